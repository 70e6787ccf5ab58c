//! Hostile packets found by review, each fed straight to an engine: what a
//! buggy or malicious peer can send must be refused, not served or completed.

use std::sync::Arc;

use softrdma::engine::iwarp::{IwarpConfig, IwarpQp, Placement};
use softrdma::engine::rc::{MAX_HEADER_LEN, Mtu, QpCaps, RcQp};
use softrdma::engine::{CqKind, QpAttr, QpState, RecvWr, Sge, Time, WcStatus};
use softrdma::memory::{Access, MrTable, Region, RegionMemory};
use softrdma::wire::packet::Repr;
use softrdma::wire::{Opcode, Psn, ddp, rdmap, reth};

const IOVA: u64 = 0x10_0000;
const LKEY: u32 = 0x100;
const RKEY: u32 = 0x200;
/// AETH syndrome of a NAK for an invalid request (IBA 9.7.5.2.8).
const NAK_INVALID_REQUEST: u8 = 0x61;

fn region() -> MrTable {
    let mem = Arc::new(RegionMemory::zeroed(65536).unwrap());
    let mut mrs = MrTable::new();
    mrs.insert(Region::new(1, (LKEY, RKEY), mem, 0, 65536, IOVA, Access::ALL).unwrap());
    mrs
}

/// An RC QP in RTS with a 1024-byte MTU and `max_dest_rd_atomic` responder
/// resources.
fn rc_qp(max_dest_rd_atomic: u8) -> RcQp {
    let mut qp = RcQp::new(0x11, 1, QpCaps::default());
    for attr in [
        QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC),
            ..QpAttr::default()
        },
        QpAttr {
            state: Some(QpState::Rtr),
            path_mtu: Some(Mtu::Mtu1024),
            dest_qp: Some(0x12),
            rq_psn: Some(0),
            max_dest_rd_atomic: Some(max_dest_rd_atomic),
            min_rnr_timer: Some(1),
            has_av: true,
            ..QpAttr::default()
        },
        QpAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(0),
            max_rd_atomic: Some(4),
            retry_cnt: Some(2),
            rnr_retry: Some(2),
            timeout: Some(14),
            ..QpAttr::default()
        },
    ] {
        qp.modify(&attr).unwrap();
    }
    qp
}

fn read_request(len: u32) -> Vec<u8> {
    let mut r = Repr::new(Opcode::RC_RDMA_READ_REQUEST, 0x11, Psn::new(0), 0);
    r.reth = Some(reth::Repr {
        va: IOVA,
        rkey: RKEY,
        dma_len: len,
    });
    let mut b = vec![0u8; r.buffer_len().unwrap()];
    r.emit(&mut b, &[]).unwrap();
    b
}

/// The one packet `qp` answers `request` with: its opcode and the first
/// byte after the BTH (an AETH's syndrome in an ACK).
fn answer(qp: &mut RcQp, mrs: &MrTable, request: &[u8]) -> (u8, u8) {
    qp.handle_packet(Time(1), request, mrs);
    let mut buf = vec![0u8; MAX_HEADER_LEN + 4096];
    let mut pieces = Vec::new();
    qp.poll_transmit(Time(2), mrs, &mut buf, &mut pieces)
        .expect("an answer");
    (buf[0], buf[12])
}

/// As rxe: a QP given no responder resources NAKs READs (and atomics).
#[test]
fn a_read_to_a_qp_without_responder_resources_is_an_invalid_request() {
    let mrs = region();
    assert_eq!(
        answer(&mut rc_qp(0), &mrs, &read_request(100)),
        (Opcode::RC_ACKNOWLEDGE.0, NAK_INVALID_REQUEST)
    );
    // With one resource the same request is served.
    let (opcode, _) = answer(&mut rc_qp(1), &mrs, &read_request(100));
    assert_eq!(opcode, Opcode::RC_RDMA_READ_RESPONSE_ONLY.0);
}

/// A duplicate READ request is replayed only if it names the first one's
/// key and a range inside it (as rxe checks): one asking for other memory
/// under an old PSN gets nothing.
#[test]
fn a_duplicate_read_for_other_memory_is_dropped() {
    let mrs = region();
    let mut qp = rc_qp(4);
    let (opcode, _) = answer(&mut qp, &mrs, &read_request(100));
    assert_eq!(opcode, Opcode::RC_RDMA_READ_RESPONSE_ONLY.0);
    let mut buf = vec![0u8; MAX_HEADER_LEN + 4096];
    let mut pieces = Vec::new();
    let duplicate = |va: u64, rkey: u32, dma_len: u32| {
        let mut r = Repr::new(Opcode::RC_RDMA_READ_REQUEST, 0x11, Psn::new(0), 0);
        r.reth = Some(reth::Repr { va, rkey, dma_len });
        let mut b = vec![0u8; r.buffer_len().unwrap()];
        r.emit(&mut b, &[]).unwrap();
        b
    };
    for (what, request) in [
        ("another key", duplicate(IOVA, RKEY ^ 1, 100)),
        ("past the first READ", duplicate(IOVA + 50, RKEY, 100)),
        ("before the first READ", duplicate(IOVA - 8, RKEY, 100)),
    ] {
        qp.handle_packet(Time(3), &request, &mrs);
        assert!(
            qp.poll_transmit(Time(4), &mrs, &mut buf, &mut pieces)
                .is_none(),
            "{what}: answered"
        );
    }
    // The same request again is replayed.
    let (opcode, _) = answer(&mut qp, &mrs, &duplicate(IOVA, RKEY, 100));
    assert_eq!(opcode, Opcode::RC_RDMA_READ_RESPONSE_ONLY.0);
}

/// A READ beyond IB's 2^31-byte message limit is refused before its key is
/// looked at: its responses could span half the PSN space, where a duplicate
/// request can't be told from a new one.
#[test]
fn a_read_longer_than_two_gib_is_an_invalid_request() {
    let mrs = region();
    assert_eq!(
        answer(&mut rc_qp(4), &mrs, &read_request(0x8000_0100)),
        (Opcode::RC_ACKNOWLEDGE.0, NAK_INVALID_REQUEST)
    );
}

/// An iWARP QP with one 4 KiB receive posted.
fn iwarp_qp_with_a_receive() -> IwarpQp {
    let mut qp = IwarpQp::new(0x11, 1, QpCaps::default(), IwarpConfig::default());
    let sge = Sge {
        addr: IOVA,
        len: 4096,
        lkey: LKEY,
    };
    qp.post_recv(RecvWr::new(9, [sge])).unwrap();
    qp
}

/// An iWARP SEND segment must start where the message's last one ended: one
/// at offset 1000 of a fresh message would have completed the receive with
/// 1 010 bytes, 1 000 of them never sent.
#[test]
fn an_iwarp_send_segment_past_a_gap_is_refused() {
    let mrs = region();
    let mut qp = iwarp_qp_with_a_receive();
    let mut hdr = [0u8; ddp::UNTAGGED_HEADER_LEN];
    let segment = |offset| ddp::Repr {
        last: true,
        rsvd_ulp: rdmap::Opcode::Send.control_byte(),
        placement: ddp::Placement::Untagged {
            rsvd_ulp_word: 0,
            queue: 0,
            msn: 1,
            offset,
        },
    };
    segment(1000).emit(&mut ddp::Segment::new_unchecked(&mut hdr[..]));
    let mut pieces = Vec::new();
    let placement = qp.accept_header(&hdr, 10, &mrs, &mut pieces);
    assert!(matches!(placement, Placement::Discard), "{placement:?}");
    assert!(pieces.is_empty(), "nothing is placed");
    qp.segment_done(&[], true, &mrs);
    while let Some((kind, wc)) = qp.poll_completion() {
        assert!(
            !(kind == CqKind::Recv && wc.status == WcStatus::Success),
            "the receive completed: {wc:?}"
        );
    }
    assert_eq!(qp.state(), QpState::Err, "a Terminate ends the stream");

    // The same segment at offset 0 is placed and completes 10 bytes.
    let mut qp = iwarp_qp_with_a_receive();
    segment(0).emit(&mut ddp::Segment::new_unchecked(&mut hdr[..]));
    let placement = qp.accept_header(&hdr, 10, &mrs, &mut pieces);
    assert!(matches!(placement, Placement::Data), "{placement:?}");
    qp.segment_done(&[], true, &mrs);
    let (kind, wc) = qp.poll_completion().expect("the receive completes");
    assert_eq!(
        (kind, wc.status, wc.byte_len),
        (CqKind::Recv, WcStatus::Success, 10)
    );
}

/// `softrdma decode`: a segment held beyond a gap and then retransmitted is
/// counted once, so filling the gap leaves no phantom one behind.
#[test]
fn a_retransmitted_segment_beyond_a_gap_is_counted_once() {
    use softrdma::capture::{Decoder, Frame, Record};
    fn frame(seq: u32, payload: &[u8]) -> Vec<u8> {
        let b = etherparse::PacketBuilder::ethernet2([1; 6], [2; 6])
            .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
            .tcp(40000, 5000, seq, 65535);
        let mut out = Vec::new();
        b.write(&mut out, payload).unwrap();
        out
    }
    let mut start = b"MPA ID Req Frame".to_vec();
    start.extend_from_slice(&[0x00, 0x01, 0x00, 0x00]); // rev 1, no private data
    let frames = [
        frame(1000, &start),
        frame(1100, &[0u8; 8]),
        frame(1100, &[0u8; 8]),
        frame(1020, &[0u8; 80]),
    ];
    let mut d = Decoder::new();
    let mut problems = Vec::new();
    let mut note = |r: Record| {
        if let Record::Problem(p) = r {
            problems.push(p.message.clone());
        }
    };
    for (i, f) in frames.iter().enumerate() {
        let frame = Frame {
            number: i as u64 + 1,
            time: 1.0,
            linktype: 1,
            data: f,
            original_len: f.len() as u32,
        };
        d.push(&frame, &mut note);
    }
    d.finish(4, &mut note);
    assert!(
        !problems.iter().any(|m| m.contains("never filled")),
        "{problems:?}"
    );
}

/// An ACK for a PSN that was assigned but not yet sent (the message's later
/// packets wait for the window) is ignored: it completed the SEND before, and
/// the rest of its packets were never sent.
#[test]
fn an_ack_for_an_unsent_psn_completes_nothing() {
    use softrdma::engine::{SendOp, SendWr};
    use softrdma::wire::aeth::{self, Syndrome};
    let mrs = region();
    let mut qp = rc_qp(4);
    let sge = Sge {
        addr: IOVA,
        len: 3000,
        lkey: LKEY,
    };
    qp.post_send(SendWr::new(7, SendOp::Send, [sge])).unwrap();
    let mut buf = vec![0u8; MAX_HEADER_LEN + 4096];
    let mut pieces = Vec::new();
    // The first of three packets (1024-byte MTU) goes out.
    assert!(
        qp.poll_transmit(Time(1), &mrs, &mut buf, &mut pieces)
            .is_some()
    );
    let ack = |psn| {
        let mut r = Repr::new(Opcode::RC_ACKNOWLEDGE, 0x11, Psn::new(psn), 0);
        r.aeth = Some(aeth::Repr {
            syndrome: Syndrome::ACK,
            msn: 1,
        });
        let mut b = vec![0u8; r.buffer_len().unwrap()];
        r.emit(&mut b, &[]).unwrap();
        b
    };
    qp.handle_packet(Time(2), &ack(2), &mrs);
    assert!(qp.poll_completion().is_none(), "PSN 2 was never sent");
    // The other two packets go out, and the same ACK then completes it.
    let mut more = 0;
    while qp
        .poll_transmit(Time(3), &mrs, &mut buf, &mut pieces)
        .is_some()
    {
        more += 1;
    }
    assert_eq!(more, 2);
    qp.handle_packet(Time(4), &ack(2), &mrs);
    let (kind, wc) = qp.poll_completion().expect("completed");
    assert_eq!(
        (kind, wc.wr_id, wc.status),
        (CqKind::Send, 7, WcStatus::Success)
    );
}
