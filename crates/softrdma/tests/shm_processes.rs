//! The shared-memory provider between processes: one-sided operations into
//! a process whose application sleeps, a peer killed with SIGKILL, and eight
//! processes hammering one word with FETCH_ADD and a CMP_SWAP lock.
//!
//! The child processes are the ignored tests below, run by their parents.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use softrdma::cm::shm::{self, Listener};
use softrdma::verbs::*;

const ROLE: &str = "SOFTRDMA_SHM_ROLE";
const NAME: &str = "SOFTRDMA_SHM_NAME";
const T: Duration = Duration::from_secs(30);

fn one(cq: &Cq) -> WorkCompletion {
    cq.wait(T).unwrap().expect("a completion within 30 s")
}

fn spawn(test: &str, role: &str, name: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .env(NAME, name)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The first line of the child's that starts with `tag` (libtest may print
/// its own words before it on the same line).
fn line_with(child: &mut Child, tag: &str) -> Vec<u64> {
    let mut lines = BufReader::new(child.stdout.as_mut().unwrap()).lines();
    loop {
        let line = lines.next().expect("the child says it").unwrap();
        if let Some(at) = line.find(tag) {
            return line[at + tag.len()..]
                .split_whitespace()
                .map(|v| v.parse().unwrap())
                .collect();
        }
    }
}

struct Side {
    ctx: Context,
    pd: Pd,
    mr: Mr,
    scq: Cq,
    rcq: Cq,
    qp: Qp,
}

fn side() -> Side {
    let ctx = Device::shm().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(2 << 20, Access::ALL).unwrap();
    let scq = ctx.create_cq(64).unwrap();
    let rcq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(&QpInit::rc(&scq, &rcq)).unwrap();
    Side {
        ctx,
        pd,
        mr,
        scq,
        rcq,
        qp,
    }
}

/// The target: connects, says where its region is, takes one SEND, then its
/// application sleeps until it is killed.
#[test]
#[ignore = "a child process of shm_tests_between_processes"]
fn sleeping_target() {
    let Ok(name) = std::env::var(NAME) else {
        return;
    };
    if std::env::var(ROLE).as_deref() != Ok("target") {
        return;
    }
    let s = side();
    s.qp.post_recv(RecvWr {
        wr_id: 1,
        sgl: vec![s.mr.sge(0, 64)],
    })
    .unwrap();
    shm::connect(&s.qp, &name).unwrap();
    println!("REGION {} {}", s.mr.addr(), s.mr.rkey());
    std::io::stdout().flush().unwrap();
    let wc = one(&s.rcq);
    assert_eq!(wc.status, WcStatus::Success);
    println!("GOT {}", wc.byte_len);
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(120));
    std::process::exit(0);
}

#[test]
fn shm_tests_between_processes() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    one_sided_into_a_sleeping_process_then_it_is_killed();
    eight_processes_add_and_lock_on_one_word();
}

fn one_sided_into_a_sleeping_process_then_it_is_killed() {
    let name = format!("shm-proc-{}", std::process::id());
    let s = side();
    let listener = Listener::bind(&s.ctx, &name).unwrap();
    let mut child = spawn("sleeping_target", "target", &name);
    listener.accept(&s.qp).unwrap();
    let r = line_with(&mut child, "REGION ");
    let (addr, rkey) = (r[0], r[1] as u32);
    // 1 MiB WRITE, READ back, 1000 FETCH_ADDs: the target sleeps through all.
    let data: Vec<u8> = (0..1 << 20).map(|i: usize| (i * 7 % 251) as u8).collect();
    s.mr.write(0, &data).unwrap();
    s.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: addr + 4096,
            rkey,
        },
        vec![s.mr.sge(0, 1 << 20)],
    ))
    .unwrap();
    assert_eq!(one(&s.scq).status, WcStatus::Success);
    s.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            remote_addr: addr + 4096,
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
                remote_addr: addr + 64,
                rkey,
                add: 1,
            },
            vec![s.mr.sge(128, 8)],
        ))
        .unwrap();
        assert_eq!(one(&s.scq).status, WcStatus::Success);
        assert_eq!(s.mr.read_vec(128, 8).unwrap(), k.to_ne_bytes());
    }
    // The SEND the target waits for.
    s.qp.post_send(SendWr::new(4, SendOp::Send, vec![s.mr.sge(0, 33)]))
        .unwrap();
    assert_eq!(one(&s.scq).status, WcStatus::Success);
    assert_eq!(line_with(&mut child, "GOT "), [33]);
    // Work outstanding when the target dies: a receive, and a SEND waiting
    // for a receive the target will never post.
    s.qp.post_recv(RecvWr {
        wr_id: 5,
        sgl: vec![s.mr.sge(0, 64)],
    })
    .unwrap();
    s.qp.post_send(SendWr::new(6, SendOp::Send, vec![s.mr.sge(0, 8)]))
        .unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let (w, r) = (one(&s.scq), one(&s.rcq));
    assert_eq!((w.wr_id, w.status), (6, WcStatus::WrFlushErr));
    assert_eq!((r.wr_id, r.status), (5, WcStatus::WrFlushErr));
    assert_eq!(s.qp.state(), QpState::Err);
    let fatal = std::iter::from_fn(|| s.ctx.wait_async_event(Duration::from_secs(1)))
        .any(|e| e == AsyncEvent::QpFatal { qpn: s.qp.qpn() });
    assert!(fatal, "QP fatal event");
    assert!(
        s.qp.post_send(SendWr::new(7, SendOp::Send, vec![]))
            .is_err()
    );
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
    let Ok(name) = std::env::var(NAME) else {
        return;
    };
    if std::env::var(ROLE).as_deref() != Ok("worker") {
        return;
    }
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
    for _ in 0..LOCKS {
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
    println!("DONE {me}");
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
    for (k, mut w) in workers.into_iter().enumerate() {
        assert_eq!(line_with(&mut w, "DONE "), [k as u64 + 1]);
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
    assert_eq!(word(COUNTER), 8 * ADDS, "every FETCH_ADD counted once");
    assert_eq!(word(VIOLATIONS), 0, "never two inside the lock");
    assert_eq!(word(GUARDED), 8 * LOCKS, "no update under the lock lost");
    assert_eq!((word(LOCK), word(INSIDE)), (0, 0));
}
