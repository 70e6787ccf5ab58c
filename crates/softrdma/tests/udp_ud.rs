//! UD over real sockets: one QP talks to 64 peer QPs on eight other devices,
//! each served by its own thread.

use std::sync::Arc;
use std::time::Duration;

use softrdma::verbs::*;
use softrdma::wire::grh;

mod common;

const QKEY: u32 = 0x1111_1111;
const T: Duration = Duration::from_secs(10);

fn ud_qp(pd: &Pd, cq: &Cq, qkey: u32) -> Qp {
    ud_qp2(pd, cq, cq, qkey)
}

fn ud_qp2(pd: &Pd, scq: &Cq, rcq: &Cq, qkey: u32) -> Qp {
    let qp = pd.create_qp(&QpInit::ud(scq, rcq)).unwrap();
    softrdma::cm::ready_ud(&qp, qkey, 0).unwrap();
    qp
}

#[test]
fn one_ud_qp_and_sixty_four_peers() {
    let center = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    let pd = center.alloc_pd().unwrap();
    let mr = pd.register(1 << 20, Access::LOCAL_WRITE).unwrap();
    let cq = center.create_cq(1024).unwrap();
    let qp = ud_qp(&pd, &cq, QKEY);
    let center_addr = center.local_addr();
    let center_qpn = qp.qpn();
    // Eight devices, eight UD QPs each; each device's thread echoes what it gets.
    let (tx, rx) = std::sync::mpsc::channel();
    let mut threads = vec![];
    for d in 0..8 {
        let tx = tx.clone();
        threads.push(std::thread::spawn(move || {
            let ctx = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
            let pd = ctx.alloc_pd().unwrap();
            let mr = pd.register(64 * 1024, Access::LOCAL_WRITE).unwrap();
            let cq = ctx.create_cq(256).unwrap();
            let scq = ctx.create_cq(256).unwrap();
            let qps: Vec<Qp> = (0..8).map(|_| ud_qp2(&pd, &scq, &cq, QKEY)).collect();
            for (i, q) in qps.iter().enumerate() {
                q.post_recv(RecvWr::new(i as u64, [mr.sge(i * 1024, 40 + 256)]))
                    .unwrap();
            }
            let back = pd.create_ah(AhAttr { addr: center_addr }).unwrap();
            tx.send((
                d,
                ctx.local_addr(),
                qps.iter().map(Qp::qpn).collect::<Vec<_>>(),
            ))
            .unwrap();
            // Answer each datagram: its payload, then this QP's number.
            for _ in 0..8 {
                let wc = cq.wait(T).unwrap().expect("a ping");
                assert_eq!(wc.status, WcStatus::Success);
                assert!(wc.grh, "{wc:?}");
                assert_eq!(wc.src_qp, center_qpn);
                let i = wc.wr_id as usize;
                let area = mr.read_vec(i * 1024, 40).unwrap();
                let g = grh::Repr::parse(&grh::Header::new_checked(&area[..]).unwrap()).unwrap();
                assert_eq!(g.sgid(), grh::ipv4_mapped(center_addr.ip().octets()));
                let len = wc.byte_len as usize - 40;
                let mut msg = mr.read_vec(i * 1024 + 40, len).unwrap();
                msg.extend_from_slice(&qps[i].qpn().to_be_bytes());
                mr.write(32 * 1024 + i * 1024, &msg).unwrap();
                let wr = SendWr::new(
                    100 + i as u64,
                    SendOp::Send,
                    vec![mr.sge(32 * 1024 + i * 1024, msg.len() as u32)],
                )
                .to(back.dest(center_qpn, QKEY));
                qps[i].post_send(wr).unwrap();
            }
            // The sends' completions.
            for _ in 0..8 {
                assert_eq!(
                    scq.wait(T).unwrap().expect("send done").status,
                    WcStatus::Success
                );
            }
        }));
    }
    let mut peers = vec![];
    let mut ahs = vec![];
    for _ in 0..8 {
        let (_, addr, qpns) = rx.recv().unwrap();
        let ah = Arc::new(pd.create_ah(AhAttr { addr }).unwrap());
        for q in qpns {
            peers.push((ah.clone(), q));
        }
        ahs.push(ah);
    }
    assert_eq!(peers.len(), 64);
    for k in 0..64 {
        qp.post_recv(RecvWr::new(1000 + k, [mr.sge(k as usize * 1024, 40 + 256)]))
            .unwrap();
    }
    for (k, (ah, q)) in peers.iter().enumerate() {
        let msg = format!("ping {k:02} to qp {q:#x}");
        mr.write(512 * 1024 + k * 256, msg.as_bytes()).unwrap();
        let wr = SendWr::new(
            k as u64,
            SendOp::Send,
            vec![mr.sge(512 * 1024 + k * 256, msg.len() as u32)],
        )
        .unsignaled()
        .to(ah.dest(*q, QKEY));
        qp.post_send(wr).unwrap();
    }
    let mut answered = std::collections::BTreeSet::new();
    while answered.len() < 64 {
        let wc = cq.wait(T).unwrap().expect("a pong");
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        let slot = (wc.wr_id - 1000) as usize;
        let body = mr
            .read_vec(slot * 1024 + 40, wc.byte_len as usize - 40)
            .unwrap();
        let (text, qpn) = body.split_at(body.len() - 4);
        let qpn = u32::from_be_bytes(qpn.try_into().unwrap());
        let text = String::from_utf8(text.to_vec()).unwrap();
        let k: usize = text[5..7].parse().unwrap();
        assert_eq!(text, format!("ping {k:02} to qp {qpn:#x}"));
        assert_eq!(
            peers[k].1, qpn,
            "the answer came from the QP the ping went to"
        );
        assert_eq!(wc.src_qp, qpn);
        assert!(answered.insert(k), "answer {k} twice");
    }
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(qp.ud_stats().unwrap().sent, 64);
}

#[test]
fn qkey_mismatch_and_oversize_over_sockets() {
    let ctx = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(1 << 16, Access::LOCAL_WRITE).unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let a = ud_qp(&pd, &cq, QKEY);
    let b = ud_qp(&pd, &cq, 0x2222);
    let ah = pd
        .create_ah(AhAttr {
            addr: ctx.local_addr(),
        })
        .unwrap();
    b.post_recv(RecvWr::new(1, [mr.sge(0, 40 + 8)])).unwrap();
    // Wrong Q_Key: dropped, counted, the receive stays.
    a.post_send(SendWr::new(2, SendOp::Send, vec![mr.sge(4096, 4)]).to(ah.dest(b.qpn(), QKEY)))
        .unwrap();
    assert_eq!(cq.wait(T).unwrap().unwrap().wr_id, 2);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(b.ud_stats().unwrap().qkey_mismatch, 1);
    // Too big for the buffer: LOC_LEN_ERR, and the QP goes on.
    a.post_send(SendWr::new(3, SendOp::Send, vec![mr.sge(4096, 9)]).to(ah.dest(b.qpn(), 0x2222)))
        .unwrap();
    let mut got = vec![];
    for _ in 0..2 {
        let wc = cq.wait(T).unwrap().unwrap();
        got.push((wc.wr_id, wc.status));
    }
    got.sort_by_key(|g| g.0);
    assert_eq!(got, [(1, WcStatus::LocLenErr), (3, WcStatus::Success)]);
    assert_eq!(b.state(), QpState::Rts);
    // Longer than the MTU: refused on the call.
    let big = pd.register(8192, Access::LOCAL_WRITE).unwrap();
    let e = a
        .post_send(
            SendWr::new(4, SendOp::Send, vec![big.sge(0, 4097)]).to(ah.dest(b.qpn(), 0x2222)),
        )
        .unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
}

/// A UD SEND ONLY from source QP 0x77 to `qpn` as rxe would send it from
/// `from` to `to` with IP ID `id`, its BTH first changed by `bth`, its ICRC
/// filled in.
fn raw_ud_send(
    from: std::net::SocketAddrV4,
    to: std::net::SocketAddrV4,
    qpn: u32,
    id: u16,
    payload: &[u8],
    bth: impl FnOnce(&mut [u8]),
) -> Vec<u8> {
    use softrdma::wire::icrc::{self, Ipv4Pseudo};
    use softrdma::wire::{Opcode, Psn, deth, packet};
    let mut r = packet::Repr::new(Opcode::UD_SEND_ONLY, qpn, Psn::new(7), payload.len());
    r.deth = Some(deth::Repr {
        qkey: QKEY,
        src_qp: 0x77,
    });
    let mut p = vec![0u8; r.buffer_len().unwrap()];
    r.emit(&mut p, payload).unwrap();
    bth(&mut p[..12]);
    let udp_len = (8 + p.len()) as u16;
    let ip = Ipv4Pseudo {
        src: from.ip().octets(),
        dst: to.ip().octets(),
        identification: id,
        dont_fragment: true,
    }
    .header(udp_len);
    let udp = icrc::udp_header(from.port(), to.port(), udp_len);
    icrc::fill(&ip, &udp, &mut p).unwrap();
    p
}

/// As rxe: a packet of another transport version, or outside the default
/// partition, is dropped and counted; the limited member's P_Key is taken.
#[test]
fn only_transport_version_0_and_the_default_partition_are_taken() {
    let ctx = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
    let cq = ctx.create_cq(8).unwrap();
    let qp = ud_qp(&pd, &cq, QKEY);
    for k in 0..2 {
        qp.post_recv(RecvWr::new(k, [mr.sge(k as usize * 64, 64)]))
            .unwrap();
    }
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let from = match sock.local_addr().unwrap() {
        std::net::SocketAddr::V4(a) => a,
        _ => unreachable!(),
    };
    let to = ctx.local_addr();
    let send = |payload: &[u8], bth: fn(&mut [u8])| {
        let p = raw_ud_send(from, to, qp.qpn(), 0, payload, bth);
        sock.send_to(&p, to).unwrap();
    };
    send(b"pkey", |b| {
        b[2..4].copy_from_slice(&0x1234u16.to_be_bytes())
    });
    send(b"tver", |b| b[1] |= 0x01);
    send(b"limited", |b| {
        b[2..4].copy_from_slice(&0x7fffu16.to_be_bytes())
    });
    let wc = cq.wait(T).unwrap().expect("the limited member's datagram");
    assert_eq!((wc.wr_id, wc.byte_len), (0, 40 + 7));
    assert_eq!(mr.read_vec(40, 7).unwrap(), b"limited");
    assert_eq!(ctx.stats().bad_header, 2);
    assert_eq!(cq.poll_one().unwrap(), None);
}

#[test]
fn a_foreign_ip_id_is_solved_from_the_icrc_and_the_grh_shows_ttl_and_tos() {
    // A sender like rxe: its ICRC covers an IP ID the receiving socket never sees.
    let ctx = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
    let cq = ctx.create_cq(8).unwrap();
    let qp = ud_qp(&pd, &cq, QKEY);
    qp.post_recv(RecvWr::new(1, [mr.sge(0, 40 + 64)])).unwrap();
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    // TTL and TOS of its own, which the GRH must show.
    sock.set_ttl(17).unwrap();
    socket2::SockRef::from(&sock).set_tos_v4(0x28).unwrap();
    let from = match sock.local_addr().unwrap() {
        std::net::SocketAddr::V4(a) => a,
        _ => unreachable!(),
    };
    let to = ctx.local_addr();
    let packet_with_id = |id: u16, corrupt: bool| {
        let mut p = raw_ud_send(from, to, qp.qpn(), id, b"hello", |_| {});
        if corrupt {
            p[21] ^= 1;
        }
        p
    };
    // Corrupt first: dropped and counted; then a good one with ID 0x1234.
    sock.send_to(&packet_with_id(0x1234, true), to).unwrap();
    sock.send_to(&packet_with_id(0x1234, false), to).unwrap();
    let wc = cq.wait(T).unwrap().expect("the datagram");
    assert_eq!(
        (wc.status, wc.src_qp, wc.byte_len),
        (WcStatus::Success, 0x77, 45)
    );
    assert_eq!(mr.read_vec(40, 5).unwrap(), b"hello");
    let area = mr.read_vec(0, 40).unwrap();
    match grh::Repr::parse(&grh::Header::new_checked(&area[..]).unwrap()).unwrap() {
        grh::Repr::Ipv4 {
            identification,
            ttl,
            tos,
            ..
        } => assert_eq!((identification, ttl, tos), (0x1234, 17, 0x28)),
        other => panic!("{other:?}"),
    }
    assert_eq!(ctx.stats().bad_icrc, 1);
}

#[test]
fn inline_ud_sends_arrive_whole() {
    let ctx = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(1 << 16, Access::LOCAL_WRITE).unwrap();
    let scq = ctx.create_cq(64).unwrap();
    let rcq = ctx.create_cq(64).unwrap();
    let a = ud_qp2(&pd, &scq, &rcq, QKEY);
    let b = ud_qp2(&pd, &scq, &rcq, QKEY);
    let ah = pd
        .create_ah(AhAttr {
            addr: ctx.local_addr(),
        })
        .unwrap();
    for (k, len) in [1usize, 3, 8, 13, 200].into_iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + k) as u8).collect();
        let k = k as u64;
        b.post_recv(RecvWr::new(k, [mr.sge(0, 40 + 256)])).unwrap();
        a.post_send(
            SendWr::new(100 + k, SendOp::Send, [])
                .inline(&data)
                .to(ah.dest(b.qpn(), QKEY)),
        )
        .unwrap();
        let sent = scq.wait(T).unwrap().expect("sent");
        assert_eq!(
            (sent.wr_id, sent.status, sent.byte_len as usize),
            (100 + k, WcStatus::Success, len)
        );
        let wc = rcq.wait(T).unwrap().expect("an inline UD SEND arrives");
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len as usize),
            (k, WcStatus::Success, 40 + len)
        );
        assert_eq!(mr.read_vec(40, len).unwrap(), data);
    }
    assert_eq!(ctx.stats().bad_icrc, 0);
}

/// A send through an address handle that was destroyed, or that another
/// protection domain made, is refused on the call; before, it completed
/// with success and nothing went out.
#[test]
fn a_destroyed_or_foreign_address_handle_is_refused() {
    let ctx = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let other_pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let a = ud_qp(&pd, &cq, QKEY);
    let to = AhAttr {
        addr: ctx.local_addr(),
    };
    let foreign = other_pd.create_ah(to).unwrap();
    let gone = pd.create_ah(to).unwrap().dest(a.qpn(), QKEY);
    for (wr_id, dest) in [(1, foreign.dest(a.qpn(), QKEY)), (2, gone)] {
        let e = a
            .post_send(SendWr::new(wr_id, SendOp::Send, vec![mr.sge(0, 4)]).to(dest))
            .unwrap_err();
        assert!(
            matches!(e, VerbsError::Post(PostError::BadAh(_))),
            "{wr_id}: {e}"
        );
    }
    assert!(cq.poll_one().unwrap().is_none(), "nothing was posted");
    // The QP's own AH still works.
    let ah = pd.create_ah(to).unwrap();
    a.post_recv(RecvWr::new(5, [mr.sge(100, 48)])).unwrap();
    a.post_send(SendWr::new(3, SendOp::Send, vec![mr.sge(0, 4)]).to(ah.dest(a.qpn(), QKEY)))
        .unwrap();
    let mut got: Vec<_> = (0..2)
        .map(|_| cq.wait(T).unwrap().unwrap())
        .map(|wc| (wc.wr_id, wc.status))
        .collect();
    got.sort_unstable_by_key(|g| g.0);
    assert_eq!(got, [(3, WcStatus::Success), (5, WcStatus::Success)]);
}

/// An address handle of another device context is refused too. Each
/// context numbered its PDs and handles from 1, so the first handle of one
/// context passed for the first of another, PD and all, and the datagram
/// went to that one's address.
#[test]
fn an_address_handle_of_another_context_is_refused() {
    let open = || Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    let (ctx, other) = (open(), open());
    let (pd, other_pd) = (ctx.alloc_pd().unwrap(), other.alloc_pd().unwrap());
    let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let a = ud_qp(&pd, &cq, QKEY);
    let theirs = other_pd
        .create_ah(AhAttr {
            addr: other.local_addr(),
        })
        .unwrap();
    let _ours = pd
        .create_ah(AhAttr {
            addr: ctx.local_addr(),
        })
        .unwrap();
    let e = a
        .post_send(SendWr::new(1, SendOp::Send, vec![mr.sge(0, 4)]).to(theirs.dest(a.qpn(), QKEY)))
        .unwrap_err();
    assert!(matches!(e, VerbsError::Post(PostError::BadAh(_))), "{e}");
}

/// A CM REQ to QP 1 (rdma_cm over RoCEv2, not served yet) is answered at
/// once with a REJ to the sender's RoCEv2 port: reason 8, the REQ's IDs.
#[test]
fn a_cm_req_is_rejected_at_once() {
    let ctx = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    common::cm_req_gets_its_rej(ctx.local_addr(), [127, 0, 0, 94]);
    // Counted once the send returns, which may be after the REJ arrived.
    let t = std::time::Instant::now();
    while ctx.stats().cm_rejects == 0 && t.elapsed() < T {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(ctx.stats().cm_rejects, 1);
}

/// A UD receiver answers the sender its GRH names (`ibv_create_ah_from_wc`):
/// the reply reaches the sender's QP on port 4791 of the source address.
/// A completion without a GRH, a short area or an IPv6 sender is refused.
#[test]
fn an_address_handle_from_a_receive_answers_its_sender() {
    let open = |ip| {
        Device::udp(std::net::SocketAddrV4::new(ip, 4791).into())
            .open()
            .unwrap()
    };
    let (a_ip, b_ip) = (
        std::net::Ipv4Addr::new(127, 0, 0, 131),
        std::net::Ipv4Addr::new(127, 0, 0, 132),
    );
    let (a, b) = (open(a_ip), open(b_ip));
    let (apd, bpd) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let (amr, bmr) = (
        apd.register(4096, Access::LOCAL_WRITE).unwrap(),
        bpd.register(4096, Access::LOCAL_WRITE).unwrap(),
    );
    let (acq, bcq) = (a.create_cq(16).unwrap(), b.create_cq(16).unwrap());
    let (aqp, bqp) = (ud_qp(&apd, &acq, QKEY), ud_qp(&bpd, &bcq, QKEY));
    bqp.post_recv(RecvWr::new(1, [bmr.sge(0, 40 + 64)]))
        .unwrap();
    aqp.post_recv(RecvWr::new(2, [amr.sge(0, 40 + 64)]))
        .unwrap();
    let to_b = apd
        .create_ah(AhAttr {
            addr: b.local_addr(),
        })
        .unwrap();
    amr.write(1024, b"ping").unwrap();
    aqp.post_send(SendWr::new(10, SendOp::Send, [amr.sge(1024, 4)]).to(to_b.dest(bqp.qpn(), QKEY)))
        .unwrap();
    let sent = acq.wait(T).unwrap().expect("the ping sent");
    assert_eq!((sent.wr_id, sent.status), (10, WcStatus::Success));
    let got = bcq.wait(T).unwrap().expect("the ping");
    assert_eq!(got.status, WcStatus::Success);
    let area = bmr.read_vec(0, 40).unwrap();
    let back = bpd.create_ah_from_wc(&got, &area).unwrap();
    assert_eq!(
        AhAttr::from_wc(&got, &area).unwrap().addr,
        std::net::SocketAddrV4::new(a_ip, 4791)
    );
    bmr.write(1024, b"pong").unwrap();
    bqp.post_send(
        SendWr::new(20, SendOp::Send, [bmr.sge(1024, 4)]).to(back.dest(got.src_qp, QKEY)),
    )
    .unwrap();
    // The reply and (on A's one CQ) the ping's own completion came first.
    let reply = acq.wait(T).unwrap().expect("the reply");
    assert_eq!((reply.wr_id, reply.status), (2, WcStatus::Success));
    assert_eq!(amr.read_vec(40, 4).unwrap(), b"pong");

    // What cannot name a sender.
    let no_grh = WorkCompletion { grh: false, ..got };
    let said = |r: Result<AhAttr>| r.unwrap_err().to_string();
    assert!(said(AhAttr::from_wc(&no_grh, &area)).contains("no GRH"));
    assert!(said(AhAttr::from_wc(&got, &area[..39])).contains("shorter than a GRH"));
    let mut v6 = [0u8; 40];
    v6[0] = 0x60;
    v6[8..24].copy_from_slice(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    assert!(said(AhAttr::from_wc(&got, &v6)).contains("IPv6"));
}
