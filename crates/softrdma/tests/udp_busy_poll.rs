//! A progress thread that spins on its sockets (busy-poll mode with no
//! application thread relieving it; blocking mode within a stream) does so
//! only for a bounded time after the last datagram, so an idle device costs
//! no CPU. A file of its own: the CPU
//! time of this process's progress threads is measured, and no other test's
//! devices may run meanwhile.

use std::time::Duration;

use softrdma::cm::{self, RcOptions};
use softrdma::verbs::*;

mod common;
use common::{T, roce_end, threads_cpu};

/// Two connected devices (`busy`: in busy-poll mode) stream WRITEs both
/// ways, the targets never polling, then idle: their progress threads must
/// go to sleep.
fn stream_then_idle(busy: bool, writes: u64) {
    let end = || roce_end(Device::udp("127.0.0.1:0".parse().unwrap()).busy_poll(busy));
    let (a, b) = (end(), end());
    cm::connect(&a.qp, &a.info, &b.info, &RcOptions::default()).unwrap();
    cm::connect(&b.qp, &b.info, &a.info, &RcOptions::default()).unwrap();
    // Traffic both ways, the targets never polling: their progress threads
    // receive, and spin after it (busy-poll mode; in blocking mode, while
    // the stream's datagrams keep coming).
    for (from, to) in [(&a, &b), (&b, &a)] {
        let data: Vec<u8> = (0..262_144u32).map(|i| (i * 31 + 7) as u8).collect();
        from.mr.write(0, &data).unwrap();
        for k in 0..writes {
            from.qp
                .post_send(SendWr::new(
                    k,
                    SendOp::Write {
                        remote_addr: to.info.va + (k % 4) * 65536,
                        rkey: to.info.rkey,
                    },
                    [from.mr.sge((k % 4) as usize * 65536, 65536)],
                ))
                .unwrap();
        }
        for k in 0..writes {
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
        "idle progress threads (busy-poll {busy}) used {used} ticks in 500 ms"
    );
}

#[test]
fn an_idle_device_sleeps_after_a_stream() {
    // One test: the ticks counted are every progress thread's of this
    // process. Blocking mode spins within a stream (see STREAM_GAP_NS).
    stream_then_idle(true, 4);
    stream_then_idle(false, 64);
}
