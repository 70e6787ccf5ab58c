//! rdma_cm over RoCEv2 (`cm::roce`) between two softrdma devices on
//! loopback: REQ, REP and RTU, private data each way, rejects, and the
//! DREQ that ends a connection. (Against Linux's rdma_cm on rxe: the
//! interop suite's rping and perftest `-R` cases.)

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use softrdma::cm::RcOptions;
use softrdma::cm::roce::{self, ConnectError, Decision, Listener};
use softrdma::verbs::*;

mod common;

const T: Duration = Duration::from_secs(10);

fn device(ip: [u8; 4]) -> Context {
    Device::udp(SocketAddrV4::new(ip.into(), 4791).into())
        .open()
        .unwrap()
}

struct Side {
    ctx: Context,
    mr: Mr,
    cq: Cq,
    qp: Qp,
}

fn side(ctx: &Context) -> Side {
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(1 << 16, Access::ALL).unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    Side {
        ctx: ctx.clone(),
        mr,
        cq,
        qp,
    }
}

#[test]
fn connect_accept_carry_private_data_and_disconnect() {
    let (a_ctx, b_ctx) = (device([127, 0, 0, 81]), device([127, 0, 0, 82]));
    let listener = Listener::bind(&b_ctx, 7174).unwrap();
    assert!(
        Listener::bind(&b_ctx, 7174)
            .unwrap_err()
            .to_string()
            .contains("listened on already")
    );
    let b = side(&b_ctx);
    // The passive side advertises its region in the REP's private data.
    let advert = [
        b.mr.addr().to_be_bytes(),
        u64::from(b.mr.rkey()).to_be_bytes(),
    ]
    .concat();
    let server = std::thread::spawn(move || {
        let got = listener
            .accept(
                &b.qp,
                &RcOptions::default(),
                |req| {
                    assert_eq!(&req.private_data[..5], b"hello");
                    assert_eq!(*req.from.ip(), std::net::Ipv4Addr::new(127, 0, 0, 81));
                    Decision::Accept(advert)
                },
                Some(T),
            )
            .unwrap();
        (got, b, listener)
    });
    let a = side(&a_ctx);
    let to = SocketAddrV4::new([127, 0, 0, 82].into(), 7174);
    let got = roce::connect(&a.qp, to, b"hello", &RcOptions::default()).unwrap();
    let (served, b, _listener) = server.join().unwrap();
    assert_eq!(got.remote_qpn, b.qp.qpn());
    assert_eq!(served.remote_qpn, a.qp.qpn());
    assert_eq!(&served.private_data[..5], b"hello");
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
    // The connection works: a WRITE to the advertised region, a SEND back.
    let va = u64::from_be_bytes(got.private_data[..8].try_into().unwrap());
    let rkey = u64::from_be_bytes(got.private_data[8..16].try_into().unwrap()) as u32;
    a.mr.write(0, b"written over rdma_cm").unwrap();
    a.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: va + 100,
            rkey,
        },
        [a.mr.sge(0, 20)],
    ))
    .unwrap();
    assert_eq!(a.cq.wait(T).unwrap().unwrap().status, WcStatus::Success);
    assert_eq!(b.mr.read_vec(100, 20).unwrap(), b"written over rdma_cm");
    a.qp.post_recv(RecvWr::new(5, [a.mr.sge(1000, 64)]))
        .unwrap();
    b.mr.write(0, b"and back").unwrap();
    b.qp.post_send(SendWr::new(6, SendOp::Send, [b.mr.sge(0, 8)]))
        .unwrap();
    let mut done = [
        a.cq.wait(T).unwrap().unwrap(),
        b.cq.wait(T).unwrap().unwrap(),
    ];
    done.sort_by_key(|w| w.wr_id);
    assert_eq!(
        done.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(5, WcStatus::Success), (6, WcStatus::Success)]
    );
    assert_eq!(a.mr.read_vec(1000, 8).unwrap(), b"and back");
    // The active side disconnects: the passive side's QP goes to ERR (the
    // DREQ), and both flush what they had posted.
    b.qp.post_recv(RecvWr::new(7, [b.mr.sge(0, 64)])).unwrap();
    roce::disconnect(&a.qp).unwrap();
    assert_eq!(a.qp.state(), QpState::Err);
    common::wait_state(&b.qp, QpState::Err);
    let wc = b.cq.wait(T).unwrap().unwrap();
    assert_eq!((wc.wr_id, wc.status), (7, WcStatus::WrFlushErr));
    drop(a_ctx);
    drop(b.ctx);
}

#[test]
fn rejects_come_back_at_once() {
    let (a_ctx, b_ctx) = (device([127, 0, 0, 83]), device([127, 0, 0, 84]));
    // Nobody listens on the port: REJ "invalid service ID".
    let a = side(&a_ctx);
    let t = Instant::now();
    let to = SocketAddrV4::new([127, 0, 0, 84].into(), 9999);
    match roce::connect(&a.qp, to, &[], &RcOptions::default()) {
        Err(ConnectError::Rejected { reason: 8, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // The application refuses: REJ "consumer defined" with its data.
    let listener = Listener::bind(&b_ctx, 7175).unwrap();
    let b = side(&b_ctx);
    let server = std::thread::spawn(move || {
        let e = listener
            .accept(
                &b.qp,
                &RcOptions::default(),
                |_| Decision::Reject(b"go away".to_vec()),
                Some(T),
            )
            .unwrap_err();
        assert!(
            matches!(e, ConnectError::Rejected { reason: 28, .. }),
            "{e}"
        );
        b
    });
    let a = side(&a_ctx);
    let to = SocketAddrV4::new([127, 0, 0, 84].into(), 7175);
    match roce::connect(&a.qp, to, &[], &RcOptions::default()) {
        Err(ConnectError::Rejected {
            reason: 28,
            private_data,
        }) => assert_eq!(&private_data[..7], b"go away"),
        other => panic!("{other:?}"),
    }
    let b = server.join().unwrap();
    // Neither QP was brought up.
    assert_eq!(a.qp.state(), QpState::Reset);
    assert_eq!(b.qp.state(), QpState::Reset);
}

#[test]
fn a_dropped_qp_disconnects_and_bad_uses_are_refused() {
    let (a_ctx, b_ctx) = (device([127, 0, 0, 85]), device([127, 0, 0, 86]));
    let listener = Listener::bind(&b_ctx, 7176).unwrap();
    let b = side(&b_ctx);
    let server = std::thread::spawn(move || {
        listener
            .accept(
                &b.qp,
                &RcOptions::default(),
                |_| Decision::Accept(vec![]),
                Some(T),
            )
            .unwrap();
        b
    });
    let a = side(&a_ctx);
    let to = SocketAddrV4::new([127, 0, 0, 86].into(), 7176);
    roce::connect(&a.qp, to, &[], &RcOptions::default()).unwrap();
    let b = server.join().unwrap();
    // A connected QP can't be connected again.
    let e = roce::connect(&a.qp, to, &[], &RcOptions::default()).unwrap_err();
    assert!(e.to_string().contains("must be new"), "{e}");
    drop(a.qp);
    common::wait_state(&b.qp, QpState::Err);
    // No REQ comes: the listener says so when its time is up.
    let listener = Listener::bind(&b_ctx, 7177).unwrap();
    let q = side(&b_ctx);
    let e = listener
        .accept(
            &q.qp,
            &RcOptions::default(),
            |_| Decision::Accept(vec![]),
            Some(Duration::from_millis(300)),
        )
        .unwrap_err();
    assert!(matches!(e, ConnectError::NoClient(_)), "{e}");
    // Too much private data.
    let e = roce::connect(&q.qp, to, &[0; 57], &RcOptions::default()).unwrap_err();
    assert!(e.to_string().contains("at most 56"), "{e}");
    // A UD QP, a device off port 4791, an iWARP device.
    let ud = q
        .ctx
        .alloc_pd()
        .unwrap()
        .create_qp(&QpInit::ud(&q.cq, &q.cq))
        .unwrap();
    let e = roce::connect(&ud, to, &[], &RcOptions::default()).unwrap_err();
    assert!(e.to_string().contains("RC QPs"), "{e}");
    let elsewhere = Device::udp("127.0.0.87:0".parse().unwrap()).open().unwrap();
    let e = Listener::bind(&elsewhere, 7174).unwrap_err();
    assert!(e.to_string().contains("UDP port 4791"), "{e}");
    let iw = Device::iwarp([127, 0, 0, 87].into()).open().unwrap();
    let e = Listener::bind(&iw, 7174).unwrap_err();
    assert!(e.to_string().contains("iWARP"), "{e}");
    drop(a_ctx);
}

/// A peer made of a UDP socket on port 4791 that speaks CM MADs by hand:
/// it can stay silent, repeat itself and send what it likes.
struct RawPeer {
    sock: std::net::UdpSocket,
    ip: [u8; 4],
}

impl RawPeer {
    fn new(ip: [u8; 4]) -> RawPeer {
        let sock = std::net::UdpSocket::bind((std::net::Ipv4Addr::from(ip), 4791)).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        RawPeer { sock, ip }
    }

    fn send(&self, to: [u8; 4], mad: &[u8; 256]) {
        use softrdma::wire::icrc::{self, Ipv4Pseudo};
        use softrdma::wire::{Opcode, Psn, deth, packet};
        let mut r = packet::Repr::new(Opcode::UD_SEND_ONLY, 1, Psn::new(0), mad.len());
        r.deth = Some(deth::Repr {
            qkey: deth::GSI_QKEY,
            src_qp: 1,
        });
        let mut p = vec![0u8; r.buffer_len().unwrap()];
        r.emit(&mut p, mad).unwrap();
        let udp_len = (8 + p.len()) as u16;
        let ip = Ipv4Pseudo::df(self.ip.into(), to.into());
        let udp = icrc::udp_header(4791, 4791, udp_len);
        icrc::fill(&ip.header(udp_len), &udp, &mut p).unwrap();
        self.sock
            .send_to(&p, (std::net::Ipv4Addr::from(to), 4791))
            .unwrap();
    }

    /// The next CM message, within `within`.
    fn recv(&self, within: Duration) -> Option<softrdma::wire::cm::Message> {
        use softrdma::wire::packet;
        self.sock.set_read_timeout(Some(within)).unwrap();
        let mut got = [0u8; 512];
        let (n, _) = self.sock.recv_from(&mut got).ok()?;
        let p = packet::Packet::new_checked(&got[..n]).unwrap();
        softrdma::wire::cm::Message::parse(&p.payload()[..256]).unwrap()
    }
}

fn raw_req(comm_id: u32, port: u16, src: [u8; 4], dst: [u8; 4]) -> [u8; 256] {
    use softrdma::wire::cm;
    let mut pd = [0u8; cm::REQ_PRIVATE_DATA_LEN];
    cm::RdmaCmHeader {
        src_port: 40000,
        src,
        dst,
    }
    .emit(&mut pd);
    let mut m = [0u8; 256];
    cm::Req {
        local_comm_id: comm_id,
        service_id: cm::rdma_cm_service_id(port),
        local_ca_guid: 1,
        local_qpn: 0x77,
        responder_resources: 1,
        initiator_depth: 1,
        remote_cm_response_timeout: 20,
        transport: 0,
        starting_psn: 100,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xffff,
        path_mtu: 3,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        primary: cm::Path {
            local_gid: std::net::Ipv4Addr::from(src).to_ipv6_mapped().octets(),
            remote_gid: std::net::Ipv4Addr::from(dst).to_ipv6_mapped().octets(),
            flow_label: 0,
            traffic_class: 0,
            hop_limit: 64,
            sl: 0,
            local_ack_timeout: 14,
        },
        private_data: pd,
    }
    .emit(0x99, &mut m);
    m
}

/// The passive side sends its REP again until the RTU comes, at once for a
/// repeated REQ; the RTU of another exchange does not count; the peer's
/// DREQ gets its DREP and ends the connection.
#[test]
fn the_passive_side_repeats_its_rep_and_takes_the_dreq() {
    use softrdma::wire::cm::{self, Body, Dreq, Ids};
    let (me, peer_ip) = ([127, 0, 0, 88], [127, 0, 0, 89]);
    let ctx = device(me);
    let listener = Listener::bind(&ctx, 7180).unwrap();
    let b = side(&ctx);
    let peer = RawPeer::new(peer_ip);
    let server = std::thread::spawn(move || {
        let got = listener.accept(
            &b.qp,
            &RcOptions::default(),
            |_| Decision::Accept(b"rep".to_vec()),
            Some(T),
        );
        (got, b, listener)
    });
    let req = raw_req(0x1234, 7180, peer_ip, me);
    peer.send(me, &req);
    let Some(cm::Message {
        body: Body::Rep(rep),
        tid: 0x99,
    }) = peer.recv(Duration::from_secs(5))
    else {
        panic!("a REP")
    };
    assert_eq!(rep.ids.remote, 0x1234);
    assert_eq!(&rep.private_data[..3], b"rep");
    // No RTU: the REP comes again, a second or so later.
    let t = Instant::now();
    let Some(cm::Message {
        body: Body::Rep(again),
        ..
    }) = peer.recv(Duration::from_secs(3))
    else {
        panic!("the REP again")
    };
    assert_eq!(again, rep);
    assert!(
        t.elapsed() > Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    // A repeated REQ gets it at once.
    peer.send(me, &req);
    let t = Instant::now();
    assert!(matches!(
        peer.recv(Duration::from_secs(3)).map(|m| m.body),
        Some(Body::Rep(_))
    ));
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    // The RTU of another exchange is not this one's.
    let mut rtu = [0u8; 256];
    Ids {
        local: 0x9999,
        remote: rep.ids.local,
    }
    .emit_as(cm::RTU, 0x99, &mut rtu);
    peer.send(me, &rtu);
    std::thread::sleep(Duration::from_millis(200));
    assert!(!server.is_finished(), "an RTU with the wrong ID was taken");
    Ids {
        local: 0x1234,
        remote: rep.ids.local,
    }
    .emit_as(cm::RTU, 0x99, &mut rtu);
    peer.send(me, &rtu);
    let (got, b, _listener) = server.join().unwrap();
    let got = got.unwrap();
    assert_eq!(got.remote_qpn, 0x77);
    assert_eq!(b.qp.state(), QpState::Rts);
    // Drain any REP repeats still on their way.
    while peer.recv(Duration::from_millis(100)).is_some() {}
    let mut dreq = [0u8; 256];
    Dreq {
        ids: Ids {
            local: 0x1234,
            remote: rep.ids.local,
        },
        remote_qpn: b.qp.qpn(),
    }
    .emit(0x99, &mut dreq);
    peer.send(me, &dreq);
    assert_eq!(
        peer.recv(Duration::from_secs(3)).map(|m| m.body),
        Some(Body::Drep(Ids {
            local: rep.ids.local,
            remote: 0x1234
        }))
    );
    common::wait_state(&b.qp, QpState::Err);
}

/// The active side sends its REQ again when no answer comes, heeds an MRA
/// (once), answers the REP with an RTU and a repeated REP with the RTU
/// again.
#[test]
fn the_active_side_repeats_its_req_heeds_an_mra_and_repeats_its_rtu() {
    use softrdma::wire::cm::{self, Body, Ids, Mra, Rep};
    let (me, peer_ip) = ([127, 0, 0, 90], [127, 0, 0, 91]);
    let ctx = device(me);
    let a = side(&ctx);
    let peer = RawPeer::new(peer_ip);
    let client = std::thread::spawn(move || {
        let to = SocketAddrV4::new(peer_ip.into(), 7181);
        let got = roce::connect(&a.qp, to, b"req", &RcOptions::default());
        (got, a)
    });
    let Some(cm::Message {
        body: Body::Req(req),
        tid,
    }) = peer.recv(Duration::from_secs(5))
    else {
        panic!("a REQ")
    };
    assert_eq!(cm::rdma_cm_port(req.service_id), Some(7181));
    let t = Instant::now();
    let again = peer.recv(Duration::from_secs(3)).expect("the REQ again");
    assert!(
        t.elapsed() > Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(again.body, Body::Req(req.clone()));
    // "Wait for me" (2^22 × 4 µs: 17 s, cut to the minute's cap but more
    // than the REQ's second): no REQ comes for a while.
    let mut mra = [0u8; 256];
    Mra {
        ids: Ids {
            local: 0x4321,
            remote: req.local_comm_id,
        },
        message_mraed: 0,
        service_timeout: 22,
    }
    .emit(tid, &mut mra);
    peer.send(me, &mra);
    assert!(
        peer.recv(Duration::from_millis(2500)).is_none(),
        "a REQ despite the MRA"
    );
    let mut rep = [0u8; 256];
    let mut pd = [0u8; cm::REP_PRIVATE_DATA_LEN];
    pd[..3].copy_from_slice(b"rep");
    Rep {
        ids: Ids {
            local: 0x4321,
            remote: req.local_comm_id,
        },
        local_qpn: 0x66,
        starting_psn: 200,
        responder_resources: 1,
        initiator_depth: 1,
        target_ack_delay: 15,
        rnr_retry_count: 7,
        srq: false,
        local_ca_guid: 2,
        private_data: pd,
    }
    .emit(tid, &mut rep);
    peer.send(me, &rep);
    let rtu = Body::Rtu(Ids {
        local: req.local_comm_id,
        remote: 0x4321,
    });
    assert_eq!(
        peer.recv(Duration::from_secs(3)).map(|m| m.body),
        Some(rtu.clone())
    );
    let (got, a) = client.join().unwrap();
    let got = got.unwrap();
    assert_eq!(
        (got.remote_qpn, &got.private_data[..3]),
        (0x66, &b"rep"[..])
    );
    assert_eq!(a.qp.state(), QpState::Rts);
    // The RTU was lost, say: the REP again gets it again.
    peer.send(me, &rep);
    assert_eq!(peer.recv(Duration::from_secs(3)).map(|m| m.body), Some(rtu));
    // Dropping the QP says goodbye.
    drop(a);
    assert!(matches!(
        peer.recv(Duration::from_secs(3)).map(|m| m.body),
        Some(Body::Dreq(_))
    ));
}

/// A UD QP, its CQ, PD and a region, as a UD rdma_cm side has them.
struct UdSide {
    pd: Pd,
    mr: Mr,
    cq: Cq,
    qp: Qp,
}

fn ud_side(ctx: &Context) -> UdSide {
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(1 << 16, Access::ALL).unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(&QpInit::ud(&cq, &cq)).unwrap();
    UdSide { pd, mr, cq, qp }
}

/// rdma_cm's UDP port space: SIDR finds the passive side's UD QP and
/// Q_Key, and datagrams flow both ways (the passive side answers the QP its
/// first datagram came from, as udaddy does).
#[test]
fn sidr_finds_a_ud_qp_and_datagrams_flow_both_ways() {
    use softrdma::cm::roce_ud;
    use softrdma::wire::cm::RDMA_CM_UDP_QKEY;
    let (a_ip, b_ip) = ([127, 0, 0, 101], [127, 0, 0, 102]);
    let (a_ctx, b_ctx) = (device(a_ip), device(b_ip));
    let listener = roce_ud::Listener::bind(&b_ctx, 7174).unwrap();
    assert!(
        roce_ud::Listener::bind(&b_ctx, 7174)
            .unwrap_err()
            .to_string()
            .contains("listened on already")
    );
    // The same port of the TCP port space is another service.
    let rc_listener = Listener::bind(&b_ctx, 7174).unwrap();
    let b = ud_side(&b_ctx);
    let server = std::thread::spawn(move || {
        let got = listener
            .accept(
                &b.qp,
                |req| {
                    assert_eq!(&req.private_data[..5], b"hello");
                    assert_eq!(*req.from.ip(), std::net::Ipv4Addr::from(a_ip));
                    Decision::Accept(b"welcome".to_vec())
                },
                Some(T),
            )
            .unwrap();
        (got, b, listener)
    });
    let a = ud_side(&a_ctx);
    let to = SocketAddrV4::new(b_ip.into(), 7174);
    let got = roce_ud::resolve(&a.qp, to, b"hello").unwrap();
    let (request, b, _listener) = server.join().unwrap();
    assert_eq!(&request.private_data[..5], b"hello");
    assert_eq!(
        (got.peer, got.remote_qpn, got.qkey),
        (b_ip.into(), b.qp.qpn(), RDMA_CM_UDP_QKEY)
    );
    assert_eq!(&got.private_data[..7], b"welcome");
    // Both QPs were brought up with rdma_cm's Q_Key.
    for qp in [&a.qp, &b.qp] {
        assert_eq!(qp.state(), QpState::Rts);
        assert_eq!(qp.query().qkey, Some(RDMA_CM_UDP_QKEY));
    }
    b.qp.post_recv(RecvWr::new(1, [b.mr.sge(0, 40 + 64)]))
        .unwrap();
    a.qp.post_recv(RecvWr::new(2, [a.mr.sge(0, 40 + 64)]))
        .unwrap();
    a.mr.write(1000, b"ping").unwrap();
    let ah =
        a.pd.create_ah(AhAttr {
            addr: SocketAddrV4::new(got.peer, 4791),
        })
        .unwrap();
    a.qp.post_send(
        SendWr::new(3, SendOp::Send, [a.mr.sge(1000, 4)]).to(ah.dest(got.remote_qpn, got.qkey)),
    )
    .unwrap();
    assert_eq!(a.cq.wait(T).unwrap().unwrap().wr_id, 3);
    let wc = b.cq.wait(T).unwrap().unwrap();
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (1, WcStatus::Success, 44)
    );
    assert_eq!(wc.src_qp, a.qp.qpn());
    assert_eq!(b.mr.read_vec(40, 4).unwrap(), b"ping");
    let back =
        b.pd.create_ah(AhAttr {
            addr: SocketAddrV4::new(a_ip.into(), 4791),
        })
        .unwrap();
    b.mr.write(1000, b"pong").unwrap();
    b.qp.post_send(
        SendWr::new(4, SendOp::Send, [b.mr.sge(1000, 4)])
            .to(back.dest(wc.src_qp, RDMA_CM_UDP_QKEY)),
    )
    .unwrap();
    assert_eq!(b.cq.wait(T).unwrap().unwrap().wr_id, 4);
    let wc = a.cq.wait(T).unwrap().unwrap();
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    assert_eq!(a.mr.read_vec(40, 4).unwrap(), b"pong");
    drop(rc_listener);
}

/// SIDR's refusals: nothing listens (at once), the application refuses
/// (with its data), an RC QP or a QP in use is refused, and an RC REQ to a
/// UD listener's port finds no listener (another port space).
#[test]
fn sidr_refusals_come_back_at_once() {
    use softrdma::cm::roce_ud;
    let (a_ip, b_ip) = ([127, 0, 0, 103], [127, 0, 0, 104]);
    let (a_ctx, b_ctx) = (device(a_ip), device(b_ip));
    let a = ud_side(&a_ctx);
    let t = Instant::now();
    match roce_ud::resolve(&a.qp, SocketAddrV4::new(b_ip.into(), 9999), &[]) {
        Err(ConnectError::Rejected { reason: 8, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // An RC listener's port is not a UD service.
    let _rc = Listener::bind(&b_ctx, 7176).unwrap();
    match roce_ud::resolve(&a.qp, SocketAddrV4::new(b_ip.into(), 7176), &[]) {
        Err(ConnectError::Rejected { reason: 8, .. }) => {}
        other => panic!("{other:?}"),
    }
    let listener = roce_ud::Listener::bind(&b_ctx, 7177).unwrap();
    let b = ud_side(&b_ctx);
    let server = std::thread::spawn(move || {
        let e = listener
            .accept(&b.qp, |_| Decision::Reject(b"go away".to_vec()), Some(T))
            .unwrap_err();
        assert!(
            matches!(e, ConnectError::Rejected { reason: 28, .. }),
            "{e}"
        );
        (b, listener)
    });
    let to = SocketAddrV4::new(b_ip.into(), 7177);
    match roce_ud::resolve(&a.qp, to, &[]) {
        Err(ConnectError::Rejected {
            reason: 28,
            private_data,
        }) => assert_eq!(&private_data[..7], b"go away"),
        other => panic!("{other:?}"),
    }
    let (_b, listener) = server.join().unwrap();
    // An RC REQ to the same port: nothing listens on it in the TCP port
    // space.
    let rc = side(&a_ctx);
    match roce::connect(&rc.qp, to, &[], &RcOptions::default()) {
        Err(ConnectError::Rejected { reason: 8, .. }) => {}
        other => panic!("{other:?}"),
    }
    // QPs that cannot take part.
    let e = roce_ud::resolve(&rc.qp, to, &[]).unwrap_err();
    assert!(e.to_string().contains("UD QPs"), "{e}");
    let e = roce_ud::resolve(&a.qp, to, &[0; 181]).unwrap_err();
    assert!(e.to_string().contains("180 bytes"), "{e}");
    let used = ud_side(&a_ctx);
    used.qp
        .modify(
            &QpAttr {
                state: Some(QpState::Err),
                ..QpAttr::default()
            },
            None,
        )
        .unwrap();
    let e = roce_ud::resolve(&used.qp, to, &[]).unwrap_err();
    assert!(e.to_string().contains("RESET"), "{e}");
    let e = listener
        .accept(&used.qp, |_| Decision::Accept(vec![]), Some(T))
        .unwrap_err();
    assert!(e.to_string().contains("RESET"), "{e}");
    match listener.accept(
        &ud_side(&b_ctx).qp,
        |_| Decision::Accept(vec![]),
        Some(Duration::from_millis(100)),
    ) {
        Err(ConnectError::NoClient(_)) => {}
        other => panic!("{other:?}"),
    }
    // A QP moved on while its accept waits: the accept gives up.
    let waiting = ud_side(&b_ctx);
    std::thread::scope(|sc| {
        let t = Instant::now();
        let accepting =
            sc.spawn(|| listener.accept(&waiting.qp, |_| Decision::Accept(vec![]), Some(T)));
        std::thread::sleep(Duration::from_millis(200));
        waiting
            .qp
            .modify(
                &QpAttr {
                    state: Some(QpState::Err),
                    ..QpAttr::default()
                },
                None,
            )
            .unwrap();
        let e = accepting.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("moved on"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    });
}

fn raw_sidr_req(request_id: u32, port: u16, src: [u8; 4], dst: [u8; 4]) -> [u8; 256] {
    use softrdma::wire::cm;
    let mut pd = [0u8; cm::SIDR_REQ_PRIVATE_DATA_LEN];
    cm::RdmaCmHeader {
        src_port: 40001,
        src,
        dst,
    }
    .emit(&mut pd);
    let mut m = [0u8; 256];
    cm::SidrReq {
        request_id,
        pkey: 0xffff,
        service_id: cm::rdma_cm_udp_service_id(port),
        private_data: pd,
    }
    .emit(0x77, &mut m);
    m
}

/// The passive side answers a repeated SIDR_REQ with the same SIDR_REP
/// (the first was lost) and takes it only once; the active side asks
/// again when no answer comes, skips a SIDR_REP for another service and
/// refuses one whose Q_Key is not its QP's.
#[test]
fn sidr_requests_are_repeated_and_answered_once() {
    use softrdma::cm::roce_ud;
    use softrdma::wire::cm::{self, Body, SidrRep};
    let (me, peer_ip) = ([127, 0, 0, 105], [127, 0, 0, 106]);
    let ctx = device(me);
    let listener = roce_ud::Listener::bind(&ctx, 7178).unwrap();
    let b = ud_side(&ctx);
    let peer = RawPeer::new(peer_ip);
    let req = raw_sidr_req(0x4242, 7178, peer_ip, me);
    peer.send(me, &req);
    let got = listener
        .accept(&b.qp, |_| Decision::Accept(b"rep".to_vec()), Some(T))
        .unwrap();
    assert_eq!(got.from, SocketAddrV4::new(peer_ip.into(), 40001));
    let Some(cm::Message {
        body: Body::SidrRep(rep),
        tid: 0x77,
    }) = peer.recv(Duration::from_secs(5))
    else {
        panic!("a SIDR_REP")
    };
    assert_eq!(
        (rep.request_id, rep.status, rep.qpn, rep.qkey),
        (0x4242, cm::SIDR_VALID, b.qp.qpn(), cm::RDMA_CM_UDP_QKEY)
    );
    assert_eq!(rep.service_id, cm::rdma_cm_udp_service_id(7178));
    assert_eq!(&rep.private_data[..3], b"rep");
    // Asked again: the same answer, and no second request for the
    // application.
    peer.send(me, &req);
    match peer.recv(Duration::from_secs(3)).map(|m| m.body) {
        Some(Body::SidrRep(again)) => assert_eq!(again, rep),
        other => panic!("{other:?}"),
    }
    match listener.accept(
        &b.qp,
        |_| Decision::Accept(vec![]),
        Some(Duration::from_millis(300)),
    ) {
        Err(ConnectError::NoClient(_)) => {}
        other => panic!("{other:?}"),
    }

    // The active side: the raw peer lets the first SIDR_REQ go unanswered,
    // answers the second for another service, then for this one.
    let a = ud_side(&ctx);
    let client = std::thread::spawn(move || {
        let got = roce_ud::resolve(&a.qp, SocketAddrV4::new(peer_ip.into(), 7179), b"x");
        (got, a)
    });
    let first = peer.recv(Duration::from_secs(3));
    let Some(cm::Message {
        body: Body::SidrReq(sidr),
        tid,
    }) = first
    else {
        panic!("{first:?}")
    };
    assert_eq!(sidr.service_id, cm::rdma_cm_udp_service_id(7179));
    let t = Instant::now();
    let second = peer.recv(Duration::from_secs(3));
    assert!(matches!(
        second.as_ref().map(|m| &m.body),
        Some(Body::SidrReq(again)) if again.request_id == sidr.request_id
    ));
    assert!(
        t.elapsed() > Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    let answer = |sidr: &cm::SidrReq, tid: u64, service_id: u64, qkey: u32| {
        let mut m = [0u8; 256];
        SidrRep {
            service_id,
            ..SidrRep::answer(sidr, cm::SIDR_VALID, 0x66, qkey)
        }
        .emit(tid, &mut m);
        peer.send(me, &m);
    };
    answer(
        &sidr,
        tid,
        cm::rdma_cm_udp_service_id(1),
        cm::RDMA_CM_UDP_QKEY,
    );
    answer(&sidr, tid, sidr.service_id, 9);
    let (got, a) = client.join().unwrap();
    match got {
        Err(ConnectError::Protocol { what, .. }) => assert!(what.contains("Q_Key"), "{what}"),
        other => panic!("{other:?}"),
    }
    // Asked again, answered with rdma_cm's Q_Key: found.
    let client = std::thread::spawn(move || {
        roce_ud::resolve(&a.qp, SocketAddrV4::new(peer_ip.into(), 7179), b"x")
    });
    while let Some(m) = peer.recv(Duration::from_secs(3)) {
        if let Body::SidrReq(r) = m.body
            && r.request_id != sidr.request_id
        {
            answer(&r, m.tid, r.service_id, cm::RDMA_CM_UDP_QKEY);
            break;
        }
    }
    let got = client.join().unwrap().unwrap();
    assert_eq!((got.remote_qpn, got.qkey), (0x66, cm::RDMA_CM_UDP_QKEY));
}
