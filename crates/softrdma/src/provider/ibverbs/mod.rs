//! The hardware provider: rdma-core's libibverbs, loaded at run time, for
//! RDMA NICs and the kernel's own rxe. The NIC (or kernel) is the
//! transport: this module only turns softrdma's verbs into libibverbs
//! calls and back. RoCE ports (their GIDs are IPv4 addresses, as
//! softrdma's connection helpers name peers) and iWARP devices, whose QPs
//! connect through rdma_cm (`rdmacm`, librdmacm); InfiniBand ports need
//! LIDs, which this provider does not do yet.
//!
//! Every `unsafe` block of the provider is here, in `ffi` or in `rdmacm`:
//! each calls into libibverbs or librdmacm on objects this provider created
//! and keeps alive.

mod ffi;
pub(crate) mod rdmacm;

use std::collections::HashMap;
use std::ffi::{CStr, c_int, c_uint, c_void};
use std::mem::MaybeUninit;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use ffi::*;
use smallvec::SmallVec;

use crate::engine::qp::{Mtu, QpAttr, QpState, QpType};
use crate::engine::rc::QpCaps;
use crate::engine::{PostError, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion};
use crate::memory::Access;
use crate::verbs::AsyncEvent;
use crate::verbs::CqError;
use crate::verbs::events::EventQueue;

/// The port every context uses.
const PORT: u8 = 1;

static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();

fn lib() -> Result<&'static Lib, String> {
    LIB.get_or_init(Lib::load).as_ref().map_err(Clone::clone)
}

/// An error of a libibverbs call that sets `errno`.
fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

/// An error of a libibverbs call that returns the errno.
fn returned_error(what: &str, rc: c_int) -> String {
    format!("{what}: {}", std::io::Error::from_raw_os_error(rc))
}

/// Why ibv_get_device_list gave no list.
fn list_error() -> String {
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENOSYS) {
        "this kernel has no RDMA subsystem (libibverbs finds no /sys/class/infiniband)".into()
    } else {
        format!("ibv_get_device_list: {e}")
    }
}

/// The names of the devices libibverbs lists (rxe0, mlx5_0, ...).
pub fn device_names() -> Result<Vec<String>, String> {
    let lib = lib()?;
    let mut n: c_int = 0;
    // SAFETY: libibverbs' own call; the list is freed below, after the names
    // are copied out.
    let list = unsafe { (lib.get_device_list)(&mut n) };
    if list.is_null() {
        return Err(list_error());
    }
    let mut names = Vec::new();
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: the list holds `n` devices; their names are C strings
        // that live as long as the list.
        let name = unsafe { CStr::from_ptr((lib.get_device_name)(*list.add(i))) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: the list from ibv_get_device_list, freed once.
    unsafe { (lib.free_device_list)(list) };
    Ok(names)
}

/// What a GID table entry is, from sysfs (as rdma-core's tools read it).
fn gid_type(dev: &str, index: usize) -> Option<String> {
    std::fs::read_to_string(format!(
        "/sys/class/infiniband/{dev}/ports/{PORT}/gid_attrs/types/{index}"
    ))
    .ok()
    .map(|s| s.trim().to_string())
}

/// The first IPv4 address of the interface whose MAC address an RNIC's
/// GID 0 holds (its first six bytes).
fn iwarp_address(gid: &[u8; 16]) -> Option<Ipv4Addr> {
    let mac: [u8; 6] = gid[..6].try_into().ok()?;
    crate::provider::netdev::interfaces()
        .ok()?
        .into_iter()
        .find(|d| d.mac == Some(mac))
        .and_then(|d| d.ipv4.first().copied())
}

/// A raw pointer that the events thread may hold: the context outlives the
/// thread (its drop joins it before closing the device).
struct ContextPtr(*mut ibv_context);
// SAFETY: libibverbs' calls on a context are thread-safe.
unsafe impl Send for ContextPtr {}

/// An open device.
pub(crate) struct HwContext {
    lib: &'static Lib,
    ctx: NonNull<ibv_context>,
    pub(crate) name: String,
    /// The GID index of the port's RoCEv2 IPv4 GID, and its address (an
    /// iWARP device: 0, and its network interface's first IPv4 address).
    pub(crate) gid_index: u8,
    pub(crate) addr: Ipv4Addr,
    /// An iWARP device (RNIC): its QPs connect through rdma_cm only.
    pub(crate) iwarp: bool,
    /// The GIDs up to that index.
    pub(crate) gids: Vec<[u8; 16]>,
    pub(crate) attr: ibv_device_attr,
    pub(crate) port_attr: ibv_port_attr,
    poll_cq: unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int,
    req_notify_cq: unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int,
    post_send: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int,
    post_recv: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int,
    post_srq_recv: Option<
        unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int,
    >,
    /// Busy-poll mode: CQ waits spin instead of sleeping on the channel.
    pub(crate) busy_poll: AtomicBool,
    /// Wakes the events thread to end it.
    stop: OwnedFd,
    events_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

// SAFETY: libibverbs objects may be used from any thread (the verbs are
// thread-safe); the struct's other fields are plain data.
unsafe impl Send for HwContext {}
// SAFETY: as above.
unsafe impl Sync for HwContext {}

impl std::fmt::Debug for HwContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HwContext")
            .field("name", &self.name)
            .field("addr", &self.addr)
            .field("gid_index", &self.gid_index)
            .finish()
    }
}

impl HwContext {
    /// Opens device `name`; its asynchronous events go to `events`.
    pub(crate) fn open(
        name: &str,
        busy_poll: bool,
        events: Arc<EventQueue>,
    ) -> Result<Arc<HwContext>, String> {
        // ffi.rs's layouts (pthread sizes, the send request's packing) are
        // x86-64's.
        if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
            return Err(
                "the ibverbs provider's ABI tables are written for x86-64 Linux so far".into(),
            );
        }
        let lib = lib()?;
        let mut n: c_int = 0;
        // SAFETY: as in `device_names`.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(format!("no RDMA device {name}: {}", list_error()));
        }
        let mut found = None;
        let mut names = Vec::new();
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: as in `device_names`.
            let (dev, this) = unsafe {
                let dev = *list.add(i);
                (
                    dev,
                    CStr::from_ptr((lib.get_device_name)(dev))
                        .to_string_lossy()
                        .into_owned(),
                )
            };
            if this == name {
                found = Some(dev);
            }
            names.push(this);
        }
        let ctx = found.map(|dev| {
            // SAFETY: a device of the list, which is still held.
            unsafe { (lib.open_device)(dev) }
        });
        let open_error = os_error("ibv_open_device");
        // SAFETY: the list, freed once; an opened context does not need it.
        unsafe { (lib.free_device_list)(list) };
        let ctx = match ctx {
            None => {
                return Err(if names.is_empty() {
                    format!("no RDMA device {name}: libibverbs lists none on this host")
                } else {
                    format!(
                        "no RDMA device {name} (libibverbs lists: {})",
                        names.join(", ")
                    )
                });
            }
            Some(p) => NonNull::new(p).ok_or_else(|| format!("{name}: {open_error}"))?,
        };
        // SAFETY: an open context; its ops are set by the provider at open
        // and never change.
        let ops = unsafe { &(*ctx.as_ptr()).ops };
        let close = |e: String| {
            // SAFETY: the context opened above, closed once on this error path.
            unsafe { (lib.close_device)(ctx.as_ptr()) };
            Err(format!("{name}: {e}"))
        };
        let (Some(poll_cq), Some(req_notify_cq), Some(post_send), Some(post_recv)) =
            (ops.poll_cq, ops.req_notify_cq, ops.post_send, ops.post_recv)
        else {
            return close("its provider lacks the data-path calls".into());
        };
        let post_srq_recv = ops.post_srq_recv;
        // SAFETY: plain-data out-parameters of the size verbs.h gives.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: an open context and an attribute struct to fill.
        let rc = unsafe { (lib.query_device)(ctx.as_ptr(), &mut attr) };
        if rc != 0 {
            return close(returned_error("ibv_query_device", rc));
        }
        let mut port_attr = ibv_port_attr::default();
        // SAFETY: as above; the port struct is at least the library's
        // compat size.
        let rc = unsafe { (lib.query_port)(ctx.as_ptr(), PORT, &mut port_attr) };
        if rc != 0 {
            return close(returned_error("ibv_query_port", rc));
        }
        // An iWARP device's port says Ethernet too: its node type tells.
        let node_type = std::fs::read_to_string(format!("/sys/class/infiniband/{name}/node_type"))
            .unwrap_or_default();
        let iwarp = node_type.trim_start().starts_with("4:");
        if !iwarp && port_attr.link_layer != IBV_LINK_LAYER_ETHERNET {
            return close(
                "its port 1 is InfiniBand, not RoCE: the ibverbs provider speaks RoCE and \
                 iWARP only so far (InfiniBand needs LIDs)"
                    .into(),
            );
        }
        let mut gids = Vec::new();
        let mut ipv4 = None;
        for i in 0..port_attr.gid_tbl_len.clamp(0, 256) {
            let mut gid = [0u8; 16];
            // SAFETY: an open context and a 16-byte GID to fill.
            if unsafe { (lib.query_gid)(ctx.as_ptr(), PORT, i, &mut gid) } != 0 {
                break;
            }
            gids.push(gid);
            if iwarp {
                // An RNIC's GID 0 is its interface's MAC, zero-padded (siw).
                ipv4 = iwarp_address(&gid).map(|a| (0, a));
                break;
            }
            let v4 = gid[..10].iter().all(|&b| b == 0) && gid[10..12] == [0xff, 0xff];
            if v4 && gid_type(name, i as usize).as_deref() == Some("RoCE v2") {
                ipv4 = Some((i as u8, Ipv4Addr::new(gid[12], gid[13], gid[14], gid[15])));
                break;
            }
        }
        let Some((gid_index, addr)) = ipv4 else {
            return close(if iwarp {
                "it is an iWARP device whose network interface (the one with the MAC address \
                 of its GID 0) has no IPv4 address, or is down"
                    .into()
            } else {
                "its port has no RoCEv2 GID of an IPv4 address (is its network interface \
                 up, with an IPv4 address?)"
                    .into()
            });
        };
        let stop = match rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        ) {
            Ok(fd) => fd,
            Err(e) => return close(format!("eventfd: {e}")),
        };
        let hw = Arc::new(HwContext {
            lib,
            ctx,
            name: name.to_string(),
            gid_index,
            addr,
            iwarp,
            gids,
            attr,
            port_attr,
            poll_cq,
            req_notify_cq,
            post_send,
            post_recv,
            post_srq_recv,
            busy_poll: AtomicBool::new(busy_poll),
            stop,
            events_thread: Mutex::new(None),
        });
        // SAFETY: the context's async fd, which lives until close_device.
        let async_fd = unsafe { BorrowedFd::borrow_raw((*ctx.as_ptr()).async_fd) };
        set_nonblocking(async_fd).map_err(|e| format!("{name}: async fd: {e}"))?;
        let stop = hw.stop.try_clone().map_err(|e| format!("{name}: {e}"))?;
        let ptr = ContextPtr(ctx.as_ptr());
        let thread = std::thread::Builder::new()
            .name(format!("softrdma-{name}-events"))
            .spawn(move || forward_events(lib, ptr, stop, &events))
            .map_err(|e| format!("{name}: cannot start its events thread: {e}"))?;
        *hw.events_thread.lock().expect("events thread lock") = Some(thread);
        Ok(hw)
    }

    fn ptr(&self) -> *mut ibv_context {
        self.ctx.as_ptr()
    }

    /// The device's attributes, as softrdma reports them.
    pub(crate) fn device_attr(&self) -> crate::verbs::DeviceAttr {
        let a = &self.attr;
        let n = |v: c_int| u32::try_from(v).unwrap_or(0);
        let fw: Vec<u8> = a
            .fw_ver
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        crate::verbs::DeviceAttr {
            fw_ver: String::from_utf8_lossy(&fw).into_owned(),
            max_qp: n(a.max_qp),
            max_qp_wr: n(a.max_qp_wr),
            max_send_sge: n(a.max_sge),
            max_recv_sge: n(a.max_sge),
            // libibverbs does not report it: a QP asks at create time.
            max_inline_data: 0,
            max_cqe: n(a.max_cqe),
            max_qp_rd_atom: n(a.max_qp_rd_atom),
            max_qp_init_rd_atom: n(a.max_qp_init_rd_atom),
            atomic_cap: match a.atomic_cap {
                0 => crate::verbs::AtomicCap::None,
                1 => crate::verbs::AtomicCap::Hca,
                _ => crate::verbs::AtomicCap::Glob,
            },
            max_srq_wr: n(a.max_srq_wr),
            max_srq_sge: n(a.max_srq_sge),
            ud: true,
            max_msg_sz: u64::from(self.port_attr.max_msg_sz),
            max_mr_size: a.max_mr_size,
        }
    }

    /// The port now (as at open if the query fails): whether it is
    /// active, its largest and its active MTU.
    pub(crate) fn port_now(&self) -> (bool, Mtu, Mtu) {
        let mut port = ibv_port_attr::default();
        // SAFETY: an open context and a port struct of at least the
        // library's compat size.
        if unsafe { (self.lib.query_port)(self.ptr(), PORT, &mut port) } != 0 {
            port = self.port_attr;
        }
        let mtu = |code: c_uint| Mtu::from_code(code as u8).unwrap_or(Mtu::Mtu1024);
        (
            port.state == IBV_PORT_ACTIVE,
            mtu(port.max_mtu),
            mtu(port.active_mtu),
        )
    }

    /// The port's active MTU.
    pub(crate) fn active_mtu(&self) -> Mtu {
        Mtu::from_code(self.port_attr.active_mtu as u8).unwrap_or(Mtu::Mtu1024)
    }
}

impl Drop for HwContext {
    fn drop(&mut self) {
        let _ = rustix::io::write(&self.stop, &1u64.to_ne_bytes());
        if let Some(t) = self
            .events_thread
            .lock()
            .expect("events thread lock")
            .take()
        {
            let _ = t.join();
        }
        // SAFETY: every object of the context holds an Arc of it, so none is
        // left; the events thread has ended.
        unsafe { (self.lib.close_device)(self.ptr()) };
    }
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> rustix::io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(fd)?;
    rustix::fs::fcntl_setfl(fd, flags | rustix::fs::OFlags::NONBLOCK)
}

/// The events thread: libibverbs' asynchronous events into the context's
/// event queue, until `stop` fires.
fn forward_events(lib: &'static Lib, ctx: ContextPtr, stop: OwnedFd, events: &EventQueue) {
    let ctx = ctx.0;
    let mut fatal_told = false;
    // SAFETY: the context outlives this thread (see ContextPtr).
    let async_fd = unsafe { BorrowedFd::borrow_raw((*ctx).async_fd) };
    loop {
        let mut fds = [
            rustix::event::PollFd::new(&async_fd, rustix::event::PollFlags::IN),
            rustix::event::PollFd::new(&stop, rustix::event::PollFlags::IN),
        ];
        match rustix::event::poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return,
        }
        if !fds[1].revents().is_empty() {
            return;
        }
        // A device taken away (a NIC reset, its driver unbound) leaves the
        // fd in error for good: say so once, and stop watching it.
        if fds[0]
            .revents()
            .intersects(rustix::event::PollFlags::ERR | rustix::event::PollFlags::HUP)
        {
            if !fatal_told {
                events.push(AsyncEvent::DeviceFatal);
            }
            return;
        }
        loop {
            let mut ev = ibv_async_event {
                element: std::ptr::null_mut(),
                event_type: 0,
            };
            // SAFETY: an open context whose async fd is non-blocking.
            if unsafe { (lib.get_async_event)(ctx, &mut ev) } != 0 {
                break;
            }
            if let Some(e) = translate_event(&ev) {
                fatal_told |= e == AsyncEvent::DeviceFatal;
                events.push(e);
            }
            // SAFETY: the event just taken, acknowledged once.
            unsafe { (lib.ack_async_event)(&mut ev) };
        }
    }
}

fn translate_event(ev: &ibv_async_event) -> Option<AsyncEvent> {
    let qpn = || {
        // SAFETY: for QP events the element is the QP, alive until the
        // event is acknowledged (ibv_destroy_qp waits for that).
        unsafe { (*ev.element.cast::<ibv_qp>()).qp_num }
    };
    Some(match ev.event_type {
        IBV_EVENT_QP_FATAL | IBV_EVENT_QP_REQ_ERR | IBV_EVENT_QP_ACCESS_ERR => {
            AsyncEvent::QpFatal { qpn: qpn() }
        }
        IBV_EVENT_COMM_EST => AsyncEvent::CommEstablished { qpn: qpn() },
        IBV_EVENT_SQ_DRAINED => AsyncEvent::SqDrained { qpn: qpn() },
        IBV_EVENT_QP_LAST_WQE_REACHED => AsyncEvent::QpLastWqeReached { qpn: qpn() },
        IBV_EVENT_CQ_ERR => {
            // SAFETY: for a CQ event the element is the CQ, alive until the
            // event is acknowledged; its context pointer holds softrdma's
            // CQ number.
            let id = unsafe { (*ev.element.cast::<ibv_cq>()).cq_context };
            AsyncEvent::CqError { cq: id as u64 }
        }
        IBV_EVENT_SRQ_LIMIT_REACHED => {
            // SAFETY: as for the CQ, with the SRQ's number.
            let id = unsafe { (*ev.element.cast::<ibv_srq>()).srq_context };
            AsyncEvent::SrqLimitReached { srq: id as u64 }
        }
        IBV_EVENT_PORT_ACTIVE => AsyncEvent::PortActive,
        IBV_EVENT_PORT_ERR => AsyncEvent::PortDown,
        IBV_EVENT_DEVICE_FATAL => AsyncEvent::DeviceFatal,
        _ => return None,
    })
}

/// A protection domain.
#[derive(Debug)]
pub(crate) struct HwPd {
    ctx: Arc<HwContext>,
    pd: NonNull<ibv_pd>,
}

// SAFETY: see HwContext.
unsafe impl Send for HwPd {}
// SAFETY: see HwContext.
unsafe impl Sync for HwPd {}

impl HwPd {
    pub(crate) fn new(ctx: &Arc<HwContext>) -> Result<Arc<HwPd>, String> {
        // SAFETY: an open context.
        let pd = unsafe { (ctx.lib.alloc_pd)(ctx.ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| os_error("ibv_alloc_pd"))?;
        Ok(Arc::new(HwPd {
            ctx: ctx.clone(),
            pd,
        }))
    }
}

impl Drop for HwPd {
    fn drop(&mut self) {
        // SAFETY: every MR, QP, SRQ and AH of the PD holds an Arc of it.
        unsafe { (self.ctx.lib.dealloc_pd)(self.pd.as_ptr()) };
    }
}

/// A memory region registered with the device.
#[derive(Debug)]
pub(crate) struct HwMr {
    pd: Arc<HwPd>,
    mr: NonNull<ibv_mr>,
    /// The memory: kept for good if deregistering fails, since the device
    /// may still reach it.
    memory: Arc<crate::memory::RegionMemory>,
}

// SAFETY: see HwContext.
unsafe impl Send for HwMr {}
// SAFETY: see HwContext.
unsafe impl Sync for HwMr {}

impl HwMr {
    /// Registers `memory`, which the device reads and writes, as `access`
    /// allows, until the `HwMr` is dropped (it holds the memory until then).
    pub(crate) fn register(
        pd: &Arc<HwPd>,
        memory: &Arc<crate::memory::RegionMemory>,
        access: Access,
    ) -> Result<HwMr, String> {
        let addr = memory.addr() as *mut c_void;
        // SAFETY: the memory is allocated for its length and held by the
        // HwMr until deregistered; the PD is alive.
        let mr = unsafe {
            (pd.ctx.lib.reg_mr)(pd.pd.as_ptr(), addr, memory.len(), access.bits() as c_int)
        };
        let mr = NonNull::new(mr).ok_or_else(|| os_error("ibv_reg_mr"))?;
        Ok(HwMr {
            pd: pd.clone(),
            mr,
            memory: memory.clone(),
        })
    }

    pub(crate) fn keys(&self) -> (u32, u32) {
        // SAFETY: a registered MR; its keys are set at registration.
        unsafe { ((*self.mr.as_ptr()).lkey, (*self.mr.as_ptr()).rkey) }
    }
}

impl Drop for HwMr {
    fn drop(&mut self) {
        // SAFETY: registered above, deregistered once; after this the
        // device no longer touches the memory.
        if unsafe { (self.pd.ctx.lib.dereg_mr)(self.mr.as_ptr()) } != 0 {
            // Still registered: the device may write it, so it is never
            // freed (a leak, not a use after free).
            std::mem::forget(self.memory.clone());
        }
    }
}

/// An address handle.
#[derive(Debug)]
pub(crate) struct HwAh {
    pd: Arc<HwPd>,
    ah: NonNull<ibv_ah>,
}

// SAFETY: see HwContext.
unsafe impl Send for HwAh {}
// SAFETY: see HwContext.
unsafe impl Sync for HwAh {}

/// The address attributes that reach `ip` from the context's IPv4 GID.
fn ah_attr(ctx: &HwContext, ip: Ipv4Addr) -> ibv_ah_attr {
    ah_attr_for(ctx.gid_index, ip)
}

/// The address attributes that reach `ip` from GID `sgid_index`.
fn ah_attr_for(sgid_index: u8, ip: Ipv4Addr) -> ibv_ah_attr {
    let mut dgid = [0u8; 16];
    dgid[10] = 0xff;
    dgid[11] = 0xff;
    dgid[12..].copy_from_slice(&ip.octets());
    ibv_ah_attr {
        grh: ibv_global_route {
            dgid,
            flow_label: 0,
            sgid_index,
            hop_limit: 64,
            traffic_class: 0,
        },
        is_global: 1,
        port_num: PORT,
        ..ibv_ah_attr::default()
    }
}

impl HwAh {
    pub(crate) fn new(pd: &Arc<HwPd>, ip: Ipv4Addr) -> Result<HwAh, String> {
        let mut attr = ah_attr(&pd.ctx, ip);
        // SAFETY: a live PD and an attribute struct the call only reads.
        let ah = unsafe { (pd.ctx.lib.create_ah)(pd.pd.as_ptr(), &mut attr) };
        let ah = NonNull::new(ah).ok_or_else(|| os_error("ibv_create_ah"))?;
        Ok(HwAh { pd: pd.clone(), ah })
    }
}

impl Drop for HwAh {
    fn drop(&mut self) {
        // SAFETY: created above, destroyed once.
        unsafe { (self.pd.ctx.lib.destroy_ah)(self.ah.as_ptr()) };
    }
}

/// A completion queue with its own completion channel.
#[derive(Debug)]
pub(crate) struct HwCq {
    ctx: Arc<HwContext>,
    channel: NonNull<ibv_comp_channel>,
    cq: NonNull<ibv_cq>,
    capacity: usize,
    /// Threads in `wait_for`.
    waiters: AtomicUsize,
}

// SAFETY: see HwContext; ibv_poll_cq and ibv_req_notify_cq may be called
// from several threads (the providers lock their CQs).
unsafe impl Send for HwCq {}
// SAFETY: as above.
unsafe impl Sync for HwCq {}

impl HwCq {
    /// A CQ of `capacity` completions; `id` names it in events.
    pub(crate) fn new(ctx: &Arc<HwContext>, capacity: usize, id: u64) -> Result<HwCq, String> {
        let lib = ctx.lib;
        // SAFETY: an open context.
        let channel = unsafe { (lib.create_comp_channel)(ctx.ptr()) };
        let channel = NonNull::new(channel).ok_or_else(|| os_error("ibv_create_comp_channel"))?;
        let destroy_channel = || {
            // SAFETY: created above, with no CQ on it.
            unsafe { (lib.destroy_comp_channel)(channel.as_ptr()) };
        };
        // SAFETY: the channel's fd, alive with the channel.
        let fd = unsafe { BorrowedFd::borrow_raw((*channel.as_ptr()).fd) };
        if let Err(e) = set_nonblocking(fd) {
            destroy_channel();
            return Err(format!("completion channel: {e}"));
        }
        let cqe = c_int::try_from(capacity).unwrap_or(c_int::MAX);
        // SAFETY: an open context and its channel; the CQ's context pointer
        // carries its number, never dereferenced.
        let cq = unsafe { (lib.create_cq)(ctx.ptr(), cqe, id as *mut c_void, channel.as_ptr(), 0) };
        let Some(cq) = NonNull::new(cq) else {
            let e = os_error("ibv_create_cq");
            destroy_channel();
            return Err(e);
        };
        Ok(HwCq {
            ctx: ctx.clone(),
            channel,
            cq,
            capacity,
            waiters: AtomicUsize::new(0),
        })
    }

    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel's fd, alive with the channel, which lives as
        // long as self.
        unsafe { BorrowedFd::borrow_raw((*self.channel.as_ptr()).fd) }
    }

    /// Polls up to `out.len()` completions.
    pub(crate) fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, CqError> {
        let mut got = 0;
        while got < out.len() {
            // Left uninitialised: the device writes the ones it returns, and
            // a busy poll should not clear 768 bytes per look.
            let mut wcs = [const { MaybeUninit::<ibv_wc>::uninit() }; 16];
            let want = (out.len() - got).min(wcs.len());
            // SAFETY: a live CQ and room for `want` completions.
            let n = unsafe {
                (self.ctx.poll_cq)(self.cq.as_ptr(), want as c_int, wcs.as_mut_ptr().cast())
            };
            if n < 0 {
                // The device's failure (an overrun comes as an async event).
                return if got > 0 {
                    Ok(got)
                } else {
                    Err(CqError::Device(n))
                };
            }
            let n = (n as usize).min(want);
            for (slot, wc) in out[got..].iter_mut().zip(&wcs[..n]) {
                // SAFETY: poll_cq filled the first n entries.
                *slot = completion(unsafe { wc.assume_init_ref() });
            }
            got += n;
            if n < want {
                break;
            }
        }
        Ok(got)
    }

    pub(crate) fn poll_one(&self) -> Result<Option<WorkCompletion>, CqError> {
        let mut one = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0)];
        Ok((self.poll(&mut one)? == 1).then_some(one[0]))
    }

    /// Asks for an event at the next (solicited) completion.
    pub(crate) fn req_notify(&self, solicited_only: bool) {
        // SAFETY: a live CQ.
        unsafe { (self.ctx.req_notify_cq)(self.cq.as_ptr(), c_int::from(solicited_only)) };
    }

    /// Takes one event from the channel, if one is there.
    fn take_event(&self) -> bool {
        let mut cq = std::ptr::null_mut();
        let mut cq_context = std::ptr::null_mut();
        // SAFETY: the channel, non-blocking; the event is acknowledged at
        // once, so destroy_cq never waits for it.
        unsafe {
            if (self.ctx.lib.get_cq_event)(self.channel.as_ptr(), &mut cq, &mut cq_context) != 0 {
                return false;
            }
            (self.ctx.lib.ack_cq_events)(cq, 1);
        }
        true
    }

    pub(crate) fn take_events(&self) -> u64 {
        let mut n = 0;
        while self.take_event() {
            n += 1;
        }
        n
    }

    /// Sleeps on the channel until it is readable or `left` has passed.
    /// Err when the device is gone (the channel reports an error).
    fn sleep_on_channel(&self, left: Duration) -> Result<(), CqError> {
        let fd = self.fd();
        let mut fds = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        let ts = i64::try_from(left.as_secs())
            .ok()
            .map(|_| crate::provider::timespec(left));
        match rustix::event::poll(&mut fds, ts.as_ref()) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(_) => return Err(CqError::Device(0)),
        }
        let gone = rustix::event::PollFlags::ERR | rustix::event::PollFlags::HUP;
        if fds[0].revents().intersects(gone) {
            return Err(CqError::Device(0));
        }
        Ok(())
    }

    /// Waits up to `timeout` for the channel to fire; takes its event.
    pub(crate) fn wait_event(&self, timeout: Duration) -> bool {
        let deadline = crate::verbs::deadline_after(timeout);
        loop {
            if self.take_event() {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.sleep_on_channel(left).is_err() {
                return false;
            }
        }
    }

    /// Up to `n` completions, waiting until `deadline` for the first ones.
    pub(crate) fn wait_for(
        &self,
        n: usize,
        deadline: Instant,
    ) -> Result<Vec<WorkCompletion>, CqError> {
        let mut got = Vec::with_capacity(n.min(self.capacity));
        let mut buf = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 16];
        let busy = self.ctx.busy_poll.load(Ordering::Relaxed);
        let _waiting = Waiting::new(&self.waiters);
        let mut armed = false;
        loop {
            let want = (n - got.len()).min(buf.len());
            let k = match self.poll(&mut buf[..want]) {
                Ok(k) => k,
                Err(e) if got.is_empty() => return Err(e),
                Err(_) => return Ok(got),
            };
            got.extend_from_slice(&buf[..k]);
            if got.len() >= n {
                return Ok(got);
            }
            if k > 0 {
                armed = false;
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(got);
            }
            if busy {
                std::hint::spin_loop();
                continue;
            }
            if !armed {
                // Armed, then polled again: one that came between the
                // poll and the arming is found by that poll.
                self.req_notify(false);
                armed = true;
                continue;
            }
            // The channel fires once per arming, and whichever thread takes
            // the event first wins it: another waiter (or a `wait_event`, an
            // `AsyncCq` on a clone) may take it, and its completion, and
            // leave this one asleep on a CQ no one re-armed. So sleep in
            // slices and look again: short ones with company, and bounded
            // ones alone (company may come while this one sleeps).
            let slice = if self.waiters.load(Ordering::Relaxed) > 1 {
                left.min(SHARED_WAIT_SLICE)
            } else {
                left.min(LONE_WAIT_SLICE)
            };
            match self.sleep_on_channel(slice) {
                Ok(()) => {}
                Err(e) if got.is_empty() => return Err(e),
                Err(_) => return Ok(got),
            }
            self.take_events();
            armed = false;
        }
    }
}

/// How long a CQ waiter sleeps at a time while others wait on the same CQ.
const SHARED_WAIT_SLICE: Duration = Duration::from_millis(20);
/// How long a lone CQ waiter sleeps at a time: the most a completion
/// another thread's take of the event hid can wait to be seen.
const LONE_WAIT_SLICE: Duration = Duration::from_millis(200);

/// Counts a waiter of a CQ while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Waiting<'a> {
        count.fetch_add(1, Ordering::Relaxed);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for HwCq {
    fn drop(&mut self) {
        let _ = self.take_events();
        // SAFETY: every QP on the CQ holds an Arc of it; its events are
        // acknowledged; the channel goes after the CQ.
        unsafe {
            (self.ctx.lib.destroy_cq)(self.cq.as_ptr());
            (self.ctx.lib.destroy_comp_channel)(self.channel.as_ptr());
        }
    }
}

/// softrdma's completion of a libibverbs one.
fn completion(wc: &ibv_wc) -> WorkCompletion {
    let opcode = match wc.opcode {
        IBV_WC_SEND => WcOpcode::Send,
        IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
        IBV_WC_COMP_SWAP => WcOpcode::CompareSwap,
        IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
        IBV_WC_LOCAL_INV => WcOpcode::LocalInv,
        IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        // Receives; and an error's opcode, which libibverbs leaves undefined.
        _ => WcOpcode::Recv,
    };
    let mut out = WorkCompletion::new(wc.wr_id, WcStatus::from_code(wc.status), opcode, wc.qp_num);
    out.byte_len = wc.byte_len;
    out.src_qp = wc.src_qp;
    out.grh = wc.wc_flags & IBV_WC_GRH != 0;
    if wc.wc_flags & IBV_WC_WITH_IMM != 0 {
        // Network order in memory, as the wire carries it.
        out.imm = Some(u32::from_be(wc.imm_or_rkey));
    }
    if wc.wc_flags & IBV_WC_WITH_INV != 0 {
        out.invalidated_rkey = Some(wc.imm_or_rkey);
    }
    out
}

/// A shared receive queue.
#[derive(Debug)]
pub(crate) struct HwSrq {
    pd: Arc<HwPd>,
    srq: NonNull<ibv_srq>,
    pub(crate) max_wr: u32,
    max_sge: u32,
}

// SAFETY: see HwContext.
unsafe impl Send for HwSrq {}
// SAFETY: see HwContext.
unsafe impl Sync for HwSrq {}

impl HwSrq {
    pub(crate) fn new(pd: &Arc<HwPd>, max_wr: u32, max_sge: u32, id: u64) -> Result<HwSrq, String> {
        if pd.ctx.post_srq_recv.is_none() {
            return Err(format!("{} has no shared receive queues", pd.ctx.name));
        }
        let mut init = ibv_srq_init_attr {
            srq_context: id as *mut c_void,
            attr: ibv_srq_attr {
                max_wr,
                max_sge,
                srq_limit: 0,
            },
        };
        // SAFETY: a live PD and an attribute struct; the context pointer
        // carries the SRQ's number, never dereferenced.
        let srq = unsafe { (pd.ctx.lib.create_srq)(pd.pd.as_ptr(), &mut init) };
        let srq = NonNull::new(srq).ok_or_else(|| os_error("ibv_create_srq"))?;
        Ok(HwSrq {
            pd: pd.clone(),
            srq,
            max_wr: init.attr.max_wr,
            max_sge,
        })
    }

    pub(crate) fn post_recv(&self, wr: &RecvWr) -> Result<(), PostError> {
        if wr.sgl.len() > self.max_sge as usize {
            return Err(PostError::TooManySges {
                given: wr.sgl.len(),
                max: self.max_sge,
            });
        }
        let post = self.pd.ctx.post_srq_recv.expect("checked at creation");
        with_recv_wr(wr, |w, bad| {
            // SAFETY: a live SRQ and a request whose SGEs live for the call.
            unsafe { post(self.srq.as_ptr(), w, bad) }
        })
        .map_err(|rc| posted_error(rc, self.max_wr))
    }

    pub(crate) fn arm_limit(&self, limit: u32) -> Result<(), String> {
        let mut attr = ibv_srq_attr {
            srq_limit: limit,
            ..ibv_srq_attr::default()
        };
        // SAFETY: a live SRQ.
        let rc =
            unsafe { (self.pd.ctx.lib.modify_srq)(self.srq.as_ptr(), &mut attr, IBV_SRQ_LIMIT) };
        if rc != 0 {
            return Err(returned_error("ibv_modify_srq", rc));
        }
        Ok(())
    }
}

impl Drop for HwSrq {
    fn drop(&mut self) {
        // SAFETY: every QP on it holds an Arc of it.
        unsafe { (self.pd.ctx.lib.destroy_srq)(self.srq.as_ptr()) };
    }
}

/// Calls `post` with `wr` as a libibverbs receive request.
fn with_recv_wr(
    wr: &RecvWr,
    post: impl FnOnce(*mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int,
) -> Result<(), c_int> {
    let mut sges: SmallVec<[ibv_sge; 4]> = wr.sgl.iter().map(sge).collect();
    let mut w = ibv_recv_wr {
        wr_id: wr.wr_id,
        next: std::ptr::null_mut(),
        sg_list: sges.as_mut_ptr(),
        num_sge: sges.len() as c_int,
    };
    let mut bad = std::ptr::null_mut();
    match post(&mut w, &mut bad) {
        0 => Ok(()),
        rc => Err(rc),
    }
}

fn sge(s: &crate::engine::Sge) -> ibv_sge {
    ibv_sge {
        addr: s.addr,
        length: s.len,
        lkey: s.lkey,
    }
}

/// A post the device refused: a full queue, or its errno (rxe's provider
/// returns it negated, mlx5's as is).
fn posted_error(rc: c_int, depth: u32) -> PostError {
    let errno = rc.saturating_abs();
    if errno == libc::ENOMEM {
        PostError::QueueFull(depth)
    } else {
        PostError::Device(errno)
    }
}

/// The libibverbs request for `wr`, its SGEs in `sges` (which must outlive
/// the post). A UD send's destination is set apart ([`ud_destination`]).
fn send_request(wr: &SendWr, sges: &mut SmallVec<[ibv_sge; 4]>) -> ibv_send_wr {
    *sges = if wr.flags.inline {
        // The provider copies the bytes during the call.
        [ibv_sge {
            addr: wr.inline_data.as_ptr() as u64,
            length: wr.inline_data.len() as u32,
            lkey: 0,
        }]
        .into_iter()
        .collect()
    } else {
        wr.sgl.iter().map(sge).collect()
    };
    let mut w = ibv_send_wr::zeroed();
    w.wr_id = wr.wr_id;
    w.sg_list = sges.as_mut_ptr();
    w.num_sge = sges.len() as c_int;
    let f = wr.flags;
    w.send_flags = [
        (f.signaled, IBV_SEND_SIGNALED),
        (f.fence, IBV_SEND_FENCE),
        (f.solicited, IBV_SEND_SOLICITED),
        (f.inline, IBV_SEND_INLINE),
    ]
    .iter()
    .filter(|(on, _)| *on)
    .fold(0, |acc, (_, bit)| acc | bit);
    let rdma = |w: &mut ibv_send_wr, addr: u64, rkey: u32| {
        w.wr.w0 = addr;
        w.wr.w1 = u64::from(rkey);
    };
    match wr.op {
        SendOp::Send => w.opcode = IBV_WR_SEND,
        SendOp::SendWithImm(imm) => {
            w.opcode = IBV_WR_SEND_WITH_IMM;
            w.imm_or_rkey = imm.to_be();
        }
        SendOp::SendWithInv(rkey) => {
            w.opcode = IBV_WR_SEND_WITH_INV;
            w.imm_or_rkey = rkey;
        }
        SendOp::LocalInv(rkey) => {
            w.opcode = IBV_WR_LOCAL_INV;
            w.imm_or_rkey = rkey;
        }
        SendOp::Write { remote_addr, rkey } => {
            w.opcode = IBV_WR_RDMA_WRITE;
            rdma(&mut w, remote_addr, rkey);
        }
        SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => {
            w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
            w.imm_or_rkey = imm.to_be();
            rdma(&mut w, remote_addr, rkey);
        }
        SendOp::Read { remote_addr, rkey } => {
            w.opcode = IBV_WR_RDMA_READ;
            rdma(&mut w, remote_addr, rkey);
        }
        SendOp::CompareSwap {
            remote_addr,
            rkey,
            compare,
            swap,
        } => {
            w.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
            w.wr = ibv_wr_union {
                w0: remote_addr,
                w1: compare,
                w2: swap,
                w3: rkey,
            };
        }
        SendOp::FetchAdd {
            remote_addr,
            rkey,
            add,
        } => {
            w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
            w.wr = ibv_wr_union {
                w0: remote_addr,
                w1: add,
                w2: 0,
                w3: rkey,
            };
        }
    }
    w
}

/// A UD send's address handle, remote QPN and Q_Key (`wr.ud`).
fn ud_destination(w: &mut ibv_send_wr, ah: *mut ibv_ah, qpn: u32, qkey: u32) {
    w.wr.w0 = ah as u64;
    w.wr.w1 = u64::from(qpn) | (u64::from(qkey) << 32);
}

/// The address handles of a device, by softrdma's number.
pub(crate) type AhTable = RwLock<HashMap<u64, Arc<HwAh>>>;

/// A queue pair.
#[derive(Debug)]
pub(crate) struct HwQp {
    pd: Arc<HwPd>,
    qp: NonNull<ibv_qp>,
    pub(crate) qpn: u32,
    qp_type: QpType,
    caps: QpCaps,
    /// Held so that they outlive the QP.
    _cqs: (Arc<HwCq>, Arc<HwCq>),
    srq: Option<Arc<HwSrq>>,
    /// The device's address handles (UD sends).
    ahs: Arc<AhTable>,
    /// Serialises modifies, so a check against the current state holds.
    modify_lock: Mutex<()>,
    /// The AHs of the last `max_send_wr` UD sends: the device may read an
    /// AH until the send is done, and a send is done once that many more
    /// have been posted (they took its queue slot), so an `Ah` dropped
    /// meanwhile is destroyed only then. Held across the post, so that the
    /// ring's order is the queue's.
    ud_ahs: Mutex<std::collections::VecDeque<Arc<HwAh>>>,
    /// Its rdma_cm connection, if it made one: ended before the QP goes.
    cm: Mutex<Option<rdmacm::CmConnection>>,
    /// An RNIC's QP state as this side last set or learnt it: siw's
    /// `ibv_query_qp` reports none (its state field stays RESET).
    rnic_state: Mutex<QpState>,
}

// SAFETY: see HwContext; posts on one QP from several threads are
// serialised by the provider.
unsafe impl Send for HwQp {}
// SAFETY: as above.
unsafe impl Sync for HwQp {}

fn qp_state_code(s: QpState) -> u32 {
    match s {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        QpState::Sqd => 4,
        QpState::Sqe => 5,
        QpState::Err => 6,
    }
}

fn qp_state(code: u32) -> QpState {
    match code {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqd,
        5 => QpState::Sqe,
        _ => QpState::Err,
    }
}

impl HwQp {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        pd: &Arc<HwPd>,
        qp_type: QpType,
        caps: QpCaps,
        send_cq: &Arc<HwCq>,
        recv_cq: &Arc<HwCq>,
        srq: Option<&Arc<HwSrq>>,
        ahs: &Arc<AhTable>,
    ) -> Result<HwQp, String> {
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: send_cq.cq.as_ptr(),
            recv_cq: recv_cq.cq.as_ptr(),
            srq: srq.map_or(std::ptr::null_mut(), |s| s.srq.as_ptr()),
            cap: ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: if srq.is_some() { 0 } else { caps.max_recv_wr },
                max_send_sge: caps.max_send_sge,
                max_recv_sge: if srq.is_some() { 0 } else { caps.max_recv_sge },
                max_inline_data: caps.max_inline_data,
            },
            qp_type: match qp_type {
                QpType::Rc => IBV_QPT_RC,
                QpType::Ud => IBV_QPT_UD,
            },
            sq_sig_all: 0,
        };
        // SAFETY: a live PD, CQs and SRQ of its context; the attributes are
        // read and the capabilities written back.
        let qp = unsafe { (pd.ctx.lib.create_qp)(pd.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| {
            let errno = std::io::Error::last_os_error();
            let e = format!("ibv_create_qp: {errno}");
            if errno.raw_os_error() != Some(libc::EINVAL) {
                return e;
            }
            let dev = &pd.ctx.attr;
            format!(
                "{e}: the device refuses these capabilities (send_wr {}, recv_wr {}, send_sge {}, \
                 recv_sge {}, inline {}); its limits are max_qp_wr {} and max_sge {}, and its \
                 inline limit, which libibverbs does not report, may be lower (siw's header \
                 says 80 bytes)",
                caps.max_send_wr,
                caps.max_recv_wr,
                caps.max_send_sge,
                caps.max_recv_sge,
                caps.max_inline_data,
                dev.max_qp_wr,
                dev.max_sge
            )
        })?;
        // SAFETY: the QP just created.
        let qpn = unsafe { (*qp.as_ptr()).qp_num };
        Ok(HwQp {
            pd: pd.clone(),
            qp,
            qpn,
            qp_type,
            // What the device granted, which may be more than asked.
            caps: QpCaps {
                max_send_wr: init.cap.max_send_wr,
                max_recv_wr: init.cap.max_recv_wr,
                max_send_sge: init.cap.max_send_sge,
                max_recv_sge: init.cap.max_recv_sge,
                max_inline_data: init.cap.max_inline_data,
            },
            _cqs: (send_cq.clone(), recv_cq.clone()),
            srq: srq.cloned(),
            ahs: ahs.clone(),
            modify_lock: Mutex::new(()),
            ud_ahs: Mutex::default(),
            cm: Mutex::default(),
            rnic_state: Mutex::new(QpState::Reset),
        })
    }

    pub(crate) fn query(&self) -> QpAttr {
        let mut attr = ibv_qp_attr::default();
        // SAFETY: plain-data out-parameter.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let mask = IBV_QP_STATE
            | IBV_QP_ACCESS_FLAGS
            | IBV_QP_PKEY_INDEX
            | IBV_QP_PORT
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_SQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MAX_QP_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_QKEY;
        // SAFETY: a live QP and structs to fill.
        let rc =
            unsafe { (self.pd.ctx.lib.query_qp)(self.qp.as_ptr(), &mut attr, mask, &mut init) };
        if rc != 0 {
            return QpAttr {
                state: Some(QpState::Err),
                ..QpAttr::default()
            };
        }
        let rc = self.qp_type == QpType::Rc;
        let state = if self.pd.ctx.iwarp {
            *self.rnic_state.lock().expect("QP state lock")
        } else {
            qp_state(attr.qp_state)
        };
        QpAttr {
            state: Some(state),
            pkey_index: Some(attr.pkey_index),
            port: Some(attr.port_num),
            qkey: (self.qp_type == QpType::Ud).then_some(attr.qkey),
            sq_psn: Some(attr.sq_psn),
            access: rc.then_some(Access::from_bits(attr.qp_access_flags)),
            path_mtu: Mtu::from_code(attr.path_mtu as u8).filter(|_| rc),
            dest_qp: rc.then_some(attr.dest_qp_num),
            rq_psn: rc.then_some(attr.rq_psn),
            max_dest_rd_atomic: rc.then_some(attr.max_dest_rd_atomic),
            max_rd_atomic: rc.then_some(attr.max_rd_atomic),
            min_rnr_timer: rc.then_some(attr.min_rnr_timer),
            timeout: rc.then_some(attr.timeout),
            retry_cnt: rc.then_some(attr.retry_cnt),
            rnr_retry: rc.then_some(attr.rnr_retry),
            ..QpAttr::default()
        }
    }

    pub(crate) fn state(&self) -> QpState {
        self.query().state.unwrap_or(QpState::Err)
    }

    /// A state change: checked against the verbs' table first (for an
    /// error that names what is missing), then made by the device.
    pub(crate) fn modify(
        &self,
        attr: &QpAttr,
        to: Option<Ipv4Addr>,
    ) -> Result<(), crate::verbs::VerbsError> {
        use crate::verbs::VerbsError;
        let _one_at_a_time = self.modify_lock.lock().expect("modify lock");
        let mut checked = *attr;
        checked.has_av = to.is_some();
        crate::engine::qp::check_transition(self.qp_type, self.state(), &checked)?;
        let dev = &self.pd.ctx.attr;
        for (given, limit, name, field) in [
            (
                attr.max_rd_atomic,
                dev.max_qp_init_rd_atom,
                "max_rd_atomic",
                "max_qp_init_rd_atom",
            ),
            (
                attr.max_dest_rd_atomic,
                dev.max_qp_rd_atom,
                "max_dest_rd_atomic",
                "max_qp_rd_atom",
            ),
        ] {
            if let Some(n) = given
                && i32::from(n) > limit
            {
                return Err(VerbsError::Invalid(format!(
                    "{name} {n} is above {}'s limit of {limit} (query_device().{field})",
                    self.pd.ctx.name
                )));
            }
        }
        let mut a = ibv_qp_attr::default();
        let mut mask = 0;
        let mut set = |bit: c_int, present: bool| {
            if present {
                mask |= bit;
            }
        };
        if let Some(s) = attr.state {
            a.qp_state = qp_state_code(s);
        }
        set(IBV_QP_STATE, attr.state.is_some());
        if let Some(s) = attr.cur_state {
            a.cur_qp_state = qp_state_code(s);
        }
        set(IBV_QP_CUR_STATE, attr.cur_state.is_some());
        a.pkey_index = attr.pkey_index.unwrap_or(0);
        set(IBV_QP_PKEY_INDEX, attr.pkey_index.is_some());
        a.port_num = attr.port.unwrap_or(PORT);
        set(IBV_QP_PORT, attr.port.is_some());
        a.qp_access_flags = attr.access.map_or(0, Access::bits);
        set(IBV_QP_ACCESS_FLAGS, attr.access.is_some());
        a.path_mtu = attr.path_mtu.map_or(0, |m| m as u32);
        set(IBV_QP_PATH_MTU, attr.path_mtu.is_some());
        a.dest_qp_num = attr.dest_qp.unwrap_or(0);
        set(IBV_QP_DEST_QPN, attr.dest_qp.is_some());
        a.rq_psn = attr.rq_psn.unwrap_or(0);
        set(IBV_QP_RQ_PSN, attr.rq_psn.is_some());
        a.sq_psn = attr.sq_psn.unwrap_or(0);
        set(IBV_QP_SQ_PSN, attr.sq_psn.is_some());
        a.max_dest_rd_atomic = attr.max_dest_rd_atomic.unwrap_or(0);
        set(IBV_QP_MAX_DEST_RD_ATOMIC, attr.max_dest_rd_atomic.is_some());
        a.max_rd_atomic = attr.max_rd_atomic.unwrap_or(0);
        set(IBV_QP_MAX_QP_RD_ATOMIC, attr.max_rd_atomic.is_some());
        a.min_rnr_timer = attr.min_rnr_timer.unwrap_or(0);
        set(IBV_QP_MIN_RNR_TIMER, attr.min_rnr_timer.is_some());
        a.timeout = attr.timeout.unwrap_or(0);
        set(IBV_QP_TIMEOUT, attr.timeout.is_some());
        a.retry_cnt = attr.retry_cnt.unwrap_or(0);
        set(IBV_QP_RETRY_CNT, attr.retry_cnt.is_some());
        a.rnr_retry = attr.rnr_retry.unwrap_or(0);
        set(IBV_QP_RNR_RETRY, attr.rnr_retry.is_some());
        a.qkey = attr.qkey.unwrap_or(0);
        set(IBV_QP_QKEY, attr.qkey.is_some());
        if let Some(ip) = to {
            a.ah_attr = ah_attr(&self.pd.ctx, ip);
        }
        set(IBV_QP_AV, to.is_some());
        // SAFETY: a live QP and attributes the call only reads.
        let rc = unsafe { (self.pd.ctx.lib.modify_qp)(self.qp.as_ptr(), &mut a, mask) };
        if rc != 0 {
            return Err(VerbsError::Invalid(format!(
                "{}: {}",
                self.pd.ctx.name,
                returned_error("ibv_modify_qp", rc)
            )));
        }
        if let Some(s) = attr.state {
            self.note_state(s);
        }
        Ok(())
    }

    /// A modify with attributes made elsewhere (rdma_cm's).
    fn modify_raw(&self, attr: &mut ibv_qp_attr, mask: c_int) -> Result<(), String> {
        let _one_at_a_time = self.modify_lock.lock().expect("modify lock");
        // SAFETY: a live QP and attributes the call only reads.
        let rc = unsafe { (self.pd.ctx.lib.modify_qp)(self.qp.as_ptr(), attr, mask) };
        if rc != 0 {
            return Err(format!(
                "{}: {}",
                self.pd.ctx.name,
                returned_error("ibv_modify_qp", rc)
            ));
        }
        if mask & IBV_QP_STATE != 0 {
            self.note_state(qp_state(attr.qp_state));
        }
        Ok(())
    }

    /// Records an RNIC QP's state (see `rnic_state`).
    fn note_state(&self, s: QpState) {
        *self.rnic_state.lock().expect("QP state lock") = s;
    }

    /// Moves the QP to ERR (its work flushed).
    pub(crate) fn to_error(&self) -> Result<(), String> {
        let mut attr = ibv_qp_attr {
            qp_state: qp_state_code(QpState::Err),
            ..ibv_qp_attr::default()
        };
        self.modify_raw(&mut attr, IBV_QP_STATE)
    }

    /// Ends its rdma_cm connection, if it has one (the DREQ, or the TCP
    /// close), and moves it to ERR.
    pub(crate) fn disconnect(&self) -> Result<(), String> {
        // The id stays until the QP goes, so that the kernel repeats the
        // DREQ until the DREP (destroying it would cancel the retries).
        if let Some(c) = self
            .cm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
        {
            c.disconnect();
        }
        self.to_error()
    }

    /// Whether it made an rdma_cm connection.
    pub(crate) fn has_cm_connection(&self) -> bool {
        self.cm.lock().expect("QP cm lock").is_some()
    }

    pub(crate) fn post_send(&self, wr: &SendWr) -> Result<(), PostError> {
        crate::engine::check_post_send(wr, &self.caps)?;
        let mut sges = SmallVec::new();
        let mut w = send_request(wr, &mut sges);
        let mut bad = std::ptr::null_mut();
        let rc = match (self.qp_type, wr.ud) {
            (QpType::Ud, Some(dest)) => {
                let ah = self
                    .ahs
                    .read()
                    .expect("AH table lock")
                    .get(&dest.ah.0)
                    .filter(|ah| Arc::ptr_eq(&ah.pd, &self.pd))
                    .cloned()
                    .ok_or(PostError::BadAh(dest.ah.0))?;
                ud_destination(&mut w, ah.ah.as_ptr(), dest.remote_qpn, dest.remote_qkey);
                let mut ring = self.ud_ahs.lock().expect("UD AH ring lock");
                // SAFETY: a live QP; the request, its SGEs and inline bytes
                // live through the call, which copies what it keeps; the AH
                // lives on in the ring.
                let rc = unsafe { (self.pd.ctx.post_send)(self.qp.as_ptr(), &mut w, &mut bad) };
                if rc == 0 {
                    ring.push_back(ah);
                    while ring.len() > self.caps.max_send_wr.max(1) as usize {
                        ring.pop_front();
                    }
                }
                rc
            }
            (QpType::Ud, None) => {
                return Err(PostError::Unsupported(
                    "a UD send needs a destination (SendWr::to)",
                ));
            }
            // SAFETY: a live QP; the request, its SGEs and inline bytes live
            // through the call, which copies what it keeps.
            (QpType::Rc, _) => unsafe {
                (self.pd.ctx.post_send)(self.qp.as_ptr(), &mut w, &mut bad)
            },
        };
        match rc {
            0 => Ok(()),
            rc => Err(posted_error(rc, self.caps.max_send_wr)),
        }
    }

    pub(crate) fn post_recv(&self, wr: &RecvWr) -> Result<(), PostError> {
        if self.srq.is_some() {
            return Err(PostError::ON_SRQ);
        }
        if wr.sgl.len() > self.caps.max_recv_sge as usize {
            return Err(PostError::TooManySges {
                given: wr.sgl.len(),
                max: self.caps.max_recv_sge,
            });
        }
        with_recv_wr(wr, |w, bad| {
            // SAFETY: a live QP and a request whose SGEs live for the call.
            unsafe { (self.pd.ctx.post_recv)(self.qp.as_ptr(), w, bad) }
        })
        .map_err(|rc| posted_error(rc, self.caps.max_recv_wr))
    }
}

impl Drop for HwQp {
    fn drop(&mut self) {
        // The connection first: the kernel's CM may hold the QP until then.
        drop(
            self.cm
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take(),
        );
        // SAFETY: created above, destroyed once; the CQs and SRQ it names
        // outlive it (held in the struct).
        unsafe { (self.pd.ctx.lib.destroy_qp)(self.qp.as_ptr()) };
    }
}

/// The fd of a CQ's completion channel.
impl AsFd for HwCq {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::engine::Sge;

    /// The `N` bytes at `at` of the request, as the device's library
    /// reads them (fields only: never its padding).
    fn field<const N: usize>(w: &ibv_send_wr, at: usize) -> [u8; N] {
        assert!(at + N <= std::mem::size_of::<ibv_send_wr>());
        // SAFETY: in bounds (checked); the tests read only bytes of
        // fields, which are initialised.
        unsafe {
            (w as *const ibv_send_wr)
                .cast::<u8>()
                .add(at)
                .cast::<[u8; N]>()
                .read_unaligned()
        }
    }

    fn u32_at(w: &ibv_send_wr, at: usize) -> u32 {
        u32::from_ne_bytes(field::<4>(w, at))
    }

    fn u64_at(w: &ibv_send_wr, at: usize) -> u64 {
        u64::from_ne_bytes(field::<8>(w, at))
    }

    // Offsets from verbs.h (checked against the compiler in ffi.rs):
    // opcode 28, send_flags 32, imm_data 36, wr.rdma.remote_addr 40,
    // wr.rdma.rkey 48, wr.atomic.{compare_add 48, swap 56, rkey 64},
    // wr.ud.{ah 40, remote_qpn 48, remote_qkey 52}.
    #[test]
    fn requests_carry_each_field_where_verbs_h_puts_it() {
        let sge = Sge {
            addr: 0x1000,
            len: 64,
            lkey: 7,
        };
        let mut sges = SmallVec::new();
        let wimm = SendOp::WriteWithImm {
            remote_addr: 0xdead_beef_0000,
            rkey: 0x1234_5678,
            imm: 0x0102_0304,
        };
        let w = send_request(&SendWr::new(9, wimm, [sge]).fenced(), &mut sges);
        assert_eq!(u32_at(&w, 28), IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!(u32_at(&w, 32), IBV_SEND_SIGNALED | IBV_SEND_FENCE);
        // Immediate data in network order, as the wire carries it.
        assert_eq!(field::<4>(&w, 36), [1, 2, 3, 4]);
        assert_eq!(u64_at(&w, 40), 0xdead_beef_0000);
        assert_eq!(u32_at(&w, 48), 0x1234_5678);
        assert_eq!(
            (w.num_sge, sges[0].addr, sges[0].length, sges[0].lkey),
            (1, 0x1000, 64, 7)
        );
        let cas = SendOp::CompareSwap {
            remote_addr: 0x8000,
            rkey: 0xaabb,
            compare: 5,
            swap: 6,
        };
        let w = send_request(&SendWr::new(1, cas, [sge]).unsignaled(), &mut sges);
        assert_eq!(u32_at(&w, 28), IBV_WR_ATOMIC_CMP_AND_SWP);
        assert_eq!(u32_at(&w, 32), 0);
        assert_eq!(
            (u64_at(&w, 40), u64_at(&w, 48), u64_at(&w, 56)),
            (0x8000, 5, 6)
        );
        assert_eq!(u32_at(&w, 64), 0xaabb);
        let mut w = send_request(
            &SendWr::new(2, SendOp::Send, []).inline(b"hi").solicited(),
            &mut sges,
        );
        assert_eq!(
            u32_at(&w, 32),
            IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | IBV_SEND_INLINE
        );
        assert_eq!((w.num_sge, sges[0].length), (1, 2));
        ud_destination(&mut w, 0x5000 as *mut ibv_ah, 0x00ab_cdef, 0x1111_2222);
        assert_eq!(
            (u64_at(&w, 40), u32_at(&w, 48), u32_at(&w, 52)),
            (0x5000, 0x00ab_cdef, 0x1111_2222)
        );
        // SEND with invalidate carries the rkey in host order.
        let w = send_request(&SendWr::new(3, SendOp::SendWithInv(0x99), []), &mut sges);
        assert_eq!(
            (u32_at(&w, 28), u32_at(&w, 36)),
            (IBV_WR_SEND_WITH_INV, 0x99)
        );
    }

    #[test]
    fn completions_read_every_field() {
        let mut wc = ibv_wc {
            wr_id: 77,
            status: 0,
            opcode: IBV_WC_RECV_RDMA_WITH_IMM,
            byte_len: 300,
            imm_or_rkey: u32::from_ne_bytes([0xa, 0xb, 0xc, 0xd]),
            qp_num: 0x11,
            src_qp: 0x22,
            wc_flags: IBV_WC_WITH_IMM | IBV_WC_GRH,
            ..ibv_wc::default()
        };
        let c = completion(&wc);
        assert_eq!(
            (
                c.wr_id, c.status, c.opcode, c.byte_len, c.qp_num, c.src_qp, c.grh
            ),
            (
                77,
                WcStatus::Success,
                WcOpcode::RecvRdmaWithImm,
                300,
                0x11,
                0x22,
                true
            )
        );
        assert_eq!(c.imm, Some(0x0a0b_0c0d), "network order on the wire");
        wc.wc_flags = IBV_WC_WITH_INV;
        wc.imm_or_rkey = 0x4321;
        wc.opcode = IBV_WC_RECV;
        let c = completion(&wc);
        assert_eq!(
            (c.imm, c.invalidated_rkey, c.grh),
            (None, Some(0x4321), false)
        );
        for (code, status) in [
            (10, WcStatus::RemAccessErr),
            (12, WcStatus::RetryExcErr),
            (20, WcStatus::RespTimeoutErr),
            (21, WcStatus::GeneralErr),
            (99, WcStatus::GeneralErr),
        ] {
            wc.status = code;
            assert_eq!(completion(&wc).status, status);
        }
        for (code, opcode) in [
            (IBV_WC_SEND, WcOpcode::Send),
            (IBV_WC_RDMA_WRITE, WcOpcode::RdmaWrite),
            (IBV_WC_RDMA_READ, WcOpcode::RdmaRead),
            (IBV_WC_COMP_SWAP, WcOpcode::CompareSwap),
            (IBV_WC_FETCH_ADD, WcOpcode::FetchAdd),
            (IBV_WC_LOCAL_INV, WcOpcode::LocalInv),
        ] {
            wc.opcode = code;
            assert_eq!(completion(&wc).opcode, opcode);
        }
    }

    #[test]
    fn an_address_vector_is_the_ipv4_mapped_gid_from_the_ipv4_gid_index() {
        let attr = ah_attr_for(3, Ipv4Addr::new(10, 99, 0, 2));
        assert_eq!(
            attr.grh.dgid,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 99, 0, 2]
        );
        assert_eq!(
            (
                attr.is_global,
                attr.grh.sgid_index,
                attr.port_num,
                attr.dlid
            ),
            (1, 3, PORT, 0)
        );
    }
}
