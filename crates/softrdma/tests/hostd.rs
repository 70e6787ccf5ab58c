//! Port sharing through hostd, with the daemon in a thread of the test: a
//! standard peer sending to IP:4791 reaches QPs of two devices that share
//! that address; a daemon that goes away takes the shared ports down; an
//! address held exclusively cannot be shared.

use std::net::UdpSocket;
use std::time::Duration;

use softrdma::cm::{self, ConnInfo, RcOptions};
use softrdma::provider::hostd::Hostd;
use softrdma::verbs::*;

mod common;

const T: Duration = Duration::from_secs(10);

struct Daemon {
    stopper: softrdma::provider::hostd::HostdStopper,
    thread: Option<std::thread::JoinHandle<()>>,
    stats: std::sync::Arc<softrdma::provider::hostd::HostdStats>,
}

impl Daemon {
    fn start(addr: &str) -> Daemon {
        let mut d = Hostd::bind(addr.parse().unwrap()).unwrap();
        let stopper = d.stopper();
        let stats = d.stats();
        let thread = std::thread::spawn(move || d.run().unwrap());
        Daemon {
            stopper,
            thread: Some(thread),
            stats,
        }
    }

    fn stop(&mut self) {
        self.stopper.stop();
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

fn rc_pair(a: &Context, b: &Context) -> (Qp, Cq, Mr, Qp, Cq, Mr) {
    let mk = |ctx: &Context| {
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(1 << 16, Access::ALL).unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
        (qp, cq, mr)
    };
    let (qa, ca, ma) = mk(a);
    let (qb, cb, mb) = mk(b);
    let ia = ConnInfo::local(&qa, Some(&ma)).unwrap();
    let ib = ConnInfo::local(&qb, Some(&mb)).unwrap();
    cm::connect(&qa, &ia, &ib, &RcOptions::default()).unwrap();
    cm::connect(&qb, &ib, &ia, &RcOptions::default()).unwrap();
    (qa, ca, ma, qb, cb, mb)
}

#[test]
fn a_peer_at_4791_reaches_qps_of_two_devices_sharing_an_address() {
    let mut daemon = Daemon::start("127.0.0.48:4791");
    let shared: Vec<Context> = (0..2)
        .map(|_| {
            Device::udp("127.0.0.48:4791".parse().unwrap())
                .shared_port(true)
                .open()
                .unwrap()
        })
        .collect();
    // The standard peer: owns its own IP:4791 and sends to 127.0.0.48:4791.
    let peer = Device::udp("127.0.0.49:4791".parse().unwrap())
        .open()
        .unwrap();
    for (i, ctx) in shared.iter().enumerate() {
        assert_eq!(ctx.local_addr().to_string(), "127.0.0.48:4791");
        let (qp, cq, mr, pqp, pcq, pmr) = rc_pair(ctx, &peer);
        assert_ne!(qp.qpn() >> 16, 0, "a hostd slot in the QPN");
        // The peer WRITEs into the shared device's region and READs it back.
        let data = vec![0x40 + i as u8; 3000];
        pmr.write(0, &data).unwrap();
        pqp.post_send(SendWr::new(
            1,
            SendOp::Write {
                remote_addr: mr.addr() + 100,
                rkey: mr.rkey(),
            },
            vec![pmr.sge(0, 3000)],
        ))
        .unwrap();
        pqp.post_send(SendWr::new(
            2,
            SendOp::Read {
                remote_addr: mr.addr() + 100,
                rkey: mr.rkey(),
            },
            vec![pmr.sge(8192, 3000)],
        ))
        .unwrap();
        let wcs = pcq.wait_for(2, T).unwrap();
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        assert_eq!(mr.read_vec(100, 3000).unwrap(), data);
        assert_eq!(pmr.read_vec(8192, 3000).unwrap(), data);
        // And the shared device SENDs to the peer.
        pqp.post_recv(RecvWr::new(7, [pmr.sge(16384, 64)])).unwrap();
        mr.write(0, b"from a shared port").unwrap();
        qp.post_send(SendWr::new(3, SendOp::Send, vec![mr.sge(0, 18)]))
            .unwrap();
        assert_eq!(cq.wait(T).unwrap().unwrap().status, WcStatus::Success);
        let wc = pcq.wait(T).unwrap().unwrap();
        assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 18));
        assert_eq!(pmr.read_vec(16384, 18).unwrap(), b"from a shared port");
    }
    assert!(
        daemon
            .stats
            .forwarded
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    // A datagram for a slot no process holds is dropped and counted.
    let s = UdpSocket::bind("127.0.0.49:0").unwrap();
    let mut junk = [0u8; 40];
    junk[5] = 0x77;
    s.send_to(&junk, "127.0.0.48:4791").unwrap();
    let t = std::time::Instant::now();
    while daemon
        .stats
        .no_owner
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
    {
        assert!(t.elapsed() < T, "junk not counted");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The daemon goes away: the shared ports go down, with an event.
    daemon.stop();
    for ctx in &shared {
        let mut down = false;
        while let Some(e) = ctx.wait_async_event(T) {
            if e == AsyncEvent::PortDown {
                down = true;
                break;
            }
        }
        assert!(down, "PortDown event");
        assert_eq!(ctx.query_port().state, PortState::Down);
    }
    assert_eq!(peer.query_port().state, PortState::Active);
}

/// Busy-poll mode through the daemon: the application threads that poll
/// take the datagrams from the uplink (the device's own sockets receive
/// nothing there), and a daemon that goes away while they poll takes the
/// port down, once.
#[test]
fn busy_polling_threads_take_what_the_daemon_forwards() {
    let daemon = Daemon::start("127.0.0.56:4791");
    let shared = Device::udp("127.0.0.56:4791".parse().unwrap())
        .shared_port(true)
        .busy_poll(true)
        .open()
        .unwrap();
    let peer = Device::udp("127.0.0.57:4791".parse().unwrap())
        .busy_poll(true)
        .open()
        .unwrap();
    let (qa, ca, ma, qb, cb, mb) = rc_pair(&shared, &peer);
    let ends = [(&qa, &ca, &ma), (&qb, &cb, &mb)];
    let post = |from: (&Qp, &Cq, &Mr), to: (&Qp, &Cq, &Mr), word: u64| {
        from.2.write(0, &word.to_le_bytes()).unwrap();
        from.0
            .post_send(SendWr::new(
                word,
                SendOp::Write {
                    remote_addr: to.2.addr() + 64,
                    rkey: to.2.rkey(),
                },
                vec![from.2.sge(0, 8)],
            ))
            .unwrap();
    };
    // A ping-pong of 8-byte WRITEs as perftest's write_lat runs it, in one
    // thread: the side a WRITE reaches spins on its memory, then posts the
    // next WRITE, which carries the ACK of this one; the first side then
    // spins on its CQ for that ACK.
    let rounds = 200u64;
    post(ends[0], ends[1], 1);
    for word in 1..=rounds {
        let (from, to) = if word % 2 == 1 {
            (ends[0], ends[1])
        } else {
            (ends[1], ends[0])
        };
        let t = std::time::Instant::now();
        while to.2.read_vec(64, 8).unwrap() != word.to_le_bytes() {
            to.1.progress();
            assert!(t.elapsed() < T, "WRITE {word} never landed");
        }
        if word < rounds {
            post(to, from, word + 1);
        }
        let wc = loop {
            if let Some(wc) = from.1.poll_one().unwrap() {
                break wc;
            }
            // The last WRITE's ACK goes out on its target's next look.
            to.1.progress();
            assert!(t.elapsed() < T, "WRITE {word} never completed");
        };
        assert_eq!((wc.wr_id, wc.status), (word, WcStatus::Success));
    }
    let s = shared.stats();
    // Each WRITE from the peer brings the shared device that WRITE and an
    // ACK; the first, before its progress thread stands by, may be the
    // progress thread's.
    assert!(s.received >= rounds, "{s:?}");
    assert!(s.polled * 10 >= s.received * 9, "{s:?}");
    // The daemon goes while the application polls (its progress thread
    // standing by, away from the uplink): the port goes down, once.
    daemon.stopper.stop();
    let t = std::time::Instant::now();
    while shared.query_port().state != PortState::Down {
        ca.progress();
        assert!(t.elapsed() < T, "the port stays up");
    }
    let mut events = vec![];
    while let Some(e) = shared.wait_async_event(Duration::from_millis(200)) {
        events.push(e);
    }
    let downs = events
        .iter()
        .filter(|&&e| e == AsyncEvent::PortDown)
        .count();
    assert_eq!(downs, 1, "{events:?}");
    assert_eq!(events.last(), Some(&AsyncEvent::PortDown), "{events:?}");
    drop(daemon);
}

#[test]
fn an_address_held_exclusively_cannot_be_shared() {
    let _owner = Device::udp("127.0.0.50:4791".parse().unwrap())
        .open()
        .unwrap();
    let err = Hostd::bind("127.0.0.50:4791".parse().unwrap()).unwrap_err();
    assert!(err.to_string().contains("exclusively"), "{err}");
    // And a second daemon for one address is refused by name.
    let _d = Daemon::start("127.0.0.51:4791");
    let err = Hostd::bind("127.0.0.51:4791".parse().unwrap()).unwrap_err();
    assert!(err.to_string().contains("already serves"), "{err}");
}

#[test]
fn a_departed_process_frees_its_slot_and_its_qpns_are_not_reused_at_once() {
    let daemon = Daemon::start("127.0.0.55:4791");
    let open = || {
        Device::udp("127.0.0.55:4791".parse().unwrap())
            .shared_port(true)
            .open()
            .unwrap()
    };
    let slot = |ctx: &Context| {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4).unwrap();
        pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap().qpn() >> 16
    };
    let first = open();
    let s1 = slot(&first);
    let connected = || {
        daemon
            .stats
            .connected
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    assert_eq!(connected(), 1);
    // Closing the device closes its connection, as a killed process's does.
    drop(first);
    let t = std::time::Instant::now();
    while connected() != 0 {
        assert!(t.elapsed() < T, "the slot is not freed");
        std::thread::sleep(Duration::from_millis(2));
    }
    let second = open();
    let s2 = slot(&second);
    assert_ne!(s1, s2, "round robin: the next process gets another slot");
    assert_eq!(
        daemon
            .stats
            .joined
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
}

/// Which child process a test binary started as (see below).
const ROLE: &str = "SOFTRDMA_HOSTD_ROLE";
/// The address the other user's daemon serves.
const OTHER_USERS: &str = "127.0.0.58:4791";

/// The daemon of another user, in a child process run as nobody: serves
/// [`OTHER_USERS`] until its standard input closes.
#[test]
#[ignore = "a child process of a_daemon_and_a_process_of_two_users_refuse_each_other"]
fn other_user_daemon() {
    use std::io::{Read, Write};
    if std::env::var(ROLE).as_deref() != Ok("daemon") {
        return;
    }
    let mut d = Hostd::bind(OTHER_USERS.parse().unwrap()).unwrap();
    let stopper = d.stopper();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read(&mut [0]);
        stopper.stop();
    });
    println!("READY");
    std::io::stdout().flush().unwrap();
    d.run().unwrap();
    std::process::exit(0);
}

/// Anyone can bind an abstract socket name: a process joins no daemon of
/// another user (which could read its traffic and forge its sources), and a
/// daemon turns away a process of another user (which could take every
/// slot). Root's daemon would serve all.
#[test]
fn a_daemon_and_a_process_of_two_users_refuse_each_other() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: can't start a process of another user; skipped");
        return;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["other_user_daemon", "--exact", "--ignored", "--nocapture"])
        .env(ROLE, "daemon")
        .uid(65534)
        .gid(65534)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = std::io::BufReader::new(child.stdout.take().unwrap());
    let ready = lines.lines().map_while(Result::ok).any(|l| l == "READY");
    assert!(ready, "the other user's daemon never started");
    let e = Device::udp(OTHER_USERS.parse().unwrap())
        .shared_port(true)
        .open()
        .unwrap_err();
    assert!(e.to_string().contains("runs as user 65534"), "{e}");
    // A process that asks anyway (straight to the daemon's socket) is
    // greeted with slot 0: turned away.
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketType};
    let fd = rustix::net::socket(AddressFamily::UNIX, SocketType::SEQPACKET, None).unwrap();
    let name = format!("softrdma-hostd/{OTHER_USERS}");
    rustix::net::connect(
        &fd,
        &SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap(),
    )
    .unwrap();
    let mut hello = [0xffu8; 6];
    let n = rustix::net::recv(&fd, &mut hello, rustix::net::RecvFlags::empty())
        .unwrap()
        .0;
    assert_eq!(&hello[..n], b"SRHD1\0");
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

/// QP 1 is no process's: the daemon answers a CM REQ with its REJ.
#[test]
fn the_daemon_rejects_a_cm_req() {
    let daemon = Daemon::start("127.0.0.59:4791");
    common::cm_req_gets_its_rej("127.0.0.59:4791".parse().unwrap(), [127, 0, 0, 96]);
    // Counted once the send returns, which may be after the REJ arrived.
    let rejects = || {
        daemon
            .stats
            .cm_rejects
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let t = std::time::Instant::now();
    while rejects() == 0 && t.elapsed() < T {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(rejects(), 1);
}
