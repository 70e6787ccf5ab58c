//! The common MAD header: parse, emit, re-parse.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::mad::{Header, Repr};

fuzz_target!(|data: &[u8]| {
    let Ok(h) = Header::new_checked(data) else {
        return;
    };
    let _ = h.data();
    let Ok(r) = Repr::parse(&h) else {
        return;
    };
    let _ = r.to_string();
    let mut out = [0u8; 24];
    r.emit(&mut Header::new_unchecked(&mut out[..]));
    // Byte for byte, but for the reserved field, which parsing ignores and
    // emitting zeroes.
    let mut want = [0u8; 24];
    want.copy_from_slice(&data[..24]);
    want[18..20].fill(0);
    assert_eq!(out, want);
});
