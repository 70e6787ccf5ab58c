//! UD between engines, packets handed over directly.

use std::sync::Arc;

use super::*;
use crate::engine::{Sge, UdDest};
use crate::memory::{Region, RegionMemory};

const QKEY: u32 = 0x1111_1111;

struct Node {
    qp: UdQp,
    mrs: MrTable,
    lkey: u32,
    base: u64,
}

fn node(qpn: u32, qkey: u32) -> Node {
    let mem = Arc::new(RegionMemory::zeroed(1 << 16).unwrap());
    let base = mem.addr();
    let mut mrs = MrTable::new();
    mrs.insert(
        Region::new(
            1,
            (qpn << 8, qpn << 8 | 1),
            mem,
            0,
            1 << 16,
            base,
            Access::ALL,
        )
        .unwrap(),
    );
    let mut qp = UdQp::new(qpn, 1, QpCaps::default(), Mtu::Mtu1024);
    qp.modify(&QpAttr {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(1),
        qkey: Some(qkey),
        ..QpAttr::default()
    })
    .unwrap();
    qp.modify(&QpAttr {
        state: Some(QpState::Rtr),
        ..QpAttr::default()
    })
    .unwrap();
    qp.modify(&QpAttr {
        state: Some(QpState::Rts),
        sq_psn: Some(0x42),
        ..QpAttr::default()
    })
    .unwrap();
    Node {
        qp,
        mrs,
        lkey: qpn << 8,
        base,
    }
}

impl Node {
    fn sge(&self, off: u64, len: u32) -> Sge {
        Sge {
            addr: self.base + off,
            len,
            lkey: self.lkey,
        }
    }
    fn write(&self, off: u64, data: &[u8]) {
        self.mrs
            .local(
                1,
                self.lkey,
                self.base + off,
                data.len() as u32,
                Access::NONE,
            )
            .unwrap()
            .write(0, data);
    }
    fn read(&self, off: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mrs
            .local(1, self.lkey, self.base + off, len as u32, Access::NONE)
            .unwrap()
            .read(0, &mut v);
        v
    }
}

const META: RecvMeta = RecvMeta::V4 {
    src: [10, 0, 0, 1],
    dst: [10, 0, 0, 2],
    tos: 0,
    ttl: 64,
    identification: 0,
};

/// Sends what `from` has queued to `to`, as a provider would: header, pieces, pad, ICRC slot.
fn deliver(from: &mut Node, to: &mut Node) -> Vec<AhId> {
    let mut ahs = vec![];
    let mut buf = vec![0u8; 64 + 4096];
    let mut pieces = vec![];
    while let Some((t, ah)) = from.qp.poll_transmit(&from.mrs, &mut buf, &mut pieces) {
        let mut pkt = buf[..t.len].to_vec();
        for s in &pieces {
            let at = pkt.len();
            pkt.resize(at + s.len(), 0);
            s.read(0, &mut pkt[at..]);
        }
        pkt.resize(pkt.len() + usize::from(t.pad) + 4, 0);
        from.qp.transmitted();
        to.qp.handle_packet(&pkt, &META, &to.mrs);
        ahs.push(ah);
    }
    ahs
}

fn dest(ah: u64, qpn: u32, qkey: u32) -> UdDest {
    UdDest {
        ah: AhId(ah),
        remote_qpn: qpn,
        remote_qkey: qkey,
    }
}

#[test]
fn datagram_with_grh_and_immediate() {
    let (mut a, mut b) = (node(0x20, QKEY), node(0x21, QKEY));
    a.write(0, b"ping ud");
    b.qp.post_recv(RecvWr::new(5, [b.sge(100, 40 + 64)]))
        .unwrap();
    let wr = SendWr::new(1, SendOp::SendWithImm(0xfeed), vec![a.sge(0, 7)]).to(dest(9, 0x21, QKEY));
    a.qp.post_send(wr).unwrap();
    assert_eq!(deliver(&mut a, &mut b), [AhId(9)]);
    let (k, wc) = a.qp.poll_completion().unwrap();
    assert_eq!(
        (k, wc.wr_id, wc.status),
        (CqKind::Send, 1, WcStatus::Success)
    );
    let (k, wc) = b.qp.poll_completion().unwrap();
    assert_eq!(k, CqKind::Recv);
    assert_eq!(
        (wc.wr_id, wc.byte_len, wc.src_qp, wc.grh, wc.imm),
        (5, 47, 0x20, true, Some(0xfeed))
    );
    assert_eq!(b.read(140, 7), b"ping ud");
    let area = b.read(100, 40);
    assert_eq!(area[..20], [0; 20]);
    let g = grh::Repr::parse(&grh::Header::new_checked(&area[..]).unwrap()).unwrap();
    match g {
        grh::Repr::Ipv4 {
            src,
            dst,
            ttl,
            protocol,
            flags_fragment,
            total_len,
            ..
        } => {
            assert_eq!(
                (src, dst, ttl, protocol, flags_fragment),
                ([10, 0, 0, 1], [10, 0, 0, 2], 64, 17, 0x4000)
            );
            // IP + UDP + BTH + DETH + ImmDt + 7 bytes + 1 pad + ICRC.
            assert_eq!(total_len, 20 + 8 + 12 + 8 + 4 + 7 + 1 + 4);
        }
        other => panic!("{other:?}"),
    }
}

/// A send's completion waits until the provider says the datagram is in the
/// socket; receive completions and earlier ones do not wait for it.
#[test]
fn a_send_completes_only_once_transmitted() {
    let (mut a, mut b) = (node(0x20, QKEY), node(0x21, QKEY));
    a.qp.post_recv(RecvWr::new(7, [a.sge(1000, 40 + 64)]))
        .unwrap();
    b.qp.post_send(SendWr::new(3, SendOp::Send, vec![b.sge(0, 5)]).to(dest(1, 0x20, QKEY)))
        .unwrap();
    a.qp.post_send(SendWr::new(1, SendOp::Send, vec![a.sge(0, 5)]).to(dest(9, 0x21, QKEY)))
        .unwrap();
    let (mut buf, mut pieces) = (vec![0u8; 64 + 4096], vec![]);
    assert!(a.qp.poll_transmit(&a.mrs, &mut buf, &mut pieces).is_some());
    assert_eq!(a.qp.poll_completion(), None, "held until transmitted");
    // A receive completing meanwhile is not held behind it.
    deliver(&mut b, &mut a);
    let (k, wc) = a.qp.poll_completion().unwrap();
    assert_eq!((k, wc.wr_id), (CqKind::Recv, 7));
    assert_eq!(a.qp.poll_completion(), None);
    a.qp.transmitted();
    let (k, wc) = a.qp.poll_completion().unwrap();
    assert_eq!(
        (k, wc.wr_id, wc.status),
        (CqKind::Send, 1, WcStatus::Success)
    );
}

#[test]
fn qkey_rules() {
    let (mut a, mut b) = (node(0x20, QKEY), node(0x21, QKEY));
    b.qp.post_recv(RecvWr::new(1, [b.sge(0, 100)])).unwrap();
    // A wrong Q_Key is dropped and counted; the receive stays posted.
    a.qp.post_send(SendWr::new(1, SendOp::Send, vec![]).to(dest(1, 0x21, 0x2222)))
        .unwrap();
    deliver(&mut a, &mut b);
    assert_eq!(b.qp.stats().qkey_mismatch, 1);
    assert!(b.qp.poll_completion().is_none());
    // The high bit means "use my own Q_Key": A's is QKEY, which B wants.
    a.qp.post_send(SendWr::new(2, SendOp::Send, vec![]).to(dest(1, 0x21, 0x8000_0000)))
        .unwrap();
    deliver(&mut a, &mut b);
    assert_eq!(b.qp.poll_completion().unwrap().1.byte_len, 40);
}

#[test]
fn oversized_datagram_is_loc_len_err_and_the_qp_goes_on() {
    let (mut a, mut b) = (node(0x20, QKEY), node(0x21, QKEY));
    b.qp.post_recv(RecvWr::new(1, [b.sge(0, 40 + 10)])).unwrap();
    b.qp.post_recv(RecvWr::new(2, [b.sge(1000, 40 + 100)]))
        .unwrap();
    a.qp.post_send(SendWr::new(1, SendOp::Send, vec![a.sge(0, 11)]).to(dest(1, 0x21, QKEY)))
        .unwrap();
    a.qp.post_send(SendWr::new(2, SendOp::Send, vec![a.sge(0, 11)]).to(dest(1, 0x21, QKEY)))
        .unwrap();
    deliver(&mut a, &mut b);
    assert_eq!(
        b.qp.poll_completion().unwrap().1.status,
        WcStatus::LocLenErr
    );
    let wc = b.qp.poll_completion().unwrap().1;
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (2, WcStatus::Success, 51)
    );
    assert_eq!(b.qp.state(), QpState::Rts);
    // No receive posted: dropped and counted.
    a.qp.post_send(SendWr::new(3, SendOp::Send, vec![]).to(dest(1, 0x21, QKEY)))
        .unwrap();
    deliver(&mut a, &mut b);
    assert_eq!(b.qp.stats().no_receive, 1);
}

#[test]
fn post_rules() {
    let (mut a, _) = (node(0x20, QKEY), ());
    let big = SendWr::new(1, SendOp::Send, vec![a.sge(0, 1025)]).to(dest(1, 2, QKEY));
    assert_eq!(
        a.qp.post_send(big),
        Err(PostError::LongerThanMtu {
            len: 1025,
            mtu: 1024
        })
    );
    assert!(matches!(
        a.qp.post_send(SendWr::new(1, SendOp::Send, vec![])),
        Err(PostError::Unsupported(_))
    ));
    let write = SendWr::new(
        1,
        SendOp::Write {
            remote_addr: 0,
            rkey: 0,
        },
        vec![],
    )
    .to(dest(1, 2, QKEY));
    assert!(matches!(
        a.qp.post_send(write),
        Err(PostError::Unsupported(_))
    ));
    // RESET -> INIT needs the Q_Key; RTS needs the send PSN.
    let mut q = UdQp::new(5, 1, QpCaps::default(), Mtu::Mtu1024);
    assert!(
        q.modify(&QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            ..QpAttr::default()
        })
        .is_err()
    );
    q.modify(&QpAttr {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(1),
        qkey: Some(7),
        ..QpAttr::default()
    })
    .unwrap();
    q.modify(&QpAttr {
        state: Some(QpState::Rtr),
        ..QpAttr::default()
    })
    .unwrap();
    assert!(
        q.modify(&QpAttr {
            state: Some(QpState::Rts),
            ..QpAttr::default()
        })
        .is_err()
    );
    // A bad lkey moves the QP to SQE and flushes the rest.
    let bad = SendWr::new(
        1,
        SendOp::Send,
        vec![Sge {
            addr: a.base,
            len: 4,
            lkey: 0xdead,
        }],
    )
    .to(dest(1, 2, QKEY));
    a.qp.post_send(bad).unwrap();
    a.qp.post_send(SendWr::new(2, SendOp::Send, vec![]).to(dest(1, 2, QKEY)))
        .unwrap();
    let mut buf = vec![0u8; 4200];
    assert!(a.qp.poll_transmit(&a.mrs, &mut buf, &mut vec![]).is_none());
    assert_eq!(a.qp.state(), QpState::Sqe);
    let got: Vec<_> = std::iter::from_fn(|| a.qp.poll_completion())
        .map(|c| (c.1.wr_id, c.1.status))
        .collect();
    assert_eq!(got, [(1, WcStatus::LocProtErr), (2, WcStatus::WrFlushErr)]);
}

/// In SQD a UD QP is drained once every datagram it handed out is in the
/// socket, unsignaled ones included.
#[test]
fn sq_drained_waits_for_unsignaled_datagrams_too() {
    let mut a = node(0x20, QKEY);
    let wr = SendWr {
        flags: crate::engine::SendFlags::default(),
        ..SendWr::new(1, SendOp::Send, vec![a.sge(0, 5)]).to(dest(9, 0x21, QKEY))
    };
    a.qp.post_send(wr).unwrap();
    let (mut buf, mut pieces) = (vec![0u8; 64 + 4096], vec![]);
    assert!(a.qp.poll_transmit(&a.mrs, &mut buf, &mut pieces).is_some());
    a.qp.modify(&QpAttr {
        state: Some(QpState::Sqd),
        ..QpAttr::default()
    })
    .unwrap();
    assert_eq!(a.qp.poll_event(), None, "a datagram not yet in the socket");
    a.qp.transmitted();
    assert_eq!(a.qp.poll_event(), Some(QpEvent::SqDrained));
    assert_eq!(a.qp.poll_event(), None);
}
