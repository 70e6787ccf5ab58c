//! RDMA extended transport header (IBTA 9.3.3), 16 bytes: in RDMA WRITE FIRST/ONLY
//! and RDMA READ REQUEST.

use core::fmt;

use crate::Result;
use crate::bytes::{get_u32, get_u64, set_u32, set_u64};

mod field {
    use crate::bytes::Field;
    pub const VA: Field = 0..8;
    pub const RKEY: Field = 8..12;
    pub const DMA_LEN: Field = 12..16;
}

/// Length of the RETH.
pub const HEADER_LEN: usize = 16;

crate::bytes::fixed_header_view!(
    /// A view of a RETH.
    Header, "RETH", HEADER_LEN
);

impl<T: AsRef<[u8]>> Header<T> {
    /// Remote virtual address.
    pub fn va(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::VA)
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::RKEY)
    }
    /// Length of the whole message in bytes.
    pub fn dma_len(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::DMA_LEN)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Header<T> {
    /// Sets the remote virtual address.
    pub fn set_va(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), field::VA, v);
    }
    /// Sets the remote key.
    pub fn set_rkey(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::RKEY, v);
    }
    /// Sets the message length.
    pub fn set_dma_len(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::DMA_LEN, v);
    }
}

/// The fields of a RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Message length.
    pub dma_len: u32,
}

impl Repr {
    /// Parses a RETH.
    pub fn parse<T: AsRef<[u8]>>(h: &Header<T>) -> Result<Repr> {
        h.check_len()?;
        Ok(Repr {
            va: h.va(),
            rkey: h.rkey(),
            dma_len: h.dma_len(),
        })
    }
    /// Bytes the header takes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }
    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        h.set_va(self.va);
        h.set_rkey(self.rkey);
        h.set_dma_len(self.dma_len);
    }
}

impl fmt::Display for Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RETH va={:#x} rkey={:#x} len={}",
            self.va, self.rkey, self.dma_len
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // rxe_write_bw.pcap frame 24 (WRITE FIRST).
    const BYTES: [u8; 16] = [
        0x00, 0x00, 0x7f, 0x6a, 0xbe, 0x95, 0x90, 0x00, 0x00, 0x00, 0x02, 0x62, 0x00, 0x01, 0x00,
        0x00,
    ];
    const REPR: Repr = Repr {
        va: 0x0000_7f6a_be95_9000,
        rkey: 0x262,
        dma_len: 65536,
    };

    #[test]
    fn deconstruct_and_parse() {
        let h = Header::new_checked(&BYTES[..]).unwrap();
        assert_eq!(h.va(), 0x0000_7f6a_be95_9000);
        assert_eq!(h.rkey(), 0x262);
        assert_eq!(h.dma_len(), 65536);
        assert_eq!(Repr::parse(&h).unwrap(), REPR);
        assert_eq!(
            REPR.to_string(),
            "RETH va=0x7f6abe959000 rkey=0x262 len=65536"
        );
    }

    #[test]
    fn construct() {
        let mut buf = [0u8; 16];
        REPR.emit(&mut Header::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn truncated() {
        assert!(Header::new_checked(&BYTES[..15]).is_err());
    }

    proptest! {
        #[test]
        fn round_trip(va: u64, rkey: u32, dma_len: u32) {
            let r = Repr { va, rkey, dma_len };
            let mut buf = [0u8; HEADER_LEN];
            r.emit(&mut Header::new_unchecked(&mut buf[..]));
            prop_assert_eq!(Repr::parse(&Header::new_checked(&buf[..]).unwrap()).unwrap(), r);
        }
    }
}
