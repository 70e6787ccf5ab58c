//! The shared-memory provider between processes: one-sided operations into
//! a process whose application sleeps, a peer killed with SIGKILL, and eight
//! processes hammering one word with FETCH_ADD and a CMP_SWAP lock.
//!
//! The child processes are the ignored tests below, run by their parents.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use softrdma::cm::shm::{self, Listener};
use softrdma::verbs::*;

const ROLE: &str = "SOFTRDMA_SHM_ROLE";
const NAME: &str = "SOFTRDMA_SHM_NAME";
mod common;
use common::{End, one};

/// The next line of the child's that contains `tag` (libtest may print its
/// own words before it on the same line): the numbers after it. Read a byte
/// at a time, so that nothing of the lines after it is buffered and lost.
fn line_with(child: &mut Child, tag: &str) -> Vec<u64> {
    let out = child.stdout.as_mut().unwrap();
    loop {
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while out.read(&mut b).expect("the child's output") == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        assert!(
            !line.is_empty() || b[0] == b'\n',
            "the child ended before {tag}"
        );
        let line = String::from_utf8_lossy(&line);
        if let Some(at) = line.find(tag) {
            return line[at + tag.len()..]
                .split_whitespace()
                .map(|v| v.parse().unwrap())
                .collect();
        }
    }
}

/// The listener's name, in a child process started for `role`; `None`
/// when the test runs otherwise (as a plain test, or another role's child).
fn child_of_role(role: &str) -> Option<String> {
    let name = std::env::var(NAME).ok()?;
    (std::env::var(ROLE).as_deref() == Ok(role)).then_some(name)
}

fn side() -> End {
    End::new(Device::shm(), 4 << 20, 64, QpCaps::default())
}

/// The target: registers three regions (one without write rights), posts
/// three receives, connects, says where its regions are, then does only what
/// stdin asks: `recv N` (wait for N receives, print each), `dereg` (drop the
/// second region), and otherwise sleeps until it is killed.
#[test]
#[ignore = "a child process of shm_tests_between_processes"]
fn sleeping_target() {
    let Some(name) = child_of_role("target") else {
        return;
    };
    let s = side();
    let second = s.pd.register(4096, Access::ALL).unwrap();
    let read_only = s.pd.register(4096, Access::REMOTE_READ).unwrap();
    for k in 0..3 {
        s.qp.post_recv(RecvWr::new(k, [s.mr.sge(k as usize * 4096, 4096)]))
            .unwrap();
    }
    shm::connect(&s.qp, &name).unwrap();
    println!(
        "REGION {} {} {} {} {} {}",
        s.mr.addr(),
        s.mr.rkey(),
        second.addr(),
        second.rkey(),
        read_only.addr(),
        read_only.rkey()
    );
    std::io::stdout().flush().unwrap();
    let mut second = Some(second);
    for line in BufReader::new(std::io::stdin()).lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["recv", n] => {
                for _ in 0..n.parse::<usize>().unwrap() {
                    let wc = one(&s.rcq);
                    assert_eq!(wc.status, WcStatus::Success);
                    println!("GOT {} {}", wc.byte_len, wc.imm.unwrap_or(0));
                }
            }
            ["dereg"] => {
                drop(second.take());
                println!("DEREGGED 1");
            }
            _ => break,
        }
        std::io::stdout().flush().unwrap();
    }
    std::thread::sleep(Duration::from_secs(120));
    std::process::exit(0);
}

/// A connected target process: the parent's side, the child, and the
/// child's regions (main, second, read-only: address and rkey each).
fn target(tag: &str) -> (End, Child, Vec<(u64, u32)>) {
    let name = format!("shm-proc-{}-{tag}", std::process::id());
    let s = side();
    let listener = Listener::bind(&s.ctx, &name).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "sleeping_target",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "target")
        .env(NAME, &name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    listener.accept(&s.qp).unwrap();
    let r = line_with(&mut child, "REGION ");
    let regions = r.chunks(2).map(|c| (c[0], c[1] as u32)).collect();
    (s, child, regions)
}

fn tell(child: &mut Child, what: &str) {
    writeln!(child.stdin.as_mut().unwrap(), "{what}").unwrap();
}

fn write_to(s: &End, (addr, rkey): (u64, u32), at: u64, len: u32) -> WcStatus {
    s.qp.post_send(SendWr::new(
        9,
        SendOp::Write {
            remote_addr: addr + at,
            rkey,
        },
        vec![s.mr.sge(0, len)],
    ))
    .unwrap();
    one(&s.scq).status
}

#[test]
fn shm_tests_between_processes() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    every_operation_into_a_sleeping_process_and_a_deregistration();
    remote_errors_between_processes();
    a_killed_peer_flushes_the_survivor();
    eight_processes_add_and_lock_on_one_word();
    a_process_of_another_user_is_refused();
}

/// The other user's side: connects to the listener it is named and prints
/// what came of it.
#[test]
#[ignore = "a child process of shm_tests_between_processes"]
fn other_user_client() {
    let Some(name) = child_of_role("other-user") else {
        return;
    };
    let s = side();
    match shm::connect(&s.qp, &name) {
        Ok(()) => println!("CONNECTED"),
        Err(e) => println!("REFUSED {e}"),
    }
    std::process::exit(0);
}

/// A PD's regions are mapped into its peers: a process of another user is
/// refused by both sides, whoever reaches the listener's abstract name.
fn a_process_of_another_user_is_refused() {
    use std::os::unix::process::CommandExt;
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: can't start a process of another user; skipped");
        return;
    }
    let name = format!("shm-proc-{}-other-user", std::process::id());
    let s = side();
    let listener = Listener::bind(&s.ctx, &name).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["other_user_client", "--exact", "--ignored", "--nocapture"])
        .env(ROLE, "other-user")
        .env(NAME, &name)
        .uid(65534)
        .gid(65534)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let e = listener.accept(&s.qp).unwrap_err();
    assert!(e.to_string().contains("one user"), "{e}");
    let out = child.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(out.contains("REFUSED"), "the child: {out}");
    assert!(out.contains("one user"), "the child: {out}");
    assert_eq!(s.qp.state(), QpState::Init, "the QP stays unconnected");
}

fn every_operation_into_a_sleeping_process_and_a_deregistration() {
    let (s, mut child, regions) = target("ops");
    let (addr, rkey) = regions[0];
    // 1 MiB WRITE, READ back, FETCH_ADDs and a CMP_SWAP: the target sleeps
    // through all of them.
    let data: Vec<u8> = (0..1 << 20).map(|i: usize| (i * 7 % 251) as u8).collect();
    s.mr.write(0, &data).unwrap();
    assert_eq!(write_to(&s, regions[0], 65536, 1 << 20), WcStatus::Success);
    s.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            remote_addr: addr + 65536,
            rkey,
        },
        vec![s.mr.sge(1 << 20, 1 << 20)],
    ))
    .unwrap();
    assert_eq!(one(&s.scq).status, WcStatus::Success);
    assert_eq!(s.mr.read_vec(1 << 20, 1 << 20).unwrap(), data);
    for k in 0..1000u64 {
        s.qp.post_send(SendWr::new(
            3,
            SendOp::FetchAdd {
                remote_addr: addr + 32768,
                rkey,
                add: 1,
            },
            vec![s.mr.sge(3 << 20, 8)],
        ))
        .unwrap();
        assert_eq!(one(&s.scq).status, WcStatus::Success);
        assert_eq!(s.mr.read_vec(3 << 20, 8).unwrap(), k.to_ne_bytes());
    }
    s.qp.post_send(SendWr::new(
        4,
        SendOp::CompareSwap {
            remote_addr: addr + 32768,
            rkey,
            compare: 1000,
            swap: 77,
        },
        vec![s.mr.sge(3 << 20, 8)],
    ))
    .unwrap();
    assert_eq!(one(&s.scq).status, WcStatus::Success);
    assert_eq!(s.mr.read_vec(3 << 20, 8).unwrap(), 1000u64.to_ne_bytes());
    // The three receives: SEND, SEND with immediate, WRITE with immediate.
    for (id, op, len) in [
        (5, SendOp::Send, 33),
        (6, SendOp::SendWithImm(0x55), 10),
        (
            7,
            SendOp::WriteWithImm {
                remote_addr: addr + 40960,
                rkey,
                imm: 0x66,
            },
            64,
        ),
    ] {
        s.qp.post_send(SendWr::new(id, op, vec![s.mr.sge(0, len)]))
            .unwrap();
        assert_eq!(one(&s.scq).status, WcStatus::Success);
    }
    tell(&mut child, "recv 3");
    assert_eq!(line_with(&mut child, "GOT "), [33, 0]);
    assert_eq!(line_with(&mut child, "GOT "), [10, 0x55]);
    assert_eq!(line_with(&mut child, "GOT "), [64, 0x66]);
    s.qp.post_send(SendWr::new(
        8,
        SendOp::Read {
            remote_addr: addr,
            rkey,
        },
        vec![s.mr.sge(2 << 20, 4096 + 10)],
    ))
    .unwrap();
    assert_eq!(one(&s.scq).status, WcStatus::Success);
    let landed = s.mr.read_vec(2 << 20, 4096 + 10).unwrap();
    assert_eq!(landed[..33], data[..33], "the SEND");
    assert_eq!(landed[4096..], data[..10], "the SEND with immediate");
    // A second region takes WRITEs until the target deregisters it.
    assert_eq!(write_to(&s, regions[1], 0, 100), WcStatus::Success);
    tell(&mut child, "dereg");
    assert_eq!(line_with(&mut child, "DEREGGED "), [1]);
    assert_eq!(write_to(&s, regions[1], 0, 100), WcStatus::RemAccessErr);
    assert_eq!(s.qp.state(), QpState::Err);
    child.kill().unwrap();
    child.wait().unwrap();
}

fn remote_errors_between_processes() {
    // Past the end of a region; into a region without write rights.
    for (k, case) in ["bounds", "rights"].into_iter().enumerate() {
        let (s, mut child, regions) = target(&format!("err{k}"));
        let status = match case {
            "bounds" => write_to(&s, regions[0], (4 << 20) - 50, 100),
            _ => write_to(&s, regions[2], 0, 100),
        };
        assert_eq!(status, WcStatus::RemAccessErr, "{case}");
        assert_eq!(s.qp.state(), QpState::Err, "{case}");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

fn a_killed_peer_flushes_the_survivor() {
    let (s, mut child, _) = target("kill");
    // Work outstanding when the target dies: a receive, and a SEND waiting
    // behind three that take the target's receives.
    s.qp.post_recv(RecvWr::new(5, [s.mr.sge(0, 64)])).unwrap();
    for _ in 0..3 {
        s.qp.post_send(SendWr::new(1, SendOp::Send, vec![s.mr.sge(0, 8)]))
            .unwrap();
        assert_eq!(one(&s.scq).status, WcStatus::Success);
    }
    s.qp.post_send(SendWr::new(6, SendOp::Send, vec![s.mr.sge(0, 8)]))
        .unwrap();
    assert!(
        s.scq.wait(Duration::from_millis(50)).unwrap().is_none(),
        "it waits"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let (w, r) = (one(&s.scq), one(&s.rcq));
    assert_eq!((w.wr_id, w.status), (6, WcStatus::WrFlushErr));
    assert_eq!((r.wr_id, r.status), (5, WcStatus::WrFlushErr));
    assert_eq!(s.qp.state(), QpState::Err);
    let fatal = std::iter::from_fn(|| s.ctx.wait_async_event(Duration::from_secs(1)))
        .any(|e| e == AsyncEvent::QpFatal { qpn: s.qp.qpn() });
    assert!(fatal, "QP fatal event");
    // Posted to the QP in error: flushed, as rxe and siw do.
    s.qp.post_send(SendWr::new(7, SendOp::Send, vec![]))
        .unwrap();
    let w = one(&s.scq);
    assert_eq!((w.wr_id, w.status), (7, WcStatus::WrFlushErr));
}

const ADDS: u64 = 100_000;
const LOCKS: u64 = 2_000;
// Words of the target's region.
const COUNTER: u64 = 0;
const LOCK: u64 = 64;
const INSIDE: u64 = 128;
const GUARDED: u64 = 192;
const VIOLATIONS: u64 = 256;

/// A worker: ADDS FETCH_ADDs on the counter, then LOCKS times: take the
/// lock with CMP_SWAP, check nobody else is inside, bump a plain counter
/// with READ and WRITE (safe only under the lock), leave.
#[test]
#[ignore = "a child process of shm_tests_between_processes"]
fn atomic_worker() {
    let Some(name) = child_of_role("worker") else {
        return;
    };
    let s = side();
    shm::connect(&s.qp, &name).unwrap();
    let mut lines = BufReader::new(std::io::stdin()).lines();
    let l = lines.next().unwrap().unwrap();
    let v: Vec<u64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
    let (addr, rkey, me) = (v[0], v[1] as u32, v[2]);
    let op = |op: SendOp, local: usize| -> u64 {
        s.qp.post_send(SendWr::new(0, op, vec![s.mr.sge(local, 8)]))
            .unwrap();
        assert_eq!(one(&s.scq).status, WcStatus::Success);
        u64::from_ne_bytes(s.mr.read_vec(local, 8).unwrap().try_into().unwrap())
    };
    for _ in 0..ADDS {
        op(
            SendOp::FetchAdd {
                remote_addr: addr + COUNTER,
                rkey,
                add: 1,
            },
            0,
        );
    }
    // Violations seen: how many, and the first one's iteration and the
    // count it found inside (reported with DONE, for a failure's message).
    let mut seen = (0u64, 0u64, 0u64);
    for iteration in 0..LOCKS {
        while op(
            SendOp::CompareSwap {
                remote_addr: addr + LOCK,
                rkey,
                compare: 0,
                swap: me,
            },
            0,
        ) != 0
        {
            std::thread::yield_now();
        }
        let inside = op(
            SendOp::FetchAdd {
                remote_addr: addr + INSIDE,
                rkey,
                add: 1,
            },
            8,
        );
        if inside != 0 {
            if seen.0 == 0 {
                seen = (0, iteration, inside);
            }
            seen.0 += 1;
            op(
                SendOp::FetchAdd {
                    remote_addr: addr + VIOLATIONS,
                    rkey,
                    add: 1,
                },
                8,
            );
        }
        let n = op(
            SendOp::Read {
                remote_addr: addr + GUARDED,
                rkey,
            },
            16,
        );
        s.mr.write(24, &(n + 1).to_ne_bytes()).unwrap();
        op(
            SendOp::Write {
                remote_addr: addr + GUARDED,
                rkey,
            },
            24,
        );
        op(
            SendOp::FetchAdd {
                remote_addr: addr + INSIDE,
                rkey,
                add: u64::MAX,
            },
            8,
        );
        // Release: only the holder writes the lock word.
        s.mr.write(32, &0u64.to_ne_bytes()).unwrap();
        op(
            SendOp::Write {
                remote_addr: addr + LOCK,
                rkey,
            },
            32,
        );
    }
    println!("DONE {me} {} {} {}", seen.0, seen.1, seen.2);
    std::io::stdout().flush().unwrap();
    std::process::exit(0);
}

fn eight_processes_add_and_lock_on_one_word() {
    let name = format!("shm-atomics-{}", std::process::id());
    let target = side();
    let listener = Listener::bind(&target.ctx, &name).unwrap();
    let mut workers = Vec::new();
    let mut qps = Vec::new();
    for me in 1..=8u64 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "atomic_worker",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, "worker")
            .env(NAME, &name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        // Each worker gets a QP of the target's PD.
        let qp = target
            .pd
            .create_qp(&QpInit::rc(&target.scq, &target.rcq))
            .unwrap();
        listener.accept(&qp).unwrap();
        writeln!(
            child.stdin.as_mut().unwrap(),
            "{} {} {me}",
            target.mr.addr(),
            target.mr.rkey()
        )
        .unwrap();
        qps.push(qp);
        workers.push(child);
    }
    // Per worker: violations seen, the first one's iteration and count.
    let mut seen = Vec::new();
    for (k, mut w) in workers.into_iter().enumerate() {
        let done = line_with(&mut w, "DONE ");
        assert_eq!(done.first(), Some(&(k as u64 + 1)), "{done:?}");
        seen.push(done[1..].to_vec());
        assert!(w.wait().unwrap().success());
    }
    let word = |at: u64| {
        u64::from_ne_bytes(
            target
                .mr
                .read_vec(at as usize, 8)
                .unwrap()
                .try_into()
                .unwrap(),
        )
    };
    // Every word at once, so that a failure shows them all: every FETCH_ADD
    // counted once, never two inside the lock, no update under it lost, the
    // lock free and nobody inside at the end.
    let words = [COUNTER, VIOLATIONS, GUARDED, LOCK, INSIDE].map(word);
    assert_eq!(
        words,
        [8 * ADDS, 0, 8 * LOCKS, 0, 0],
        "counter, violations, guarded, lock, inside; per worker (violations, \
         the first's iteration and count inside): {seen:?}"
    );
}
