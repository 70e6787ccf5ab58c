//! The libibverbs provider on a real device. The ignored tests need one:
//! `SOFTRDMA_IBVERBS_DEV=rxe0 cargo test --test ibverbs -- --ignored`.
//! `tests/interop/run.py` runs them in a guest on the kernel's rxe (its
//! `ibverbs` variant); this host has no RDMA subsystem.

mod common;

use std::time::{Duration, Instant};

use common::{T, connect_rc, one, wait_event};
use softrdma::cm::RcOptions;
use softrdma::verbs::*;

fn device() -> Device {
    let name = std::env::var("SOFTRDMA_IBVERBS_DEV")
        .expect("set SOFTRDMA_IBVERBS_DEV to a libibverbs device (rxe0) to run these");
    Device::ibverbs(&name)
}

/// Two RC QPs of one context, connected to each other through the device.
struct Pair {
    ctx: Context,
    pd: Pd,
    a: Mr,
    b: Mr,
    cq_a: Cq,
    cq_b: Cq,
    qa: Qp,
    qb: Qp,
}

fn pair() -> Pair {
    let ctx = device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let a = pd.register(64 * 1024, Access::ALL).unwrap();
    let b = pd.register(64 * 1024, Access::ALL).unwrap();
    let cq_a = ctx.create_cq(64).unwrap();
    let cq_b = ctx.create_cq(64).unwrap();
    let qa = pd.create_qp(&QpInit::rc(&cq_a, &cq_a)).unwrap();
    let qb = pd.create_qp(&QpInit::rc(&cq_b, &cq_b)).unwrap();
    connect_rc(&qa, &qb, None, &RcOptions::default());
    Pair {
        ctx,
        pd,
        a,
        b,
        cq_a,
        cq_b,
        qa,
        qb,
    }
}

fn ok(cq: &Cq, wr_id: u64, opcode: WcOpcode) -> WorkCompletion {
    let wc = one(cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (wr_id, WcStatus::Success, opcode),
        "{wc:?}"
    );
    wc
}

/// Two UD QPs of one context in RTS with Q_Key `qkey`, one CQ for all.
struct UdPair {
    ctx: Context,
    pd: Pd,
    mr: Mr,
    cq: Cq,
    qa: Qp,
    qb: Qp,
}

fn ud_pair(qkey: u32) -> UdPair {
    let ctx = device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(8192, Access::LOCAL_WRITE).unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let (qa, qb) = (
        pd.create_qp(&QpInit::ud(&cq, &cq)).unwrap(),
        pd.create_qp(&QpInit::ud(&cq, &cq)).unwrap(),
    );
    for q in [&qa, &qb] {
        softrdma::cm::ready_ud(q, qkey, 0).unwrap();
    }
    UdPair {
        ctx,
        pd,
        mr,
        cq,
        qa,
        qb,
    }
}

#[test]
fn an_unknown_device_is_a_clear_error() {
    let e = Device::ibverbs("no-such-dev0")
        .open()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no RDMA device no-such-dev0") || e.contains("cannot load libibverbs"),
        "{e}"
    );
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn the_device_reports_its_port_and_ipv4_gid() {
    let ctx = device().open().unwrap();
    assert!(ctx.is_ibverbs());
    let port = ctx.query_port();
    assert_eq!(port.state, PortState::Active);
    let gid = *port.gids.last().unwrap();
    let ip = ctx.local_addr().ip().octets();
    assert_eq!(gid[10..], [0xff, 0xff, ip[0], ip[1], ip[2], ip[3]]);
    let attr = ctx.query_device();
    assert!(
        attr.max_qp > 0 && attr.max_qp_wr > 0 && attr.max_cqe > 0,
        "{attr:?}"
    );
    assert_eq!(ctx.poll_async_event(), Some(AsyncEvent::PortActive));
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn writes_reads_sends_and_atomics_go_through_the_device() {
    let p = pair();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    p.a.write(0, &data).unwrap();
    // WRITE a → b.
    let write = SendOp::Write {
        remote_addr: p.b.addr() + 8192,
        rkey: p.b.rkey(),
    };
    p.qa.post_send(SendWr::new(1, write, [p.a.sge(0, 4096)]))
        .unwrap();
    ok(&p.cq_a, 1, WcOpcode::RdmaWrite);
    assert_eq!(p.b.read_vec(8192, 4096).unwrap(), data);
    // READ it back into a.
    let read = SendOp::Read {
        remote_addr: p.b.addr() + 8192,
        rkey: p.b.rkey(),
    };
    p.qa.post_send(SendWr::new(2, read, [p.a.sge(16384, 4096)]))
        .unwrap();
    let wc = ok(&p.cq_a, 2, WcOpcode::RdmaRead);
    assert_eq!(wc.byte_len, 4096);
    assert_eq!(p.a.read_vec(16384, 4096).unwrap(), data);
    // SEND with immediate data, across two SGEs into one receive.
    p.qb.post_recv(RecvWr::new(3, [p.b.sge(0, 1024)])).unwrap();
    p.qa.post_send(SendWr::new(
        4,
        SendOp::SendWithImm(0x1234_5678),
        [p.a.sge(0, 100), p.a.sge(200, 50)],
    ))
    .unwrap();
    ok(&p.cq_a, 4, WcOpcode::Send);
    let wc = ok(&p.cq_b, 3, WcOpcode::Recv);
    assert_eq!(
        (wc.byte_len, wc.imm, wc.qp_num),
        (150, Some(0x1234_5678), p.qb.qpn())
    );
    assert_eq!(p.b.read_vec(0, 100).unwrap(), data[..100]);
    assert_eq!(p.b.read_vec(100, 50).unwrap(), data[200..250]);
    // Inline SEND.
    p.qb.post_recv(RecvWr::new(5, [p.b.sge(2048, 64)])).unwrap();
    p.qa.post_send(SendWr::new(6, SendOp::Send, []).inline(b"inline bytes"))
        .unwrap();
    ok(&p.cq_a, 6, WcOpcode::Send);
    assert_eq!(ok(&p.cq_b, 5, WcOpcode::Recv).byte_len, 12);
    assert_eq!(p.b.read_vec(2048, 12).unwrap(), b"inline bytes");
    // WRITE with immediate: the payload lands, a receive carries the number.
    p.qb.post_recv(RecvWr::new(7, [])).unwrap();
    let wimm = SendOp::WriteWithImm {
        remote_addr: p.b.addr() + 40000,
        rkey: p.b.rkey(),
        imm: 99,
    };
    p.qa.post_send(SendWr::new(8, wimm, [p.a.sge(0, 16)]))
        .unwrap();
    ok(&p.cq_a, 8, WcOpcode::RdmaWrite);
    let wc = ok(&p.cq_b, 7, WcOpcode::RecvRdmaWithImm);
    assert_eq!((wc.imm, wc.byte_len), (Some(99), 16));
    assert_eq!(p.b.read_vec(40000, 16).unwrap(), data[..16]);
    // Atomics on an 8-byte word of b.
    p.b.write(48000, &40u64.to_ne_bytes()).unwrap();
    let fadd = SendOp::FetchAdd {
        remote_addr: p.b.addr() + 48000,
        rkey: p.b.rkey(),
        add: 2,
    };
    p.qa.post_send(SendWr::new(9, fadd, [p.a.sge(30000, 8)]))
        .unwrap();
    ok(&p.cq_a, 9, WcOpcode::FetchAdd);
    assert_eq!(p.a.load_u64(30000).unwrap(), 40);
    let cas = SendOp::CompareSwap {
        remote_addr: p.b.addr() + 48000,
        rkey: p.b.rkey(),
        compare: 42,
        swap: 7,
    };
    p.qa.post_send(SendWr::new(10, cas, [p.a.sge(30008, 8)]))
        .unwrap();
    ok(&p.cq_a, 10, WcOpcode::CompareSwap);
    assert_eq!(p.a.load_u64(30008).unwrap(), 42);
    assert_eq!(p.b.load_u64(48000).unwrap(), 7);
    // Unsignaled WRITEs complete nothing; the signaled one after them does.
    for i in 0..3 {
        let w = SendOp::Write {
            remote_addr: p.b.addr() + 50000 + i * 8,
            rkey: p.b.rkey(),
        };
        p.qa.post_send(SendWr::new(20 + i, w, [p.a.sge(0, 8)]).unsignaled())
            .unwrap();
    }
    p.qa.post_send(SendWr::new(30, write, [p.a.sge(0, 8)]))
        .unwrap();
    ok(&p.cq_a, 30, WcOpcode::RdmaWrite);
    assert!(p.cq_a.poll_one().unwrap().is_none());
    let q = p.qa.query();
    assert_eq!((q.state, q.dest_qp), (Some(QpState::Rts), Some(p.qb.qpn())));
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn a_bad_rkey_fails_the_qp_and_later_work_is_flushed() {
    let p = pair();
    let bad = SendOp::Write {
        remote_addr: p.b.addr(),
        rkey: p.b.rkey() ^ 0x100,
    };
    p.qa.post_send(SendWr::new(1, bad, [p.a.sge(0, 64)]))
        .unwrap();
    let wc = one(&p.cq_a);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RemAccessErr));
    common::wait_state(&p.qa, QpState::Err);
    p.qa.post_send(SendWr::new(2, SendOp::Send, [p.a.sge(0, 8)]))
        .unwrap();
    let wc = one(&p.cq_a);
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::WrFlushErr));
    // Past the end of a region, on a fresh pair.
    let p = pair();
    let beyond = SendOp::Write {
        remote_addr: p.b.addr() + p.b.len() as u64 - 8,
        rkey: p.b.rkey(),
    };
    p.qa.post_send(SendWr::new(3, beyond, [p.a.sge(0, 64)]))
        .unwrap();
    assert_eq!(one(&p.cq_a).status, WcStatus::RemAccessErr);
    // A local key that is not one: the requester's own error.
    let p = pair();
    let wrong = Sge {
        addr: p.a.addr(),
        len: 8,
        lkey: p.a.lkey() ^ 0x100,
    };
    let write = SendOp::Write {
        remote_addr: p.b.addr(),
        rkey: p.b.rkey(),
    };
    p.qa.post_send(SendWr::new(4, write, [wrong])).unwrap();
    // The device's word: rxe (kernel 6.1) says LOC_QP_OP_ERR, the IB spec
    // and softrdma's own providers LOC_PROT_ERR.
    let status = one(&p.cq_a).status;
    assert!(
        matches!(status, WcStatus::LocProtErr | WcStatus::LocQpOpErr),
        "{status:?}"
    );
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn a_dropped_region_is_out_of_reach() {
    let p = pair();
    let gone = p.pd.register(4096, Access::ALL).unwrap();
    let (addr, rkey) = (gone.addr(), gone.rkey());
    drop(gone);
    let w = SendOp::Write {
        remote_addr: addr,
        rkey,
    };
    p.qa.post_send(SendWr::new(1, w, [p.a.sge(0, 64)])).unwrap();
    assert_eq!(one(&p.cq_a).status, WcStatus::RemAccessErr);
    // A caller's buffer comes back whole.
    let mr =
        p.pd.register_vec(vec![5u8; 100], Access::LOCAL_WRITE)
            .unwrap();
    assert_eq!(mr.deregister(), Some(vec![5u8; 100]));
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn waits_sleep_on_the_completion_channel() {
    let p = pair();
    assert!(p.cq_b.wait(Duration::from_millis(50)).unwrap().is_none());
    p.qb.post_recv(RecvWr::new(1, [p.b.sge(0, 64)])).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            p.qa.post_send(SendWr::new(2, SendOp::Send, [p.a.sge(0, 8)]))
                .unwrap();
        });
        let t = Instant::now();
        let wc = p.cq_b.wait(T).unwrap().expect("the SEND");
        assert_eq!(wc.wr_id, 1);
        assert!(t.elapsed() >= Duration::from_millis(150));
    });
    assert_eq!(ok(&p.cq_a, 2, WcOpcode::Send).status, WcStatus::Success);
    // The channel: armed, it fires once at the next completion.
    p.qb.post_recv(RecvWr::new(3, [p.b.sge(0, 64)])).unwrap();
    p.cq_b.req_notify(false);
    assert!(!p.cq_b.wait_event(Duration::from_millis(50)));
    p.qa.post_send(SendWr::new(4, SendOp::Send, [p.a.sge(0, 8)]))
        .unwrap();
    assert!(p.cq_b.wait_event(T));
    assert_eq!(ok(&p.cq_b, 3, WcOpcode::Recv).byte_len, 8);
    assert_eq!(p.cq_b.take_events(), 0);
    // wait_for gathers several.
    for i in 0..3 {
        p.qb.post_recv(RecvWr::new(10 + i, [p.b.sge(0, 64)]))
            .unwrap();
        p.qa.post_send(SendWr::new(20 + i, SendOp::Send, [p.a.sge(0, 8)]))
            .unwrap();
    }
    let got = p.cq_b.wait_for(3, T).unwrap();
    assert_eq!(
        got.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        [10, 11, 12]
    );
    assert_eq!(p.cq_a.wait_for(3, T).unwrap().len(), 3);
    drop(p.ctx);
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn ud_datagrams_go_through_an_address_handle() {
    let UdPair {
        ctx,
        pd,
        mr,
        cq,
        qa,
        qb,
    } = ud_pair(0x1111);
    qb.post_recv(RecvWr::new(1, [mr.sge(4096, 40 + 512)]))
        .unwrap();
    mr.write(0, &[9u8; 300]).unwrap();
    let ah = pd
        .create_ah(AhAttr {
            addr: ctx.local_addr(),
        })
        .unwrap();
    qa.post_send(SendWr::new(2, SendOp::Send, [mr.sge(0, 300)]).to(ah.dest(qb.qpn(), 0x1111)))
        .unwrap();
    let mut got = cq.wait_for(2, T).unwrap();
    got.sort_by_key(|w| w.wr_id);
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(
        (got[0].status, got[0].byte_len, got[0].grh),
        (WcStatus::Success, 340, true)
    );
    assert_eq!(got[0].src_qp, qa.qpn());
    assert_eq!(mr.read_vec(4096 + 40, 300).unwrap(), vec![9u8; 300]);
    assert_eq!((got[1].wr_id, got[1].status), (2, WcStatus::Success));
    // A destroyed handle is refused at post time.
    let dest = ah.dest(qb.qpn(), 0x1111);
    drop(ah);
    let e = qa
        .post_send(SendWr::new(3, SendOp::Send, [mr.sge(0, 8)]).to(dest))
        .unwrap_err();
    assert!(matches!(e, VerbsError::Post(PostError::BadAh(_))), "{e}");
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn qps_share_an_srq_and_its_limit_raises_an_event() {
    let ctx = device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(16384, Access::LOCAL_WRITE).unwrap();
    let (scq, rcq) = (ctx.create_cq(64).unwrap(), ctx.create_cq(64).unwrap());
    let srq = pd.create_srq(16, 1).unwrap();
    let senders: Vec<Qp> = (0..2)
        .map(|_| pd.create_qp(&QpInit::rc(&scq, &scq)).unwrap())
        .collect();
    let receivers: Vec<Qp> = (0..2)
        .map(|_| pd.create_qp(&QpInit::rc(&rcq, &rcq).srq(&srq)).unwrap())
        .collect();
    for (s, r) in senders.iter().zip(&receivers) {
        connect_rc(s, r, None, &RcOptions::default());
    }
    let e = receivers[0]
        .post_recv(RecvWr::new(0, [mr.sge(0, 64)]))
        .unwrap_err();
    assert!(e.to_string().contains("shared receive queue"), "{e}");
    for i in 0..4 {
        srq.post_recv(RecvWr::new(100 + i, [mr.sge(1024 * i as usize, 1024)]))
            .unwrap();
    }
    srq.arm_limit(3).unwrap();
    for (i, s) in senders.iter().enumerate() {
        s.post_send(SendWr::new(
            i as u64,
            SendOp::Send,
            [mr.sge(8192, 10 + i as u32)],
        ))
        .unwrap();
    }
    let mut got = rcq.wait_for(2, T).unwrap();
    got.sort_by_key(|w| w.qp_num);
    let mut want: Vec<(u32, u32)> = receivers.iter().map(Qp::qpn).zip([10, 11]).collect();
    want.sort();
    assert_eq!(
        got.iter()
            .map(|w| (w.qp_num, w.byte_len))
            .collect::<Vec<_>>(),
        want
    );
    assert!(got.iter().all(|w| (100..104).contains(&w.wr_id)));
    wait_event(&ctx, AsyncEvent::SrqLimitReached { srq: srq.id() });
    assert_eq!(scq.wait_for(2, T).unwrap().len(), 2);
}

#[cfg(feature = "tokio")]
#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn an_async_cq_awaits_the_devices_completions() {
    let p = pair();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .unwrap();
    for k in 0..3 {
        p.qb.post_recv(RecvWr::new(k, [p.b.sge(64 * k as usize, 64)]))
            .unwrap();
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            for k in 0..3 {
                std::thread::sleep(Duration::from_millis(50));
                p.qa.post_send(SendWr::new(k, SendOp::Send, [p.a.sge(0, 8)]))
                    .unwrap();
            }
        });
        let got: Vec<u64> = rt.block_on(async {
            let mut cq = AsyncCq::new(p.cq_b.clone()).unwrap();
            let mut got = vec![];
            for _ in 0..3 {
                let wc = tokio::time::timeout(T, cq.next())
                    .await
                    .expect("a completion in time")
                    .unwrap()
                    .unwrap();
                assert_eq!(wc.status, WcStatus::Success);
                got.push(wc.wr_id);
            }
            got
        });
        assert_eq!(got, [0, 1, 2]);
    });
    assert_eq!(p.cq_a.wait_for(3, T).unwrap().len(), 3);
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn two_threads_waiting_on_one_cq_both_wake() {
    let p = pair();
    for k in 0..2 {
        p.qb.post_recv(RecvWr::new(k, [p.b.sge(64 * k as usize, 64)]))
            .unwrap();
    }
    std::thread::scope(|s| {
        // Both asleep on the CQ's one channel before anything comes.
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let cq = p.cq_b.clone();
                s.spawn(move || cq.wait(Duration::from_secs(10)).unwrap())
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        for k in 0..2 {
            p.qa.post_send(SendWr::new(k, SendOp::Send, [p.a.sge(0, 8)]))
                .unwrap();
            std::thread::sleep(Duration::from_millis(100));
        }
        let t = Instant::now();
        let mut got: Vec<u64> = waiters
            .into_iter()
            .map(|w| w.join().unwrap().expect("each waiter a completion").wr_id)
            .collect();
        got.sort();
        assert_eq!(got, [0, 1]);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    });
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn an_address_handle_dropped_after_its_post_still_delivers() {
    let UdPair {
        ctx,
        pd,
        mr,
        cq,
        qa,
        qb,
    } = ud_pair(0x2222);
    for round in 0..20u64 {
        qb.post_recv(RecvWr::new(100 + round, [mr.sge(4096, 40 + 64)]))
            .unwrap();
        let ah = pd
            .create_ah(AhAttr {
                addr: ctx.local_addr(),
            })
            .unwrap();
        qa.post_send(
            SendWr::new(round, SendOp::Send, [mr.sge(0, 32)]).to(ah.dest(qb.qpn(), 0x2222)),
        )
        .unwrap();
        drop(ah);
        let mut got = cq.wait_for(2, T).unwrap();
        got.sort_by_key(|w| w.wr_id);
        assert_eq!(
            got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            [(round, WcStatus::Success), (100 + round, WcStatus::Success)]
        );
    }
    assert_eq!(qa.state(), QpState::Rts);
}
