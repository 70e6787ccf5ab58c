//! Arbitrary bytes as a capture: frames, frame decoding, TCP reassembly, MPA.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma::capture;

fuzz_target!(|data: &[u8]| {
    let Ok(frames) = capture::frames(data) else {
        return;
    };
    let mut d = capture::Decoder::new();
    let mut last = 0;
    for f in frames {
        let Ok(f) = f else {
            break;
        };
        last = f.number;
        d.push(&f, &mut |r| {
            let _ = (r.describe(), r.errors());
        });
    }
    d.finish(last, &mut |r| {
        let _ = r.describe();
    });
});
