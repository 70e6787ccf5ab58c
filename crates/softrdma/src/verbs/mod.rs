//! The verbs: what applications use. It feels like libibverbs — devices,
//! protection domains, memory regions, completion queues, queue pairs, work
//! requests and completions — with owned handles that free on drop and errors
//! that say what went wrong.
//!
//! ```no_run
//! use softrdma::verbs::*;
//! # fn main() -> Result<(), VerbsError> {
//! let ctx = Device::udp("127.0.0.1:4791".parse().unwrap()).open()?;
//! let pd = ctx.alloc_pd()?;
//! let mr = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let cq = ctx.create_cq(64)?;
//! let qp = pd.create_qp(&QpInit::rc(&cq, &cq))?;
//! # Ok(()) }
//! ```

#[cfg(feature = "tokio")]
mod async_cq;
pub(crate) mod cq;
mod early;
pub(crate) mod events;
mod iwarp;
mod shm;

pub use iwarp::IwarpQpStats;

/// The instant `timeout` from now; a timeout too long to add (such as
/// `Duration::MAX`, "wait forever") ends a century from now instead.
pub(crate) fn deadline_after(timeout: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + std::time::Duration::from_secs(100 * 365 * 86_400))
}

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

pub use crate::engine::qp::{Mtu, QpType};
pub use crate::engine::rc::{QpCaps, RcStats};
pub use crate::engine::{
    InlineData, PostError, QpAttr, QpState, RecvWr, SendFlags, SendOp, SendWr, Sge,
    TransitionError, WcOpcode, WcStatus, WorkCompletion,
};
pub use crate::memory::{Access, AccessError};
#[cfg(feature = "tokio")]
pub use async_cq::AsyncCq;
pub use cq::{Cq, CqError};
pub use events::AsyncEvent;

use crate::engine::QpEngine;
use crate::engine::rc::RcQp;
use crate::engine::ud::UdQp;
pub use crate::engine::ud::UdStats;
pub use crate::engine::{AhId, UdDest};
use crate::memory::{MrTable, PdId, Region, RegionMemory};
use crate::provider::ibverbs::{HwAh, HwContext, HwCq, HwMr, HwPd, HwQp, HwSrq};
use crate::provider::udp::{MAX_SGE, QpSlot, UdpDevice};
use events::EventQueue;

/// Errors of the verbs.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// The operating system refused something (bind, thread, eventfd...).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// A work request could not be posted.
    #[error(transparent)]
    Post(#[from] PostError),
    /// A QP state change was refused.
    #[error(transparent)]
    Modify(#[from] TransitionError),
    /// Polling a CQ failed.
    #[error(transparent)]
    Cq(#[from] CqError),
    /// A memory access was refused.
    #[error(transparent)]
    Access(#[from] AccessError),
    /// An argument out of range.
    #[error("{0}")]
    Invalid(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VerbsError {
    let what = what.into();
    move |source| VerbsError::Io { what, source }
}

/// Result of the verbs.
pub type Result<T, E = VerbsError> = std::result::Result<T, E>;

/// A software RoCEv2 device: an IPv4 address and a UDP port.
///
/// Peers reach a device at its address and port; the port is 4791 unless the
/// device is opened on another one (so that several processes can share an
/// address) — then the peer must be told the port, which the connection
/// helper in [`crate::cm`] does.
#[derive(Debug, Clone)]
pub struct Device {
    addr: SocketAddrV4,
    busy_poll: bool,
    link_mtu: Option<usize>,
    shared_port: Option<bool>,
    pcap: Option<std::path::PathBuf>,
    iwarp: bool,
    shm: bool,
    /// A libibverbs device's name (the hardware provider).
    ibverbs: Option<String>,
}

impl Device {
    /// The RoCEv2-over-UDP device at `addr` (port 0 picks a free port).
    pub fn udp(addr: SocketAddr) -> Device {
        let addr = match addr {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(a) => SocketAddrV4::new(
                a.ip().to_ipv4_mapped().unwrap_or(Ipv4Addr::UNSPECIFIED),
                a.port(),
            ),
        };
        Device {
            addr,
            busy_poll: false,
            link_mtu: None,
            shared_port: None,
            pcap: None,
            iwarp: false,
            shm: false,
            ibverbs: None,
        }
    }

    /// The iWARP device at `ip`: RDMAP/DDP/MPA over TCP, one connection per
    /// QP (see [`crate::cm::iwarp`]); RC only, no atomics, no immediate data.
    pub fn iwarp(ip: Ipv4Addr) -> Device {
        Device {
            iwarp: true,
            ..Device::udp(SocketAddrV4::new(ip, 0).into())
        }
    }

    /// The shared-memory device: RC QPs between processes of this host,
    /// connected by [`crate::cm::shm`]; WRITE, READ and atomics go straight
    /// into the peer's memory (docs/shm.md).
    pub fn shm() -> Device {
        Device {
            shm: true,
            ..Device::udp(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0).into())
        }
    }

    /// The fastest device to reach `peer` with: shared memory when `peer` is
    /// an address of this host (loopback included), else RoCEv2 on UDP 4791
    /// of the address the kernel routes to `peer` from. Both ends must pick
    /// alike: a peer on this host that asks the same gets shm too.
    pub fn fastest_to(peer: Ipv4Addr) -> Result<Device> {
        if peer.is_loopback() || crate::provider::netdev::owner_of(peer).is_some() {
            return Ok(Device::shm());
        }
        let local = crate::provider::netdev::route_to(peer)
            .map_err(io_err(format!("no route to {peer}")))?;
        Ok(Device::udp(SocketAddrV4::new(local, 4791).into()))
    }

    /// A device libibverbs lists (`rxe0`, `mlx5_0`; see [`ibverbs_devices`]):
    /// an RDMA NIC, or the kernel's rxe, which is then the transport. Its
    /// port 1 must be RoCE with an IPv4 GID: its address is the device's.
    /// RC and UD QPs, SRQs and address handles; no iWARP or InfiniBand
    /// ports yet (`docs/ibverbs.md`).
    pub fn ibverbs(name: &str) -> Device {
        Device {
            ibverbs: Some(name.to_string()),
            ..Device::udp(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0).into())
        }
    }

    /// Whether this is the shared-memory device.
    pub fn is_shm(&self) -> bool {
        self.shm
    }

    /// Busy-poll mode. RoCEv2: a thread polling or waiting on one of the
    /// device's CQs receives and handles the device's packets itself,
    /// spinning instead of sleeping, and the progress thread stands by while
    /// it does (within 10 ms of the last poll). A ping-pong then takes no
    /// thread wake-up: lower latency, a CPU spent per polling thread.
    /// iWARP: each connection's receiving thread spins on its socket for up
    /// to 1 ms before it sleeps in `read`, so a stream of FPDUs wakes no
    /// thread; a thread polling one of the device's CQs receives the small
    /// FPDUs whole in its connections' sockets itself, the receiving threads
    /// standing by while polls keep coming (waits still sleep, and leave the
    /// receiving to those threads). The shared-memory device ignores the
    /// mode.
    #[must_use]
    pub fn busy_poll(mut self, on: bool) -> Device {
        self.busy_poll = on;
        self
    }

    /// Share the address with other processes through `softrdma hostd`
    /// (started if none runs; see `docs/multiprocess.md`), instead of binding
    /// it exclusively. Default: the `SOFTRDMA_PORT_SHARING` environment
    /// variable (`hostd` or `exclusive`), else exclusive.
    #[must_use]
    pub fn shared_port(mut self, on: bool) -> Device {
        self.shared_port = Some(on);
        self
    }

    /// Write what the device sends and receives to a pcap file (raw IPv4,
    /// with the IP and UDP headers synthesized), for tshark or
    /// `softrdma decode`.
    #[must_use]
    pub fn pcap(mut self, path: impl Into<std::path::PathBuf>) -> Device {
        self.pcap = Some(path.into());
        self
    }

    /// The link MTU the port's active MTU derives from (default: the
    /// interface's, 1500 if unknown; loopback 65536).
    #[must_use]
    pub fn link_mtu(mut self, mtu: usize) -> Device {
        self.link_mtu = Some(mtu);
        self
    }

    /// Opens the device: binds the socket and starts its progress thread.
    pub fn open(&self) -> Result<Context> {
        if let Some(name) = &self.ibverbs {
            return self.open_ibverbs(name);
        }
        if self.addr.ip().is_unspecified() {
            return Err(VerbsError::Invalid(
                "a device needs a specific IPv4 address (its GID), not 0.0.0.0".into(),
            ));
        }
        let ip = self.addr.ip();
        if ip.is_multicast() || ip.is_broadcast() {
            return Err(VerbsError::Invalid(format!(
                "a device needs a unicast IPv4 address (its GID), not {ip}"
            )));
        }
        let shared_port = match self.shared_port {
            Some(on) => on,
            None => match std::env::var("SOFTRDMA_PORT_SHARING").as_deref() {
                Ok("hostd") => true,
                Ok("exclusive") | Ok("") | Err(_) => false,
                Ok(other) => {
                    return Err(VerbsError::Invalid(format!(
                        "SOFTRDMA_PORT_SHARING={other}: use hostd or exclusive"
                    )));
                }
            },
        };
        if shared_port && self.addr.port() == 0 {
            return Err(VerbsError::Invalid(
                "a shared address needs a port (4791), not 0".into(),
            ));
        }
        let (dev, slot) = if self.shm {
            let events = EventQueue::new().map_err(io_err("cannot open a shm device"))?;
            let events = Arc::new(events);
            events.push(AsyncEvent::PortActive);
            (
                Provider::Shm(ShmDeviceSlot {
                    mrs: Arc::new(RwLock::new(MrTable::new())),
                    events,
                    shm: Arc::new(crate::provider::shm::ShmDevice::default()),
                }),
                0,
            )
        } else if self.iwarp {
            let events = EventQueue::new().map_err(io_err("cannot open an iWARP device"))?;
            let events = Arc::new(events);
            events.push(AsyncEvent::PortActive);
            (
                Provider::Iwarp(IwarpDevice {
                    addr: *self.addr.ip(),
                    mrs: Arc::new(RwLock::new(MrTable::new())),
                    events,
                    busy_poll: Arc::new(AtomicBool::new(self.busy_poll)),
                    connections: Default::default(),
                }),
                0,
            )
        } else {
            let dev = UdpDevice::open(self.addr, self.busy_poll, shared_port, self.pcap.as_deref())
                .map_err(io_err(format!(
                    "cannot open a RoCEv2 device on {}{}",
                    self.addr,
                    if shared_port { " through hostd" } else { "" }
                )))?;
            let slot = dev.shared.slot;
            (Provider::Udp(dev), slot)
        };
        let netdev = crate::provider::netdev::owner_of(*self.addr.ip());
        let link_mtu = self
            .link_mtu
            .or(netdev.as_ref().and_then(|d| d.mtu))
            .unwrap_or(if self.addr.ip().is_loopback() {
                65536
            } else {
                1500
            });
        let gids = gid_table(netdev.and_then(|d| d.mac), *self.addr.ip());
        Ok(Context {
            inner: Arc::new(ContextInner {
                dev,
                qpn_range: qpn_range(slot),
                next_qpn: Mutex::new(*qpn_range(slot).start()),
                cm_qpns: Arc::default(),
                gids,
                active_mtu: Mtu::for_link(link_mtu),
            }),
        })
    }
}

impl Device {
    fn open_ibverbs(&self, name: &str) -> Result<Context> {
        let events = Arc::new(EventQueue::new().map_err(io_err("cannot open an ibverbs device"))?);
        let hw =
            HwContext::open(name, self.busy_poll, events.clone()).map_err(VerbsError::Invalid)?;
        if hw.port_now().0 {
            events.push(AsyncEvent::PortActive);
        }
        let active_mtu = hw.active_mtu();
        let gids = hw.gids.clone();
        Ok(Context {
            inner: Arc::new(ContextInner {
                dev: Provider::Ibverbs(IbverbsDevice {
                    hw,
                    mrs: Arc::new(RwLock::new(MrTable::new())),
                    events,
                    ahs: Arc::default(),
                }),
                qpn_range: qpn_range(0),
                next_qpn: Mutex::new(*qpn_range(0).start()),
                cm_qpns: Arc::default(),
                gids,
                active_mtu,
            }),
        })
    }
}

/// The names of the devices libibverbs lists on this host (none where
/// rdma-core is not installed; an error says why it could not be loaded).
pub fn ibverbs_devices() -> Result<Vec<String>> {
    crate::provider::ibverbs::device_names().map_err(VerbsError::Invalid)
}

/// A libibverbs device.
#[derive(Debug)]
pub(crate) struct IbverbsDevice {
    hw: Arc<HwContext>,
    /// The regions by the device's keys: softrdma's table, which the
    /// device does not consult (it checks keys itself).
    mrs: Arc<RwLock<MrTable>>,
    events: Arc<EventQueue>,
    ahs: Arc<crate::provider::ibverbs::AhTable>,
}

/// The provider behind a context.
#[derive(Debug)]
enum Provider {
    /// RoCEv2 over UDP.
    Udp(UdpDevice),
    /// iWARP over TCP.
    Iwarp(IwarpDevice),
    /// Shared memory.
    Shm(ShmDeviceSlot),
    /// A device of libibverbs.
    Ibverbs(IbverbsDevice),
}

/// A shared-memory device.
#[derive(Debug)]
pub(crate) struct ShmDeviceSlot {
    pub(crate) mrs: Arc<RwLock<MrTable>>,
    pub(crate) events: Arc<EventQueue>,
    pub(crate) shm: Arc<crate::provider::shm::ShmDevice>,
}

/// An iWARP device: an IPv4 address; each QP brings its TCP connection.
#[derive(Debug)]
pub(crate) struct IwarpDevice {
    pub(crate) addr: Ipv4Addr,
    pub(crate) mrs: Arc<RwLock<MrTable>>,
    pub(crate) events: Arc<EventQueue>,
    /// Busy-poll mode, shared with the device's connections.
    pub(crate) busy_poll: Arc<AtomicBool>,
    /// The connections, which polls of the device's CQs work for.
    pub(crate) connections: Arc<crate::provider::tcp::Connections>,
}

impl ContextInner {
    /// The next QPN of the device's range that `in_use` does not claim.
    fn take_qpn(&self, in_use: impl Fn(u32) -> bool) -> Result<u32> {
        let mut next = self.next_qpn.lock().expect("QPN lock");
        let range = &self.qpn_range;
        let first = *next;
        loop {
            let q = *next;
            *next = if q >= *range.end() {
                *range.start()
            } else {
                q + 1
            };
            if !in_use(q) {
                return Ok(q);
            }
            if *next == first {
                return Err(VerbsError::Invalid(format!(
                    "all {} QP numbers of the device are in use",
                    range.clone().count()
                )));
            }
        }
    }

    /// A QPN for an iWARP or shm QP, which have no QP table: their numbers
    /// appear only in completions and events, where two live QPs must not
    /// share one. Held until the lease drops.
    pub(crate) fn take_cm_qpn(&self) -> Result<QpnLease> {
        let mut live = self.cm_qpns.lock().expect("QPN set lock");
        let qpn = self.take_qpn(|q| live.contains(&q))?;
        live.insert(qpn);
        Ok(QpnLease {
            live: self.cm_qpns.clone(),
            qpn,
        })
    }

    fn mrs(&self) -> &Arc<RwLock<MrTable>> {
        match &self.dev {
            Provider::Udp(d) => &d.shared.mrs,
            Provider::Iwarp(d) => &d.mrs,
            Provider::Shm(d) => &d.mrs,
            Provider::Ibverbs(d) => &d.mrs,
        }
    }

    fn events(&self) -> &Arc<EventQueue> {
        match &self.dev {
            Provider::Udp(d) => &d.shared.events,
            Provider::Iwarp(d) => &d.events,
            Provider::Shm(d) => &d.events,
            Provider::Ibverbs(d) => &d.events,
        }
    }

    pub(crate) fn udp(&self, what: &str) -> Result<&UdpDevice> {
        match &self.dev {
            Provider::Udp(d) => Ok(d),
            Provider::Iwarp(_) => Err(VerbsError::Invalid(format!(
                "{what} is for RoCEv2 devices; this one is iWARP"
            ))),
            Provider::Shm(_) => Err(VerbsError::Invalid(format!(
                "{what} is for RoCEv2 devices; this one is shared memory"
            ))),
            Provider::Ibverbs(_) => Err(VerbsError::Invalid(format!(
                "{what} is for software RoCEv2 devices; this one is libibverbs'"
            ))),
        }
    }

    fn ibverbs(&self) -> Option<&IbverbsDevice> {
        match &self.dev {
            Provider::Ibverbs(d) => Some(d),
            _ => None,
        }
    }
}

#[derive(Debug)]
struct ContextInner {
    dev: Provider,
    /// The QPNs this device hands out: a hostd slot's, or all but 0..0x11.
    qpn_range: std::ops::RangeInclusive<u32>,
    next_qpn: Mutex<u32>,
    /// The QPNs of live iWARP and shm QPs.
    cm_qpns: Arc<Mutex<std::collections::HashSet<u32>>>,
    gids: Vec<[u8; 16]>,
    active_mtu: Mtu,
}

/// An iWARP or shm QP's number, given back when dropped: the last field of
/// its slot, so that the connection's flushes and events, which carry the
/// number, come before another QP can have it.
#[derive(Debug)]
pub(crate) struct QpnLease {
    live: Arc<Mutex<std::collections::HashSet<u32>>>,
    qpn: u32,
}

impl QpnLease {
    pub(crate) fn qpn(&self) -> u32 {
        self.qpn
    }
}

impl Drop for QpnLease {
    fn drop(&mut self) {
        self.live.lock().expect("QPN set lock").remove(&self.qpn);
    }
}

/// The number of a new PD, CQ, SRQ or address handle: unique in the
/// process, so that one of another context (or kind) is never taken for
/// this one's (an address handle of another context sent to this
/// context's handle of the same number), and 64-bit, so that it never
/// wraps onto a live one.
fn next_object_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// QPNs of a device: slot 0 (exclusive) has 0x11..=0xfeffff; a hostd slot
/// the 65536 QPNs with it as top byte, from 0x11 up.
fn qpn_range(slot: u8) -> std::ops::RangeInclusive<u32> {
    if slot == 0 {
        0x11..=0xfe_ffff
    } else {
        let base = u32::from(slot) << 16;
        base | 0x11..=base | 0xffff
    }
}

/// The GID index of a device's IPv4 address (as rxe's: `-g 1`, `-x 1`).
pub const IPV4_GID_INDEX: usize = 1;

/// A RoCEv2 device of this host: one per IPv4 address of an interface that
/// is up, named `roce_<netdev>` (`roce_<netdev>:<n>` for its further
/// addresses), as rxe makes `rxe0` on a netdev.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name (`roce_eth0`).
    pub name: String,
    /// The interface.
    pub netdev: String,
    /// Its IPv4 address.
    pub addr: Ipv4Addr,
    /// The interface's MTU.
    pub link_mtu: Option<usize>,
    /// The GID table (see [`PortAttr::gids`]).
    pub gids: Vec<[u8; 16]>,
    /// A loopback interface's.
    pub loopback: bool,
}

impl DeviceInfo {
    /// The device, to open, on UDP port 4791.
    pub fn device(&self) -> Device {
        let d = Device::udp(SocketAddrV4::new(self.addr, 4791).into());
        match self.link_mtu {
            Some(m) => d.link_mtu(m),
            None => d,
        }
    }
}

/// A device's GID table, laid out as rxe's: the IPv6 link-local GID from
/// the interface's MAC (zero without one), then the IPv4-mapped address.
fn gid_table(mac: Option<[u8; 6]>, ip: Ipv4Addr) -> Vec<[u8; 16]> {
    vec![
        mac.map_or([0; 16], crate::provider::netdev::link_local_gid),
        softrdma_wire::grh::ipv4_mapped(ip.octets()),
    ]
}

/// The RoCEv2 devices of this host, in interface order.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let netdevs = crate::provider::netdev::interfaces()
        .map_err(io_err("cannot list the network interfaces"))?;
    let mut out = Vec::new();
    for d in netdevs {
        for (n, &ip) in d.ipv4.iter().enumerate() {
            out.push(DeviceInfo {
                name: if n == 0 {
                    format!("roce_{}", d.name)
                } else {
                    format!("roce_{}:{n}", d.name)
                },
                netdev: d.name.clone(),
                addr: ip,
                link_mtu: d.mtu,
                gids: gid_table(d.mac, ip),
                loopback: d.loopback,
            });
        }
    }
    Ok(out)
}

/// Port attributes (`ibv_query_port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttr {
    /// Port state: active once the device is open.
    pub state: PortState,
    /// Largest MTU: 4096.
    pub max_mtu: Mtu,
    /// The MTU the link allows.
    pub active_mtu: Mtu,
    /// GID table, laid out as rxe's: index 0 the IPv6 link-local GID made
    /// from the interface's MAC (zero without one; softrdma does not send
    /// IPv6 yet), index [`IPV4_GID_INDEX`] the device's IPv4-mapped address.
    pub gids: Vec<[u8; 16]>,
    /// The UDP port the device listens on.
    pub udp_port: u16,
}

/// Work requests a send, receive or shared receive queue holds at most.
const MAX_QP_WR: u32 = 1 << 16;
/// Completions a CQ holds at most.
const MAX_CQE: u32 = 1 << 22;

/// Device attributes (`ibv_query_device`): the limits `create_*`, `post_*`
/// and `modify` enforce on this device, and what it can do.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// The softrdma version (ibverbs' firmware version).
    pub fw_ver: String,
    /// QPs the device numbers apart (its QP number range).
    pub max_qp: u32,
    /// Work requests a send or receive queue holds.
    pub max_qp_wr: u32,
    /// Scatter/gather elements of a send work request.
    pub max_send_sge: u32,
    /// Scatter/gather elements of a receive work request.
    pub max_recv_sge: u32,
    /// Bytes of inline data a send may carry (a QP asks for its own at
    /// create time).
    pub max_inline_data: u32,
    /// Completions a CQ holds.
    pub max_cqe: u32,
    /// Incoming RDMA READs and atomics a QP serves at once
    /// (`max_dest_rd_atomic`; iWARP's IRD). Shared memory has no such
    /// limit (the initiator reads the peer's memory itself).
    pub max_qp_rd_atom: u32,
    /// Outgoing RDMA READs and atomics a QP has at once (`max_rd_atomic`;
    /// iWARP's ORD); shared memory, as above.
    pub max_qp_init_rd_atom: u32,
    /// Atomic operations.
    pub atomic_cap: AtomicCap,
    /// Receives an SRQ holds; 0 where the device has no SRQs.
    pub max_srq_wr: u32,
    /// Scatter/gather elements of an SRQ's receive; 0 without SRQs.
    pub max_srq_sge: u32,
    /// Whether it has UD QPs.
    pub ud: bool,
    /// The longest RC message (a UD message is one packet: the port's
    /// active MTU, `query_port`).
    pub max_msg_sz: u64,
    /// The largest memory region.
    pub max_mr_size: u64,
}

/// What a device's atomic operations are atomic against
/// (`ibv_device_attr.atomic_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AtomicCap {
    /// No atomic operations (iWARP: RFC 5040 has none).
    None,
    /// Atomic against this device's other atomics (IBV_ATOMIC_HCA).
    Hca,
    /// Atomic against the CPU's atomics and other devices' too
    /// (IBV_ATOMIC_GLOB): softrdma runs them as the CPU's own atomic
    /// read-modify-writes on the target word.
    Glob,
}

/// Port states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// Up.
    Active,
    /// Down.
    Down,
}

/// An open device.
#[derive(Debug, Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

impl Context {
    /// The RoCEv2 device, for `cm::roce`.
    pub(crate) fn roce_device(&self, what: &str) -> Result<&UdpDevice> {
        self.inner.udp(what)
    }

    /// The device's address and UDP port.
    pub fn local_addr(&self) -> SocketAddrV4 {
        match &self.inner.dev {
            Provider::Udp(d) => d.local_addr(),
            Provider::Iwarp(d) => SocketAddrV4::new(d.addr, 0),
            Provider::Shm(_) => SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0),
            Provider::Ibverbs(d) => SocketAddrV4::new(d.hw.addr, 4791),
        }
    }

    /// Whether this is a libibverbs device.
    pub fn is_ibverbs(&self) -> bool {
        matches!(self.inner.dev, Provider::Ibverbs(_))
    }

    /// Whether this is a shared-memory device.
    pub fn is_shm(&self) -> bool {
        matches!(self.inner.dev, Provider::Shm(_))
    }

    /// Whether this is an iWARP device (softrdma's, or an RNIC through
    /// libibverbs).
    pub fn is_iwarp(&self) -> bool {
        match &self.inner.dev {
            Provider::Iwarp(_) => true,
            Provider::Ibverbs(d) => d.hw.iwarp,
            _ => false,
        }
    }

    /// The libibverbs device, for `cm`'s rdma_cm through librdmacm.
    pub(crate) fn hw(&self) -> Option<&Arc<HwContext>> {
        self.inner.ibverbs().map(|d| &d.hw)
    }

    /// The device's attributes and limits (`ibv_query_device`).
    pub fn query_device(&self) -> DeviceAttr {
        if let Some(d) = self.inner.ibverbs() {
            return d.hw.device_attr();
        }
        let range = &self.inner.qpn_range;
        let roce = matches!(self.inner.dev, Provider::Udp(_));
        let max_rd = u32::from(crate::engine::qp::MAX_RD_ATOMIC);
        DeviceAttr {
            fw_ver: env!("CARGO_PKG_VERSION").to_string(),
            max_qp: range.end() - range.start() + 1,
            max_qp_wr: MAX_QP_WR,
            max_send_sge: MAX_SGE as u32,
            max_recv_sge: match &self.inner.dev {
                Provider::Shm(_) => crate::provider::shm::MAX_RECV_SGE as u32,
                _ => MAX_SGE as u32,
            },
            max_inline_data: crate::engine::MAX_INLINE_DATA,
            max_cqe: MAX_CQE,
            max_qp_rd_atom: max_rd,
            max_qp_init_rd_atom: max_rd,
            atomic_cap: if self.is_iwarp() {
                AtomicCap::None
            } else {
                AtomicCap::Glob
            },
            max_srq_wr: if self.is_shm() { 0 } else { MAX_QP_WR },
            max_srq_sge: if self.is_shm() { 0 } else { MAX_SGE as u32 },
            ud: roce,
            max_msg_sz: crate::engine::rc::MAX_MESSAGE_LEN,
            max_mr_size: usize::MAX as u64,
        }
    }

    /// The port's attributes.
    pub fn query_port(&self) -> PortAttr {
        let a = self.local_addr();
        if let Some(d) = self.inner.ibverbs() {
            let (active, max_mtu, active_mtu) = d.hw.port_now();
            return PortAttr {
                state: if active {
                    PortState::Active
                } else {
                    PortState::Down
                },
                max_mtu,
                active_mtu,
                gids: self.inner.gids.clone(),
                udp_port: a.port(),
            };
        }
        PortAttr {
            state: if self.inner.udp("").is_ok_and(|d| d.shared.port_up())
                || self.is_iwarp()
                || self.is_shm()
            {
                PortState::Active
            } else {
                PortState::Down
            },
            max_mtu: Mtu::Mtu4096,
            active_mtu: self.inner.active_mtu,
            gids: self.inner.gids.clone(),
            udp_port: a.port(),
        }
    }

    /// The device's counters.
    pub fn stats(&self) -> DeviceCounters {
        let Provider::Udp(d) = &self.inner.dev else {
            return DeviceCounters::default();
        };
        let s = &d.shared.stats;
        DeviceCounters {
            sent: s.sent.load(Ordering::Relaxed),
            received: s.received.load(Ordering::Relaxed),
            bad_icrc: s.bad_icrc.load(Ordering::Relaxed),
            no_qp: s.no_qp.load(Ordering::Relaxed),
            bad_header: s.bad_header.load(Ordering::Relaxed),
            cm_rejects: s.cm_rejects.load(Ordering::Relaxed),
            wrong_source: s.wrong_source.load(Ordering::Relaxed),
            send_errors: s.send_errors.load(Ordering::Relaxed),
            polled: s.polled.load(Ordering::Relaxed),
        }
    }

    /// Busy polling on or off.
    pub fn set_busy_poll(&self, on: bool) {
        match &self.inner.dev {
            Provider::Udp(d) => d.set_busy_poll(on),
            Provider::Iwarp(d) => {
                d.busy_poll.store(on, Ordering::SeqCst);
                if !on {
                    d.connections.busy_poll_ended();
                }
            }
            Provider::Shm(_) => {}
            Provider::Ibverbs(d) => d.hw.busy_poll.store(on, Ordering::Relaxed),
        }
    }

    /// A protection domain.
    pub fn alloc_pd(&self) -> Result<Pd> {
        let hw = match self.inner.ibverbs() {
            Some(d) => Some(HwPd::new(&d.hw).map_err(VerbsError::Invalid)?),
            None => None,
        };
        Ok(Pd {
            ctx: self.clone(),
            id: next_object_id(),
            hw,
        })
    }

    /// A completion queue holding `capacity` completions.
    pub fn create_cq(&self, capacity: usize) -> Result<Cq> {
        if capacity == 0 || capacity > MAX_CQE as usize {
            return Err(VerbsError::Invalid(format!(
                "CQ capacity {capacity} is outside 1..={MAX_CQE}"
            )));
        }
        let id = next_object_id();
        let cq = Cq::new(capacity, id, Some(self.inner.events().clone()))
            .map_err(io_err("cannot create a completion queue"))?;
        Ok(match &self.inner.dev {
            Provider::Udp(d) => cq.driven_by(&d.shared),
            Provider::Iwarp(d) => cq.polls_connections(&d.connections, &d.busy_poll),
            Provider::Shm(_) => cq,
            Provider::Ibverbs(d) => cq.on_hardware(Arc::new(
                HwCq::new(&d.hw, capacity, id).map_err(VerbsError::Invalid)?,
            )),
        })
    }

    /// The next asynchronous event, if one is waiting (`ibv_get_async_event`
    /// without blocking; events need no acknowledging).
    pub fn poll_async_event(&self) -> Option<AsyncEvent> {
        self.inner.events().poll()
    }

    /// Waits up to `timeout` for an asynchronous event.
    pub fn wait_async_event(&self, timeout: std::time::Duration) -> Option<AsyncEvent> {
        self.inner.events().wait(timeout)
    }

    /// Events dropped because the queue was full: it keeps the newest 4096,
    /// so an application that does not read events loses the oldest.
    pub fn async_events_dropped(&self) -> u64 {
        self.inner.events().dropped()
    }

    /// A descriptor that is readable while asynchronous events wait (epoll/tokio).
    pub fn async_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.inner.events().as_fd()
    }
}

/// Device counters (RoCEv2; zero on iWARP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DeviceCounters {
    /// Datagrams sent.
    pub sent: u64,
    /// Datagrams received.
    pub received: u64,
    /// Received with a bad ICRC (dropped).
    pub bad_icrc: u64,
    /// Received for no known QP (dropped).
    pub no_qp: u64,
    /// Received with a BTH transport version other than 0 or a P_Key
    /// outside the default partition (dropped, as rxe does).
    pub bad_header: u64,
    /// CM messages the device refused itself, nothing here taking them:
    /// REQs (and REPs for no exchange) answered with a REJ, SIDR_REQs with
    /// a SIDR_REP that finds no QP, each once (not its replays). An
    /// application's refusals are not counted.
    pub cm_rejects: u64,
    /// Dropped: for an RC QP, from an address that is not its peer's.
    pub wrong_source: u64,
    /// Datagrams the kernel refused to send.
    pub send_errors: u64,
    /// Of the datagrams received, those an application thread polling a CQ
    /// took (busy-poll mode; the device's progress thread took the rest).
    pub polled: u64,
}

/// A protection domain: memory regions and queue pairs in one may work together.
#[derive(Debug)]
pub struct Pd {
    ctx: Context,
    id: PdId,
    /// The device's PD (libibverbs devices).
    hw: Option<Arc<HwPd>>,
}

fn random_key(taken: impl Fn(u32) -> bool) -> Result<u32> {
    loop {
        let k = getrandom::u32()
            .map_err(|e| VerbsError::Invalid(format!("no randomness for keys: {e}")))?;
        if k != 0 && !taken(k) {
            return Ok(k);
        }
    }
}

impl Pd {
    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    fn check_access(access: Access) -> Result<()> {
        if access.needs_local_write() && !access.contains(Access::LOCAL_WRITE) {
            return Err(VerbsError::Invalid(format!(
                "access {access} needs LOCAL_WRITE too (remote write and atomic rights require it)"
            )));
        }
        Ok(())
    }

    fn insert(&self, memory: RegionMemory, access: Access) -> Result<Mr> {
        let memory = Arc::new(memory);
        let hw = match &self.hw {
            Some(pd) => Some(HwMr::register(pd, &memory, access).map_err(|e| {
                VerbsError::Invalid(format!("cannot register {} bytes: {e}", memory.len()))
            })?),
            None => None,
        };
        let mut mrs = self.ctx.inner.mrs().write().expect("MR table lock");
        let (lkey, rkey) = match &hw {
            Some(mr) => mr.keys(),
            None => {
                let lkey = random_key(|k| mrs.key_in_use(k))?;
                (lkey, random_key(|k| k == lkey || mrs.key_in_use(k))?)
            }
        };
        let len = memory.len();
        let iova = memory.addr();
        let region = Region::new(self.id, (lkey, rkey), memory, 0, len, iova, access)?;
        let region = mrs.insert(region);
        Ok(Mr {
            ctx: self.ctx.clone(),
            hw,
            region,
        })
    }

    /// A shared receive queue of `max_wr` receives with up to `max_sge` SGEs.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Srq> {
        if matches!(self.ctx.inner.dev, Provider::Shm(_)) {
            return Err(VerbsError::Invalid(
                "shared receive queues are not supported on shm devices yet".into(),
            ));
        }
        if max_wr == 0 || max_wr > MAX_QP_WR || max_sge as usize > MAX_SGE {
            return Err(VerbsError::Invalid(format!(
                "an SRQ needs 1..={MAX_QP_WR} receives and at most {MAX_SGE} SGEs each"
            )));
        }
        let id = next_object_id();
        let hw = match &self.hw {
            Some(pd) => Some(Arc::new(
                HwSrq::new(pd, max_wr, max_sge, id).map_err(VerbsError::Invalid)?,
            )),
            None => None,
        };
        Ok(Srq {
            ctx: self.ctx.clone(),
            id,
            inner: Arc::new(Mutex::new(crate::engine::srq::Srq::new(
                self.id, max_wr, max_sge,
            ))),
            hw,
        })
    }

    /// An address handle to the sender of a UD receive (`ibv_create_ah_from_wc`);
    /// see [`AhAttr::from_wc`].
    pub fn create_ah_from_wc(&self, wc: &WorkCompletion, grh: &[u8]) -> Result<Ah> {
        self.create_ah(AhAttr::from_wc(wc, grh)?)
    }

    /// An address handle for UD sends to `attr`.
    pub fn create_ah(&self, attr: AhAttr) -> Result<Ah> {
        if attr.addr.ip().is_unspecified() || attr.addr.port() == 0 {
            return Err(VerbsError::Invalid(format!(
                "{} is not a destination",
                attr.addr
            )));
        }
        let id = AhId(next_object_id());
        if let (Some(d), Some(pd)) = (self.ctx.inner.ibverbs(), &self.hw) {
            let ah = HwAh::new(pd, *attr.addr.ip()).map_err(VerbsError::Invalid)?;
            d.ahs
                .write()
                .expect("AH table lock")
                .insert(id.0, Arc::new(ah));
            return Ok(Ah {
                ctx: self.ctx.clone(),
                id,
                attr,
            });
        }
        let dev = self.ctx.inner.udp("an address handle")?;
        dev.shared
            .ahs
            .write()
            .expect("AH table lock")
            .insert(id.0, (attr.addr, self.id));
        Ok(Ah {
            ctx: self.ctx.clone(),
            id,
            attr,
        })
    }

    /// Registers `len` bytes of zeroed, page-aligned memory the library allocates.
    pub fn register(&self, len: usize, access: Access) -> Result<Mr> {
        Self::check_access(access)?;
        if let Provider::Shm(d) = &self.ctx.inner.dev {
            // Shared memory that peers map.
            let (memory, fd) = d.shm.allocate(len).map_err(|e| VerbsError::Io {
                what: format!("cannot allocate a {len}-byte shared region"),
                source: e,
            })?;
            let mr = self.insert(memory, access)?;
            d.shm.registered(crate::provider::shm::SharedRegion {
                pd: self.id,
                lkey: mr.lkey(),
                rkey: mr.rkey(),
                iova: mr.addr(),
                len,
                access,
                fd,
            });
            return Ok(mr);
        }
        let memory = RegionMemory::zeroed(len)
            .ok_or_else(|| VerbsError::Invalid(format!("cannot allocate a {len}-byte region")))?;
        self.insert(memory, access)
    }

    /// Registers a buffer the caller provides; [`Mr::deregister`] gives it back.
    pub fn register_vec(&self, buf: Vec<u8>, access: Access) -> Result<Mr> {
        Self::check_access(access)?;
        if let Provider::Shm(_) = &self.ctx.inner.dev {
            return Err(VerbsError::Invalid(
                "a shm region must be shared memory: allocate it with Pd::register".into(),
            ));
        }
        self.insert(RegionMemory::from_vec(buf), access)
    }

    /// The CQs and SRQ a QP is given must be of its device context: their
    /// events go to that context, and a busy-polling CQ drives only its own
    /// device (ib_uverbs cannot even name another context's objects).
    fn check_same_context(&self, init: &QpInit<'_>) -> Result<()> {
        let ours = self.ctx.inner.events();
        for (cq, which) in [(init.send_cq, "send"), (init.recv_cq, "receive")] {
            if !cq.inner.reports_to(ours) {
                return Err(VerbsError::Invalid(format!(
                    "the {which} CQ belongs to another device context"
                )));
            }
        }
        if init
            .srq
            .is_some_and(|s| !Arc::ptr_eq(&s.ctx.inner, &self.ctx.inner))
        {
            return Err(VerbsError::Invalid(
                "the SRQ belongs to another device context".into(),
            ));
        }
        Ok(())
    }

    /// Creates a queue pair in this domain.
    pub fn create_qp(&self, init: &QpInit<'_>) -> Result<Qp> {
        let caps = init.caps;
        if caps.max_send_sge as usize > MAX_SGE || caps.max_recv_sge as usize > MAX_SGE {
            return Err(VerbsError::Invalid(format!(
                "at most {MAX_SGE} scatter/gather elements per work request"
            )));
        }
        if caps.max_send_wr == 0 || caps.max_send_wr > MAX_QP_WR || caps.max_recv_wr > MAX_QP_WR {
            return Err(VerbsError::Invalid(format!(
                "queue depths must be 1..={MAX_QP_WR}"
            )));
        }
        if caps.max_inline_data > crate::engine::MAX_INLINE_DATA {
            return Err(VerbsError::Invalid(format!(
                "at most {} bytes of inline data",
                crate::engine::MAX_INLINE_DATA
            )));
        }
        // An SRQ is of a RoCEv2 or iWARP device (`create_srq`): an shm QP
        // is refused one here.
        self.check_same_context(init)?;
        if let Provider::Iwarp(_) = &self.ctx.inner.dev {
            return self.create_iwarp_qp(init);
        }
        if let Provider::Shm(_) = &self.ctx.inner.dev {
            return self.create_shm_qp(init);
        }
        if let Some(d) = self.ctx.inner.ibverbs() {
            return self.create_hw_qp(d, init);
        }
        let shared = &self.ctx.inner.udp("a QP")?.shared;
        if init.qp_type == QpType::Ud {
            // A UD receive's GRH carries the datagram's TTL and TOS.
            shared
                .want_ip_fields()
                .map_err(io_err("asking the sockets for TTL and TOS"))?;
        }
        let mut qps = shared.qps.write().expect("QP table lock");
        // Under the table's lock: a failing device fails every QP it holds.
        if shared.is_fatal() {
            return Err(device_failed());
        }
        let qpn = self.ctx.inner.take_qpn(|q| qps.contains_key(&q))?;
        let mtu = self.ctx.inner.active_mtu;
        let engine = match (init.qp_type, init.srq) {
            (QpType::Rc, None) => QpEngine::Rc(RcQp::new(qpn, self.id, caps)),
            (QpType::Rc, Some(s)) => {
                QpEngine::Rc(RcQp::with_srq(qpn, self.id, caps, s.inner.clone()))
            }
            (QpType::Ud, None) => QpEngine::Ud(UdQp::new(qpn, self.id, caps, mtu)),
            (QpType::Ud, Some(s)) => {
                QpEngine::Ud(UdQp::with_srq(qpn, self.id, caps, mtu, s.inner.clone()))
            }
        };
        let slot = Arc::new(QpSlot::new(
            engine,
            init.send_cq.inner.clone(),
            init.recv_cq.inner.clone(),
            init.srq.map(|s| (s.id, s.inner.clone())),
        ));
        qps.insert(qpn, slot.clone());
        Ok(Qp {
            ctx: self.ctx.clone(),
            kind: QpKind::Roce(slot),
        })
    }
}

impl Pd {
    fn create_hw_qp(&self, d: &IbverbsDevice, init: &QpInit<'_>) -> Result<Qp> {
        let (Some(pd), Some(scq), Some(rcq)) = (&self.hw, &init.send_cq.hw, &init.recv_cq.hw)
        else {
            unreachable!("a libibverbs context's PDs and CQs are the device's");
        };
        let srq = init.srq.and_then(|s| s.hw.as_ref());
        let qp = HwQp::new(pd, init.qp_type, init.caps, scq, rcq, srq, &d.ahs)
            .map_err(|e| VerbsError::Invalid(format!("{}: {e}", d.hw.name)))?;
        Ok(Qp {
            ctx: self.ctx.clone(),
            kind: QpKind::Hw(Arc::new(qp)),
        })
    }
}

/// What a RoCEv2 device whose progress thread died answers.
fn device_failed() -> VerbsError {
    VerbsError::Invalid(
        "the device failed (its progress thread stopped; see AsyncEvent::DeviceFatal): \
         open it again"
            .into(),
    )
}

/// A shared receive queue: receives that several QPs draw from.
#[derive(Debug)]
pub struct Srq {
    /// Keeps the device open while the SRQ lives.
    ctx: Context,
    id: u64,
    inner: Arc<Mutex<crate::engine::srq::Srq>>,
    /// The device's SRQ (libibverbs devices), which `inner` then is not.
    hw: Option<Arc<HwSrq>>,
}

impl Srq {
    /// The SRQ's number (as async events name it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Posts a receive any QP on the SRQ may take.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        if let Some(hw) = &self.hw {
            return Ok(hw.post_recv(&wr)?);
        }
        Ok(self.inner.lock().expect("SRQ lock").post_recv(wr)?)
    }

    /// Arms the limit (`ibv_modify_srq`): one [`AsyncEvent::SrqLimitReached`]
    /// when fewer than `limit` receives remain; 0 disarms.
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        if let Some(hw) = &self.hw {
            return hw.arm_limit(limit).map_err(VerbsError::Invalid);
        }
        Ok(self.inner.lock().expect("SRQ lock").arm_limit(limit)?)
    }

    /// Receives waiting, the armed limit (0: none) and the size. A
    /// libibverbs device's SRQ reports no count (0) and no limit here.
    pub fn query(&self) -> (usize, u32, u32) {
        if let Some(hw) = &self.hw {
            return (0, 0, hw.max_wr);
        }
        let s = self.inner.lock().expect("SRQ lock");
        (s.len(), s.limit(), s.max_wr())
    }
}

/// Where an address handle points: a device's IPv4 address and UDP port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AhAttr {
    /// IPv4 address and UDP port (4791 for rxe and NICs).
    pub addr: SocketAddrV4,
}

impl AhAttr {
    /// The sender of a UD receive, as `ibv_init_ah_from_wc` finds it: the
    /// source address in the GRH area that starts the receive buffer
    /// (`grh`: its first 40 bytes), and RoCEv2's port 4791, where every
    /// RoCEv2 peer receives (a softrdma device on another port cannot be
    /// answered this way).
    pub fn from_wc(wc: &WorkCompletion, grh: &[u8]) -> Result<AhAttr> {
        let invalid = |why: String| VerbsError::Invalid(format!("no sender to answer: {why}"));
        if !wc.grh {
            return Err(invalid("the completion carries no GRH".into()));
        }
        let area = grh
            .get(..softrdma_wire::grh::HEADER_LEN)
            .ok_or_else(|| invalid(format!("{} bytes are shorter than a GRH", grh.len())))?;
        let header =
            softrdma_wire::grh::Header::new_checked(area).map_err(|e| invalid(e.to_string()))?;
        match softrdma_wire::grh::Repr::parse(&header).map_err(|e| invalid(e.to_string()))? {
            softrdma_wire::grh::Repr::Ipv4 { src, .. } => Ok(AhAttr {
                addr: SocketAddrV4::new(Ipv4Addr::from(src), 4791),
            }),
            softrdma_wire::grh::Repr::Ipv6 { .. } => Err(invalid(
                "an IPv6 sender, and softrdma's RoCEv2 is IPv4 only".into(),
            )),
        }
    }
}

/// An address handle: a destination for UD sends; destroyed when dropped.
#[derive(Debug)]
pub struct Ah {
    ctx: Context,
    id: AhId,
    attr: AhAttr,
}

impl Ah {
    /// The handle's number.
    pub fn id(&self) -> AhId {
        self.id
    }
    /// Where it points.
    pub fn attr(&self) -> AhAttr {
        self.attr
    }
    /// A UD destination: this address, the remote QP and its Q_Key.
    pub fn dest(&self, remote_qpn: u32, remote_qkey: u32) -> UdDest {
        UdDest {
            ah: self.id,
            remote_qpn,
            remote_qkey,
        }
    }
}

impl Drop for Ah {
    fn drop(&mut self) {
        if let Some(d) = self.ctx.inner.ibverbs() {
            d.ahs.write().expect("AH table lock").remove(&self.id.0);
        }
        if let Provider::Udp(d) = &self.ctx.inner.dev {
            d.shared
                .ahs
                .write()
                .expect("AH table lock")
                .remove(&self.id.0);
        }
    }
}

/// A registered memory region. Remote peers may write it at any time (if its
/// rights allow), so it is read and written by copy, never through a plain
/// slice; deregistered when dropped.
#[derive(Debug)]
pub struct Mr {
    ctx: Context,
    /// The device's registration (libibverbs devices): dropped first.
    hw: Option<HwMr>,
    region: Arc<Region>,
}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.region.lkey
    }
    /// Remote key (what a peer needs, with [`Mr::addr`]).
    pub fn rkey(&self) -> u32 {
        self.region.rkey
    }
    /// The address of the first byte, as SGEs and peers name it.
    pub fn addr(&self) -> u64 {
        self.region.iova
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.region.len
    }
    /// The region is empty.
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }
    /// Rights.
    pub fn access(&self) -> Access {
        self.region.access
    }

    fn range(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.region.len) {
            return Err(VerbsError::Access(AccessError::OutOfBounds {
                key: self.region.lkey,
                addr: self.region.iova.wrapping_add(offset as u64),
                len: len as u64,
            }));
        }
        Ok(())
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.range(offset, data.len())?;
        self.region.memory().write(offset, data);
        Ok(())
    }

    /// Copies from the region at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.range(offset, out.len())?;
        self.region.memory().read(offset, out);
        Ok(())
    }

    /// Copies `len` bytes from `offset` into a new vector.
    pub fn read_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// Reads the 8-byte word at `offset` atomically (host order, as remote
    /// atomics leave it).
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        self.range(offset, 8)?;
        if !(self.region.memory().addr() + offset as u64).is_multiple_of(8) {
            return Err(VerbsError::Access(AccessError::Unaligned(
                self.addr() + offset as u64,
            )));
        }
        // A plain load: polling must not take the line from its writer.
        Ok(self.region.memory().load(offset))
    }

    /// An SGE for `len` bytes at `offset` of this region.
    pub fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr() + offset as u64,
            len,
            lkey: self.lkey(),
        }
    }

    /// Deregisters now; returns the caller's buffer for a region made by
    /// [`Pd::register_vec`] (unless a transfer still holds it).
    pub fn deregister(self) -> Option<Vec<u8>> {
        let region = self.region.clone();
        drop(self);
        let region = Arc::try_unwrap(region).ok()?;
        Arc::try_unwrap(region.into_memory()).ok()?.into_vec()
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // The device stops using the memory before it can be freed.
        drop(self.hw.take());
        if let Provider::Shm(d) = &self.ctx.inner.dev {
            // Peers let go of it first: no access with its keys after this.
            d.shm.deregistered(self.region.lkey);
        }
        self.ctx
            .inner
            .mrs()
            .write()
            .expect("MR table lock")
            .remove(self.region.lkey);
        if let Provider::Shm(d) = &self.ctx.inner.dev {
            // Then the QPs that used it (no copy holds the table's lock).
            d.shm.forget_local(self.region.lkey);
        }
    }
}

/// What a queue pair is created with.
#[derive(Debug, Clone, Copy)]
pub struct QpInit<'a> {
    /// Transport type.
    pub qp_type: QpType,
    /// Where send completions go.
    pub send_cq: &'a Cq,
    /// Where receive completions go.
    pub recv_cq: &'a Cq,
    /// Capacities.
    pub caps: QpCaps,
    /// Take receives from this shared receive queue.
    pub srq: Option<&'a Srq>,
}

impl<'a> QpInit<'a> {
    /// An RC QP with default capacities.
    pub fn rc(send_cq: &'a Cq, recv_cq: &'a Cq) -> QpInit<'a> {
        QpInit {
            qp_type: QpType::Rc,
            send_cq,
            recv_cq,
            caps: QpCaps::default(),
            srq: None,
        }
    }

    /// A UD QP with default capacities.
    pub fn ud(send_cq: &'a Cq, recv_cq: &'a Cq) -> QpInit<'a> {
        QpInit {
            qp_type: QpType::Ud,
            send_cq,
            recv_cq,
            caps: QpCaps::default(),
            srq: None,
        }
    }

    /// With these capacities.
    #[must_use]
    pub fn caps(mut self, caps: QpCaps) -> QpInit<'a> {
        self.caps = caps;
        self
    }

    /// Taking its receives from `srq`.
    #[must_use]
    pub fn srq(mut self, srq: &'a Srq) -> QpInit<'a> {
        self.srq = Some(srq);
        self
    }
}

/// Where the peer QP is: its device's address and UDP port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressVector {
    /// IPv4 address and UDP port (4791 for rxe and NICs).
    pub addr: SocketAddrV4,
}

impl fmt::Display for AddressVector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.addr)
    }
}

/// A queue pair; destroyed when dropped (its peer then sees its requests time out).
#[derive(Debug)]
pub struct Qp {
    ctx: Context,
    kind: QpKind,
}

#[derive(Debug)]
enum QpKind {
    Roce(Arc<QpSlot>),
    Iwarp(Arc<iwarp::IwarpSlot>),
    Shm(Arc<shm::ShmSlot>),
    Hw(Arc<HwQp>),
}

impl Qp {
    /// QP number.
    pub fn qpn(&self) -> u32 {
        match &self.kind {
            QpKind::Roce(s) => s.qpn,
            QpKind::Iwarp(s) => s.qpn,
            QpKind::Shm(s) => s.qpn,
            QpKind::Hw(q) => q.qpn,
        }
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// A libibverbs device's QP, for `cm`'s rdma_cm through librdmacm.
    pub(crate) fn hw(&self) -> Option<&Arc<HwQp>> {
        match &self.kind {
            QpKind::Hw(q) => Some(q),
            _ => None,
        }
    }

    /// The error for a verb an iWARP or shm QP doesn't take.
    fn brought_up_by_cm(&self, what: &str) -> VerbsError {
        VerbsError::Invalid(match &self.kind {
            QpKind::Shm(_) => format!(
                "{what}: a shm QP is brought up by cm::shm (connect or accept); \
                 modify takes only qp_access_flags (in the QP's state) and a move to ERR"
            ),
            _ => format!(
                "{what}: an iWARP QP is brought up by cm::iwarp (connect or accept), \
                 which runs the MPA exchange; modify takes only qp_access_flags (in the \
                 QP's state) and a move to ERR"
            ),
        })
    }

    /// `modify` of an iWARP or shm QP: new access flags in the QP's state
    /// (not ERR), or a move to ERR, which closes the connection.
    fn modify_cm_qp(&self, attr: &QpAttr, av: Option<AddressVector>) -> Result<()> {
        let theirs = QpAttr {
            state: attr.state,
            cur_state: attr.cur_state,
            access: attr.access,
            ..QpAttr::default()
        };
        let state = self.state();
        let to_error = attr.state == Some(QpState::Err) && attr.access.is_none();
        let new_access = attr.state.is_none_or(|s| s == state) && attr.access.is_some();
        if *attr != theirs || av.is_some() || !(to_error || new_access) {
            return Err(self.brought_up_by_cm("modify"));
        }
        if let Some(cur) = attr.cur_state
            && cur != state
        {
            return Err(VerbsError::Invalid(format!(
                "modify: the QP is in {state}, not {cur}"
            )));
        }
        match (&self.kind, attr.access) {
            (_, Some(_)) if state == QpState::Err => Err(VerbsError::Invalid(
                "modify: a QP in ERR takes no qp_access_flags".into(),
            )),
            (QpKind::Iwarp(s), Some(access)) => {
                s.set_access(access);
                Ok(())
            }
            (QpKind::Shm(s), Some(access)) => {
                s.set_access(access);
                Ok(())
            }
            (QpKind::Iwarp(s), None) => {
                s.to_error(self.ctx.inner.events());
                Ok(())
            }
            (QpKind::Shm(s), None) => {
                s.to_error();
                Ok(())
            }
            (QpKind::Roce(_) | QpKind::Hw(_), _) => {
                unreachable!("these QPs move through modify")
            }
        }
    }

    fn kick(&self, slot: &QpSlot) {
        if let Provider::Udp(d) = &self.ctx.inner.dev {
            d.kick(slot);
        }
    }

    /// Modifies the QP (`ibv_modify_qp`); RC's INIT -> RTR needs `av`.
    /// iWARP and shm QPs are brought up by their connection managers: they
    /// take new access flags (in the state they are in) and one move, to
    /// ERR, which closes the connection.
    pub fn modify(&self, attr: &QpAttr, av: Option<AddressVector>) -> Result<()> {
        let to_error = QpAttr {
            state: Some(QpState::Err),
            cur_state: attr.cur_state,
            ..QpAttr::default()
        };
        if let QpKind::Hw(q) = &self.kind {
            let active = self.ctx.query_port().active_mtu;
            if let Some(m) = attr.path_mtu
                && m > active
            {
                return Err(VerbsError::Invalid(format!(
                    "path MTU {} is larger than the port's active MTU {}",
                    m.bytes(),
                    active.bytes()
                )));
            }
            return q.modify(attr, av.map(|a| *a.addr.ip()));
        }
        let slot = match &self.kind {
            QpKind::Roce(s) => s,
            _ => return self.modify_cm_qp(attr, av),
        };
        let mut a = *attr;
        a.has_av = av.is_some();
        if let Some(m) = a.path_mtu
            && m > self.ctx.inner.active_mtu
        {
            return Err(VerbsError::Invalid(format!(
                "path MTU {} is larger than the port's active MTU {}",
                m.bytes(),
                self.ctx.inner.active_mtu.bytes()
            )));
        }
        {
            let mut qp = slot.engine.lock().expect("QP lock");
            // Under the QP's lock: a failing device moves it to ERR after.
            if *attr != to_error && self.ctx.inner.udp("").is_ok_and(|d| d.shared.is_fatal()) {
                return Err(device_failed());
            }
            qp.modify(&a)?;
            if let Some(av) = av {
                slot.set_peer(Some(av.addr));
            }
            if qp.state() == QpState::Reset {
                slot.set_peer(None);
            }
        }
        // Entering ERR flushes: the completions must reach the CQs.
        self.kick(slot);
        Ok(())
    }

    /// The QP's attributes (`ibv_query_qp`).
    pub fn query(&self) -> QpAttr {
        match &self.kind {
            QpKind::Roce(s) => s.engine.lock().expect("QP lock").query(),
            QpKind::Iwarp(s) => QpAttr {
                state: Some(s.state()),
                access: Some(s.access()),
                ..QpAttr::default()
            },
            QpKind::Shm(s) => QpAttr {
                state: Some(s.state()),
                access: Some(s.access()),
                ..QpAttr::default()
            },
            QpKind::Hw(q) => q.query(),
        }
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        match &self.kind {
            QpKind::Roce(s) => s.engine.lock().expect("QP lock").state(),
            QpKind::Iwarp(s) => s.state(),
            QpKind::Shm(s) => s.state(),
            QpKind::Hw(q) => q.state(),
        }
    }

    /// Transport counters of an RC QP on RoCEv2.
    pub fn stats(&self) -> Option<RcStats> {
        let QpKind::Roce(s) = &self.kind else {
            return None;
        };
        match &*s.engine.lock().expect("QP lock") {
            QpEngine::Rc(q) => Some(q.stats()),
            QpEngine::Ud(_) => None,
        }
    }

    /// Counters of a UD QP.
    pub fn ud_stats(&self) -> Option<UdStats> {
        let QpKind::Roce(s) = &self.kind else {
            return None;
        };
        match &*s.engine.lock().expect("QP lock") {
            QpEngine::Ud(q) => Some(q.stats()),
            QpEngine::Rc(_) => None,
        }
    }

    /// Counters of an iWARP QP, and the Terminates sent and received.
    pub fn iwarp_stats(&self) -> Option<iwarp::IwarpQpStats> {
        match &self.kind {
            QpKind::Iwarp(s) => Some(s.stats()),
            QpKind::Roce(_) | QpKind::Shm(_) | QpKind::Hw(_) => None,
        }
    }

    /// Posts a send work request; returns at once. For inline sends the
    /// payload is copied from `wr.inline_data`.
    pub fn post_send(&self, wr: SendWr) -> Result<()> {
        match &self.kind {
            QpKind::Roce(slot) => {
                let in_flight = {
                    let mut qp = slot.engine.lock().expect("QP lock");
                    if let (Some(dest), Provider::Udp(d)) = (&wr.ud, &self.ctx.inner.dev) {
                        // As rxe's AH lookup: a destroyed AH or another PD's.
                        let ahs = d.shared.ahs.read().expect("AH table lock");
                        if ahs.get(&dest.ah.0).is_none_or(|&(_, pd)| pd != qp.pd()) {
                            return Err(PostError::BadAh(dest.ah.0).into());
                        }
                    }
                    qp.post_send(wr)?;
                    qp.packets_in_flight()
                };
                if let Provider::Udp(d) = &self.ctx.inner.dev
                    && d.poster_transmits(in_flight)
                {
                    d.kick(slot);
                }
            }
            QpKind::Iwarp(s) => s.post_send(wr)?,
            QpKind::Shm(s) => s.post_send(&wr)?,
            QpKind::Hw(q) => q.post_send(&wr)?,
        }
        Ok(())
    }

    /// Posts a receive work request (on iWARP also before the connection is
    /// up, as rdma_cm users do).
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        match &self.kind {
            QpKind::Roce(slot) => {
                slot.engine.lock().expect("QP lock").post_recv(wr)?;
                self.kick(slot);
            }
            QpKind::Iwarp(s) => s.post_recv(wr)?,
            QpKind::Shm(s) => s.post_recv(wr)?,
            QpKind::Hw(q) => q.post_recv(&wr)?,
        }
        Ok(())
    }

    /// Before a connection manager's first I/O: a QP connected before or
    /// moved to ERR can't be connected (a peer would be answered, then
    /// dropped). The attach checks again.
    pub(crate) fn check_unconnected(&self) -> Result<()> {
        let used = match &self.kind {
            QpKind::Iwarp(s) => s.before.state() != QpState::Init,
            QpKind::Shm(s) => s.before.state() != QpState::Init,
            QpKind::Hw(q) => {
                q.has_cm_connection() || !matches!(q.state(), QpState::Reset | QpState::Init)
            }
            QpKind::Roce(_) => false,
        };
        if used {
            return Err(VerbsError::Invalid(
                "this QP was connected before or moved to ERR: create a new one".into(),
            ));
        }
        Ok(())
    }

    /// For `cm::roce`: whether this is an RC QP of a RoCEv2 device, and
    /// whether it takes receives from an SRQ.
    pub(crate) fn roce_rc(&self) -> Option<bool> {
        match &self.kind {
            QpKind::Roce(s) => matches!(*s.engine.lock().expect("QP lock"), QpEngine::Rc(_))
                .then_some(s.srq.is_some()),
            _ => None,
        }
    }

    /// For `cm::roce_ud`: whether this is a UD QP of a RoCEv2 device.
    pub(crate) fn is_roce_ud(&self) -> bool {
        match &self.kind {
            QpKind::Roce(s) => matches!(*s.engine.lock().expect("QP lock"), QpEngine::Ud(_)),
            _ => false,
        }
    }

    /// The iWARP slot, for `cm::iwarp`.
    pub(crate) fn iwarp_slot(&self) -> Option<&Arc<iwarp::IwarpSlot>> {
        match &self.kind {
            QpKind::Iwarp(s) => Some(s),
            QpKind::Roce(_) | QpKind::Shm(_) | QpKind::Hw(_) => None,
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        if let (QpKind::Roce(slot), Provider::Udp(d)) = (&self.kind, &self.ctx.inner.dev) {
            // An rdma_cm connection ends with a DREQ (not waited for).
            if let Some((local, c)) = d.shared.gsi.take_connection_of(slot.qpn) {
                let dreq = crate::provider::gsi::dreq_for(local, &c);
                let _ = crate::provider::udp::send_mad(&d.shared, c.peer, &dreq);
            }
            d.shared.remove_qp(slot.qpn);
        }
    }
}

#[cfg(test)]
mod deadline_tests {
    use std::time::{Duration, Instant};

    #[test]
    fn a_timeout_too_long_to_add_is_far_away_not_a_panic() {
        let now = Instant::now();
        assert!(
            super::deadline_after(Duration::MAX) > now + Duration::from_secs(50 * 365 * 86_400)
        );
        let d = super::deadline_after(Duration::from_millis(5));
        assert!(d >= now + Duration::from_millis(5) && d < now + Duration::from_secs(60));
    }
}

#[cfg(test)]
mod qpn_tests {
    use super::*;

    /// iWARP and shm QPs have no QP table: their numbers wrapped onto live
    /// QPs' (completions and events then named two QPs alike).
    #[test]
    fn wrapped_qp_numbers_skip_live_ones_on_every_provider_without_a_table() {
        for ctx in [
            Device::iwarp(std::net::Ipv4Addr::new(127, 0, 0, 1))
                .open()
                .unwrap(),
            Device::shm().open().unwrap(),
        ] {
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(4).unwrap();
            let make = || pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
            let range = ctx.inner.qpn_range.clone();
            let first = make();
            assert_eq!(first.qpn(), *range.start());
            *ctx.inner.next_qpn.lock().unwrap() = *range.end();
            let last = make();
            assert_eq!(last.qpn(), *range.end());
            let wrapped = make();
            assert_eq!(
                wrapped.qpn(),
                range.start() + 1,
                "the live first one's skipped"
            );
            // A connection may hold the QP's slot a while after the QP is
            // dropped (flushing, with the number in its completions).
            let slot: Box<dyn std::any::Any> = match &first.kind {
                QpKind::Iwarp(s) => Box::new(s.clone()),
                QpKind::Shm(s) => Box::new(s.clone()),
                QpKind::Roce(_) | QpKind::Hw(_) => unreachable!("no RoCEv2 device here"),
            };
            drop(first);
            *ctx.inner.next_qpn.lock().unwrap() = *range.start();
            assert_ne!(make().qpn(), *range.start(), "its slot still lives");
            drop(slot);
            *ctx.inner.next_qpn.lock().unwrap() = *range.start();
            assert_eq!(
                make().qpn(),
                *range.start(),
                "a dropped QP's number is free"
            );
        }
    }
}

#[cfg(test)]
mod device_fatal_tests {
    use super::*;
    use crate::cm::{self, ConnInfo, RcOptions};

    /// A RoCEv2 progress thread that dies (a bug) leaves no application
    /// waiting: its QPs go to ERR with their work flushed, the device raises
    /// DEVICE_FATAL, and it refuses new QPs and moves out of ERR.
    #[test]
    fn a_progress_thread_that_panics_fails_the_device_and_flushes_its_qps() {
        let open = || Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
        let (a, b) = (open(), open());
        let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
        let mr = pa.register(4096, Access::LOCAL_WRITE).unwrap();
        let (ca, cb) = (a.create_cq(16).unwrap(), b.create_cq(16).unwrap());
        let qa = pa.create_qp(&QpInit::rc(&ca, &ca)).unwrap();
        let qb = pb.create_qp(&QpInit::rc(&cb, &cb)).unwrap();
        let (ia, ib) = (
            ConnInfo::local(&qa, None).unwrap(),
            ConnInfo::local(&qb, None).unwrap(),
        );
        cm::connect(&qa, &ia, &ib, &RcOptions::default()).unwrap();
        cm::connect(&qb, &ib, &ia, &RcOptions::default()).unwrap();
        qa.post_recv(RecvWr::new(7, [mr.sge(0, 64)])).unwrap();
        // A SEND the peer has no receive for: retried on RNR until the end.
        qa.post_send(SendWr::new(8, SendOp::Send, [mr.sge(64, 8)]))
            .unwrap();
        a.inner.udp("").unwrap().shared.panic_soon();
        let t = std::time::Instant::now();
        while a.poll_async_event() != Some(AsyncEvent::DeviceFatal) {
            assert!(t.elapsed().as_secs() < 20, "no DeviceFatal");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let mut got: Vec<(u64, WcStatus)> = (0..2)
            .map(|_| {
                let wc = ca
                    .wait(std::time::Duration::from_secs(20))
                    .unwrap()
                    .expect("a flush");
                (wc.wr_id, wc.status)
            })
            .collect();
        got.sort_by_key(|g| g.0);
        assert_eq!(got, [(7, WcStatus::WrFlushErr), (8, WcStatus::WrFlushErr)]);
        assert_eq!(qa.state(), QpState::Err);
        // Posts are flushed, not left waiting.
        qa.post_recv(RecvWr::new(9, [mr.sge(0, 64)])).unwrap();
        let wc = ca
            .wait(std::time::Duration::from_secs(20))
            .unwrap()
            .unwrap();
        assert_eq!((wc.wr_id, wc.status), (9, WcStatus::WrFlushErr));
        let e = pa.create_qp(&QpInit::rc(&ca, &ca)).unwrap_err();
        assert!(e.to_string().contains("device failed"), "{e}");
        let reset = QpAttr {
            state: Some(QpState::Reset),
            ..QpAttr::default()
        };
        assert!(qa.modify(&reset, None).is_err());
        assert_eq!(a.query_port().state, PortState::Down);
    }
}
