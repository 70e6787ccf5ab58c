//! One-sided operations complete while the target application sleeps: the
//! target is another process whose main thread is blocked in `sleep`; its
//! device's progress thread serves the WRITE, READ and atomics.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use softrdma::cm::{self, ConnInfo, RcOptions};
use softrdma::verbs::*;

const ROLE: &str = "SOFTRDMA_SLEEPING_TARGET";

/// The target: set up, connect, then sleep until killed.
#[test]
#[ignore = "the child process of a_sleeping_target_process_serves_write_read_and_atomics, which runs it"]
fn target_role() {
    if std::env::var_os(ROLE).is_none() {
        return;
    }
    let ctx = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(1 << 20, Access::ALL).unwrap();
    mr.write(0x8000, &5000u64.to_ne_bytes()).unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("LISTEN {}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (mut tcp, _) = listener.accept().unwrap();
    let local = ConnInfo::local(&qp, Some(&mr)).unwrap();
    let remote = cm::exchange(&mut tcp, &local).unwrap();
    cm::connect(&qp, &local, &remote, &RcOptions::default()).unwrap();
    // From here on the application does nothing at all.
    std::thread::sleep(Duration::from_secs(120));
    std::process::exit(0);
}

#[test]
fn a_sleeping_target_process_serves_write_read_and_atomics() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "target_role",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let port: u16 = loop {
        let line = lines.next().expect("the target prints its port").unwrap();
        // libtest prints "test target_role ... " before the line on the same line.
        if let Some(at) = line.find("LISTEN ") {
            break line[at + 7..].trim().parse().unwrap();
        }
    };
    /// Kills the target whatever happens.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Reap(child);
    {
        let ctx = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(1 << 20, Access::LOCAL_WRITE).unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let local = ConnInfo::local(&qp, None).unwrap();
        let remote = cm::exchange(&mut tcp, &local).unwrap();
        cm::connect(&qp, &local, &remote, &RcOptions::default()).unwrap();
        let done = |n: usize| {
            let wcs = cq.wait_for(n, Duration::from_secs(10)).unwrap();
            assert_eq!(wcs.len(), n, "completions");
            assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        };
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        mr.write(0, &data).unwrap();
        qp.post_send(SendWr::new(
            1,
            SendOp::Write {
                remote_addr: remote.va + 0x10000,
                rkey: remote.rkey,
            },
            vec![mr.sge(0, 200_000)],
        ))
        .unwrap();
        qp.post_send(SendWr::new(
            2,
            SendOp::Read {
                remote_addr: remote.va + 0x10000,
                rkey: remote.rkey,
            },
            vec![mr.sge(400_000, 200_000)],
        ))
        .unwrap();
        done(2);
        assert_eq!(
            mr.read_vec(400_000, 200_000).unwrap(),
            data,
            "READ returns what the WRITE put there"
        );
        for k in 0..10 {
            qp.post_send(SendWr::new(
                10 + k,
                SendOp::FetchAdd {
                    remote_addr: remote.va + 0x8000,
                    rkey: remote.rkey,
                    add: 3,
                },
                vec![mr.sge(700_000 + 8 * k as usize, 8)],
            ))
            .unwrap();
        }
        qp.post_send(SendWr::new(
            30,
            SendOp::CompareSwap {
                remote_addr: remote.va + 0x8000,
                rkey: remote.rkey,
                compare: 5030,
                swap: 1,
            },
            vec![mr.sge(800_000, 8)],
        ))
        .unwrap();
        done(11);
        for k in 0..10 {
            assert_eq!(mr.load_u64(700_000 + 8 * k).unwrap(), 5000 + 3 * k as u64);
        }
        assert_eq!(mr.load_u64(800_000).unwrap(), 5030);
        qp.post_send(SendWr::new(
            31,
            SendOp::Read {
                remote_addr: remote.va + 0x8000,
                rkey: remote.rkey,
            },
            vec![mr.sge(800_008, 8)],
        ))
        .unwrap();
        done(1);
        assert_eq!(mr.load_u64(800_008).unwrap(), 1);
        // The target was asleep the whole time, and still is.
        assert!(
            child.0.try_wait().unwrap().is_none(),
            "the target process exited early"
        );

        // kill -9: the next request gets a clean error, not a hang.
        child.0.kill().unwrap();
        child.0.wait().unwrap();
        qp.post_send(SendWr::new(
            40,
            SendOp::Write {
                remote_addr: remote.va,
                rkey: remote.rkey,
            },
            vec![mr.sge(0, 8)],
        ))
        .unwrap();
        qp.post_send(SendWr::new(41, SendOp::Send, vec![mr.sge(0, 8)]))
            .unwrap();
        let wcs = cq.wait_for(2, Duration::from_secs(10)).unwrap();
        let statuses: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            statuses,
            [(40, WcStatus::RetryExcErr), (41, WcStatus::WrFlushErr)]
        );
        assert_eq!(qp.state(), QpState::Err);
    }
}
