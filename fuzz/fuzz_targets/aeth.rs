//! AETH and the one-word, RDMA, atomic and datagram extension headers.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::{aeth, atomic, deth, imm, reth};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = aeth::Header::new_checked(data) {
        let r = aeth::Repr::parse(&h).unwrap();
        let _ = r.to_string();
        let mut out = [0u8; 4];
        r.emit(&mut aeth::Header::new_unchecked(&mut out[..]));
        assert_eq!(out[..], data[..4]);
    }
    if let Ok(h) = reth::Header::new_checked(data) {
        let r = reth::Repr::parse(&h).unwrap();
        let mut out = [0u8; 16];
        r.emit(&mut reth::Header::new_unchecked(&mut out[..]));
        assert_eq!(out[..], data[..16]);
    }
    if let Ok(h) = atomic::Header::new_checked(data) {
        let r = atomic::Repr::parse(&h).unwrap();
        let mut out = [0u8; 28];
        r.emit(&mut atomic::Header::new_unchecked(&mut out[..]));
        assert_eq!(out[..], data[..28]);
    }
    if let Ok(h) = atomic::AckHeader::new_checked(data) {
        let _ = h.original();
    }
    if let Ok(h) = deth::Header::new_checked(data)
        && let Ok(r) = deth::Repr::parse(&h)
    {
        let mut out = [0u8; 8];
        r.emit(&mut deth::Header::new_unchecked(&mut out[..]));
        assert_eq!(out[..], data[..8]);
    }
    if let Ok(h) = imm::Header::new_checked(data) {
        let _ = h.value();
    }
});
