//! A whole RoCEv2 InfiniBand packet: parse, print, re-emit, re-parse.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::Opcode;
use softrdma_wire::packet::{Packet, Repr};

fuzz_target!(|data: &[u8]| {
    let Ok(p) = Packet::new_checked(data) else {
        return;
    };
    let _ = (
        p.payload(),
        p.pad(),
        p.icrc(),
        p.immediate(),
        p.invalidate_rkey(),
    );
    let Ok(r) = Repr::parse(&p) else {
        return;
    };
    let _ = r.to_string();
    let mut out = vec![0u8; r.buffer_len().unwrap()];
    r.emit(&mut out, p.payload()).unwrap();
    let again = Repr::parse(&Packet::new_checked(&out[..]).unwrap()).unwrap();
    assert_eq!(again, r);
    // Headers re-emit byte for byte, but for what parse ignores: the reserved
    // bits of BTH byte 4 and a CNP's reserved bytes, which emit zeroes.
    let h = if r.bth.opcode == Opcode::CNP {
        12
    } else {
        r.header_len().unwrap()
    };
    assert_eq!(out[..4], data[..4]);
    assert_eq!(out[5..h], data[5..h]);
});
