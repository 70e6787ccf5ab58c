//! Terminate bodies in either encoding: parse, emit, re-parse.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::rdmap::TerminateRepr;

fuzz_target!(|data: &[u8]| {
    let Ok(t) = TerminateRepr::parse(data) else {
        return;
    };
    let _ = t.control.to_string();
    let mut out = vec![0u8; t.buffer_len()];
    t.emit(&mut out).unwrap();
    assert_eq!(TerminateRepr::parse(&out).unwrap(), t);
});
