//! QP 1, the general services interface of a RoCEv2 device: the packets
//! that carry the IB connection manager's MADs (rdma_cm over RoCE). The
//! provider hands their MADs to its bookkeeping (`provider::gsi`, for
//! `cm::roce`); a CM REQ for a port nothing listens on gets a REJ at once,
//! reason 8 ("invalid Service ID"), as Linux answers a REQ that no listener
//! takes: the peer's rdma_connect fails in milliseconds with
//! RDMA_CM_EVENT_REJECTED instead of retrying for over a minute. A SIDR_REQ
//! gets its SIDR_REP "unsupported" as Linux answers it. Other MADs are
//! dropped.

use softrdma_wire::cm;
use softrdma_wire::deth::{self, GSI_QKEY};
use softrdma_wire::mad::MAD_LEN;
use softrdma_wire::packet::{Packet, Repr};
use softrdma_wire::{Opcode, Psn};

/// The GSI's QP number.
pub const GSI_QPN: u32 = 1;

/// A GSI packet: BTH, DETH, the MAD and the ICRC.
pub const MAD_PACKET_LEN: usize = 12 + 8 + MAD_LEN + 4;

/// The MAD `packet` (BTH through ICRC, its ICRC checked) carries, if it is
/// a UD SEND to the GSI with the GSI's Q_Key and a whole MAD.
pub fn gsi_mad(packet: &[u8]) -> Option<&[u8]> {
    let p = Packet::new_checked(packet).ok()?;
    if p.bth().opcode() != Opcode::UD_SEND_ONLY || p.bth().dest_qp() != GSI_QPN {
        return None;
    }
    let d = p.deth()?;
    if d.qkey() != GSI_QKEY || p.payload().len() < MAD_LEN {
        return None;
    }
    let at = p.header_len();
    Some(&packet[at..at + MAD_LEN])
}

/// Writes the GSI packet carrying `mad` to the peer's QP 1, with PSN `psn`,
/// into `out`, its ICRC left for the sender to fill.
pub fn mad_packet(mad: &[u8; MAD_LEN], psn: u32, out: &mut [u8; MAD_PACKET_LEN]) -> Option<()> {
    let mut r = Repr::new(Opcode::UD_SEND_ONLY, GSI_QPN, Psn::new(psn), MAD_LEN);
    // As rxe's GSI sends its MADs (WIRE-NOTES 4).
    r.bth.ack_req = true;
    r.deth = Some(deth::Repr {
        qkey: GSI_QKEY,
        src_qp: GSI_QPN,
    });
    r.emit(&mut out[..], mad).ok()
}

/// The refusal answering `packet` (BTH through ICRC, its ICRC checked) as
/// if nothing listened, if it is a request to the GSI: a REJ for a CM REQ,
/// a SIDR_REP "unsupported" for a SIDR_REQ. Written into `out` with its
/// ICRC left for the sender to fill; `None` for anything else.
pub fn refuse_request(packet: &[u8], out: &mut [u8; MAD_PACKET_LEN]) -> Option<()> {
    // A CM Send of class version 2 (what `parse` takes) from here on.
    let m = cm::Message::parse(gsi_mad(packet)?).ok()??;
    let mut answer = [0u8; MAD_LEN];
    match m.body {
        cm::Body::Req(r) => {
            cm::Rej::of_req(r.local_comm_id, cm::REJ_INVALID_SERVICE_ID).emit(m.tid, &mut answer)
        }
        cm::Body::SidrReq(r) => {
            cm::SidrRep::refusal(&r, cm::SIDR_UNSUPPORTED).emit(m.tid, &mut answer)
        }
        _ => return None,
    }
    mad_packet(&answer, 0, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use softrdma_wire::mad;
    use softrdma_wire::packet::Packet;

    /// A CM REQ as rxe's GSI sends it, with the REQ's local communication
    /// ID and transaction ID of `rxe_rping.pcap` frame 3.
    fn req(attribute: u16) -> Vec<u8> {
        let mut mad = [0u8; MAD_LEN];
        mad::Repr {
            mgmt_class: mad::CLASS_CM,
            class_version: 2,
            method: mad::METHOD_SEND,
            status: 0,
            class_specific: 0,
            transaction_id: 0x2_74b8_8d6c,
            attribute_id: attribute,
            attribute_modifier: 0,
        }
        .emit(&mut mad::Header::new_unchecked(&mut mad[..24]));
        mad[24..28].copy_from_slice(&0x6c8d_b874u32.to_be_bytes());
        let mut r = Repr::new(Opcode::UD_SEND_ONLY, GSI_QPN, Psn::new(0), MAD_LEN);
        r.deth = Some(deth::Repr {
            qkey: GSI_QKEY,
            src_qp: GSI_QPN,
        });
        let mut p = vec![0u8; r.buffer_len().unwrap()];
        r.emit(&mut p, &mad).unwrap();
        p
    }

    #[test]
    fn a_cm_req_is_rejected_for_an_invalid_service_id() {
        let mut out = [0u8; MAD_PACKET_LEN];
        refuse_request(&req(mad::CM_REQ), &mut out).expect("a REJ");
        let p = Packet::new_checked(&out[..]).unwrap();
        assert_eq!(
            (p.bth().opcode(), p.bth().dest_qp(), p.bth().pkey()),
            (Opcode::UD_SEND_ONLY, GSI_QPN, 0xffff)
        );
        let d = p.deth().unwrap();
        assert_eq!((d.qkey(), d.src_qp()), (GSI_QKEY, GSI_QPN));
        let m = p.payload();
        let h = mad::Repr::parse(&mad::Header::new_checked(&m[..24]).unwrap()).unwrap();
        assert_eq!(h.to_string(), "MAD CM REJ Send tid=0x274b88d6c");
        // Local comm ID 0, remote = the REQ's local, the REQ rejected, no
        // ARI, reason 8.
        assert_eq!(&m[24..36], [0, 0, 0, 0, 0x6c, 0x8d, 0xb8, 0x74, 0, 0, 0, 8]);
        assert!(m[36..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_sidr_req_gets_its_unsupported_answer() {
        let mut out = [0u8; MAD_PACKET_LEN];
        let mut p = req(cm::SIDR_REQ);
        let service = cm::rdma_cm_udp_service_id(7174);
        p[20 + 32..20 + 40].copy_from_slice(&service.to_be_bytes());
        refuse_request(&p, &mut out).expect("a SIDR_REP");
        let p = Packet::new_checked(&out[..]).unwrap();
        assert_eq!(p.bth().dest_qp(), GSI_QPN);
        let m = cm::Message::parse(p.payload()).unwrap().unwrap();
        assert_eq!(m.tid, 0x2_74b8_8d6c);
        let cm::Body::SidrRep(r) = m.body else {
            panic!("{m:?}")
        };
        assert_eq!(
            (r.request_id, r.status, r.qpn, r.service_id),
            (0x6c8d_b874, cm::SIDR_UNSUPPORTED, 0, service)
        );
    }

    #[test]
    fn other_mads_and_packets_get_no_answer() {
        let mut out = [0u8; MAD_PACKET_LEN];
        for attr in [mad::CM_REJ, 0x0013, 0x0015, cm::SIDR_REP] {
            assert!(refuse_request(&req(attr), &mut out).is_none(), "{attr:#x}");
        }
        let mut wrong_qkey = req(mad::CM_REQ);
        wrong_qkey[12] ^= 1;
        assert!(refuse_request(&wrong_qkey, &mut out).is_none());
        let good = req(mad::CM_REQ);
        for cut in [0, 12, 20, 100, good.len() - 5] {
            assert!(refuse_request(&good[..cut], &mut out).is_none(), "{cut}");
        }
    }
}
