//! Atomic extended transport headers (IBTA 9.3.6): AtomicETH (28 bytes, in
//! COMPARE_SWAP and FETCH_ADD) and AtomicAckETH (8 bytes, in ATOMIC_ACKNOWLEDGE).

use core::fmt;

use crate::Result;
use crate::bytes::{get_u32, get_u64, set_u32, set_u64};

mod field {
    use crate::bytes::Field;
    pub const VA: Field = 0..8;
    pub const RKEY: Field = 8..12;
    pub const SWAP_ADD: Field = 12..20;
    pub const COMPARE: Field = 20..28;
    pub const ORIG: Field = 0..8;
}

/// Length of the AtomicETH.
pub const HEADER_LEN: usize = 28;
/// Length of the AtomicAckETH.
pub const ACK_HEADER_LEN: usize = 8;

crate::bytes::fixed_header_view!(
    /// A view of an AtomicETH.
    Header, "AtomicETH", HEADER_LEN
);

impl<T: AsRef<[u8]>> Header<T> {
    /// Remote virtual address (8-byte aligned on a valid request).
    pub fn va(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::VA)
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::RKEY)
    }
    /// Swap value (COMPARE_SWAP) or addend (FETCH_ADD).
    pub fn swap_add(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::SWAP_ADD)
    }
    /// Compare value (COMPARE_SWAP; zero in FETCH_ADD).
    pub fn compare(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::COMPARE)
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
    /// Sets the swap value or addend.
    pub fn set_swap_add(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), field::SWAP_ADD, v);
    }
    /// Sets the compare value.
    pub fn set_compare(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), field::COMPARE, v);
    }
}

/// The fields of an AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap value or addend.
    pub swap_add: u64,
    /// Compare value.
    pub compare: u64,
}

impl Repr {
    /// Parses an AtomicETH. Alignment is the responder's check, not a format rule.
    pub fn parse<T: AsRef<[u8]>>(h: &Header<T>) -> Result<Repr> {
        h.check_len()?;
        Ok(Repr {
            va: h.va(),
            rkey: h.rkey(),
            swap_add: h.swap_add(),
            compare: h.compare(),
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
        h.set_swap_add(self.swap_add);
        h.set_compare(self.compare);
    }
}

impl fmt::Display for Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "AtomicETH va={:#x} rkey={:#x} swap/add={:#x} compare={:#x}",
            self.va, self.rkey, self.swap_add, self.compare
        )
    }
}

crate::bytes::fixed_header_view!(
    /// A view of an AtomicAckETH.
    AckHeader, "AtomicAckETH", ACK_HEADER_LEN
);

impl<T: AsRef<[u8]>> AckHeader<T> {
    /// The value at the address before the atomic executed.
    pub fn original(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::ORIG)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AckHeader<T> {
    /// Sets the original value.
    pub fn set_original(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), field::ORIG, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // rxe_atomic_bw.pcap frame 24 (FETCH_ADD).
    const FETCH_ADD: [u8; 28] = [
        0x00, 0x00, 0x55, 0x6f, 0xc8, 0xa2, 0xb0, 0x00, 0x00, 0x00, 0x02, 0xaf, 0, 0, 0, 0, 0, 0,
        0, 1, 0, 0, 0, 0, 0, 0, 0, 0,
    ];

    #[test]
    fn golden_fetch_add() {
        let h = Header::new_checked(&FETCH_ADD[..]).unwrap();
        let r = Repr::parse(&h).unwrap();
        assert_eq!(
            r,
            Repr {
                va: 0x0000_556f_c8a2_b000,
                rkey: 0x2af,
                swap_add: 1,
                compare: 0
            }
        );
        let mut buf = [0xffu8; 28];
        r.emit(&mut Header::new_unchecked(&mut buf[..]));
        assert_eq!(buf, FETCH_ADD);
        assert!(Header::new_checked(&FETCH_ADD[..27]).is_err());
    }

    #[test]
    fn golden_ack() {
        // rxe_atomic_bw.pcap frame 29.
        let bytes = [0x7e, 0x93, 0xb7, 0x9b, 0x33, 0xe2, 0x41, 0xb6];
        let h = AckHeader::new_checked(&bytes[..]).unwrap();
        assert_eq!(h.original(), 0x7e93_b79b_33e2_41b6);
        let mut buf = [0u8; 8];
        AckHeader::new_unchecked(&mut buf[..]).set_original(h.original());
        assert_eq!(buf, bytes);
        assert!(AckHeader::new_checked(&bytes[..7]).is_err());
    }

    proptest! {
        #[test]
        fn ack_round_trip(v: u64) {
            let mut buf = [0u8; ACK_HEADER_LEN];
            AckHeader::new_unchecked(&mut buf[..]).set_original(v);
            prop_assert_eq!(AckHeader::new_checked(&buf[..]).unwrap().original(), v);
        }

        #[test]
        fn round_trip(va: u64, rkey: u32, swap_add: u64, compare: u64) {
            let r = Repr { va, rkey, swap_add, compare };
            let mut buf = [0u8; HEADER_LEN];
            r.emit(&mut Header::new_unchecked(&mut buf[..]));
            prop_assert_eq!(Repr::parse(&Header::new_checked(&buf[..]).unwrap()).unwrap(), r);
        }
    }
}
