//! The one-word extension headers (IBTA 9.3.4 and 9.3.7): ImmDt, the immediate
//! data of SEND/WRITE with immediate, and IETH, the R_Key a SEND with
//! invalidate asks the responder to invalidate. Both are 4 opaque bytes.

use crate::Result;
use crate::bytes::{check, get_u32, set_u32};

/// Length of ImmDt and of IETH.
pub const HEADER_LEN: usize = 4;

/// A view of a one-word header (ImmDt or IETH).
#[derive(Debug, Clone)]
pub struct Header<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Header<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buffer: T) -> Header<T> {
        Header { buffer }
    }
    /// Wraps a buffer that holds at least 4 bytes.
    pub fn new_checked(buffer: T) -> Result<Header<T>> {
        let h = Header::new_unchecked(buffer);
        h.check_len()?;
        Ok(h)
    }
    /// Fails unless the buffer holds 4 bytes.
    pub fn check_len(&self) -> Result<()> {
        check("ImmDt/IETH", self.buffer.as_ref(), HEADER_LEN)
    }
    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }
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
