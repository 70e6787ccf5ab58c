//! An application that takes signals: with a handler installed without
//! SA_RESTART, a signal to every thread each millisecond interrupts the
//! library's system calls all the time. None of that may fail a connection, a
//! registration or a transfer, nor stretch a timed wait. Each case runs in
//! a child process of this test binary (the handler is process-wide).

use std::time::{Duration, Instant};

use softrdma::cm::shm::{self, Listener};
use softrdma::verbs::*;

mod common;
use common::{End, T, one};

/// Runs the test `name` of this binary again in a child process under the
/// signals, and asserts it passed there.
fn in_a_child_under_signals(name: &str, body: impl FnOnce()) {
    const CHILD: &str = "SOFTRDMA_SIGNALS_CHILD";
    if std::env::var_os(CHILD).is_none() {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("the child hung");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut out = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
        assert!(status.success(), "{status:?}\n{out}");
        assert!(out.contains("done under signals"), "{out}");
        return;
    }
    extern "C" fn on_alarm(_: libc::c_int) {}
    // SAFETY: a handler that does nothing (async-signal-safe), installed
    // before this process starts any thread of the library.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_alarm as *const () as libc::sighandler_t;
        sa.sa_flags = 0; // no SA_RESTART
        assert_eq!(libc::sigaction(libc::SIGALRM, &sa, std::ptr::null_mut()), 0);
    }
    // A process-wide signal goes to whichever thread the kernel picks
    // (mostly one idle in a wait that restarts): each thread gets its own,
    // every millisecond.
    std::thread::spawn(|| {
        // SAFETY: gettid has no memory effects.
        let me = unsafe { libc::syscall(libc::SYS_gettid) } as libc::pid_t;
        let pid = std::process::id() as libc::pid_t;
        loop {
            for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
                let Ok(tid) = task.file_name().to_string_lossy().parse::<libc::pid_t>() else {
                    continue;
                };
                if tid != me {
                    // SAFETY: tgkill has no memory effects; a thread gone
                    // meanwhile is ESRCH.
                    unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGALRM) };
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    body();
    println!("done under signals");
}

fn shm_end() -> End {
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 64,
    };
    End::new(Device::shm(), 1 << 16, 64, caps)
}

/// The shm exchange runs under socket timeouts, where a signal interrupts
/// even a restartable call: it failed with "Interrupted system call".
/// Registrations after it tell the peer by a deadline, across signals too.
#[test]
fn shm_connects_registers_and_writes_under_signals() {
    in_a_child_under_signals("shm_connects_registers_and_writes_under_signals", || {
        let name = format!("test-{}-signals", std::process::id());
        for round in 0..5 {
            let server = shm_end();
            let listener = Listener::bind(&server.ctx, &format!("{name}-{round}")).unwrap();
            let t = std::thread::spawn(move || {
                // The client waits in the exchange meanwhile.
                std::thread::sleep(Duration::from_millis(100));
                listener.accept(&server.qp).unwrap();
                server
            });
            let client = shm_end();
            shm::connect(&client.qp, &format!("{name}-{round}")).unwrap();
            let server = t.join().unwrap();
            for k in 0..20u64 {
                let target = server.pd.register(4096, Access::ALL).unwrap();
                client.mr.write(0, &k.to_le_bytes()).unwrap();
                client
                    .qp
                    .post_send(SendWr::new(
                        k,
                        SendOp::Write {
                            remote_addr: target.addr(),
                            rkey: target.rkey(),
                        },
                        vec![client.mr.sge(0, 8)],
                    ))
                    .unwrap();
                assert_eq!(one(&client.scq).status, WcStatus::Success);
                let mut got = [0u8; 8];
                target.read(0, &mut got).unwrap();
                assert_eq!(u64::from_le_bytes(got), k);
            }
            assert_eq!(client.qp.state(), QpState::Rts);
            assert_eq!(server.qp.state(), QpState::Rts);
        }
    });
}

/// A timed wait on a completion channel restarted its full timeout at each
/// signal: with signals faster than the timeout it never returned.
#[test]
fn a_timed_cq_wait_ends_on_time_under_signals() {
    in_a_child_under_signals("a_timed_cq_wait_ends_on_time_under_signals", || {
        let ctx = Device::shm().open().unwrap();
        let cq = ctx.create_cq(4).unwrap();
        let t = Instant::now();
        assert!(!cq.wait_event(Duration::from_millis(200)));
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(200), "{took:?}");
        assert!(took < T / 10, "{took:?}");
    });
}

/// SENDs into posted receives, WRITEs and READs, in turn, from `src` to
/// `dst` (a QP, its region, the CQ of its completions), each checked.
fn send_write_read(src: (&Qp, &Mr, &Cq), dst: (&Qp, &Mr, &Cq), what: &str) {
    let (data_at, written_at) = (0usize, 1usize << 18);
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    src.1.write(0, &data).unwrap();
    let mut sends = 0;
    for k in 0..20u64 {
        dst.0
            .post_recv(RecvWr::new(k, [dst.1.sge(data_at, 1 << 17)]))
            .unwrap();
        let (remote_addr, rkey) = (dst.1.addr() + written_at as u64, dst.1.rkey());
        let op = match k % 3 {
            0 => {
                sends += 1;
                SendOp::Send
            }
            1 => SendOp::Write { remote_addr, rkey },
            _ => SendOp::Read { remote_addr, rkey },
        };
        src.0
            .post_send(SendWr::new(k, op, [src.1.sge(0, data.len() as u32)]))
            .unwrap();
        assert_eq!(one(src.2).status, WcStatus::Success, "{what} WR {k}");
    }
    for _ in 0..sends {
        assert_eq!(one(dst.2).status, WcStatus::Success, "{what}");
    }
    assert_eq!(dst.1.read_vec(data_at, data.len()).unwrap(), data, "{what}");
    assert_eq!(
        dst.1.read_vec(written_at, data.len()).unwrap(),
        data,
        "{what}"
    );
}

/// RoCEv2 and iWARP connect and move data with every thread interrupted
/// each millisecond.
#[test]
fn roce_and_iwarp_move_data_under_signals() {
    in_a_child_under_signals("roce_and_iwarp_move_data_under_signals", || {
        use common::{connect_rc, iwarp_pair, roce_end};
        let roce = |ip: &str| roce_end(Device::udp(format!("{ip}:0").parse().unwrap()));
        let (a, b) = (roce("127.0.0.61"), roce("127.0.0.62"));
        connect_rc(&a.qp, &b.qp, Some(&a.mr), &Default::default());
        send_write_read((&a.qp, &a.mr, &a.cq), (&b.qp, &b.mr, &b.cq), "RoCEv2");
        let (c, d) = iwarp_pair(Default::default(), |_| {});
        send_write_read((&c.qp, &c.mr, &c.scq), (&d.qp, &d.mr, &d.rcq), "iWARP");
    });
}
