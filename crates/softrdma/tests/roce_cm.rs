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
