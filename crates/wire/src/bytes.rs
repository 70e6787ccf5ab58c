//! Big-endian field access. Callers check lengths first (`check_len`), so an
//! out-of-range index here is a bug in this crate, not bad input.

use core::ops::Range;

pub(crate) type Field = Range<usize>;

#[inline]
pub(crate) fn get_u16(b: &[u8], f: Field) -> u16 {
    let mut v = [0u8; 2];
    v.copy_from_slice(&b[f]);
    u16::from_be_bytes(v)
}

#[inline]
pub(crate) fn get_u24(b: &[u8], f: Field) -> u32 {
    let b = &b[f];
    (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2])
}

#[inline]
pub(crate) fn get_u32(b: &[u8], f: Field) -> u32 {
    let mut v = [0u8; 4];
    v.copy_from_slice(&b[f]);
    u32::from_be_bytes(v)
}

#[inline]
pub(crate) fn get_u64(b: &[u8], f: Field) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[f]);
    u64::from_be_bytes(v)
}

#[inline]
pub(crate) fn set_u16(b: &mut [u8], f: Field, v: u16) {
    b[f].copy_from_slice(&v.to_be_bytes());
}

#[inline]
pub(crate) fn set_u24(b: &mut [u8], f: Field, v: u32) {
    b[f].copy_from_slice(&v.to_be_bytes()[1..]);
}

#[inline]
pub(crate) fn set_u32(b: &mut [u8], f: Field, v: u32) {
    b[f].copy_from_slice(&v.to_be_bytes());
}

#[inline]
pub(crate) fn set_u64(b: &mut [u8], f: Field, v: u64) {
    b[f].copy_from_slice(&v.to_be_bytes());
}

/// Fails with [`crate::Error::Truncated`] unless `buf` holds `need` bytes.
#[inline]
pub(crate) fn check(header: &'static str, buf: &[u8], need: usize) -> crate::Result<()> {
    if buf.len() < need {
        Err(crate::Error::Truncated {
            header,
            needed: need,
            available: buf.len(),
        })
    } else {
        Ok(())
    }
}

/// The view type of a fixed-length header: the struct, `new_unchecked`,
/// `new_checked`, `check_len` and `into_inner`. Field accessors stay in each file.
macro_rules! fixed_header_view {
    ($(#[$meta:meta])* $name:ident, $what:literal, $len:expr) => {
        $(#[$meta])*
        #[derive(Debug, Clone)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// Wraps a buffer without checking its length.
            pub const fn new_unchecked(buffer: T) -> $name<T> {
                $name { buffer }
            }
            /// Wraps a buffer that holds at least the whole header.
            pub fn new_checked(buffer: T) -> $crate::Result<$name<T>> {
                let h = $name::new_unchecked(buffer);
                h.check_len()?;
                Ok(h)
            }
            /// Fails unless the buffer holds the whole header.
            pub fn check_len(&self) -> $crate::Result<()> {
                $crate::bytes::check($what, self.buffer.as_ref(), $len)
            }
            /// The wrapped buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}
pub(crate) use fixed_header_view;
