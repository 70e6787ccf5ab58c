//! RoCEv2 busy-poll mode: a progress thread that no application thread
//! relieves spins on its sockets only for a bounded time after the last
//! datagram, so an idle device costs no CPU. A file of its own: the CPU
//! time of this process's progress threads is measured, and no other test's
//! devices may run meanwhile.

use std::time::Duration;

use softrdma::cm::{self, RcOptions};
use softrdma::verbs::*;

mod common;
use common::{T, roce_end, threads_cpu};

#[test]
fn an_idle_busy_polling_device_sleeps() {
    let end = || roce_end(Device::udp("127.0.0.1:0".parse().unwrap()).busy_poll(true));
    let (a, b) = (end(), end());
    cm::connect(&a.qp, &a.info, &b.info, &RcOptions::default()).unwrap();
    cm::connect(&b.qp, &b.info, &a.info, &RcOptions::default()).unwrap();
    // Traffic both ways, the targets never polling: their progress threads
    // receive, and spin after it.
    for (from, to) in [(&a, &b), (&b, &a)] {
        let data: Vec<u8> = (0..262_144u32).map(|i| (i * 31 + 7) as u8).collect();
        from.mr.write(0, &data).unwrap();
        for k in 0..4u64 {
            from.qp
                .post_send(SendWr::new(
                    k,
                    SendOp::Write {
                        remote_addr: to.info.va + k * 65536,
                        rkey: to.info.rkey,
                    },
                    [from.mr.sge(k as usize * 65536, 65536)],
                ))
                .unwrap();
        }
        for k in 0..4u64 {
            let wc = from.cq.wait(T).unwrap().expect("a completion");
            assert_eq!((wc.wr_id, wc.status), (k, WcStatus::Success));
        }
        assert_eq!(to.mr.read_vec(0, data.len()).unwrap(), data);
    }
    // Idle now: two threads spinning for this long would take 100 ticks.
    // (Progress threads are named after their device's address.)
    std::thread::sleep(Duration::from_millis(100));
    let before = threads_cpu("softrdma-127.");
    std::thread::sleep(Duration::from_millis(500));
    let used = threads_cpu("softrdma-127.") - before;
    assert!(
        used <= 5,
        "idle progress threads used {used} ticks in 500 ms"
    );
}
