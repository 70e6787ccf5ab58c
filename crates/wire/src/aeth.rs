//! ACK extended transport header (IBTA 9.3.5), 4 bytes: syndrome and MSN, in
//! ACKs, NAKs, READ responses (first, last, only) and atomic ACKs.

use core::fmt;

use crate::Result;
use crate::bytes::{get_u24, set_u24};

mod field {
    use crate::bytes::Field;
    pub const SYNDROME: usize = 0;
    pub const MSN: Field = 1..4;
}

/// Length of the AETH.
pub const HEADER_LEN: usize = 4;

/// The NAK codes (IBTA table 43).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NakCode {
    /// PSN sequence error: the responder expected an earlier PSN.
    PsnSequenceError,
    /// Invalid request: bad opcode sequence, length, or an operation the QP forbids.
    InvalidRequest,
    /// Remote access error: R_Key, bounds or access rights.
    RemoteAccessError,
    /// Remote operational error: the responder could not complete the request.
    RemoteOperationalError,
    /// Invalid RD request.
    InvalidRdRequest,
    /// A reserved code (5..=31).
    Reserved(u8),
}

impl NakCode {
    /// The 5-bit code.
    pub const fn code(self) -> u8 {
        match self {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
            NakCode::Reserved(c) => c & 0x1f,
        }
    }

    /// The code of 5 bits.
    pub const fn from_code(c: u8) -> NakCode {
        match c & 0x1f {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            3 => NakCode::RemoteOperationalError,
            4 => NakCode::InvalidRdRequest,
            c => NakCode::Reserved(c),
        }
    }
}

impl fmt::Display for NakCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NakCode::PsnSequenceError => f.write_str("PSN sequence error"),
            NakCode::InvalidRequest => f.write_str("invalid request"),
            NakCode::RemoteAccessError => f.write_str("remote access error"),
            NakCode::RemoteOperationalError => f.write_str("remote operational error"),
            NakCode::InvalidRdRequest => f.write_str("invalid RD request"),
            NakCode::Reserved(c) => write!(f, "reserved NAK code {c}"),
        }
    }
}

/// End-to-end credit count of an ACK (5 bits; IBTA table 45). Code 31 means
/// "invalid": the responder does not do credits (rxe always sends it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CreditCount(u8);

const CREDITS: [u16; 31] = [
    0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
    2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768,
];

impl CreditCount {
    /// No credit information (code 31).
    pub const INVALID: CreditCount = CreditCount(31);

    /// The credit count of a 5-bit code.
    pub const fn from_code(c: u8) -> CreditCount {
        CreditCount(c & 0x1f)
    }
    /// The 5-bit code.
    pub const fn code(self) -> u8 {
        self.0
    }
    /// Receive WQEs the responder has, or `None` for code 31.
    pub const fn credits(self) -> Option<u16> {
        if self.0 < 31 {
            Some(CREDITS[self.0 as usize])
        } else {
            None
        }
    }
}

/// The RNR NAK timer (5 bits; IBTA table 46): how long the requester waits
/// before it retries a request the responder had no receive WQE for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RnrTimer(u8);

const RNR_MICROS: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
    5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122_880, 163_840, 245_760,
    327_680, 491_520,
];

impl RnrTimer {
    /// The timer of a 5-bit code.
    pub const fn from_code(c: u8) -> RnrTimer {
        RnrTimer(c & 0x1f)
    }
    /// The 5-bit code.
    pub const fn code(self) -> u8 {
        self.0
    }
    /// The delay in microseconds (rxe reads code 25 as 61410, the IBTA as 61440).
    pub const fn micros(self) -> u32 {
        RNR_MICROS[self.0 as usize]
    }
    /// The smallest code whose delay is at least `micros` (code 0, the longest, if none).
    pub fn at_least(micros: u32) -> RnrTimer {
        (1..32u8)
            .map(RnrTimer)
            .find(|t| t.micros() >= micros)
            .unwrap_or(RnrTimer(0))
    }
}

/// The AETH syndrome byte: bits 7-5 type, bits 4-0 value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// Positive acknowledgement with a credit count.
    Ack(CreditCount),
    /// Receiver not ready: no receive WQE; retry after the timer.
    RnrNak(RnrTimer),
    /// Negative acknowledgement.
    Nak(NakCode),
    /// Type 0b010, reserved.
    Reserved(u8),
}

impl Syndrome {
    /// An ACK without credits, as rxe sends it (0x1f).
    pub const ACK: Syndrome = Syndrome::Ack(CreditCount::INVALID);

    /// Decodes a syndrome byte.
    pub const fn from_byte(b: u8) -> Syndrome {
        match b >> 5 {
            0b000 => Syndrome::Ack(CreditCount::from_code(b)),
            0b001 => Syndrome::RnrNak(RnrTimer::from_code(b)),
            0b011 => Syndrome::Nak(NakCode::from_code(b)),
            _ => Syndrome::Reserved(b),
        }
    }

    /// Encodes the syndrome byte.
    pub const fn to_byte(self) -> u8 {
        match self {
            Syndrome::Ack(c) => c.code(),
            Syndrome::RnrNak(t) => 0x20 | t.code(),
            Syndrome::Nak(n) => 0x60 | n.code(),
            Syndrome::Reserved(b) => b,
        }
    }

    /// An ACK (positive).
    pub const fn is_ack(self) -> bool {
        matches!(self, Syndrome::Ack(_))
    }
}

impl fmt::Display for Syndrome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Syndrome::Ack(c) => match c.credits() {
                Some(n) => write!(f, "ACK credits={n}"),
                None => f.write_str("ACK"),
            },
            Syndrome::RnrNak(t) => write!(f, "RNR NAK timer={} ({} us)", t.code(), t.micros()),
            Syndrome::Nak(n) => write!(f, "NAK {n}"),
            Syndrome::Reserved(b) => write!(f, "reserved syndrome {b:#04x}"),
        }
    }
}

crate::bytes::fixed_header_view!(
    /// A view of an AETH.
    Header, "AETH", HEADER_LEN
);

impl<T: AsRef<[u8]>> Header<T> {
    /// The raw syndrome byte.
    pub fn syndrome_byte(&self) -> u8 {
        self.buffer.as_ref()[field::SYNDROME]
    }
    /// The decoded syndrome.
    pub fn syndrome(&self) -> Syndrome {
        Syndrome::from_byte(self.syndrome_byte())
    }
    /// Message sequence number (24 bits).
    pub fn msn(&self) -> u32 {
        get_u24(self.buffer.as_ref(), field::MSN)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Header<T> {
    /// Sets the syndrome.
    pub fn set_syndrome(&mut self, s: Syndrome) {
        self.buffer.as_mut()[field::SYNDROME] = s.to_byte();
    }
    /// Sets the MSN (24 bits).
    pub fn set_msn(&mut self, msn: u32) {
        set_u24(self.buffer.as_mut(), field::MSN, msn & 0xff_ffff);
    }
}

/// The fields of an AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// Syndrome.
    pub syndrome: Syndrome,
    /// Message sequence number.
    pub msn: u32,
}

impl Repr {
    /// Parses an AETH.
    pub fn parse<T: AsRef<[u8]>>(h: &Header<T>) -> Result<Repr> {
        h.check_len()?;
        Ok(Repr {
            syndrome: h.syndrome(),
            msn: h.msn(),
        })
    }
    /// Bytes the header takes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }
    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        h.set_syndrome(self.syndrome);
        h.set_msn(self.msn);
    }
}

impl fmt::Display for Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AETH {} msn={}", self.syndrome, self.msn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_ack() {
        // rxe_write_bw.pcap frame 99.
        let bytes = [0x1f, 0x00, 0x00, 0x01];
        let h = Header::new_checked(&bytes[..]).unwrap();
        let r = Repr::parse(&h).unwrap();
        assert_eq!(
            r,
            Repr {
                syndrome: Syndrome::ACK,
                msn: 1
            }
        );
        assert_eq!(r.to_string(), "AETH ACK msn=1");
        let mut buf = [0u8; 4];
        r.emit(&mut Header::new_unchecked(&mut buf[..]));
        assert_eq!(buf, bytes);
        assert!(Header::new_checked(&bytes[..3]).is_err());
    }

    #[test]
    fn syndromes() {
        assert_eq!(Syndrome::from_byte(0x00), Syndrome::Ack(CreditCount(0)));
        assert_eq!(CreditCount(5).credits(), Some(6));
        assert_eq!(CreditCount(30).credits(), Some(32768));
        assert_eq!(CreditCount::INVALID.credits(), None);
        let rnr = Syndrome::from_byte(0x2c);
        assert_eq!(rnr, Syndrome::RnrNak(RnrTimer(12)));
        assert_eq!(RnrTimer(12).micros(), 640);
        assert_eq!(rnr.to_string(), "RNR NAK timer=12 (640 us)");
        assert_eq!(
            Syndrome::from_byte(0x60),
            Syndrome::Nak(NakCode::PsnSequenceError)
        );
        assert_eq!(
            Syndrome::from_byte(0x61),
            Syndrome::Nak(NakCode::InvalidRequest)
        );
        assert_eq!(
            Syndrome::from_byte(0x62),
            Syndrome::Nak(NakCode::RemoteAccessError)
        );
        assert_eq!(
            Syndrome::from_byte(0x63),
            Syndrome::Nak(NakCode::RemoteOperationalError)
        );
        assert_eq!(
            Syndrome::from_byte(0x64),
            Syndrome::Nak(NakCode::InvalidRdRequest)
        );
        assert_eq!(
            Syndrome::from_byte(0x65),
            Syndrome::Nak(NakCode::Reserved(5))
        );
        assert_eq!(Syndrome::from_byte(0x41), Syndrome::Reserved(0x41));
        assert_eq!(Syndrome::from_byte(0x80), Syndrome::Reserved(0x80));
        assert_eq!(RnrTimer::at_least(600).code(), 12);
        assert_eq!(RnrTimer::at_least(10).code(), 1);
        assert_eq!(RnrTimer::at_least(1_000_000).code(), 0);
    }

    proptest! {
        #[test]
        fn syndrome_byte_round_trips(b: u8) {
            prop_assert_eq!(Syndrome::from_byte(b).to_byte(), b);
        }

        #[test]
        fn round_trip(s: u8, msn in 0u32..(1 << 24)) {
            let r = Repr { syndrome: Syndrome::from_byte(s), msn };
            let mut buf = [0u8; HEADER_LEN];
            r.emit(&mut Header::new_unchecked(&mut buf[..]));
            prop_assert_eq!(Repr::parse(&Header::new_checked(&buf[..]).unwrap()).unwrap(), r);
        }
    }
}
