//! Four processes share one RoCEv2 address, 127.0.0.47:4791, through the
//! hostd they start themselves (the real `softrdma hostd`), and run RC and UD
//! traffic to each other at once: WRITE, SEND, READ and FETCH_ADD on an RC QP
//! per pair, and UD datagrams between their UD QPs; all data verified.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use softrdma::cm::{self, ConnInfo, RcOptions};
use softrdma::verbs::*;

const ROLE: &str = "SOFTRDMA_MESH_RANK";
const ADDR: &str = "127.0.0.47:4791";
const RANKS: usize = 4;
const SENDS: usize = 20;
const DATAGRAMS: usize = 20;
const SEND_LEN: usize = 1000;
const UD_LEN: usize = 512;
const QKEY: u32 = 0x4d45_5348;
const T: Duration = Duration::from_secs(20);

// Layout of each process's region.
const MR_LEN: usize = 512 * 1024;
const WRITE_AT: usize = 0; // + writer * 4096
const OWN_AT: usize = 16384; // what peers READ
const READ_SINK: usize = 20480; // + peer * 4096
const RC_RECV: usize = 65536; // + (peer * SENDS + k) * 1024
const UD_RECV: usize = 147456; // + slot * 1024
const RC_SRC: usize = 212992; // + (peer * SENDS + k) * 1024
const UD_SRC: usize = 299008; // + (peer * DATAGRAMS + k) * 1024
const WRITE_SRC: usize = 385024; // + peer * 4096
const COUNTER: usize = 450560;

/// The bytes `src` sends to `dst` as message `k`.
fn pattern(src: usize, dst: usize, k: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (src * 31 + dst * 7 + k * 13 + i) as u8)
        .collect()
}

/// The lines the test sends this process for the next phase (up to "END").
fn next_phase(lines: &mut impl Iterator<Item = String>) -> Vec<String> {
    let mut got = vec![];
    for l in lines.by_ref() {
        if l == "END" {
            return got;
        }
        got.push(l);
    }
    panic!("stdin closed before the next phase");
}

fn say(line: String) {
    println!("{line}");
    std::io::stdout().flush().unwrap();
}

fn ud_qp(pd: &Pd, scq: &Cq, rcq: &Cq) -> Qp {
    let qp = pd.create_qp(&QpInit::ud(scq, rcq)).unwrap();
    cm::ready_ud(&qp, QKEY, 0).unwrap();
    qp
}

/// One process of the mesh (run by the test below, with its rank in ROLE).
#[test]
#[ignore = "the child process of four_processes_share_one_address_for_rc_and_ud, which runs it"]
fn mesh_process() {
    let Some(me) = std::env::var(ROLE)
        .ok()
        .and_then(|r| r.parse::<usize>().ok())
    else {
        return;
    };
    let mut stdin = std::io::stdin().lines().map(Result::unwrap);
    let ctx = Device::udp(ADDR.parse().unwrap())
        .shared_port(true)
        .open()
        .unwrap();
    assert_eq!(ctx.local_addr().to_string(), ADDR);
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(MR_LEN, Access::ALL).unwrap();
    mr.write(OWN_AT, &pattern(me, 9, 0, 4096)).unwrap();
    let scq = ctx.create_cq(512).unwrap();
    let rcq = ctx.create_cq(512).unwrap();
    let peers: Vec<usize> = (0..RANKS).filter(|&p| p != me).collect();
    let mut rc = BTreeMap::new();
    for &p in &peers {
        let qp = pd.create_qp(&QpInit::rc(&scq, &rcq)).unwrap();
        let info = ConnInfo::local(&qp, Some(&mr)).unwrap();
        rc.insert(p, (qp, info));
    }
    let ud = ud_qp(&pd, &scq, &rcq);
    for slot in 0..peers.len() * DATAGRAMS {
        ud.post_recv(RecvWr::new(
            1_000_000 + slot as u64,
            [mr.sge(UD_RECV + slot * 1024, 40 + UD_LEN as u32)],
        ))
        .unwrap();
    }
    say(format!("HELLO {me} {:#08x}", ud.qpn()));
    for (p, (_, info)) in &rc {
        say(format!("CONN {me} {p} {}", info.to_line()));
    }
    say(format!("UD {me} {}", ud.qpn()));

    // Peers' QPs: "CONN from to line" and "UD from qpn".
    let mut remote_rc = BTreeMap::new();
    let mut remote_ud = BTreeMap::new();
    for l in next_phase(&mut stdin) {
        let w: Vec<&str> = l.splitn(4, ' ').collect();
        match w[0] {
            "CONN" => {
                let from: usize = w[1].parse().unwrap();
                remote_rc.insert(from, w[3].parse::<ConnInfo>().unwrap());
            }
            "UD" => {
                remote_ud.insert(w[1].parse::<usize>().unwrap(), w[2].parse::<u32>().unwrap());
            }
            _ => panic!("unexpected {l}"),
        }
    }
    assert_eq!(remote_rc.len(), peers.len());
    assert_eq!(remote_ud.len(), peers.len());
    for (p, (qp, info)) in &rc {
        cm::connect(qp, info, &remote_rc[p], &RcOptions::default()).unwrap();
        for k in 0..SENDS {
            qp.post_recv(RecvWr::new(
                (p * SENDS + k) as u64,
                [mr.sge(RC_RECV + (p * SENDS + k) * 1024, 1024)],
            ))
            .unwrap();
        }
    }
    // Every peer is at the same address: one address handle serves them all.
    let ah = pd
        .create_ah(AhAttr {
            addr: ADDR.parse().unwrap(),
        })
        .unwrap();
    say(format!("READY {me}"));
    next_phase(&mut stdin);

    for (&p, (qp, _)) in &rc {
        let remote = &remote_rc[&p];
        mr.write(WRITE_SRC + p * 4096, &pattern(me, p, 99, 4096))
            .unwrap();
        qp.post_send(SendWr::new(
            1,
            SendOp::Write {
                remote_addr: remote.va + (WRITE_AT + me * 4096) as u64,
                rkey: remote.rkey,
            },
            vec![mr.sge(WRITE_SRC + p * 4096, 4096)],
        ))
        .unwrap();
        for k in 0..SENDS {
            let at = RC_SRC + (p * SENDS + k) * 1024;
            mr.write(at, &pattern(me, p, k, SEND_LEN)).unwrap();
            qp.post_send(SendWr::new(
                2,
                SendOp::Send,
                vec![mr.sge(at, SEND_LEN as u32)],
            ))
            .unwrap();
        }
        qp.post_send(SendWr::new(
            3,
            SendOp::Read {
                remote_addr: remote.va + OWN_AT as u64,
                rkey: remote.rkey,
            },
            vec![mr.sge(READ_SINK + p * 4096, 4096)],
        ))
        .unwrap();
        qp.post_send(SendWr::new(
            4,
            SendOp::FetchAdd {
                remote_addr: remote.va + COUNTER as u64,
                rkey: remote.rkey,
                add: 1,
            },
            vec![mr.sge(READ_SINK + p * 4096 + 4096 - 8, 8)],
        ))
        .unwrap();
    }
    for &p in &peers {
        for k in 0..DATAGRAMS {
            let at = UD_SRC + (p * DATAGRAMS + k) * 1024;
            let mut msg = pattern(me, p, 100 + k, UD_LEN);
            msg[0] = k as u8;
            mr.write(at, &msg).unwrap();
            ud.post_send(
                SendWr::new(5, SendOp::Send, vec![mr.sge(at, UD_LEN as u32)])
                    .to(ah.dest(remote_ud[&p], QKEY)),
            )
            .unwrap();
        }
    }

    // Our operations: all complete successfully.
    let want = peers.len() * (SENDS + 3 + DATAGRAMS);
    let wcs = scq.wait_for(want, T).unwrap();
    assert_eq!(wcs.len(), want, "send completions");
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    for &p in &peers {
        assert_eq!(
            mr.read_vec(READ_SINK + p * 4096, 4096 - 8).unwrap(),
            pattern(p, 9, 0, 4096)[..4096 - 8],
            "READ from {p}"
        );
    }
    // What the peers sent: every SEND in order, every datagram once.
    let want = peers.len() * (SENDS + DATAGRAMS);
    let wcs = rcq.wait_for(want, T).unwrap();
    assert_eq!(wcs.len(), want, "receive completions");
    let ud_from: BTreeMap<u32, usize> = remote_ud.iter().map(|(&p, &q)| (q, p)).collect();
    let mut datagrams = BTreeSet::new();
    for wc in &wcs {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        if wc.wr_id >= 1_000_000 {
            let slot = (wc.wr_id - 1_000_000) as usize;
            let p = ud_from[&wc.src_qp];
            assert!(wc.grh);
            assert_eq!(wc.byte_len as usize, 40 + UD_LEN);
            let body = mr.read_vec(UD_RECV + slot * 1024 + 40, UD_LEN).unwrap();
            let k = usize::from(body[0]);
            let mut msg = pattern(p, me, 100 + k, UD_LEN);
            msg[0] = k as u8;
            assert_eq!(body, msg, "datagram {k} from {p}");
            assert!(datagrams.insert((p, k)), "datagram {k} from {p} twice");
        } else {
            let (p, k) = (wc.wr_id as usize / SENDS, wc.wr_id as usize % SENDS);
            assert_eq!(wc.byte_len as usize, SEND_LEN);
            assert_eq!(
                mr.read_vec(RC_RECV + (p * SENDS + k) * 1024, SEND_LEN)
                    .unwrap(),
                pattern(p, me, k, SEND_LEN),
                "SEND {k} from {p}"
            );
        }
    }
    assert_eq!(datagrams.len(), peers.len() * DATAGRAMS);
    say(format!("DONE {me}"));

    // Once everyone is done, the peers' one-sided operations have landed.
    next_phase(&mut stdin);
    for &p in &peers {
        assert_eq!(
            mr.read_vec(WRITE_AT + p * 4096, 4096).unwrap(),
            pattern(p, me, 99, 4096),
            "WRITE from {p}"
        );
    }
    assert_eq!(mr.load_u64(COUNTER).unwrap(), peers.len() as u64);
    say(format!("OK {me}"));
    next_phase(&mut stdin);
}

/// Kills the processes whatever happens.
struct Mesh(Vec<Child>);

impl Drop for Mesh {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The `/proc` directory of the hostd serving `addr`, if one runs.
fn hostd_proc(addr: &str) -> Option<std::path::PathBuf> {
    std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
        let c = std::fs::read(e.path().join("cmdline")).ok()?;
        let c = String::from_utf8_lossy(&c).replace('\0', " ");
        (c.contains(" hostd ") && c.contains(addr)).then(|| e.path())
    })
}

fn hostd_running(addr: &str) -> bool {
    hostd_proc(addr).is_some()
}

/// The process group of `/proc/{pid}` (the field after state and ppid).
fn pgrp(proc_dir: &std::path::Path) -> Option<i32> {
    let stat = std::fs::read_to_string(proc_dir.join("stat")).ok()?;
    stat.rsplit_once(") ")?.1.split(' ').nth(2)?.parse().ok()
}

#[test]
fn four_processes_share_one_address_for_rc_and_ud() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut mesh = Mesh(vec![]);
    let mut inputs: Vec<ChildStdin> = vec![];
    for rank in 0..RANKS {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "mesh_process",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, rank.to_string())
            .env("SOFTRDMA_HOSTD", env!("CARGO_BIN_EXE_softrdma"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        inputs.push(child.stdin.take().unwrap());
        let out = child.stdout.take().unwrap();
        mesh.0.push(child);
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                // libtest may print "test mesh_process ... " before a line.
                for tag in ["HELLO ", "CONN ", "UD ", "READY ", "DONE ", "OK "] {
                    if let Some(at) = line.find(tag) {
                        let _ = tx.send((rank, line[at..].to_string()));
                        break;
                    }
                }
            }
        });
    }
    let expect = |tag: &str, n: usize| -> Vec<(usize, String)> {
        (0..n)
            .map(|_| {
                let (r, l) = rx
                    .recv_timeout(Duration::from_secs(60))
                    .unwrap_or_else(|_| panic!("waiting for {tag}"));
                assert!(l.starts_with(tag), "rank {r}: expected {tag}, got {l}");
                (r, l)
            })
            .collect()
    };
    let mut send = |rank: usize, text: &str| {
        // A process that died makes the test fail on its missing line.
        let _ = writeln!(inputs[rank], "{text}");
    };
    // Each process got its own hostd slot: the top byte of its QPNs.
    let mut slots = BTreeSet::new();
    let mut conn = vec![];
    let mut ud = vec![];
    for _ in 0..RANKS * (1 + RANKS) {
        let (r, l) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("set-up lines");
        match l.split(' ').next().unwrap() {
            "HELLO" => {
                let qpn = u32::from_str_radix(l.rsplit("0x").next().unwrap(), 16).unwrap();
                assert_ne!(qpn >> 16, 0, "rank {r} has a hostd slot");
                assert!(slots.insert(qpn >> 16), "slots differ");
            }
            "CONN" => conn.push(l),
            "UD" => ud.push(l),
            _ => panic!("rank {r}: {l}"),
        }
    }
    assert_eq!(slots.len(), RANKS);
    // The daemon one of them started is out of their process group: a
    // Ctrl-C to it must not take the others' port down.
    let ours = pgrp(std::path::Path::new("/proc/self")).unwrap();
    let hostd = hostd_proc(ADDR).expect("the hostd");
    assert_ne!(pgrp(&hostd).unwrap(), ours);
    for rank in 0..RANKS {
        for l in &conn {
            let to: usize = l.split(' ').nth(2).unwrap().parse().unwrap();
            if to == rank {
                send(rank, l);
            }
        }
        for l in &ud {
            if !l.starts_with(&format!("UD {rank} ")) {
                send(rank, l);
            }
        }
        send(rank, "END");
    }
    expect("READY", RANKS);
    for rank in 0..RANKS {
        send(rank, "END");
    }
    expect("DONE", RANKS);
    for rank in 0..RANKS {
        send(rank, "END");
    }
    expect("OK", RANKS);
    for rank in 0..RANKS {
        send(rank, "END");
    }
    for c in &mut mesh.0 {
        assert!(c.wait().unwrap().success());
    }
    // The daemon they started leaves once they are gone.
    let t = std::time::Instant::now();
    while hostd_running(ADDR) {
        assert!(t.elapsed() < Duration::from_secs(10), "hostd still running");
        std::thread::sleep(Duration::from_millis(100));
    }
}
