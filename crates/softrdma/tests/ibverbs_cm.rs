//! rdma_cm on a libibverbs device (through librdmacm): the same `cm::roce`
//! and `cm::iwarp` calls as on softrdma's own devices. The ignored tests need
//! a device, RoCE (rxe0) or iWARP (siw0):
//! `SOFTRDMA_IBVERBS_DEV=siw0 cargo test --test ibverbs_cm -- --ignored`.
//! `tests/interop/run.py` runs them in its guests on rxe0 and on siw0.

mod common;

use std::net::SocketAddrV4;
use std::time::Duration;

use common::{T, one, wait_state};
use softrdma::cm::mpa::{Decision, MpaConfig, MpaError};
use softrdma::cm::{RcOptions, iwarp, roce};
use softrdma::verbs::*;

fn open() -> Context {
    let name = std::env::var("SOFTRDMA_IBVERBS_DEV")
        .expect("set SOFTRDMA_IBVERBS_DEV to a libibverbs device (rxe0, siw0) to run these");
    Device::ibverbs(&name).open().unwrap()
}

/// One side: a region, a CQ and an RC QP in INIT (receives may be posted).
struct Side {
    mr: Mr,
    cq: Cq,
    qp: Qp,
    _pd: Pd,
}

fn side(ctx: &Context) -> Side {
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(64 * 1024, Access::ALL).unwrap();
    let cq = ctx.create_cq(64).unwrap();
    // siw takes less inline data than the default asks for.
    let caps = QpCaps {
        max_inline_data: 64,
        ..QpCaps::default()
    };
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq).caps(caps)).unwrap();
    qp.modify(
        &QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(Access::REMOTE_WRITE | Access::REMOTE_READ),
            ..QpAttr::default()
        },
        None,
    )
    .unwrap();
    Side {
        mr,
        cq,
        qp,
        _pd: pd,
    }
}

/// The client's READ depths on RoCE: it issues 1 and serves 16.
fn client_depths() -> RcOptions {
    RcOptions {
        max_rd_atomic: 1,
        max_dest_rd_atomic: 16,
        ..RcOptions::default()
    }
}

/// The listener's: it would issue 2 and serve 4. Cut to the client's offer,
/// it serves 1 and issues 2, and the client's QP follows the REP.
fn listener_depths() -> RcOptions {
    RcOptions {
        max_rd_atomic: 2,
        max_dest_rd_atomic: 4,
        ..RcOptions::default()
    }
}

/// The listener of either kind, on `ctx`'s address.
enum Listening {
    Roce(roce::Listener),
    Iwarp(iwarp::Listener),
}

impl Listening {
    fn bind(ctx: &Context) -> (Listening, SocketAddrV4) {
        let ip = *ctx.local_addr().ip();
        if ctx.is_iwarp() {
            let l = iwarp::Listener::bind(ctx, 0).unwrap();
            let at = l.local_addr();
            (Listening::Iwarp(l), at)
        } else {
            let l = roce::Listener::bind(ctx, 0).unwrap();
            let at = SocketAddrV4::new(ip, l.port());
            (Listening::Roce(l), at)
        }
    }

    /// Accepts with `reply`, or rejects with it when `reject`; the peer's
    /// private data.
    fn accept(&self, qp: &Qp, reply: &[u8], reject: bool) -> Result<Vec<u8>, String> {
        match self {
            Listening::Roce(l) => {
                let mut seen = Vec::new();
                l.accept(
                    qp,
                    &listener_depths(),
                    |r| {
                        seen = r.private_data.clone();
                        if reject {
                            roce::Decision::Reject(reply.to_vec())
                        } else {
                            roce::Decision::Accept(reply.to_vec())
                        }
                    },
                    Some(T),
                )
                .map(|c| {
                    assert_eq!((c.initiator_depth, c.responder_resources), (2, 1));
                    seen
                })
                .map_err(|e| e.to_string())
            }
            Listening::Iwarp(l) => {
                let cfg = MpaConfig {
                    private_data: reply.to_vec(),
                    ird: 4,
                    ord: 4,
                    ..MpaConfig::default()
                };
                let mut seen = Vec::new();
                l.accept_timeout(
                    qp,
                    &cfg,
                    |r| {
                        seen = r.private_data.clone();
                        if reject {
                            Decision::Reject(reply.to_vec())
                        } else {
                            Decision::Accept
                        }
                    },
                    T,
                )
                .map(|_| seen)
                .map_err(|e| e.to_string())
            }
        }
    }
}

/// Connects `qp` to `to` with `pd`: the peer's private data, or the error
/// (Rejected carries the peer's).
fn connect(qp: &Qp, to: SocketAddrV4, pd: &[u8]) -> Result<Vec<u8>, Refusal> {
    if qp.context().is_iwarp() {
        let cfg = MpaConfig {
            private_data: pd.to_vec(),
            ird: 4,
            ord: 4,
            ..MpaConfig::default()
        };
        match iwarp::connect(qp, to, &cfg) {
            Ok(out) => {
                assert!(out.through_kernel);
                Ok(out.peer_private_data)
            }
            Err(iwarp::ConnectError::Mpa(MpaError::Rejected { private_data })) => {
                Err(Refusal::Rejected(private_data))
            }
            Err(iwarp::ConnectError::Tcp { source, .. })
                if source.kind() == std::io::ErrorKind::ConnectionRefused =>
            {
                Err(Refusal::NothingListens)
            }
            Err(e) => Err(Refusal::Other(e.to_string())),
        }
    } else {
        match roce::connect(qp, to, pd, &client_depths()) {
            Ok(c) => {
                // What the client's QP took from the REP.
                assert_eq!((c.initiator_depth, c.responder_resources), (1, 2));
                Ok(c.private_data)
            }
            // IBTA's reason 8: no listener for the service ID.
            Err(roce::ConnectError::Rejected { reason: 8, .. }) => Err(Refusal::NothingListens),
            Err(roce::ConnectError::Rejected { private_data, .. }) => {
                Err(Refusal::Rejected(private_data))
            }
            Err(e) => Err(Refusal::Other(e.to_string())),
        }
    }
}

#[derive(Debug)]
enum Refusal {
    Rejected(Vec<u8>),
    NothingListens,
    Other(String),
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn rdma_cm_connects_qps_that_then_write_read_and_send() {
    let ctx = open();
    let (listener, at) = Listening::bind(&ctx);
    let (a, b) = (side(&ctx), side(&ctx));
    b.qp.post_recv(RecvWr::new(7, [b.mr.sge(32768, 4096)]))
        .unwrap();
    std::thread::scope(|s| {
        let server = s.spawn(|| listener.accept(&b.qp, b"from the server", false));
        let got = connect(&a.qp, at, b"from the client").unwrap();
        let seen = server.join().unwrap().unwrap();
        assert!(seen.starts_with(b"from the client"), "{seen:?}");
        assert!(got.starts_with(b"from the server"), "{got:?}");
    });
    wait_state(&a.qp, QpState::Rts);
    wait_state(&b.qp, QpState::Rts);
    if !ctx.is_iwarp() {
        // The READ depths the REP announced, on both QPs.
        let (qa, qb) = (a.qp.query(), b.qp.query());
        assert_eq!(
            (qb.max_dest_rd_atomic, qb.max_rd_atomic),
            (Some(1), Some(2))
        );
        assert_eq!(
            (qa.max_rd_atomic, qa.max_dest_rd_atomic),
            (Some(1), Some(2))
        );
    }
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 5) as u8).collect();
    a.mr.write(0, &data).unwrap();
    // WRITE into b, READ it back into a's second page, SEND it to b's receive.
    a.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey: b.mr.rkey(),
        },
        [a.mr.sge(0, 4096)],
    ))
    .unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    assert_eq!(b.mr.read_vec(0, 4096).unwrap(), data);
    a.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            remote_addr: b.mr.addr(),
            rkey: b.mr.rkey(),
        },
        [a.mr.sge(4096, 4096)],
    ))
    .unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    assert_eq!(a.mr.read_vec(4096, 4096).unwrap(), data);
    a.qp.post_send(SendWr::new(3, SendOp::Send, [a.mr.sge(4096, 4096)]))
        .unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    let wc = one(&b.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (7, WcStatus::Success, 4096)
    );
    assert_eq!(b.mr.read_vec(32768, 4096).unwrap(), data);
    // A receive left posted is flushed once the peer disconnects.
    b.qp.post_recv(RecvWr::new(8, [b.mr.sge(32768, 64)]))
        .unwrap();
    if ctx.is_iwarp() {
        a.qp.modify(
            &QpAttr {
                state: Some(QpState::Err),
                ..QpAttr::default()
            },
            None,
        )
        .unwrap();
    } else {
        roce::disconnect(&a.qp).unwrap();
    }
    let wc = b.cq.wait(T).unwrap().expect("the receive flushed");
    assert_eq!((wc.wr_id, wc.status), (8, WcStatus::WrFlushErr));
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn a_port_nothing_listens_on_is_refused() {
    let ctx = open();
    let a = side(&ctx);
    // A listener's port, free again once it is gone.
    let at = {
        let (_l, at) = Listening::bind(&ctx);
        at
    };
    std::thread::sleep(Duration::from_millis(100));
    match connect(&a.qp, at, b"") {
        Err(Refusal::NothingListens) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn an_application_rejects_with_private_data() {
    let ctx = open();
    let (listener, at) = Listening::bind(&ctx);
    let (a, b) = (side(&ctx), side(&ctx));
    std::thread::scope(|s| {
        let server = s.spawn(|| listener.accept(&b.qp, b"go away", true));
        match connect(&a.qp, at, b"let me in") {
            Err(Refusal::Rejected(pd)) => assert!(pd.starts_with(b"go away"), "{pd:?}"),
            other => panic!("{other:?}"),
        }
        let e = server.join().unwrap().unwrap_err();
        assert!(e.contains("reject"), "{e}");
    });
    // On RoCE the rejected QP may try again (it is in INIT); siw keeps an
    // iWARP QP's failed attempt, so there it says so, and a new QP tries.
    let again = side(&ctx);
    let a = if ctx.is_iwarp() {
        match connect(&a.qp, at, b"") {
            Err(Refusal::Other(e)) => assert!(e.contains("connected before"), "{e}"),
            other => panic!("{other:?}"),
        }
        &again
    } else {
        &a
    };
    let (listener, at) = Listening::bind(&ctx);
    std::thread::scope(|s| {
        let server = s.spawn(|| listener.accept(&b.qp, b"", false));
        connect(&a.qp, at, b"").unwrap();
        server.join().unwrap().unwrap();
    });
}

#[test]
#[ignore = "needs an RDMA device (SOFTRDMA_IBVERBS_DEV); run by tests/interop/run.py"]
fn a_connected_qp_is_not_connected_again() {
    let ctx = open();
    let (listener, at) = Listening::bind(&ctx);
    let (a, b) = (side(&ctx), side(&ctx));
    std::thread::scope(|s| {
        let server = s.spawn(|| listener.accept(&b.qp, b"", false));
        connect(&a.qp, at, b"").unwrap();
        server.join().unwrap().unwrap();
    });
    match connect(&a.qp, at, b"") {
        Err(Refusal::Other(e)) => assert!(e.contains("connected before"), "{e}"),
        other => panic!("{other:?}"),
    }
}
