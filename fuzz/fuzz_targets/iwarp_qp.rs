//! An iWARP QP fed hostile DDP segments, as the TCP provider hands them over
//! (the header, where its payload goes, then whether the MPA CRC held), and a
//! few work requests of its own, so that hostile READ Responses and
//! Terminates meet outstanding READs: it must never panic, place outside its
//! region or place more than a segment carries, and what it sends must fit
//! its FPDUs.
//!
//! Input: a control byte (bit 0: the QP takes its receives from an SRQ),
//! then segments, each a flags byte (bit 0: the CRC
//! held; bit 1: send and reap after it; bit 2: patch a tagged segment's STag
//! to the region's and fold its TO near it, or an untagged one's MSN near
//! the expected; bit 3: set the QP's access flags first, REMOTE_WRITE from
//! bit 5 and REMOTE_READ from bit 6), a 2-byte little-endian payload length,
//! the DDP header (14 bytes if the first byte's top bit says tagged, else 18)
//! and the payload. A WRITE with payload is never placed past a QP that
//! does not allow WRITEs.
#![no_main]
use std::sync::{Arc, Mutex};

use libfuzzer_sys::fuzz_target;
use softrdma::engine::iwarp::{IwarpConfig, IwarpQp, MAX_HEADER_LEN, Placement};
use softrdma::engine::rc::QpCaps;
use softrdma::engine::srq::Srq;
use softrdma::engine::{RecvWr, SendFlags, SendOp, SendWr, Sge};
use softrdma::memory::{Access, MrTable, Region, RegionMemory};

const IOVA: u64 = 0x10_0000;
const REGION: usize = 65536;
const LKEY: u32 = 0x100;
const RKEY: u32 = 0x200;

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, mut rest)) = data.split_first() else {
        return;
    };
    let mem = Arc::new(RegionMemory::zeroed(REGION).unwrap());
    let mut mrs = MrTable::new();
    let access = Access::from_bits(u32::from(ctl) & 0xe);
    mrs.insert(Region::new(1, (LKEY, RKEY), mem, 0, REGION, IOVA, access).unwrap());
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 64,
    };
    let cfg = IwarpConfig {
        // 64 (the floor) to 1 024: small FPDUs cut messages into many.
        max_ulpdu: 64 + usize::from(ctl & 0xc0) * 4,
        ird: 2,
        ord: 2,
        ..IwarpConfig::default()
    };
    let max_ulpdu = cfg.max_ulpdu;
    let mut qp = IwarpQp::new(0x11, 1, caps, cfg);
    let sge = |at: u64, len| Sge {
        addr: IOVA + at,
        len,
        lkey: LKEY,
    };
    if ctl & 1 != 0 {
        // Receives from an SRQ: each SEND that starts takes one.
        let srq = Arc::new(Mutex::new(Srq::new(1, 4, 2)));
        for k in 0..3 {
            let wr = RecvWr::new(10 + k, [sge(k * 4000, 3000)]);
            srq.lock().unwrap().post_recv(wr).unwrap();
        }
        qp = qp.with_srq(srq);
        assert!(qp.post_recv(RecvWr::new(1, [sge(0, 8)])).is_err());
    } else if ctl & 0x10 != 0 {
        let _ = qp.post_recv(RecvWr::new(1, [sge(0, 3000)]));
    }
    if ctl & 0x20 != 0 {
        let flags = SendFlags {
            signaled: true,
            ..SendFlags::default()
        };
        for op in [
            SendOp::Send,
            SendOp::Read {
                remote_addr: 0,
                rkey: 1,
            },
            SendOp::Write {
                remote_addr: 0,
                rkey: 1,
            },
        ] {
            let _ = qp.post_send(SendWr {
                wr_id: 2,
                op,
                sgl: vec![sge(8192, 5000)].into(),
                flags,
                ud: None,
                inline_data: Default::default(),
            });
        }
    }
    let mut buf = vec![0u8; MAX_HEADER_LEN + 64];
    let mut pieces = Vec::new();
    let mut send_and_reap = |qp: &mut IwarpQp, mrs: &MrTable| {
        for _ in 0..10_000 {
            let Some(t) = qp.poll_transmit(mrs, &mut buf, &mut pieces) else {
                break;
            };
            assert!(t.header_len <= buf.len(), "a header past the buffer");
            assert_eq!(pieces.iter().map(|p| p.len()).sum::<usize>(), t.payload_len);
            assert!(t.ulpdu_len <= max_ulpdu, "an FPDU past the ULPDU limit");
            assert_eq!(t.header_len - 2 + t.payload_len, t.ulpdu_len);
        }
        qp.transmitted();
        while qp.poll_completion().is_some() {}
        while qp.poll_event().is_some() {}
    };
    send_and_reap(&mut qp, &mrs);
    let mut place = Vec::new();
    while rest.len() >= 4 {
        let flags = rest[0];
        let payload_len = usize::from(u16::from_le_bytes([rest[1], rest[2]]));
        let tagged = rest[3] & 0x80 != 0;
        let hlen = (if tagged { 14 } else { 18 }).min(rest.len() - 3);
        let mut hdr = rest[3..3 + hlen].to_vec();
        rest = &rest[3 + hlen..];
        let n = payload_len.min(rest.len());
        let payload = &rest[..n];
        rest = &rest[n..];
        if flags & 4 != 0 && hdr.len() >= 14 {
            if tagged {
                hdr[2..6].copy_from_slice(&RKEY.to_be_bytes());
                let to = u64::from_be_bytes(hdr[6..14].try_into().unwrap());
                let to = IOVA + to % (REGION as u64 + 256);
                hdr[6..14].copy_from_slice(&to.to_be_bytes());
            } else {
                let msn = u32::from_be_bytes(hdr[10..14].try_into().unwrap());
                hdr[10..14].copy_from_slice(&(1 + msn % 4).to_be_bytes());
            }
        }
        if flags & 8 != 0 {
            qp.set_access(Access::from_bits(u32::from(flags >> 4) & 6));
        }
        // RDMAP's opcode 0 in a tagged segment: a WRITE.
        let write = tagged && hdr.len() >= 2 && hdr[1] & 0x0f == 0 && !payload.is_empty();
        let forbidden = write && !qp.access().contains(Access::REMOTE_WRITE);
        let mut control: &[u8] = &[];
        match qp.accept_header(&hdr, payload.len(), &mrs, &mut place) {
            Placement::Data => {
                assert!(!forbidden, "a WRITE placed past the QP's access flags");
                assert_eq!(
                    place.iter().map(|p| p.len()).sum::<usize>(),
                    payload.len(),
                    "pieces that do not add up to the payload"
                );
                let mut off = 0;
                // Segment::write panics past its piece, and a piece past its
                // region cannot be made: so this also checks the bounds.
                for p in &place {
                    p.write(0, &payload[off..off + p.len()]);
                    off += p.len();
                }
            }
            Placement::Control => control = payload,
            Placement::Discard => {}
        }
        qp.segment_done(control, flags & 1 != 0, &mrs);
        if flags & 2 != 0 {
            send_and_reap(&mut qp, &mrs);
        }
    }
    send_and_reap(&mut qp, &mrs);
    qp.connection_lost();
    send_and_reap(&mut qp, &mrs);
});
