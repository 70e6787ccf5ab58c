//! Datagram extended transport header (IBTA 9.3.2), 8 bytes: in UD packets.

use core::fmt;

use crate::bytes::{get_u24, get_u32, set_u24, set_u32};
use crate::{Error, Result};

mod field {
    use crate::bytes::Field;
    pub const QKEY: Field = 0..4;
    pub const RESERVED: usize = 4;
    pub const SRC_QP: Field = 5..8;
}

/// Length of the DETH.
pub const HEADER_LEN: usize = 8;
/// The Q_Key of the general services interface (QP1), used by the IB CM.
pub const GSI_QKEY: u32 = 0x8001_0000;

crate::bytes::fixed_header_view!(
    /// A view of a DETH.
    Header, "DETH", HEADER_LEN
);

impl<T: AsRef<[u8]>> Header<T> {
    /// Queue key.
    pub fn qkey(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::QKEY)
    }
    /// The reserved byte.
    pub fn reserved(&self) -> u8 {
        self.buffer.as_ref()[field::RESERVED]
    }
    /// Source queue pair (24 bits).
    pub fn src_qp(&self) -> u32 {
        get_u24(self.buffer.as_ref(), field::SRC_QP)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Header<T> {
    /// Sets the queue key.
    pub fn set_qkey(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::QKEY, v);
    }
    /// Sets the reserved byte.
    pub fn set_reserved(&mut self, v: u8) {
        self.buffer.as_mut()[field::RESERVED] = v;
    }
    /// Sets the source QP (24 bits).
    pub fn set_src_qp(&mut self, v: u32) {
        set_u24(self.buffer.as_mut(), field::SRC_QP, v & 0xff_ffff);
    }
}

/// The fields of a DETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// Queue key.
    pub qkey: u32,
    /// Source queue pair.
    pub src_qp: u32,
}

impl Repr {
    /// Parses a DETH; the reserved byte must be zero.
    pub fn parse<T: AsRef<[u8]>>(h: &Header<T>) -> Result<Repr> {
        h.check_len()?;
        if h.reserved() != 0 {
            return Err(Error::InvalidField {
                field: "DETH reserved byte",
                value: h.reserved().into(),
            });
        }
        Ok(Repr {
            qkey: h.qkey(),
            src_qp: h.src_qp(),
        })
    }
    /// Bytes the header takes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }
    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        h.set_qkey(self.qkey);
        h.set_reserved(0);
        h.set_src_qp(self.src_qp);
    }
}

impl fmt::Display for Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DETH qkey={:#010x} sqp={:#08x}", self.qkey, self.src_qp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // rxe_rping.pcap frame 3: a CM MAD to QP1.
    const BYTES: [u8; 8] = [0x80, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01];

    #[test]
    fn golden() {
        let h = Header::new_checked(&BYTES[..]).unwrap();
        assert_eq!(h.qkey(), GSI_QKEY);
        assert_eq!(h.src_qp(), 1);
        let r = Repr::parse(&h).unwrap();
        assert_eq!(
            r,
            Repr {
                qkey: GSI_QKEY,
                src_qp: 1
            }
        );
        let mut buf = [0xffu8; 8];
        r.emit(&mut Header::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES);
        assert_eq!(r.to_string(), "DETH qkey=0x80010000 sqp=0x000001");
    }

    #[test]
    fn malformed() {
        assert!(Header::new_checked(&BYTES[..7]).is_err());
        let mut bad = BYTES;
        bad[4] = 1;
        assert!(Repr::parse(&Header::new_unchecked(&bad[..])).is_err());
    }

    proptest! {
        #[test]
        fn round_trip(qkey: u32, src_qp in 0u32..(1 << 24)) {
            let r = Repr { qkey, src_qp };
            let mut buf = [0u8; HEADER_LEN];
            r.emit(&mut Header::new_unchecked(&mut buf[..]));
            prop_assert_eq!(Repr::parse(&Header::new_checked(&buf[..]).unwrap()).unwrap(), r);
        }
    }
}
