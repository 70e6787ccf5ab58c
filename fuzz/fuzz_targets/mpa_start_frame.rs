//! MPA Request/Reply frames: parse, emit, compare.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::mpa::{StartFrame, StartFrameRepr};

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
    assert_eq!(out[..], data[..r.buffer_len()]);
});
