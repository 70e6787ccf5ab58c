//! The shared-memory provider: RC queue pairs between processes of one host,
//! with no wire. Every memory region of a shm device lives in a sealed memfd
//! ([`mapping`]); a connected peer maps the regions of the QP's protection
//! domain, so that
//!
//! - RDMA WRITE and READ are one copy between the initiator's region and the
//!   target's, made by the initiator's thread; the target does nothing;
//! - atomics are CPU atomics on the shared word (atomic against every other
//!   initiator and the target itself);
//! - SEND and WRITE with immediate take the receiver's next posted receive
//!   from a ring in shared memory (the receiver's "inbox"), copy the payload
//!   once, straight into the receive buffer, and put the completion on a
//!   second ring of the inbox; the receiver's progress thread, woken by an
//!   eventfd, moves it to its CQ.
//!
//! The connection is a Unix seqpacket socket: both sides send their inbox
//! memfd and eventfd, then their regions, and keep the socket for regions
//! registered or deregistered later. A peer that dies closes it: the QP goes
//! to ERR, its work is flushed and the peer's mappings are dropped.
//!
//! Rights are checked by the initiator on every operation (the target QP's
//! access flags, which its owner keeps in its inbox, and remote rights on
//! the target region; local write on a receive buffer). Between processes of
//! one user on one host that is the protection there is: the peer's memory is
//! mapped here.

mod copier;
pub(crate) mod mapping;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, PollFd, PollFlags, eventfd};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, Shutdown,
};

use crate::engine::rc::QpCaps;
use crate::engine::{
    PostError, QpState, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
use smallvec::SmallVec;

use crate::memory::{Access, MrTable, PdId, Region, RegionMemory, SegmentRef};
use crate::verbs::cq::CqInner;
use crate::verbs::events::{AsyncEvent, EventQueue};

/// Most SGEs of a receive in the ring (the verbs allow up to this many).
pub(crate) const MAX_RECV_SGE: usize = 7;
/// 2: the inbox holds the owner's QP access flags.
const VERSION: u32 = 2;

/// How long a peer has to take and acknowledge a region message.
const ACK_WAIT: Duration = Duration::from_secs(1);

// The inbox: counters on their own cache lines, then the receive ring (the
// owner posts, the peer takes), then the completion ring (the peer puts, the
// owner drains). Counters only grow; a slot is `count % slots`.
const RQ_HEAD: usize = 0;
const RQ_TAIL: usize = 64;
const CQ_HEAD: usize = 128;
const CQ_TAIL: usize = 192;
/// Set by a peer whose SEND found no receive: the owner's next post wakes it.
const PEER_WAITING: usize = 256;
/// The owner's QP access flags (`qp_access_flags`): the remote operations
/// the peer may run on it, looked at by the peer on each one.
const QP_ACCESS: usize = 320;
const RINGS: usize = 4096;
const RQ_SLOT: usize = 128;
const CQ_SLOT: usize = 32;

/// The peer's regions are kept in a table of their own under this PD.
const PEER_PD: PdId = 0;

fn inbox_len(slots: u64) -> usize {
    RINGS + slots as usize * (RQ_SLOT + CQ_SLOT)
}

/// One side's inbox, as mapped here.
#[derive(Debug)]
struct Inbox {
    mem: Arc<RegionMemory>,
    slots: u64,
    event: OwnedFd,
}

impl Inbox {
    fn rq_slot(&self, n: u64) -> usize {
        RINGS + (n % self.slots) as usize * RQ_SLOT
    }

    fn cq_slot(&self, n: u64) -> usize {
        RINGS + self.slots as usize * RQ_SLOT + (n % self.slots) as usize * CQ_SLOT
    }

    fn wake(&self) {
        let _ = rustix::io::write(&self.event, &1u64.to_ne_bytes());
    }
}

/// A receive taken from a peer's ring: its slot, as copied out.
struct TakenRecv {
    slot: [u8; RQ_SLOT],
}

impl TakenRecv {
    fn wr_id(&self) -> u64 {
        le64(&self.slot, 0)
    }

    /// Its SGEs: lkey, address, length.
    fn sges(&self) -> impl Iterator<Item = (u32, u64, u32)> + '_ {
        let n = (le32(&self.slot, 8) as usize).min(MAX_RECV_SGE);
        (0..n).map(|i| {
            let e = 16 + 16 * i;
            (
                le32(&self.slot, e + 12),
                le64(&self.slot, e),
                le32(&self.slot, e + 8),
            )
        })
    }
}

// Messages on the socket: a tag byte, then little-endian fields.
const HELLO: u8 = 1;
const REGION: u8 = 2;
const READY: u8 = 3;
const REVOKE: u8 = 4;
/// The peer mapped (REGION) or let go of (REVOKE) a region.
const ACK: u8 = 5;
const MSG_MAX: usize = 64;

/// A region of this side's, as its peers learn it.
#[derive(Debug)]
pub(crate) struct SharedRegion {
    pub(crate) pd: PdId,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    pub(crate) iova: u64,
    pub(crate) len: usize,
    pub(crate) access: Access,
    pub(crate) fd: OwnedFd,
}

impl SharedRegion {
    /// Peers map a region only if they may write it (a receive buffer, or
    /// remote rights): a region with no rights but local reads stays here.
    fn shared(&self) -> bool {
        self.access != Access::NONE
    }

    fn message(&self) -> [u8; 32] {
        let mut m = [0u8; 32];
        m[0] = REGION;
        m[4..8].copy_from_slice(&self.lkey.to_le_bytes());
        m[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        m[12..16].copy_from_slice(&self.access.bits().to_le_bytes());
        m[16..24].copy_from_slice(&self.iova.to_le_bytes());
        m[24..32].copy_from_slice(&(self.len as u64).to_le_bytes());
        m
    }
}

/// What a shm device keeps: its regions' memfds and its connected QPs (to
/// tell them of regions registered and deregistered later).
#[derive(Debug, Default)]
pub(crate) struct ShmDevice {
    regions: Mutex<Vec<SharedRegion>>,
    qps: Mutex<Vec<Weak<ShmQp>>>,
}

impl ShmDevice {
    /// Shared memory for a new region of `pd`: the memory; call
    /// [`ShmDevice::registered`] with its keys once it is in the MR table.
    pub(crate) fn allocate(&self, len: usize) -> io::Result<(RegionMemory, OwnedFd)> {
        mapping::create(len, "softrdma-mr")
    }

    /// A region is registered: peers of its PD map it before this returns
    /// (they answer, or have gone, within a second, all of them together),
    /// so its rkey works as soon as the application can hand it out.
    pub(crate) fn registered(&self, r: SharedRegion) {
        let mut regions = self.regions.lock().expect("shm regions lock");
        // Every peer is told first, then the answers are awaited together,
        // all within one wait: slow peers cost one, not one each.
        let deadline = Instant::now() + ACK_WAIT;
        let mut told = Vec::new();
        for qp in self.live_qps(r.pd).into_iter().filter(|_| r.shared()) {
            if qp.send_region(&r, deadline).is_ok() {
                told.push(qp);
            } else {
                // A peer that can't be told of it would refuse its key:
                // the connection ends.
                qp.fail();
            }
        }
        for qp in told {
            // One slow to map it learns of it all the same, when it reads;
            // but a peer that never answers would cost every register here
            // its second.
            if !qp.slow_to_ack.load(Ordering::Acquire) && !qp.wait_ack(REGION, r.lkey, deadline) {
                qp.slow_to_ack.store(true, Ordering::Release);
            }
        }
        regions.push(r);
    }

    /// A region is being deregistered: every peer that maps it lets go of it
    /// (they answer, or have gone, within a second, all of them together)
    /// before this returns, so no access with its keys succeeds afterwards.
    pub(crate) fn deregistered(&self, lkey: u32) {
        let mut regions = self.regions.lock().expect("shm regions lock");
        let Some(at) = regions.iter().position(|r| r.lkey == lkey) else {
            return;
        };
        let r = regions.remove(at);
        drop(regions);
        // A peer that doesn't answer may still reach the region: the
        // connection ends (its QP fails and lets go of every region). Every
        // peer is told first, so that slow ones cost one wait, not one each.
        let deadline = Instant::now() + ACK_WAIT;
        let mut told = Vec::new();
        for qp in self.live_qps(r.pd).into_iter().filter(|_| r.shared()) {
            if qp.send_revoke(r.lkey, r.rkey, deadline).is_ok() {
                told.push(qp);
            } else {
                qp.fail();
            }
        }
        for qp in told {
            if !qp.wait_ack(REVOKE, r.lkey, deadline) {
                qp.fail();
            }
        }
    }

    /// A region left the MR table: QPs that used it let go of it, after the
    /// operation that may be copying to or from it.
    pub(crate) fn forget_local(&self, lkey: u32) {
        let qps: Vec<Arc<ShmQp>> = {
            let mut qps = self.qps.lock().expect("shm QPs lock");
            qps.retain(|w| w.strong_count() > 0);
            qps.iter().filter_map(Weak::upgrade).collect()
        };
        for qp in qps {
            qp.sq.lock().local.remove(lkey);
        }
    }

    fn live_qps(&self, pd: PdId) -> Vec<Arc<ShmQp>> {
        let mut qps = self.qps.lock().expect("shm QPs lock");
        qps.retain(|w| w.strong_count() > 0);
        qps.iter()
            .filter_map(Weak::upgrade)
            .filter(|q| q.pd == pd && !q.failed.load(Ordering::Acquire))
            .collect()
    }
}

/// A connected shm QP.
#[derive(Debug)]
pub(crate) struct ShmQp {
    qpn: u32,
    pd: PdId,
    caps: QpCaps,
    mrs: Arc<RwLock<MrTable>>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    events: Arc<EventQueue>,
    sock: OwnedFd,
    mine: Inbox,
    peer: Inbox,
    /// The send queue: every operation runs under its lock, which also
    /// guards the region tables an operation uses (one lock per post).
    sq: SqLock,
    /// The receives this side posted, oldest first, until their
    /// completions come back.
    posted: Mutex<VecDeque<Posted>>,
    failed: AtomicBool,
    closing: AtomicBool,
    /// (message, lkey) the peer has acknowledged.
    acks: Mutex<Vec<(u8, u32)>>,
    acked: Condvar,
    /// The peer let a new region's acknowledgement wait out [`ACK_WAIT`]:
    /// registrations stop waiting for it until it acknowledges something.
    slow_to_ack: AtomicBool,
    /// Wakes the progress thread to end the connection: an eventfd of this
    /// side's alone (the peer holds `mine.event` too, and could take the
    /// wake-up from it).
    end_now: OwnedFd,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Tests: the progress thread panics at its next wake-up.
    #[cfg(test)]
    panic_in_progress: AtomicBool,
}

/// The send queue's lock. It is held for one operation (its copy at most)
/// and taken by other threads rarely (posts from several threads, the
/// progress thread's region updates), so it spins, giving the CPU away
/// between looks, as rdma-core's providers lock their send queues. Unlocking
/// is a plain store: after a large copy, the first locked instruction waits
/// until the copy's stores drain (most of a 64 KiB READ's own post time sat
/// on the table lock's release in `perf record`).
type SqLock = spin::mutex::SpinMutex<SendSide, spin::relax::Yield>;

/// What runs an operation needs, under the send queue's lock.
#[derive(Debug)]
struct SendSide {
    /// Work waiting for the peer to post receives (RC's RNR wait; iWARP
    /// would fail instead, RoCE retries).
    backlog: VecDeque<SendWr>,
    /// The peer's regions, mapped here. A revocation takes this lock, so it
    /// waits for the operation using the region to finish.
    peer: MrTable,
    /// The regions of the device's MR table that operations of this QP used
    /// (looked up there on first use): a copy holds no lock on that table.
    /// A deregistration takes the region out under this lock
    /// ([`ShmDevice::forget_local`]), so it waits for the copy.
    local: MrTable,
}

/// What an established connection needs from the verbs.
pub(crate) struct QpParts {
    pub(crate) qpn: u32,
    pub(crate) pd: PdId,
    pub(crate) caps: QpCaps,
    pub(crate) mrs: Arc<RwLock<MrTable>>,
    pub(crate) send_cq: Arc<CqInner>,
    pub(crate) recv_cq: Arc<CqInner>,
    pub(crate) events: Arc<EventQueue>,
    /// The QP's access flags, which the exchange puts in its inbox.
    pub(crate) access: Arc<AccessFlags>,
}

/// A shm QP's access flags (`qp_access_flags`): kept here until the QP has
/// an inbox, then in it as well, where the peer looks at them on each
/// remote operation. A change takes effect at the peer's next operation,
/// from before the peer knows the inbox.
#[derive(Debug)]
pub(crate) struct AccessFlags(Mutex<(Access, Option<Arc<RegionMemory>>)>);

impl AccessFlags {
    pub(crate) fn new(access: Access) -> AccessFlags {
        AccessFlags(Mutex::new((access, None)))
    }

    pub(crate) fn get(&self) -> Access {
        self.0.lock().expect("access lock").0
    }

    pub(crate) fn set(&self, access: Access) {
        let mut a = self.0.lock().expect("access lock");
        a.0 = access;
        if let Some(inbox) = &a.1 {
            inbox.store(QP_ACCESS, u64::from(access.bits()));
        }
    }

    /// From now on the flags live in `inbox` too.
    fn publish_in(&self, inbox: &Arc<RegionMemory>) {
        let mut a = self.0.lock().expect("access lock");
        inbox.store(QP_ACCESS, u64::from(a.0.bits()));
        a.1 = Some(inbox.clone());
    }
}

/// Sends one message after the exchange, waiting until `deadline` at most
/// for room in the peer's queue (without touching the socket's timeout,
/// which other threads' sends share); signals do not cut the wait short,
/// `gave_up` (looked at every few milliseconds) does.
fn send_by(
    sock: BorrowedFd<'_>,
    msg: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Instant,
    gave_up: &dyn Fn() -> bool,
) -> io::Result<()> {
    loop {
        match send_msg_once(sock, msg, fds, SendFlags::DONTWAIT) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the peer has not read its messages in time",
                    ));
                }
                if gave_up() {
                    return Err(io::Error::other("the connection is ending"));
                }
                let slice = left.min(Duration::from_millis(10));
                let mut out = [PollFd::new(&sock, PollFlags::OUT)];
                let ts = rustix::time::Timespec {
                    tv_sec: 0,
                    tv_nsec: i64::from(slice.subsec_nanos()),
                };
                match rustix::event::poll(&mut out, Some(&ts)) {
                    Ok(_) | Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

fn send_msg_once(
    sock: BorrowedFd<'_>,
    msg: &[u8],
    fds: &[BorrowedFd<'_>],
    flags: SendFlags,
) -> io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("too many descriptors for one message"));
    }
    rustix::net::sendmsg(
        sock,
        &[IoSlice::new(msg)],
        &mut control,
        flags | SendFlags::NOSIGNAL,
    )?;
    Ok(())
}

/// The next message (0 bytes: the peer closed), with its descriptors, on a
/// socket with no receive timeout (after the exchange).
fn recv_msg(sock: BorrowedFd<'_>, buf: &mut [u8; MSG_MAX]) -> io::Result<(usize, Vec<OwnedFd>)> {
    loop {
        match recv_msg_once(sock, buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

fn recv_msg_once(
    sock: BorrowedFd<'_>,
    buf: &mut [u8; MSG_MAX],
) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let m = rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    if m.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
        // The kernel dropped descriptors the peer passed: this process
        // has run out of them (EMFILE), or the peer passed more than a
        // message holds; either way the message is missing a region or ring.
        return Err(io::Error::other(
            "descriptors the peer passed were dropped: this process has run out of file \
             descriptors (RLIMIT_NOFILE), or the peer passed more than one message holds",
        ));
    }
    let mut fds = Vec::new();
    for c in control.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = c {
            fds.extend(it);
        }
    }
    Ok((m.bytes, fds))
}

/// Regions a peer may have mapped here at once: each is a mapping of this
/// process (the kernel allows some 65 000), so a peer can't use them all up.
const MAX_PEER_REGIONS: usize = 4096;

fn too_many_regions() -> io::Error {
    bad(format!(
        "the peer announced more than {MAX_PEER_REGIONS} regions at once"
    ))
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// A region a peer announced, mapped here under its keys.
fn map_region(msg: &[u8], fd: &OwnedFd) -> io::Result<Region> {
    let (lkey, rkey) = (le32(msg, 4), le32(msg, 8));
    let access = Access::from_bits(le32(msg, 12));
    let iova = le64(msg, 16);
    let len = usize::try_from(le64(msg, 24)).map_err(|_| bad("a region too large"))?;
    let memory = mapping::map(fd.as_fd(), len)?;
    Region::new(
        PEER_PD,
        (lkey, rkey),
        Arc::new(memory),
        0,
        len,
        iova,
        access,
    )
    .map_err(|e| bad(e.to_string()))
}

/// The exchange's end: what is left of it bounds the socket's next send or
/// receive (a timeout per message alone would let a peer that dribbles its
/// regions hold the exchange for as long as it likes).
#[derive(Clone, Copy)]
struct Deadline {
    at: Instant,
    timeout: Duration,
}

impl Deadline {
    fn after(timeout: Duration) -> Deadline {
        Deadline {
            at: crate::verbs::deadline_after(timeout),
            timeout,
        }
    }

    fn expired(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the peer did not finish the exchange within {:.1} s",
                self.timeout.as_secs_f64()
            ),
        )
    }

    /// Sets the socket's timeouts to what is left.
    fn bound(&self, sock: BorrowedFd<'_>) -> io::Result<()> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.expired());
        }
        // A zero timeval would mean no timeout at all.
        let left = left.max(Duration::from_millis(1));
        for dir in [
            rustix::net::sockopt::Timeout::Recv,
            rustix::net::sockopt::Timeout::Send,
        ] {
            rustix::net::sockopt::set_socket_timeout(sock, dir, Some(left))?;
        }
        Ok(())
    }

    /// A socket timeout (EAGAIN) as the exchange's.
    fn explain(&self, e: io::Error) -> io::Error {
        if e.kind() == io::ErrorKind::WouldBlock {
            self.expired()
        } else {
            e
        }
    }

    /// A signal interrupts a send or receive under a socket timeout even
    /// with SA_RESTART: each try is bounded anew by what is left.
    fn send(&self, sock: BorrowedFd<'_>, msg: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        loop {
            self.bound(sock)?;
            match send_msg_once(sock, msg, fds, SendFlags::empty()) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => return r.map_err(|e| self.explain(e)),
            }
        }
    }

    fn recv(
        &self,
        sock: BorrowedFd<'_>,
        buf: &mut [u8; MSG_MAX],
    ) -> io::Result<(usize, Vec<OwnedFd>)> {
        loop {
            self.bound(sock)?;
            match recv_msg_once(sock, buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => return r.map_err(|e| self.explain(e)),
            }
        }
    }
}

/// Whether `fd` is an eventfd (the kernel names it so in /proc). Without
/// /proc: whether it is a file of the anonymous inode eventfds share (an
/// epoll or timer descriptor passes too, but a write to one fails at once,
/// which is all a wake-up needs).
fn is_eventfd(fd: BorrowedFd<'_>) -> bool {
    use std::os::fd::AsRawFd;
    if let Ok(target) = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) {
        return target.as_os_str() == "anon_inode:[eventfd]";
    }
    let inode = |fd: BorrowedFd<'_>| rustix::fs::fstat(fd).map(|st| (st.st_dev, st.st_ino));
    let Ok(ours) = eventfd(0, EventfdFlags::CLOEXEC) else {
        return false;
    };
    matches!((inode(fd), inode(ours.as_fd())), (Ok(a), Ok(b)) if a == b)
}

/// The peer's half of the exchange: its HELLO (ring size, inbox, eventfd)
/// and its regions, up to READY.
fn read_peer(
    sock: BorrowedFd<'_>,
    deadline: Deadline,
) -> io::Result<(u64, OwnedFd, RegionMemory, MrTable)> {
    let mut buf = [0u8; MSG_MAX];
    let (n, mut fds) = deadline
        .recv(sock, &mut buf)
        .map_err(|e| io::Error::new(e.kind(), format!("no HELLO from the peer: {e}")))?;
    if n != 16 || buf[0] != HELLO || fds.len() != 2 {
        return Err(bad("the peer is not a softrdma shm QP"));
    }
    if le32(&buf, 4) != VERSION {
        return Err(bad(format!(
            "the peer speaks shm version {}, this side {VERSION}",
            le32(&buf, 4)
        )));
    }
    let peer_slots = u64::from(le32(&buf, 12));
    if !peer_slots.is_power_of_two() || peer_slots > 1 << 16 {
        return Err(bad(
            "the peer's receive ring size is not a power of two up to 65536",
        ));
    }
    let peer_event = fds.pop().expect("two descriptors");
    // Waking the peer writes to it: a pipe or socket whose other end closed
    // would raise SIGPIPE, a file could block. Only an eventfd will do.
    if !is_eventfd(peer_event.as_fd()) {
        return Err(bad("the peer's wake-up descriptor is not an eventfd"));
    }
    // Waking the peer must never block this side (its own eventfd is
    // non-blocking already: this changes nothing for it).
    rustix::io::ioctl_fionbio(&peer_event, true)?;
    let peer_inbox = mapping::map(fds[0].as_fd(), inbox_len(peer_slots))?;
    let mut peer_regions = MrTable::new();
    let mut announced = 0;
    loop {
        let (n, fds) = deadline.recv(sock, &mut buf)?;
        match (n, buf[0]) {
            (1, READY) => break,
            (32, REGION) if fds.len() == 1 => {
                announced += 1;
                if announced > MAX_PEER_REGIONS {
                    return Err(too_many_regions());
                }
                let r = map_region(&buf[..32], &fds[0])?;
                if peer_regions.key_in_use(r.lkey) || peer_regions.key_in_use(r.rkey) {
                    return Err(bad("the peer announced a key twice"));
                }
                peer_regions.insert(r);
            }
            (0, _) => return Err(bad("the peer closed during the exchange")),
            _ => return Err(bad("an unexpected message during the exchange")),
        }
    }
    Ok((peer_slots, peer_event, peer_inbox, peer_regions))
}

/// Both sides send the same messages: HELLO with the inbox and its eventfd,
/// every region of the PD, READY. The side that `reads_first` (the
/// acceptor) takes the peer's before sending its own, so that neither
/// blocks on a full socket while the other does the same: a PD's regions
/// can outnumber what the socket queues.
pub(crate) fn establish(
    device: &Arc<ShmDevice>,
    sock: OwnedFd,
    parts: QpParts,
    timeout: Duration,
    reads_first: bool,
) -> io::Result<Arc<ShmQp>> {
    copier::start();
    let slots = u64::from(parts.caps.max_recv_wr.max(1)).next_power_of_two();
    let (inbox, inbox_fd) = mapping::create(inbox_len(slots), "softrdma-inbox")?;
    let inbox = Arc::new(inbox);
    parts.access.publish_in(&inbox);
    let my_event = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
    let deadline = Deadline::after(timeout);
    let mut hello = [0u8; 16];
    hello[0] = HELLO;
    hello[4..8].copy_from_slice(&VERSION.to_le_bytes());
    hello[8..12].copy_from_slice(&parts.qpn.to_le_bytes());
    hello[12..16].copy_from_slice(&(slots as u32).to_le_bytes());
    // The regions as they are now; what changes until this QP joins the
    // list that hears of later ones is sent after the exchange. (The lock is
    // not held while reading: the peer may be a QP of this same device.)
    let send_mine = || -> io::Result<Vec<u32>> {
        let announced: Vec<u32> = {
            let regions = device.regions.lock().expect("shm regions lock");
            deadline.send(sock.as_fd(), &hello, &[inbox_fd.as_fd(), my_event.as_fd()])?;
            let mut sent = Vec::new();
            for r in regions.iter().filter(|r| r.pd == parts.pd && r.shared()) {
                deadline.send(sock.as_fd(), &r.message(), &[r.fd.as_fd()])?;
                sent.push(r.lkey);
            }
            sent
        };
        deadline.send(sock.as_fd(), &[READY], &[])?;
        Ok(announced)
    };
    let (announced, (peer_slots, peer_event, peer_inbox, peer_regions)) = if reads_first {
        let peer = read_peer(sock.as_fd(), deadline)?;
        (send_mine()?, peer)
    } else {
        let announced = send_mine()?;
        (announced, read_peer(sock.as_fd(), deadline)?)
    };
    rustix::net::sockopt::set_socket_timeout(&sock, rustix::net::sockopt::Timeout::Recv, None)?;
    // No send timeout: messages from here on go out by `send_by`'s deadline
    // (region messages with the device's region list locked: a peer that
    // stops reading must not hold every register on the device).
    rustix::net::sockopt::set_socket_timeout(&sock, rustix::net::sockopt::Timeout::Send, None)?;
    let qp = Arc::new(ShmQp {
        qpn: parts.qpn,
        pd: parts.pd,
        caps: parts.caps,
        mrs: parts.mrs,
        send_cq: parts.send_cq,
        recv_cq: parts.recv_cq,
        events: parts.events,
        sock,
        mine: Inbox {
            mem: inbox,
            slots,
            event: my_event,
        },
        peer: Inbox {
            mem: Arc::new(peer_inbox),
            slots: peer_slots,
            event: peer_event,
        },
        sq: SqLock::new(SendSide {
            backlog: VecDeque::new(),
            peer: peer_regions,
            local: MrTable::new(),
        }),
        posted: Mutex::new(VecDeque::new()),
        failed: AtomicBool::new(false),
        closing: AtomicBool::new(false),
        acks: Mutex::new(Vec::new()),
        acked: Condvar::new(),
        slow_to_ack: AtomicBool::new(false),
        end_now: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
        thread: Mutex::new(None),
        #[cfg(test)]
        panic_in_progress: AtomicBool::new(false),
    });
    {
        let regions = device.regions.lock().expect("shm regions lock");
        let now: Vec<&SharedRegion> = regions
            .iter()
            .filter(|r| r.pd == qp.pd && r.shared())
            .collect();
        let by = Instant::now() + ACK_WAIT;
        for r in now.iter().filter(|r| !announced.contains(&r.lkey)) {
            qp.send_region(r, by)?;
        }
        for &lkey in announced
            .iter()
            .filter(|k| !now.iter().any(|r| r.lkey == **k))
        {
            qp.send_revoke(lkey, 0, by)?;
        }
        device
            .qps
            .lock()
            .expect("shm QPs lock")
            .push(Arc::downgrade(&qp));
    }
    let runner = qp.clone();
    let t = std::thread::Builder::new()
        .name("softrdma-shm".into())
        .spawn(move || {
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runner.progress()));
            if ran.is_err() {
                runner.progress_panicked();
            }
        })?;
    *qp.thread.lock().expect("thread lock") = Some(t);
    Ok(qp)
}

/// A receive this side posted: what its completion reports.
#[derive(Debug, Clone, Copy)]
struct Posted {
    wr_id: u64,
    /// Its buffers' length: no SEND's completion reports more.
    len: u32,
}

impl Posted {
    fn of(wr: &RecvWr) -> Posted {
        let len: u64 = wr.sgl.iter().map(|s| u64::from(s.len)).sum();
        Posted {
            wr_id: wr.wr_id,
            len: u32::try_from(len).unwrap_or(u32::MAX),
        }
    }
}

/// Why an operation could not run now.
enum Outcome {
    Done(WcStatus),
    /// A SEND found no receive: it waits.
    NoReceive,
}

impl ShmQp {
    /// Whether the peer's QP allows `op` (a remote right). An operation
    /// already running when the peer took the right away still finishes,
    /// as one already executing at an RC responder does.
    fn peer_allows(&self, op: Access) -> Result<(), WcStatus> {
        let allowed = Access::from_bits(self.peer.mem.load(QP_ACCESS) as u32);
        // RC's responder answers an operation its QP refuses with an
        // invalid request NAK.
        if allowed.contains(op) {
            Ok(())
        } else {
            Err(WcStatus::RemInvReqErr)
        }
    }

    pub(crate) fn state(&self) -> QpState {
        if self.failed.load(Ordering::Acquire) {
            QpState::Err
        } else {
            QpState::Rts
        }
    }

    /// Posts and (unless receives are awaited) runs a send WR on the
    /// caller's thread. By reference: a WR passed on by value was copied
    /// here (about 200 bytes; one instruction of the copy held over a third
    /// of the post's profile samples); one that must wait for a receive is
    /// cloned instead.
    #[inline]
    pub(crate) fn post_send(&self, wr: &SendWr) -> Result<(), PostError> {
        if matches!(wr.op, SendOp::SendWithInv(_) | SendOp::LocalInv(_)) {
            return Err(PostError::Unsupported(
                "SEND with invalidate and local invalidate are not implemented on shm devices \
                 (they are on iWARP and RoCEv2)",
            ));
        }
        crate::engine::check_post_send(wr, &self.caps)?;
        let mut guard = self.sq.lock();
        let sq = &mut *guard;
        if self.failed.load(Ordering::Acquire) && sq.backlog.is_empty() {
            // Posted to a QP in error: flushed at once (as rxe and siw do).
            // Behind a backlog it waits there, which the connection's end
            // flushes in order.
            drop(guard);
            self.send_cq
                .push_flushed(wr.wr_id, wr.op.wc_opcode(), self.qpn);
            return Ok(());
        }
        if !sq.backlog.is_empty() {
            if sq.backlog.len() >= self.caps.max_send_wr as usize {
                return Err(PostError::QueueFull(self.caps.max_send_wr));
            }
            sq.backlog.push_back(wr.clone());
            return Ok(());
        }
        match self.execute(&mut sq.local, &sq.peer, wr) {
            Outcome::Done(status) => {
                let signal = self.complete_send(wr, status);
                drop(guard);
                if signal {
                    self.send_cq.signal();
                }
            }
            Outcome::NoReceive => sq.backlog.push_back(wr.clone()),
        }
        Ok(())
    }

    /// Runs what waited for receives, in order, until one waits again.
    fn run_backlog(&self) {
        loop {
            let mut guard = self.sq.lock();
            if self.failed.load(Ordering::Acquire) {
                return;
            }
            let sq = &mut *guard;
            let Some(wr) = sq.backlog.front() else { return };
            match self.execute(&mut sq.local, &sq.peer, wr) {
                Outcome::NoReceive => return,
                Outcome::Done(status) => {
                    let wr = guard.backlog.pop_front().expect("front");
                    let signal = self.complete_send(&wr, status);
                    drop(guard);
                    if signal {
                        self.send_cq.signal();
                    }
                }
            }
        }
    }

    /// Completes `wr`; returns whether to signal the CQ's channel. Called
    /// under the send queue's lock: a WR run after this one (by another
    /// thread, or the progress thread's backlog) completes after it, and
    /// none runs once this one failed.
    fn complete_send(&self, wr: &SendWr, status: WcStatus) -> bool {
        let mut signal = false;
        if wr.flags.signaled || status != WcStatus::Success {
            let mut wc = WorkCompletion::new(wr.wr_id, status, wr.op.wc_opcode(), self.qpn);
            if status == WcStatus::Success {
                wc.byte_len = if wr.flags.inline {
                    wr.inline_data.len() as u32
                } else {
                    wr.sgl.iter().map(|s| s.len).sum()
                };
            }
            signal = self.send_cq.push(wc);
            // A CQ that overran loses completions: the QP can't go on.
            if self.send_cq.overran() {
                self.fail();
            }
        }
        if status != WcStatus::Success {
            self.fail();
        }
        signal
    }

    /// Puts the regions `wr`'s buffers name into `local`, from the MR table,
    /// if they are not there yet (a key the table lacks fails later, in
    /// [`ShmQp::each_local`]).
    fn learn_local(&self, local: &mut MrTable, wr: &SendWr) {
        // Empty SGEs name no region (their keys are not checked).
        let named = || wr.sgl.iter().filter(|s| s.len > 0);
        if wr.flags.inline || named().all(|s| local.key_in_use(s.lkey)) {
            return;
        }
        let mrs = self.mrs.read().expect("MR table lock");
        for s in named() {
            if !local.key_in_use(s.lkey)
                && let Some(r) = mrs.by_lkey(s.lkey)
            {
                local.insert_local(r.clone());
            }
        }
    }

    /// Runs `f` on each local buffer of `wr`, in order (no list built: this
    /// is every operation's path).
    fn each_local(
        &self,
        local: &MrTable,
        wr: &SendWr,
        need: Access,
        mut f: impl FnMut(&SegmentRef<'_>),
    ) -> Result<(), WcStatus> {
        // An empty SGE's key is not checked (rxe, siw).
        for s in wr.sgl.iter().filter(|s| s.len > 0) {
            // Key or bounds: an L_Key violation (LOC_LEN_ERR is for
            // messages too long for their receive).
            let seg = local
                .local_ref(self.pd, s.lkey, s.addr, s.len, need)
                .map_err(|_| WcStatus::LocProtErr)?;
            f(&seg);
        }
        Ok(())
    }

    /// Runs `f` on the peer's region range `rkey`, `addr`, `len` once its
    /// rights are checked. The caller holds the send queue's lock, so a
    /// deregistration the peer announces waits for `f` to finish.
    fn with_remote<T>(
        peer: &MrTable,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
        f: impl FnOnce(&SegmentRef<'_>) -> Result<T, WcStatus>,
    ) -> Result<T, WcStatus> {
        let seg = peer
            .remote_ref(PEER_PD, rkey, addr, len, need)
            .map_err(|_| WcStatus::RemAccessErr)?;
        f(&seg)
    }

    fn execute(&self, local: &mut MrTable, peer: &MrTable, wr: &SendWr) -> Outcome {
        self.learn_local(local, wr);
        match self.try_execute(local, peer, wr) {
            Ok(Some(())) => Outcome::Done(WcStatus::Success),
            Ok(None) => Outcome::NoReceive,
            Err(status) => Outcome::Done(status),
        }
    }

    /// `Ok(None)`: a SEND (or WRITE with immediate) found no receive.
    fn try_execute(
        &self,
        local: &MrTable,
        peer: &MrTable,
        wr: &SendWr,
    ) -> Result<Option<()>, WcStatus> {
        let len: u64 = if wr.flags.inline {
            wr.inline_data.len() as u64
        } else {
            wr.sgl.iter().map(|s| u64::from(s.len)).sum()
        };
        match wr.op {
            SendOp::Write { remote_addr, rkey }
            | SendOp::WriteWithImm {
                remote_addr, rkey, ..
            } => {
                let imm = match wr.op {
                    SendOp::WriteWithImm { imm, .. } => Some(imm),
                    _ => None,
                };
                // The QP's access before the receive, as RC's responder.
                self.peer_allows(Access::REMOTE_WRITE)?;
                // WRITE with immediate needs its receive before any byte moves.
                let taken = match imm {
                    Some(_) => match self.take_receive() {
                        Some(t) => Some(t),
                        None => return Ok(None),
                    },
                    None => None,
                };
                // A zero-byte WRITE names no memory: its key is not
                // checked (rxe's `check_rkey`, and the other providers).
                let moved = if len == 0 {
                    Ok(())
                } else {
                    Self::with_remote(peer, rkey, remote_addr, len, Access::REMOTE_WRITE, |dst| {
                        self.gather_into(local, wr, std::slice::from_ref(dst))
                    })
                };
                if let Some(t) = taken {
                    // The receive is taken already: it completes either way
                    // (flushed if this side's own buffers failed, as this QP
                    // goes to ERR and takes the connection down).
                    let status = match moved {
                        Ok(()) => WcStatus::Success,
                        Err(WcStatus::RemAccessErr) => WcStatus::RemAccessErr,
                        Err(_) => WcStatus::WrFlushErr,
                    };
                    let byte_len = if moved.is_ok() { len as u32 } else { 0 };
                    self.put_completion(&t, byte_len, true, status, imm, wr.flags.solicited);
                }
                moved.map(Some)
            }
            SendOp::Read { .. } if len == 0 => self.peer_allows(Access::REMOTE_READ).map(Some),
            SendOp::Read { remote_addr, rkey } => {
                self.peer_allows(Access::REMOTE_READ)?;
                Self::with_remote(peer, rkey, remote_addr, len, Access::REMOTE_READ, |src| {
                    let mut at = 0;
                    self.each_local(local, wr, Access::LOCAL_WRITE, |seg| {
                        copier::copy(seg, 0, src, at, seg.len());
                        at += seg.len();
                    })
                })?;
                Ok(Some(()))
            }
            SendOp::CompareSwap {
                remote_addr, rkey, ..
            }
            | SendOp::FetchAdd {
                remote_addr, rkey, ..
            } => {
                // One 8-byte buffer and an aligned word: `check_post_send`
                // refused the post otherwise. The result's buffer first: a
                // bad one must not change the word.
                self.each_local(local, wr, Access::LOCAL_WRITE, |_| {})?;
                self.peer_allows(Access::REMOTE_ATOMIC)?;
                let old =
                    Self::with_remote(peer, rkey, remote_addr, 8, Access::REMOTE_ATOMIC, |word| {
                        Ok(match wr.op {
                            SendOp::CompareSwap { compare, swap, .. } => {
                                word.compare_swap(compare, swap)
                            }
                            SendOp::FetchAdd { add, .. } => word.fetch_add(add),
                            _ => unreachable!("an atomic"),
                        })
                    })?;
                self.each_local(local, wr, Access::LOCAL_WRITE, |seg| {
                    seg.write(0, &old.to_ne_bytes())
                })?;
                Ok(Some(()))
            }
            SendOp::Send | SendOp::SendWithImm(_) => {
                let imm = match wr.op {
                    SendOp::SendWithImm(v) => Some(v),
                    _ => None,
                };
                let Some(t) = self.take_receive() else {
                    return Ok(None);
                };
                let moved = {
                    let dst = t
                        .sges()
                        .filter(|&(_, _, len)| len > 0)
                        .map(|(lkey, addr, len)| {
                            peer.local_ref(PEER_PD, lkey, addr, len, Access::LOCAL_WRITE)
                        })
                        .collect::<Result<SmallVec<[SegmentRef<'_>; MAX_RECV_SGE]>, _>>();
                    match dst {
                        // This side's own buffers failed: its QP goes to ERR
                        // and takes the connection down, so the receive is
                        // flushed (as with WRITE with immediate above).
                        Ok(d) if d.iter().map(|s| s.len() as u64).sum::<u64>() >= len => self
                            .gather_into(local, wr, &d)
                            .map_err(|s| (WcStatus::WrFlushErr, s)),
                        Ok(_) => Err((WcStatus::LocLenErr, WcStatus::RemInvReqErr)),
                        Err(_) => Err((WcStatus::LocProtErr, WcStatus::RemOpErr)),
                    }
                };
                match moved {
                    Ok(()) => {
                        self.put_completion(
                            &t,
                            len as u32,
                            false,
                            WcStatus::Success,
                            imm,
                            wr.flags.solicited,
                        );
                        Ok(Some(()))
                    }
                    Err((theirs, mine)) => {
                        self.put_completion(&t, 0, false, theirs, None, false);
                        Err(mine)
                    }
                }
            }
            SendOp::SendWithInv(_) | SendOp::LocalInv(_) => Err(WcStatus::LocQpOpErr),
        }
    }

    /// Copies the payload of `wr` (its SGEs or inline bytes) into `dst`.
    fn gather_into(
        &self,
        local: &MrTable,
        wr: &SendWr,
        dst: &[SegmentRef<'_>],
    ) -> Result<(), WcStatus> {
        let mut d = dst.iter();
        let mut cur = d.next();
        let mut cur_at = 0;
        let mut put = |src: Option<&SegmentRef<'_>>, bytes: &[u8], mut n: usize| {
            let mut from = 0;
            while n > 0 {
                let Some(seg) = cur else { return };
                let room = seg.len() - cur_at;
                let k = room.min(n);
                match src {
                    Some(s) => copier::copy(seg, cur_at, s, from, k),
                    None => seg.write(cur_at, &bytes[from..from + k]),
                }
                from += k;
                n -= k;
                cur_at += k;
                if cur_at == seg.len() {
                    cur = d.next();
                    cur_at = 0;
                }
            }
        };
        if wr.flags.inline {
            put(None, &wr.inline_data, wr.inline_data.len());
            return Ok(());
        }
        self.each_local(local, wr, Access::NONE, |s| put(Some(s), &[], s.len()))
    }

    /// Takes the peer's oldest posted receive, if any; if none, asks the
    /// peer to wake this side when it posts one.
    fn take_receive(&self) -> Option<TakenRecv> {
        let m = &self.peer.mem;
        for _ in 0..2 {
            let tail = m.load(RQ_TAIL);
            if tail < m.load(RQ_HEAD) {
                let at = self.peer.rq_slot(tail);
                let mut slot = [0u8; RQ_SLOT];
                m.read(at, &mut slot);
                // The owner may claim the entries of a failing QP: only one
                // side gets each receive.
                if m.compare_swap(RQ_TAIL, tail, tail + 1) != tail {
                    return None;
                }
                return Some(TakenRecv { slot });
            }
            // Say so, then look once more: the owner posts, then reads this
            // flag (both sequentially consistent), so one of the two sees
            // the other.
            m.store(PEER_WAITING, 1);
        }
        None
    }

    /// Completes the peer's receive `t` on its ring (`by_write`: consumed
    /// by a WRITE with immediate) and wakes the peer.
    fn put_completion(
        &self,
        t: &TakenRecv,
        byte_len: u32,
        by_write: bool,
        status: WcStatus,
        imm: Option<u32>,
        solicited: bool,
    ) {
        let m = &self.peer.mem;
        let head = m.load(CQ_HEAD);
        let mut slot = [0u8; CQ_SLOT];
        slot[0..8].copy_from_slice(&t.wr_id().to_le_bytes());
        slot[8..12].copy_from_slice(&byte_len.to_le_bytes());
        slot[12] = u8::from(by_write);
        slot[13] = status as u8;
        slot[14] = u8::from(imm.is_some());
        slot[15] = u8::from(solicited);
        slot[16..20].copy_from_slice(&imm.unwrap_or(0).to_le_bytes());
        m.write(self.peer.cq_slot(head), &slot);
        m.store(CQ_HEAD, head.wrapping_add(1));
        self.peer.wake();
    }

    pub(crate) fn post_recv(&self, wr: RecvWr) -> Result<(), PostError> {
        if wr.sgl.len() > (self.caps.max_recv_sge as usize).min(MAX_RECV_SGE) {
            return Err(PostError::TooManySges {
                given: wr.sgl.len(),
                max: self.caps.max_recv_sge.min(MAX_RECV_SGE as u32),
            });
        }
        let mut posted = self.posted.lock().expect("shm RQ lock");
        if posted.len() >= self.caps.max_recv_wr as usize {
            return Err(PostError::QueueFull(self.caps.max_recv_wr));
        }
        if self.failed.load(Ordering::Acquire) {
            // Flushed: by the connection's end if receives wait before it
            // (it flushes them all, in order), else now.
            if !posted.is_empty() {
                posted.push_back(Posted::of(&wr));
                return Ok(());
            }
            drop(posted);
            self.recv_cq
                .push_flushed(wr.wr_id, WcOpcode::Recv, self.qpn);
            return Ok(());
        }
        let m = &self.mine.mem;
        let head = m.load(RQ_HEAD);
        let mut slot = [0u8; RQ_SLOT];
        slot[0..8].copy_from_slice(&wr.wr_id.to_le_bytes());
        slot[8..12].copy_from_slice(&(wr.sgl.len() as u32).to_le_bytes());
        for (i, s) in wr.sgl.iter().enumerate() {
            let e = 16 + 16 * i;
            slot[e..e + 8].copy_from_slice(&s.addr.to_le_bytes());
            slot[e + 8..e + 12].copy_from_slice(&s.len.to_le_bytes());
            slot[e + 12..e + 16].copy_from_slice(&s.lkey.to_le_bytes());
        }
        m.write(self.mine.rq_slot(head), &slot);
        m.store(RQ_HEAD, head.wrapping_add(1));
        posted.push_back(Posted::of(&wr));
        drop(posted);
        if m.load(PEER_WAITING) != 0 {
            m.store(PEER_WAITING, 0);
            self.peer.wake();
        }
        Ok(())
    }

    /// Moves the completions the peer put on this side's ring to the CQ.
    fn drain_completions(&self) {
        let m = &self.mine.mem;
        let mut posted = self.posted.lock().expect("shm RQ lock");
        let mut tail = m.load(CQ_TAIL);
        // The peer can write the tail too: what was drained is counted
        // from this reading, not from another.
        let drained_from = tail;
        let mut head = m.load(CQ_HEAD);
        // The peer writes CQ_HEAD: more than a ring's worth (or less than
        // drained) is a broken peer, not work to do forever.
        if head < tail || head - tail > self.mine.slots {
            head = tail;
            self.fail();
        }
        let mut signal = false;
        while tail < head {
            let mut slot = [0u8; CQ_SLOT];
            m.read(self.mine.cq_slot(tail), &mut slot);
            tail += 1;
            // The peer takes receives in order and completes each as it
            // takes it (both under its send queue's lock): this is the
            // oldest. Its word on which, and on the length, is not trusted.
            let Some(r) = posted.pop_front() else {
                self.fail();
                break;
            };
            let wr_id = r.wr_id;
            let opcode = if slot[12] != 0 {
                WcOpcode::RecvRdmaWithImm
            } else {
                WcOpcode::Recv
            };
            let mut wc = WorkCompletion::new(
                wr_id,
                WcStatus::from_code(u32::from(slot[13])),
                opcode,
                self.qpn,
            );
            // A SEND's length is at most the receive's buffers; a WRITE
            // with immediate's is the WRITE's, into the peer's region.
            wc.byte_len = if slot[12] != 0 {
                le32(&slot, 8)
            } else {
                le32(&slot, 8).min(r.len)
            };
            wc.imm = (slot[14] != 0).then(|| le32(&slot, 16));
            wc.solicited = slot[15] != 0;
            signal |= self.recv_cq.push(wc);
        }
        let pushed = tail != drained_from;
        m.store(CQ_TAIL, tail);
        if pushed && self.recv_cq.overran() {
            self.fail();
        }
        drop(posted);
        if signal {
            self.recv_cq.signal();
        }
    }

    fn send_region(&self, r: &SharedRegion, deadline: Instant) -> io::Result<()> {
        send_by(
            self.sock.as_fd(),
            &r.message(),
            &[r.fd.as_fd()],
            deadline,
            &|| self.failed.load(Ordering::Acquire),
        )
    }

    fn send_revoke(&self, lkey: u32, rkey: u32, deadline: Instant) -> io::Result<()> {
        let mut m = [0u8; 12];
        m[0] = REVOKE;
        m[4..8].copy_from_slice(&lkey.to_le_bytes());
        m[8..12].copy_from_slice(&rkey.to_le_bytes());
        send_by(self.sock.as_fd(), &m, &[], deadline, &|| {
            self.failed.load(Ordering::Acquire)
        })
    }

    /// Waits (until `deadline`, or until the connection fails) for the
    /// peer's acknowledgement of `what` for `lkey`; whether it came.
    fn wait_ack(&self, what: u8, lkey: u32, deadline: Instant) -> bool {
        let mut acks = self.acks.lock().expect("acks lock");
        while !acks.contains(&(what, lkey)) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.failed.load(Ordering::Acquire) {
                return false;
            }
            acks = self.acked.wait_timeout(acks, left).expect("acks lock").0;
        }
        acks.retain(|&a| a != (what, lkey));
        true
    }

    fn send_ack(&self, what: u8, lkey: u32) -> io::Result<()> {
        let mut ack = [0u8; 8];
        ack[0] = ACK;
        ack[1] = what;
        ack[4..8].copy_from_slice(&lkey.to_le_bytes());
        send_by(
            self.sock.as_fd(),
            &ack,
            &[],
            Instant::now() + ACK_WAIT,
            &|| self.failed.load(Ordering::Acquire),
        )
    }

    /// The QP fails: no operation starts from here on, and the progress
    /// thread ends the connection (see [`ShmQp::progress`]) and flushes
    /// what waits here.
    fn fail(&self) {
        {
            // Under the lock `wait_ack` checks the flag under: a waiter for
            // an acknowledgement gives up now.
            let _acks = self.acks.lock().expect("acks lock");
            if self.failed.swap(true, Ordering::AcqRel) {
                return;
            }
            self.acked.notify_all();
        }
        let _ = rustix::io::write(&self.end_now, &1u64.to_ne_bytes());
    }

    /// Tells the peer that this side touches its memory no more: the
    /// operation that may be copying into it (under the send queue's lock)
    /// has ended, and none starts after `failed` was set; then the write
    /// half of the socket closes, which the peer reads as the end.
    fn let_go_of_the_peer(&self) {
        drop(self.sq.lock());
        let _ = rustix::net::shutdown(&self.sock, Shutdown::Write);
    }

    /// The progress thread: the peer's completions and wake-ups, region
    /// updates, and the end of the connection. Either side ends it the same
    /// way: it stops touching the peer's memory, then says so by closing
    /// its write half; a side that hears the end first answers in kind. So
    /// when a side hears the end, every receive of its own that the peer
    /// took is complete, and it may flush the rest (a receive flushed while
    /// the peer still copied into it would be overwritten after the
    /// application got it back). A peer that does not answer within
    /// [`ACK_WAIT`] is not waited for longer.
    fn progress(&self) {
        let mut buf = [0u8; MSG_MAX];
        let mut answer_until: Option<Instant> = None;
        loop {
            if answer_until.is_none() && self.failed.load(Ordering::Acquire) {
                self.let_go_of_the_peer();
                answer_until = Some(Instant::now() + ACK_WAIT);
            }
            let left = answer_until.map(|t| t.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                break;
            }
            let ts = left.map(super::timespec);
            let mut fds = [
                PollFd::new(&self.sock, PollFlags::IN),
                PollFd::new(&self.mine.event, PollFlags::IN),
                PollFd::new(&self.end_now, PollFlags::IN),
            ];
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => {
                    // Not expected; end as for any failure (bounded).
                    self.fail();
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
            }
            let ready = |i: usize| !fds[i].revents().is_empty();
            let (sock_ready, event_ready, end_ready) = (ready(0), ready(1), ready(2));
            #[cfg(test)]
            if self.panic_in_progress.swap(false, Ordering::SeqCst) {
                panic!("the shm progress thread fails, as a test asked");
            }
            if end_ready {
                let mut b = [0u8; 8];
                let _ = rustix::io::read(&self.end_now, &mut b);
            }
            if event_ready {
                let mut b = [0u8; 8];
                let _ = rustix::io::read(&self.mine.event, &mut b);
                self.drain_completions();
                self.run_backlog();
            }
            if !sock_ready {
                continue;
            }
            match recv_msg(self.sock.as_fd(), &mut buf) {
                // The peer's end: it touches this side's memory no more.
                Ok((0, _)) => break,
                // Waiting for the peer's end, its messages need no answer
                // (its descriptors close here).
                _ if answer_until.is_some() => {}
                Ok((n, fds)) => {
                    if self.message(&buf[..n], &fds).is_err() {
                        self.fail();
                    }
                }
                Err(_) => self.fail(),
            }
        }
        if answer_until.is_none() {
            // The peer ended first: this side answers.
            self.failed.store(true, Ordering::Release);
            self.let_go_of_the_peer();
        }
        self.lost();
    }

    /// The progress thread panicked (a bug): the connection ends through
    /// the same handshake as on any failure, so that no work waits forever
    /// and no receive is flushed while the peer may still copy into it.
    fn progress_panicked(&self) {
        self.posted.clear_poison();
        self.acks.clear_poison();
        self.mrs.clear_poison();
        self.fail();
        self.let_go_of_the_peer();
        // The peer's answer: the end of its stream, within ACK_WAIT.
        let until = Instant::now() + ACK_WAIT;
        let mut buf = [0u8; MSG_MAX];
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let mut fds = [PollFd::new(&self.sock, PollFlags::IN)];
            match rustix::event::poll(&mut fds, Some(&super::timespec(left))) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => break,
            }
            if fds[0].revents().is_empty() {
                continue;
            }
            match recv_msg(self.sock.as_fd(), &mut buf) {
                Ok((0, _)) | Err(_) => break,
                Ok(_) => {}
            }
        }
        self.lost();
    }

    fn message(&self, m: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
        match (m.len(), m.first()) {
            (32, Some(&REGION)) if fds.len() == 1 => {
                if self.sq.lock().peer.len() >= MAX_PEER_REGIONS {
                    return Err(too_many_regions());
                }
                let r = map_region(m, &fds[0])?;
                let lkey = r.lkey;
                let mut sq = self.sq.lock();
                if sq.peer.key_in_use(r.lkey) || sq.peer.key_in_use(r.rkey) {
                    return Err(bad("the peer announced a key twice"));
                }
                sq.peer.insert(r);
                drop(sq);
                self.send_ack(REGION, lkey)?;
            }
            (12, Some(&REVOKE)) => {
                let lkey = le32(m, 4);
                self.sq.lock().peer.remove(lkey);
                self.send_ack(REVOKE, lkey)?;
            }
            (8, Some(&ACK)) => {
                let mut acks = self.acks.lock().expect("acks lock");
                acks.push((m[1], le32(m, 4)));
                // Acknowledgements nobody waits for (regions sent while a
                // connection came up) must not pile up.
                if acks.len() > 256 {
                    acks.remove(0);
                }
                drop(acks);
                self.slow_to_ack.store(false, Ordering::Release);
                self.acked.notify_all();
            }
            _ => return Err(bad("an unexpected message from the peer")),
        }
        Ok(())
    }

    /// The connection ended: ERR, everything outstanding flushed, the peer's
    /// memory unmapped.
    fn lost(&self) {
        {
            // Under the lock `wait_ack` checks the flag under: its waiter
            // can't miss the notification between its check and its wait.
            let _acks = self.acks.lock().expect("acks lock");
            self.failed.store(true, Ordering::Release);
            self.acked.notify_all();
        }
        // Receives: claim those the peer has not taken (it may be taking
        // one right now: the claim is a compare-and-swap), then flush the
        // rest. A peer that answered the end has completed what it took; one
        // that did not gets a moment more.
        let m = &self.mine.mem;
        let mut tries = 0;
        // Under the receive queue's lock: a post that checked `failed`
        // before it was set has its slot on the ring before the claim.
        let posting = self.posted.lock().expect("shm RQ lock");
        let taken = loop {
            let tail = m.load(RQ_TAIL);
            let head = m.load(RQ_HEAD);
            // A peer that moves the tail without end is broken: claim anyway.
            tries += 1;
            if tries > 1000 {
                m.store(RQ_TAIL, head);
                break tail;
            }
            if m.compare_swap(RQ_TAIL, tail, head) == tail {
                break tail;
            }
        };
        drop(posting);
        let deadline = Instant::now() + Duration::from_millis(50);
        while m.load(CQ_HEAD) < taken && Instant::now() < deadline {
            std::thread::yield_now();
        }
        self.drain_completions();
        let mut signal = false;
        for r in self.posted.lock().expect("shm RQ lock").drain(..) {
            let wc = WorkCompletion::new(r.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, self.qpn);
            signal |= self.recv_cq.push(wc);
        }
        if signal {
            self.recv_cq.signal();
        }
        let mut signal = false;
        let mut sq = self.sq.lock();
        for wr in sq.backlog.drain(..) {
            let wc =
                WorkCompletion::new(wr.wr_id, WcStatus::WrFlushErr, wr.op.wc_opcode(), self.qpn);
            signal |= self.send_cq.push(wc);
        }
        sq.peer = MrTable::new();
        sq.local = MrTable::new();
        drop(sq);
        if signal {
            self.send_cq.signal();
        }
        if !self.closing.load(Ordering::Acquire) {
            self.events.push(AsyncEvent::QpFatal { qpn: self.qpn });
        }
    }

    /// Ends the connection (the QP is destroyed): returns once the peer
    /// has let go of this side's memory, or did not answer in time.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::Release);
        self.fail();
        if let Some(t) = self.thread.lock().expect("thread lock").take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}
