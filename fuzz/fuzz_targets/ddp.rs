//! DDP segment headers: parse, emit, compare.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::ddp::{Repr, Segment};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = Segment::new_checked(data) else {
        return;
    };
    let _ = s.payload();
    let Ok(r) = Repr::parse(&s) else {
        return;
    };
    let _ = r.to_string();
    let mut out = vec![0u8; r.buffer_len()];
    r.emit(&mut Segment::new_unchecked(&mut out[..]));
    assert_eq!(
        Repr::parse(&Segment::new_checked(&out[..]).unwrap()).unwrap(),
        r
    );
});
