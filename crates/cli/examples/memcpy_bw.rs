//! Single-thread copy bandwidth: the ceiling a one-copy transfer on this
//! machine can reach. `cargo run --release --example memcpy_bw -- 65536
//! 1048576` prints `<size> <GB/s>` per size (bytes copied per second, 1e9):
//! the better of glibc's memcpy and softrdma's payload copy, which takes a
//! vector loop where that moves more (`softrdma::memory::copy_bytes`).

use std::time::{Duration, Instant};

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("sizes in bytes"))
        .collect();
    for size in sizes {
        // One allocation, the halves apart by a page and a cache line: two
        // allocations can sit a multiple of 4 KiB apart, and the CPU then
        // takes loads for aliases of earlier stores (10x slower here).
        let mut buf = vec![0x5au8; 2 * size + 4096 + 64];
        let (src, dst) = buf.split_at_mut(size + 4096 + 64);
        let src = &src[..size];
        let dst = &mut dst[..size];
        let memcpy = |d: &mut [u8], s: &[u8]| d.copy_from_slice(s);
        let ours = |d: &mut [u8], s: &[u8]| softrdma::memory::copy_bytes(d, s);
        let best = [rate(dst, src, memcpy), rate(dst, src, ours)]
            .into_iter()
            .fold(0.0, f64::max);
        println!("{size} {best:.2}");
    }
}

/// GB/s of `copy` from `src` to `dst` over 300 ms.
fn rate(dst: &mut [u8], src: &[u8], copy: impl Fn(&mut [u8], &[u8])) -> f64 {
    copy(dst, src); // touch both
    let start = Instant::now();
    let mut copies = 0u64;
    while start.elapsed() < Duration::from_millis(300) {
        for _ in 0..16 {
            copy(dst, std::hint::black_box(src));
            std::hint::black_box(&mut *dst);
        }
        copies += 16;
    }
    (copies * src.len() as u64) as f64 / start.elapsed().as_secs_f64() / 1e9
}
