//! rdma_cm through rdma-core's librdmacm, loaded at run time: how an ibverbs
//! device's RC QPs connect (an iWARP device's must; a RoCE device's may).
//!
//! The QP is softrdma's own, created on the provider's context, and goes to
//! rdma_cm by number, as librdmacm allows for an rdma_cm_id without a QP:
//! on RoCE this side moves it to INIT, RTR and RTS with the attributes
//! `rdma_init_qp_attr` gives (and sends the RTU with `rdma_establish`); on
//! iWARP it moves it to INIT and the kernel's iw_cm takes it to RTS. Each
//! connection keeps its rdma_cm_id, on an event channel of its own, for as
//! long as its QP lives, and a thread that answers the peer's disconnect
//! (`rdma_disconnect`: the DREP on RoCE) and moves the QP to ERR, which the
//! kernel does not do to a QP it was not given.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::ffi::{
    IBV_QP_ACCESS_FLAGS, IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_MIN_RNR_TIMER,
    IBV_QP_TIMEOUT, ibv_context, ibv_qp_attr,
};
use super::{HwContext, HwQp, qp_state_code, set_nonblocking};
use crate::engine::qp::QpState;
use crate::memory::Access;

#[repr(C)]
struct rdma_event_channel {
    fd: c_int,
}

/// The head of `struct rdma_cm_id`: its device context, then (after three
/// pointers) its route, whose addresses are read for the peer's.
#[repr(C)]
struct rdma_cm_id {
    verbs: *mut ibv_context,
    _channel: *mut rdma_event_channel,
    _context: *mut c_void,
    _qp: *mut c_void,
    /// `route.addr.src_addr` (a `sockaddr_storage`), then `dst_addr`.
    src_addr: [u8; 128],
    dst_addr: [u8; 128],
}

/// `struct rdma_conn_param`.
#[repr(C)]
#[derive(Clone, Copy)]
struct rdma_conn_param {
    private_data: *const c_void,
    private_data_len: u8,
    responder_resources: u8,
    initiator_depth: u8,
    flow_control: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    srq: u8,
    qp_num: u32,
}

/// `struct rdma_cm_event`, its parameters read as `conn` (the union's
/// first member; only connected events are read here).
#[repr(C)]
struct rdma_cm_event {
    id: *mut rdma_cm_id,
    listen_id: *mut rdma_cm_id,
    event: c_uint,
    status: c_int,
    conn: rdma_conn_param,
}

use libc::sockaddr_in;

const AF_INET: u16 = libc::AF_INET as u16;
const RDMA_PS_TCP: c_int = 0x0106;

const ADDR_RESOLVED: c_uint = 0;
const ROUTE_RESOLVED: c_uint = 2;
const CONNECT_REQUEST: c_uint = 4;
const CONNECT_RESPONSE: c_uint = 5;
const REJECTED: c_uint = 8;
const ESTABLISHED: c_uint = 9;
const DISCONNECTED: c_uint = 10;
const DEVICE_REMOVAL: c_uint = 11;

/// How long address and route resolution may take (as rping's 2 s).
const RESOLVE_MS: c_int = 2000;
/// How long a connection's exchange may take once started. On RoCE the
/// kernel's CM sends a REQ or REP 16 times some 4.6 s apart before it gives
/// up itself (about 70 s, by its source; not measured); this is a bound
/// beyond that. (siw makes its TCP connection inside `rdma_connect`, which a
/// host that never answers holds for TCP's SYN retries.)
const EXCHANGE_LIMIT: Duration = Duration::from_secs(90);
/// The most private data a REJ carries (IB CM; MPA's reject carries up to
/// 255 through librdmacm).
const REJ_PRIVATE_DATA_MAX: usize = 148;
/// rdma_listen's backlog.
const BACKLOG: c_int = 64;

/// librdmacm's entry points this provider calls.
struct CmLib {
    create_event_channel: unsafe extern "C" fn() -> *mut rdma_event_channel,
    destroy_event_channel: unsafe extern "C" fn(*mut rdma_event_channel),
    create_id: unsafe extern "C" fn(
        *mut rdma_event_channel,
        *mut *mut rdma_cm_id,
        *mut c_void,
        c_int,
    ) -> c_int,
    destroy_id: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    bind_addr: unsafe extern "C" fn(*mut rdma_cm_id, *mut sockaddr_in) -> c_int,
    resolve_addr:
        unsafe extern "C" fn(*mut rdma_cm_id, *mut sockaddr_in, *mut sockaddr_in, c_int) -> c_int,
    resolve_route: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    listen: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    connect: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    accept: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    reject: unsafe extern "C" fn(*mut rdma_cm_id, *const c_void, u8) -> c_int,
    disconnect: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    establish: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    get_cm_event: unsafe extern "C" fn(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int,
    ack_cm_event: unsafe extern "C" fn(*mut rdma_cm_event) -> c_int,
    init_qp_attr: unsafe extern "C" fn(*mut rdma_cm_id, *mut ibv_qp_attr, *mut c_int) -> c_int,
    migrate_id: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_event_channel) -> c_int,
    event_str: unsafe extern "C" fn(c_uint) -> *const c_char,
    /// Kept loaded for the process's life: the pointers above point into it.
    _lib: libloading::Library,
}

impl CmLib {
    fn load() -> Result<CmLib, String> {
        // SAFETY: loading rdma-core's librdmacm runs its initialisers, which
        // read the environment; it is a C library made to be loaded into any
        // process (its devices are opened at its first call).
        let lib = unsafe { libloading::Library::new("librdmacm.so.1") }.map_err(|e| {
            format!("cannot load librdmacm.so.1 ({e}): install rdma-core's librdmacm1")
        })?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol is librdmacm's exported function of this
                // name; the field's type is its C prototype from rdma-core's
                // rdma_cma.h.
                let s = unsafe { lib.get($name.as_bytes()) }
                    .map_err(|e| format!("librdmacm.so.1 has no {}: {e}", $name))?;
                *s
            }};
        }
        Ok(CmLib {
            create_event_channel: sym!("rdma_create_event_channel"),
            destroy_event_channel: sym!("rdma_destroy_event_channel"),
            create_id: sym!("rdma_create_id"),
            destroy_id: sym!("rdma_destroy_id"),
            bind_addr: sym!("rdma_bind_addr"),
            resolve_addr: sym!("rdma_resolve_addr"),
            resolve_route: sym!("rdma_resolve_route"),
            listen: sym!("rdma_listen"),
            connect: sym!("rdma_connect"),
            accept: sym!("rdma_accept"),
            reject: sym!("rdma_reject"),
            disconnect: sym!("rdma_disconnect"),
            establish: sym!("rdma_establish"),
            get_cm_event: sym!("rdma_get_cm_event"),
            ack_cm_event: sym!("rdma_ack_cm_event"),
            init_qp_attr: sym!("rdma_init_qp_attr"),
            migrate_id: sym!("rdma_migrate_id"),
            event_str: sym!("rdma_event_str"),
            _lib: lib,
        })
    }

    fn event_name(&self, event: c_uint) -> String {
        // SAFETY: rdma_event_str returns a static string for any value.
        let s = unsafe { (self.event_str)(event) };
        if s.is_null() {
            return format!("event {event}");
        }
        // SAFETY: a NUL-terminated static string.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

static CM_LIB: OnceLock<Result<CmLib, String>> = OnceLock::new();

fn cm_lib() -> Result<&'static CmLib, String> {
    CM_LIB
        .get_or_init(CmLib::load)
        .as_ref()
        .map_err(Clone::clone)
}

fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn sockaddr(a: SocketAddrV4) -> sockaddr_in {
    sockaddr_in {
        sin_family: AF_INET,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

/// Why a connection through librdmacm failed.
#[derive(Debug)]
pub(crate) enum CmFailure {
    /// The peer (or its kernel) rejected it: the event's status (an IB CM
    /// reject reason on RoCE, a negative errno on iWARP) and private data.
    Rejected { status: i32, private_data: Vec<u8> },
    /// The connection was refused at once (iWARP: nothing listens there).
    Refused,
    /// Anything else, said in words.
    Other(String),
}

impl From<String> for CmFailure {
    fn from(s: String) -> CmFailure {
        CmFailure::Other(s)
    }
}

/// An event, copied out of librdmacm's (which is acknowledged at once).
struct Event {
    kind: c_uint,
    status: i32,
    id: *mut rdma_cm_id,
    private_data: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
    /// The peer's QP (RoCE; 0 on iWARP).
    qp_num: u32,
}

/// An event channel.
struct Channel {
    lib: &'static CmLib,
    ch: NonNull<rdma_event_channel>,
}

impl Channel {
    fn new(lib: &'static CmLib) -> Result<Channel, String> {
        // SAFETY: no arguments; returns a new channel or NULL.
        let ch = unsafe { (lib.create_event_channel)() };
        let ch = NonNull::new(ch).ok_or_else(|| os_error("rdma_create_event_channel"))?;
        let channel = Channel { lib, ch };
        set_nonblocking(channel.as_fd()).map_err(|e| format!("rdma_cm event channel: {e}"))?;
        Ok(channel)
    }

    /// The next event, waiting until `deadline` (None: for ever; Ok(None)
    /// when it passed), or until `stop` is readable.
    fn next(
        &self,
        deadline: Option<Instant>,
        stop: Option<BorrowedFd<'_>>,
    ) -> Result<Option<Event>, String> {
        loop {
            let mut ev = std::ptr::null_mut();
            // SAFETY: a live channel; the event pointer is filled on success.
            let rc = unsafe { (self.lib.get_cm_event)(self.ch.as_ptr(), &mut ev) };
            if rc == 0 {
                // SAFETY: librdmacm's event, valid until acknowledged; its
                // private data is `private_data_len` bytes where non-NULL.
                let event = unsafe {
                    let e = &*ev;
                    let pd = if e.conn.private_data.is_null() {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(
                            e.conn.private_data.cast::<u8>(),
                            usize::from(e.conn.private_data_len),
                        )
                        .to_vec()
                    };
                    Event {
                        kind: e.event,
                        status: e.status,
                        id: e.id,
                        private_data: pd,
                        responder_resources: e.conn.responder_resources,
                        initiator_depth: e.conn.initiator_depth,
                        qp_num: e.conn.qp_num,
                    }
                };
                // SAFETY: the event taken above, acknowledged once.
                unsafe { (self.lib.ack_cm_event)(ev) };
                return Ok(Some(event));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::WouldBlock
                && e.kind() != std::io::ErrorKind::Interrupted
            {
                return Err(format!("rdma_get_cm_event: {e}"));
            }
            let timeout = match deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    Some(rustix::time::Timespec {
                        tv_sec: left.as_secs() as i64,
                        tv_nsec: i64::from(left.subsec_nanos()),
                    })
                }
            };
            let me = self.as_fd();
            let mut fds = vec![rustix::event::PollFd::new(
                &me,
                rustix::event::PollFlags::IN,
            )];
            if let Some(s) = &stop {
                fds.push(rustix::event::PollFd::new(s, rustix::event::PollFlags::IN));
            }
            match rustix::event::poll(&mut fds, timeout.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(format!("poll on the rdma_cm event channel: {e}")),
            }
            if fds.len() > 1 && !fds[1].revents().is_empty() {
                return Ok(None);
            }
        }
    }
}

impl AsFd for Channel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel's fd lives until the channel is destroyed.
        unsafe { BorrowedFd::borrow_raw((*self.ch.as_ptr()).fd) }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: created above, destroyed once, after its ids (CmId drops
        // its id first).
        unsafe { (self.lib.destroy_event_channel)(self.ch.as_ptr()) };
    }
}

/// An rdma_cm_id on an event channel of its own (shared with a connection's
/// watcher, which may outlive the id by a moment).
struct CmId {
    id: NonNull<rdma_cm_id>,
    channel: Arc<Channel>,
}

// SAFETY: librdmacm's calls are thread-safe: an id and its channel may be
// used from several threads at once (a disconnect beside the watcher's
// wait for events, accepts on one listener's channel).
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}
// SAFETY: as above.
unsafe impl Send for Channel {}
// SAFETY: as above.
unsafe impl Sync for Channel {}

impl CmId {
    fn new() -> Result<CmId, String> {
        let lib = cm_lib()?;
        let channel = Channel::new(lib)?;
        let mut id = std::ptr::null_mut();
        // SAFETY: a live channel; the id is filled on success.
        let rc = unsafe {
            (lib.create_id)(
                channel.ch.as_ptr(),
                &mut id,
                std::ptr::null_mut(),
                RDMA_PS_TCP,
            )
        };
        if rc != 0 {
            return Err(os_error("rdma_create_id"));
        }
        let id = NonNull::new(id).ok_or("rdma_create_id gave no id")?;
        Ok(CmId {
            id,
            channel: Arc::new(channel),
        })
    }

    /// Takes `id` (a connect request's, on a listener's channel) onto a
    /// channel of its own.
    fn adopt(id: *mut rdma_cm_id) -> Result<CmId, String> {
        let lib = cm_lib()?;
        let id = NonNull::new(id).ok_or("a connect request without an id")?;
        let channel = match Channel::new(lib) {
            Ok(c) => c,
            Err(e) => {
                // SAFETY: the request's id, which this side owns; destroyed once.
                unsafe { (lib.destroy_id)(id.as_ptr()) };
                return Err(e);
            }
        };
        // SAFETY: a live id and channel.
        if unsafe { (lib.migrate_id)(id.as_ptr(), channel.ch.as_ptr()) } != 0 {
            let e = os_error("rdma_migrate_id");
            // SAFETY: as above.
            unsafe { (lib.destroy_id)(id.as_ptr()) };
            return Err(e);
        }
        Ok(CmId {
            id,
            channel: Arc::new(channel),
        })
    }

    fn lib(&self) -> &'static CmLib {
        self.channel.lib
    }

    fn ptr(&self) -> *mut rdma_cm_id {
        self.id.as_ptr()
    }

    /// The name of the device rdma_cm bound this id to (none before its
    /// address is bound or resolved).
    fn device_name(&self, ctx: &HwContext) -> Option<String> {
        // SAFETY: a live id; `verbs` is NULL or librdmacm's open context,
        // whose `device` is its device.
        unsafe {
            let verbs = (*self.ptr()).verbs;
            if verbs.is_null() {
                return None;
            }
            let name = (ctx.lib.get_device_name)((*verbs).device);
            (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy().into_owned())
        }
    }

    /// The id's local or peer address (IPv4 only).
    fn addr(&self, peer: bool) -> Option<SocketAddrV4> {
        // SAFETY: a live id; its route's addresses are plain bytes.
        let raw = unsafe {
            let id = &*self.ptr();
            if peer { id.dst_addr } else { id.src_addr }
        };
        let family = u16::from_ne_bytes([raw[0], raw[1]]);
        (family == AF_INET).then(|| {
            SocketAddrV4::new(
                Ipv4Addr::new(raw[4], raw[5], raw[6], raw[7]),
                u16::from_be_bytes([raw[2], raw[3]]),
            )
        })
    }

    /// The next event of kind `want` by `deadline`; another kind is an
    /// error (a rejection as [`CmFailure::Rejected`]).
    fn expect(&self, want: c_uint, deadline: Instant, doing: &str) -> Result<Event, CmFailure> {
        match self.channel.next(Some(deadline), None)? {
            None => Err(CmFailure::Other(format!(
                "no answer within {} s while {doing}",
                EXCHANGE_LIMIT.as_secs()
            ))),
            Some(e) if e.kind == want => Ok(e),
            Some(e) if e.kind == REJECTED => Err(CmFailure::Rejected {
                status: e.status,
                private_data: e.private_data,
            }),
            Some(e) => Err(CmFailure::Other(format!(
                "rdma_cm said {} (status {}) while {doing}",
                self.lib().event_name(e.kind),
                e.status
            ))),
        }
    }

    /// Moves `qp` to `state` with the attributes rdma_cm gives for it, as
    /// `tweak` changes them (a field the mask names).
    fn qp_to(
        &self,
        qp: &HwQp,
        state: QpState,
        tweak: impl FnOnce(&mut ibv_qp_attr, &mut c_int),
    ) -> Result<(), String> {
        let mut attr = ibv_qp_attr {
            qp_state: qp_state_code(state),
            ..ibv_qp_attr::default()
        };
        let mut mask: c_int = 0;
        // SAFETY: a live id and structs to fill.
        let rc = unsafe { (self.lib().init_qp_attr)(self.ptr(), &mut attr, &mut mask) };
        if rc != 0 {
            return Err(format!(
                "rdma_init_qp_attr for {state:?}: {}",
                std::io::Error::last_os_error()
            ));
        }
        tweak(&mut attr, &mut mask);
        qp.modify_raw(&mut attr, mask)
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: created or adopted above, destroyed once, before its
        // channel (a field, dropped after this).
        unsafe { (self.lib().destroy_id)(self.ptr()) };
    }
}

/// What both sides of a connection set.
#[derive(Debug, Clone)]
pub(crate) struct CmParams {
    /// The application's private data.
    pub private_data: Vec<u8>,
    /// READs and atomics this side serves at once.
    pub responder_resources: u8,
    /// READs and atomics this side has outstanding.
    pub initiator_depth: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    /// The QP's remote access.
    pub access: Access,
    /// RoCE: the local ACK timeout and the RNR timer this side asks for
    /// (None: rdma_cm's).
    pub timeout: Option<u8>,
    pub min_rnr_timer: Option<u8>,
}

/// What a connection learnt of its peer.
#[derive(Debug, Clone)]
pub(crate) struct CmOutcome {
    pub peer: SocketAddrV4,
    /// The peer's QP (RoCE; 0 on iWARP).
    pub remote_qpn: u32,
    pub private_data: Vec<u8>,
    /// The peer's READ depths: it serves, it issues. A connecting side's
    /// events give only the depths agreed, so there these are this side's
    /// matched (it issues what the peer serves).
    pub peer_responder_resources: u8,
    pub peer_initiator_depth: u8,
    /// This side's, as its QP has them: it issues, it serves.
    pub initiator_depth: u8,
    pub responder_resources: u8,
}

/// A connection request a listener took.
#[derive(Debug, Clone)]
pub(crate) struct CmRequest {
    pub from: SocketAddrV4,
    pub remote_qpn: u32,
    pub private_data: Vec<u8>,
    /// The peer's READ depths: it serves, it issues.
    pub responder_resources: u8,
    pub initiator_depth: u8,
}

/// `p`'s READ depths within the device's limits (librdmacm refuses more
/// with a bare EINVAL).
fn within_device(ctx: &HwContext, p: &CmParams) -> CmParams {
    let limit = |n: c_int| u8::try_from(n.max(1)).unwrap_or(u8::MAX);
    CmParams {
        responder_resources: p.responder_resources.min(limit(ctx.attr.max_qp_rd_atom)),
        initiator_depth: p.initiator_depth.min(limit(ctx.attr.max_qp_init_rd_atom)),
        ..p.clone()
    }
}

fn conn_param(p: &CmParams, qp: &HwQp, pd: &[u8]) -> Result<rdma_conn_param, String> {
    Ok(rdma_conn_param {
        private_data: if pd.is_empty() {
            std::ptr::null()
        } else {
            pd.as_ptr().cast()
        },
        private_data_len: u8::try_from(pd.len())
            .map_err(|_| format!("{} bytes of private data: at most 255", pd.len()))?,
        responder_resources: p.responder_resources,
        initiator_depth: p.initiator_depth,
        flow_control: 0,
        retry_count: p.retry_count.min(7),
        rnr_retry_count: p.rnr_retry_count.min(7),
        srq: u8::from(qp.srq.is_some()),
        qp_num: qp.qpn,
    })
}

/// The id's device must be `ctx`'s: rdma_cm picks the device by address.
fn check_device(id: &CmId, ctx: &HwContext, addr: SocketAddrV4) -> Result<(), String> {
    match id.device_name(ctx) {
        Some(n) if n == ctx.name => Ok(()),
        Some(n) => Err(format!(
            "rdma_cm reaches {addr} through device {n}, not {}: open {n}, or give {} an \
             address of its own",
            ctx.name, ctx.name
        )),
        None => Err(format!("rdma_cm found no RDMA device for {addr}")),
    }
}

/// Brings `qp` (RESET, or INIT with receives posted) to INIT, again if it
/// is there, with rdma_cm's attributes and `access`.
fn to_init(id: &CmId, qp: &HwQp, access: Access) -> Result<(), String> {
    if qp.qp_type != crate::engine::qp::QpType::Rc {
        return Err("rdma_cm here connects RC QPs only".into());
    }
    match qp.state() {
        QpState::Reset | QpState::Init => id.qp_to(qp, QpState::Init, |a, mask| {
            a.qp_access_flags = access.bits();
            *mask |= IBV_QP_ACCESS_FLAGS;
        }),
        s => Err(format!(
            "the QP is in {s:?}: rdma_cm connects a new QP (RESET, or INIT with receives posted)"
        )),
    }
}

/// RoCE: `qp` to RTR and RTS with rdma_cm's attributes, the READ depths
/// this side announced (None: rdma_cm's) and `p`'s timers; `reached` notes
/// when it has left INIT.
fn to_rts(
    id: &CmId,
    qp: &HwQp,
    p: &CmParams,
    depths: Option<(u8, u8)>,
    reached: &mut Reached,
) -> Result<(), String> {
    id.qp_to(qp, QpState::Rtr, |a, mask| {
        if let Some((serves, _)) = depths {
            a.max_dest_rd_atomic = serves;
            *mask |= IBV_QP_MAX_DEST_RD_ATOMIC;
        }
        if let Some(t) = p.min_rnr_timer {
            a.min_rnr_timer = t;
            *mask |= IBV_QP_MIN_RNR_TIMER;
        }
    })?;
    *reached = Reached::Moved;
    id.qp_to(qp, QpState::Rts, |a, mask| {
        if let Some((_, issues)) = depths {
            a.max_rd_atomic = issues;
            *mask |= IBV_QP_MAX_QP_RD_ATOMIC;
        }
        if let Some(t) = p.timeout {
            a.timeout = t;
            *mask |= IBV_QP_TIMEOUT;
        }
    })
}

/// How far a failed attempt got with the QP.
#[derive(Clone, Copy)]
enum Reached {
    /// Nothing the kernel or the QP's state remembers.
    Nothing,
    /// RoCE: the QP left INIT (RTR or RTS, with no connection).
    Moved,
    /// iWARP: the kernel took the QP (`rdma_connect` returned, or
    /// `rdma_accept` was called), and siw refuses it another attempt.
    Handed,
}

/// Leaves a QP whose attempt failed as it can be used: back in INIT it was
/// never moved; moved or handed, in ERR (as librdmacm does), so that it is
/// not connected again.
fn after_failure(qp: &HwQp, reached: Reached) {
    match reached {
        Reached::Nothing => {}
        Reached::Moved => {
            let _ = qp.to_error();
        }
        Reached::Handed => qp.note_state(QpState::Err),
    }
}

/// Connects RC `qp` of `ctx` to the rdma_cm listener at `to`.
pub(crate) fn connect(
    ctx: &HwContext,
    qp: &Arc<HwQp>,
    to: SocketAddrV4,
    p: &CmParams,
) -> Result<CmOutcome, CmFailure> {
    let mut reached = Reached::Nothing;
    let out = try_connect(ctx, qp, to, &within_device(ctx, p), &mut reached);
    if out.is_err() {
        after_failure(qp, reached);
    }
    out
}

fn try_connect(
    ctx: &HwContext,
    qp: &Arc<HwQp>,
    to: SocketAddrV4,
    p: &CmParams,
    reached: &mut Reached,
) -> Result<CmOutcome, CmFailure> {
    let id = CmId::new()?;
    let lib = id.lib();
    let deadline = Instant::now() + EXCHANGE_LIMIT;
    let (mut src, mut dst) = (sockaddr(SocketAddrV4::new(ctx.addr, 0)), sockaddr(to));
    // SAFETY: a live id and addresses the call only reads.
    if unsafe { (lib.resolve_addr)(id.ptr(), &mut src, &mut dst, RESOLVE_MS) } != 0 {
        return Err(os_error(&format!("rdma_resolve_addr {to}")).into());
    }
    id.expect(ADDR_RESOLVED, deadline, "resolving the address")?;
    check_device(&id, ctx, to)?;
    // SAFETY: a live id with its address resolved.
    if unsafe { (lib.resolve_route)(id.ptr(), RESOLVE_MS) } != 0 {
        return Err(os_error(&format!("rdma_resolve_route {to}")).into());
    }
    id.expect(ROUTE_RESOLVED, deadline, "resolving the route")?;
    to_init(&id, qp, p.access)?;
    let mut param = conn_param(p, qp, &p.private_data)?;
    // SAFETY: a live id and parameters the call reads (the private data
    // lives across it).
    if unsafe { (lib.connect)(id.ptr(), &mut param) } != 0 {
        // An RNIC's driver may make the TCP connection here (siw does).
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::ECONNREFUSED) {
            return Err(CmFailure::Refused);
        }
        return Err(os_error(&format!("rdma_connect {to}")).into());
    }
    let event = if ctx.iwarp {
        *reached = Reached::Handed;
        let e = id.expect(ESTABLISHED, deadline, "connecting")?;
        // The kernel's iw_cm took the QP to RTS.
        qp.note_state(QpState::Rts);
        e
    } else {
        // No QP on the id: the QP's moves and the RTU are this side's.
        let e = id.expect(CONNECT_RESPONSE, deadline, "connecting")?;
        to_rts(&id, qp, p, None, reached)?;
        // SAFETY: a live id whose REP came.
        if unsafe { (lib.establish)(id.ptr()) } != 0 {
            return Err(os_error("rdma_establish").into());
        }
        e
    };
    // The events give the depths this side's QP takes (IB CM's REP read
    // from this side; iw_cm's negotiated ORD and IRD), each named after
    // what the peer's matches (rdma_get_cm_event(3)): this side issues as
    // many READs as the peer serves.
    let (issues, serves) = if ctx.iwarp {
        (event.responder_resources, event.initiator_depth)
    } else {
        (event.initiator_depth, event.responder_resources)
    };
    let out = CmOutcome {
        peer: id.addr(true).unwrap_or(to),
        remote_qpn: event.qp_num,
        private_data: event.private_data,
        peer_responder_resources: issues,
        peer_initiator_depth: serves,
        initiator_depth: issues,
        responder_resources: serves,
    };
    attach(qp, id)?;
    Ok(out)
}

/// An rdma_cm listener on a device's address.
pub(crate) struct CmListener {
    id: CmId,
    at: SocketAddrV4,
    /// One accept at a time: a request's id must leave the listener's
    /// channel (`rdma_migrate_id`) while no one else waits on it.
    accepting: std::sync::Mutex<()>,
}

impl std::fmt::Debug for CmListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmListener").field("at", &self.at).finish()
    }
}

impl CmListener {
    /// Listens on `port` (0: any) of `ctx`'s address.
    pub(crate) fn bind(ctx: &HwContext, port: u16) -> Result<CmListener, String> {
        let id = CmId::new()?;
        let at = SocketAddrV4::new(ctx.addr, port);
        let mut a = sockaddr(at);
        // SAFETY: a live id and an address the call reads.
        if unsafe { (id.lib().bind_addr)(id.ptr(), &mut a) } != 0 {
            return Err(os_error(&format!("rdma_bind_addr {at}")));
        }
        check_device(&id, ctx, at)?;
        // SAFETY: a live, bound id.
        if unsafe { (id.lib().listen)(id.ptr(), BACKLOG) } != 0 {
            return Err(os_error(&format!("rdma_listen {at}")));
        }
        let at = id.addr(false).unwrap_or(at);
        Ok(CmListener {
            id,
            at,
            accepting: std::sync::Mutex::default(),
        })
    }

    /// The address it listens on.
    pub(crate) fn local_addr(&self) -> SocketAddrV4 {
        self.at
    }

    /// Takes the next connect request for `qp` by `deadline` (Ok(None)
    /// when none came), lets `decide` answer it (Err: reject with that
    /// private data, cut to what a reject carries), and on acceptance
    /// connects `qp`.
    pub(crate) fn accept(
        &self,
        ctx: &HwContext,
        qp: &Arc<HwQp>,
        p: &CmParams,
        decide: impl FnOnce(&CmRequest) -> Result<Vec<u8>, Vec<u8>>,
        deadline: Option<Instant>,
    ) -> Result<Option<CmOutcome>, CmFailure> {
        let _one = self
            .accepting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let request = loop {
            match self.id.channel.next(deadline, None)? {
                None => return Ok(None),
                Some(e) if e.kind == CONNECT_REQUEST => break e,
                // A listener's own channel sees little else (DEVICE_REMOVAL;
                // a request's id before it moves to a channel of its own).
                Some(_) => {}
            }
        };
        let id = CmId::adopt(request.id)?;
        let req = CmRequest {
            from: id
                .addr(true)
                .unwrap_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)),
            remote_qpn: request.qp_num,
            private_data: request.private_data,
            // The event names each depth after what this side is to match
            // (rdma_get_cm_event(3)): the peer's are the other way round.
            responder_resources: request.initiator_depth,
            initiator_depth: request.responder_resources,
        };
        let mut reached = Reached::Nothing;
        let out = self.answer(
            ctx,
            qp,
            &within_device(ctx, p),
            &id,
            req,
            decide,
            &mut reached,
        );
        let out = out.and_then(|out| {
            attach(qp, id)?;
            Ok(out)
        });
        if out.is_err() {
            after_failure(qp, reached);
        }
        out.map(Some)
    }

    #[allow(clippy::too_many_arguments)]
    fn answer(
        &self,
        ctx: &HwContext,
        qp: &Arc<HwQp>,
        p: &CmParams,
        id: &CmId,
        req: CmRequest,
        decide: impl FnOnce(&CmRequest) -> Result<Vec<u8>, Vec<u8>>,
        reached: &mut Reached,
    ) -> Result<CmOutcome, CmFailure> {
        let lib = id.lib();
        let reject = |pd: &[u8]| {
            let most = if ctx.iwarp {
                usize::from(u8::MAX)
            } else {
                REJ_PRIVATE_DATA_MAX
            };
            let len = pd.len().min(most);
            // SAFETY: a live id and private data the call reads. A failed
            // reject leaves the peer to its own timeout (the id's destroy
            // rejects it then).
            unsafe { (lib.reject)(id.ptr(), pd.as_ptr().cast(), len as u8) };
        };
        let reply = match decide(&req) {
            Ok(reply) => reply,
            Err(pd) => {
                reject(&pd);
                return Err(CmFailure::Other("connection rejected here".into()));
            }
        };
        // This side's READ depths, cut to what the peer offers.
        let mine = CmParams {
            responder_resources: p.responder_resources.min(req.initiator_depth).max(1),
            initiator_depth: p.initiator_depth.min(req.responder_resources).max(1),
            ..p.clone()
        };
        let ready = check_device(id, ctx, self.at).and_then(|()| {
            to_init(id, qp, p.access)?;
            if !ctx.iwarp {
                to_rts(
                    id,
                    qp,
                    p,
                    Some((mine.responder_resources, mine.initiator_depth)),
                    reached,
                )?;
            }
            Ok(())
        });
        if let Err(e) = ready {
            reject(&[]);
            return Err(e.into());
        }
        let mut param = conn_param(&mine, qp, &reply)?;
        // siw moves the QP on inside rdma_accept, and keeps it if that fails.
        if ctx.iwarp {
            *reached = Reached::Handed;
        }
        // SAFETY: a live id and parameters the call reads.
        if unsafe { (lib.accept)(id.ptr(), &mut param) } != 0 {
            return Err(os_error("rdma_accept").into());
        }
        id.expect(
            ESTABLISHED,
            Instant::now() + EXCHANGE_LIMIT,
            "waiting for the connection to be established",
        )?;
        if ctx.iwarp {
            qp.note_state(QpState::Rts);
        }
        Ok(CmOutcome {
            peer: req.from,
            remote_qpn: req.remote_qpn,
            private_data: req.private_data,
            peer_responder_resources: req.responder_resources,
            peer_initiator_depth: req.initiator_depth,
            initiator_depth: mine.initiator_depth,
            responder_resources: mine.responder_resources,
        })
    }
}

/// A connected QP's rdma_cm_id and the thread that watches it.
pub(crate) struct CmConnection {
    id: CmId,
    stop: OwnedFd,
    watcher: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for CmConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmConnection").finish_non_exhaustive()
    }
}

/// Keeps `id` with `qp`, and answers the peer's disconnect.
fn attach(qp: &Arc<HwQp>, id: CmId) -> Result<(), String> {
    let stop = rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )
    .map_err(|e| format!("eventfd: {e}"))?;
    let woken = stop.try_clone().map_err(|e| format!("eventfd: {e}"))?;
    let watched = (id.channel.clone(), Arc::downgrade(qp));
    let watcher = std::thread::Builder::new()
        .name("softrdma-rdmacm".into())
        .spawn(move || watch(&watched.0, &watched.1, woken))
        .map_err(|e| format!("cannot start the rdma_cm watcher thread: {e}"))?;
    let old = qp
        .cm
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .replace(CmConnection {
            id,
            stop,
            watcher: Some(watcher),
        });
    drop(old);
    Ok(())
}

/// Waits on a connection's channel until `stop`: the peer's disconnect is
/// answered (`rdma_disconnect`, the DREP on RoCE) and moves the QP to ERR.
fn watch(channel: &Channel, qp: &Weak<HwQp>, stop: OwnedFd) {
    loop {
        match channel.next(None, Some(stop.as_fd())) {
            Ok(Some(e)) if e.kind == DISCONNECTED || e.kind == DEVICE_REMOVAL => {
                // SAFETY: the event's id, which lives until this thread is
                // joined (CmConnection's drop joins it before destroying
                // the id), or, when the QP's last reference is dropped here,
                // until that drop ends, after this call.
                unsafe { (channel.lib.disconnect)(e.id) };
                if let Some(qp) = qp.upgrade() {
                    let _ = qp.to_error();
                }
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return,
        }
    }
}

impl CmConnection {
    /// Sends the DREQ (RoCE) or closes the connection (iWARP).
    pub(crate) fn disconnect(&self) {
        // SAFETY: a live id; a second disconnect is refused harmlessly.
        unsafe { (self.id.lib().disconnect)(self.id.ptr()) };
    }
}

impl Drop for CmConnection {
    fn drop(&mut self) {
        let _ = rustix::io::write(&self.stop, &1u64.to_ne_bytes());
        // The watcher itself may drop the QP's last reference (in its
        // `upgrade`): then it ends on its own once this returns.
        if let Some(w) = self.watcher.take()
            && w.thread().id() != std::thread::current().id()
        {
            let _ = w.join();
        }
        self.disconnect();
        // The id goes now (a field), before the QP; its channel when the
        // watcher has let go of it too.
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use std::mem::{offset_of, size_of};

    use super::*;

    /// The layouts read from librdmacm's structs, as rdma-core 44's
    /// `rdma_cma.h` has them on x86-64.
    #[test]
    fn layouts_are_rdma_cmas() {
        assert_eq!(size_of::<rdma_conn_param>(), 24);
        assert_eq!(offset_of!(rdma_conn_param, private_data_len), 8);
        assert_eq!(offset_of!(rdma_conn_param, rnr_retry_count), 13);
        assert_eq!(offset_of!(rdma_conn_param, srq), 14);
        assert_eq!(offset_of!(rdma_conn_param, qp_num), 16);
        assert_eq!(offset_of!(rdma_cm_event, event), 16);
        assert_eq!(offset_of!(rdma_cm_event, status), 20);
        assert_eq!(offset_of!(rdma_cm_event, conn), 24);
        // `route.addr`: two sockaddr_storage unions after four pointers.
        assert_eq!(offset_of!(rdma_cm_id, src_addr), 32);
        assert_eq!(offset_of!(rdma_cm_id, dst_addr), 160);
        assert_eq!(size_of::<sockaddr_in>(), 16);
    }

    #[test]
    fn addresses_are_in_network_order() {
        let a = sockaddr(SocketAddrV4::new(Ipv4Addr::new(10, 99, 0, 2), 7174));
        assert_eq!(a.sin_family, AF_INET);
        assert_eq!(a.sin_port.to_ne_bytes(), [0x1c, 0x06]);
        assert_eq!(a.sin_addr.s_addr.to_ne_bytes(), [10, 99, 0, 2]);
    }
}
