//! Base transport header (IBTA vol. 1, 9.2), 12 bytes, first in every RoCEv2 payload.

use core::fmt;

use crate::bytes::{get_u16, get_u24, set_u16, set_u24};
use crate::{Error, Opcode, Psn, Result};

mod field {
    use crate::bytes::Field;
    pub const OPCODE: usize = 0;
    /// SE (7), M (6), PadCnt (5-4), TVer (3-0).
    pub const FLAGS: usize = 1;
    pub const PKEY: Field = 2..4;
    /// FECN (7), BECN (6), reserved (5-0).
    pub const FECN_BECN: usize = 4;
    pub const DEST_QP: Field = 5..8;
    /// AckReq (7), reserved (6-0).
    pub const ACK_REQ: usize = 8;
    pub const PSN: Field = 9..12;
}

/// Length of the BTH.
pub const HEADER_LEN: usize = 12;
/// The only transport header version there is.
pub const TRANSPORT_VERSION: u8 = 0;
/// The default partition key, full member.
pub const DEFAULT_PKEY: u16 = 0xffff;

crate::bytes::fixed_header_view!(
    /// A view of a BTH.
    Header, "BTH", HEADER_LEN
);

impl<T: AsRef<[u8]>> Header<T> {
    /// Opcode.
    pub fn opcode(&self) -> Opcode {
        Opcode(self.buffer.as_ref()[field::OPCODE])
    }
    /// Solicited event.
    pub fn solicited(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & 0x80 != 0
    }
    /// Migration request.
    pub fn mig_req(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & 0x40 != 0
    }
    /// Pad bytes after the payload.
    pub fn pad_count(&self) -> u8 {
        (self.buffer.as_ref()[field::FLAGS] >> 4) & 0x3
    }
    /// Transport header version.
    pub fn transport_version(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS] & 0x0f
    }
    /// Partition key.
    pub fn pkey(&self) -> u16 {
        get_u16(self.buffer.as_ref(), field::PKEY)
    }
    /// Forward explicit congestion notification.
    pub fn fecn(&self) -> bool {
        self.buffer.as_ref()[field::FECN_BECN] & 0x80 != 0
    }
    /// Backward explicit congestion notification.
    pub fn becn(&self) -> bool {
        self.buffer.as_ref()[field::FECN_BECN] & 0x40 != 0
    }
    /// The six reserved bits after FECN/BECN.
    pub fn reserved6(&self) -> u8 {
        self.buffer.as_ref()[field::FECN_BECN] & 0x3f
    }
    /// Destination queue pair number (24 bits).
    pub fn dest_qp(&self) -> u32 {
        get_u24(self.buffer.as_ref(), field::DEST_QP)
    }
    /// Acknowledge request.
    pub fn ack_req(&self) -> bool {
        self.buffer.as_ref()[field::ACK_REQ] & 0x80 != 0
    }
    /// The seven reserved bits after AckReq.
    pub fn reserved7(&self) -> u8 {
        self.buffer.as_ref()[field::ACK_REQ] & 0x7f
    }
    /// Packet sequence number.
    pub fn psn(&self) -> Psn {
        Psn::new(get_u24(self.buffer.as_ref(), field::PSN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Header<T> {
    fn flag(&mut self, byte: usize, mask: u8, on: bool) {
        let b = &mut self.buffer.as_mut()[byte];
        *b = if on { *b | mask } else { *b & !mask };
    }
    /// Sets the opcode.
    pub fn set_opcode(&mut self, op: Opcode) {
        self.buffer.as_mut()[field::OPCODE] = op.0;
    }
    /// Sets the solicited event bit.
    pub fn set_solicited(&mut self, on: bool) {
        self.flag(field::FLAGS, 0x80, on);
    }
    /// Sets the migration request bit.
    pub fn set_mig_req(&mut self, on: bool) {
        self.flag(field::FLAGS, 0x40, on);
    }
    /// Sets the pad count (0..=3).
    pub fn set_pad_count(&mut self, pad: u8) {
        let b = &mut self.buffer.as_mut()[field::FLAGS];
        *b = (*b & !0x30) | ((pad & 0x3) << 4);
    }
    /// Sets the transport header version.
    pub fn set_transport_version(&mut self, v: u8) {
        let b = &mut self.buffer.as_mut()[field::FLAGS];
        *b = (*b & 0xf0) | (v & 0x0f);
    }
    /// Sets the partition key.
    pub fn set_pkey(&mut self, pkey: u16) {
        set_u16(self.buffer.as_mut(), field::PKEY, pkey);
    }
    /// Sets FECN.
    pub fn set_fecn(&mut self, on: bool) {
        self.flag(field::FECN_BECN, 0x80, on);
    }
    /// Sets BECN.
    pub fn set_becn(&mut self, on: bool) {
        self.flag(field::FECN_BECN, 0x40, on);
    }
    /// Sets the six reserved bits of byte 4.
    pub fn set_reserved6(&mut self, v: u8) {
        let b = &mut self.buffer.as_mut()[field::FECN_BECN];
        *b = (*b & 0xc0) | (v & 0x3f);
    }
    /// Sets the destination QP (24 bits).
    pub fn set_dest_qp(&mut self, qpn: u32) {
        set_u24(self.buffer.as_mut(), field::DEST_QP, qpn & 0xff_ffff);
    }
    /// Sets AckReq.
    pub fn set_ack_req(&mut self, on: bool) {
        self.flag(field::ACK_REQ, 0x80, on);
    }
    /// Sets the seven reserved bits of byte 8.
    pub fn set_reserved7(&mut self, v: u8) {
        let b = &mut self.buffer.as_mut()[field::ACK_REQ];
        *b = (*b & 0x80) | (v & 0x7f);
    }
    /// Sets the PSN.
    pub fn set_psn(&mut self, psn: Psn) {
        set_u24(self.buffer.as_mut(), field::PSN, psn.value());
    }
}

/// The fields of a BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// Opcode.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// Migration request.
    pub mig_req: bool,
    /// Pad bytes after the payload (0..=3).
    pub pad_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// Forward congestion notification.
    pub fecn: bool,
    /// Backward congestion notification.
    pub becn: bool,
    /// Destination QP (24 bits).
    pub dest_qp: u32,
    /// Acknowledge request.
    pub ack_req: bool,
    /// Packet sequence number.
    pub psn: Psn,
}

impl Repr {
    /// A BTH as RC and UD senders write it: no solicited event, migration
    /// request, congestion mark or ACK request, the default partition key.
    pub const fn new(opcode: Opcode, dest_qp: u32, psn: Psn, pad_count: u8) -> Repr {
        Repr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_count,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp,
            ack_req: false,
            psn,
        }
    }

    /// Parses a BTH. Rejects a transport version other than 0 and nonzero reserved
    /// bits, as rxe does; the opcode is checked by [`crate::packet`].
    pub fn parse<T: AsRef<[u8]>>(h: &Header<T>) -> Result<Repr> {
        h.check_len()?;
        if h.transport_version() != TRANSPORT_VERSION {
            return Err(Error::UnsupportedVersion {
                field: "BTH transport version",
                value: h.transport_version(),
            });
        }
        if h.reserved7() != 0 {
            return Err(Error::InvalidField {
                field: "BTH reserved bits after AckReq",
                value: h.reserved7().into(),
            });
        }
        Ok(Repr {
            opcode: h.opcode(),
            solicited: h.solicited(),
            mig_req: h.mig_req(),
            pad_count: h.pad_count(),
            pkey: h.pkey(),
            fecn: h.fecn(),
            becn: h.becn(),
            dest_qp: h.dest_qp(),
            ack_req: h.ack_req(),
            psn: h.psn(),
        })
    }

    /// Bytes the header takes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header; reserved bits become zero.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        // Three big-endian words, not a setter per field: every packet sent
        // passes here.
        let flags = u32::from(self.solicited) << 7
            | u32::from(self.mig_req) << 6
            | u32::from(self.pad_count & 0x3) << 4
            | u32::from(TRANSPORT_VERSION);
        let words = [
            u32::from(self.opcode.0) << 24 | flags << 16 | u32::from(self.pkey),
            u32::from(self.fecn) << 31 | u32::from(self.becn) << 30 | (self.dest_qp & 0xff_ffff),
            u32::from(self.ack_req) << 31 | self.psn.value(),
        ];
        let b = &mut h.buffer.as_mut()[..HEADER_LEN];
        for (to, w) in b.chunks_exact_mut(4).zip(words) {
            to.copy_from_slice(&w.to_be_bytes());
        }
    }
}

/// Pad bytes needed after `payload_len` bytes so that the payload ends on 4 bytes.
pub const fn pad_for(payload_len: usize) -> u8 {
    (payload_len.wrapping_neg() & 3) as u8
}

impl fmt::Display for Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} dqp={:#08x} psn={}",
            self.opcode, self.dest_qp, self.psn
        )?;
        if self.ack_req {
            f.write_str(" A")?;
        }
        if self.solicited {
            f.write_str(" SE")?;
        }
        if self.mig_req {
            f.write_str(" M")?;
        }
        if self.pad_count != 0 {
            write!(f, " pad={}", self.pad_count)?;
        }
        if self.pkey != DEFAULT_PKEY {
            write!(f, " pkey={:#06x}", self.pkey)?;
        }
        if self.fecn {
            f.write_str(" FECN")?;
        }
        if self.becn {
            f.write_str(" BECN")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // rxe_write_bw.pcap frame 99: an ACK.
    const ACK: [u8; 12] = [
        0x11, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x00, 0x03, 0x7d, 0x59,
    ];
    // rxe_read_bw.pcap frame 24: READ REQUEST with AckReq.
    const READ_REQ: [u8; 12] = [
        0x0c, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x86, 0xca, 0x48,
    ];

    fn ack_repr() -> Repr {
        Repr {
            opcode: Opcode::RC_ACKNOWLEDGE,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp: 0x11,
            ack_req: false,
            psn: Psn::new(0x037d59),
        }
    }

    #[test]
    fn deconstruct() {
        let h = Header::new_checked(&READ_REQ[..]).unwrap();
        assert_eq!(h.opcode(), Opcode::RC_RDMA_READ_REQUEST);
        assert!(h.ack_req());
        assert!(!h.solicited());
        assert_eq!(h.pkey(), 0xffff);
        assert_eq!(h.dest_qp(), 0x11);
        assert_eq!(h.psn().value(), 0x86ca48);
        assert_eq!(h.transport_version(), 0);
    }

    #[test]
    fn construct() {
        let mut buf = [0xa5u8; 12];
        let mut h = Header::new_unchecked(&mut buf[..]);
        ack_repr().emit(&mut h);
        assert_eq!(buf, ACK);
    }

    #[test]
    fn parse() {
        let h = Header::new_checked(&ACK[..]).unwrap();
        assert_eq!(Repr::parse(&h).unwrap(), ack_repr());
        assert_eq!(
            ack_repr().to_string(),
            "RC ACKNOWLEDGE dqp=0x000011 psn=0x037d59"
        );
    }

    #[test]
    fn malformed() {
        assert_eq!(
            Header::new_checked(&ACK[..11]).unwrap_err(),
            Error::Truncated {
                header: "BTH",
                needed: 12,
                available: 11
            }
        );
        let mut bad = ACK;
        bad[1] = 0x01;
        let err = Repr::parse(&Header::new_unchecked(&bad[..])).unwrap_err();
        assert!(matches!(err, Error::UnsupportedVersion { value: 1, .. }));
        let mut bad = ACK;
        bad[8] = 0x01;
        let err = Repr::parse(&Header::new_unchecked(&bad[..])).unwrap_err();
        assert!(matches!(err, Error::InvalidField { .. }));
    }

    #[test]
    fn pads() {
        assert_eq!(pad_for(0), 0);
        assert_eq!(pad_for(1), 3);
        assert_eq!(pad_for(2), 2);
        assert_eq!(pad_for(3), 1);
        assert_eq!(pad_for(1024), 0);
    }

    prop_compose! {
        pub fn any_repr()(op in any::<u8>(), se: bool, m: bool, pad in 0u8..4, pkey: u16,
                          fecn: bool, becn: bool, qp in 0u32..(1 << 24), a: bool,
                          psn in 0u32..(1 << 24)) -> Repr {
            Repr { opcode: Opcode(op), solicited: se, mig_req: m, pad_count: pad, pkey, fecn,
                   becn, dest_qp: qp, ack_req: a, psn: Psn::new(psn) }
        }
    }

    proptest! {
        #[test]
        fn round_trip(r in any_repr()) {
            let mut buf = [0u8; HEADER_LEN];
            r.emit(&mut Header::new_unchecked(&mut buf[..]));
            prop_assert_eq!(Repr::parse(&Header::new_checked(&buf[..]).unwrap()).unwrap(), r);
        }
    }
}
