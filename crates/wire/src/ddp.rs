//! DDP segment headers (RFC 5041 section 4), at the start of every ULPDU.
//!
//! Byte 0 is DDP's control (T tagged, L last, DV version); byte 1 belongs to the
//! upper layer (RDMAP's control byte). A tagged segment then names a target
//! buffer directly (STag, tagged offset); an untagged one names a queue, a
//! message on it and an offset inside the message.

use core::fmt;

use crate::bytes::{check, get_u32, get_u64, set_u32, set_u64};
use crate::{Error, Result};

mod field {
    use crate::bytes::Field;
    /// T (7), L (6), reserved (5-2), DV (1-0).
    pub const CONTROL: usize = 0;
    pub const RSVD_ULP: usize = 1;
    pub const STAG: Field = 2..6;
    pub const TO: Field = 6..14;
    pub const RSVD_ULP_WORD: Field = 2..6;
    pub const QN: Field = 6..10;
    pub const MSN: Field = 10..14;
    pub const MO: Field = 14..18;
}

/// Length of a tagged header (control bytes included).
pub const TAGGED_HEADER_LEN: usize = 14;
/// Length of an untagged header (control bytes included).
pub const UNTAGGED_HEADER_LEN: usize = 18;
/// The DDP version of RFC 5041.
pub const VERSION: u8 = 1;

/// Untagged queue of SEND messages.
pub const QN_SEND: u32 = 0;
/// Untagged queue of RDMA READ requests.
pub const QN_READ_REQUEST: u32 = 1;
/// Untagged queue of Terminate messages.
pub const QN_TERMINATE: u32 = 2;

/// A view of a DDP segment (header and payload).
#[derive(Debug, Clone)]
pub struct Segment<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Segment<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Segment<T> {
        Segment { buffer }
    }
    /// Wraps a buffer that holds the whole header its T bit calls for.
    pub fn new_checked(buffer: T) -> Result<Segment<T>> {
        let s = Segment::new_unchecked(buffer);
        s.check_len()?;
        Ok(s)
    }
    /// Fails unless the whole header is there.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        check("DDP header", b, 2)?;
        check(
            if self.tagged() {
                "DDP tagged header"
            } else {
                "DDP untagged header"
            },
            b,
            self.header_len(),
        )
    }
    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }
    /// Tagged buffer model.
    pub fn tagged(&self) -> bool {
        self.buffer.as_ref()[field::CONTROL] & 0x80 != 0
    }
    /// Last segment of the DDP message.
    pub fn last(&self) -> bool {
        self.buffer.as_ref()[field::CONTROL] & 0x40 != 0
    }
    /// The four reserved control bits.
    pub fn reserved(&self) -> u8 {
        (self.buffer.as_ref()[field::CONTROL] >> 2) & 0x0f
    }
    /// DDP version.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::CONTROL] & 0x03
    }
    /// The upper layer's byte (RDMAP control).
    pub fn rsvd_ulp(&self) -> u8 {
        self.buffer.as_ref()[field::RSVD_ULP]
    }
    /// Header bytes, by the T bit.
    pub fn header_len(&self) -> usize {
        if self.tagged() {
            TAGGED_HEADER_LEN
        } else {
            UNTAGGED_HEADER_LEN
        }
    }
    /// Steering tag (tagged).
    pub fn stag(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::STAG)
    }
    /// Tagged offset (tagged).
    pub fn tagged_offset(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::TO)
    }
    /// The upper layer's 32 bits (untagged): RDMAP's invalidate STag.
    pub fn rsvd_ulp_word(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::RSVD_ULP_WORD)
    }
    /// Queue number (untagged).
    pub fn queue(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::QN)
    }
    /// Message sequence number (untagged).
    pub fn msn(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::MSN)
    }
    /// Message offset (untagged).
    pub fn message_offset(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::MO)
    }
    /// The bytes after the header.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Segment<T> {
    /// Sets the control byte: T, L, and the version; reserved bits zero.
    pub fn set_control(&mut self, tagged: bool, last: bool, version: u8) {
        self.buffer.as_mut()[field::CONTROL] =
            (u8::from(tagged) << 7) | (u8::from(last) << 6) | (version & 0x03);
    }
    /// Sets the upper layer's byte.
    pub fn set_rsvd_ulp(&mut self, v: u8) {
        self.buffer.as_mut()[field::RSVD_ULP] = v;
    }
    /// Sets the STag.
    pub fn set_stag(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::STAG, v);
    }
    /// Sets the tagged offset.
    pub fn set_tagged_offset(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), field::TO, v);
    }
    /// Sets the upper layer's 32 bits.
    pub fn set_rsvd_ulp_word(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::RSVD_ULP_WORD, v);
    }
    /// Sets the queue number.
    pub fn set_queue(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::QN, v);
    }
    /// Sets the MSN.
    pub fn set_msn(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::MSN, v);
    }
    /// Sets the message offset.
    pub fn set_message_offset(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::MO, v);
    }
}

/// Where a segment's payload goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Tagged: straight into the buffer the STag names, at the tagged offset.
    Tagged {
        /// Steering tag.
        stag: u32,
        /// Tagged offset.
        offset: u64,
    },
    /// Untagged: into the next buffer of a queue.
    Untagged {
        /// The upper layer's 32 bits (RDMAP invalidate STag).
        rsvd_ulp_word: u32,
        /// Queue number.
        queue: u32,
        /// Message sequence number.
        msn: u32,
        /// Offset in the message.
        offset: u32,
    },
}

/// The fields of a DDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// Last segment of the message.
    pub last: bool,
    /// The upper layer's byte (RDMAP control).
    pub rsvd_ulp: u8,
    /// Tagged or untagged addressing.
    pub placement: Placement,
}

impl Repr {
    /// Parses a DDP header; the version must be 1.
    pub fn parse<T: AsRef<[u8]>>(s: &Segment<T>) -> Result<Repr> {
        s.check_len()?;
        if s.version() != VERSION {
            return Err(Error::UnsupportedVersion {
                field: "DDP version",
                value: s.version(),
            });
        }
        let placement = if s.tagged() {
            Placement::Tagged {
                stag: s.stag(),
                offset: s.tagged_offset(),
            }
        } else {
            Placement::Untagged {
                rsvd_ulp_word: s.rsvd_ulp_word(),
                queue: s.queue(),
                msn: s.msn(),
                offset: s.message_offset(),
            }
        };
        Ok(Repr {
            last: s.last(),
            rsvd_ulp: s.rsvd_ulp(),
            placement,
        })
    }

    /// Tagged.
    pub const fn tagged(&self) -> bool {
        matches!(self.placement, Placement::Tagged { .. })
    }

    /// Bytes of the header.
    pub const fn buffer_len(&self) -> usize {
        if self.tagged() {
            TAGGED_HEADER_LEN
        } else {
            UNTAGGED_HEADER_LEN
        }
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, s: &mut Segment<T>) {
        s.set_control(self.tagged(), self.last, VERSION);
        s.set_rsvd_ulp(self.rsvd_ulp);
        match self.placement {
            Placement::Tagged { stag, offset } => {
                s.set_stag(stag);
                s.set_tagged_offset(offset);
            }
            Placement::Untagged {
                rsvd_ulp_word,
                queue,
                msn,
                offset,
            } => {
                s.set_rsvd_ulp_word(rsvd_ulp_word);
                s.set_queue(queue);
                s.set_msn(msn);
                s.set_message_offset(offset);
            }
        }
    }
}

impl fmt::Display for Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.placement {
            Placement::Tagged { stag, offset } => {
                write!(f, "DDP tagged stag={stag:#010x} to={offset:#x}")?
            }
            Placement::Untagged {
                queue, msn, offset, ..
            } => write!(f, "DDP untagged qn={queue} msn={msn} mo={offset}")?,
        }
        if self.last {
            f.write_str(" L")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // siwcrc_rping.pcap frame 12 (Read Response) and frame 10 (Send), after the MPA length.
    const TAGGED: [u8; 14] = [
        0xc1, 0x42, 0x7e, 0x9a, 0x5b, 0x00, 0x00, 0x00, 0x55, 0xdd, 0x7d, 0x19, 0x5b, 0x10,
    ];
    const UNTAGGED: [u8; 18] = [0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];

    #[test]
    fn golden_tagged() {
        let s = Segment::new_checked(&TAGGED[..]).unwrap();
        let r = Repr::parse(&s).unwrap();
        assert_eq!(
            r,
            Repr {
                last: true,
                rsvd_ulp: 0x42,
                placement: Placement::Tagged {
                    stag: 0x7e9a_5b00,
                    offset: 0x0000_55dd_7d19_5b10
                }
            }
        );
        let mut buf = [0u8; 14];
        r.emit(&mut Segment::new_unchecked(&mut buf[..]));
        assert_eq!(buf, TAGGED);
        assert_eq!(
            r.to_string(),
            "DDP tagged stag=0x7e9a5b00 to=0x55dd7d195b10 L"
        );
    }

    #[test]
    fn golden_untagged() {
        let s = Segment::new_checked(&UNTAGGED[..]).unwrap();
        let r = Repr::parse(&s).unwrap();
        assert_eq!(
            r.placement,
            Placement::Untagged {
                rsvd_ulp_word: 0,
                queue: 0,
                msn: 1,
                offset: 0
            }
        );
        let mut buf = [0u8; 18];
        r.emit(&mut Segment::new_unchecked(&mut buf[..]));
        assert_eq!(buf, UNTAGGED);
    }

    #[test]
    fn malformed() {
        assert!(Segment::new_checked(&TAGGED[..13]).is_err());
        assert!(Segment::new_checked(&UNTAGGED[..17]).is_err());
        assert!(Segment::new_checked(&UNTAGGED[..1]).is_err());
        let mut bad = TAGGED;
        bad[0] = 0xc2;
        assert!(matches!(
            Repr::parse(&Segment::new_unchecked(&bad[..])),
            Err(Error::UnsupportedVersion { value: 2, .. })
        ));
    }

    proptest! {
        #[test]
        fn round_trip(tagged: bool, last: bool, ulp: u8, a: u32, b: u64, c: u32, d: u32) {
            let placement = if tagged {
                Placement::Tagged { stag: a, offset: b }
            } else {
                Placement::Untagged { rsvd_ulp_word: a, queue: b as u32, msn: c, offset: d }
            };
            let r = Repr { last, rsvd_ulp: ulp, placement };
            let mut buf = [0u8; 18];
            r.emit(&mut Segment::new_unchecked(&mut buf[..]));
            prop_assert_eq!(Repr::parse(&Segment::new_checked(&buf[..]).unwrap()).unwrap(), r);
        }
    }
}
