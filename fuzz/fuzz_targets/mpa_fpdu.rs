//! FPDUs without markers: cut, check the CRC, re-emit.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::mpa::{self, Fpdu};

fuzz_target!(|data: &[u8]| {
    let Ok(f) = Fpdu::new_checked(data) else {
        return;
    };
    let good = f.check_crc(true).is_ok();
    let _ = (f.pad(), f.crc(), f.check_crc(false));
    let mut out = vec![0u8; f.total_len()];
    mpa::emit(&mut out, f.ulpdu(), true).unwrap();
    let mut o = Fpdu::new_unchecked(&mut out[..]);
    o.pad_mut().copy_from_slice(f.pad());
    let c = o.compute_crc();
    o.set_crc(c);
    assert_eq!(good, out[..] == data[..f.total_len()]);
});
