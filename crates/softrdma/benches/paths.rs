//! softrdma's per-operation paths without the network: the shared-memory
//! provider's post-and-poll (the verbs path every operation takes), and the
//! iWARP engine cutting a WRITE into FPDUs.
//! `cargo bench -p softrdma --bench paths`

use std::sync::Arc;

use divan::{Bencher, black_box};
use softrdma::cm::shm::{self, Listener};
use softrdma::engine::iwarp::{IwarpConfig, IwarpQp, MAX_HEADER_LEN};
use softrdma::memory::{Access, MrTable, Region, RegionMemory};
use softrdma::verbs::*;

fn main() {
    divan::main();
}

struct Pair {
    a: (Context, Pd, Mr, Cq, Qp),
    b: (Context, Pd, Mr, Cq, Qp),
}

fn end() -> (Context, Pd, Mr, Cq, Qp) {
    let ctx = Device::shm().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(1 << 20, Access::ALL).unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    (ctx, pd, mr, cq, qp)
}

fn shm_pair(name: &str) -> Pair {
    let b = end();
    let l = Listener::bind(&b.0, name).unwrap();
    let t = std::thread::spawn(move || {
        l.accept(&b.4).unwrap();
        b
    });
    let a = end();
    shm::connect(&a.4, name).unwrap();
    Pair {
        a,
        b: t.join().unwrap(),
    }
}

/// One RDMA WRITE posted and its completion polled, on shared memory: the
/// copy plus the verbs' per-operation cost.
#[divan::bench(args = [8, 4096, 65536])]
fn shm_write_post_and_poll(b: Bencher, len: u32) {
    let p = shm_pair(&format!("bench-{}-{len}", std::process::id()));
    let (remote_addr, rkey) = (p.b.2.addr(), p.b.2.rkey());
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| {
            p.a.4
                .post_send(SendWr::new(
                    1,
                    SendOp::Write { remote_addr, rkey },
                    [p.a.2.sge(0, len)],
                ))
                .unwrap();
            black_box(p.a.3.poll_one().unwrap().unwrap())
        });
}

/// The iWARP engine turning a posted WRITE into FPDUs (headers built, payload
/// pieces resolved; nothing copied).
#[divan::bench(args = [4096, 65536, 1 << 20])]
fn iwarp_write_segmentation(b: Bencher, len: usize) {
    let mem = Arc::new(RegionMemory::zeroed(2 << 20).unwrap());
    let mut mrs = MrTable::new();
    let iova = 0x10_0000_0000;
    mrs.insert(Region::new(1, (0x100, 0x200), mem, 0, 2 << 20, iova, Access::ALL).unwrap());
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let mut qp = IwarpQp::new(0x11, 1, caps, IwarpConfig::default());
    let mut buf = vec![0u8; MAX_HEADER_LEN + 64];
    let mut pieces = Vec::new();
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| {
            qp.post_send(SendWr::new(
                1,
                SendOp::Write {
                    remote_addr: 0x7000,
                    rkey: 0x999,
                },
                vec![Sge {
                    addr: iova,
                    len: len as u32,
                    lkey: 0x100,
                }],
            ))
            .unwrap();
            let mut fpdus = 0;
            while qp.poll_transmit(&mrs, &mut buf, &mut pieces).is_some() {
                fpdus += 1;
            }
            while qp.poll_completion().is_some() {}
            black_box(fpdus)
        });
}

/// `len` bytes `skew` bytes past a page boundary of `buf` (`len + 8192` long).
fn at_page(buf: &mut [u8], skew: usize, len: usize) -> &mut [u8] {
    let at = buf.as_ptr().align_offset(4096) + skew;
    &mut buf[at..at + len]
}

/// The payload copy: softrdma's routine against glibc's memcpy
/// (`copy_from_slice`); the source page-aligned, the destination SKEW bytes
/// past a page boundary (glibc 2.36's `rep movsb` crawls at 8 and 16 on AMD
/// Zen: docs/performance.md).
#[divan::bench(consts = [0, 16], args = [4096, 65536, 1 << 20])]
fn copy_softrdma<const SKEW: usize>(b: Bencher, len: usize) {
    let (mut s, mut d) = (vec![1u8; len + 8192], vec![0u8; len + 8192]);
    let (src, dst) = (at_page(&mut s, 0, len), at_page(&mut d, SKEW, len));
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| softrdma::memory::copy_bytes(black_box(&mut *dst), black_box(&*src)));
}

#[divan::bench(consts = [0, 16], args = [4096, 65536, 1 << 20])]
fn copy_libc_memcpy<const SKEW: usize>(b: Bencher, len: usize) {
    let (mut s, mut d) = (vec![1u8; len + 8192], vec![0u8; len + 8192]);
    let (src, dst) = (at_page(&mut s, 0, len), at_page(&mut d, SKEW, len));
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| black_box(&mut *dst).copy_from_slice(black_box(&*src)));
}
