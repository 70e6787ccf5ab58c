//! `softrdma demo`: two endpoints over RoCEv2 on loopback, every RC operation
//! at sizes from 1 byte to 1 MiB, each result verified.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use softrdma::cm::{self, ConnInfo, RcOptions};
use softrdma::verbs::*;

const T: Duration = Duration::from_secs(30);
const MIB: usize = 1 << 20;
const SIZES: [usize; 7] = [1, 7, 64, 1000, 4096, 65_539, MIB];

struct End {
    ctx: Context,
    mr: Mr,
    cq: Cq,
    qp: Qp,
    info: ConnInfo,
    _pd: Pd,
}

fn end(device: &Device) -> Result<End, VerbsError> {
    let ctx = device.open()?;
    let pd = ctx.alloc_pd()?;
    // Two MiB: the first half is what the other side writes or reads, the
    // second the local sources and sinks.
    let mr = pd.register(2 * MIB + 4096, Access::ALL)?;
    let cq = ctx.create_cq(1024)?;
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq))?;
    let info = ConnInfo::local(&qp, Some(&mr))?;
    Ok(End {
        ctx,
        mr,
        cq,
        qp,
        info,
        _pd: pd,
    })
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131) as u8).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

fn wait(cq: &Cq, what: &str) -> Result<WorkCompletion, String> {
    match cq.wait(T) {
        Ok(Some(wc)) if wc.status == WcStatus::Success => Ok(wc),
        Ok(Some(wc)) => Err(format!("{what}: {}", wc.status)),
        Ok(None) => Err(format!("{what}: no completion within {T:?}")),
        Err(e) => Err(format!("{what}: {e}")),
    }
}

/// One operation at one size; `Ok` when the result was verified.
fn run_op(a: &End, b: &End, op: &str, size: usize, seed: u8) -> Result<(), String> {
    let src = MIB; // A's source / sink area
    let data = pattern(size, seed);
    let e = |e: VerbsError| e.to_string();
    match op {
        "SEND" | "SEND_WITH_IMM" => {
            a.mr.write(src, &data).map_err(e)?;
            b.mr.write(0, &vec![0; size]).map_err(e)?;
            b.qp.post_recv(RecvWr::new(1, [b.mr.sge(0, size as u32)]))
                .map_err(e)?;
            let imm = u32::from_be_bytes([seed, 1, 2, 3]);
            let o = if op == "SEND" {
                SendOp::Send
            } else {
                SendOp::SendWithImm(imm)
            };
            a.qp.post_send(SendWr::new(2, o, [a.mr.sge(src, size as u32)]))
                .map_err(e)?;
            wait(&a.cq, "send")?;
            let r = wait(&b.cq, "receive")?;
            let want_imm = (op != "SEND").then_some(imm);
            if r.byte_len as usize != size || r.imm != want_imm || r.opcode != WcOpcode::Recv {
                return Err(format!("receive completion {r:?}"));
            }
            check(&b.mr.read_vec(0, size).map_err(e)?, &data)
        }
        "RDMA_WRITE" | "RDMA_WRITE_WITH_IMM" => {
            a.mr.write(src, &data).map_err(e)?;
            b.mr.write(0, &vec![0; size]).map_err(e)?;
            let imm = u32::from_be_bytes([3, 2, 1, seed]);
            let (remote_addr, rkey) = (b.info.va, b.info.rkey);
            let o = if op == "RDMA_WRITE" {
                SendOp::Write { remote_addr, rkey }
            } else {
                b.qp.post_recv(RecvWr::new(3, [])).map_err(e)?;
                SendOp::WriteWithImm {
                    remote_addr,
                    rkey,
                    imm,
                }
            };
            a.qp.post_send(SendWr::new(4, o, [a.mr.sge(src, size as u32)]))
                .map_err(e)?;
            wait(&a.cq, "write")?;
            if op != "RDMA_WRITE" {
                let r = wait(&b.cq, "write with immediate")?;
                if r.imm != Some(imm)
                    || r.byte_len as usize != size
                    || r.opcode != WcOpcode::RecvRdmaWithImm
                {
                    return Err(format!("receive completion {r:?}"));
                }
            }
            check(&b.mr.read_vec(0, size).map_err(e)?, &data)
        }
        "RDMA_READ" => {
            b.mr.write(0, &data).map_err(e)?;
            a.mr.write(src, &vec![0; size]).map_err(e)?;
            let o = SendOp::Read {
                remote_addr: b.info.va,
                rkey: b.info.rkey,
            };
            a.qp.post_send(SendWr::new(5, o, [a.mr.sge(src, size as u32)]))
                .map_err(e)?;
            let c = wait(&a.cq, "read")?;
            if c.byte_len as usize != size {
                return Err(format!("read completion {c:?}"));
            }
            check(&a.mr.read_vec(src, size).map_err(e)?, &data)
        }
        "ATOMIC_CMP_AND_SWP" => {
            let old = u64::from(seed) << 32 | 0xabcd;
            b.mr.write(0, &old.to_ne_bytes()).map_err(e)?;
            let o = SendOp::CompareSwap {
                remote_addr: b.info.va,
                rkey: b.info.rkey,
                compare: old,
                swap: !old,
            };
            a.qp.post_send(SendWr::new(6, o, [a.mr.sge(src, 8)]))
                .map_err(e)?;
            wait(&a.cq, "compare and swap")?;
            let got = a.mr.load_u64(src).map_err(e)?;
            let now = b.mr.load_u64(0).map_err(e)?;
            if got != old || now != !old {
                return Err(format!(
                    "returned {got:#x} (want {old:#x}), memory {now:#x} (want {:#x})",
                    !old
                ));
            }
            Ok(())
        }
        "ATOMIC_FETCH_AND_ADD" => {
            b.mr.write(0, &1000u64.to_ne_bytes()).map_err(e)?;
            let o = SendOp::FetchAdd {
                remote_addr: b.info.va,
                rkey: b.info.rkey,
                add: u64::from(seed),
            };
            a.qp.post_send(SendWr::new(7, o, [a.mr.sge(src, 8)]))
                .map_err(e)?;
            wait(&a.cq, "fetch and add")?;
            let got = a.mr.load_u64(src).map_err(e)?;
            let now = b.mr.load_u64(0).map_err(e)?;
            if got != 1000 || now != 1000 + u64::from(seed) {
                return Err(format!("returned {got}, memory {now}"));
            }
            Ok(())
        }
        _ => unreachable!("known operations only"),
    }
}

fn check(got: &[u8], want: &[u8]) -> Result<(), String> {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "byte {i} differs: {:#04x}, want {:#04x}",
            got[i], want[i]
        )),
    }
}

/// Over softrdma's RoCEv2 on `ip`, or with `ibverbs` through that
/// libibverbs device (both QPs on it, the device looping back).
pub fn run(ip: &str, busy_poll: bool, ibverbs: Option<&str>) -> ExitCode {
    let device = match ibverbs {
        Some(name) => Device::ibverbs(name),
        None => Device::udp(format!("{ip}:0").parse().expect("an IPv4 address")),
    };
    let (a, b) = match (end(&device), end(&device)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("softrdma demo: {e}");
            return ExitCode::FAILURE;
        }
    };
    a.ctx.set_busy_poll(busy_poll);
    b.ctx.set_busy_poll(busy_poll);
    let opts = RcOptions::default();
    if let Err(e) = cm::connect(&a.qp, &a.info, &b.info, &opts)
        .and_then(|()| cm::connect(&b.qp, &b.info, &a.info, &opts))
    {
        eprintln!("softrdma demo: cannot connect the queue pairs: {e}");
        return ExitCode::FAILURE;
    }
    outln!(
        "RC over {}: {} QP {:#08x} <-> {} QP {:#08x}, path MTU {}",
        ibverbs.map_or("RoCEv2".to_string(), |d| format!("{d} (libibverbs)")),
        a.info.addr,
        a.info.qpn,
        b.info.addr,
        b.info.qpn,
        a.info.mtu.min(b.info.mtu).bytes()
    );
    outln!(
        "{:<22} {:>9}  {:<9} {:>11}",
        "operation",
        "bytes",
        "verified",
        "time"
    );
    let ops = [
        "SEND",
        "SEND_WITH_IMM",
        "RDMA_WRITE",
        "RDMA_WRITE_WITH_IMM",
        "RDMA_READ",
        "ATOMIC_CMP_AND_SWP",
        "ATOMIC_FETCH_AND_ADD",
    ];
    let mut failed = 0;
    let mut seed = 1u8;
    for op in ops {
        let sizes: &[usize] = if op.starts_with("ATOMIC") {
            &[8]
        } else {
            &SIZES
        };
        for &size in sizes {
            seed = seed.wrapping_add(1);
            let t0 = Instant::now();
            let r = run_op(&a, &b, op, size, seed);
            let us = t0.elapsed().as_secs_f64() * 1e6;
            match r {
                Ok(()) => outln!("{op:<22} {size:>9}  {:<9} {us:>8.0} us", "yes"),
                Err(e) => {
                    failed += 1;
                    outln!("{op:<22} {size:>9}  {:<9} {us:>8.0} us  {e}", "NO");
                }
            }
        }
    }
    let total = 5 * SIZES.len() + 2;
    if failed == 0 {
        outln!("all {total} operations verified");
        ExitCode::SUCCESS
    } else {
        outln!("{failed} of {total} operations FAILED");
        ExitCode::FAILURE
    }
}
