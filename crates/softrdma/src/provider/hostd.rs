//! Sharing one RoCEv2 address among processes (see `docs/multiprocess.md`).
//!
//! `hostd` owns `IP:4791` and forwards each datagram to the process whose
//! slot is the top byte of the BTH destination QPN, over that process's Unix
//! seqpacket connection. Processes send from their own UDP sockets (same IP,
//! any source port: RoCEv2 peers answer to 4791 whatever the source port).
//!
//! The daemon is found through an abstract Unix socket named after the
//! address (so it is per network namespace). A process that finds none starts
//! one (`softrdma hostd ADDR --exit-when-idle`); of two started at once, the
//! one that binds the name first wins and the other exits.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{SocketAddrV4, UdpSocket};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, PollFd, PollFlags, eventfd};
use rustix::net::{RecvFlags, SendFlags, SocketAddrUnix, SocketFlags, sockopt};
use softrdma_wire::icrc::{self, Ipv4Pseudo};

use super::udp::{RxMeta, recv_datagram, roce_socket};
use super::{connect_unix_within, unix_seqpacket};

/// Bytes the daemon puts before each forwarded datagram: source IPv4
/// address, source UDP port (big endian), TTL, TOS.
pub(crate) const FORWARD_HEADER_LEN: usize = 8;
/// The daemon's greeting: magic, version, then the slot.
const GREETING: &[u8; 5] = b"SRHD1";
/// Slots a daemon hands out: 0 is the slot of QPNs 0 and 1 and of exclusive
/// devices, 0xff that of the multicast QPN 0xffffff.
const SLOTS: std::ops::RangeInclusive<u8> = 1..=254;

/// The greeting's slot byte that turns a process away (not a slot).
const REFUSED: u8 = 0;

/// The daemon's greeting handing out `slot` (or [`REFUSED`]).
fn greeting(slot: u8) -> [u8; 6] {
    let mut hello = [slot; 6];
    hello[..5].copy_from_slice(GREETING);
    hello
}

/// Largest datagram forwarded.
const RX_BUF: usize = 65536;

/// Most datagrams the daemon forwards before it looks at its other sockets.
const FORWARD_BUDGET: usize = 256;

/// Most connections the daemon takes (or turns away) before it looks at
/// its other sockets.
const ACCEPT_BUDGET: usize = 64;

/// The abstract socket name of the daemon serving `addr`.
fn socket_name(addr: SocketAddrV4) -> String {
    format!("softrdma-hostd/{addr}")
}

/// Counters of a daemon.
#[derive(Debug, Default)]
pub struct HostdStats {
    /// Datagrams forwarded to a process.
    pub forwarded: AtomicU64,
    /// Dropped: no process holds the slot, or not a RoCEv2 packet.
    pub no_owner: AtomicU64,
    /// Dropped: the process's connection was full.
    pub overflow: AtomicU64,
    /// Processes that joined.
    pub joined: AtomicU64,
    /// Processes connected now.
    pub connected: AtomicU64,
    /// Processes of another user turned away.
    pub refused: AtomicU64,
    /// CM requests (rdma_cm over RoCEv2) refused: REQs with a REJ,
    /// SIDR_REQs with a SIDR_REP "unsupported".
    pub cm_rejects: AtomicU64,
}

/// The daemon that shares one RoCEv2 address among processes.
#[derive(Debug)]
pub struct Hostd {
    addr: SocketAddrV4,
    udp: UdpSocket,
    listener: OwnedFd,
    clients: Vec<Option<OwnedFd>>,
    /// Where the search for a free slot starts: slots are handed out round
    /// robin, so that a dead process's QPNs are not soon reused.
    next_slot: u8,
    exit_when_idle: Option<Duration>,
    stop: Arc<OwnedFd>,
    stats: Arc<HostdStats>,
}

/// Stops a running daemon (from another thread).
#[derive(Debug, Clone)]
pub struct HostdStopper {
    stop: Arc<OwnedFd>,
}

impl HostdStopper {
    /// Asks the daemon to leave its loop.
    pub fn stop(&self) {
        let _ = rustix::io::write(&*self.stop, &1u64.to_ne_bytes());
    }
}

/// How long a daemon out of descriptors leaves joiners waiting before it
/// tries again.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

impl Hostd {
    /// Claims `addr` for sharing: binds the daemon's name, then the UDP
    /// socket. `AddrInUse` from the name means a daemon already serves it.
    pub fn bind(addr: SocketAddrV4) -> io::Result<Hostd> {
        // What a shared device can open (`Device::open`'s rules).
        let ip = addr.ip();
        if ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() || addr.port() == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{addr}: a hostd serves one unicast IPv4 address and a nonzero port"),
            ));
        }
        // Non-blocking: the loop accepts until there is no one left.
        let listener = unix_seqpacket(SocketFlags::NONBLOCK)?;
        rustix::net::bind(
            &listener,
            &SocketAddrUnix::new_abstract_name(socket_name(addr).as_bytes())?,
        )
        .map_err(|e| {
            let e = io::Error::from(e);
            if e.kind() == io::ErrorKind::AddrInUse {
                io::Error::new(e.kind(), format!("a hostd already serves {addr}"))
            } else {
                e
            }
        })?;
        rustix::net::listen(&listener, 64)?;
        // Forwards TTL and TOS to its clients, UD or not.
        let udp = roce_socket(addr, true).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("hostd cannot bind UDP {addr} (is a process using it exclusively?): {e}"),
            )
        })?;
        Ok(Hostd {
            addr,
            udp,
            listener,
            clients: (0..256).map(|_| None).collect(),
            next_slot: *SLOTS.start(),
            exit_when_idle: None,
            stop: Arc::new(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?),
            stats: Arc::new(HostdStats::default()),
        })
    }

    /// Leave when no process has been connected for `linger` (from the
    /// start, or since the last one left).
    #[must_use]
    pub fn exit_when_idle(mut self, linger: Duration) -> Hostd {
        self.exit_when_idle = Some(linger);
        self
    }

    /// The address served.
    pub fn addr(&self) -> SocketAddrV4 {
        self.addr
    }

    /// The daemon's counters.
    pub fn stats(&self) -> Arc<HostdStats> {
        self.stats.clone()
    }

    /// A handle that stops [`Hostd::run`] from another thread.
    pub fn stopper(&self) -> HostdStopper {
        HostdStopper {
            stop: self.stop.clone(),
        }
    }

    /// Serves until stopped, or idle for the linger time.
    pub fn run(&mut self) -> io::Result<()> {
        let mut rx = vec![0u8; RX_BUF];
        let mut cmsg = nix::cmsg_space!(i32, u8);
        let mut idle_since = Some(Instant::now());
        let mut slots: Vec<u8> = Vec::new();
        let mut accept_paused_until: Option<Instant> = None;
        loop {
            slots.clear();
            slots.extend(
                self.clients
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.is_some())
                    .map(|(s, _)| s as u8),
            );
            let timeout = match (self.exit_when_idle, idle_since) {
                (Some(linger), Some(since)) => {
                    let left = linger.saturating_sub(since.elapsed());
                    if left.is_zero() {
                        return Ok(());
                    }
                    Some(left)
                }
                _ => None,
            };
            // Out of descriptors, the listener stays readable with the
            // joiner it can't take: it is left out of the poll a while, or
            // the daemon would spin.
            let pause_left = accept_paused_until
                .map(|t| t.saturating_duration_since(Instant::now()))
                .filter(|left| !left.is_zero());
            let accepting = pause_left.is_none();
            let timeout = match (timeout, pause_left) {
                (Some(t), Some(p)) => Some(t.min(p)),
                (t, p) => t.or(p),
            };
            // A linger beyond what a timespec holds waits without one.
            let ts = timeout.and_then(|d| {
                Some(rustix::time::Timespec {
                    tv_sec: i64::try_from(d.as_secs()).ok()?,
                    tv_nsec: i64::from(d.subsec_nanos()),
                })
            });
            let mut fds = Vec::with_capacity(3 + slots.len());
            fds.push(PollFd::new(&self.udp, PollFlags::IN));
            fds.push(PollFd::new(
                &self.listener,
                if accepting {
                    PollFlags::IN
                } else {
                    PollFlags::empty()
                },
            ));
            fds.push(PollFd::new(&*self.stop, PollFlags::IN));
            for &s in &slots {
                let fd = self.clients[usize::from(s)].as_ref().expect("listed");
                // Only hang-ups matter: processes never write to the daemon.
                fds.push(PollFd::new(fd, PollFlags::IN));
            }
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
            drop(fds);
            if ready[2] {
                return Ok(());
            }
            for (i, &s) in slots.iter().enumerate() {
                if ready[3 + i] {
                    self.clients[usize::from(s)] = None;
                    self.stats.connected.fetch_sub(1, Ordering::Relaxed);
                }
            }
            if ready[1] && !self.accept() {
                accept_paused_until = Some(Instant::now() + ACCEPT_PAUSE);
            }
            if ready[0] {
                // A budget a look: a flood must not keep the daemon from its
                // stop signal, its joiners and its departed clients.
                for _ in 0..FORWARD_BUDGET {
                    let Some((n, meta)) = recv_datagram(&self.udp, &mut rx, &mut cmsg) else {
                        break;
                    };
                    self.forward(&rx[..n], &meta);
                }
            }
            // Joiners left waiting for descriptors count as company: the
            // daemon does not leave under them.
            let connected = self.clients.iter().any(Option::is_some)
                || accept_paused_until.is_some_and(|t| Instant::now() < t);
            idle_since = match (connected, idle_since) {
                (true, _) => None,
                (false, None) => Some(Instant::now()),
                (false, since) => since,
            };
        }
    }

    /// Takes the processes waiting to join; false if this process ran out
    /// of descriptors (or memory) for them.
    fn accept(&mut self) -> bool {
        // A budget per pass, as forwarding has: processes that keep the
        // backlog full (each turned away) must not keep the daemon from its
        // datagrams and its stop signal.
        for _ in 0..ACCEPT_BUDGET {
            let fd = match rustix::net::accept_with(
                &self.listener,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            ) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::INTR | rustix::io::Errno::CONNABORTED) => continue,
                Err(
                    rustix::io::Errno::MFILE
                    | rustix::io::Errno::NFILE
                    | rustix::io::Errno::NOBUFS
                    | rustix::io::Errno::NOMEM,
                ) => return false,
                Err(_) => return true,
            };
            // A process of another user is turned away (unless the daemon
            // is root's, serving all): it could take every slot.
            let me = rustix::process::geteuid();
            let peer = rustix::net::sockopt::socket_peercred(&fd).map(|c| c.uid);
            if !me.is_root() && peer.ok() != Some(me) {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                let _ = rustix::net::send(&fd, &greeting(REFUSED), SendFlags::NOSIGNAL);
                continue;
            }
            let free = (0..SLOTS.clone().count()).find_map(|i| {
                let span = u32::from(*SLOTS.end() - *SLOTS.start()) + 1;
                let s = (u32::from(self.next_slot - *SLOTS.start()) + i as u32) % span
                    + u32::from(*SLOTS.start());
                let s = s as u8;
                self.clients[usize::from(s)].is_none().then_some(s)
            });
            let Some(slot) = free else {
                // Full: closing the connection tells the process.
                continue;
            };
            // Room for bursts: a full connection drops datagrams (the RC
            // transport retransmits), it never blocks the daemon.
            let _ = sockopt::set_socket_send_buffer_size(&fd, 8 << 20);
            self.next_slot = if slot == *SLOTS.end() {
                *SLOTS.start()
            } else {
                slot + 1
            };
            // Counted before the greeting, so that a process that has its
            // slot sees itself in the counters.
            self.stats.joined.fetch_add(1, Ordering::Relaxed);
            self.stats.connected.fetch_add(1, Ordering::Relaxed);
            if rustix::net::send(&fd, &greeting(slot), SendFlags::NOSIGNAL).is_err() {
                self.stats.connected.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            self.clients[usize::from(slot)] = Some(fd);
        }
        // The rest wait for the next pass (the listener stays readable).
        true
    }

    fn forward(&self, packet: &[u8], meta: &RxMeta) {
        // QP 1 is no process's: a CM REQ gets its REJ here.
        if packet.len() >= 12 && packet[5..8] == [0, 0, 1] {
            self.answer_gsi(packet, meta.from);
            return;
        }
        // The slot is the destination QPN's top byte: BTH byte 5.
        let owner = (packet.len() >= 12)
            .then(|| self.clients[usize::from(packet[5])].as_ref())
            .flatten();
        let Some(fd) = owner else {
            self.stats.no_owner.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let hdr = forward_header(meta);
        let iov = [IoSlice::new(&hdr), IoSlice::new(packet)];
        match rustix::net::sendmsg(
            fd,
            &iov,
            &mut Default::default(),
            SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
        ) {
            Ok(_) => self.stats.forwarded.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.stats.overflow.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// A packet for QP 1, its ICRC not yet checked (the daemon checks no
    /// other's): a CM REQ or SIDR_REQ whose ICRC holds gets its refusal.
    fn answer_gsi(&self, packet: &[u8], from: SocketAddrV4) {
        let udp_len = (8 + packet.len()) as u16;
        let ip = Ipv4Pseudo::df(*from.ip(), *self.addr.ip());
        let udp = icrc::udp_header(from.port(), self.addr.port(), udp_len);
        let sound = matches!(
            icrc::solve_ipv4_identification(&ip.header(udp_len), &udp, packet),
            Ok(Some(_))
        );
        let sent = sound.then(|| super::udp::send_cm_refusal(&self.udp, self.addr, packet, from));
        match sent.flatten() {
            Some(true) => self.stats.cm_rejects.fetch_add(1, Ordering::Relaxed),
            // Not a sound request, or a refusal the socket would not take
            // (the peer's CM retries): dropped as no process's.
            _ => self.stats.no_owner.fetch_add(1, Ordering::Relaxed),
        };
    }
}

fn forward_header(meta: &RxMeta) -> [u8; FORWARD_HEADER_LEN] {
    let mut h = [0u8; FORWARD_HEADER_LEN];
    h[..4].copy_from_slice(&meta.from.ip().octets());
    h[4..6].copy_from_slice(&meta.from.port().to_be_bytes());
    h[6] = meta.ttl;
    h[7] = meta.tos;
    h
}

/// Receives one forwarded datagram into `rx`: `Ok(None)` when there is none
/// now, an error when the daemon is gone.
pub(crate) fn recv_forwarded(
    uplink: impl AsFd,
    rx: &mut [u8],
) -> io::Result<Option<(usize, RxMeta)>> {
    let mut hdr = [0u8; FORWARD_HEADER_LEN];
    let mut iov = [IoSliceMut::new(&mut hdr), IoSliceMut::new(rx)];
    match rustix::net::recvmsg(
        uplink,
        &mut iov,
        &mut Default::default(),
        RecvFlags::DONTWAIT,
    ) {
        Ok(m) if m.bytes == 0 => Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "hostd closed the connection",
        )),
        Ok(m) if m.bytes < FORWARD_HEADER_LEN => Ok(None),
        Ok(m) => {
            let from = SocketAddrV4::new(
                [hdr[0], hdr[1], hdr[2], hdr[3]].into(),
                u16::from_be_bytes([hdr[4], hdr[5]]),
            );
            Ok(Some((
                m.bytes - FORWARD_HEADER_LEN,
                RxMeta {
                    from,
                    ttl: hdr[6],
                    tos: hdr[7],
                    // The daemon's socket does not coalesce (no UDP_GRO).
                    gro_segment: None,
                },
            )))
        }
        Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Joins the daemon serving `addr`, starting one if there is none; returns
/// the connection and the process's slot.
pub(crate) fn join(addr: SocketAddrV4) -> io::Result<(OwnedFd, u8)> {
    match connect(addr) {
        Ok(j) => return Ok(j),
        Err(e) if e.kind() != io::ErrorKind::ConnectionRefused => return Err(e),
        Err(_) => {}
    }
    let program = hostd_program().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "no hostd serves {addr}, and none can be started: put the softrdma \
                 binary on PATH, set SOFTRDMA_HOSTD to it, or run `softrdma hostd {addr}`"
            ),
        )
    })?;
    // A process group of its own: the daemon serves every process on the
    // address, so a Ctrl-C (or SIGHUP) to the one that started it must not
    // reach it.
    let mut child = Command::new(&program)
        .process_group(0)
        .args(["hostd", &addr.to_string(), "--exit-when-idle", "2"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot start hostd ({}): {e}", program.display()),
            )
        })?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match connect(addr) {
            Ok(j) => {
                // Reap it whenever it leaves.
                std::thread::spawn(move || child.wait());
                return Ok(j);
            }
            Err(e) if e.kind() != io::ErrorKind::ConnectionRefused => {
                // A daemon that failed right after it began to listen says
                // why itself; one still running is reaped when it leaves.
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(exited(addr, &mut child, status));
                }
                std::thread::spawn(move || child.wait());
                return Err(e);
            }
            Err(_) => {}
        }
        if let Some(status) = child.try_wait()? {
            // Another process's daemon may have won the race for the name.
            if let Ok(j) = connect(addr) {
                return Ok(j);
            }
            return Err(exited(addr, &mut child, status));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("hostd for {addr} did not start"),
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The error for a daemon this process started that exited: its status and
/// what it wrote to stderr.
fn exited(
    addr: SocketAddrV4,
    child: &mut std::process::Child,
    status: std::process::ExitStatus,
) -> io::Error {
    let mut msg = String::new();
    if let Some(mut err) = child.stderr.take() {
        let _ = io::Read::read_to_string(&mut err, &mut msg);
    }
    io::Error::other(format!(
        "hostd for {addr} exited ({status}): {}",
        msg.trim()
    ))
}

/// The program run as `PROGRAM hostd`: `$SOFTRDMA_HOSTD`, this program if it
/// is softrdma, or `softrdma` on `PATH`.
fn hostd_program() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SOFTRDMA_HOSTD") {
        return Some(p.into());
    }
    if let Ok(me) = std::env::current_exe()
        && me.file_name().is_some_and(|n| n == "softrdma")
    {
        return Some(me);
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join("softrdma"))
        .find(|p| p.is_file())
}

/// How long a joiner waits for the daemon to take its connection.
#[cfg(not(test))]
const JOIN_WAIT: Duration = Duration::from_secs(10);
#[cfg(test)]
const JOIN_WAIT: Duration = Duration::from_secs(1);

fn join_timed_out(addr: SocketAddrV4) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!(
            "the hostd for {addr} took no connection in {} s (stopped, or another \
             process holds its socket name)",
            JOIN_WAIT.as_secs()
        ),
    )
}

fn connect(addr: SocketAddrV4) -> io::Result<(OwnedFd, u8)> {
    let fd = unix_seqpacket(SocketFlags::empty())?;
    let name = SocketAddrUnix::new_abstract_name(socket_name(addr).as_bytes())?;
    connect_unix_within(&fd, &name, JOIN_WAIT).map_err(|e| match e.kind() {
        io::ErrorKind::TimedOut => join_timed_out(addr),
        _ => e,
    })?;
    // Anyone can bind an abstract name: a daemon of another user (root
    // aside) could read this process's traffic and forge its sources.
    let daemon = rustix::net::sockopt::socket_peercred(&fd)?.uid;
    if !daemon.is_root() && daemon != rustix::process::geteuid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the hostd for {addr} runs as user {}, this process as {}: not joined",
                daemon.as_raw(),
                rustix::process::geteuid().as_raw()
            ),
        ));
    }
    let mut hello = [0u8; 6];
    // A signal interrupts a receive under a socket timeout even with
    // SA_RESTART (a SIGCHLD from the daemon just started, say): the next
    // try gets what is left.
    let give_up = Instant::now() + Duration::from_secs(2);
    let n = loop {
        let left = give_up
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        rustix::net::sockopt::set_socket_timeout(
            &fd,
            rustix::net::sockopt::Timeout::Recv,
            Some(left),
        )?;
        match rustix::net::recv(&fd, &mut hello, RecvFlags::empty()) {
            Err(rustix::io::Errno::INTR) if Instant::now() < give_up => {}
            r => {
                break r
                    .map_err(|e| {
                        io::Error::other(format!("no greeting from the hostd for {addr}: {e}"))
                    })?
                    .0;
            }
        }
    };
    if n == 0 {
        return Err(io::Error::other(format!(
            "the hostd for {addr} has no free slot (254 processes)"
        )));
    }
    if n != hello.len() || &hello[..5] != GREETING {
        return Err(io::Error::other(format!(
            "the process serving {addr} is not a compatible hostd"
        )));
    }
    if hello[5] == REFUSED {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("the hostd for {addr} serves processes of its own user only"),
        ));
    }
    rustix::net::sockopt::set_socket_timeout(&fd, rustix::net::sockopt::Timeout::Recv, None)?;
    rustix::net::sockopt::set_socket_recv_buffer_size(&fd, 8 << 20)?;
    rustix::fs::fcntl_setfl(&fd, rustix::fs::OFlags::NONBLOCK)?;
    Ok((fd, hello[5]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket name held by something that never takes connections (a
    /// stopped daemon, or another user's process squatting on the name):
    /// joining times out instead of blocking for good.
    #[test]
    fn a_daemon_that_takes_no_connection_times_the_join_out() {
        // Abstract names are host-wide: an address of this process's own.
        let pid = std::process::id();
        let addr = SocketAddrV4::new(
            std::net::Ipv4Addr::new(127, 201, (pid >> 8) as u8, pid as u8),
            4791,
        );
        let name = SocketAddrUnix::new_abstract_name(socket_name(addr).as_bytes()).unwrap();
        let squatter = unix_seqpacket(SocketFlags::empty()).unwrap();
        rustix::net::bind(&squatter, &name).unwrap();
        rustix::net::listen(&squatter, 0).unwrap();
        // The one connection a backlog of 0 holds.
        let first = unix_seqpacket(SocketFlags::empty()).unwrap();
        rustix::net::connect(&first, &name).unwrap();
        let t = Instant::now();
        let e = connect(addr).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("took no connection"), "{e}");
        assert!(t.elapsed() >= JOIN_WAIT - Duration::from_millis(50));
        assert!(t.elapsed() < JOIN_WAIT + Duration::from_secs(5));
    }

    #[test]
    fn forward_header_round_trips() {
        let meta = RxMeta {
            from: "10.1.2.3:49152".parse().unwrap(),
            ttl: 63,
            tos: 0x88,
            gro_segment: None,
        };
        let h = forward_header(&meta);
        assert_eq!(h, [10, 1, 2, 3, 0xc0, 0x00, 63, 0x88]);
    }

    /// The stat file of this process's thread named `name`, open (a new
    /// thread names itself once it runs: it is looked for a while).
    fn thread_stat(name: &str) -> std::fs::File {
        let t0 = Instant::now();
        loop {
            let found = std::fs::read_dir("/proc/self/task")
                .unwrap()
                .flatten()
                .find(|t| {
                    std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name)
                })
                .and_then(|t| std::fs::File::open(t.path().join("stat")).ok());
            if let Some(f) = found {
                return f;
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "no thread {name}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The CPU time (clock ticks) in a thread's open stat file: read again
    /// with no new descriptor.
    fn cpu_ticks(stat: &std::fs::File) -> u64 {
        let mut buf = [0u8; 1024];
        let n = std::os::unix::fs::FileExt::read_at(stat, &mut buf, 0).unwrap();
        let text = String::from_utf8_lossy(&buf[..n]);
        let f: Vec<&str> = text.rsplit_once(") ").unwrap().1.split(' ').collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }

    /// A daemon out of descriptors can't take a joiner, whose connection
    /// keeps its listener readable: it spun at 100 % of a CPU until a
    /// descriptor came free. Runs in a child process (the limit is the
    /// process's).
    #[test]
    fn a_daemon_out_of_descriptors_waits_for_them_without_spinning() {
        const CHILD: &str = "SOFTRDMA_HOSTD_EMFILE_CHILD";
        let me =
            "provider::hostd::tests::a_daemon_out_of_descriptors_waits_for_them_without_spinning";
        if std::env::var_os(CHILD).is_none() {
            let out = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", me, "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{:?}\n{text}\n{err}", out.status);
            assert!(text.contains("joined after the pause"), "{text}");
            return;
        }
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let addr: SocketAddrV4 = "127.0.0.71:4791".parse().unwrap();
        let mut d = Hostd::bind(addr).unwrap();
        let stopper = d.stopper();
        let daemon = std::thread::Builder::new()
            .name("hostd-emfile".into())
            .spawn(move || d.run())
            .unwrap();
        // The joiner's socket first: then no descriptor is left for the
        // daemon's accept.
        let joiner = unix_seqpacket(SocketFlags::empty()).unwrap();
        let stat = thread_stat("hostd-emfile");
        let name = SocketAddrUnix::new_abstract_name(socket_name(addr).as_bytes()).unwrap();
        let before = getrlimit(Resource::Nofile);
        let highest = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
            .max()
            .unwrap();
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(highest + 1),
                maximum: before.maximum,
            },
        )
        .unwrap();
        // And the numbers free below the limit taken too.
        let mut filler = Vec::new();
        while let Ok(fd) = rustix::io::dup(&joiner) {
            filler.push(fd);
        }
        rustix::net::connect(&joiner, &name).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let cpu = cpu_ticks(&stat);
        std::thread::sleep(Duration::from_millis(500));
        let spent = cpu_ticks(&stat) - cpu;
        // Clock ticks are 10 ms: a spinning daemon spends about 50.
        assert!(spent <= 10, "the daemon spent {spent} ticks in 500 ms");
        setrlimit(Resource::Nofile, before).unwrap();
        drop(filler);
        let mut hello = [0u8; 6];
        rustix::net::sockopt::set_socket_timeout(
            &joiner,
            rustix::net::sockopt::Timeout::Recv,
            Some(Duration::from_secs(5)),
        )
        .unwrap();
        let n = rustix::net::recv(&joiner, &mut hello, RecvFlags::empty())
            .unwrap()
            .0;
        assert_eq!(&hello[..n.min(5)], GREETING);
        println!("joined after the pause");
        stopper.stop();
        daemon.join().unwrap().unwrap();
    }

    #[test]
    fn an_address_no_device_can_open_is_refused() {
        for addr in [
            "0.0.0.0:4791",
            "224.0.0.1:4791",
            "255.255.255.255:4791",
            "127.0.0.1:0",
        ] {
            let Err(e) = Hostd::bind(addr.parse().unwrap()) else {
                panic!("{addr}: bound");
            };
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{addr}: {e}");
        }
    }
}
