use std::time::{Duration, Instant};

use super::*;
use crate::cm::shm::{Listener, connect};
use crate::verbs::{Device, QpInit};

#[test]
fn a_peer_that_writes_a_wild_completion_count_fails_the_qp_instead_of_looping() {
    let make = || {
        let ctx = Device::shm().open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
        (ctx, pd, cq, qp)
    };
    let (b_ctx, _b_pd, _b_cq, b_qp) = make();
    let name = format!("unit-{}-wild", std::process::id());
    let l = Listener::bind(&b_ctx, &name).unwrap();
    let (_a_ctx, _a_pd, _a_cq, a_qp) = make();
    std::thread::scope(|s| {
        let t = s.spawn(|| l.accept(&b_qp).unwrap());
        connect(&a_qp, &name).unwrap();
        t.join().unwrap();
    });
    // a, misbehaving: says it put 2^40 completions on b's ring.
    let a = a_qp.shm_conn().unwrap();
    a.peer.mem.store(CQ_HEAD, 1 << 40);
    a.peer.wake();
    let t = Instant::now();
    while b_qp.state() != QpState::Err {
        assert!(t.elapsed() < Duration::from_secs(5), "b noticed");
        std::thread::sleep(Duration::from_millis(1));
    }
}
