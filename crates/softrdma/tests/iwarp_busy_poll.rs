//! iWARP busy-poll mode: the receiving thread spins on its socket only for
//! a bounded time, so an idle connection costs no CPU. A file of its own:
//! the CPU time of this process's iWARP threads is measured, and no other
//! test's connections may run meanwhile.

use std::time::Duration;

use softrdma::cm::mpa::MpaConfig;
use softrdma::verbs::*;

mod common;
use common::{iwarp_pair, one, threads_cpu};

#[test]
fn an_idle_busy_polling_connection_sleeps() {
    let (a, b) = iwarp_pair(MpaConfig::default(), |_| {});
    a.ctx.set_busy_poll(true);
    b.ctx.set_busy_poll(true);
    // Traffic both ways, so that both receiving threads have spun.
    for (from, to) in [(&a, &b), (&b, &a)] {
        from.mr.write(0, b"busy").unwrap();
        from.qp
            .post_send(SendWr::new(
                1,
                SendOp::Write {
                    remote_addr: to.mr.addr() + 4096,
                    rkey: to.mr.rkey(),
                },
                vec![from.mr.sge(0, 4)],
            ))
            .unwrap();
        assert_eq!(one(&from.scq).status, WcStatus::Success);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(to.mr.read_vec(4096, 4).unwrap(), b"busy");
    }
    // Idle now: two threads spinning for this long would take 100 ticks.
    std::thread::sleep(Duration::from_millis(100));
    let before = threads_cpu("softrdma-iwarp");
    std::thread::sleep(Duration::from_millis(500));
    let used = threads_cpu("softrdma-iwarp") - before;
    assert!(used <= 5, "idle iWARP threads used {used} ticks in 500 ms");
}
