//! MPA Request/Reply frames: parse, emit, compare.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::mpa::{FLAG_ENHANCED, StartFrame, StartFrameRepr};

fuzz_target!(|data: &[u8]| {
    let f = StartFrame::new_unchecked(data);
    let Ok(r) = StartFrameRepr::parse(&f) else {
        return;
    };
    let _ = r.to_string();
    let pd = f.private_data();
    let ulp = &pd[pd.len() - r.ulp_private_data_len..];
    let mut out = vec![0u8; r.buffer_len()];
    r.emit(&mut StartFrame::new_unchecked(&mut out[..]), ulp)
        .unwrap();
    // Byte for byte, but for the enhanced bit of a revision 1 frame: a
    // reserved bit there, which parsing ignores and emitting clears.
    let mut want = data[..r.buffer_len()].to_vec();
    if r.revision < 2 {
        want[16] &= !FLAG_ENHANCED;
    }
    assert_eq!(out, want);
});
