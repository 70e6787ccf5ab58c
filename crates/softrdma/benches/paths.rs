//! softrdma's per-operation paths without the network: the shared-memory
//! provider's post-and-poll (the verbs path every operation takes), and the
//! iWARP engine cutting a WRITE into FPDUs.
//! `cargo bench -p softrdma --bench paths`

use std::sync::Arc;

use divan::{Bencher, black_box};
use softrdma::cm::shm::{self, Listener};
use softrdma::engine::iwarp::{IwarpConfig, IwarpQp, MAX_HEADER_LEN};
use softrdma::engine::rc::{MAX_HEADER_LEN as RC_MAX_HEADER_LEN, Mtu, RcQp};
use softrdma::engine::{QpAttr, QpState, Time};
use softrdma::memory::{Access, MrTable, Region, RegionMemory, Segment};
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
    let caps = bench_caps();
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
            qp.transmitted();
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

/// A RoCEv2 receiver's placement: a GRO datagram of fifteen 4 KiB WRITE
/// ONLY packets (28 bytes of headers and 4 of ICRC each), each payload
/// copied into its page of a 64 KiB region, by softrdma's copy (`SOFTRDMA`)
/// or glibc's memcpy.
#[divan::bench(consts = [true, false])]
fn copy_a_datagram_of_packets_into_a_region<const SOFTRDMA: bool>(b: Bencher) {
    const PACKET: usize = 28 + 4096 + 4;
    let datagram = vec![1u8; 15 * PACKET];
    let mut region = vec![0u8; 65536 + 4096];
    let target = at_page(&mut region, 0, 65536);
    let mut next = 0;
    b.counter(divan::counter::BytesCount::new(15 * 4096usize))
        .bench_local(|| {
            for k in 0..15 {
                let payload = &datagram[k * PACKET + 28..k * PACKET + 28 + 4096];
                let page = &mut target[(next % 16) * 4096..][..4096];
                next += 1;
                if SOFTRDMA {
                    softrdma::memory::copy_bytes(black_box(page), black_box(payload));
                } else {
                    black_box(page).copy_from_slice(black_box(payload));
                }
            }
        });
}

/// A QP of 64 WRs each way, one SGE, no inline data.
fn bench_caps() -> QpCaps {
    QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    }
}

/// Two RC engines (sans I/O) connected back to back, path MTU 4096.
struct EnginePair {
    qp: [RcQp; 2],
    mrs: [MrTable; 2],
}

const ENGINE_IOVA: u64 = 0x10_0000_0000;

fn engine_pair() -> EnginePair {
    let caps = bench_caps();
    let mut qp = [RcQp::new(0x11, 1, caps), RcQp::new(0x12, 1, caps)];
    let mrs = [0u32, 1].map(|i| {
        let mem = Arc::new(RegionMemory::zeroed(1 << 20).unwrap());
        let mut t = MrTable::new();
        t.insert(
            Region::new(
                1,
                (0x100 + i, 0x200 + i),
                mem,
                0,
                1 << 20,
                ENGINE_IOVA,
                Access::ALL,
            )
            .unwrap(),
        );
        t
    });
    for (i, q) in qp.iter_mut().enumerate() {
        for attr in [
            QpAttr {
                state: Some(QpState::Init),
                pkey_index: Some(0),
                port: Some(1),
                access: Some(Access::REMOTE_WRITE | Access::REMOTE_READ),
                ..QpAttr::default()
            },
            QpAttr {
                state: Some(QpState::Rtr),
                path_mtu: Some(Mtu::Mtu4096),
                dest_qp: Some(0x12 - i as u32),
                rq_psn: Some(100),
                max_dest_rd_atomic: Some(16),
                min_rnr_timer: Some(1),
                has_av: true,
                ..QpAttr::default()
            },
            QpAttr {
                state: Some(QpState::Rts),
                sq_psn: Some(100),
                max_rd_atomic: Some(16),
                retry_cnt: Some(7),
                rnr_retry: Some(7),
                timeout: Some(14),
                ..QpAttr::default()
            },
        ] {
            q.modify(&attr).unwrap();
        }
    }
    EnginePair { qp, mrs }
}

/// Moves every packet engine `from` has ready into engine `to`: headers and
/// payload gathered into one datagram buffer (the provider's job, and its
/// copy), ICRC left zero (the provider checks it).
fn carry(
    p: &mut EnginePair,
    from: usize,
    buf: &mut [u8],
    pieces: &mut Vec<Segment>,
    dgram: &mut Vec<u8>,
) {
    let now = Time(1_000_000);
    while let Some(t) = p.qp[from].poll_transmit(now, &p.mrs[from], buf, pieces) {
        dgram.clear();
        dgram.extend_from_slice(&buf[..t.len]);
        for s in pieces.iter() {
            let at = dgram.len();
            dgram.resize(at + s.len(), 0);
            s.read(0, &mut dgram[at..]);
        }
        dgram.resize(dgram.len() + usize::from(t.pad) + 4, 0);
        let (a, b) = p.qp.split_at_mut(1);
        let to = if from == 0 { &mut b[0] } else { &mut a[0] };
        to.handle_packet(now, dgram, &p.mrs[1 - from]);
    }
}

/// A WRITE of `len` bytes from the start of engine 0's region to the start
/// of engine 1's.
fn engine_write(len: u32) -> SendWr {
    SendWr::new(
        1,
        SendOp::Write {
            remote_addr: ENGINE_IOVA,
            rkey: 0x201,
        },
        [Sge {
            addr: ENGINE_IOVA,
            len,
            lkey: 0x100,
        }],
    )
}

/// The RC engine's per-message work: the requester cuts a posted WRITE into
/// packets, the responder places them and queues an ACK, the requester takes
/// the ACK and completes the WR (datagram assembly included, no ICRC, no
/// sockets).
#[divan::bench(args = [8, 4096, 65536])]
fn rc_engine_write_and_ack(b: Bencher, len: u32) {
    let mut p = engine_pair();
    let mut buf = vec![0u8; RC_MAX_HEADER_LEN + 4096];
    let (mut pieces, mut dgram) = (Vec::new(), Vec::with_capacity(8192));
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| {
            p.qp[0].post_send(engine_write(len)).unwrap();
            carry(&mut p, 0, &mut buf, &mut pieces, &mut dgram);
            carry(&mut p, 1, &mut buf, &mut pieces, &mut dgram);
            let done = p.qp[0].poll_completion().expect("the WRITE completed");
            black_box(done)
        });
}

/// The RC requester alone in a WRITE stream: it cuts a posted WRITE into
/// packets (headers built, payload pieces resolved, nothing copied) and takes
/// the one ACK that completes it. The sender's per-packet engine work.
#[divan::bench(args = [8, 65536])]
fn rc_requester_write(b: Bencher, len: u32) {
    use softrdma_wire::{Opcode, Psn, aeth, packet::Repr};
    let mut p = engine_pair();
    let mut buf = vec![0u8; RC_MAX_HEADER_LEN + 4096];
    let mut pieces = Vec::new();
    let mut ack = [0u8; 64];
    let mut msn = 0u32;
    let now = Time(1_000_000);
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| {
            p.qp[0].post_send(engine_write(len)).unwrap();
            let mut last = 0;
            while let Some(t) = p.qp[0].poll_transmit(now, &p.mrs[0], &mut buf, &mut pieces) {
                last = u32::from_be_bytes([0, buf[9], buf[10], buf[11]]);
                // Each packet of a WRITE without an immediate is a WRITE
                // ONLY, a message of its own to the responder.
                msn = (msn + 1) & 0x00ff_ffff;
                black_box((t, &pieces));
            }
            let mut r = Repr::new(Opcode::RC_ACKNOWLEDGE, 0x11, Psn::new(last), 0);
            r.aeth = Some(aeth::Repr {
                syndrome: aeth::Syndrome::ACK,
                msn,
            });
            let n = r.emit_header(&mut ack).unwrap();
            p.qp[0].handle_packet(now, &ack[..n + 4], &p.mrs[0]);
            p.qp[0].poll_completion().expect("the WRITE completed")
        });
}

/// One look of a thread spinning on an empty CQ of a RoCEv2 device in
/// busy-poll mode: an empty `recvmsg` on the device's socket and what the
/// CQ and the provider add around it (the period at which a busy-poll
/// ping-pong notices its answer).
#[divan::bench]
fn roce_busy_poll_empty_look(b: Bencher) {
    let ctx = Device::udp("127.0.0.95:0".parse().unwrap())
        .busy_poll(true)
        .open()
        .unwrap();
    let cq = ctx.create_cq(64).unwrap();
    b.bench_local(|| black_box(cq.poll_one().unwrap()));
}
