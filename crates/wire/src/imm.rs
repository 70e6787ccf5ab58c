//! The one-word extension headers (IBTA 9.3.4 and 9.3.7): ImmDt, the immediate
//! data of SEND/WRITE with immediate, and IETH, the R_Key a SEND with
//! invalidate asks the responder to invalidate. Both are 4 opaque bytes.

use crate::bytes::{get_u32, set_u32};

/// Length of ImmDt and of IETH.
pub const HEADER_LEN: usize = 4;

crate::bytes::fixed_header_view!(
    /// A view of a one-word header (ImmDt or IETH).
    Header, "ImmDt/IETH", HEADER_LEN
);

impl<T: AsRef<[u8]>> Header<T> {
    /// The word: immediate data (opaque, passed as is) or the R_Key to invalidate.
    pub fn value(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 0..4)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Header<T> {
    /// Sets the word.
    pub fn set_value(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), 0..4, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(v: u32) {
            let mut buf = [0u8; HEADER_LEN];
            Header::new_unchecked(&mut buf[..]).set_value(v);
            prop_assert_eq!(Header::new_checked(&buf[..]).unwrap().value(), v);
        }
    }

    #[test]
    fn word() {
        let mut buf = [0u8; 4];
        Header::new_unchecked(&mut buf[..]).set_value(0xdead_beef);
        assert_eq!(buf, [0xde, 0xad, 0xbe, 0xef]);
        assert_eq!(Header::new_checked(&buf[..]).unwrap().value(), 0xdead_beef);
        assert!(Header::new_checked(&buf[..3]).is_err());
    }
}
