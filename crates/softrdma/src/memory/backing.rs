//! The memory behind regions. This is one of the few places with `unsafe`: it
//! owns raw allocations that the progress engine writes on a peer's behalf
//! while the application may be reading them, as a NIC's DMA would.
//!
//! No Rust reference to region memory is ever formed by safe code: accesses are
//! raw-pointer copies and `AtomicU64` operations (the approach of rust-vmm's
//! `vm-memory` for guest memory). Concurrent accesses to the same bytes by the
//! application and a peer are the application's race, as on hardware: they may
//! tear, they cannot reach memory outside the region. An aligned 8-byte word
//! of a copy of at most 64 bytes is one store, as a NIC's DMA writes it (see
//! [`copy_words`]): a lock released by an 8-byte WRITE stays released.
//!
//! A deliberate deviation, as `vm-memory`'s: Rust's memory model calls two
//! plain copies of the same bytes at once a data race, and so undefined, not
//! merely torn. Region memory is shared with peers (threads placing their
//! data, other processes, in effect DMA) that no lock can exclude, so the
//! copies here are opaque routines (memcpy, vector loops) through raw
//! pointers that the compiler cannot reason across, and the two `&[u8]`
//! views that exist ([`RegionMemory::slice`], for a send's CRC and iovecs)
//! live only for the call that uses them. The same holds for two mappings
//! of one memfd in this process (a shm QP connected to its own device):
//! overlapping ranges copied between them may come out wrong, as an
//! overlapping DMA may.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

const PAGE: usize = 4096;

/// From this size, [`RegionMemory::zeroed`] maps fresh pages, which the
/// kernel zeroes when first touched: an allocator's page-aligned memory is
/// zeroed up front instead (2 GiB took 6.8 s here, all of it resident).
const MAP_ZEROED_MIN: usize = 128 << 10;

/// From this size up, payload copies between ranges that are not aligned
/// alike take a vector loop where there is one.
const BULK_COPY_MIN: usize = 4096;

/// Copies of at most this many bytes store word by word (see [`copy_words`]).
pub(crate) const WORD_COPY_MAX: usize = 64;

/// Copies between ranges aligned alike from this size up to (not
/// including) [`MID_COPY_MAX`], past L1 and within L2, take the AVX2 loop
/// on Intel CPUs ([`copy_choice`]). On the project's Intel Xeon, `softrdma
/// perf read-bw --provider shm -s 65536` moved 50.3 GB/s with it, 48.3 with
/// the AVX-512 loop and 45.9 with glibc's memcpy (`rep movsb` at these sizes;
/// write-bw alike); in short bursts of copies `rep movsb` was the faster, so
/// a timing at start-up picked it wrongly. On AMD EPYC `rep movsb` was the
/// faster; on the Xeon memcpy matched or beat the AVX2 loop at 16 KiB (in
/// L1) and at 1 MiB.
const MID_COPY_MIN: usize = 32 << 10;
const MID_COPY_MAX: usize = 1 << 20;

type CopyLoop = unsafe fn(*const u8, *mut u8, usize);

/// The copy loops chosen for this CPU.
#[derive(Clone, Copy, Debug)]
struct CopyChoice {
    /// For large copies between ranges aligned differently: AVX-512, else
    /// AVX2, if the CPU has either.
    apart: Option<CopyLoop>,
    /// For mid-sized copies between ranges aligned alike, where a loop beats
    /// memcpy (see [`MID_COPY_MIN`]).
    mid: Option<CopyLoop>,
}

/// The loops for this CPU, looked up once (CPUID is slow, more so in a VM).
fn copy_choice() -> CopyChoice {
    static CHOICE: std::sync::OnceLock<CopyChoice> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(choose_copy_loops)
}

fn choose_copy_loops() -> CopyChoice {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::arch::is_x86_feature_detected!("avx2");
        let avx512 = std::arch::is_x86_feature_detected!("avx512f");
        let apart: Option<CopyLoop> = if avx512 {
            Some(copy_avx512)
        } else if avx2 {
            Some(copy_avx2)
        } else {
            None
        };
        let cpuid = std::arch::x86_64::__cpuid(0);
        // "GenuineIntel" in EBX, EDX, ECX.
        let intel = (cpuid.ebx, cpuid.edx, cpuid.ecx)
            == (
                u32::from_le_bytes(*b"Genu"),
                u32::from_le_bytes(*b"ineI"),
                u32::from_le_bytes(*b"ntel"),
            );
        let mid: Option<CopyLoop> = if avx2 && intel { Some(copy_avx2) } else { None };
        CopyChoice { apart, mid }
    }
    #[cfg(not(target_arch = "x86_64"))]
    CopyChoice {
        apart: None,
        mid: None,
    }
}

/// Copies `len` bytes between ranges that do not overlap.
///
/// Up to [`WORD_COPY_MAX`] bytes, [`copy_words`]: an 8-byte WRITE lands
/// in one store, as a NIC's DMA writes it.
///
/// glibc's memcpy picks `rep movsb` for large copies on AMD EPYC, which is
/// fast when source and destination sit alike within a cache line and, on
/// some of these CPUs, crawls when they do not (1.8 GB/s with the destination
/// 8 or 16 bytes past the source modulo 4 KiB, on the project's first
/// machine). So large copies between ranges aligned differently take an
/// unrolled AVX-512 (else AVX2) loop that stores to aligned cache lines, and
/// those aligned alike memcpy, or on Intel the AVX2 loop between
/// [`MID_COPY_MIN`] and [`MID_COPY_MAX`] (`cargo bench -p softrdma --bench
/// paths -- copy`, `docs/performance.md`): on one machine memcpy moved 64 KiB
/// aligned alike at 128 GB/s against the loop's 96, and the loop 4 KiB 16
/// bytes apart at 165 against memcpy's 89; on another, 4 KiB 16 bytes apart
/// at 51 against 40, and 64 KiB and 1 MiB level with memcpy (55 and 47).
///
/// Above [`WORD_COPY_MAX`] bytes, all but the last [`LAST_IN_ORDER`] go as
/// above, then those by [`copy_words`]: a peer polling a message's last
/// byte (perftest's latency tests, eager protocols) sees all of it when it
/// sees that byte, where memcpy may store a copy's end first (seen at 1000
/// bytes on the project's EPYC host).
///
/// # Safety
/// `from` is readable and `to` writable for `len` bytes; they do not overlap.
pub(super) unsafe fn copy_apart(from: *const u8, to: *mut u8, len: usize) {
    if len <= WORD_COPY_MAX {
        // SAFETY: the caller's contract.
        unsafe { copy_words(from, to, len) };
        return;
    }
    let body = len - LAST_IN_ORDER;
    // SAFETY: the caller's contract; `body < len`.
    unsafe {
        copy_body(from, to, body, len);
        copy_words(from.add(body), to.add(body), LAST_IN_ORDER);
    }
}

/// The bytes at the end of a copy stored after the rest, in order.
const LAST_IN_ORDER: usize = 8;

/// The first `body` bytes of a copy of `len` (which picks the routine).
///
/// # Safety
/// As [`copy_apart`], for `body` bytes; `len - body` is [`LAST_IN_ORDER`].
unsafe fn copy_body(from: *const u8, to: *mut u8, body: usize, len: usize) {
    if len >= BULK_COPY_MIN {
        let choice = copy_choice();
        let copy_loop = if !(to as usize).wrapping_sub(from as usize).is_multiple_of(64) {
            choice.apart
        } else if (MID_COPY_MIN..MID_COPY_MAX).contains(&len) {
            choice.mid
        } else {
            None
        };
        if let Some(copy_loop) = copy_loop {
            // Stores that straddle cache lines cost two: the loop starts at
            // a 64-byte-aligned destination (its loads may straddle; they
            // cost less).
            let head = (to as usize).wrapping_neg() & 63;
            // SAFETY: head < 64 < body (`len >= BULK_COPY_MIN`), so both
            // parts lie inside both ranges; the loop's CPU feature was
            // detected (`choose_copy_loops`); the rest is the caller's
            // contract.
            unsafe {
                std::ptr::copy_nonoverlapping(from, to, head);
                copy_loop(from.add(head), to.add(head), body - head);
            }
            return;
        }
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(from, to, body) }
}

/// Copies `len` bytes storing each 8-byte-aligned word that lies wholly in
/// the destination in a single 8-byte store, and no other store over it
/// (the partial words at either end go byte by byte), all in ascending
/// order.
///
/// glibc's memcpy stores overlapping pieces: an 8-byte copy is two 8-byte
/// stores to the same word. A peer's atomic that lands between the two is
/// undone by the second: a lock released by an 8-byte RDMA WRITE of 0 while
/// another process's CMP_SWAP takes it was free again right after, and two
/// processes held it (`tests/shm_processes.rs`, about one run in a hundred).
///
/// # Safety
/// As [`copy_apart`].
unsafe fn copy_words(from: *const u8, to: *mut u8, len: usize) {
    let lead = ((to as usize).wrapping_neg() & 7).min(len);
    // Every store in ascending order, the last one Release (no store of the
    // copy after it, for the compiler either): a peer that sees the last
    // byte sees the copy. memcpy stores small copies' ends first.
    let order = |end: usize| {
        if end == len {
            Ordering::Release
        } else {
            Ordering::Relaxed
        }
    };
    // SAFETY: every range below is inside `0..len`, so inside both ranges
    // (the caller's contract); the words' destinations, past the lead, are
    // 8-byte aligned, as `AtomicU64::from_ptr` needs, and a store through it
    // is one 8-byte store. The lead and the tail go byte by byte.
    unsafe {
        for i in 0..lead {
            AtomicU8::from_ptr(to.add(i)).store(from.add(i).read(), order(i + 1));
        }
        let mut i = lead;
        while i + 8 <= len {
            let word = from.add(i).cast::<u64>().read_unaligned();
            AtomicU64::from_ptr(to.add(i).cast::<u64>()).store(word, order(i + 8));
            i += 8;
        }
        while i < len {
            AtomicU8::from_ptr(to.add(i)).store(from.add(i).read(), order(i + 1));
            i += 1;
        }
    }
}

/// `dst.copy_from_slice(src)` by the payload copy's routine (for benches:
/// compare it with `copy_from_slice`, which is glibc's memcpy).
///
/// # Panics
/// If the lengths differ.
pub fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_bytes: lengths differ");
    // SAFETY: two Rust slices, one of them `&mut`, cannot overlap.
    unsafe { copy_apart(src.as_ptr(), dst.as_mut_ptr(), src.len()) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(from: *const u8, to: *mut u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    // Whole 128-byte blocks through four registers, the tail by memcpy.
    let body = len & !127;
    let mut i = 0;
    while i < body {
        // SAFETY: i + 128 <= len, inside both ranges (the caller's contract);
        // unaligned loads and stores (aligned ones from `copy_apart`).
        unsafe {
            let s = from.add(i).cast::<__m256i>();
            let d = to.add(i).cast::<__m256i>();
            let (a, b) = (_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1)));
            let (c, e) = (_mm256_loadu_si256(s.add(2)), _mm256_loadu_si256(s.add(3)));
            _mm256_storeu_si256(d, a);
            _mm256_storeu_si256(d.add(1), b);
            _mm256_storeu_si256(d.add(2), c);
            _mm256_storeu_si256(d.add(3), e);
        }
        i += 128;
    }
    // SAFETY: the tail is inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(from.add(body), to.add(body), len - body) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn copy_avx512(from: *const u8, to: *mut u8, len: usize) {
    use std::arch::x86_64::{__m512i, _mm512_loadu_si512, _mm512_storeu_si512};
    // Whole 256-byte blocks through four registers, the tail by memcpy.
    let body = len & !255;
    let mut i = 0;
    while i < body {
        // SAFETY: i + 256 <= len, inside both ranges (the caller's contract);
        // unaligned loads and stores (aligned ones from `copy_apart`).
        unsafe {
            let s = from.add(i).cast::<__m512i>();
            let d = to.add(i).cast::<__m512i>();
            let (a, b) = (_mm512_loadu_si512(s), _mm512_loadu_si512(s.add(1)));
            let (c, e) = (_mm512_loadu_si512(s.add(2)), _mm512_loadu_si512(s.add(3)));
            _mm512_storeu_si512(d, a);
            _mm512_storeu_si512(d.add(1), b);
            _mm512_storeu_si512(d.add(2), c);
            _mm512_storeu_si512(d.add(3), e);
        }
        i += 256;
    }
    // SAFETY: the tail is inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(from.add(body), to.add(body), len - body) }
}

/// An allocation that memory regions are carved from.
#[derive(Debug)]
pub struct RegionMemory {
    ptr: NonNull<u8>,
    len: usize,
    owner: Owner,
}

#[derive(Debug)]
enum Owner {
    /// Allocated here with this layout.
    Alloc(Layout),
    /// Mapped here (anonymous, private): unmapped on drop.
    Mapped,
    /// A caller's vector, given back with `into_vec`.
    Vec { capacity: usize },
    /// Memory a provider mapped (shared memory): `keeper` unmaps it when
    /// dropped, after this memory is gone.
    Keeper { _alive: Keeper },
}

/// Whatever keeps shared memory mapped.
struct Keeper {
    _mapping: Box<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keeper")
    }
}

// SAFETY: the allocation is owned by the RegionMemory and only reached through
// raw-pointer copies and atomics, which are sound to issue from any thread.
unsafe impl Send for RegionMemory {}
// SAFETY: as above; shared access creates no references to the bytes but
// the short-lived views of `slice`, an `unsafe fn` (see the module's notes).
unsafe impl Sync for RegionMemory {}

impl RegionMemory {
    /// `len` zeroed bytes, page aligned. `None` if the allocation fails or `len` is 0.
    pub fn zeroed(len: usize) -> Option<RegionMemory> {
        if len == 0 {
            return None;
        }
        if len >= MAP_ZEROED_MIN {
            // SAFETY: a new private anonymous mapping the kernel places (null
            // hint); nothing else refers to it. Unmapped in `drop`.
            let ptr = unsafe {
                rustix::mm::mmap_anonymous(
                    std::ptr::null_mut(),
                    len,
                    rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                    rustix::mm::MapFlags::PRIVATE,
                )
            }
            .ok()?;
            return Some(RegionMemory {
                ptr: NonNull::new(ptr.cast::<u8>())?,
                len,
                owner: Owner::Mapped,
            });
        }
        let layout = Layout::from_size_align(len, PAGE).ok()?;
        // SAFETY: the layout has a nonzero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })?;
        Some(RegionMemory {
            ptr,
            len,
            owner: Owner::Alloc(layout),
        })
    }

    /// Takes over a caller's buffer (which may be empty).
    pub fn from_vec(v: Vec<u8>) -> RegionMemory {
        let mut v = std::mem::ManuallyDrop::new(v);
        let (ptr, len, capacity) = (v.as_mut_ptr(), v.len(), v.capacity());
        RegionMemory {
            // SAFETY: a Vec's pointer is never null (dangling but non-null when empty).
            ptr: unsafe { NonNull::new_unchecked(ptr) },
            len,
            owner: Owner::Vec { capacity },
        }
    }

    /// Memory that `keeper` keeps mapped: a provider's shared mapping.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, page aligned,
    /// for as long as `keeper` lives, and reached by this process only
    /// through this `RegionMemory` (other processes may share it: their
    /// accesses are their race, as a peer's DMA is).
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        keeper: Box<dyn std::any::Any + Send + Sync>,
    ) -> RegionMemory {
        RegionMemory {
            ptr,
            len,
            owner: Owner::Keeper {
                _alive: Keeper { _mapping: keeper },
            },
        }
    }

    /// Copies `len` bytes from `src` at `src_offset` to `self` at `offset`:
    /// the one copy of a shared-memory transfer.
    pub fn copy_from(&self, offset: usize, src: &RegionMemory, src_offset: usize, len: usize) {
        self.check(offset, len);
        src.check(src_offset, len);
        let from = src.ptr.as_ptr().wrapping_add(src_offset);
        let to = self.ptr.as_ptr().wrapping_add(offset);
        let apart = (from as usize).abs_diff(to as usize) >= len;
        // SAFETY: both ranges are inside their allocations (checked). Ranges
        // that overlap in this address space take memmove; others memcpy
        // (two mappings of the same pages are different memory to this
        // process: what a peer writes meanwhile is unspecified, as with DMA).
        unsafe {
            if apart {
                copy_apart(from, to, len)
            } else {
                std::ptr::copy(from, to, len)
            }
        };
    }

    /// The address of `offset..offset + len`, checked: for a copy made
    /// through raw pointers while the caller keeps this memory alive and
    /// borrowed ([`super::board::CopyBoard`]).
    ///
    /// # Panics
    /// If the range reaches past the memory.
    pub(super) fn ptr_at(&self, offset: usize, len: usize) -> *mut u8 {
        self.check(offset, len);
        self.ptr.as_ptr().wrapping_add(offset)
    }

    /// Atomic load (sequentially consistent) of the host-order word at
    /// `offset`: shared rings' counters and flags.
    pub fn load(&self, offset: usize) -> u64 {
        self.word(offset).load(Ordering::SeqCst)
    }

    /// Atomic store (sequentially consistent) of the host-order word at `offset`.
    pub fn store(&self, offset: usize, value: u64) {
        self.word(offset).store(value, Ordering::SeqCst)
    }

    /// Gives a caller's buffer back, or `None` for memory allocated here.
    pub fn into_vec(self) -> Option<Vec<u8>> {
        let this = std::mem::ManuallyDrop::new(self);
        match this.owner {
            Owner::Vec { capacity } => {
                // SAFETY: ptr/len/capacity came from a Vec<u8> in `from_vec`, and
                // the ManuallyDrop keeps Drop from freeing them as well.
                Some(unsafe { Vec::from_raw_parts(this.ptr.as_ptr(), this.len, capacity) })
            }
            Owner::Alloc(layout) => {
                // SAFETY: allocated in `zeroed` with this layout; not freed elsewhere.
                unsafe { alloc::dealloc(this.ptr.as_ptr(), layout) };
                None
            }
            Owner::Mapped => {
                // SAFETY: mapped in `zeroed` with this length; the
                // ManuallyDrop keeps Drop from unmapping it again.
                let _ = unsafe { rustix::mm::munmap(this.ptr.as_ptr().cast(), this.len) };
                None
            }
            Owner::Keeper { .. } => {
                // SAFETY: read out of the ManuallyDrop exactly once, so the
                // keeper is dropped (and unmaps) once.
                drop(unsafe { std::ptr::read(&this.owner) });
                None
            }
        }
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The memory is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of the first byte (what a region over it may advertise as its iova).
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "access {offset}+{len} outside {} bytes",
            self.len
        );
    }

    /// Copies `data` to `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: the range is inside the allocation (checked); `data` is a
        // separate Rust slice, so the ranges cannot overlap.
        unsafe { copy_apart(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len()) };
    }

    /// Copies from `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len());
        // SAFETY: as in `write`.
        unsafe { copy_apart(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), out.len()) };
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        self.check(offset, 8);
        // SAFETY: in bounds (checked); the callers checked 8-byte alignment of
        // the iova, and the pointer itself must be aligned for AtomicU64.
        let p = unsafe { self.ptr.as_ptr().add(offset) };
        assert!(
            (p as usize).is_multiple_of(8),
            "atomic on a misaligned host address"
        );
        // SAFETY: aligned, in bounds, lives as long as `self`; all atomic
        // accesses to region memory go through AtomicU64.
        unsafe { AtomicU64::from_ptr(p.cast::<u64>()) }
    }

    /// Atomic compare-and-swap of the host-order word at `offset`; returns the old value.
    pub fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> u64 {
        match self
            .word(offset)
            .compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(v) | Err(v) => v,
        }
    }

    /// Atomic fetch-and-add of the host-order word at `offset`; returns the old value.
    pub fn fetch_add(&self, offset: usize, add: u64) -> u64 {
        self.word(offset).fetch_add(add, Ordering::SeqCst)
    }

    /// The iovec of `offset..offset + len` for a scatter read into this
    /// memory (see [`read_vectored_from_fd`](super::read_vectored_from_fd)).
    pub(super) fn iovec_mut(&self, offset: usize, len: usize) -> libc::iovec {
        self.check(offset, len);
        libc::iovec {
            // SAFETY: in bounds (checked); only a pointer is formed here.
            iov_base: unsafe { self.ptr.as_ptr().add(offset) }.cast::<libc::c_void>(),
            iov_len: len,
        }
    }

    /// A view of `offset..offset + len` for gather I/O.
    ///
    /// # Safety
    /// Region memory may be written at any moment by the progress engine on a
    /// peer's behalf. The caller must use the slice only for a send it is
    /// building now and not keep it. A concurrent write is a data race in
    /// Rust's model, which this crate accepts as the module's notes say: what
    /// is sent is then unspecified, as DMA from a buffer being written is.
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        self.check(offset, len);
        // SAFETY: in bounds and alive for `&self`; the caller takes the
        // contract about concurrent writes stated above.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }
}

impl Drop for RegionMemory {
    fn drop(&mut self) {
        match self.owner {
            // SAFETY: allocated in `zeroed` with this layout.
            Owner::Alloc(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) },
            Owner::Mapped => {
                // SAFETY: mapped in `zeroed` with this length, and no
                // reference into it outlives `self`. A failure would leave
                // the pages mapped, not freed twice.
                let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
            }
            Owner::Vec { capacity } => {
                // SAFETY: the parts of a Vec<u8> taken in `from_vec`.
                let v = unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, capacity) };
                drop(v);
            }
            // The keeper field drops after this and unmaps.
            Owner::Keeper { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// A peer that sees a copy's last byte sees all of it, for sizes where
    /// memcpy stores a copy's end first.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_copys_last_byte_lands_last() {
        use super::super::last_byte_watch::LastByteWatch;
        // memcpy's order showed in about one run of three of a single pass
        // (1000 bytes, end first): four passes.
        let lens = [7usize, 65, 71, 100, 127, 200, 1000, 4099, 70_001];
        for len in lens.into_iter().cycle().take(4 * lens.len()) {
            let mem = Arc::new(RegionMemory::zeroed(len + 8).unwrap());
            // At offset 1: the partial words at both ends.
            let watch = {
                let mem = Arc::clone(&mem);
                LastByteWatch::start(len, move |at, out| mem.read(1 + at, out))
            };
            for k in 1..=250u8 {
                mem.write(1, &vec![k; len]);
            }
            assert!(watch.stop() > 0, "{len}: the observer saw no copy");
        }
    }

    type Copy = unsafe fn(*const u8, *mut u8, usize);

    /// The dispatching copy and each vector loop this CPU can run.
    fn copy_routines() -> Vec<(&'static str, Copy)> {
        let mut routines: Vec<(&'static str, Copy)> = vec![("copy_apart", copy_apart)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                routines.push(("avx2", copy_avx2));
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                routines.push(("avx512", copy_avx512));
            }
        }
        routines
    }

    #[test]
    fn copies_of_every_length_and_skew_are_exact() {
        // Below and above the bulk loops' threshold, with partial tails (of
        // their 128- and 256-byte blocks), at source and destination offsets
        // that are not multiples of anything.
        let src: Vec<u8> = (0..50_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for len in [
            0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 4095, 4096, 4097, 4224, 4351,
            4353, 9999, 16_384, 40_000,
        ] {
            for (s_at, d_at) in [(0, 0), (3, 16), (16, 3), (129, 1), (5, 70)] {
                for (name, copy) in copy_routines() {
                    let mut dst = vec![0xEEu8; len + 300];
                    let (from, to) = (&src[s_at..s_at + len], &mut dst[d_at..d_at + len]);
                    // SAFETY: two slices of one length that do not overlap.
                    unsafe { copy(from.as_ptr(), to.as_mut_ptr(), len) };
                    assert_eq!(
                        &dst[d_at..d_at + len],
                        &src[s_at..s_at + len],
                        "{name} {len} {s_at} {d_at}"
                    );
                    assert!(
                        dst[..d_at].iter().all(|&b| b == 0xEE),
                        "{name} before, {len}"
                    );
                    assert!(
                        dst[d_at + len..].iter().all(|&b| b == 0xEE),
                        "{name} after, {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_chosen_loops_are_the_cpus() {
        let c = choose_copy_loops();
        #[cfg(target_arch = "x86_64")]
        {
            let (avx2, avx512) = (
                std::arch::is_x86_feature_detected!("avx2"),
                std::arch::is_x86_feature_detected!("avx512f"),
            );
            assert_eq!(c.apart.is_some(), avx2 || avx512);
            if let Some(mid) = c.mid {
                assert!(avx2 && std::ptr::fn_addr_eq(mid, copy_avx2 as CopyLoop));
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        assert!(c.apart.is_none() && c.mid.is_none());
    }

    /// Spins until `ready`, yielding once in a long while (on a busy machine
    /// the other thread may need this CPU; more often, and takes seldom land
    /// on a release).
    fn spin_until(ready: impl Fn() -> bool) {
        let mut spins = 0u32;
        while !ready() {
            spins += 1;
            if spins.is_multiple_of(1 << 14) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    #[test]
    fn an_eight_byte_write_is_one_store() {
        // Rounds of: one thread releases word 0 with an 8-byte write of 0
        // while the other takes it with a compare-and-swap (0 to 1); once the
        // release is done, the word must still hold the take. With glibc's
        // memcpy (two stores of the word) this test lost 1 to 21 takes in
        // each of ten runs (debug build); in `tests/shm_processes.rs` one lost
        // take let two processes hold a lock. Up to 3 million rounds or two
        // seconds.
        let m = Arc::new(RegionMemory::zeroed(64).unwrap());
        let released = Arc::new(AtomicU64::new(0));
        let next = Arc::new(AtomicU64::new(1));
        let stop = Instant::now() + Duration::from_secs(2);
        let rounds = 3_000_000u64;
        m.store(0, 1);
        let releaser = {
            let (m, released, next) = (m.clone(), released.clone(), next.clone());
            std::thread::spawn(move || {
                for round in 1..=rounds {
                    // 0: the taker stopped (it changes `next` only then, or
                    // once this round's release is done).
                    spin_until(|| {
                        let n = next.load(Ordering::Acquire);
                        n == 0 || n == round
                    });
                    if next.load(Ordering::Acquire) == 0 {
                        return;
                    }
                    // Its length unknown to the compiler, as a WR's is.
                    m.write(0, std::hint::black_box(&[0u8; 8][..]));
                    released.store(round, Ordering::Release);
                }
            })
        };
        let (mut lost, mut done) = (0, 0);
        for round in 1..=rounds {
            if Instant::now() > stop {
                break;
            }
            next.store(round, Ordering::Release);
            spin_until(|| m.compare_swap(0, 0, 1) == 0);
            spin_until(|| released.load(Ordering::Acquire) == round);
            if m.load(0) != 1 {
                lost += 1;
                m.store(0, 1);
            }
            done = round;
        }
        next.store(0, Ordering::Release);
        releaser.join().unwrap();
        assert_eq!(lost, 0, "takes undone by the release, in {done} rounds");
    }

    #[test]
    fn zeroed_is_page_aligned_and_zero() {
        // Allocated, and (from MAP_ZEROED_MIN) mapped.
        for len in [10_000, MAP_ZEROED_MIN + 10_000, 64 << 20] {
            let m = RegionMemory::zeroed(len).unwrap();
            assert_eq!(m.addr() % 4096, 0);
            let mut b = [1u8; 16];
            m.read(len - 16, &mut b);
            assert_eq!(b, [0; 16]);
            m.write(len - 16, &[7; 16]);
            m.read(len - 16, &mut b);
            assert_eq!(b, [7; 16]);
            assert!(m.into_vec().is_none());
        }
        assert!(RegionMemory::zeroed(0).is_none());
    }

    #[test]
    fn vec_round_trip() {
        let m = RegionMemory::from_vec(b"hello".to_vec());
        m.write(0, b"J");
        assert_eq!(m.into_vec().unwrap(), b"Jello");
        assert_eq!(RegionMemory::zeroed(8).unwrap().into_vec(), None);
        assert_eq!(RegionMemory::from_vec(Vec::new()).len(), 0);
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn out_of_bounds_panics_instead_of_touching_memory() {
        let m = RegionMemory::zeroed(8).unwrap();
        m.write(4, &[0; 5]);
    }

    #[test]
    fn atomics_from_many_threads() {
        let m = std::sync::Arc::new(RegionMemory::zeroed(64).unwrap());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        m.fetch_add(8, 1);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(m.fetch_add(8, 0), 40_000);
    }
}
