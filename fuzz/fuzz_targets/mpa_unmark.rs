//! Marked FPDUs: unmark arbitrary input at an arbitrary stream position; what
//! unmarks re-marks and unmarks again to the same FPDU.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::mpa::{self, Fpdu};

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let pos = usize::from(u16::from_le_bytes([data[0], data[1]])) & !3;
    let input = &data[2..];
    let mut plain = vec![0u8; 70_000];
    let Ok(u) = mpa::unmark(input, pos, &mut plain) else {
        return;
    };
    let f = Fpdu::new_checked(&plain[..u.written]).unwrap();
    let mut marked = vec![0u8; 70_000];
    let n = mpa::emit_marked(&mut marked, pos, f.ulpdu(), true).unwrap();
    let mut again = vec![0u8; 70_000];
    let v = mpa::unmark(&marked[..n], pos, &mut again).unwrap();
    assert_eq!(
        (v.consumed, v.written, v.markers),
        (n, u.written, u.markers)
    );
    let g = Fpdu::new_checked(&again[..v.written]).unwrap();
    assert_eq!(g.ulpdu(), f.ulpdu());
    assert_eq!(g.crc(), v.computed_crc);
});
