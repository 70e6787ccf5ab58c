//! A whole InfiniBand transport packet as RoCEv2 carries it in a UDP datagram:
//! BTH, the extension headers its opcode calls for (in wire order), payload,
//! pad, and the 4-byte ICRC.

use core::fmt;

use crate::opcode::{Headers, OpcodeInfo};
use crate::{Error, Opcode, Result, aeth, atomic, bth, deth, icrc, imm, reth};

/// A view of a RoCEv2 InfiniBand packet (BTH through ICRC).
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checking it; accessors may panic on a bad one.
    pub const fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// Wraps a buffer after checking that it holds a BTH with a known opcode,
    /// that opcode's extension headers, the pad the BTH announces, and an ICRC.
    pub fn new_checked(buffer: T) -> Result<Packet<T>> {
        let p = Packet::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Checks what [`Packet::new_checked`] checks.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        let h = bth::Header::new_checked(b)?;
        let info = h
            .opcode()
            .info()
            .ok_or(Error::UnknownOpcode(h.opcode().0))?;
        let need = info.header_len() + usize::from(h.pad_count()) + icrc::LEN;
        if b.len() < need {
            return Err(Error::Truncated {
                header: info.name,
                needed: need,
                available: b.len(),
            });
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The BTH.
    pub fn bth(&self) -> bth::Header<&[u8]> {
        bth::Header::new_unchecked(&self.buffer.as_ref()[..bth::HEADER_LEN])
    }

    /// The opcode.
    pub fn opcode(&self) -> Opcode {
        Opcode(self.buffer.as_ref()[0])
    }

    /// The opcode's table row.
    ///
    /// # Panics
    /// On an unknown opcode, which [`Packet::new_checked`] rules out.
    pub fn info(&self) -> &'static OpcodeInfo {
        self.opcode()
            .info()
            .expect("packet checked for a known opcode")
    }

    fn ext(&self, which: Headers) -> Option<&[u8]> {
        let info = self.info();
        let off = bth::HEADER_LEN + info.headers.offset_of(which)?;
        Some(&self.buffer.as_ref()[off..info.header_len()])
    }

    /// The DETH, if the opcode has one.
    pub fn deth(&self) -> Option<deth::Header<&[u8]>> {
        self.ext(Headers::DETH).map(deth::Header::new_unchecked)
    }
    /// The RETH, if the opcode has one.
    pub fn reth(&self) -> Option<reth::Header<&[u8]>> {
        self.ext(Headers::RETH).map(reth::Header::new_unchecked)
    }
    /// The AtomicETH, if the opcode has one.
    pub fn atomic_eth(&self) -> Option<atomic::Header<&[u8]>> {
        self.ext(Headers::ATOMIC_ETH)
            .map(atomic::Header::new_unchecked)
    }
    /// The AETH, if the opcode has one.
    pub fn aeth(&self) -> Option<aeth::Header<&[u8]>> {
        self.ext(Headers::AETH).map(aeth::Header::new_unchecked)
    }
    /// The AtomicAckETH, if the opcode has one.
    pub fn atomic_ack_eth(&self) -> Option<atomic::AckHeader<&[u8]>> {
        self.ext(Headers::ATOMIC_ACK_ETH)
            .map(atomic::AckHeader::new_unchecked)
    }
    /// The immediate data, if the opcode carries it.
    pub fn immediate(&self) -> Option<u32> {
        self.ext(Headers::IMM_DT)
            .map(|b| imm::Header::new_unchecked(b).value())
    }
    /// The R_Key to invalidate, if the opcode carries an IETH.
    pub fn invalidate_rkey(&self) -> Option<u32> {
        self.ext(Headers::IETH)
            .map(|b| imm::Header::new_unchecked(b).value())
    }

    /// Bytes of BTH and extension headers.
    pub fn header_len(&self) -> usize {
        self.info().header_len()
    }

    fn payload_end(&self) -> usize {
        self.buffer.as_ref().len() - icrc::LEN - usize::from(self.bth().pad_count())
    }

    /// The payload, without pad.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..self.payload_end()]
    }

    /// The pad bytes.
    pub fn pad(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[self.payload_end()..b.len() - icrc::LEN]
    }

    /// Everything the ICRC covers after the IP and UDP headers (BTH to pad).
    pub fn covered(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[..b.len() - icrc::LEN]
    }

    /// The ICRC the packet carries.
    pub fn icrc(&self) -> u32 {
        let b = self.buffer.as_ref();
        let mut v = [0u8; icrc::LEN];
        v.copy_from_slice(&b[b.len() - icrc::LEN..]);
        u32::from_le_bytes(v)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// The payload, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let (start, end) = (self.header_len(), self.payload_end());
        &mut self.buffer.as_mut()[start..end]
    }

    /// Sets the ICRC trailer.
    pub fn set_icrc(&mut self, crc: u32) {
        let b = self.buffer.as_mut();
        let n = b.len();
        b[n - icrc::LEN..].copy_from_slice(&crc.to_le_bytes());
    }
}

/// The headers of a RoCEv2 packet, and the length of its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// Base transport header.
    pub bth: bth::Repr,
    /// DETH (UD).
    pub deth: Option<deth::Repr>,
    /// RETH (WRITE first/only, READ request).
    pub reth: Option<reth::Repr>,
    /// AtomicETH (atomics).
    pub atomic: Option<atomic::Repr>,
    /// AETH (ACK, READ response, atomic ACK).
    pub aeth: Option<aeth::Repr>,
    /// Original value of an atomic ACK.
    pub atomic_ack: Option<u64>,
    /// Immediate data.
    pub immediate: Option<u32>,
    /// R_Key to invalidate.
    pub invalidate_rkey: Option<u32>,
    /// Payload bytes (pad excluded).
    pub payload_len: usize,
}

impl Repr {
    /// A packet of `opcode` with no extension headers filled in yet: set the ones
    /// the opcode needs. The pad count follows from `payload_len`.
    pub fn new(opcode: Opcode, dest_qp: u32, psn: crate::Psn, payload_len: usize) -> Repr {
        Repr {
            bth: bth::Repr::new(opcode, dest_qp, psn, bth::pad_for(payload_len)),
            deth: None,
            reth: None,
            atomic: None,
            aeth: None,
            atomic_ack: None,
            immediate: None,
            invalidate_rkey: None,
            payload_len,
        }
    }

    /// Parses a checked packet.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        p.check_len()?;
        let bth = bth::Repr::parse(&p.bth())?;
        let info = p.info();
        let payload_len = p.payload().len();
        if !info.has_payload && payload_len != 0 {
            return Err(Error::InvalidField {
                field: "payload length of an opcode without payload",
                value: payload_len as u64,
            });
        }
        Ok(Repr {
            bth,
            deth: p.deth().map(|h| deth::Repr::parse(&h)).transpose()?,
            reth: p.reth().map(|h| reth::Repr::parse(&h)).transpose()?,
            atomic: p
                .atomic_eth()
                .map(|h| atomic::Repr::parse(&h))
                .transpose()?,
            aeth: p.aeth().map(|h| aeth::Repr::parse(&h)).transpose()?,
            atomic_ack: p.atomic_ack_eth().map(|h| h.original()),
            immediate: p.immediate(),
            invalidate_rkey: p.invalidate_rkey(),
            payload_len,
        })
    }

    /// The opcode's table row, or an error for an unknown opcode.
    pub fn info(&self) -> Result<&'static OpcodeInfo> {
        self.bth
            .opcode
            .info()
            .ok_or(Error::UnknownOpcode(self.bth.opcode.0))
    }

    /// Bytes of BTH and extension headers.
    pub fn header_len(&self) -> Result<usize> {
        Ok(self.info()?.header_len())
    }

    /// Bytes of the whole packet, BTH through ICRC.
    pub fn buffer_len(&self) -> Result<usize> {
        Ok(self.header_len()? + self.payload_len + usize::from(self.bth.pad_count) + icrc::LEN)
    }

    /// Checks that the extension headers present are exactly the opcode's.
    fn check_headers(&self, info: &OpcodeInfo) -> Result<()> {
        let present = [
            (Headers::DETH, self.deth.is_some()),
            (Headers::RETH, self.reth.is_some()),
            (Headers::ATOMIC_ETH, self.atomic.is_some()),
            (Headers::AETH, self.aeth.is_some()),
            (Headers::ATOMIC_ACK_ETH, self.atomic_ack.is_some()),
            (Headers::IMM_DT, self.immediate.is_some()),
            (Headers::IETH, self.invalidate_rkey.is_some()),
        ]
        .into_iter()
        .fold(
            Headers::NONE,
            |set, (h, is)| if is { set.with(h) } else { set },
        );
        // A CNP's reserved bytes are not a field of the Repr.
        if present != info.headers.without(Headers::CNP_RESERVED) {
            return Err(Error::InvalidField {
                field: "extension headers that do not match the opcode",
                value: u64::from(self.bth.opcode.0),
            });
        }
        if !info.has_payload && self.payload_len != 0 {
            return Err(Error::InvalidField {
                field: "payload length of an opcode without payload",
                value: self.payload_len as u64,
            });
        }
        Ok(())
    }

    /// Writes the BTH and extension headers into the start of `buf`; returns
    /// their length. This is what a sender gathers in front of the payload.
    pub fn emit_header(&self, buf: &mut [u8]) -> Result<usize> {
        let info = self.info()?;
        self.check_headers(info)?;
        let len = info.header_len();
        crate::bytes::check("header buffer", buf, len)?;
        let buf = &mut buf[..len];
        self.bth
            .emit(&mut bth::Header::new_unchecked(&mut buf[..bth::HEADER_LEN]));
        let ext = &mut buf[bth::HEADER_LEN..];
        let at = |h: Headers| info.headers.offset_of(h).unwrap_or(0);
        if let Some(r) = &self.deth {
            r.emit(&mut deth::Header::new_unchecked(
                &mut ext[at(Headers::DETH)..],
            ));
        }
        if let Some(r) = &self.reth {
            r.emit(&mut reth::Header::new_unchecked(
                &mut ext[at(Headers::RETH)..],
            ));
        }
        if let Some(r) = &self.atomic {
            r.emit(&mut atomic::Header::new_unchecked(
                &mut ext[at(Headers::ATOMIC_ETH)..],
            ));
        }
        if let Some(r) = &self.aeth {
            r.emit(&mut aeth::Header::new_unchecked(
                &mut ext[at(Headers::AETH)..],
            ));
        }
        if let Some(v) = self.atomic_ack {
            atomic::AckHeader::new_unchecked(&mut ext[at(Headers::ATOMIC_ACK_ETH)..])
                .set_original(v);
        }
        if let Some(v) = self.immediate {
            imm::Header::new_unchecked(&mut ext[at(Headers::IMM_DT)..]).set_value(v);
        }
        if let Some(v) = self.invalidate_rkey {
            imm::Header::new_unchecked(&mut ext[at(Headers::IETH)..]).set_value(v);
        }
        if info.headers.contains(Headers::CNP_RESERVED) {
            ext[at(Headers::CNP_RESERVED)..].fill(0);
        }
        Ok(len)
    }

    /// Writes the whole packet into `buf` (exactly [`Repr::buffer_len`] bytes):
    /// headers, `payload`, zero pad, and a zero ICRC for [`icrc::fill`] to set.
    pub fn emit(&self, buf: &mut [u8], payload: &[u8]) -> Result<()> {
        let total = self.buffer_len()?;
        if buf.len() != total || payload.len() != self.payload_len {
            return Err(Error::InvalidField {
                field: "buffer or payload length for the packet",
                value: buf.len() as u64,
            });
        }
        let h = self.emit_header(buf)?;
        buf[h..h + payload.len()].copy_from_slice(payload);
        buf[h + payload.len()..].fill(0);
        Ok(())
    }
}

impl fmt::Display for Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bth)?;
        if let Some(h) = &self.deth {
            write!(f, " | {h}")?;
        }
        if let Some(h) = &self.reth {
            write!(f, " | {h}")?;
        }
        if let Some(h) = &self.atomic {
            write!(f, " | {h}")?;
        }
        if let Some(h) = &self.aeth {
            write!(f, " | {h}")?;
        }
        if let Some(v) = self.atomic_ack {
            write!(f, " | AtomicAckETH orig={v:#x}")?;
        }
        if let Some(v) = self.immediate {
            write!(f, " | ImmDt {v:#010x}")?;
        }
        if let Some(v) = self.invalidate_rkey {
            write!(f, " | IETH rkey={v:#x}")?;
        }
        if self.payload_len != 0 {
            write!(f, " | payload {}", self.payload_len)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Psn;
    use crate::aeth::Syndrome;
    use proptest::prelude::*;

    prop_compose! {
        fn any_repr()(op in proptest::sample::select(Opcode::all().collect::<Vec<_>>()),
                      se: bool, fecn: bool, becn: bool, pkey: u16, qp in 0u32..(1 << 24),
                      a: bool, psn in 0u32..(1 << 24), va: u64, rkey: u32, len: u32,
                      swap: u64, cmp: u64, syn: u8, msn in 0u32..(1 << 24), orig: u64,
                      imm: u32, inv: u32, qkey: u32, sqp in 0u32..(1 << 24),
                      payload in 0usize..300) -> Repr {
            let info = op.info().unwrap();
            let payload_len = if info.has_payload { payload } else { 0 };
            let mut r = Repr::new(op, qp, Psn::new(psn), payload_len);
            r.bth.solicited = se;
            r.bth.fecn = fecn;
            r.bth.becn = becn;
            r.bth.pkey = pkey;
            r.bth.ack_req = a;
            let h = info.headers;
            r.deth = h.contains(Headers::DETH).then_some(deth::Repr { qkey, src_qp: sqp });
            r.reth = h.contains(Headers::RETH).then_some(reth::Repr { va, rkey, dma_len: len });
            r.atomic = h.contains(Headers::ATOMIC_ETH)
                .then_some(atomic::Repr { va, rkey, swap_add: swap, compare: cmp });
            r.aeth = h.contains(Headers::AETH)
                .then_some(aeth::Repr { syndrome: Syndrome::from_byte(syn), msn });
            r.atomic_ack = h.contains(Headers::ATOMIC_ACK_ETH).then_some(orig);
            r.immediate = h.contains(Headers::IMM_DT).then_some(imm);
            r.invalidate_rkey = h.contains(Headers::IETH).then_some(inv);
            r
        }
    }

    proptest! {
        #[test]
        fn round_trip(r in any_repr(), fill: u8) {
            let mut buf = vec![0u8; r.buffer_len().unwrap()];
            let payload = vec![fill; r.payload_len];
            r.emit(&mut buf, &payload).unwrap();
            let p = Packet::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(Repr::parse(&p).unwrap(), r);
            prop_assert_eq!(p.payload(), &payload[..]);
            prop_assert_eq!((p.payload().len() + p.pad().len()) % 4, 0);
        }
    }

    // rxe_atomic_bw.pcap frame 29: ATOMIC ACKNOWLEDGE, BTH through ICRC.
    const ATOMIC_ACK: [u8; 28] = [
        0x12, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x00, 0xbe, 0x35, 0x4e, 0x1f, 0x00, 0x00,
        0x01, 0x7e, 0x93, 0xb7, 0x9b, 0x33, 0xe2, 0x41, 0xb6, 0xbf, 0xe4, 0x73, 0x5e,
    ];

    #[test]
    fn parse_atomic_ack() {
        let p = Packet::new_checked(&ATOMIC_ACK[..]).unwrap();
        let r = Repr::parse(&p).unwrap();
        assert_eq!(r.bth.opcode, Opcode::RC_ATOMIC_ACKNOWLEDGE);
        assert_eq!(r.aeth.unwrap().syndrome, Syndrome::ACK);
        assert_eq!(r.atomic_ack, Some(0x7e93_b79b_33e2_41b6));
        assert_eq!(r.payload_len, 0);
        assert_eq!(p.icrc(), 0x5e73_e4bf);
        let mut out = [0u8; 28];
        r.emit(&mut out, &[]).unwrap();
        assert_eq!(out[..24], ATOMIC_ACK[..24]);
        assert_eq!(
            r.to_string(),
            "RC ATOMIC_ACKNOWLEDGE dqp=0x000011 psn=0xbe354e | AETH ACK msn=1 | AtomicAckETH orig=0x7e93b79b33e241b6"
        );
    }

    #[test]
    fn padded_payload() {
        let mut r = Repr::new(
            Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
            0x12,
            Psn::new(7),
            5,
        );
        r.reth = Some(reth::Repr {
            va: 0x1000,
            rkey: 0xabc,
            dma_len: 5,
        });
        r.immediate = Some(0x0102_0304);
        assert_eq!(r.bth.pad_count, 3);
        let mut buf = [0xeeu8; 32 + 5 + 3 + 4];
        assert_eq!(r.buffer_len().unwrap(), buf.len());
        r.emit(&mut buf, b"hello").unwrap();
        let p = Packet::new_checked(&buf[..]).unwrap();
        assert_eq!(p.payload(), b"hello");
        assert_eq!(p.pad(), &[0, 0, 0]);
        assert_eq!(p.immediate(), Some(0x0102_0304));
        assert_eq!(Repr::parse(&p).unwrap(), r);
    }

    #[test]
    fn malformed() {
        assert!(matches!(
            Packet::new_checked(&ATOMIC_ACK[..27]),
            Err(Error::Truncated { .. })
        ));
        let mut bad = ATOMIC_ACK;
        bad[0] = 0x15;
        assert_eq!(
            Packet::new_checked(&bad[..]).unwrap_err(),
            Error::UnknownOpcode(0x15)
        );
        // An ACK with three bytes of pad announced but no room for them.
        let mut ack = [0u8; 20];
        ack[..12].copy_from_slice(&ATOMIC_ACK[..12]);
        ack[0] = 0x11;
        ack[1] = 0x30;
        assert!(Packet::new_checked(&ack[..]).is_err());
        // An ACK with payload.
        let mut ack = [0u8; 24];
        ack[..12].copy_from_slice(&ATOMIC_ACK[..12]);
        ack[0] = 0x11;
        let p = Packet::new_checked(&ack[..]).unwrap();
        assert!(Repr::parse(&p).is_err());
        // Headers that do not match the opcode are refused on emit.
        let r = Repr::new(Opcode::RC_RDMA_WRITE_FIRST, 1, Psn::new(0), 0);
        assert!(r.emit_header(&mut [0u8; 64]).is_err());
        let r = Repr::new(Opcode(0x15), 1, Psn::new(0), 0);
        assert_eq!(r.buffer_len(), Err(Error::UnknownOpcode(0x15)));
        let r = Repr::new(Opcode::RC_SEND_ONLY, 1, Psn::new(0), 4);
        assert!(r.emit(&mut [0u8; 20], b"abc").is_err());
        assert!(r.emit_header(&mut [0u8; 11]).is_err());
    }
}
