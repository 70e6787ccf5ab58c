//! RC over real UDP sockets on loopback: two devices in one process.

use std::time::{Duration, Instant};

use softrdma::cm::{self, ConnInfo, RcOptions};
use softrdma::verbs::*;

mod common;
use common::{RoceEnd, roce_end};

const T: Duration = Duration::from_secs(10);

fn end(ip: &str) -> RoceEnd {
    roce_end(Device::udp(format!("{ip}:0").parse().unwrap()))
}

fn pair() -> (RoceEnd, RoceEnd) {
    let a = end("127.0.0.1");
    let b = end("127.0.0.1");
    cm::connect(&a.qp, &a.info, &b.info, &RcOptions::default()).unwrap();
    cm::connect(&b.qp, &b.info, &a.info, &RcOptions::default()).unwrap();
    (a, b)
}

fn one(cq: &Cq) -> WorkCompletion {
    cq.wait(T).unwrap().expect("a completion within 10 s")
}

#[test]
fn every_operation_over_loopback() {
    let (a, b) = pair();
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
    a.mr.write(0, &data).unwrap();
    // SEND/RECV, multi-packet.
    b.qp.post_recv(RecvWr::new(1, [b.mr.sge(0, 100_000)]))
        .unwrap();
    a.qp.post_send(SendWr::new(2, SendOp::Send, vec![a.mr.sge(0, 100_000)]))
        .unwrap();
    let wc = one(&b.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (1, WcStatus::Success, 100_000)
    );
    assert_eq!(b.mr.read_vec(0, 100_000).unwrap(), data);
    assert_eq!(one(&a.cq).wr_id, 2);
    // WRITE then READ it back.
    a.qp.post_send(SendWr::new(
        3,
        SendOp::Write {
            remote_addr: b.info.va + 200_000,
            rkey: b.info.rkey,
        },
        vec![a.mr.sge(0, 65_537)],
    ))
    .unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    assert_eq!(b.mr.read_vec(200_000, 65_537).unwrap(), data[..65_537]);
    a.qp.post_send(SendWr::new(
        4,
        SendOp::Read {
            remote_addr: b.info.va + 200_000,
            rkey: b.info.rkey,
        },
        vec![a.mr.sge(500_000, 65_537)],
    ))
    .unwrap();
    let wc = one(&a.cq);
    assert_eq!(
        (wc.status, wc.opcode, wc.byte_len),
        (WcStatus::Success, WcOpcode::RdmaRead, 65_537)
    );
    assert_eq!(a.mr.read_vec(500_000, 65_537).unwrap(), data[..65_537]);
    // Atomics.
    b.mr.write(800_000, &41u64.to_ne_bytes()).unwrap();
    a.qp.post_send(SendWr::new(
        5,
        SendOp::FetchAdd {
            remote_addr: b.info.va + 800_000,
            rkey: b.info.rkey,
            add: 1,
        },
        vec![a.mr.sge(900_000, 8)],
    ))
    .unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    assert_eq!(a.mr.load_u64(900_000).unwrap(), 41);
    a.qp.post_send(SendWr::new(
        6,
        SendOp::CompareSwap {
            remote_addr: b.info.va + 800_000,
            rkey: b.info.rkey,
            compare: 42,
            swap: 7,
        },
        vec![a.mr.sge(900_008, 8)],
    ))
    .unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    assert_eq!(a.mr.load_u64(900_008).unwrap(), 42);
    assert_eq!(b.mr.load_u64(800_000).unwrap(), 7);
    // WRITE with immediate.
    b.qp.post_recv(RecvWr::new(7, [])).unwrap();
    a.qp.post_send(SendWr::new(
        8,
        SendOp::WriteWithImm {
            remote_addr: b.info.va,
            rkey: b.info.rkey,
            imm: 0xabcd,
        },
        vec![a.mr.sge(0, 10)],
    ))
    .unwrap();
    let wc = one(&b.cq);
    assert_eq!(
        (wc.wr_id, wc.opcode, wc.imm, wc.byte_len),
        (7, WcOpcode::RecvRdmaWithImm, Some(0xabcd), 10)
    );
    assert_eq!(one(&a.cq).wr_id, 8);
    assert_eq!(a.ctx.stats().bad_icrc + b.ctx.stats().bad_icrc, 0);
}

/// Resets `a`'s QP and connects it to `peer` again with this ACK timeout
/// (4.096 us << `timeout`) and retry count.
fn reconnect_with_short_timeout(a: &RoceEnd, peer: &ConnInfo, timeout: u8, retry_cnt: u8) {
    a.qp.modify(
        &QpAttr {
            state: Some(QpState::Reset),
            ..QpAttr::default()
        },
        None,
    )
    .unwrap();
    let o = RcOptions {
        timeout,
        retry_cnt,
        ..RcOptions::default()
    };
    cm::connect(&a.qp, &a.info, peer, &o).unwrap();
}

#[test]
fn a_destroyed_peer_gives_retry_exceeded() {
    let (a, b) = pair();
    reconnect_with_short_timeout(&a, &b.info, 4, 2);
    drop(b);
    a.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: 0,
            rkey: 1,
        },
        vec![a.mr.sge(0, 8)],
    ))
    .unwrap();
    let wc = one(&a.cq);
    assert_eq!(wc.status, WcStatus::RetryExcErr);
    assert_eq!(a.qp.state(), QpState::Err);
}

/// A QP dropped with a WRITE outstanding lets go of the WRITE's region at
/// once, so the caller's buffer comes back from `Mr::deregister`; the
/// progress thread held the QP (and so the region) while it slept, until
/// its next timer or datagram.
#[test]
fn a_dropped_qp_lets_go_of_its_regions_while_the_device_sleeps() {
    let ctx = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let mr = pd
        .register_vec(vec![7u8; 4096], Access::LOCAL_WRITE)
        .unwrap();
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
    // A peer that never answers: the WRITE stays outstanding, its next
    // retransmission seconds away.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let std::net::SocketAddr::V4(addr) = silent.local_addr().unwrap() else {
        unreachable!("IPv4")
    };
    let mine = ConnInfo::local(&qp, None).unwrap();
    let peer = ConnInfo { addr, ..mine };
    let slow = RcOptions {
        timeout: 20,
        ..RcOptions::default()
    };
    cm::connect(&qp, &mine, &peer, &slow).unwrap();
    qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: 0,
            rkey: 1,
        },
        vec![mr.sge(0, 8)],
    ))
    .unwrap();
    // Sent, and the progress thread asleep again.
    let mut got = [0u8; 64];
    silent.recv(&mut got).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(qp);
    let buf = mr.deregister().expect("the buffer given back");
    assert_eq!(buf, vec![7u8; 4096]);
}

/// A destroyed QP takes no packet, even right after it took some (the
/// receiving thread keeps the QPs the last packets were for): a WRITE to it
/// lands nowhere, is counted as for no QP, and its requester gives up.
#[test]
fn a_destroyed_qp_takes_no_more_packets() {
    let (a, b) = pair();
    let b_info = b.info;
    let write = |wr_id: u64, at: u64| {
        SendWr::new(
            wr_id,
            SendOp::Write {
                remote_addr: b_info.va + at,
                rkey: b_info.rkey,
            },
            vec![a.mr.sge(0, 8)],
        )
    };
    a.mr.write(0, &[7; 8]).unwrap();
    a.qp.post_send(write(1, 0)).unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    assert_eq!(b.mr.read_vec(0, 8).unwrap(), [7; 8]);
    // B's receiving thread now holds B's QP among its recent ones.
    let RoceEnd { ctx, mr, qp, .. } = b;
    drop(qp);
    // A short timeout for the WRITE that is to find no QP.
    reconnect_with_short_timeout(&a, &b_info, 8, 1);
    a.qp.post_send(write(2, 64)).unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::RetryExcErr);
    assert_eq!(mr.read_vec(64, 8).unwrap(), [0; 8]);
    let until = Instant::now() + T;
    while ctx.stats().no_qp == 0 {
        assert!(Instant::now() < until, "{:?}", ctx.stats());
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn thousands_of_ping_pongs_lose_no_post() {
    // The poster and the progress thread hand transmission to each other on
    // every message here: a lost hand-off shows as a hang.
    let (a, b) = pair();
    for _ in 0..4 {
        b.qp.post_recv(RecvWr::new(0, [b.mr.sge(0, 64)])).unwrap();
        a.qp.post_recv(RecvWr::new(0, [a.mr.sge(0, 64)])).unwrap();
    }
    for i in 0..3000u64 {
        let (from, to) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        from.qp
            .post_send(SendWr::new(i, SendOp::Send, vec![from.mr.sge(4096, 64)]))
            .unwrap();
        let wcs = [one(&from.cq), one(&to.cq)];
        assert!(
            wcs.iter().all(|w| w.status == WcStatus::Success),
            "{i}: {wcs:?}"
        );
        to.qp.post_recv(RecvWr::new(0, [to.mr.sge(0, 64)])).unwrap();
    }
}

/// As rxe: an RC QP drops packets that do not come from its peer's address,
/// even with a valid ICRC and the expected PSN; its peer's traffic goes on.
#[test]
fn an_rc_qp_ignores_packets_from_another_address() {
    use softrdma::wire::icrc::{self, Ipv4Pseudo};
    use softrdma::wire::{Opcode, Psn, packet};
    let a = end("127.0.0.1");
    let b = end("127.0.0.1");
    cm::connect(&a.qp, &a.info, &b.info, &RcOptions::default()).unwrap();
    cm::connect(&b.qp, &b.info, &a.info, &RcOptions::default()).unwrap();
    for k in 0..2 {
        b.qp.post_recv(RecvWr::new(k, [b.mr.sge(k as usize * 64, 64)]))
            .unwrap();
    }
    // A stranger at 127.0.0.9 sends a SEND Only with the PSN b expects.
    let stranger = std::net::UdpSocket::bind("127.0.0.9:0").unwrap();
    let from = match stranger.local_addr().unwrap() {
        std::net::SocketAddr::V4(s) => s,
        _ => unreachable!(),
    };
    let to = b.ctx.local_addr();
    let r = packet::Repr::new(Opcode::RC_SEND_ONLY, b.qp.qpn(), Psn::new(a.info.psn), 5);
    let mut p = vec![0u8; r.buffer_len().unwrap()];
    r.emit(&mut p, b"forge").unwrap();
    let udp_len = (8 + p.len()) as u16;
    let ip = Ipv4Pseudo::df(*from.ip(), *to.ip()).header(udp_len);
    icrc::fill(
        &ip,
        &icrc::udp_header(from.port(), to.port(), udp_len),
        &mut p,
    )
    .unwrap();
    stranger.send_to(&p, to).unwrap();
    let t = std::time::Instant::now();
    while b.ctx.stats().wrong_source == 0 {
        assert!(t.elapsed() < T, "the stranger's packet was not counted");
        std::thread::sleep(Duration::from_millis(2));
    }
    // The real peer's SEND, with that same PSN, is the one that lands.
    a.mr.write(0, b"peer!").unwrap();
    a.qp.post_send(SendWr::new(1, SendOp::Send, vec![a.mr.sge(0, 5)]))
        .unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    let wc = one(&b.cq);
    assert_eq!(
        (wc.status, wc.wr_id, wc.byte_len),
        (WcStatus::Success, 0, 5)
    );
    assert_eq!(b.mr.read_vec(0, 5).unwrap(), b"peer!");
    assert_eq!(b.cq.poll_one().unwrap(), None, "nothing from the stranger");
}

/// Multi-packet messages leave in UDP GSO sends: in the device's capture
/// every ICRC (over the ID its segment went out with) verifies, and the
/// receiver (with UDP GRO) drops none. (The IDs against the kernel's own
/// headers: `icrcs_hold_over_the_ip_ids_the_kernel_wrote`.)
#[test]
fn multi_packet_messages_go_out_in_gso_sends_whose_icrcs_hold() {
    let pcap = std::env::temp_dir().join(format!("softrdma-gso-{}.pcap", std::process::id()));
    let a = roce_end(Device::udp("127.0.0.1:0".parse().unwrap()).pcap(&pcap));
    let b = end("127.0.0.1");
    cm::connect(&a.qp, &a.info, &b.info, &RcOptions::default()).unwrap();
    cm::connect(&b.qp, &b.info, &a.info, &RcOptions::default()).unwrap();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 13 + i / 4099) as u8).collect();
    a.mr.write(0, &data).unwrap();
    for (id, len) in [(1u64, 300_000u32), (2, 9000), (3, 4096 * 3)] {
        a.qp.post_send(SendWr::new(
            id,
            SendOp::Write {
                remote_addr: b.info.va,
                rkey: b.info.rkey,
            },
            [a.mr.sge(0, len)],
        ))
        .unwrap();
        assert_eq!(one(&a.cq).status, WcStatus::Success);
        assert_eq!(
            b.mr.read_vec(0, len as usize).unwrap(),
            &data[..len as usize]
        );
    }
    let (sent, got) = (a.ctx.stats(), b.ctx.stats());
    assert_eq!(got.bad_icrc, 0);
    assert_eq!(got.received, sent.sent, "every packet arrived once");
    let ports = [a.info.addr.port(), b.info.addr.port()];
    drop(a);
    let file = std::fs::read(&pcap).unwrap();
    let _ = std::fs::remove_file(&pcap);
    let mut decoder = softrdma::capture::Decoder::new();
    for p in ports {
        decoder.add_roce_port(p);
    }
    let mut packets = 0;
    for frame in softrdma::capture::frames(&file).unwrap() {
        decoder.push(&frame.unwrap(), &mut |rec| {
            let softrdma::capture::Record::Roce(r) = rec else {
                panic!("not RoCEv2: {rec:?}");
            };
            assert!(r.icrc.is_ok(), "frame {}: ICRC {:?}", r.frame, r.icrc);
            packets += 1;
        });
    }
    assert_eq!(
        packets,
        sent.sent + sent.received,
        "the capture holds every packet sent and received"
    );
}

/// A connected pair of busy-poll devices, with a long ACK timeout (about
/// 4 s): what completes sooner was not rescued by a retransmission.
fn busy_pair() -> (RoceEnd, RoceEnd) {
    let end = || roce_end(Device::udp("127.0.0.1:0".parse().unwrap()).busy_poll(true));
    let (a, b) = (end(), end());
    let o = RcOptions {
        timeout: 20,
        ..RcOptions::default()
    };
    cm::connect(&a.qp, &a.info, &b.info, &o).unwrap();
    cm::connect(&b.qp, &b.info, &a.info, &o).unwrap();
    (a, b)
}

fn write(from: &RoceEnd, to: &RoceEnd, wr_id: u64, len: u32) {
    from.qp
        .post_send(SendWr::new(
            wr_id,
            SendOp::Write {
                remote_addr: to.info.va,
                rkey: to.info.rkey,
            },
            [from.mr.sge(0, len)],
        ))
        .unwrap();
}

/// `a` WRITEs 64 bytes of `byte` to `b`, whose thread polls until they
/// land (the ACK deferred to its next look); returns when `a` posted.
fn write_polled_by_target(a: &RoceEnd, b: &RoceEnd, byte: u8) -> Instant {
    a.mr.write(0, &[byte; 64]).unwrap();
    let t = Instant::now();
    write(a, b, 1, 64);
    while b.mr.read_vec(0, 64).unwrap() != [byte; 64] {
        b.cq.progress();
        assert!(t.elapsed() < T, "the WRITE never landed");
    }
    t
}

/// Busy-poll mode: the polling threads do the receiving (a ping-pong of
/// WRITEs, each side spinning on its memory as perftest's write_lat), and a
/// target whose application never polls is still served by its progress
/// thread.
#[test]
fn busy_poll_pingpong_and_a_target_that_does_not_poll() {
    let (a, b) = busy_pair();
    for round in 1..=200u8 {
        let (from, to) = if round % 2 == 1 { (&a, &b) } else { (&b, &a) };
        from.mr.write(0, &[round; 8]).unwrap();
        write(from, to, u64::from(round), 8);
        let done = Instant::now() + T;
        while to.mr.read_vec(0, 8).unwrap() != [round; 8] {
            to.cq.progress();
            assert!(
                Instant::now() < done,
                "round {round}: the WRITE never landed"
            );
        }
        let t0 = Instant::now();
        let wc = from
            .cq
            .wait(T)
            .unwrap()
            .unwrap_or_else(|| panic!("round {round}: no completion"));
        // Not rescued by a retransmission (seconds): the ACK the target
        // deferred went out with its next WRITE or from its progress thread.
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "round {round}: {:?}",
            t0.elapsed()
        );
        assert_eq!((wc.wr_id, wc.status), (u64::from(round), WcStatus::Success));
    }
    // b's application goes quiet: within the 10 ms standby its progress
    // thread takes over, and a's WRITE lands and completes (no retransmit:
    // that would take seconds).
    std::thread::sleep(Duration::from_millis(20));
    a.mr.write(0, &[0xAB; 4096]).unwrap();
    let t = Instant::now();
    write(&a, &b, 1000, 4096);
    let wc = a.cq.wait(T).unwrap().expect("a completion");
    assert_eq!((wc.wr_id, wc.status), (1000, WcStatus::Success));
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(b.mr.read_vec(0, 4096).unwrap(), vec![0xAB; 4096]);
}

/// Busy-poll mode: a thread that polled its CQ and then sleeps on the CQ's
/// channel gets its event when the completion comes, not when the progress
/// thread's standby for polling threads runs out (10 ms after the last
/// poll): the wait hands the sockets back to the progress thread.
#[test]
fn busy_poll_a_poller_that_sleeps_on_the_channel_is_woken_by_the_completion() {
    let (a, b) = busy_pair();
    let mut took = vec![];
    for round in 0..10u64 {
        b.qp.post_recv(RecvWr::new(round, [b.mr.sge(64, 64)]))
            .unwrap();
        // b's thread takes a WRITE by polling (its progress thread, woken to
        // send the deferred ACK, then stands by for it), then sleeps.
        write_polled_by_target(&a, &b, round as u8);
        let wc = a.cq.wait(T).unwrap().expect("the WRITE's completion");
        assert_eq!(wc.status, WcStatus::Success);
        b.cq.req_notify(false);
        let posted = std::thread::scope(|s| {
            let sender = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(2));
                let t = Instant::now();
                a.qp.post_send(SendWr::new(round, SendOp::Send, [a.mr.sge(0, 8)]))
                    .unwrap();
                t
            });
            assert!(b.cq.wait_event(T), "round {round}: no event");
            sender.join().unwrap()
        });
        took.push(posted.elapsed());
        let wc = b.cq.poll_one().unwrap().expect("the receive's completion");
        assert_eq!((wc.wr_id, wc.status), (round, WcStatus::Success));
        let wc = a.cq.wait(T).unwrap().expect("the send's completion");
        assert_eq!((wc.wr_id, wc.status), (round, WcStatus::Success));
    }
    // One slow round is forgiven (a busy machine); the standby's stall
    // made several of ten take about 8 ms.
    let slow = took
        .iter()
        .filter(|t| **t >= Duration::from_millis(4))
        .count();
    assert!(slow <= 1, "events came this long after the SEND: {took:?}");
}

/// A busy-poll receiver defers its ACK to leave with its next request; if
/// its application stops polling instead, the progress thread sends the ACK
/// when it takes the sockets back (within about 1 ms, not at the sender's
/// seconds-long ACK timeout).
#[test]
fn a_deferred_ack_is_sent_when_the_poller_goes_away() {
    let (a, b) = busy_pair();
    // b's thread receives the WRITE (its ACK deferred), then stops polling.
    let t = write_polled_by_target(&a, &b, 7);
    // a waits without polling b: only b's progress thread can answer.
    let wc = a.cq.wait(T).unwrap().expect("a completion");
    assert_eq!(wc.status, WcStatus::Success);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
}

/// In busy-poll mode a post that finds packets in flight leaves its
/// transmission to the thread that takes their ACKs. Posted back to back and
/// then waited for without polling, or polled for by a thread that posts
/// more, every WRITE still lands and completes well within the ACK timeout
/// (about 4 s): none waits for a retransmission.
#[test]
fn busy_poll_posts_left_to_the_ack_path_all_leave() {
    let (a, b) = busy_pair();
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 13 + 5) as u8).collect();
    a.mr.write(0, &data).unwrap();
    // Two posts, the second finding the first in flight, then a blocking
    // wait: no application thread polls either device.
    let t = Instant::now();
    a.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: b.info.va,
            rkey: b.info.rkey,
        },
        [a.mr.sge(0, 4096)],
    ))
    .unwrap();
    a.qp.post_send(SendWr::new(
        2,
        SendOp::Write {
            remote_addr: b.info.va + 4096,
            rkey: b.info.rkey,
        },
        [a.mr.sge(4096, 4096)],
    ))
    .unwrap();
    for want in [1, 2] {
        let wc = a.cq.wait(T).unwrap().expect("a completion");
        assert_eq!((wc.wr_id, wc.status), (want, WcStatus::Success));
    }
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(b.mr.read_vec(0, 8192).unwrap(), data);
    // A stream of 8-byte WRITEs, 64 outstanding, the poster polling.
    let t = Instant::now();
    let (mut posted, mut done) = (0u64, 0u64);
    while done < 2000 {
        while posted < 2000 && posted - done < 64 {
            let off = (posted % 1024) * 8;
            a.qp.post_send(SendWr::new(
                posted,
                SendOp::Write {
                    remote_addr: b.info.va + off,
                    rkey: b.info.rkey,
                },
                [a.mr.sge(off as usize, 8)],
            ))
            .unwrap();
            posted += 1;
        }
        while let Some(wc) = a.cq.poll_one().unwrap() {
            assert_eq!((wc.wr_id, wc.status), (done, WcStatus::Success));
            done += 1;
        }
        assert!(t.elapsed() < Duration::from_secs(3), "{done} of 2000 done");
    }
    assert_eq!(b.mr.read_vec(0, 8192).unwrap(), data);
}

/// perftest's write_lat pattern in blocking mode, one thread per side: each
/// spins on its memory for the peer's WRITE, then posts its own at once —
/// while its progress thread may still be sending the ACK of what just
/// landed. A post that lost the transmit hand-off to that thread hung here
/// (about once in 30 000 rounds before the fix).
#[test]
fn write_ping_pong_posts_racing_the_ack_all_leave() {
    const ROUNDS: u32 = 3_000;
    let (a, b) = pair();
    let side = |me: RoceEnd, peer: ConnInfo, first: bool| {
        std::thread::spawn(move || {
            for r in 1..=ROUNDS {
                let want = (r as u8).to_ne_bytes();
                if !(first && r == 1) {
                    let until = Instant::now() + T;
                    let expect = if first { r - 1 } else { r };
                    let expect = (expect as u8).to_ne_bytes();
                    while me.mr.read_vec(64, 1).unwrap() != expect {
                        assert!(
                            Instant::now() < until,
                            "round {r}: no WRITE from the peer; {:?}, {:?}",
                            me.qp.stats(),
                            me.ctx.stats()
                        );
                        std::hint::spin_loop();
                    }
                }
                me.mr.write(0, &want).unwrap();
                me.qp
                    .post_send(SendWr::new(
                        u64::from(r),
                        SendOp::Write {
                            remote_addr: peer.va + 64,
                            rkey: peer.rkey,
                        },
                        [me.mr.sge(0, 1)],
                    ))
                    .unwrap();
                let wc = me
                    .cq
                    .wait(T)
                    .unwrap()
                    .unwrap_or_else(|| panic!("round {r}: the WRITE never completed"));
                assert_eq!(
                    wc.status,
                    WcStatus::Success,
                    "round {r}: {:?}, {:?}",
                    me.qp.stats(),
                    me.ctx.stats()
                );
            }
            me
        })
    };
    let (ai, bi) = (a.info, b.info);
    let ta = side(a, bi, true);
    let tb = side(b, ai, false);
    // a finishes once its last WRITE is ACKed, while b's last WRITE may
    // still wait for a's ACK: a's end must live until b is done too.
    let _a = ta.join().unwrap();
    let _b = tb.join().unwrap();
}

#[test]
fn inline_sends_and_writes_arrive_whole() {
    let (a, b) = pair();
    // Sizes around the pad (the payload ends on 4 bytes) and a word.
    for (k, len) in [1usize, 3, 8, 13, 64, 200, 256].into_iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|i| (i * 13 + k) as u8).collect();
        let k = k as u64;
        b.qp.post_recv(RecvWr::new(100 + k, [b.mr.sge(4096, 4096)]))
            .unwrap();
        a.qp.post_send(SendWr::new(k, SendOp::Send, []).inline(&data))
            .unwrap();
        let wc = one(&b.cq);
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len as usize),
            (100 + k, WcStatus::Success, len)
        );
        assert_eq!(b.mr.read_vec(4096, len).unwrap(), data);
        assert_eq!(one(&a.cq).status, WcStatus::Success, "SEND of {len}");
        let at = 16_384 + 512 * k;
        a.qp.post_send(
            SendWr::new(
                200 + k,
                SendOp::Write {
                    remote_addr: b.info.va + at,
                    rkey: b.info.rkey,
                },
                [],
            )
            .inline(&data),
        )
        .unwrap();
        assert_eq!(one(&a.cq).status, WcStatus::Success, "WRITE of {len}");
        assert_eq!(b.mr.read_vec(at as usize, len).unwrap(), data);
    }
    assert_eq!(a.ctx.stats().bad_icrc + b.ctx.stats().bad_icrc, 0);
}

#[test]
fn zero_length_immediates_and_scattered_buffers_over_sockets() {
    // A path MTU of 1 KiB: the 2 999-byte messages below take three packets,
    // whose edges fall inside the pieces.
    let (a, b) = (end("127.0.0.1"), end("127.0.0.1"));
    let (mut ai, mut bi) = (a.info, b.info);
    ai.mtu = Mtu::Mtu1024;
    bi.mtu = Mtu::Mtu1024;
    cm::connect(&a.qp, &ai, &bi, &RcOptions::default()).unwrap();
    cm::connect(&b.qp, &bi, &ai, &RcOptions::default()).unwrap();
    let data: Vec<u8> = (0..3000u32).map(|i| (i * 11 + 5) as u8).collect();
    a.mr.write(0, &data).unwrap();
    // Zero-length SEND with immediate, zero-length WRITE.
    b.qp.post_recv(RecvWr::new(1, [b.mr.sge(0, 16)])).unwrap();
    a.qp.post_send(SendWr::new(2, SendOp::SendWithImm(0x1234_5678), []))
        .unwrap();
    let wc = one(&b.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len, wc.imm),
        (1, WcStatus::Success, 0, Some(0x1234_5678))
    );
    assert_eq!(one(&a.cq).wr_id, 2);
    a.qp.post_send(SendWr::new(
        3,
        SendOp::Write {
            remote_addr: b.info.va,
            rkey: b.info.rkey,
        },
        [],
    ))
    .unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    // A SEND gathered from three pieces of odd lengths into a receive of
    // three pieces.
    let (x, y) = (100_000usize, 200_000usize);
    b.qp.post_recv(RecvWr::new(
        4,
        [
            b.mr.sge(x, 999),
            b.mr.sge(x + 5000, 1),
            b.mr.sge(x + 9000, 2000),
        ],
    ))
    .unwrap();
    a.qp.post_send(SendWr::new(
        5,
        SendOp::Send,
        [a.mr.sge(0, 1001), a.mr.sge(1001, 7), a.mr.sge(1008, 1991)],
    ))
    .unwrap();
    let wc = one(&b.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (4, WcStatus::Success, 2999)
    );
    let mut got = b.mr.read_vec(x, 999).unwrap();
    got.extend(b.mr.read_vec(x + 5000, 1).unwrap());
    got.extend(b.mr.read_vec(x + 9000, 1999).unwrap());
    assert_eq!(got, data[..2999]);
    assert_eq!(one(&a.cq).wr_id, 5);
    // The same three pieces as one WRITE with immediate.
    b.qp.post_recv(RecvWr::new(6, [])).unwrap();
    a.qp.post_send(SendWr::new(
        7,
        SendOp::WriteWithImm {
            remote_addr: b.info.va + y as u64,
            rkey: b.info.rkey,
            imm: 9,
        },
        [a.mr.sge(0, 1001), a.mr.sge(1001, 7), a.mr.sge(1008, 1991)],
    ))
    .unwrap();
    let wc = one(&b.cq);
    assert_eq!(
        (wc.wr_id, wc.opcode, wc.imm, wc.byte_len),
        (6, WcOpcode::RecvRdmaWithImm, Some(9), 2999)
    );
    assert_eq!(b.mr.read_vec(y, 2999).unwrap(), data[..2999]);
    assert_eq!(one(&a.cq).wr_id, 7);
    assert_eq!(a.ctx.stats().bad_icrc + b.ctx.stats().bad_icrc, 0);
}

/// Spins on `end`'s CQ for `d` without taking completions (an application
/// busy-polling something else): its progress thread stands by.
fn spin_progress(end: &RoceEnd, d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        end.cq.progress();
    }
}

/// Busy-poll mode: an RNR NAK taken by the polling thread sets a retry
/// timer of 0.6 ms; the progress thread, standing by, must wake for it (it
/// slept until the send's ACK timer, some 4 s here).
#[test]
fn an_rnr_retry_taken_by_a_polling_thread_is_not_late() {
    let (a, b) = busy_pair();
    spin_progress(&a, Duration::from_millis(20));
    a.qp.post_send(SendWr::new(1, SendOp::Send, [a.mr.sge(0, 8)]))
        .unwrap();
    // a's thread polls while b has no receive: the RNR NAK is its to take.
    spin_progress(&a, Duration::from_millis(5));
    b.qp.post_recv(RecvWr::new(9, [b.mr.sge(0, 64)])).unwrap();
    let t = Instant::now();
    let wc = loop {
        if let Some(wc) = a.cq.poll_one().unwrap() {
            break wc;
        }
        assert!(t.elapsed() < T, "no completion");
    };
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(a.qp.stats().unwrap().rnr_naks_received >= 1);
}

/// An answer a polling thread deferred still leaves when busy-poll mode is
/// then turned off (the progress thread took deferred answers only in
/// busy-poll mode).
#[test]
fn a_deferred_ack_leaves_when_busy_polling_is_turned_off() {
    let (a, b) = busy_pair();
    spin_progress(&b, Duration::from_millis(20));
    let t = write_polled_by_target(&a, &b, 5);
    b.ctx.set_busy_poll(false);
    let wc = a.cq.wait(T).unwrap().expect("a completion");
    assert_eq!(wc.status, WcStatus::Success);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
}

/// SEND with invalidate over RoCEv2: the named rkey stops working before
/// the receive completes (a WRITE with it then fails), its lkey goes on,
/// and a multi-packet SEND carries the IETH on its last packet.
#[test]
fn send_with_invalidate_ends_the_rkey_not_the_lkey() {
    let dir = tempfile::tempdir().unwrap();
    let pcap = dir.path().join("a.pcap");
    let a = roce_end(Device::udp("127.0.0.1:0".parse().unwrap()).pcap(&pcap));
    let b = end("127.0.0.1");
    cm::connect(&a.qp, &a.info, &b.info, &RcOptions::default()).unwrap();
    cm::connect(&b.qp, &b.info, &a.info, &RcOptions::default()).unwrap();
    let pd = &b._pd;
    let victim = pd.register(8192, Access::ALL).unwrap();
    let payload: Vec<u8> = (0..5000u32).map(|i| (i * 13) as u8).collect();
    a.mr.write(0, &payload).unwrap();
    b.qp.post_recv(RecvWr::new(1, [b.mr.sge(0, 8192)])).unwrap();
    a.qp.post_send(SendWr::new(
        2,
        SendOp::SendWithInv(victim.rkey()),
        vec![a.mr.sge(0, 5000)],
    ))
    .unwrap();
    let wc = one(&b.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len, wc.invalidated_rkey),
        (1, WcStatus::Success, 5000, Some(victim.rkey()))
    );
    assert_eq!(b.mr.read_vec(0, 5000).unwrap(), payload);
    let wc = one(&a.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (2, WcStatus::Success, WcOpcode::Send)
    );
    // The lkey still takes a SEND.
    b.qp.post_recv(RecvWr::new(3, [victim.sge(0, 64)])).unwrap();
    a.qp.post_send(SendWr::new(4, SendOp::Send, vec![a.mr.sge(0, 64)]))
        .unwrap();
    assert_eq!(one(&b.cq).status, WcStatus::Success);
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    assert_eq!(victim.read_vec(0, 64).unwrap(), payload[..64]);
    // The rkey does not take a WRITE.
    a.qp.post_send(SendWr::new(
        5,
        SendOp::Write {
            remote_addr: victim.addr(),
            rkey: victim.rkey(),
        },
        vec![a.mr.sge(0, 8)],
    ))
    .unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::RemAccessErr);
    assert_eq!(
        victim.read_vec(0, 8).unwrap(),
        payload[..8],
        "nothing written"
    );
    // On the wire: FIRST, MIDDLEs, then LAST_WITH_INVALIDATE with the key
    // in its IETH; every packet's ICRC holds.
    let ports = [a.info.addr.port(), b.info.addr.port()];
    drop(a);
    let file = std::fs::read(&pcap).unwrap();
    let mut decoder = softrdma::capture::Decoder::new();
    for port in ports {
        decoder.add_roce_port(port);
    }
    let mut lines = Vec::new();
    for frame in softrdma::capture::frames(&file).unwrap() {
        decoder.push(&frame.unwrap(), &mut |rec| {
            assert!(rec.errors().is_empty(), "{:?}", rec.errors());
            lines.push(rec.describe());
        });
    }
    let last = lines
        .iter()
        .find(|l| l.contains("SEND_LAST_WITH_INVALIDATE"))
        .unwrap_or_else(|| panic!("{lines:#?}"));
    assert!(
        last.contains(&format!("IETH rkey={:#x}", victim.rkey())),
        "{last}"
    );
    // The IETH is on the last packet only.
    assert_eq!(
        lines.iter().filter(|l| l.contains("IETH")).count(),
        1,
        "{lines:#?}"
    );
    assert!(lines.iter().any(|l| l.contains("SEND_FIRST")), "{lines:#?}");
}

/// A SEND with invalidate naming a key of another PD: the receive fails
/// (REM_INV_REQ_ERR) and the sender hears "invalid request".
#[test]
fn send_with_invalidate_of_a_foreign_key_is_refused() {
    let (a, b) = pair();
    let other = b
        .ctx
        .alloc_pd()
        .unwrap()
        .register(4096, Access::ALL)
        .unwrap();
    b.qp.post_recv(RecvWr::new(1, [b.mr.sge(0, 64)])).unwrap();
    a.qp.post_send(SendWr::new(
        2,
        SendOp::SendWithInv(other.rkey()),
        vec![a.mr.sge(0, 16)],
    ))
    .unwrap();
    let wc = one(&b.cq);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RemInvReqErr));
    assert_eq!(one(&a.cq).status, WcStatus::RemInvReqErr);
    common::wait_state(&b.qp, QpState::Err);
}

/// Local invalidate over RoCEv2: in send queue order, after what was posted
/// before it; the peer's WRITE with the key then fails; an unknown key is a
/// local protection error that ends the QP.
#[test]
fn local_invalidate_in_send_queue_order() {
    let (a, b) = pair();
    let pd = &a._pd;
    let mine = pd.register(4096, Access::ALL).unwrap();
    // A WRITE, then the invalidate, then a SEND: completions in posting
    // order, the invalidate's after the WRITE's (which needs the peer's
    // ACK).
    a.mr.write(0, b"before").unwrap();
    a.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: b.info.va,
            rkey: b.info.rkey,
        },
        vec![a.mr.sge(0, 6)],
    ))
    .unwrap();
    a.qp.post_send(SendWr::new(2, SendOp::LocalInv(mine.rkey()), []))
        .unwrap();
    b.qp.post_recv(RecvWr::new(9, [b.mr.sge(100, 64)])).unwrap();
    a.qp.post_send(SendWr::new(3, SendOp::Send, vec![a.mr.sge(0, 6)]))
        .unwrap();
    let got: Vec<_> = [one(&a.cq), one(&a.cq), one(&a.cq)]
        .iter()
        .map(|w| (w.wr_id, w.status, w.opcode))
        .collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success, WcOpcode::RdmaWrite),
            (2, WcStatus::Success, WcOpcode::LocalInv),
            (3, WcStatus::Success, WcOpcode::Send)
        ]
    );
    assert_eq!(one(&b.cq).status, WcStatus::Success);
    assert_eq!(b.mr.read_vec(0, 6).unwrap(), b"before");
    // The peer's WRITE with the invalidated key fails.
    b.mr.write(0, b"after").unwrap();
    b.qp.post_send(SendWr::new(
        4,
        SendOp::Write {
            remote_addr: mine.addr(),
            rkey: mine.rkey(),
        },
        vec![b.mr.sge(0, 5)],
    ))
    .unwrap();
    assert_eq!(one(&b.cq).status, WcStatus::RemAccessErr);
    assert_eq!(mine.read_vec(0, 5).unwrap(), [0; 5]);
    // An unknown key: LOC_PROT_ERR, and the QP in ERR.
    let (a, _b) = pair();
    a.qp.post_send(SendWr::new(5, SendOp::LocalInv(0x1234_5678), []))
        .unwrap();
    let wc = one(&a.cq);
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::LocProtErr));
    common::wait_state(&a.qp, QpState::Err);
}

/// Every packet's ICRC holds over the IPv4 header the kernel really wrote.
/// RC QPs send from sockets connected to their peers, whose IDs count from
/// a random start that the provider reads with a probe. The provider's own
/// receiver solves any ID, so only the real headers can tell a wrong guess;
/// a packet socket sees them (root, or CAP_NET_RAW). Single datagrams and
/// GSO sends (several packets under one header on loopback, segment k with
/// the header's ID + k).
#[test]
fn icrcs_hold_over_the_ip_ids_the_kernel_wrote() {
    use socket2::{Domain, Protocol, Socket, Type};
    use softrdma::wire::icrc;
    use std::io::Read;
    use std::sync::atomic::{AtomicBool, Ordering};
    const ETH_P_IP: u16 = 0x0800;
    let capture = match Socket::new(
        Domain::PACKET,
        Type::DGRAM,
        Some(Protocol::from(i32::from(ETH_P_IP.to_be()))),
    ) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            eprintln!("no packet socket ({e}): skipped");
            return;
        }
        Err(e) => panic!("packet socket: {e}"),
    };
    // Past rmem_max where allowed (CAP_NET_ADMIN), and read as it comes:
    // other tests' packets pass here too.
    let force = nix::sys::socket::sockopt::RcvBufForce;
    if nix::sys::socket::setsockopt(&capture, force, &(32 << 20)).is_err() {
        capture.set_recv_buffer_size(32 << 20).unwrap();
    }
    capture
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let reader = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut frames = Vec::new();
            let mut frame = vec![0u8; 70_000];
            let mut read = &capture;
            loop {
                match read.read(&mut frame) {
                    Ok(n) => {
                        let ip = &frame[..n];
                        let ours = n >= 28
                            && ip[0] == 0x45
                            && ip[9] == 17
                            && [[127, 0, 0, 97], [127, 0, 0, 98]]
                                .contains(&[ip[12], ip[13], ip[14], ip[15]])
                            && [[127, 0, 0, 97], [127, 0, 0, 98]]
                                .contains(&[ip[16], ip[17], ip[18], ip[19]]);
                        if ours {
                            frames.push(ip.to_vec());
                        }
                    }
                    Err(_) if stop.load(Ordering::Acquire) => return frames,
                    Err(_) => {}
                }
            }
        })
    };
    let (a, b) = (end("127.0.0.97"), end("127.0.0.98"));
    cm::connect(&a.qp, &a.info, &b.info, &RcOptions::default()).unwrap();
    cm::connect(&b.qp, &b.info, &a.info, &RcOptions::default()).unwrap();
    let data: Vec<u8> = (0..20_000u32).map(|i| (i * 11 + 5) as u8).collect();
    a.mr.write(0, &data).unwrap();
    // Equal WRITEs posted together (GSO sends of equal packets), a READ, a
    // SEND, and a 12 KiB WRITE (4 KiB segments).
    for round in 0..20u64 {
        for k in 0..4 {
            a.qp.post_send(SendWr::new(
                round * 10 + k,
                SendOp::Write {
                    remote_addr: b.info.va + 100_000 + 64 * k,
                    rkey: b.info.rkey,
                },
                [a.mr.sge(0, 8)],
            ))
            .unwrap();
        }
        for _ in 0..4 {
            assert_eq!(one(&a.cq).status, WcStatus::Success);
        }
        b.qp.post_send(SendWr::new(
            1,
            SendOp::Read {
                remote_addr: a.info.va + 8,
                rkey: a.info.rkey,
            },
            [b.mr.sge(200_000, 100)],
        ))
        .unwrap();
        assert_eq!(one(&b.cq).status, WcStatus::Success);
        b.qp.post_recv(RecvWr::new(2, [b.mr.sge(300_000, 64)]))
            .unwrap();
        a.qp.post_send(SendWr::new(3, SendOp::Send, [a.mr.sge(0, 50)]))
            .unwrap();
        assert_eq!(one(&b.cq).status, WcStatus::Success);
        assert_eq!(one(&a.cq).status, WcStatus::Success);
    }
    a.qp.post_send(SendWr::new(
        4,
        SendOp::Write {
            remote_addr: b.info.va + 400_000,
            rkey: b.info.rkey,
        },
        [a.mr.sge(0, 12_288)],
    ))
    .unwrap();
    assert_eq!(one(&a.cq).status, WcStatus::Success);
    assert_eq!(b.mr.read_vec(400_000, 12_288).unwrap(), &data[..12_288]);
    let sent = a.ctx.stats().sent + b.ctx.stats().sent;
    let ports = [a.info.addr.port(), b.info.addr.port()];
    drop((a, b));
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Release);
    let frames = reader.join().unwrap();
    let (mut packets, mut counted_ids, mut gso_counted) = (0u64, 0u64, 0u64);
    for ip in frames
        .iter()
        .filter(|ip| ports.contains(&u16::from_be_bytes([ip[22], ip[23]])))
    {
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]])).min(ip.len());
        let payload = &ip[28..total];
        let id = u16::from_be_bytes([ip[4], ip[5]]);
        // The segment size: the split whose every segment verifies.
        let verifies = |segment: usize| {
            payload.chunks(segment).enumerate().all(|(k, p)| {
                let mut h = [0u8; 20];
                h.copy_from_slice(&ip[..20]);
                h[2..4].copy_from_slice(&((28 + p.len()) as u16).to_be_bytes());
                h[4..6].copy_from_slice(&id.wrapping_add(k as u16).to_be_bytes());
                let udp = icrc::udp_header(
                    u16::from_be_bytes([ip[20], ip[21]]),
                    u16::from_be_bytes([ip[22], ip[23]]),
                    (8 + p.len()) as u16,
                );
                p.len() >= 16 && icrc::verify(&h, &udp, p).is_ok()
            })
        };
        let segment = std::iter::once(payload.len())
            .chain((16..payload.len()).step_by(4))
            .find(|&s| verifies(s));
        let Some(segment) = segment else {
            panic!(
                "no split of a {}-byte datagram with IP ID {id:#x} verifies",
                payload.len()
            );
        };
        packets += payload.len().div_ceil(segment) as u64;
        counted_ids += u64::from(id != 0);
        gso_counted += u64::from(segment < payload.len() && id != 0);
    }
    assert!(
        packets >= sent,
        "the capture holds every packet sent ({packets} of {sent})"
    );
    // (Unless the environment turns them off.)
    let connected = std::env::var_os("SOFTRDMA_NO_CONNECTED").is_none();
    let gso = std::env::var_os("SOFTRDMA_NO_GSO").is_none();
    assert!(
        counted_ids > 0 || !connected,
        "sent from connected sockets (IDs not 0)"
    );
    assert!(
        gso_counted > 0 || !(connected && gso),
        "GSO sends from connected sockets"
    );
}
