//! The verbs' own rules: registration, keys, CQ capacity and notification,
//! QP transitions and post errors through the public API.

use std::os::fd::AsFd;
use std::time::Duration;

use softrdma::cm::RcOptions;
use softrdma::verbs::*;

mod common;

fn ctx() -> Context {
    Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap()
}

/// On one device: a region, QP `a` completing on `cq` (of `cq_len`), QP `b`
/// on a CQ of its own, the two connected.
struct Looped {
    ctx: Context,
    mr: Mr,
    cq: Cq,
    a: Qp,
    b: Qp,
    _b_cq: Cq,
}

fn looped(cq_len: usize) -> Looped {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(4096, Access::ALL).unwrap();
    let cq = ctx.create_cq(cq_len).unwrap();
    let a = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    let b_cq = ctx.create_cq(16).unwrap();
    let b = pd.create_qp(&QpInit::rc(&b_cq, &b_cq)).unwrap();
    common::connect_rc(&a, &b, Some(&mr), &RcOptions::default());
    Looped {
        ctx,
        mr,
        cq,
        a,
        b,
        _b_cq: b_cq,
    }
}

/// A signaled 8-byte WRITE from `qp` to the start of `mr`.
fn write8(qp: &Qp, mr: &Mr, wr_id: u64) {
    let op = SendOp::Write {
        remote_addr: mr.addr(),
        rkey: mr.rkey(),
    };
    qp.post_send(SendWr::new(wr_id, op, [mr.sge(0, 8)]))
        .unwrap();
}

#[test]
fn registration_rules_and_keys() {
    let c = ctx();
    let pd = c.alloc_pd().unwrap();
    // Remote write and atomic rights need local write (as the kernel insists).
    assert!(pd.register(64, Access::REMOTE_WRITE).is_err());
    assert!(
        pd.register(64, Access::REMOTE_ATOMIC | Access::REMOTE_READ)
            .is_err()
    );
    assert!(pd.register(0, Access::LOCAL_WRITE).is_err());
    let a = pd.register(8192, Access::ALL).unwrap();
    let b = pd.register(8192, Access::ALL).unwrap();
    assert_eq!(a.addr() % 4096, 0, "library memory is page aligned");
    let keys = [a.lkey(), a.rkey(), b.lkey(), b.rkey()];
    for (i, k) in keys.iter().enumerate() {
        assert!(keys[i + 1..].iter().all(|o| o != k), "keys are distinct");
    }
    // Random, not a counter: the difference between consecutive keys is not small.
    assert!(
        keys.windows(2).any(|w| w[0].abs_diff(w[1]) > 1 << 16),
        "{keys:x?}"
    );
    // Safe accessors check bounds.
    assert!(a.write(8190, b"abc").is_err());
    assert!(a.read(usize::MAX, &mut [0u8; 2]).is_err());
    a.write(8189, b"abc").unwrap();
    assert_eq!(a.read_vec(8189, 3).unwrap(), b"abc");
    assert!(a.load_u64(3).is_err(), "unaligned");
    // A caller's buffer comes back on deregistration.
    let v = pd
        .register_vec(b"caller memory".to_vec(), Access::LOCAL_WRITE)
        .unwrap();
    v.write(0, b"C").unwrap();
    assert_eq!(v.deregister().unwrap(), b"Caller memory");
    assert!(a.deregister().is_none(), "library memory is not a Vec");
}

#[test]
fn cq_capacity_and_overrun_is_an_error() {
    let l = looped(2);
    let (c, mr, small, qp, peer) = (&l.ctx, &l.mr, &l.cq, &l.a, &l.b);
    assert!(c.create_cq(0).is_err());
    for i in 0..4 {
        write8(qp, mr, i);
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut wcs = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        qp_num: 0,
        src_qp: 0,
        grh: false,
        solicited: false,
        invalidated_rkey: None,
    }; 8];
    // The two queued before the overrun are polled, then the CQ says it
    // overran, and keeps saying so: nothing after it was taken.
    assert_eq!(small.poll(&mut wcs), Ok(2));
    assert_eq!(wcs[..2].iter().map(|w| w.wr_id).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(small.poll(&mut wcs), Err(CqError::Overrun(2)));
    assert_eq!(small.poll_one(), Err(CqError::Overrun(2)));
    assert_eq!(
        small.wait(Duration::from_millis(10)),
        Err(CqError::Overrun(2))
    );
    // The QP whose completions were lost failed.
    assert_eq!(qp.state(), QpState::Err);
    assert_eq!(peer.state(), QpState::Rts);
}

/// A CQ armed for any completion stays so when a solicited-only arm
/// follows (rdmavt keeps NEXT_COMP), and a thread that loses the event to
/// another waits on for its own time instead of returning at once.
#[test]
fn an_arm_is_not_narrowed_and_a_lost_event_race_keeps_waiting() {
    let l = looped(16);
    let (mr, cq, a) = (&l.mr, &l.cq, &l.a);
    let _fd = cq.as_fd();
    cq.req_notify(false);
    cq.req_notify(true);
    // An unsolicited WRITE: its send completion fires the arm.
    write8(a, mr, 1);
    assert!(cq.wait_event(Duration::from_secs(5)), "the first arm held");
    assert_eq!(cq.wait(Duration::from_secs(5)).unwrap().unwrap().wr_id, 1);
    // Two waiters, one event: the other keeps waiting until its timeout.
    cq.req_notify(false);
    let t = std::time::Instant::now();
    let got = std::thread::scope(|s| {
        let waiters: Vec<_> = (0..2)
            .map(|_| s.spawn(|| cq.wait_event(Duration::from_millis(600))))
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        write8(a, mr, 2);
        waiters
            .into_iter()
            .map(|w| w.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(got.iter().filter(|&&f| f).count(), 1, "{got:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(550),
        "the loser returned early: {:?}",
        t.elapsed()
    );
}

#[test]
fn completion_channel_fires_on_the_fd() {
    let c = ctx();
    let pd = c.alloc_pd().unwrap();
    let mr = pd.register(4096, Access::ALL).unwrap();
    let cq_a = c.create_cq(16).unwrap();
    let cq_b = c.create_cq(16).unwrap();
    let a = pd.create_qp(&QpInit::rc(&cq_a, &cq_a)).unwrap();
    let b = pd.create_qp(&QpInit::rc(&cq_b, &cq_b)).unwrap();
    common::connect_rc(&a, &b, Some(&mr), &RcOptions::default());
    let _fd = cq_b.as_fd();
    // Solicited only: an unsolicited SEND does not fire, a solicited one does.
    cq_b.req_notify(true);
    for solicited in [false, true] {
        b.post_recv(RecvWr::new(7, [mr.sge(100, 16)])).unwrap();
        a.post_send(SendWr {
            wr_id: 1,
            op: SendOp::Send,
            sgl: vec![mr.sge(0, 16)].into(),
            flags: SendFlags {
                solicited,
                ..SendFlags::default()
            },
            ud: None,
            inline_data: InlineData::new(),
        })
        .unwrap();
        let fired = cq_b.wait_event(Duration::from_millis(500));
        assert_eq!(fired, solicited, "solicited={solicited}");
        assert_eq!(
            cq_b.wait(Duration::from_secs(5))
                .unwrap()
                .unwrap()
                .solicited,
            solicited
        );
    }
    // Any completion fires a plain notification; one already waiting fires at once.
    b.post_recv(RecvWr::new(8, [mr.sge(100, 16)])).unwrap();
    a.post_send(SendWr {
        wr_id: 2,
        op: SendOp::Send,
        sgl: vec![mr.sge(0, 16)].into(),
        flags: SendFlags::default(),
        ud: None,
        inline_data: InlineData::new(),
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    cq_b.req_notify(false);
    assert!(cq_b.wait_event(Duration::from_millis(500)));
    assert!(
        !cq_b.wait_event(Duration::from_millis(50)),
        "one event per request"
    );
}

#[test]
fn qp_transitions_through_the_verbs() {
    let c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = c.create_cq(16).unwrap();
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    assert_eq!(qp.state(), QpState::Reset);
    // Posting before RTS is refused on the call.
    let send = || SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sgl: Default::default(),
        flags: SendFlags::default(),
        ud: None,
        inline_data: InlineData::new(),
    };
    assert!(matches!(
        qp.post_send(send()),
        Err(VerbsError::Post(PostError::BadState(QpState::Reset)))
    ));
    // INIT -> RTR without an address vector is refused.
    qp.modify(
        &QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(Access::NONE),
            ..QpAttr::default()
        },
        None,
    )
    .unwrap();
    let rtr = QpAttr {
        state: Some(QpState::Rtr),
        path_mtu: Some(Mtu::Mtu1024),
        dest_qp: Some(0x12),
        rq_psn: Some(5),
        max_dest_rd_atomic: Some(1),
        min_rnr_timer: Some(12),
        ..QpAttr::default()
    };
    let err = qp.modify(&rtr, None).unwrap_err();
    assert!(err.to_string().contains("ah_attr"), "{err}");
    let av = AddressVector {
        addr: "127.0.0.1:4791".parse().unwrap(),
    };
    qp.modify(&rtr, Some(av)).unwrap();
    assert!(matches!(
        qp.post_send(send()),
        Err(VerbsError::Post(PostError::BadState(QpState::Rtr)))
    ));
    qp.post_recv(RecvWr::new(1, [])).unwrap();
    let rts = QpAttr {
        state: Some(QpState::Rts),
        sq_psn: Some(9),
        timeout: Some(14),
        retry_cnt: Some(7),
        rnr_retry: Some(7),
        max_rd_atomic: Some(1),
        ..QpAttr::default()
    };
    qp.modify(&rts, None).unwrap();
    let q = qp.query();
    assert_eq!(
        (q.state, q.sq_psn, q.rq_psn, q.dest_qp, q.path_mtu),
        (
            Some(QpState::Rts),
            Some(9),
            Some(5),
            Some(0x12),
            Some(Mtu::Mtu1024)
        )
    );
    // SQD and back.
    qp.modify(
        &QpAttr {
            state: Some(QpState::Sqd),
            ..QpAttr::default()
        },
        None,
    )
    .unwrap();
    qp.modify(
        &QpAttr {
            state: Some(QpState::Rts),
            ..QpAttr::default()
        },
        None,
    )
    .unwrap();
    // To ERR: the posted receive is flushed onto the CQ.
    qp.modify(
        &QpAttr {
            state: Some(QpState::Err),
            ..QpAttr::default()
        },
        None,
    )
    .unwrap();
    let wc = cq.wait(Duration::from_secs(1)).unwrap().unwrap();
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::WrFlushErr));
    // ERR -> RTS is not a transition; ERR -> RESET is.
    assert!(qp.modify(&rts, None).is_err());
    qp.modify(
        &QpAttr {
            state: Some(QpState::Reset),
            ..QpAttr::default()
        },
        None,
    )
    .unwrap();
    assert_eq!(qp.state(), QpState::Reset);
    // A path MTU above the port's is refused.
    let c2 = Device::udp("127.0.0.1:0".parse().unwrap())
        .link_mtu(1500)
        .open()
        .unwrap();
    assert_eq!(c2.query_port().active_mtu, Mtu::Mtu1024);
    let pd2 = c2.alloc_pd().unwrap();
    let cq2 = c2.create_cq(4).unwrap();
    let qp2 = pd2.create_qp(&QpInit::rc(&cq2, &cq2)).unwrap();
    qp2.modify(
        &QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(Access::NONE),
            ..QpAttr::default()
        },
        None,
    )
    .unwrap();
    let big = QpAttr {
        path_mtu: Some(Mtu::Mtu4096),
        ..rtr
    };
    assert!(qp2.modify(&big, Some(av)).is_err());
}

#[test]
fn port_attributes() {
    let c = ctx();
    let p = c.query_port();
    assert_eq!(p.state, PortState::Active);
    assert_eq!(p.active_mtu, Mtu::Mtu4096, "loopback allows 4096");
    assert_eq!(p.gids[IPV4_GID_INDEX][10..], [0xff, 0xff, 127, 0, 0, 1]);
    assert_eq!(
        p.gids[0], [0; 16],
        "loopback has no MAC, so no link-local GID"
    );
    assert_eq!(p.udp_port, c.local_addr().port());
    assert!(Device::udp("0.0.0.0:0".parse().unwrap()).open().is_err());
    // Binding to these works; being a GID does not.
    for not_unicast in ["224.0.0.1:0", "255.255.255.255:0"] {
        let e = Device::udp(not_unicast.parse().unwrap())
            .open()
            .unwrap_err();
        assert!(e.to_string().contains("unicast"), "{e}");
    }
    assert!(Device::iwarp("239.1.2.3".parse().unwrap()).open().is_err());
}

/// Two events pending on a completion channel go to two waiting threads,
/// one each, as `ibv_get_cq_event` hands them out; `take_events` counts
/// what is left.
#[test]
fn two_channel_events_wake_two_waiters() {
    let l = looped(16);
    let (mr, cq, a) = (&l.mr, &l.cq, &l.a);
    cq.req_notify(false);
    write8(a, mr, 1);
    // The completion fires the arm; an arm with it still queued fires again.
    assert!(cq.wait_event(common::T));
    cq.req_notify(false);
    cq.req_notify(false);
    let woken = std::thread::scope(|s| {
        let waiters: Vec<_> = (0..2)
            .map(|_| s.spawn(|| cq.wait_event(Duration::from_millis(500))))
            .collect();
        waiters
            .into_iter()
            .map(|w| w.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(woken, [true, true]);
    cq.req_notify(false);
    assert_eq!(cq.take_events(), 1);
    assert_eq!(cq.take_events(), 0);
}

/// A QP takes CQs and an SRQ of its own device context only.
#[test]
fn a_qp_refuses_cqs_and_srqs_of_another_context() {
    let (a, b) = (ctx(), ctx());
    let pd = b.alloc_pd().unwrap();
    let (their_cq, our_cq) = (a.create_cq(4).unwrap(), b.create_cq(4).unwrap());
    let their_srq = a.alloc_pd().unwrap().create_srq(4, 1).unwrap();
    let e = pd.create_qp(&QpInit::rc(&their_cq, &our_cq)).unwrap_err();
    assert!(e.to_string().contains("send CQ belongs to another"), "{e}");
    let e = pd.create_qp(&QpInit::rc(&our_cq, &their_cq)).unwrap_err();
    assert!(
        e.to_string().contains("receive CQ belongs to another"),
        "{e}"
    );
    let e = pd
        .create_qp(&QpInit::rc(&our_cq, &our_cq).srq(&their_srq))
        .unwrap_err();
    assert!(e.to_string().contains("SRQ belongs to another"), "{e}");
    pd.create_qp(&QpInit::rc(&our_cq, &our_cq)).unwrap();
}

/// `query_device` reports the limits the verbs enforce, on every provider:
/// each limit is taken, one more is refused.
#[test]
fn query_device_reports_the_limits_the_verbs_enforce() {
    let devices = [
        Device::udp("127.0.0.1:0".parse().unwrap()),
        Device::iwarp(std::net::Ipv4Addr::LOCALHOST),
        Device::shm(),
    ];
    for dev in devices {
        let c = dev.open().unwrap();
        let a = c.query_device();
        let what = format!("{:?}", c.local_addr());
        assert!(
            a.max_qp > 60_000 && a.max_msg_sz == 1 << 31,
            "{what}: {a:?}"
        );
        assert!(c.create_cq(a.max_cqe as usize).is_ok(), "{what}");
        assert!(c.create_cq(a.max_cqe as usize + 1).is_err(), "{what}");
        let cq = c.create_cq(4).unwrap();
        let pd = c.alloc_pd().unwrap();
        let most = QpCaps {
            max_send_wr: a.max_qp_wr,
            max_recv_wr: a.max_qp_wr,
            max_send_sge: a.max_send_sge,
            max_recv_sge: a.max_recv_sge,
            max_inline_data: a.max_inline_data,
        };
        pd.create_qp(&QpInit::rc(&cq, &cq).caps(most))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let over: [fn(&mut QpCaps); 5] = [
            |c| c.max_send_wr += 1,
            |c| c.max_recv_wr += 1,
            |c| c.max_send_sge += 1,
            |c| c.max_recv_sge += 1,
            |c| c.max_inline_data += 1,
        ];
        for (k, more) in over.iter().enumerate() {
            let mut caps = most;
            more(&mut caps);
            let r = pd.create_qp(&QpInit::rc(&cq, &cq).caps(caps));
            assert!(r.is_err(), "{what}: limit {k} plus one was taken");
        }
        assert_eq!(pd.create_qp(&QpInit::ud(&cq, &cq)).is_ok(), a.ud, "{what}");
        if a.max_srq_wr > 0 {
            let srq = pd.create_srq(a.max_srq_wr, a.max_srq_sge).unwrap();
            pd.create_qp(&QpInit::rc(&cq, &cq).srq(&srq)).unwrap();
            assert!(pd.create_srq(a.max_srq_wr + 1, 1).is_err());
            assert!(pd.create_srq(1, a.max_srq_sge + 1).is_err());
        } else {
            assert!(pd.create_srq(1, 1).is_err(), "{what}");
        }
        assert_eq!(a.atomic_cap == AtomicCap::None, c.is_iwarp(), "{what}");
    }
    // RoCEv2's READ and atomic depths, through modify.
    let c = ctx();
    let a = c.query_device();
    let (pd, cq) = (c.alloc_pd().unwrap(), c.create_cq(4).unwrap());
    for (depth, ok) in [
        (a.max_qp_init_rd_atom, true),
        (a.max_qp_init_rd_atom + 1, false),
    ] {
        let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
        let peer = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
        let opts = RcOptions {
            max_rd_atomic: depth.min(255) as u8,
            max_dest_rd_atomic: depth.min(255) as u8,
            ..RcOptions::default()
        };
        use softrdma::cm::{self, ConnInfo};
        let (ours, theirs) = (
            ConnInfo::local(&qp, None).unwrap(),
            ConnInfo::local(&peer, None).unwrap(),
        );
        let r = cm::connect(&qp, &ours, &theirs, &opts);
        assert_eq!(r.is_ok(), ok, "depth {depth}: {r:?}");
    }
    // iWARP's IRD and ORD, through the MPA configuration.
    let c = Device::iwarp(std::net::Ipv4Addr::LOCALHOST).open().unwrap();
    let a = c.query_device();
    let (pd, cq) = (c.alloc_pd().unwrap(), c.create_cq(4).unwrap());
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    let l = softrdma::cm::iwarp::Listener::bind(&c, 0).unwrap();
    let cfg = softrdma::cm::mpa::MpaConfig {
        ird: a.max_qp_rd_atom as u16 + 1,
        ..Default::default()
    };
    let e = l
        .accept(&qp, &cfg, |_| softrdma::cm::mpa::Decision::Accept)
        .unwrap_err();
    assert!(e.to_string().contains("at most 128"), "{e}");
}
