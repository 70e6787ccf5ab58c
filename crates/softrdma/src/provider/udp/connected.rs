//! A QP's own send socket, connected to its peer.
//!
//! An unconnected UDP send looks the route up every time; a connected
//! socket keeps it (docs/performance.md: 0.35–0.55 µs of `roce_ceiling`'s
//! busy-poll half round trip, eighteenth session; a median 0.17 µs of
//! softrdma's, thirty-sixth). The catch is the IPv4 ID, which the ICRC covers: an
//! unconnected socket with DF set sends ID 0, a connected one counts from a
//! random start that no socket option shows.
//!
//! The count can be read all the same. A datagram sent with a software
//! transmit timestamp comes back on the socket's error queue with its
//! headers (unless `net.core.tstamp_allow_data` is 0). A connected UDP socket
//! may still name another destination in a send, and the count moves for
//! that too; so the probe is a datagram of a fresh tag to the socket's own
//! address, which no socket takes and the peer never sees. After the probe,
//! each send moves the count by a step the socket is calibrated for when
//! made. A datagram and a GSO send moved it by one each on the kernels tried
//! (a GSO send's segments take the IDs from its own on). A failed send may
//! or may not have moved it, so the next send probes again; so does the
//! first send after a sign that either end sent something again (a
//! retransmission timeout, a duplicate request), in case anything else
//! moved the count: a strict peer drops a packet under a wrong ID without a
//! word.
//!
//! Where calibrating a socket fails, the device makes no more (QPs without
//! one send from its unconnected sockets, as before; those with one keep
//! it); where opening one fails, or a probe fails for good, that QP does so.
//! A probe that meets a full socket buffer or a pending ICMP error loses its
//! send, as the buffer or the network would have. Each
//! device opens at most a quarter of the process's file descriptors (at
//! most 1024) of them. SOFTRDMA_NO_CONNECTED (any value) turns them off.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use nix::sys::socket::{
    ControlMessage, MsgFlags, SockaddrIn, TimestampingFlag, recvmsg, sendmsg, sendto, setsockopt,
    sockopt,
};
use softrdma_wire::icrc::{Ipv4Flow, Ipv4Pseudo};

/// A classic BPF program of one instruction, `ret #0`: keep no byte of any
/// datagram (the error queue is not filtered).
const DROP_EVERYTHING: [socket2::SockFilter; 1] = [socket2::SockFilter::new(0x06, 0, 0, 0)];

/// A device's connected send sockets: whether they work at all, and how
/// many more it may open.
#[derive(Debug)]
pub(crate) struct Budget {
    /// Whether new sockets are made: off with SOFTRDMA_NO_CONNECTED, or
    /// once one failed to calibrate (the next would fail the same way,
    /// each after a wait). Sockets made before stay.
    on: AtomicBool,
    /// Sockets it may still open: a socket each is a file descriptor each,
    /// which the application's own limit counts too.
    left: AtomicUsize,
}

impl Budget {
    pub(crate) fn new() -> Arc<Budget> {
        let off = std::env::var_os("SOFTRDMA_NO_CONNECTED").is_some();
        // A quarter of the descriptors the process may open, at most 1024.
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(4096);
        Budget::with(!off, (limit / 4).min(1024) as usize)
    }

    fn with(on: bool, sockets: usize) -> Arc<Budget> {
        Arc::new(Budget {
            on: AtomicBool::new(on),
            left: AtomicUsize::new(sockets),
        })
    }

    fn take(self: &Arc<Budget>) -> Option<Taken> {
        self.left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .ok()
            .map(|_| Taken(self.clone()))
    }
}

/// One socket of the budget, given back when dropped.
#[derive(Debug)]
struct Taken(Arc<Budget>);

impl Drop for Taken {
    fn drop(&mut self) {
        self.0.left.fetch_add(1, Ordering::AcqRel);
    }
}

/// A QP's connected send socket, once tried.
#[derive(Debug, Default)]
pub(crate) enum SendSocket {
    /// Not made yet: made at the QP's first send to its peer.
    #[default]
    Untried,
    Ready(ConnectedSend),
    /// Making it failed, or its probes did: the device's sockets send.
    Unusable,
}

impl SendSocket {
    /// The socket connected to `peer`, made (or made again, for a new
    /// peer) from `local_ip`; `None` if there is none, for good. `resends`:
    /// the QP's signs of packets sent again so far (see
    /// `QpEngine::resend_signs`): a new one has the socket read its ID
    /// count again, since a strict peer drops a packet under a wrong ID
    /// without a word.
    pub(crate) fn connected_to(
        &mut self,
        budget: &Arc<Budget>,
        local_ip: Ipv4Addr,
        peer: SocketAddrV4,
        gso: bool,
        resends: u64,
    ) -> Option<&mut ConnectedSend> {
        match self {
            SendSocket::Ready(c) if c.peer != peer => *self = SendSocket::Untried,
            SendSocket::Ready(c) if c.gave_up => *self = SendSocket::Unusable,
            _ => {}
        }
        if let SendSocket::Untried = self {
            *self = SendSocket::Unusable;
            if budget.on.load(Ordering::Relaxed)
                && let Some(taken) = budget.take()
            {
                match ConnectedSend::open_taking(local_ip, peer, gso, Some(taken)) {
                    Ok(mut c) => {
                        c.resends_seen = resends;
                        *self = SendSocket::Ready(c);
                    }
                    // The host's way with IDs or timestamps: the next
                    // socket would fail the same way.
                    Err(Failed::Calibrating(_)) => budget.on.store(false, Ordering::Relaxed),
                    // Out of descriptors, a peer unreachable: this QP alone.
                    Err(Failed::Opening(_)) => {}
                }
            }
        }
        match self {
            SendSocket::Ready(c) => {
                if c.resends_seen != resends {
                    c.resends_seen = resends;
                    c.next_ident = None;
                }
                Some(c)
            }
            _ => None,
        }
    }
}

/// Why a socket could not be made.
#[derive(Debug)]
enum Failed {
    Opening(io::Error),
    Calibrating(io::Error),
}

impl From<Failed> for io::Error {
    fn from(f: Failed) -> io::Error {
        match f {
            Failed::Opening(e) | Failed::Calibrating(e) => e,
        }
    }
}

/// Why a send has no ID to go out with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoIdent {
    /// The probe could not be sent now (a full socket buffer, an ICMP
    /// error pending): lose the send, as that buffer or the network would,
    /// and probe again at the next.
    Busy,
    /// The probe failed otherwise: this socket is given up, and the QP
    /// sends from the device's sockets.
    GaveUp,
}

/// How far a datagram moves a socket's ID count: the only step calibration
/// accepts (Linux's).
const DATAGRAM_STEP: u16 = 1;

/// How long a probe waits for its copy.
const PROBE_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

/// A UDP socket connected to one RoCEv2 peer, with the IPv4 ID its next
/// datagram goes out with (for the ICRC).
#[derive(Debug)]
pub struct ConnectedSend {
    socket: UdpSocket,
    /// Its own address (the source port goes into the ICRC).
    local: SocketAddrV4,
    peer: SocketAddrV4,
    /// Its datagrams' flow, for their ICRCs.
    flow: Ipv4Flow,
    /// The ID the next datagram (a GSO send's first segment) goes out with;
    /// `None` after a failed send, until a probe reads it again.
    next_ident: Option<u16>,
    /// How far a GSO send moves it: `Some(0)` a step per segment, `None`
    /// when GSO sends do not go out here.
    gso_step: Option<u16>,
    /// A probe failed other than for a full buffer: not used again.
    gave_up: bool,
    /// The QP's signs of resends when the count was last read.
    resends_seen: u64,
    _taken: Option<Taken>,
}

impl ConnectedSend {
    /// A socket bound to `local_ip` (an ephemeral port), connected to
    /// `peer`, its ID count read and its steps calibrated (`gso`: GSO sends
    /// too). Errors where the count cannot be read.
    pub fn open(local_ip: Ipv4Addr, peer: SocketAddrV4, gso: bool) -> io::Result<ConnectedSend> {
        Ok(ConnectedSend::open_taking(local_ip, peer, gso, None)?)
    }

    fn open_taking(
        local_ip: Ipv4Addr,
        peer: SocketAddrV4,
        gso: bool,
        taken: Option<Taken>,
    ) -> Result<ConnectedSend, Failed> {
        if local_ip.is_unspecified() {
            return Err(Failed::Opening(io::Error::other(
                "the device has no address of its own",
            )));
        }
        let opened = super::roce_socket(SocketAddrV4::new(local_ip, 0), false).and_then(|s| {
            // Sends only: nothing legitimate arrives here (the peer answers
            // port 4791), and what a peer sent anyway would sit in the
            // receive buffer for good, holding kernel memory and the room
            // the error queue's probes need. A filter drops it on arrival
            // (where filters are refused, the socket serves without one).
            let _ = socket2::SockRef::from(&s).attach_filter(&DROP_EVERYTHING);
            s.connect(peer)?;
            match s.local_addr()? {
                SocketAddr::V4(a) => Ok((s, a)),
                SocketAddr::V6(_) => Err(io::Error::other("an IPv6 address")),
            }
        });
        let (socket, local) = opened.map_err(Failed::Opening)?;
        let ip = Ipv4Pseudo::df(*local.ip(), *peer.ip());
        let mut c = ConnectedSend {
            socket,
            local,
            peer,
            flow: Ipv4Flow::new(ip, local.port(), peer.port()),
            next_ident: None,
            gso_step: None,
            gave_up: false,
            resends_seen: 0,
            _taken: taken,
        };
        c.calibrate(gso).map_err(Failed::Calibrating)?;
        Ok(c)
    }

    /// Reads the count three times: twice in a row (a datagram's step),
    /// then after a GSO send of three segments (a GSO send's step, and the
    /// count to start from).
    fn calibrate(&mut self, gso: bool) -> io::Result<()> {
        #[cfg(test)]
        if tests::FAIL_CALIBRATION.get() {
            return Err(io::Error::other("calibration fails, as a test asked"));
        }
        let (datagram_step, gso_step, last) = self.timestamped(|| {
            let first = self.probe()?;
            let second = self.probe()?;
            let datagram_step = second.wrapping_sub(first);
            let own = SockaddrIn::from(self.local);
            let segment = 1u16;
            let gso_sent = gso
                && sendmsg(
                    self.socket.as_raw_fd(),
                    &[IoSlice::new(&[0u8; 3])],
                    &[ControlMessage::UdpGsoSegments(&segment)],
                    MsgFlags::empty(),
                    Some(&own),
                )
                .is_ok();
            let third = self.probe()?;
            // A GSO send that failed moved nothing (no datagram was made).
            let gso_step = gso_sent.then(|| third.wrapping_sub(second).wrapping_sub(datagram_step));
            Ok((datagram_step, gso_step, third))
        })?;
        // One per datagram, and per GSO send one or one per segment: what
        // Linux does. Anything else is a counter this code does not know.
        if datagram_step != DATAGRAM_STEP {
            return Err(io::Error::other(format!(
                "the IPv4 ID moved by {datagram_step} a datagram"
            )));
        }
        self.gso_step = match gso_step {
            Some(1) => Some(1),
            Some(3) => Some(0),
            _ => None,
        };
        self.next_ident = Some(last.wrapping_add(DATAGRAM_STEP));
        Ok(())
    }

    /// `probing` with software transmit timestamps on (each probe's copy
    /// comes back), and off again after, whatever it returned.
    fn timestamped<T>(&self, probing: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        self.timestamping(true)?;
        let result = probing();
        self.timestamping(false).and(result)
    }

    fn timestamping(&self, on: bool) -> io::Result<()> {
        let flags = if on {
            TimestampingFlag::SOF_TIMESTAMPING_TX_SOFTWARE
                | TimestampingFlag::SOF_TIMESTAMPING_SOFTWARE
        } else {
            TimestampingFlag::empty()
        };
        setsockopt(&self.socket, sockopt::Timestamping, &flags).map_err(io::Error::from)
    }

    /// Sends a datagram of a fresh 8-byte tag to the socket's own address
    /// (timestamping on) and reads the ID it went out with from its
    /// looped-back copy: that copy alone, not an older probe's.
    fn probe(&self) -> io::Result<u16> {
        static TAGS: AtomicU64 = AtomicU64::new(0);
        let tag = (u64::from(std::process::id()) << 32 | TAGS.fetch_add(1, Ordering::Relaxed))
            .to_be_bytes();
        let fd = self.socket.as_raw_fd();
        let mut buf = [0u8; 96];
        let read_copy = |buf: &mut [u8]| {
            recvmsg::<()>(
                fd,
                &mut [IoSliceMut::new(buf)],
                None,
                MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT,
            )
            .map(|m| m.bytes)
        };
        // Copies of earlier probes (one that timed out, say) go first.
        while read_copy(&mut buf).is_ok() {}
        sendto(fd, &tag, &SockaddrIn::from(self.local), MsgFlags::empty())?;
        // The copy is queued as the packet leaves (within the send on
        // loopback); a queue on the device could take a little longer.
        let deadline = std::time::Instant::now() + PROBE_WAIT;
        loop {
            match read_copy(&mut buf) {
                Ok(n) => {
                    if let Some(id) = looped_ident(&buf[..n.min(buf.len())], self.local, &tag) {
                        return Ok(id);
                    }
                }
                Err(nix::errno::Errno::EAGAIN) => {
                    if std::time::Instant::now() >= deadline {
                        return Err(io::Error::other(
                            "no copy of the probe came back (net.core.tstamp_allow_data = 0?)",
                        ));
                    }
                    let mut waiting = [rustix::event::PollFd::new(
                        &self.socket,
                        rustix::event::PollFlags::ERR,
                    )];
                    // The time left, not a whole PROBE_WAIT each round.
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    rustix::event::poll(&mut waiting, Some(&crate::provider::timespec(left)))?;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Its own address (its port is the UDP source port the ICRC covers).
    pub fn local(&self) -> SocketAddrV4 {
        self.local
    }

    /// The flow its datagrams go out in (sent with DF set, as the
    /// device's sockets are).
    pub fn flow(&self) -> Ipv4Flow {
        self.flow
    }

    /// The socket: its sends name no address.
    pub fn socket(&self) -> &UdpSocket {
        &self.socket
    }

    /// The ID the next send's first datagram goes out with, probed again
    /// after a failed send.
    pub fn next_ident(&mut self) -> Result<u16, NoIdent> {
        if self.gave_up {
            return Err(NoIdent::GaveUp);
        }
        if let Some(id) = self.next_ident {
            return Ok(id);
        }
        let probed = self.timestamped(|| self.probe());
        match probed {
            Ok(id) => {
                let next = id.wrapping_add(DATAGRAM_STEP);
                self.next_ident = Some(next);
                Ok(next)
            }
            // A full buffer, a signal, or an ICMP error the socket held
            // for its next call (the peer's port closed, say): the next
            // probe may well work.
            Err(e)
                if e.raw_os_error()
                    .map(nix::errno::Errno::from_raw)
                    .is_some_and(|e| {
                        matches!(
                            e,
                            nix::errno::Errno::EAGAIN
                                | nix::errno::Errno::ENOBUFS
                                | nix::errno::Errno::EINTR
                        ) || pending_icmp(e)
                    }) =>
            {
                Err(NoIdent::Busy)
            }
            Err(_) => {
                self.gave_up = true;
                Err(NoIdent::GaveUp)
            }
        }
    }

    /// Whether a GSO send can go out here.
    pub fn takes_gso(&self) -> bool {
        self.gso_step.is_some()
    }

    /// A send of `segments` datagrams (GSO if more than one) went out: its
    /// segment k had ID [`next_ident`](ConnectedSend::next_ident) + k.
    pub fn sent(&mut self, segments: usize) {
        let step = match self.gso_step {
            Some(0) if segments > 1 => segments as u16,
            Some(s) if segments > 1 => s,
            _ => DATAGRAM_STEP,
        };
        self.next_ident = self.next_ident.map(|id| id.wrapping_add(step));
    }

    /// A send failed: the count may or may not have moved.
    pub fn failed(&mut self) {
        self.next_ident = None;
    }
}

/// Whether `e`, from a send or a probe on a connected socket, can be an
/// ICMP error the socket held for its next call: the ones Linux reports
/// there without IP_RECVERR (port, protocol, network or host unreachable,
/// a host down or isolated, a parameter problem, and, DF being set,
/// fragmentation needed). The peer's or the network's trouble, which may
/// pass; not the socket's. (EMSGSIZE can also be a send's own size, which
/// a probe's 8 bytes never are.)
pub(crate) fn pending_icmp(e: nix::errno::Errno) -> bool {
    use nix::errno::Errno as E;
    matches!(
        e,
        E::ECONNREFUSED
            | E::ENOPROTOOPT
            | E::ENETUNREACH
            | E::EHOSTUNREACH
            | E::EHOSTDOWN
            | E::ENONET
            | E::EPROTO
            | E::EMSGSIZE
    )
}

/// The IPv4 ID of the probe in `data`, a looped-back copy from the link
/// header (Ethernet's 14 bytes, or none) on: a UDP datagram of `tag` from
/// `own` to `own`.
fn looped_ident(data: &[u8], own: SocketAddrV4, tag: &[u8; 8]) -> Option<u16> {
    [0, 14].into_iter().find_map(|at| {
        let ip = data.get(at..at + 36)?;
        let ours = ip[0] == 0x45
            && ip[9] == 17
            && ip[12..16] == own.ip().octets()
            && ip[16..20] == own.ip().octets()
            && ip[20..22] == own.port().to_be_bytes()
            && ip[22..24] == own.port().to_be_bytes()
            && ip[24..26] == 16u16.to_be_bytes()
            && ip[28..36] == tag[..];
        ours.then(|| u16::from_be_bytes([ip[4], ip[5]]))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// Makes this thread's calibrations fail.
        pub(super) static FAIL_CALIBRATION: std::cell::Cell<bool> =
            const { std::cell::Cell::new(false) };
    }

    fn open(local: Ipv4Addr, to: SocketAddrV4) -> ConnectedSend {
        ConnectedSend::open(local, to, true).unwrap()
    }

    /// A socket standing for a peer, and its address.
    fn peer() -> (UdpSocket, SocketAddrV4) {
        let socket = UdpSocket::bind("127.0.0.95:0").unwrap();
        let SocketAddr::V4(at) = socket.local_addr().unwrap() else {
            unreachable!("bound to an IPv4 address")
        };
        (socket, at)
    }

    /// Datagrams to a connected send socket, even from its peer, are
    /// dropped on arrival: none waits in its receive buffer.
    #[test]
    fn nothing_sent_to_the_send_socket_stays() {
        let (peer, to) = peer();
        let c = open(Ipv4Addr::new(127, 0, 0, 96), to);
        for _ in 0..4 {
            peer.send_to(&[0xaa; 1000], c.local).unwrap();
        }
        // Loopback delivers within the send; a moment more all the same.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut buf = [0u8; 2048];
        let e = c.socket.recv(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        // Probes, whose copies come back on the error queue, still read
        // the count (`failed` makes the next look probe).
        let mut c = c;
        c.failed();
        assert!(c.next_ident().is_ok());
    }

    #[test]
    fn a_probe_reads_the_count_and_sends_move_it_by_the_steps() {
        let (peer, to) = peer();
        let mut c = open(Ipv4Addr::new(127, 0, 0, 96), to);
        assert!(c.takes_gso());
        let before = c.next_ident().unwrap();
        let fd = c.socket.as_raw_fd();
        nix::sys::socket::send(fd, &[1, 2, 3], MsgFlags::empty()).unwrap();
        c.sent(1);
        let segment = 2u16;
        sendmsg::<()>(
            fd,
            &[IoSlice::new(&[0u8; 5])],
            &[ControlMessage::UdpGsoSegments(&segment)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        c.sent(3);
        let predicted = c.next_ident().unwrap();
        assert_ne!(predicted, before);
        // A stale copy waiting on the error queue is not taken for the
        // next probe's.
        c.timestamping(true).unwrap();
        nix::sys::socket::sendto(fd, &[9; 8], &SockaddrIn::from(c.local), MsgFlags::empty())
            .unwrap();
        c.timestamping(false).unwrap();
        c.failed();
        // The fresh probe goes out after that datagram: two up.
        assert_eq!(c.next_ident(), Ok(predicted.wrapping_add(2)));
        // The peer got the two sends and no probe.
        let mut buf = [0u8; 16];
        peer.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        while let Ok(n) = peer.recv(&mut buf) {
            got.push(n);
        }
        assert_eq!(got, [3, 2, 2, 1]);
    }

    #[test]
    fn a_probe_that_meets_a_pending_icmp_error_is_busy_not_given_up() {
        let (peer, to) = peer();
        let mut c = open(Ipv4Addr::new(127, 0, 0, 96), to);
        drop(peer);
        // The port is closed now: the ICMP port unreachable that answers
        // this is held for the socket's next call, the probe's send. Sent
        // again now and then: the kernel's global ICMP rate limit may drop
        // an answer while other tests' probes draw on it.
        let tenth = crate::provider::timespec(std::time::Duration::from_millis(100));
        let pending = (0..20).any(|_| {
            // A send that meets an error come late takes it: sent again.
            let _ = nix::sys::socket::send(c.socket.as_raw_fd(), &[1, 2, 3], MsgFlags::empty());
            let mut fd = [rustix::event::PollFd::new(
                &c.socket,
                rustix::event::PollFlags::ERR,
            )];
            rustix::event::poll(&mut fd, Some(&tenth)).unwrap();
            fd[0].revents().contains(rustix::event::PollFlags::ERR)
        });
        assert!(pending, "no ICMP error came back within 2 s");
        c.failed();
        assert_eq!(c.next_ident(), Err(NoIdent::Busy));
        assert!(!c.gave_up);
        assert!(c.next_ident().is_ok(), "the error was the last one's alone");
    }

    #[test]
    fn a_new_peer_or_a_resend_reads_the_count_again() {
        let budget = Budget::with(true, 4);
        let left = budget.left.load(Ordering::Relaxed);
        let peers = [peer(), peer()];
        let local = Ipv4Addr::new(127, 0, 0, 96);
        let mut s = SendSocket::Untried;
        let c = s.connected_to(&budget, local, peers[0].1, true, 5).unwrap();
        let first_port = c.local().port();
        assert!(c.next_ident.is_some(), "the count from calibrating");
        assert_eq!(budget.left.load(Ordering::Relaxed), left - 1);
        let c = s.connected_to(&budget, local, peers[0].1, true, 6).unwrap();
        assert_eq!(c.next_ident, None, "a resend: probe again");
        assert!(c.next_ident().is_ok());
        let c = s.connected_to(&budget, local, peers[1].1, true, 6).unwrap();
        assert_eq!(c.peer, peers[1].1);
        assert_ne!(c.local().port(), first_port, "a new socket");
        assert_eq!(
            budget.left.load(Ordering::Relaxed),
            left - 1,
            "the old one given back"
        );
        // Given up: the device's sockets send, and the socket goes back.
        c.gave_up = true;
        assert_eq!(c.next_ident(), Err(NoIdent::GaveUp));
        assert!(
            s.connected_to(&budget, local, peers[1].1, true, 6)
                .is_none()
        );
        assert!(matches!(s, SendSocket::Unusable));
        assert_eq!(budget.left.load(Ordering::Relaxed), left);
        // Out of budget: the device's sockets send.
        budget.left.store(0, Ordering::Relaxed);
        let mut s = SendSocket::Untried;
        assert!(
            s.connected_to(&budget, local, peers[0].1, true, 0)
                .is_none()
        );
        assert!(matches!(s, SendSocket::Unusable));
        // A socket that cannot be opened (no address) leaves the others on.
        budget.left.store(4, Ordering::Relaxed);
        let mut s = SendSocket::Untried;
        let nowhere = Ipv4Addr::UNSPECIFIED;
        assert!(
            s.connected_to(&budget, nowhere, peers[0].1, true, 0)
                .is_none()
        );
        assert!(budget.on.load(Ordering::Relaxed));
    }

    #[test]
    fn the_errors_an_icmp_message_leaves_are_pending_ones() {
        use nix::errno::Errno as E;
        for e in [
            E::ECONNREFUSED,
            E::ENOPROTOOPT,
            E::ENETUNREACH,
            E::EHOSTUNREACH,
            E::EHOSTDOWN,
            E::ENONET,
            E::EPROTO,
            E::EMSGSIZE,
        ] {
            assert!(pending_icmp(e), "{e}");
        }
        for e in [E::EBADF, E::EINVAL, E::EIO, E::ENOTCONN, E::EAGAIN] {
            assert!(!pending_icmp(e), "{e}");
        }
    }

    #[test]
    fn a_failed_calibration_turns_the_device_s_new_sockets_off() {
        let budget = Budget::with(true, 4);
        let (_peer, to) = peer();
        let local = Ipv4Addr::new(127, 0, 0, 96);
        let mut kept = SendSocket::Untried;
        assert!(kept.connected_to(&budget, local, to, true, 0).is_some());
        FAIL_CALIBRATION.set(true);
        let mut s = SendSocket::Untried;
        let made = s.connected_to(&budget, local, to, true, 0).is_some();
        FAIL_CALIBRATION.set(false);
        assert!(!made);
        assert!(matches!(s, SendSocket::Unusable));
        assert!(!budget.on.load(Ordering::Relaxed), "no more are made");
        assert_eq!(
            budget.left.load(Ordering::Relaxed),
            3,
            "its share given back"
        );
        // Calibrating would work again now, but none is tried.
        let mut s = SendSocket::Untried;
        assert!(s.connected_to(&budget, local, to, true, 0).is_none());
        assert_eq!(budget.left.load(Ordering::Relaxed), 3);
        // The socket made before stays.
        assert!(kept.connected_to(&budget, local, to, true, 0).is_some());
    }

    #[test]
    fn only_the_probe_is_taken_for_one() {
        let own: SocketAddrV4 = "127.0.0.96:40000".parse().unwrap();
        let tag = [1, 2, 3, 4, 5, 6, 7, 8];
        let mut frame = [0u8; 50];
        frame[12..14].copy_from_slice(&[8, 0]);
        let ip = &mut frame[14..];
        ip[0] = 0x45;
        ip[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
        ip[9] = 17;
        ip[12..16].copy_from_slice(&own.ip().octets());
        ip[16..20].copy_from_slice(&own.ip().octets());
        ip[20..22].copy_from_slice(&own.port().to_be_bytes());
        ip[22..24].copy_from_slice(&own.port().to_be_bytes());
        ip[24..26].copy_from_slice(&16u16.to_be_bytes());
        ip[28..36].copy_from_slice(&tag);
        assert_eq!(looped_ident(&frame, own, &tag), Some(0x1234));
        assert_eq!(looped_ident(&frame[14..], own, &tag), Some(0x1234));
        assert_eq!(looped_ident(&frame[..49], own, &tag), None);
        let mut other = frame;
        other[14 + 22] ^= 1;
        assert_eq!(looped_ident(&other, own, &tag), None, "another port");
        let mut older = frame;
        older[14 + 35] ^= 1;
        assert_eq!(looped_ident(&older, own, &tag), None, "another probe's");
        let mut longer = frame;
        longer[14 + 25] = 17;
        assert_eq!(looped_ident(&longer, own, &tag), None, "another length");
    }
}
