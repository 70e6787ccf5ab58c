//! What sharing an address through hostd costs: the same RC traffic between
//! two devices that each own their address (exclusive), and between two
//! devices that share one address through `softrdma hostd` (a separate
//! process, run as an administrator would run it). Rounds alternate so
//! that drift hits both; the table gives medians and shared/exclusive ratios.
//!
//! `cargo bench -p softrdma-cli --bench port_sharing [-- ROUNDS]`

use std::time::{Duration, Instant};

use softrdma::cm::{self, ConnInfo, RcOptions};
use softrdma::verbs::*;

const T: Duration = Duration::from_secs(30);
const PINGS: usize = 2000;
const DEPTH: usize = 16;

struct Pair {
    qa: Qp,
    ca: Cq,
    ma: Mr,
    qb: Qp,
    cb: Cq,
    mb: Mr,
    // Dropped last: the contexts outlive their QPs.
    _ctx: (Context, Context),
}

fn pair(shared: bool) -> Pair {
    let open = |addr: &str| {
        Device::udp(addr.parse().unwrap())
            .shared_port(shared)
            .open()
            .unwrap()
    };
    let (a, b) = if shared {
        (open("127.0.0.54:4791"), open("127.0.0.54:4791"))
    } else {
        (open("127.0.0.52:4791"), open("127.0.0.53:4791"))
    };
    let mk = |ctx: &Context| {
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(8 << 20, Access::ALL).unwrap();
        let cq = ctx.create_cq(4 * DEPTH).unwrap();
        let qp = pd
            .create_qp(&QpInit::rc(&cq, &cq).caps(QpCaps {
                max_send_wr: 4 * DEPTH as u32,
                max_recv_wr: 4 * DEPTH as u32,
                ..QpCaps::default()
            }))
            .unwrap();
        (qp, cq, mr)
    };
    let (qa, ca, ma) = mk(&a);
    let (qb, cb, mb) = mk(&b);
    let ia = ConnInfo::local(&qa, Some(&ma)).unwrap();
    let ib = ConnInfo::local(&qb, Some(&mb)).unwrap();
    cm::connect(&qa, &ia, &ib, &RcOptions::default()).unwrap();
    cm::connect(&qb, &ib, &ia, &RcOptions::default()).unwrap();
    Pair {
        qa,
        ca,
        ma,
        qb,
        cb,
        mb,
        _ctx: (a, b),
    }
}

fn ok(wc: Option<WorkCompletion>) {
    let wc = wc.expect("a completion in time");
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
}

/// 8-byte SEND ping-pong, blocking CQ waits: half round trips in µs, sorted.
fn latency(p: &Pair) -> Vec<f64> {
    let recv = |qp: &Qp, mr: &Mr| qp.post_recv(RecvWr::new(0, [mr.sge(0, 8)])).unwrap();
    let send = |qp: &Qp, mr: &Mr| {
        qp.post_send(SendWr::new(1, SendOp::Send, vec![mr.sge(64, 8)]).unsignaled())
            .unwrap()
    };
    let mut half = Vec::with_capacity(PINGS);
    recv(&p.qb, &p.mb);
    recv(&p.qa, &p.ma);
    for i in 0..PINGS + 100 {
        let t = Instant::now();
        send(&p.qa, &p.ma);
        ok(p.cb.wait(T).unwrap());
        recv(&p.qb, &p.mb);
        send(&p.qb, &p.mb);
        ok(p.ca.wait(T).unwrap());
        recv(&p.qa, &p.ma);
        if i >= 100 {
            half.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    half.sort_by(f64::total_cmp);
    half
}

/// RDMA WRITE of `size` bytes from a to b, DEPTH outstanding: GB/s.
fn bandwidth(p: &Pair, size: usize) -> f64 {
    let total = (256 << 20).max(size * 64);
    let n = total / size;
    let slots = (8 << 20) / size;
    let post = |i: usize| {
        let off = (i % slots) * size;
        p.qa.post_send(SendWr::new(
            i as u64,
            SendOp::Write {
                remote_addr: p.mb.addr() + off as u64,
                rkey: p.mb.rkey(),
            },
            vec![p.ma.sge(off, size as u32)],
        ))
        .unwrap()
    };
    let t = Instant::now();
    let mut posted = 0;
    while posted < DEPTH.min(n) {
        post(posted);
        posted += 1;
    }
    for _ in 0..n {
        ok(p.ca.wait(T).unwrap());
        if posted < n {
            post(posted);
            posted += 1;
        }
    }
    (n * size) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map_or(5, |r| r.parse().expect("ROUNDS is a number"));
    // The daemon, run as an administrator would run it.
    let mut hostd = std::process::Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(["hostd", "127.0.0.54:4791"])
        .spawn()
        .expect("softrdma hostd");
    std::thread::sleep(Duration::from_millis(200));
    let names = [
        "8 B SEND half round trip p50 (µs)",
        "8 B SEND half round trip p99 (µs)",
        "WRITE 64 KiB (GB/s)",
        "WRITE 1 MiB (GB/s)",
    ];
    let mut figures = vec![[vec![], vec![]]; names.len()];
    for round in 0..rounds {
        for (k, shared) in [false, true].into_iter().enumerate() {
            let p = pair(shared);
            let lat = latency(&p);
            figures[0][k].push(lat[lat.len() / 2]);
            figures[1][k].push(lat[lat.len() * 99 / 100]);
            figures[2][k].push(bandwidth(&p, 64 << 10));
            figures[3][k].push(bandwidth(&p, 1 << 20));
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }
    println!(
        "{:<36} {:>10} {:>10} {:>8}",
        "figure (median of rounds)", "exclusive", "hostd", "ratio"
    );
    for (name, [excl, shared]) in names.iter().zip(figures.iter_mut()) {
        let (e, s) = (median(excl), median(shared));
        println!("{name:<36} {e:>10.2} {s:>10.2} {:>8.2}", s / e);
    }
    let _ = hostd.kill();
    let _ = hostd.wait();
}
