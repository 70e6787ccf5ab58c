//! What a RoCEv2 implementation over UDP sockets can reach on this machine
//! with no transport engine at all: the datagrams softrdma sends, with only
//! the work the wire and the one-copy design make mandatory (an ICRC per
//! packet on each side, the received payload copied into its target). The
//! comparison bench (`bench/compare.py`) runs it beside the peers, so that a
//! target above this ceiling shows as such in the same run.
//!
//! ```text
//! roce_ceiling stream SECS [SIZE] [--busy] [--bare] # prints "stream <GB/s>"
//! roce_ceiling read SECS SIZE [--busy] [--bare]       # prints "read <GB/s>"
//! roce_ceiling pingpong ITERS [--bare|--plain] # prints "pingpong <p50 µs> <p99 µs>"
//! ```
//!
//! `stream`: one thread sends full 4 KiB WRITE MIDDLE packets from a buffer
//! of SIZE bytes (default 1 MiB; `softrdma perf` sends every WRITE from one
//! buffer of the message's size, and the receiver writes one such target)
//! in UDP GSO sends of 15 (as the provider does), another receives them
//! with UDP GRO, checks each ICRC and copies each payload into a target of
//! SIZE bytes; GB/s of payload received. The receiver sends an ACK (BTH,
//! AETH, ICRC) every 64 packets, as RC requesters ask (rxe's
//! RXE_MAX_PKT_PER_ACK), and the sender takes the ACKs that wait (checking
//! their ICRCs) after each send: the datagrams an RC WRITE stream cannot do
//! without. Flow control costs nothing beyond them: the sender keeps at
//! most 4 MiB ahead of what the receiver has taken, counted in shared
//! memory. The receiver blocks in `recvmsg` and the
//! sender sleeps while the window is full, as a blocking transport does;
//! `--busy` makes both spin instead, the receiver pausing 10 µs after an
//! empty look as the provider's does in a stream. `read`: the same for RDMA READs of SIZE
//! bytes (from and into buffers of SIZE bytes, as `softrdma perf`'s), with
//! what READ adds on the wire: a requester keeps 16 READ
//! requests out (one datagram each, sent as each READ's last response
//! arrives), a responder takes each request (its ICRC checked) and sends the
//! responses, whose FIRST and LAST packets carry an AETH (4 bytes more than a
//! MIDDLE's, so they cannot share a MIDDLE's GSO send): each READ's LAST
//! goes with the next READ's FIRST in one send where a request waits, as
//! softrdma's responder does at best. `pingpong`: two threads busy-polling
//! their sockets pass the datagram of one half round trip of softrdma's
//! WRITE ping-pong: an 8-byte WRITE ONLY and the ACK of the peer's WRITE in
//! one GSO send; each side checks both ICRCs and copies the 8 bytes, then
//! builds and sends its own; half round trip medians and p99. `--bare`
//! skips the ICRCs and copies (the kernel's part alone); `--plain` passes
//! one 64-byte datagram instead (sockperf's shape, for comparison). Loopback
//! only: 127.0.0.93 and 127.0.0.94.
//!
//! Everything but `--plain` is sent as the provider's RC QPs send: from a
//! socket connected to the peer, the IPv4 IDs its ICRCs cover read by
//! `provider::udp::connected`; receivers check each ICRC as the provider
//! does, in one pass with the ID solved.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{SocketAddrV4, UdpSocket};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrIn, recvmsg, setsockopt, sockopt};
use softrdma::provider::udp::connected::ConnectedSend;
use softrdma::provider::udp::send_datagram;
use softrdma_wire::icrc::{self, IdentificationMaps, Ipv4Flow, Ipv4Pseudo};

const A: [u8; 4] = [127, 0, 0, 93];
const B: [u8; 4] = [127, 0, 0, 94];
const PAYLOAD: usize = 4096;
const BTH: usize = 12;
/// One packet on the wire after the UDP header: BTH, payload, ICRC.
const SEGMENT: usize = BTH + PAYLOAD + icrc::LEN;
/// Full packets per GSO send (65 507 bytes at most).
const PER_SEND: usize = 15;
const REGION: usize = 1 << 20;
const WINDOW_PACKETS: u64 = 1024;
/// A stream's receiver ACKs every this many packets (rxe's
/// RXE_MAX_PKT_PER_ACK; softrdma's requester asks as often).
const PACKETS_PER_ACK: u32 = 64;
/// An ACK: BTH, AETH, ICRC.
const ACK_LEN: usize = BTH + 4 + icrc::LEN;
/// A busy stream receiver's pause after an empty look (the provider's
/// BULK_PAUSE_NS: a receiver forever in `recvmsg` slows the sender).
const BULK_PAUSE: Duration = Duration::from_micros(10);

/// Where packet `psn`'s payload sits in a region of `len` bytes (sender's
/// and target).
fn region_at(psn: u32, len: usize) -> std::ops::Range<usize> {
    let at = (psn as usize % (len / PAYLOAD)) * PAYLOAD;
    at..at + PAYLOAD
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let number = |i: usize| args.get(i).and_then(|a| a.parse::<u64>().ok());
    let size_ok = |n: &u64| {
        let n = *n as usize;
        n >= PAYLOAD && n.is_multiple_of(PAYLOAD) && n <= REGION
    };
    let result = match (args.first().map(String::as_str), number(1)) {
        (Some("stream"), Some(secs)) => match args.get(2).filter(|a| !a.starts_with("--")) {
            None => Some(REGION as u64),
            Some(_) => number(2).filter(size_ok),
        }
        .map_or_else(
            || {
                Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "stream SECS [SIZE]: SIZE a multiple of 4096 up to 1 MiB",
                ))
            },
            |size| {
                stream(secs, size as usize, flag("--busy"), flag("--bare"))
                    .map(|gbs| println!("stream {gbs:.3}"))
            },
        ),
        (Some("read"), Some(secs)) => match number(2).filter(size_ok) {
            Some(size) => read_stream(secs, size as usize, flag("--busy"), flag("--bare"))
                .map(|gbs| println!("read {gbs:.3}")),
            None => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "read SECS SIZE: SIZE a multiple of 4096 up to 1 MiB",
            )),
        },
        (Some("pingpong"), Some(iters)) => pingpong(iters, flag("--bare"), flag("--plain"))
            .map(|(p50, p99)| println!("pingpong {p50:.2} {p99:.2}")),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "usage: roce_ceiling stream SECS [SIZE] [--busy] [--bare] | read SECS SIZE [--busy] \
             [--bare] | pingpong ITERS [--bare|--plain]",
        )),
    };
    if let Err(e) = result {
        eprintln!("roce_ceiling: {e}");
        std::process::exit(1);
    }
}

/// A socket as the provider opens one: 8 MiB buffers, DF, UDP GRO.
fn socket(ip: [u8; 4], nonblocking: bool) -> io::Result<UdpSocket> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
    s.set_recv_buffer_size(8 << 20)?;
    s.set_send_buffer_size(8 << 20)?;
    s.bind(&std::net::SocketAddr::from((ip, 0)).into())?;
    rustix::net::sockopt::set_ip_mtu_discover(&s, rustix::net::sockopt::Ipv4PathMtuDiscovery::DO)?;
    setsockopt(&s, sockopt::UdpGroSegment, &true).map_err(io::Error::from)?;
    s.set_nonblocking(nonblocking)?;
    s.set_read_timeout(Some(Duration::from_millis(100)))?;
    Ok(s.into())
}

fn addr(s: &UdpSocket) -> io::Result<SocketAddrV4> {
    match s.local_addr()? {
        std::net::SocketAddr::V4(a) => Ok(a),
        std::net::SocketAddr::V6(_) => Err(io::Error::other("bound to IPv6")),
    }
}

/// The ICRC of a packet (`head` then `payload`) of `flow` sent with IP ID
/// `ident`, made as the provider makes it: from the flow's pseudo-header
/// CRC (kept by its send socket) and six table lookups for the packet's
/// lengths and ID.
fn icrc_of(flow: &Ipv4Flow, ident: u16, head: &[u8], payload: &[u8]) -> u32 {
    let udp_len = (8 + head.len() + payload.len() + icrc::LEN) as u16;
    let mut crc = flow.icrc(ident, udp_len, head).expect("a BTH");
    crc.update(payload);
    crc.finish()
}

/// Checks ICRCs as the provider does: one pass with IP ID 0, and the ID
/// (which a UDP socket does not show) solved from the difference.
#[derive(Default)]
struct Checker {
    flow: Option<Ipv4Flow>,
    maps: IdentificationMaps,
}

impl Checker {
    /// Whether `packet`, from `from` to `to`, has a good ICRC under some ID.
    fn ok(&mut self, from: SocketAddrV4, to: SocketAddrV4, packet: &[u8]) -> bool {
        let ip = Ipv4Pseudo::df(*from.ip(), *to.ip());
        let flow = match self.flow {
            Some(f) if f.is(&ip, from.port(), to.port()) => f,
            _ => *self.flow.insert(Ipv4Flow::new(ip, from.port(), to.port())),
        };
        self.maps.identify(&flow, packet).is_some()
    }
}

/// A send socket as the provider's RC QPs have: connected to the peer, its
/// IPv4 IDs known.
fn sender(me: SocketAddrV4, peer: SocketAddrV4) -> io::Result<ConnectedSend> {
    ConnectedSend::open(*me.ip(), peer, true)
}

/// A BTH: opcode, destination QP 0x11, PSN.
fn bth(opcode: u8, psn: u32) -> [u8; BTH] {
    let mut h = [0u8; BTH];
    h[0] = opcode;
    h[2..4].copy_from_slice(&0xffffu16.to_be_bytes());
    h[5..8].copy_from_slice(&0x11u32.to_be_bytes()[1..]);
    h[8..12].copy_from_slice(&(psn & 0x00ff_ffff).to_be_bytes());
    h
}

/// Sends `iov` from `out` as one datagram, cut into segments of `segment`
/// bytes (`segments` of them), through the provider's own system call.
fn send_gso(
    out: &mut ConnectedSend,
    iov: &[IoSlice<'_>],
    segment: u16,
    segments: usize,
) -> io::Result<()> {
    let sent =
        send_datagram(out.socket().as_fd(), iov, None, Some(segment)).map_err(io::Error::from);
    counted(out, sent, segments)
}

/// Moves `out`'s ID count past a send of `segments` datagrams, or has the
/// next send read it again if the send failed (it may or may not have
/// moved it), as the provider does.
fn counted(out: &mut ConnectedSend, sent: io::Result<()>, segments: usize) -> io::Result<()> {
    match &sent {
        Ok(()) => out.sent(segments),
        Err(_) => out.failed(),
    }
    sent
}

/// The ID `out`'s next send goes out with.
fn next_ident(out: &mut ConnectedSend) -> io::Result<u16> {
    out.next_ident().map_err(|e| {
        io::Error::other(format!(
            "the send socket's IP ID count cannot be read: {e:?}"
        ))
    })
}

/// Receives one datagram: its length, where from, its GRO segment size.
fn recv(
    sock: &UdpSocket,
    buf: &mut [u8],
    cmsg: &mut [u8],
    flags: MsgFlags,
) -> io::Result<(usize, SocketAddrV4, usize)> {
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<SockaddrIn>(sock.as_raw_fd(), &mut iov, Some(cmsg), flags)
        .map_err(io::Error::from)?;
    let from = msg
        .address
        .map(SocketAddrV4::from)
        .ok_or_else(|| io::Error::other("no source"))?;
    let mut segment = msg.bytes;
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::UdpGroSegments(n) = c
                && n > 0
            {
                segment = n as usize;
            }
        }
    }
    Ok((msg.bytes, from, segment.max(1)))
}

fn stream(secs: u64, region_len: usize, busy: bool, bare: bool) -> io::Result<f64> {
    let rx = socket(B, busy)?;
    let to = addr(&rx)?;
    let from = SocketAddrV4::new(A.into(), 0);
    // ACKs come to the sender's own socket, as to a device's 4791 (a
    // provider's connected send sockets drop what arrives).
    let ack_rx = socket(A, true)?;
    let ack_to = addr(&ack_rx)?;
    let taken = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let sender = {
        let (taken, stop) = (taken.clone(), stop.clone());
        std::thread::spawn(move || -> io::Result<()> {
            let mut out = Sender::new(from, to, region_len, &taken, &stop, bare, busy)?;
            let mut acks = Acks::default();
            let mut psn = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let packets: [(u8, u32); PER_SEND] =
                    std::array::from_fn(|k| (WRITE_MIDDLE, psn.wrapping_add(k as u32)));
                out.send(&packets)?;
                acks.take(&ack_rx, ack_to, to, bare)?;
                psn = psn.wrapping_add(PER_SEND as u32);
            }
            acks.checked()
        })
    };
    let mut buf = vec![0u8; 65536];
    let mut cmsg = nix::cmsg_space!(i32);
    let mut target = vec![0u8; region_len];
    let (mut bytes, mut bad) = (0u64, 0u64);
    let mut checker = Checker::default();
    let mut started = None;
    let (mut unacknowledged, mut ack_psn) = (0u32, 0u32);
    let flags = if busy {
        MsgFlags::MSG_DONTWAIT
    } else {
        MsgFlags::empty()
    };
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        let (n, src, segment) = match recv(&rx, &mut buf, &mut cmsg, flags) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // As the provider's spinning receiver in a stream: a pause
                // with no system call before the next look.
                let until = Instant::now() + BULK_PAUSE;
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        started.get_or_insert_with(Instant::now);
        let mut packets = 0;
        for packet in buf[..n].chunks(segment) {
            packets += 1;
            if packet.len() != SEGMENT {
                bad += 1;
                continue;
            }
            if !bare {
                if !checker.ok(src, to, packet) {
                    bad += 1;
                    continue;
                }
                let psn = u32::from_be_bytes([0, packet[9], packet[10], packet[11]]);
                target[region_at(psn, region_len)].copy_from_slice(&packet[BTH..BTH + PAYLOAD]);
            }
            bytes += PAYLOAD as u64;
        }
        taken.fetch_add(packets, Ordering::Release);
        unacknowledged += packets as u32;
        ack_psn = ack_psn.wrapping_add(packets as u32);
        if unacknowledged >= PACKETS_PER_ACK {
            unacknowledged -= PACKETS_PER_ACK;
            send_ack(&rx, to, ack_to, ack_psn, bare)?;
        }
        sender.thread().unpark();
    }
    std::hint::black_box(&target);
    finish(&stop, sender, bad, bytes, started)
}

/// Ends a stream: stops the sending thread, and gives the GB/s received
/// since `started`, unless packets were bad.
fn finish(
    stop: &AtomicBool,
    sender: std::thread::JoinHandle<io::Result<()>>,
    bad: u64,
    bytes: u64,
    started: Option<Instant>,
) -> io::Result<f64> {
    stop.store(true, Ordering::Relaxed);
    sender.thread().unpark();
    sender
        .join()
        .map_err(|_| io::Error::other("the sending thread panicked"))??;
    if bad > 0 {
        return Err(io::Error::other(format!(
            "{bad} packets with a bad ICRC or size"
        )));
    }
    let secs = started.map_or(0.0, |s| s.elapsed().as_secs_f64());
    if secs == 0.0 {
        return Err(io::Error::other("nothing received"));
    }
    Ok(bytes as f64 / secs / 1e9)
}

/// Sends the ACK of the packets up to `psn` from `rx` (at `me`) to `to`, as
/// a device socket sends it (unconnected, IP ID 0).
fn send_ack(
    rx: &UdpSocket,
    me: SocketAddrV4,
    to: SocketAddrV4,
    psn: u32,
    bare: bool,
) -> io::Result<()> {
    let mut ack = [0u8; ACK_LEN];
    ack[..BTH].copy_from_slice(&bth(RC_ACKNOWLEDGE, psn.wrapping_sub(1)));
    if !bare {
        let flow = Ipv4Flow::new(Ipv4Pseudo::df(*me.ip(), *to.ip()), me.port(), to.port());
        let crc = icrc_of(&flow, 0, &ack[..BTH + 4], &[]);
        ack[BTH + 4..].copy_from_slice(&crc.to_le_bytes());
    }
    rx.send_to(&ack, to).map(drop)
}

/// The stream sender's intake of ACKs: each checked as the provider checks
/// one (its ICRC, with the IP ID solved).
#[derive(Default)]
struct Acks {
    checker: Checker,
    buf: [u8; 32],
    good: u64,
    bad: u64,
}

impl Acks {
    /// Takes the ACKs waiting on `sock` (at `me`), sent from `peer`.
    fn take(
        &mut self,
        sock: &UdpSocket,
        me: SocketAddrV4,
        peer: SocketAddrV4,
        bare: bool,
    ) -> io::Result<()> {
        loop {
            let mut iov = [IoSliceMut::new(&mut self.buf)];
            let got =
                recvmsg::<SockaddrIn>(sock.as_raw_fd(), &mut iov, None, MsgFlags::MSG_DONTWAIT);
            let n = match got {
                Ok(m) => m.bytes,
                Err(nix::errno::Errno::EAGAIN) => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            let ack = &self.buf[..n];
            if n != ACK_LEN
                || ack[0] != RC_ACKNOWLEDGE
                || (!bare && !self.checker.ok(peer, me, ack))
            {
                self.bad += 1;
            } else {
                self.good += 1;
            }
        }
    }

    /// An error if an ACK was bad, or none came (a stream sends thousands).
    fn checked(&self) -> io::Result<()> {
        match (self.good, self.bad) {
            (_, n @ 1..) => Err(io::Error::other(format!("{n} bad ACKs"))),
            (0, 0) => Err(io::Error::other("no ACK came")),
            _ => Ok(()),
        }
    }
}

/// RC ACKNOWLEDGE.
const RC_ACKNOWLEDGE: u8 = 0x11;
/// RDMA WRITE MIDDLE; READ RESPONSE FIRST, MIDDLE and LAST; RDMA READ request.
const WRITE_MIDDLE: u8 = 0x07;
const READ_FIRST: u8 = 0x0d;
const READ_MIDDLE: u8 = 0x0e;
const READ_LAST: u8 = 0x0f;
const READ_REQUEST: u8 = 0x0c;
const AETH: usize = 4;
/// READs a requester keeps out.
const OUTSTANDING_READS: u32 = 16;

/// A READ request for the `packets` responses from `psn` on: BTH, RETH
/// (its length field is what the responder reads), ICRC.
fn read_request(flow: &Ipv4Flow, ident: u16, psn: u32, len: u32, bare: bool) -> [u8; 32] {
    let mut r = [0u8; 32];
    r[..BTH].copy_from_slice(&bth(READ_REQUEST, psn));
    r[BTH + 12..BTH + 16].copy_from_slice(&len.to_be_bytes());
    if !bare {
        let crc = icrc_of(flow, ident, &r[..BTH + 16], &[]);
        r[28..].copy_from_slice(&crc.to_le_bytes());
    }
    r
}

/// A stream's sends: packets of one size in GSO sends of at most 15 (as the
/// provider makes them), each after the flow-control window has room.
struct Sender {
    out: ConnectedSend,
    region: Vec<u8>,
    /// Packets the receiver has taken, and the stop flag.
    taken: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    bare: bool,
    busy: bool,
    sent: u64,
}

impl Sender {
    /// Sends from `me`'s address (an ephemeral port) to `peer`.
    fn new(
        me: SocketAddrV4,
        peer: SocketAddrV4,
        region_len: usize,
        taken: &Arc<AtomicU64>,
        stop: &Arc<AtomicBool>,
        bare: bool,
        busy: bool,
    ) -> io::Result<Sender> {
        Ok(Sender {
            out: sender(me, peer)?,
            region: (0..region_len).map(|i| (i * 7 + 1) as u8).collect(),
            taken: taken.clone(),
            stop: stop.clone(),
            bare,
            busy,
            sent: 0,
        })
    }

    /// Sends one GSO datagram of the packets `(opcode, psn)`, all of one
    /// size (READ FIRST and LAST carry an AETH, the others only a BTH),
    /// once the window has room (nothing once stopped).
    fn send(&mut self, packets: &[(u8, u32)]) -> io::Result<()> {
        while self.sent.saturating_sub(self.taken.load(Ordering::Acquire)) > WINDOW_PACKETS {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            if self.busy {
                std::hint::spin_loop();
            } else {
                std::thread::park_timeout(Duration::from_millis(10));
            }
        }
        let head_len = match packets.first() {
            Some(&(READ_FIRST | READ_LAST, _)) => BTH + AETH,
            _ => BTH,
        };
        let mut heads = [[0u8; BTH + AETH]; PER_SEND];
        let mut trailers = [[0u8; icrc::LEN]; PER_SEND];
        let base = next_ident(&mut self.out)?;
        let flow = self.out.flow();
        let region_len = self.region.len();
        for (k, &(opcode, psn)) in packets.iter().enumerate() {
            heads[k][..BTH].copy_from_slice(&bth(opcode, psn));
            if !self.bare {
                let crc = icrc_of(
                    &flow,
                    base.wrapping_add(k as u16),
                    &heads[k][..head_len],
                    &self.region[region_at(psn, region_len)],
                );
                trailers[k] = crc.to_le_bytes();
            }
        }
        // On the stack, as the provider's gather list is.
        let mut iov = [IoSlice::new(&[]); 3 * PER_SEND];
        for (k, &(_, psn)) in packets.iter().enumerate() {
            iov[3 * k] = IoSlice::new(&heads[k][..head_len]);
            iov[3 * k + 1] = IoSlice::new(&self.region[region_at(psn, region_len)]);
            iov[3 * k + 2] = IoSlice::new(&trailers[k]);
        }
        // One packet goes as a plain datagram (no longer than the segment).
        let segment = (head_len + PAYLOAD + icrc::LEN) as u16;
        let iov = &iov[..3 * packets.len()];
        send_gso(&mut self.out, iov, segment, packets.len())?;
        self.sent += packets.len() as u64;
        Ok(())
    }

    /// Answers the READ at `psn` of `packets` packets; its LAST waits in
    /// `last` for the next READ's FIRST.
    fn answer(&mut self, psn: u32, packets: u32, last: &mut Option<u32>) -> io::Result<()> {
        match last.take() {
            Some(l) => self.send(&[(READ_LAST, l), (READ_FIRST, psn)])?,
            None => self.send(&[(READ_FIRST, psn)])?,
        }
        let mut i = 1;
        while i < packets - 1 {
            let n = (packets - 1 - i).min(PER_SEND as u32);
            let mut chunk = [(READ_MIDDLE, 0u32); PER_SEND];
            for (j, c) in chunk.iter_mut().enumerate().take(n as usize) {
                c.1 = psn.wrapping_add(i + j as u32);
            }
            self.send(&chunk[..n as usize])?;
            i += n;
        }
        *last = Some(psn.wrapping_add(packets - 1));
        Ok(())
    }
}

fn read_stream(secs: u64, size: usize, busy: bool, bare: bool) -> io::Result<f64> {
    let packets = (size / PAYLOAD) as u32;
    if packets < 2 {
        return Err(io::Error::other("a READ of two packets at least"));
    }
    let requester = socket(B, busy)?;
    let responder = socket(A, busy)?;
    let (req_addr, resp_addr) = (addr(&requester)?, addr(&responder)?);
    let taken = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let answering = {
        let (taken, stop) = (taken.clone(), stop.clone());
        std::thread::spawn(move || -> io::Result<()> {
            let mut r = Sender::new(resp_addr, req_addr, size, &taken, &stop, bare, busy)?;
            let mut checker = Checker::default();
            let mut buf = vec![0u8; 65536];
            let mut cmsg = nix::cmsg_space!(i32);
            let mut last = None;
            while !stop.load(Ordering::Relaxed) {
                // A request waiting, else the LAST held for it goes alone.
                let got = recv(&responder, &mut buf, &mut cmsg, MsgFlags::MSG_DONTWAIT);
                let (n, from) = match got {
                    Ok((n, from, _)) => (n, from),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if let Some(l) = last.take() {
                            r.send(&[(READ_LAST, l)])?;
                        }
                        let flags = if busy {
                            MsgFlags::MSG_DONTWAIT
                        } else {
                            MsgFlags::empty()
                        };
                        match recv(&responder, &mut buf, &mut cmsg, flags) {
                            Ok((n, from, _)) => (n, from),
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                                ) =>
                            {
                                continue;
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    Err(e) => return Err(e),
                };
                let request = &buf[..n];
                if n != 32
                    || request[0] != READ_REQUEST
                    || (!bare && !checker.ok(from, resp_addr, request))
                {
                    return Err(io::Error::other("a bad READ request"));
                }
                let psn = u32::from_be_bytes([0, request[9], request[10], request[11]]);
                r.answer(psn, packets, &mut last)?;
            }
            Ok(())
        })
    };
    let mut buf = vec![0u8; 65536];
    let mut cmsg = nix::cmsg_space!(i32);
    let region_len = size;
    let mut target = vec![0u8; region_len];
    let (mut bytes, mut bad) = (0u64, 0u64);
    let mut checker = Checker::default();
    let mut next_psn = 0u32;
    let mut asking = sender(req_addr, resp_addr)?;
    let mut ask = |next_psn: &mut u32| -> io::Result<()> {
        let ident = next_ident(&mut asking)?;
        let r = read_request(&asking.flow(), ident, *next_psn, size as u32, bare);
        *next_psn = next_psn.wrapping_add(packets);
        let sent = send_datagram(asking.socket().as_fd(), &[IoSlice::new(&r)], None, None)
            .map_err(io::Error::from);
        counted(&mut asking, sent, 1)
    };
    for _ in 0..OUTSTANDING_READS {
        ask(&mut next_psn)?;
    }
    let mut started = None;
    let flags = if busy {
        MsgFlags::MSG_DONTWAIT
    } else {
        MsgFlags::empty()
    };
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        let (n, src, segment) = match recv(&requester, &mut buf, &mut cmsg, flags) {
            Ok(r) => r,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(e) => return Err(e),
        };
        started.get_or_insert_with(Instant::now);
        let mut count = 0;
        let mut lasts = 0;
        for packet in buf[..n].chunks(segment) {
            count += 1;
            let head = match packet.first() {
                Some(&READ_MIDDLE) => BTH,
                Some(&READ_FIRST | &READ_LAST) => BTH + AETH,
                _ => 0,
            };
            if head == 0
                || packet.len() != head + PAYLOAD + icrc::LEN
                || (!bare && !checker.ok(src, req_addr, packet))
            {
                bad += 1;
                continue;
            }
            let psn = u32::from_be_bytes([0, packet[9], packet[10], packet[11]]);
            if !bare {
                target[region_at(psn, region_len)].copy_from_slice(&packet[head..head + PAYLOAD]);
            }
            bytes += PAYLOAD as u64;
            lasts += u32::from(packet[0] == READ_LAST);
        }
        taken.fetch_add(count, Ordering::Release);
        answering.thread().unpark();
        for _ in 0..lasts {
            ask(&mut next_psn)?;
        }
    }
    std::hint::black_box(&target);
    finish(&stop, answering, bad, bytes, started)
}

/// One side of the ping-pong: waits for the peer's datagram (unless it
/// starts), then answers with a WRITE and the ACK of the peer's WRITE.
struct Side {
    /// Where it receives (and, `--plain`, sends).
    sock: UdpSocket,
    me: SocketAddrV4,
    peer: SocketAddrV4,
    /// Where it sends from, as the provider's RC QPs do.
    out: ConnectedSend,
    checker: Checker,
    bare: bool,
    plain: bool,
    buf: Vec<u8>,
    cmsg: Vec<u8>,
    target: [u8; 8],
    psn: u32,
}

/// WRITE ONLY with a RETH and 8 bytes, then an ACK: both in one GSO send.
const WRITE_HEAD: usize = BTH + 16;
const WRITE_LEN: usize = WRITE_HEAD + 8 + icrc::LEN;
const ACK_HEAD: usize = BTH + 4;

impl Side {
    fn send(&mut self, count: u64) -> io::Result<()> {
        let mut write = [0u8; WRITE_HEAD];
        write[..BTH].copy_from_slice(&bth(0x0a, self.psn));
        write[BTH + 12..BTH + 16].copy_from_slice(&8u32.to_be_bytes());
        let payload = count.to_le_bytes();
        let mut ack = [0u8; ACK_HEAD];
        ack[..BTH].copy_from_slice(&bth(0x11, self.psn));
        self.psn = self.psn.wrapping_add(1);
        let (mut wcrc, mut acrc) = ([0u8; 4], [0u8; 4]);
        if !self.bare && !self.plain {
            let (flow, base) = (self.out.flow(), next_ident(&mut self.out)?);
            wcrc = icrc_of(&flow, base, &write, &payload).to_le_bytes();
            acrc = icrc_of(&flow, base.wrapping_add(1), &ack, &[]).to_le_bytes();
        }
        if self.plain {
            // sockperf's shape: one 64-byte datagram.
            let mut d = [0u8; 64];
            d[..8].copy_from_slice(&payload);
            return self.sock.send_to(&d, self.peer).map(drop);
        }
        let iov = [
            IoSlice::new(&write),
            IoSlice::new(&payload),
            IoSlice::new(&wcrc),
            IoSlice::new(&ack),
            IoSlice::new(&acrc),
        ];
        send_gso(&mut self.out, &iov, WRITE_LEN as u16, 2)
    }

    /// Spins until the peer's datagram for `count` is in.
    fn wait(&mut self, count: u64, give_up: &AtomicBool) -> io::Result<bool> {
        loop {
            if give_up.load(Ordering::Relaxed) {
                return Ok(false);
            }
            let (n, from, segment) = match recv(
                &self.sock,
                &mut self.buf,
                &mut self.cmsg,
                MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(r) => r,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            };
            if self.plain {
                if from != self.peer || n != 64 || self.buf[..8] != count.to_le_bytes() {
                    return Err(io::Error::other("an unexpected datagram"));
                }
                return Ok(true);
            }
            if *from.ip() != *self.peer.ip() || segment != WRITE_LEN || n <= segment {
                return Err(io::Error::other("an unexpected datagram"));
            }
            let (write, ack) = self.buf[..n].split_at(segment);
            if !self.bare {
                if !self.checker.ok(from, self.me, write) || !self.checker.ok(from, self.me, ack) {
                    return Err(io::Error::other("a bad ICRC"));
                }
                self.target
                    .copy_from_slice(&write[WRITE_HEAD..WRITE_HEAD + 8]);
                if u64::from_le_bytes(self.target) != count {
                    return Err(io::Error::other("a WRITE out of turn"));
                }
            }
            return Ok(true);
        }
    }
}

fn pingpong(iters: u64, bare: bool, plain: bool) -> io::Result<(f64, f64)> {
    let (sa, sb) = (socket(A, true)?, socket(B, true)?);
    let (a, b) = (addr(&sa)?, addr(&sb)?);
    let side = move |sock, me, peer| -> io::Result<Side> {
        Ok(Side {
            sock,
            me,
            peer,
            out: sender(me, peer)?,
            checker: Checker::default(),
            bare,
            plain,
            buf: vec![0u8; 65536],
            cmsg: nix::cmsg_space!(i32),
            target: [0; 8],
            psn: 0,
        })
    };
    let mut client = side(sa, a, b)?;
    let warmup = 1000;
    let total = iters + warmup;
    let failed = Arc::new(AtomicBool::new(false));
    let echo = {
        let failed = failed.clone();
        std::thread::spawn(move || -> io::Result<()> {
            let mut server = side(sb, b, a)?;
            for i in 1..=total {
                let r = server
                    .wait(i, &failed)
                    .and_then(|ok| if ok { server.send(i) } else { Ok(()) });
                if let Err(e) = r {
                    failed.store(true, Ordering::Relaxed);
                    return Err(e);
                }
            }
            Ok(())
        })
    };
    let mut half = Vec::with_capacity(iters as usize);
    let mut run = || -> io::Result<()> {
        for i in 1..=total {
            let t = Instant::now();
            client.send(i)?;
            if !client.wait(i, &failed)? {
                return Err(io::Error::other("the echoing thread failed"));
            }
            if i > warmup {
                half.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        }
        Ok(())
    };
    let r = run();
    if r.is_err() {
        failed.store(true, Ordering::Relaxed);
    }
    let e = echo.join().map_err(|_| io::Error::other("echo panicked"))?;
    r?;
    e?;
    half.sort_by(f64::total_cmp);
    let at = |q: f64| half[((half.len() - 1) as f64 * q) as usize];
    Ok((at(0.5), at(0.99)))
}
