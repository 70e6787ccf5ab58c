//! A copy board: one thread posts a large region-to-region copy, helper
//! threads take chunks of it while the poster copies the rest.
//!
//! This is the memory half of the shm provider's copy helper: the chunks,
//! the claims, and the guarantee that a helper touches the poster's memory
//! only while the poster's [`CopyBoard::copy`] holds it borrowed. Threads,
//! clocks and when to help are the provider's.
//!
//! The final [`TAIL`] bytes are stored last, by the poster, once every chunk
//! is in: a peer polling the last byte of a WRITE (perftest's latency tests,
//! eager RDMA protocols) sees the whole message when it sees that byte, as a
//! single forward copy gave it.

use std::borrow::Borrow;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::backing::copy_apart;
use super::{Region, Segment};

/// Copies from this size up go on the board.
pub const SHARE_MIN: usize = 32 << 10;
/// The smallest chunk.
const CHUNK: usize = 16 << 10;
/// The largest chunk: a poster waits for a chunk a helper holds, and a
/// helper that loses its CPU mid-chunk should not hold much.
const LARGEST_CHUNK: usize = 256 << 10;
/// Most chunks in a copy up to `MOST_CHUNKS * LARGEST_CHUNK`: enough for two
/// threads to even out.
const MOST_CHUNKS: usize = 8;
/// A larger copy goes on the board in pieces of this size (the state word
/// counts chunks in 8 bits).
const PIECE: usize = 128 * LARGEST_CHUNK;
/// Bytes at the end of a copy that the poster stores after every chunk (up
/// to a line more, so that the board's part ends on a line).
const TAIL: usize = 64;
/// A cache line: chunks meet at line boundaries of the destination, so two
/// threads never write one line.
const LINE: usize = 64;
/// A waiting poster calls its `waiting` hook once every this many spins.
const SPINS_PER_WAITING: u32 = 256;

/// How a copy's bytes on the board fall into chunks: every boundary between
/// two chunks is at a line boundary of the destination; chunks are
/// [`CHUNK`] to [`LARGEST_CHUNK`] long, but the first (up to a line
/// shorter) and the last (at least a quarter of [`CHUNK`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Chunks {
    len: usize,
    /// The destination's offset into its first line.
    skew: usize,
    chunk: usize,
    count: usize,
}

impl Chunks {
    fn new(to: usize, len: usize) -> Chunks {
        let skew = to % LINE;
        let chunk = (len + skew)
            .div_ceil(MOST_CHUNKS)
            .next_multiple_of(LINE)
            .clamp(CHUNK, LARGEST_CHUNK);
        let mut count = (len + skew).div_ceil(chunk);
        // A last chunk of a few bytes is not worth a claim: the one before
        // takes it.
        if count > 2 && (len + skew) - (count - 1) * chunk < CHUNK / 4 {
            count -= 1;
        }
        Chunks {
            len,
            skew,
            chunk,
            count,
        }
    }

    /// Where chunk `i` starts, and its length.
    fn span(&self, i: u8) -> (usize, usize) {
        let i = usize::from(i);
        let at = (i * self.chunk).saturating_sub(self.skew);
        let end = if i + 1 >= self.count {
            self.len
        } else {
            (i + 1) * self.chunk - self.skew
        };
        (at, end - at)
    }
}

/// The job's state in one word, so that a claim names its job: generation
/// (high 48 bits: it does not come round again), then the unclaimed chunks
/// `lo..hi` (8 bits each). The poster claims from the front, helpers from
/// the back: in a stream of like copies each thread keeps writing the same
/// lines, which stay in its cache, where taking turns would move them.
fn pack(generation: u64, lo: u8, hi: u8) -> u64 {
    (generation << 16) | (u64::from(lo) << 8) | u64::from(hi)
}

fn generation_of(state: u64) -> u64 {
    state >> 16
}

fn lo_of(state: u64) -> u8 {
    (state >> 8) as u8
}

fn hi_of(state: u64) -> u8 {
    state as u8
}

/// Which end of the unclaimed chunks a thread takes.
#[derive(Clone, Copy)]
enum End {
    Front,
    Back,
}

/// Its own cache line: the poster and the helpers write these at
/// different moments, and a shared line would bounce between them.
#[repr(align(64))]
#[derive(Default)]
struct Line<T>(T);

/// What a helper reads when it claims a chunk: one line.
#[derive(Default)]
struct Job {
    state: AtomicU64,
    from: AtomicUsize,
    to: AtomicUsize,
    /// Bytes on the board (the copy, or its piece, less its tail).
    len: AtomicUsize,
}

/// See the module.
#[derive(Default)]
pub struct CopyBoard {
    job: Line<Job>,
    /// Chunks helpers have finished in this generation.
    done: Line<AtomicU32>,
    /// A poster holds the board (one copy at a time; others copy alone).
    taken: Line<AtomicBool>,
}

impl std::fmt::Debug for CopyBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyBoard")
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

/// Held while a poster has the board; lets it go even if the poster's
/// `waiting` hook unwinds.
struct Taken<'a>(&'a AtomicBool);

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The helpers' chunks of a posted piece. Dropping it waits for them, so
/// that no path out of [`CopyBoard::copy`], an unwinding `waiting` hook
/// included, leaves a helper copying between ranges no longer borrowed.
struct Theirs<'a> {
    done: &'a AtomicU32,
    count: u32,
}

impl Theirs<'_> {
    fn in_(&self) -> bool {
        self.done.load(Ordering::Acquire) >= self.count
    }
}

impl Drop for Theirs<'_> {
    fn drop(&mut self) {
        while !self.in_() {
            std::hint::spin_loop();
        }
    }
}

impl CopyBoard {
    /// An empty board.
    pub fn new() -> CopyBoard {
        CopyBoard::default()
    }

    /// The generation of the latest copy posted: a helper waits for it to
    /// change, then calls [`help`](Self::help).
    pub fn generation(&self) -> u64 {
        generation_of(self.job.0.state.load(Ordering::Acquire))
    }

    /// The bytes the latest copy put on the board (a helper sizes its
    /// waits by it).
    pub fn last_len(&self) -> usize {
        self.job.0.len.load(Ordering::Relaxed)
    }

    /// Copies chunks of copy `generation` until none is left unclaimed;
    /// returns how many it copied (none if that copy is over).
    pub fn help(&self, generation: u64) -> usize {
        self.help_after(generation, || {})
    }

    /// As [`help`](Self::help), calling `claimed` after each claim (tests
    /// hold a chunk there).
    fn help_after(&self, generation: u64, mut claimed: impl FnMut()) -> usize {
        let mut copied = 0;
        while let Some(i) = self.claim(generation, End::Back) {
            claimed();
            let job = &self.job.0;
            let from = job.from.load(Ordering::Relaxed) as *const u8;
            let to = job.to.load(Ordering::Relaxed) as *mut u8;
            let (at, n) = Chunks::new(to as usize, job.len.load(Ordering::Relaxed)).span(i);
            // SAFETY: chunk `i` of this copy is claimed, so the copy is
            // live: its poster, inside `copy`, keeps both ranges borrowed
            // (valid, not overlapping) until `done` counts this chunk, and
            // published them before the state this claim read (Acquire).
            // `at + n <= len`, the length of both.
            unsafe { copy_apart(from.add(at), to.add(at), n) };
            self.done.0.fetch_add(1, Ordering::Release);
            copied += 1;
        }
        copied
    }

    /// Claims the chunk at `end` of the unclaimed chunks of copy
    /// `generation`; `None` once all are claimed or that copy is over.
    fn claim(&self, generation: u64, end: End) -> Option<u8> {
        let state = &self.job.0.state;
        let mut s = state.load(Ordering::Acquire);
        loop {
            let (lo, hi) = (lo_of(s), hi_of(s));
            if generation_of(s) != generation || lo >= hi {
                return None;
            }
            let (taken, next) = match end {
                End::Front => (lo, pack(generation, lo + 1, hi)),
                End::Back => (hi - 1, pack(generation, lo, hi - 1)),
            };
            match state.compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(taken),
                Err(now) => s = now,
            }
        }
    }

    /// Copies `len` bytes from `src` (at `src_at`) into `dst` at `at`, as
    /// [`Segment::copy_from`] does, with whatever help the board's helpers
    /// give; `false`, having copied nothing, if the board is held by another
    /// copy, the copy is smaller than [`SHARE_MIN`] or the ranges overlap in
    /// this address space. While it waits for a chunk a helper holds, it
    /// calls `waiting` every few hundred spins, with how many times it has
    /// in this wait (the caller may sleep there: the helper may have lost
    /// its CPU).
    ///
    /// # Panics
    /// If either range reaches past its segment.
    pub fn copy<D: Borrow<Region>, S: Borrow<Region>>(
        &self,
        dst: &Segment<D>,
        at: usize,
        src: &Segment<S>,
        src_at: usize,
        len: usize,
        mut waiting: impl FnMut(u32),
    ) -> bool {
        let to = dst.ptr_at(at, len);
        let from = src.ptr_at(src_at, len).cast_const();
        if len < SHARE_MIN || (to as usize).abs_diff(from as usize) < len {
            return false;
        }
        if self.taken.0.swap(true, Ordering::Acquire) {
            return false;
        }
        let _taken = Taken(&self.taken.0);
        let mut off = 0;
        while off < len {
            let rest = len - off;
            // The last piece takes the rest, at least `SHARE_MIN`.
            let piece = if rest > PIECE + SHARE_MIN {
                PIECE
            } else {
                rest
            };
            // SAFETY: both ranges were checked against their memories
            // (`ptr_at`) and do not overlap; the piece lies within them.
            unsafe {
                self.copy_piece(
                    from.add(off),
                    to.add(off),
                    piece,
                    off + piece == len,
                    &mut waiting,
                )
            };
            off += piece;
        }
        true
    }

    /// Posts one piece of a copy, copies its chunks from the front, waits
    /// for the helpers' and, for the copy's `last` piece, stores its tail.
    ///
    /// # Safety
    /// `from` and `to` are valid for `len` bytes, do not overlap, and stay
    /// so for the call; the caller holds `taken`.
    unsafe fn copy_piece(
        &self,
        from: *const u8,
        to: *mut u8,
        len: usize,
        last: bool,
        waiting: &mut impl FnMut(u32),
    ) {
        // The tail starts on a line of the destination, so the board's
        // part and the tail do not share one.
        let shared = if last {
            (to as usize + len - TAIL) / LINE * LINE - to as usize
        } else {
            len
        };
        let chunks = Chunks::new(to as usize, shared);
        // Neither happens (a piece has 2 to `PIECE / LARGEST_CHUNK + 1`
        // chunks); the poster would copy alone.
        let count = match u8::try_from(chunks.count) {
            Ok(count) if count >= 2 => count,
            _ => {
                // SAFETY: the caller's.
                unsafe { copy_apart(from, to, len) };
                return;
            }
        };
        let job = &self.job.0;
        let generation = generation_of(job.state.load(Ordering::Relaxed)) + 1;
        job.from.store(from as usize, Ordering::Relaxed);
        job.to.store(to as usize, Ordering::Relaxed);
        job.len.store(shared, Ordering::Relaxed);
        self.done.0.store(0, Ordering::Relaxed);
        job.state
            .store(pack(generation, 0, count), Ordering::Release);
        // Nothing here unwinds until `theirs` below guards the helpers'
        // chunks.
        let mut mine = 0u32;
        while let Some(i) = self.claim(generation, End::Front) {
            let (at, n) = chunks.span(i);
            // SAFETY: the caller's; `at + n <= shared <= len`.
            unsafe { copy_apart(from.add(at), to.add(at), n) };
            mine += 1;
        }
        let theirs = Theirs {
            done: &self.done.0,
            count: u32::from(count) - mine,
        };
        let (mut spins, mut calls) = (0u32, 0u32);
        while !theirs.in_() {
            // A helper is copying a chunk: microseconds, unless it lost
            // its CPU.
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(SPINS_PER_WAITING) {
                calls = calls.saturating_add(1);
                waiting(calls);
            }
            std::hint::spin_loop();
        }
        drop(theirs);
        if last {
            // SAFETY: the caller's; the tail is the rest of both ranges.
            // `copy_apart` stores its last bytes last, in order.
            unsafe { copy_apart(from.add(shared), to.add(shared), len - shared) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Access, MrTable, Region, RegionMemory};
    use std::sync::Arc;

    #[test]
    fn the_state_word_names_its_copy() {
        let s = pack(7, 3, 16);
        assert_eq!((generation_of(s), lo_of(s), hi_of(s)), (7, 3, 16));
        assert_eq!(generation_of(pack((1 << 48) - 1, 0, 16)), (1 << 48) - 1);
        let board = CopyBoard::new();
        board.job.0.state.store(pack(5, 0, 3), Ordering::Relaxed);
        assert_eq!(board.claim(5, End::Front), Some(0));
        assert_eq!(board.claim(5, End::Back), Some(2));
        assert_eq!(board.claim(4, End::Back), None, "another copy's claim");
        assert_eq!(board.claim(5, End::Back), Some(1));
        assert_eq!(board.claim(5, End::Front), None);
        assert_eq!(board.claim(5, End::Back), None);
    }

    #[test]
    fn chunks_are_few_not_small_and_meet_on_lines() {
        let sizes = [
            SHARE_MIN - 2 * TAIL,
            64 << 10,
            (1 << 20) - 64,
            1 << 20,
            (2 << 20) + 77,
            PIECE,
            PIECE + SHARE_MIN,
        ];
        for len in sizes {
            for to in [0x1000_0000usize, 0x1000_0001, 0x1000_003f] {
                let c = Chunks::new(to, len);
                assert!((CHUNK..=LARGEST_CHUNK).contains(&c.chunk), "{c:?}");
                assert!(c.count >= 2 && c.count <= 255, "{c:?}");
                if len + c.skew <= MOST_CHUNKS * LARGEST_CHUNK {
                    assert!(c.count <= MOST_CHUNKS, "{c:?}");
                }
                let mut end = 0;
                for i in 0..c.count as u8 {
                    let (at, n) = c.span(i);
                    assert_eq!(at, end, "{c:?} chunk {i}");
                    if i > 0 {
                        assert_eq!((to + at) % LINE, 0, "{c:?} chunk {i}");
                    }
                    if usize::from(i) + 1 < c.count {
                        assert!(n >= CHUNK - LINE, "{c:?} chunk {i}: {n} bytes");
                    } else {
                        assert!(n >= CHUNK / 4, "{c:?}: a last chunk of {n} bytes");
                    }
                    end = at + n;
                }
                assert_eq!(end, len, "{c:?}");
            }
        }
    }

    const A: u64 = 0x1000_0000;
    const B: u64 = 0x2000_0000;

    /// Two regions of `len` bytes, keys 1 at `A` and 2 at `B`.
    fn two_regions(len: usize) -> MrTable {
        let mut t = MrTable::new();
        for (key, iova) in [(1, A), (2, B)] {
            let mem = Arc::new(RegionMemory::zeroed(len).unwrap());
            t.insert(Region::new(1, (key, key), mem, 0, len, iova, Access::ALL).unwrap());
        }
        t
    }

    /// A helper thread as the shm provider's, spinning on the board and
    /// counting the chunks it copied; it holds each chunk it claims for
    /// `hold` (as a helper that lost its CPU).
    struct TestHelper {
        stop: Arc<AtomicBool>,
        helped: Arc<AtomicUsize>,
        thread: std::thread::JoinHandle<()>,
    }

    impl TestHelper {
        fn start(board: &Arc<CopyBoard>, hold: std::time::Duration) -> TestHelper {
            let (stop, helped) = (
                Arc::new(AtomicBool::new(false)),
                Arc::new(AtomicUsize::new(0)),
            );
            let thread = {
                let (board, stop, helped) =
                    (Arc::clone(board), Arc::clone(&stop), Arc::clone(&helped));
                std::thread::spawn(move || {
                    let mut seen = board.generation();
                    while !stop.load(Ordering::Relaxed) {
                        let g = board.generation();
                        if g != seen {
                            seen = g;
                            let n = board.help_after(g, || {
                                if !hold.is_zero() {
                                    std::thread::sleep(hold);
                                }
                            });
                            helped.fetch_add(n, Ordering::Relaxed);
                        }
                        std::hint::spin_loop();
                    }
                })
            };
            TestHelper {
                stop,
                helped,
                thread,
            }
        }

        fn helped(&self) -> usize {
            self.helped.load(Ordering::Relaxed)
        }

        /// Stops it; the chunks it copied.
        fn stop(self) -> usize {
            self.stop.store(true, Ordering::Relaxed);
            self.thread.join().unwrap();
            self.helped.load(Ordering::Relaxed)
        }
    }

    /// Every byte lands where it should, for sizes around the chunking's
    /// edges and offsets that are not aligned, and the helper takes chunks.
    #[test]
    fn copies_with_a_helper_move_every_byte() {
        let len = 3 << 20;
        let t = two_regions(len);
        let board = Arc::new(CopyBoard::new());
        let helper = TestHelper::start(&board, std::time::Duration::ZERO);
        let src = t.local(1, 2, B, len as u32, Access::NONE).unwrap();
        let dst = t.local(1, 1, A, len as u32, Access::LOCAL_WRITE).unwrap();
        let check = |round: usize, size: usize, dst_at: usize, src_at: usize| {
            let pattern: Vec<u8> = (0..size)
                .map(|i| (i as u8) ^ (i >> 8) as u8 ^ round as u8)
                .collect();
            src.write(src_at, &pattern);
            assert!(board.copy(
                &dst,
                dst_at,
                &src,
                src_at,
                size,
                |_| std::thread::yield_now()
            ));
            let mut out = vec![0u8; size];
            dst.read(dst_at, &mut out);
            assert!(out == pattern, "size {size} at {dst_at} from {src_at}");
        };
        let sizes = [
            SHARE_MIN,
            SHARE_MIN + 1,
            65536,
            100_003,
            1 << 20,
            (2 << 20) + 77,
        ];
        for (round, size) in sizes.into_iter().enumerate() {
            for (dst_at, src_at) in [(0, 0), (1, 13), (4096 + 8, 64)] {
                check(round, size, dst_at, src_at);
            }
        }
        // Whether the helper got a chunk in yet is the scheduler's: go on
        // until it has (a stalled test fails by its time).
        let mut round = sizes.len();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while helper.helped() == 0 && std::time::Instant::now() < deadline {
            check(round, 2 << 20, 8, 0);
            round += 1;
        }
        assert!(helper.stop() > 0, "the helper never copied a chunk");
    }

    /// A peer that sees the last byte of a copy sees all of it: with the
    /// helper copying chunks, the tail is still stored last. x86 keeps
    /// stores in order for every observer; the observer's plain reads rely
    /// on that.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_last_byte_lands_last() {
        // Tails of 77, 71 and 120 bytes: 120 is where a vector copy stores
        // its last 32 bytes before its middle ones; 71 ends 7 bytes into a
        // word, which memcpy would store end first.
        for len in [(1 << 20) + 77, (1 << 20) + 71, (1 << 20) + 120] {
            the_last_byte_lands_last_in(len);
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn the_last_byte_lands_last_in(len: usize) {
        use super::super::last_byte_watch::LastByteWatch;
        let t = Arc::new(two_regions(len));
        let board = Arc::new(CopyBoard::new());
        let helper = TestHelper::start(&board, std::time::Duration::ZERO);
        let src = t.local(1, 2, B, len as u32, Access::NONE).unwrap();
        let dst = t.local(1, 1, A, len as u32, Access::LOCAL_WRITE).unwrap();
        // Rounds of 250 copies until the helper took part in one (a busy
        // machine may not run it in time; a stalled test fails by its time).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            dst.write(0, &vec![0u8; len]);
            let before = helper.helped();
            let watch = {
                let dst = t.local(1, 1, A, len as u32, Access::NONE).unwrap();
                LastByteWatch::start(len, move |at, out| dst.read(at, out))
            };
            for k in 1..=250u8 {
                src.write(0, &vec![k; len]);
                assert!(board.copy(&dst, 0, &src, 0, len, |_| std::thread::yield_now()));
            }
            assert!(watch.stop() > 0, "the observer saw no copy land");
            if helper.helped() > before {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the helper never copied a chunk"
            );
        }
        helper.stop();
    }

    /// A copy larger than a piece goes on the board piece by piece, every
    /// byte in place.
    #[test]
    fn copies_larger_than_a_piece_go_in_pieces() {
        let len = PIECE + PIECE / 2 + 4099;
        let t = two_regions(len);
        let board = Arc::new(CopyBoard::new());
        let helper = TestHelper::start(&board, std::time::Duration::ZERO);
        let src = t.local(1, 2, B, len as u32, Access::NONE).unwrap();
        let dst = t.local(1, 1, A, len as u32, Access::LOCAL_WRITE).unwrap();
        let pattern: Vec<u8> = (0..len - 8).map(|i| (i % 251) as u8).collect();
        src.write(8, &pattern);
        let generation = board.generation();
        assert!(board.copy(&dst, 0, &src, 8, len - 8, |_| std::thread::yield_now()));
        assert_eq!(board.generation(), generation + 2, "two pieces");
        let mut out = vec![0u8; len - 8];
        dst.read(0, &mut out);
        assert!(out == pattern, "the copy's bytes");
        helper.stop();
    }

    /// A poster waiting for a chunk a helper holds calls its `waiting`
    /// hook, and the copy completes once the helper finishes.
    #[test]
    fn a_poster_waiting_for_a_held_chunk_calls_its_hook() {
        let len = 1 << 20;
        let t = two_regions(len);
        let board = Arc::new(CopyBoard::new());
        let slow_helper = TestHelper::start(&board, std::time::Duration::from_millis(5));
        let src = t.local(1, 2, B, len as u32, Access::NONE).unwrap();
        let dst = t.local(1, 1, A, len as u32, Access::LOCAL_WRITE).unwrap();
        let mut waits = 0u32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut k = 0u8;
        while slow_helper.helped() == 0 && std::time::Instant::now() < deadline {
            k = k.wrapping_add(1);
            src.write(0, &vec![k; len]);
            assert!(board.copy(&dst, 0, &src, 0, len, |_| waits += 1));
            let mut out = vec![0u8; len];
            dst.read(0, &mut out);
            assert!(out.iter().all(|&b| b == k), "the copy's bytes");
        }
        assert!(slow_helper.stop() > 0, "the helper never claimed a chunk");
        assert!(
            waits > 0,
            "the poster waited for a held chunk without its hook"
        );
    }

    #[test]
    fn small_overlapping_and_out_of_range_copies_are_refused() {
        let t = two_regions(1 << 20);
        let board = CopyBoard::new();
        let src = t.local(1, 2, B, 1 << 20, Access::NONE).unwrap();
        let dst = t.local(1, 1, A, 1 << 20, Access::LOCAL_WRITE).unwrap();
        assert!(!board.copy(&dst, 0, &src, 0, SHARE_MIN - 1, |_| {}));
        assert!(
            !board.copy(&dst, 0, &dst, 4096, 65536, |_| {}),
            "overlapping"
        );
        let out_of_range = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            board.copy(&dst, 1 << 19, &src, 0, 1 << 20, |_| {})
        }));
        assert!(out_of_range.is_err());
        assert!(
            board.copy(&dst, 0, &src, 0, 65536, |_| {}),
            "the board is free again"
        );
    }
}
