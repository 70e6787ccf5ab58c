//! RDMAP message segments (a ULPDU): parse, emit, re-parse.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::rdmap::{Message, MessageRepr};

fuzz_target!(|data: &[u8]| {
    let Ok(m) = Message::new_checked(data) else {
        return;
    };
    let _ = (
        m.payload(),
        m.read_request().map(|r| r.size()),
        m.terminate_body(),
    );
    let Ok(r) = MessageRepr::parse(&m) else {
        return;
    };
    let _ = r.to_string();
    let mut out = vec![0u8; r.buffer_len()];
    let h = r.emit_header(&mut out).unwrap();
    out[h..].copy_from_slice(m.payload());
    assert_eq!(
        MessageRepr::parse(&Message::new_checked(&out[..]).unwrap()).unwrap(),
        r
    );
});
