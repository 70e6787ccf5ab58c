//! What the tests share: one side's verbs objects (RoCEv2, iWARP, shared
//! memory), a connected iWARP pair, waiting for a completion or a QP state,
//! and the CPU time of a process's threads.

// Each test binary uses its own part of this.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use softrdma::verbs::*;

/// How long a test waits for something that should happen.
pub const T: Duration = Duration::from_secs(30);

/// Connects two RoCEv2 RC QPs to each other (`cm::connect` both ways), each
/// advertising `mr` if given.
pub fn connect_rc(a: &Qp, b: &Qp, mr: Option<&Mr>, opts: &softrdma::cm::RcOptions) {
    use softrdma::cm::{self, ConnInfo};
    let (ia, ib) = (
        ConnInfo::local(a, mr).unwrap(),
        ConnInfo::local(b, mr).unwrap(),
    );
    cm::connect(a, &ia, &ib, opts).unwrap();
    cm::connect(b, &ib, &ia, opts).unwrap();
}

/// One side: a PD with one region, a send and a receive CQ, an RC QP.
pub struct End {
    pub ctx: Context,
    pub pd: Pd,
    pub mr: Mr,
    pub scq: Cq,
    pub rcq: Cq,
    pub qp: Qp,
}

impl End {
    /// On `dev`: a region of `mr_len` bytes with every right, CQs of
    /// `cq_len`, a QP with `caps`.
    pub fn new(dev: Device, mr_len: usize, cq_len: usize, caps: QpCaps) -> End {
        let ctx = dev.open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(mr_len, Access::ALL).unwrap();
        let scq = ctx.create_cq(cq_len).unwrap();
        let rcq = ctx.create_cq(cq_len).unwrap();
        let qp = pd.create_qp(&QpInit::rc(&scq, &rcq).caps(caps)).unwrap();
        End {
            ctx,
            pd,
            mr,
            scq,
            rcq,
            qp,
        }
    }
}

/// A RoCEv2 side: a region of 1 MiB with every right, one CQ of 256 for both
/// queues, an RC QP, and what a peer needs to connect to it.
pub struct RoceEnd {
    pub ctx: Context,
    pub _pd: Pd,
    pub mr: Mr,
    pub cq: Cq,
    pub qp: Qp,
    pub info: softrdma::cm::ConnInfo,
}

/// A [`RoceEnd`] on `device`.
pub fn roce_end(device: Device) -> RoceEnd {
    let ctx = device.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(1 << 20, Access::ALL).unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    let info = softrdma::cm::ConnInfo::local(&qp, Some(&mr)).unwrap();
    RoceEnd {
        ctx,
        _pd: pd,
        mr,
        cq,
        qp,
        info,
    }
}

/// The next completion on `cq` (a test failure after [`T`]).
pub fn one(cq: &Cq) -> WorkCompletion {
    cq.wait(T).unwrap().expect("a completion in time")
}

/// Waits until `qp` is in `want` (a test failure after [`T`]).
pub fn wait_state(qp: &Qp, want: QpState) {
    let t = Instant::now();
    while qp.state() != want {
        assert!(t.elapsed() < T, "QP never reached {want}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A SEND of `data` from `from`'s QP lands in a receive posted on `to_qp`
/// (a QP of `to`'s, with `to`'s region and CQs): the connection works.
pub fn a_send_lands(from: &End, to: &End, to_qp: &Qp, data: &[u8]) {
    to_qp.post_recv(RecvWr::new(1, [to.mr.sge(0, 64)])).unwrap();
    from.mr.write(0, data).unwrap();
    from.qp
        .post_send(SendWr::new(
            2,
            SendOp::Send,
            [from.mr.sge(0, data.len() as u32)],
        ))
        .unwrap();
    assert_eq!(one(&to.rcq).status, WcStatus::Success);
    assert_eq!(to.mr.read_vec(0, data.len()).unwrap(), data);
}

/// Waits for `want` among `ctx`'s async events, skipping others (a test
/// failure after [`T`]).
pub fn wait_event(ctx: &Context, want: AsyncEvent) {
    let t = Instant::now();
    loop {
        let left = T.saturating_sub(t.elapsed());
        assert!(!left.is_zero(), "no {want:?} event");
        if ctx.wait_async_event(left) == Some(want) {
            return;
        }
    }
}

/// An iWARP end at `ip` (a region of 8 MiB, CQs of 256, 64 WRs and 4 SGEs a
/// queue).
pub fn iwarp_end(ip: [u8; 4]) -> End {
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    };
    End::new(
        Device::iwarp(std::net::Ipv4Addr::from(ip)),
        8 << 20,
        256,
        caps,
    )
}

/// An iWARP client at 127.0.0.1 connected to a server at 127.0.0.2; `before`
/// runs on the server's end before it accepts (to post receives).
pub fn iwarp_pair(
    client_cfg: softrdma::cm::mpa::MpaConfig,
    before: impl FnOnce(&End) + Send + 'static,
) -> (End, End) {
    use softrdma::cm::iwarp::{self, Listener};
    use softrdma::cm::mpa::{Decision, MpaConfig};
    let server = iwarp_end([127, 0, 0, 2]);
    let listener = Listener::bind(&server.ctx, 0).unwrap();
    let at = listener.local_addr();
    let t = std::thread::spawn(move || {
        before(&server);
        listener
            .accept(&server.qp, &MpaConfig::default(), |_| Decision::Accept)
            .unwrap();
        server
    });
    let client = iwarp_end([127, 0, 0, 1]);
    iwarp::connect(&client.qp, at, &client_cfg).unwrap();
    (client, t.join().unwrap())
}

/// CPU time (clock ticks) of this process's threads whose name starts with
/// `prefix`.
pub fn threads_cpu(prefix: &str) -> u64 {
    let mut ticks = 0;
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = t.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        // Fields after the command's closing parenthesis; utime and stime
        // are the 14th and 15th of the line.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        ticks += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    }
    ticks
}

/// `modify` to ERR on `a`, an iWARP or shm QP connected to `b`: only that
/// move is taken; `a`'s work is flushed by the time it returns, in posting
/// order, and what is posted later is flushed at once; `a` raises no fatal
/// event, `b` fails with one; a second move changes nothing.
pub fn modify_to_err_flushes_and_closes(a: &End, b: &End) {
    for k in 0..3 {
        a.qp.post_recv(RecvWr::new(10 + k, [a.mr.sge(0, 64)]))
            .unwrap();
    }
    let rts = QpAttr {
        state: Some(QpState::Rts),
        ..QpAttr::default()
    };
    let e = a.qp.modify(&rts, None).unwrap_err();
    assert!(e.to_string().contains("to ERR"), "{e}");
    let wrong_now = QpAttr {
        state: Some(QpState::Err),
        cur_state: Some(QpState::Init),
        ..QpAttr::default()
    };
    assert!(a.qp.modify(&wrong_now, None).is_err());
    assert_eq!(a.qp.state(), QpState::Rts);
    let err = QpAttr {
        state: Some(QpState::Err),
        ..QpAttr::default()
    };
    a.qp.modify(&err, None).unwrap();
    assert_eq!(a.qp.state(), QpState::Err);
    let flushed: Vec<(u64, WcStatus)> = std::iter::from_fn(|| a.rcq.poll_one().unwrap())
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(
        flushed,
        [10, 11, 12].map(|k| (k, WcStatus::WrFlushErr)).to_vec()
    );
    a.qp.post_recv(RecvWr::new(13, [a.mr.sge(0, 64)])).unwrap();
    let w = one(&a.rcq);
    assert_eq!((w.wr_id, w.status), (13, WcStatus::WrFlushErr));
    a.qp.post_send(SendWr::new(5, SendOp::Send, vec![a.mr.sge(0, 8)]))
        .unwrap();
    let w = one(&a.scq);
    assert_eq!((w.wr_id, w.status), (5, WcStatus::WrFlushErr));
    // The application's own move is no fatal event; the peer's loss is.
    let fatal = |e: &AsyncEvent| matches!(e, AsyncEvent::QpFatal { .. });
    assert!(!std::iter::from_fn(|| a.ctx.poll_async_event()).any(|e| fatal(&e)));
    wait_state(&b.qp, QpState::Err);
    // The peer's state may read ERR a moment before its event is out.
    wait_event(&b.ctx, AsyncEvent::QpFatal { qpn: b.qp.qpn() });
    a.qp.modify(&err, None).unwrap();
    assert_eq!(a.rcq.poll_one().unwrap(), None);
}

/// Sends a CM REQ (rdma_cm connecting over RoCEv2) from `peer`:4791 to
/// QP 1 of the RoCEv2 address `to`, and checks the REJ that comes back to
/// `peer`:4791: reason 8 (invalid service ID), the REQ's transaction and
/// communication IDs, an ICRC that holds.
pub fn cm_req_gets_its_rej(to: std::net::SocketAddrV4, peer: [u8; 4]) {
    use softrdma::wire::icrc::{self, Ipv4Pseudo};
    use softrdma::wire::{Opcode, Psn, deth, mad, packet};
    let sock = std::net::UdpSocket::bind((std::net::Ipv4Addr::from(peer), 4791)).unwrap();
    sock.set_read_timeout(Some(T)).unwrap();
    let mut req = [0u8; mad::MAD_LEN];
    mad::Repr {
        mgmt_class: mad::CLASS_CM,
        class_version: mad::CM_CLASS_VERSION,
        method: mad::METHOD_SEND,
        status: 0,
        class_specific: 0,
        transaction_id: 0x1234_5678,
        attribute_id: mad::CM_REQ,
        attribute_modifier: 0,
    }
    .emit(&mut mad::Header::new_unchecked(&mut req[..24]));
    req[24..28].copy_from_slice(&[0xaa, 0xbb, 0xcc, 0xdd]);
    let mut r = packet::Repr::new(Opcode::UD_SEND_ONLY, 1, Psn::new(0), req.len());
    r.deth = Some(deth::Repr {
        qkey: deth::GSI_QKEY,
        src_qp: 1,
    });
    let mut p = vec![0u8; r.buffer_len().unwrap()];
    r.emit(&mut p, &req).unwrap();
    let pseudo = |src: [u8; 4], dst: [u8; 4], len: usize| {
        Ipv4Pseudo::df(src.into(), dst.into()).header((8 + len) as u16)
    };
    let udp_len = (8 + p.len()) as u16;
    let udp = icrc::udp_header(4791, to.port(), udp_len);
    icrc::fill(&pseudo(peer, to.ip().octets(), p.len()), &udp, &mut p).unwrap();
    sock.send_to(&p, to).unwrap();
    let mut got = [0u8; 512];
    let (n, from) = sock.recv_from(&mut got).expect("a REJ");
    assert_eq!(from.ip(), std::net::IpAddr::from(*to.ip()));
    let rej = packet::Packet::new_checked(&got[..n]).unwrap();
    assert_eq!((rej.bth().dest_qp(), rej.deth().unwrap().src_qp()), (1, 1));
    let m = rej.payload();
    let h = mad::Repr::parse(&mad::Header::new_checked(&m[..24]).unwrap()).unwrap();
    assert_eq!(
        (h.attribute_id, h.transaction_id),
        (mad::CM_REJ, 0x1234_5678)
    );
    assert_eq!(&m[28..32], [0xaa, 0xbb, 0xcc, 0xdd], "remote comm ID");
    assert_eq!(&m[34..36], [0, 8], "reason: invalid service ID");
    let udp = icrc::udp_header(from.port(), 4791, (8 + n) as u16);
    let id = icrc::solve_ipv4_identification(&pseudo(to.ip().octets(), peer, n), &udp, &got[..n]);
    assert_eq!(id.unwrap(), Some(0), "the REJ's ICRC");
}

/// Runs `accept` on a thread of its own; its result comes on the channel.
pub fn in_background(
    accept: impl FnOnce() -> Result<(), String> + Send + 'static,
) -> std::sync::mpsc::Receiver<Result<(), String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(accept());
    });
    rx
}

/// Moves `qp` to ERR while an accept for it waits (`accepted` brings its
/// result): the accept ends, saying why.
pub fn err_ends_the_waiting_accept(
    qp: &Qp,
    accepted: &std::sync::mpsc::Receiver<Result<(), String>>,
) {
    std::thread::sleep(Duration::from_millis(50));
    let err = QpAttr {
        state: Some(QpState::Err),
        ..QpAttr::default()
    };
    qp.modify(&err, None).unwrap();
    let e = accepted
        .recv_timeout(T)
        .expect("the accept returned")
        .unwrap_err();
    assert!(e.contains("moved to ERR"), "{e}");
}

/// `modify` with only `qp_access_flags` on `qp`, an iWARP or shm QP in
/// `now`: taken in the QP's state (named or not), shown by `query`; with
/// any other attribute, a move to ERR or a wrong current state, refused
/// and nothing changed. Ends with `access` set.
pub fn access_flags_modify(qp: &Qp, now: QpState, access: Access) {
    let before = qp.query().access.expect("the QP's access flags");
    for refused in [
        QpAttr {
            access: Some(access),
            path_mtu: Some(Mtu::Mtu1024),
            ..QpAttr::default()
        },
        QpAttr {
            state: Some(QpState::Err),
            access: Some(access),
            ..QpAttr::default()
        },
    ] {
        let e = qp.modify(&refused, None).unwrap_err();
        assert!(e.to_string().contains("takes only qp_access_flags"), "{e}");
    }
    let wrong_now = QpAttr {
        access: Some(access),
        cur_state: Some(QpState::Sqd),
        ..QpAttr::default()
    };
    let e = qp.modify(&wrong_now, None).unwrap_err();
    assert!(e.to_string().contains("not SQD"), "{e}");
    let q = qp.query();
    assert_eq!((q.state, q.access), (Some(now), Some(before)));
    // As `ibv_modify_qp(IBV_QP_ACCESS_FLAGS)`: no state given.
    let none = QpAttr {
        access: Some(Access::NONE),
        ..QpAttr::default()
    };
    qp.modify(&none, None).unwrap();
    assert_eq!(qp.query().access, Some(Access::NONE));
    let named = QpAttr {
        state: Some(now),
        cur_state: Some(now),
        access: Some(access),
        ..QpAttr::default()
    };
    qp.modify(&named, None).unwrap();
    let q = qp.query();
    assert_eq!((q.state, q.access), (Some(now), Some(access)));
}
