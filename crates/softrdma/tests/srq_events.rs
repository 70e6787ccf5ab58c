//! Shared receive queues under load, and asynchronous events.

use std::time::Duration;

use softrdma::cm::RcOptions;
use softrdma::verbs::*;

mod common;

const T: Duration = Duration::from_secs(20);

fn ctx() -> Context {
    Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap()
}

#[test]
fn eight_rc_qps_share_one_srq_under_load() {
    // The receiving side: 8 QPs on one SRQ, one receive CQ.
    let rx = ctx();
    let rpd = rx.alloc_pd().unwrap();
    let rmr = rpd.register(8 << 20, Access::LOCAL_WRITE).unwrap();
    let rcq = rx.create_cq(4096).unwrap();
    let scq_r = rx.create_cq(64).unwrap();
    let srq = rpd.create_srq(256, 1).unwrap();
    // The sending side: 8 QPs, one CQ.
    let tx = ctx();
    let tpd = tx.alloc_pd().unwrap();
    let tmr = tpd.register(1 << 20, Access::LOCAL_WRITE).unwrap();
    let tcq = tx.create_cq(4096).unwrap();
    let mut pairs = vec![];
    for _ in 0..8 {
        let r = rpd.create_qp(&QpInit::rc(&scq_r, &rcq).srq(&srq)).unwrap();
        let s = tpd.create_qp(&QpInit::rc(&tcq, &tcq)).unwrap();
        let o = RcOptions {
            min_rnr_timer: 1,
            ..RcOptions::default()
        };
        common::connect_rc(&r, &s, None, &o);
        // A receive posted on a QP of an SRQ is refused.
        assert!(r.post_recv(RecvWr::new(0, [])).is_err());
        pairs.push((r, s));
    }
    const MSGS: usize = 50; // per QP: 400 in all, through 256 SRQ slots
    const SIZE: usize = 3000;
    let mut next_slot = 0usize;
    let post = |n: usize, next: &mut usize| {
        for _ in 0..n {
            let slot = *next % 2048;
            srq.post_recv(RecvWr::new(
                slot as u64,
                [rmr.sge(slot * 4096, SIZE as u32)],
            ))
            .unwrap();
            *next += 1;
        }
    };
    post(200, &mut next_slot);
    srq.arm_limit(100).unwrap();
    for (q, (_, s)) in pairs.iter().enumerate() {
        for m in 0..MSGS {
            let off = (q * MSGS + m) * 8;
            let tag = format!("{q}:{m:03}");
            tmr.write(off * 256 % (1 << 20), tag.as_bytes()).unwrap();
            let wr = SendWr::new(
                (q * MSGS + m) as u64,
                SendOp::Send,
                vec![tmr.sge(off * 256 % (1 << 20), SIZE as u32)],
            )
            .unsignaled();
            let wr = if m == MSGS - 1 {
                SendWr {
                    flags: SendFlags {
                        signaled: true,
                        ..wr.flags
                    },
                    ..wr
                }
            } else {
                wr
            };
            s.post_send(wr).unwrap();
        }
    }
    // Receive everything, reposting as we go; the senders meet RNR when the
    // SRQ runs dry and carry on when it is refilled.
    let mut seen = std::collections::BTreeSet::new();
    let mut limit_fired = false;
    while seen.len() < 8 * MSGS {
        let wc = rcq.wait(T).unwrap().expect("a receive");
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        assert_eq!(wc.byte_len as usize, SIZE);
        let text = rmr.read_vec(wc.wr_id as usize * 4096, 5).unwrap();
        let text = String::from_utf8(text).unwrap();
        let q: usize = text[..1].parse().unwrap();
        assert_eq!(
            pairs[q].0.qpn(),
            wc.qp_num,
            "arrived on the QP it was sent to"
        );
        assert!(seen.insert(text.clone()), "{text} twice");
        while let Some(e) = rx.poll_async_event() {
            if e == (AsyncEvent::SrqLimitReached { srq: srq.id() }) {
                limit_fired = true;
            }
        }
        // No reposting before 120 have arrived: by then fewer than 100
        // receives are left, whatever the arrivals' timing (the limit).
        if seen.len() >= 120 && seen.len() % 40 == 0 {
            post(40, &mut next_slot);
        }
    }
    assert!(limit_fired, "the SRQ limit event fired");
    // Per sender, in order: the last message of each completed.
    let done = tcq.wait_for(8, T).unwrap();
    assert!(done.iter().all(|w| w.status == WcStatus::Success));
}

#[test]
fn rnr_on_an_empty_srq_recovers() {
    let c = ctx();
    let pd = c.alloc_pd().unwrap();
    let mr = pd.register(1 << 16, Access::LOCAL_WRITE).unwrap();
    let cq = c.create_cq(64).unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let r = pd.create_qp(&QpInit::rc(&cq, &cq).srq(&srq)).unwrap();
    let s = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    let o = RcOptions {
        min_rnr_timer: 1,
        ..RcOptions::default()
    };
    common::connect_rc(&r, &s, None, &o);
    mr.write(0, b"waited").unwrap();
    s.post_send(SendWr::new(1, SendOp::Send, vec![mr.sge(0, 6)]))
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        s.stats().unwrap().rnr_naks_received >= 1,
        "RNR-NAKed, not dropped"
    );
    assert!(cq.poll_one().unwrap().is_none());
    srq.post_recv(RecvWr::new(9, [mr.sge(1000, 64)])).unwrap();
    let mut got = cq.wait_for(2, T).unwrap();
    got.sort_by_key(|w| w.wr_id);
    assert_eq!(
        got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success), (9, WcStatus::Success)]
    );
    assert_eq!(mr.read_vec(1000, 6).unwrap(), b"waited");
}

#[test]
fn async_events() {
    let c = ctx();
    assert_eq!(
        c.wait_async_event(Duration::from_secs(1)),
        Some(AsyncEvent::PortActive)
    );
    let pd = c.alloc_pd().unwrap();
    let mr = pd.register(4096, Access::ALL).unwrap();
    let cq = c.create_cq(1).unwrap();
    let srq = pd.create_srq(4, 1).unwrap();
    let a = pd.create_qp(&QpInit::rc(&cq, &cq).srq(&srq)).unwrap();
    let b = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    common::connect_rc(&a, &b, Some(&mr), &RcOptions::default());
    // A bad rkey: both QPs fail (the responder after its NAK): QP fatal for
    // each, last-WQE-reached for the one on the SRQ; two completions in a
    // one-entry CQ: a CQ error.
    b.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: mr.addr(),
            rkey: mr.rkey() ^ 1,
        },
        vec![mr.sge(0, 8)],
    ))
    .unwrap();
    b.post_send(SendWr::new(2, SendOp::Send, vec![])).unwrap();
    let mut events = vec![];
    while let Some(e) = c.wait_async_event(Duration::from_millis(500)) {
        events.push(e);
    }
    for want in [
        AsyncEvent::QpFatal { qpn: a.qpn() },
        AsyncEvent::QpFatal { qpn: b.qpn() },
        AsyncEvent::QpLastWqeReached { qpn: a.qpn() },
        AsyncEvent::CqError { cq: cq.id() },
    ] {
        assert!(events.contains(&want), "{want:?} not in {events:?}");
    }
    // The descriptor is readable while events wait, and quiet when none do.
    let _fd = c.async_fd();
    assert!(c.poll_async_event().is_none());
}

/// A QP moved to SQD with a 1 MiB WRITE in flight raises SQ_DRAINED once
/// the WRITE is acknowledged, after its completion; so does a UD QP.
#[test]
fn sqd_raises_sq_drained() {
    let c = ctx();
    let pd = c.alloc_pd().unwrap();
    let mr = pd.register(2 << 20, Access::ALL).unwrap();
    let cq = c.create_cq(16).unwrap();
    let a = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    let b = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    common::connect_rc(&a, &b, Some(&mr), &RcOptions::default());
    let write = SendOp::Write {
        remote_addr: mr.addr() + (1 << 20),
        rkey: mr.rkey(),
    };
    a.post_send(SendWr::new(1, write, [mr.sge(0, 1 << 20)]))
        .unwrap();
    let sqd = QpAttr {
        state: Some(QpState::Sqd),
        ..QpAttr::default()
    };
    a.modify(&sqd, None).unwrap();
    common::wait_event(&c, AsyncEvent::SqDrained { qpn: a.qpn() });
    let wc = cq.poll_one().unwrap().expect("the WRITE completed first");
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    assert_eq!(c.poll_async_event(), None, "once");
    let ud = pd.create_qp(&QpInit::ud(&cq, &cq)).unwrap();
    for state in [QpState::Init, QpState::Rtr, QpState::Rts, QpState::Sqd] {
        let attr = QpAttr {
            state: Some(state),
            qkey: (state == QpState::Init).then_some(7),
            pkey_index: (state == QpState::Init).then_some(0),
            port: (state == QpState::Init).then_some(1),
            sq_psn: (state == QpState::Rts).then_some(0),
            ..QpAttr::default()
        };
        ud.modify(&attr, None).unwrap();
    }
    common::wait_event(&c, AsyncEvent::SqDrained { qpn: ud.qpn() });
}

/// An SRQ's receives name memory of the SRQ's PD, which may not be its
/// QPs' PD (verbs allows that): their lkeys are checked against the SRQ's.
#[test]
fn srq_receives_use_the_srqs_pd_not_the_qps() {
    let c = ctx();
    let (srq_pd, qp_pd) = (c.alloc_pd().unwrap(), c.alloc_pd().unwrap());
    let srq_mr = srq_pd.register(1 << 16, Access::LOCAL_WRITE).unwrap();
    let qp_mr = qp_pd.register(1 << 16, Access::LOCAL_WRITE).unwrap();
    let cq = c.create_cq(64).unwrap();
    let srq = srq_pd.create_srq(8, 1).unwrap();

    // RC: the receiver on the QP PD, its receives from the SRQ PD's SRQ.
    let r = qp_pd.create_qp(&QpInit::rc(&cq, &cq).srq(&srq)).unwrap();
    let s = srq_pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    common::connect_rc(&r, &s, None, &RcOptions::default());
    srq_mr.write(0, b"through the SRQ's PD").unwrap();
    srq.post_recv(RecvWr::new(1, [srq_mr.sge(4096, 64)]))
        .unwrap();
    s.post_send(SendWr::new(2, SendOp::Send, vec![srq_mr.sge(0, 20)]))
        .unwrap();
    let mut got = cq.wait_for(2, T).unwrap();
    got.sort_by_key(|w| w.wr_id);
    assert_eq!(
        got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(srq_mr.read_vec(4096, 20).unwrap(), b"through the SRQ's PD");
    // An lkey of the QP's PD is not the SRQ's: a local protection error,
    // and the sender is NAKed.
    srq.post_recv(RecvWr::new(3, [qp_mr.sge(0, 64)])).unwrap();
    s.post_send(SendWr::new(4, SendOp::Send, vec![srq_mr.sge(0, 20)]))
        .unwrap();
    let mut got = cq.wait_for(2, T).unwrap();
    got.sort_by_key(|w| w.wr_id);
    assert_eq!(
        got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(3, WcStatus::LocProtErr), (4, WcStatus::RemOpErr)]
    );
    assert_eq!(qp_mr.read_vec(0, 20).unwrap(), [0; 20], "nothing placed");

    // UD, the same way round.
    let usrq = srq_pd.create_srq(8, 1).unwrap();
    let ur = qp_pd.create_qp(&QpInit::ud(&cq, &cq).srq(&usrq)).unwrap();
    let us = srq_pd.create_qp(&QpInit::ud(&cq, &cq)).unwrap();
    for q in [&ur, &us] {
        softrdma::cm::ready_ud(q, 0x2222, 0).unwrap();
    }
    let ah = srq_pd
        .create_ah(AhAttr {
            addr: c.local_addr(),
        })
        .unwrap();
    usrq.post_recv(RecvWr::new(5, [srq_mr.sge(8192, 40 + 64)]))
        .unwrap();
    us.post_send(SendWr::new(6, SendOp::Send, [srq_mr.sge(0, 20)]).to(ah.dest(ur.qpn(), 0x2222)))
        .unwrap();
    let mut got = cq.wait_for(2, T).unwrap();
    got.sort_by_key(|w| w.wr_id);
    assert_eq!(
        got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(5, WcStatus::Success), (6, WcStatus::Success)]
    );
    assert_eq!(
        srq_mr.read_vec(8192 + 40, 20).unwrap(),
        b"through the SRQ's PD"
    );
    usrq.post_recv(RecvWr::new(7, [qp_mr.sge(0, 40 + 64)]))
        .unwrap();
    us.post_send(SendWr::new(8, SendOp::Send, [srq_mr.sge(0, 20)]).to(ah.dest(ur.qpn(), 0x2222)))
        .unwrap();
    let mut got = cq.wait_for(2, T).unwrap();
    got.sort_by_key(|w| w.wr_id);
    assert_eq!(
        got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(7, WcStatus::LocProtErr), (8, WcStatus::Success)]
    );
    assert_eq!(qp_mr.read_vec(0, 60).unwrap(), [0; 60], "nothing placed");
}
