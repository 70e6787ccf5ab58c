//! The asynchronous face: a CQ's completions awaited on tokio (`AsyncCq`),
//! on every provider, through busy-poll mode and a CQ overrun.

use std::future::poll_fn;
use std::pin::Pin;
use std::time::Duration;

use futures_core::Stream;
use softrdma::cm::RcOptions;
use softrdma::verbs::*;

mod common;
use common::{End, T};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .unwrap()
}

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 256,
        max_recv_wr: 256,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    }
}

/// Two connected RoCEv2 ends on 127.0.0.1.
fn roce_pair() -> (End, End) {
    let dev = || Device::udp("127.0.0.1:0".parse().unwrap());
    let (a, b) = (
        End::new(dev(), 1 << 16, 256, caps()),
        End::new(dev(), 1 << 16, 256, caps()),
    );
    common::connect_rc(&a.qp, &b.qp, None, &RcOptions::default());
    (a, b)
}

/// `n` SENDs from `from` (on a thread of its own, after a pause, so that the
/// receiver waits first) land as `n` receive completions awaited on `to`'s
/// receive CQ, in order; through the `Stream` impl when `stream`.
fn sends_are_awaited(from: End, to: End, n: u64, stream: bool) {
    for k in 0..n {
        to.qp
            .post_recv(RecvWr::new(k, [to.mr.sge(64 * k as usize, 64)]))
            .unwrap();
    }
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        for k in 0..n {
            from.qp
                .post_send(SendWr::new(k, SendOp::Send, [from.mr.sge(0, 8)]))
                .unwrap();
            assert_eq!(common::one(&from.scq).status, WcStatus::Success);
        }
        from
    });
    let rt = runtime();
    let got = rt.block_on(async {
        let mut cq = AsyncCq::new(to.rcq.clone()).unwrap();
        let mut got = vec![];
        while got.len() < n as usize {
            let wc = if stream {
                poll_fn(|cx| Pin::new(&mut cq).poll_next(cx)).await
            } else {
                cq.next().await
            };
            got.push(wc.expect("the stream goes on").unwrap());
        }
        got
    });
    let _from = sender.join().unwrap();
    assert_eq!(
        got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        (0..n).map(|k| (k, WcStatus::Success)).collect::<Vec<_>>()
    );
}

#[test]
fn completions_are_awaited_on_roce() {
    let (a, b) = roce_pair();
    sends_are_awaited(a, b, 200, false);
}

#[test]
fn completions_stream_on_roce_in_busy_poll_mode() {
    let (a, b) = roce_pair();
    a.ctx.set_busy_poll(true);
    b.ctx.set_busy_poll(true);
    sends_are_awaited(a, b, 50, true);
}

#[test]
fn completions_are_awaited_on_iwarp_and_shm() {
    let (client, server) = common::iwarp_pair(Default::default(), |_| {});
    sends_are_awaited(client, server, 50, false);
    let name = format!("async-{}", std::process::id());
    let dev = || Device::shm();
    let server = End::new(dev(), 1 << 16, 256, caps());
    let listener = softrdma::cm::shm::Listener::bind(&server.ctx, &name).unwrap();
    let accepting = std::thread::spawn(move || {
        listener.accept(&server.qp).unwrap();
        server
    });
    let client = End::new(dev(), 1 << 16, 256, caps());
    softrdma::cm::shm::connect(&client.qp, &name).unwrap();
    sends_are_awaited(client, accepting.join().unwrap(), 50, true);
}

/// Nothing completes: the await does not end; a completion later ends it.
/// An overrun CQ yields what it held, then the error, then ends.
#[test]
fn an_await_ends_with_a_completion_and_the_stream_with_an_overrun() {
    let (a, b) = roce_pair();
    let rt = runtime();
    rt.block_on(async {
        let mut cq = AsyncCq::new(a.scq.clone()).unwrap();
        let quiet = tokio::time::timeout(Duration::from_millis(200), cq.next()).await;
        assert!(quiet.is_err(), "{quiet:?}");
        let write = SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey: b.mr.rkey(),
        };
        a.qp.post_send(SendWr::new(7, write, [a.mr.sge(0, 8)]))
            .unwrap();
        let wc = tokio::time::timeout(T, cq.next()).await.unwrap();
        let wc = wc.expect("the stream goes on").unwrap();
        assert_eq!((wc.wr_id, wc.status), (7, WcStatus::Success));
    });
    // Two completions into a CQ of one.
    let c = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    let pd = c.alloc_pd().unwrap();
    let mr = pd.register(64, Access::ALL).unwrap();
    let small = c.create_cq(1).unwrap();
    let other = c.create_cq(4).unwrap();
    let x = pd.create_qp(&QpInit::rc(&small, &small)).unwrap();
    let y = pd.create_qp(&QpInit::rc(&other, &other)).unwrap();
    common::connect_rc(&x, &y, Some(&mr), &RcOptions::default());
    for k in 0..2 {
        let write = SendOp::Write {
            remote_addr: mr.addr(),
            rkey: mr.rkey(),
        };
        x.post_send(SendWr::new(k, write, [mr.sge(8, 8)])).unwrap();
    }
    common::wait_event(&c, AsyncEvent::CqError { cq: small.id() });
    rt.block_on(async {
        let mut cq = AsyncCq::new(small).unwrap();
        let first = tokio::time::timeout(T, cq.next()).await.unwrap();
        assert_eq!(first.unwrap().unwrap().wr_id, 0);
        let second = tokio::time::timeout(T, cq.next()).await.unwrap();
        assert!(
            matches!(second, Some(Err(CqError::Overrun(_)))),
            "{second:?}"
        );
        assert!(cq.next().await.is_none());
    });
}

/// A CQ that always has a completion ready still lets the runtime's other
/// tasks run (tokio's task budget); two `AsyncCq`s of clones of one CQ live
/// side by side in one runtime.
#[test]
fn a_busy_cq_does_not_starve_other_tasks() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let (a, b) = roce_pair();
    const N: usize = 500;
    let c = a.ctx.create_cq(N).unwrap();
    let deep = QpCaps {
        max_send_wr: N as u32,
        max_recv_wr: N as u32,
        ..caps()
    };
    let qp = a.pd.create_qp(&QpInit::rc(&c, &c).caps(deep)).unwrap();
    let rcq = b.ctx.create_cq(N).unwrap();
    let peer = b.pd.create_qp(&QpInit::rc(&rcq, &rcq).caps(deep)).unwrap();
    common::connect_rc(&qp, &peer, None, &RcOptions::default());
    for k in 0..N as u64 {
        peer.post_recv(RecvWr::new(k, [b.mr.sge(0, 8)])).unwrap();
        qp.post_send(SendWr::new(k, SendOp::Send, [a.mr.sge(0, 8)]))
            .unwrap();
    }
    // All arrived; their ACKs a moment later: every send completion waits
    // in `c` before the runtime starts.
    assert_eq!(rcq.wait_for(N, T).unwrap().len(), N);
    std::thread::sleep(Duration::from_millis(200));
    let rt = runtime();
    let seen_at = rt.block_on(async {
        let mut cq = AsyncCq::new(c.clone()).unwrap();
        let _beside = AsyncCq::new(c.clone()).expect("a second one of the same CQ");
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        tokio::spawn(async move { r.store(true, Ordering::SeqCst) });
        let mut seen_at = None;
        for k in 0..N {
            cq.next().await.unwrap().unwrap();
            if seen_at.is_none() && ran.load(Ordering::SeqCst) {
                seen_at = Some(k);
            }
        }
        seen_at
    });
    assert!(seen_at.is_some_and(|k| k < N / 2), "{seen_at:?}");
}
