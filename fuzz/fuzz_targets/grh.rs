//! The GRH area of a UD receive buffer: parse, emit, re-parse.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::grh::{Header, Repr};

fuzz_target!(|data: &[u8]| {
    let Ok(h) = Header::new_checked(data) else {
        return;
    };
    let Ok(r) = Repr::parse(&h) else {
        return;
    };
    let _ = (r.to_string(), r.sgid(), r.dgid());
    let mut out = [0u8; 40];
    r.emit(&mut Header::new_unchecked(&mut out[..]));
    assert_eq!(
        Repr::parse(&Header::new_checked(&out[..]).unwrap()).unwrap(),
        r
    );
});
