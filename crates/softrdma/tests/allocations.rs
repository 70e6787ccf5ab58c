//! Heap allocations on the per-operation paths: none per packet or message
//! once a connection is warm (RoCEv2 RC and UD, iWARP, shared memory; both
//! ends and every thread counted). A counting allocator wraps the system's; this binary
//! holds one test so that no other test's allocations are counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use softrdma::cm::mpa::MpaConfig;
use softrdma::cm::{self, RcOptions};
use softrdma::verbs::*;

mod common;
use common::roce_end;

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call goes to the system allocator unchanged; the counter is
// only a side effect.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded; `ptr` came from this allocator, which is System.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded; `ptr` came from System.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

const T: Duration = Duration::from_secs(10);

fn one(cq: &Cq) -> WorkCompletion {
    let wc = cq.wait(T).unwrap().expect("a completion in time");
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    wc
}

/// Allocations per operation over `rounds` of `op`, after as many to warm
/// up: the least of three such counts. A per-thread buffer that grows on its
/// thread's first use (which thread transmits depends on timing) shows in one
/// count at most; an allocation per operation shows in all three.
fn per_op(rounds: u64, mut op: impl FnMut()) -> f64 {
    for _ in 0..rounds {
        op();
    }
    (0..3)
        .map(|_| {
            let before = allocations();
            for _ in 0..rounds {
                op();
            }
            (allocations() - before) as f64 / rounds as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// Most allocations an operation may average: a rare growth of a buffer is
/// tolerated, one per operation is not.
const AT_MOST: f64 = 0.05;

fn check(what: &str, per: f64) {
    println!("{what}: {per} allocations per operation");
    assert!(per <= AT_MOST, "{what}: {per} allocations per operation");
}

fn write(a: &Qp, cq: &Cq, local: &Mr, remote_addr: u64, rkey: u32, len: u32) {
    a.post_send(SendWr::new(
        1,
        SendOp::Write { remote_addr, rkey },
        [local.sge(0, len)],
    ))
    .unwrap();
    one(cq);
}

fn read(a: &Qp, cq: &Cq, local: &Mr, remote_addr: u64, rkey: u32, len: u32) {
    a.post_send(SendWr::new(
        4,
        SendOp::Read { remote_addr, rkey },
        [local.sge(0, len)],
    ))
    .unwrap();
    one(cq);
}

/// A SEND of `len` bytes from `a` into a receive posted on `b`.
fn send(a: &Qp, a_cq: &Cq, a_mr: &Mr, b: &Qp, b_cq: &Cq, b_mr: &Mr, len: u32) {
    b.post_recv(RecvWr::new(2, [b_mr.sge(0, len)])).unwrap();
    a.post_send(SendWr::new(3, SendOp::Send, [a_mr.sge(0, len)]))
        .unwrap();
    one(b_cq);
    one(a_cq);
}

#[test]
fn no_allocation_per_packet_or_message_once_warm() {
    // The counter counts: one allocation an operation shows as one.
    let boxed = per_op(100, || drop(std::hint::black_box(Box::new(0u64))));
    assert!(boxed >= 1.0, "the counting allocator saw {boxed} per Box");
    // RoCEv2 RC: 1 packet, 16 (two GSO sends: a datagram holds 15) and 256
    // per WRITE.
    let a = roce_end(Device::udp("127.0.0.61:0".parse().unwrap()));
    let b = roce_end(Device::udp("127.0.0.62:0".parse().unwrap()));
    cm::connect(&a.qp, &a.info, &b.info, &RcOptions::default()).unwrap();
    cm::connect(&b.qp, &b.info, &a.info, &RcOptions::default()).unwrap();
    let (va, rkey) = (b.info.va, b.info.rkey);
    for len in [8, 65_536, 1 << 20] {
        let rounds = if len == 1 << 20 { 20 } else { 200 };
        check(
            &format!("RoCEv2 WRITE {len} B"),
            per_op(rounds, || write(&a.qp, &a.cq, &a.mr, va, rkey, len)),
        );
    }
    check(
        "RoCEv2 READ 64 KiB",
        per_op(200, || read(&a.qp, &a.cq, &a.mr, va, rkey, 65_536)),
    );
    check(
        "RoCEv2 SEND 64 KiB",
        per_op(200, || {
            send(&a.qp, &a.cq, &a.mr, &b.qp, &b.cq, &b.mr, 65_536)
        }),
    );
    check(
        "RoCEv2 FETCH_ADD",
        per_op(200, || {
            a.qp.post_send(SendWr::new(
                5,
                SendOp::FetchAdd {
                    remote_addr: va,
                    rkey,
                    add: 1,
                },
                [a.mr.sge(0, 8)],
            ))
            .unwrap();
            one(&a.cq);
        }),
    );
    drop((a, b));

    // RoCEv2 UD: one datagram each way.
    let ctx = Device::udp("127.0.0.63:0".parse().unwrap()).open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(1 << 16, Access::LOCAL_WRITE).unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let qps = [0, 1].map(|_| {
        let qp = pd.create_qp(&QpInit::ud(&cq, &cq)).unwrap();
        cm::ready_ud(&qp, 0x1111, 0).unwrap();
        qp
    });
    let ah = pd
        .create_ah(AhAttr {
            addr: ctx.local_addr(),
        })
        .unwrap();
    check(
        "RoCEv2 UD SEND 1 KiB",
        per_op(200, || {
            qps[1]
                .post_recv(RecvWr::new(6, [mr.sge(8192, 40 + 1024)]))
                .unwrap();
            qps[0]
                .post_send(
                    SendWr::new(7, SendOp::Send, [mr.sge(0, 1024)])
                        .to(ah.dest(qps[1].qpn(), 0x1111)),
                )
                .unwrap();
            one(&cq);
            one(&cq);
        }),
    );
    drop((qps, ah, mr, cq, pd, ctx));

    // iWARP: a WRITE's completion is local, so each round ends with a READ
    // (which waits for everything before it on the stream).
    let (a, b) = common::iwarp_pair(MpaConfig::default(), |_| {});
    let (va, rkey) = (b.mr.addr(), b.mr.rkey());
    check(
        "iWARP WRITE 64 KiB",
        per_op(200, || {
            write(&a.qp, &a.scq, &a.mr, va, rkey, 65_536);
            read(&a.qp, &a.scq, &a.mr, va, rkey, 8);
        }),
    );
    check(
        "iWARP READ 64 KiB",
        per_op(200, || read(&a.qp, &a.scq, &a.mr, va, rkey, 65_536)),
    );
    check(
        "iWARP SEND 64 KiB",
        per_op(200, || {
            send(&a.qp, &a.scq, &a.mr, &b.qp, &b.rcq, &b.mr, 65_536)
        }),
    );
    drop((a, b));

    // Shared memory.
    let name = format!("softrdma-alloc-test-{}", std::process::id());
    let shm_end = || common::End::new(Device::shm(), 1 << 20, 64, QpCaps::default());
    let b = shm_end();
    let listener = softrdma::cm::shm::Listener::bind(&b.ctx, &name).unwrap();
    let t = std::thread::spawn(move || {
        listener.accept(&b.qp).unwrap();
        b
    });
    let a = shm_end();
    softrdma::cm::shm::connect(&a.qp, &name).unwrap();
    let b = t.join().unwrap();
    let (va, rkey) = (b.mr.addr(), b.mr.rkey());
    check(
        "shm WRITE 64 KiB",
        per_op(200, || write(&a.qp, &a.scq, &a.mr, va, rkey, 65_536)),
    );
    check(
        "shm READ 64 KiB",
        per_op(200, || read(&a.qp, &a.scq, &a.mr, va, rkey, 65_536)),
    );
    check(
        "shm SEND 64 KiB",
        per_op(200, || {
            send(&a.qp, &a.scq, &a.mr, &b.qp, &b.rcq, &b.mr, 65_536)
        }),
    );
}
