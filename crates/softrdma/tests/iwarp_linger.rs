//! An iWARP connection that fails on this side ends its half of the stream
//! (after a Terminate, if one is due) and reads on for the peer to close;
//! a peer that never closes has its connection ended a second later, so it
//! can't keep the QP's threads and socket for the QP's whole life. A file
//! of its own: the process's iWARP threads are counted.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use softrdma::cm::iwarp::Listener;
use softrdma::cm::mpa::{self, Decision, MpaConfig};
use softrdma::wire::mpa::Crc32c;

mod common;

/// The process's threads named `prefix…`.
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter(|t| {
            let dir = t.as_ref().unwrap().path();
            std::fs::read_to_string(dir.join("comm"))
                .unwrap_or_default()
                .starts_with(prefix)
        })
        .count()
}

#[test]
fn a_peer_that_never_closes_has_the_failed_connection_ended() {
    // The QP's receive and transmit threads ("softrdma-iwarp-rx"/"-tx",
    // cut to 15 bytes by the kernel).
    const THREADS: &str = "softrdma-iwarp-";
    let server = common::iwarp_end([127, 0, 0, 5]);
    let listener = Listener::bind(&server.ctx, 0).unwrap();
    let at = listener.local_addr();
    let accepting = std::thread::spawn(move || {
        listener
            .accept(&server.qp, &MpaConfig::default(), |_| Decision::Accept)
            .unwrap();
        server
    });
    let mut peer = TcpStream::connect(at).unwrap();
    mpa::connect(&mut peer, &MpaConfig::default()).unwrap();
    let server = accepting.join().unwrap();
    // (A thread names itself once it runs.)
    let t = Instant::now();
    while threads_named(THREADS) < 2 {
        assert!(t.elapsed() < common::T, "the QP's threads never ran");
        std::thread::sleep(Duration::from_millis(1));
    }
    // An RDMA WRITE to an STag the server never gave out: the server's QP
    // sends a Terminate and ends its half of the stream.
    let mut fpdu = vec![0u8, 18]; // MPA: the ULPDU's length
    fpdu.extend_from_slice(&[0xc1, 0x40]); // DDP tagged, last; RDMAP WRITE
    fpdu.extend_from_slice(&0x0bad_0bad_u32.to_be_bytes()); // STag
    fpdu.extend_from_slice(&0u64.to_be_bytes()); // tagged offset
    fpdu.extend_from_slice(b"data");
    let mut crc = Crc32c::new();
    crc.update(&fpdu);
    fpdu.extend_from_slice(&crc.finish().to_le_bytes());
    peer.write_all(&fpdu).unwrap();
    peer.set_read_timeout(Some(common::T)).unwrap();
    let mut terminate = vec![];
    peer.read_to_end(&mut terminate)
        .expect("the server ends its half of the stream");
    // An FPDU came before the end: the Terminate (RDMAP opcode 7).
    assert!(
        terminate.len() > 4 && terminate[3] & 0x0f == 7,
        "{terminate:x?}"
    );
    common::wait_state(&server.qp, softrdma::verbs::QpState::Err);
    // The peer keeps its half open; the server's threads end within about
    // a second all the same.
    let t = Instant::now();
    while threads_named(THREADS) > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the failed connection's threads still run"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        t.elapsed() >= Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    drop(peer);
}
