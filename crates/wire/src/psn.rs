//! 24-bit packet sequence numbers with wrap-around.
//!
//! PSNs live in a circle of 2^24 values. Two PSNs compare by the signed 24-bit
//! distance between them (as rxe does with `(a - b) << 8`), so "before" and
//! "after" are meaningful only within half the circle (2^23) of each other.

use core::cmp::Ordering;
use core::fmt;

/// PSN values are taken modulo this.
pub const MODULUS: u32 = 1 << 24;
/// The mask of a 24-bit field.
pub const MASK: u32 = MODULUS - 1;

/// A 24-bit packet sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// The PSN of `value` modulo 2^24.
    pub const fn new(value: u32) -> Psn {
        Psn(value & MASK)
    }

    /// The PSN as a number in `0..2^24`.
    pub const fn value(self) -> u32 {
        self.0
    }

    /// `self + n`, wrapping at 2^24.
    #[must_use]
    pub const fn add(self, n: u32) -> Psn {
        Psn(self.0.wrapping_add(n) & MASK)
    }

    /// `self - n`, wrapping at 2^24.
    #[must_use]
    pub const fn sub(self, n: u32) -> Psn {
        Psn(self.0.wrapping_sub(n) & MASK)
    }

    /// The next PSN.
    #[must_use]
    pub const fn next(self) -> Psn {
        self.add(1)
    }

    /// The signed distance `self - other`, in `-2^23..2^23`.
    pub const fn distance(self, other: Psn) -> i32 {
        (self.0.wrapping_sub(other.0) << 8) as i32 >> 8
    }

    /// Orders two PSNs within the window of 2^23 around each other.
    pub const fn compare(self, other: Psn) -> Ordering {
        let d = self.distance(other);
        if d < 0 {
            Ordering::Less
        } else if d > 0 {
            Ordering::Greater
        } else {
            Ordering::Equal
        }
    }

    /// `self` comes strictly before `other` in the window.
    pub const fn before(self, other: Psn) -> bool {
        self.distance(other) < 0
    }

    /// `self` comes strictly after `other` in the window.
    pub const fn after(self, other: Psn) -> bool {
        self.distance(other) > 0
    }

    /// `start <= self < start + len`, counting along the circle.
    pub const fn in_range(self, start: Psn, len: u32) -> bool {
        (self.0.wrapping_sub(start.0) & MASK) < len
    }
}

impl From<Psn> for u32 {
    fn from(p: Psn) -> u32 {
        p.0
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wraps() {
        let p = Psn::new(0xff_fffe);
        assert_eq!(p.add(1).value(), 0xff_ffff);
        assert_eq!(p.add(2).value(), 0);
        assert_eq!(p.add(5).value(), 3);
        assert_eq!(Psn::new(2).sub(5).value(), 0xff_fffd);
        assert_eq!(Psn::new(0x1_000_005).value(), 5);
    }

    #[test]
    fn compares_across_the_wrap() {
        let a = Psn::new(0xff_fff0);
        let b = Psn::new(0x10);
        assert!(a.before(b));
        assert!(b.after(a));
        assert_eq!(b.distance(a), 0x20);
        assert_eq!(a.distance(b), -0x20);
        assert_eq!(a.compare(a), Ordering::Equal);
        assert!(Psn::new(0x10).in_range(a, 0x21));
        assert!(!Psn::new(0x11).in_range(a, 0x21));
    }

    #[test]
    fn window_edge() {
        let a = Psn::new(0);
        assert_eq!(Psn::new((1 << 23) - 1).distance(a), (1 << 23) - 1);
        assert_eq!(Psn::new(1 << 23).distance(a), -(1 << 23));
    }

    proptest! {
        #[test]
        fn distance_inverts_add(start in 0u32..MODULUS, n in 0u32..(1 << 23)) {
            let s = Psn::new(start);
            prop_assert_eq!(s.add(n).distance(s), n as i32);
            prop_assert_eq!(s.add(n).sub(n), s);
            prop_assert!(s.add(n).in_range(s, n + 1));
        }
    }
}
