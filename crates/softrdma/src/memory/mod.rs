//! Registered memory: regions, their keys and access rights, and every access
//! a local work request or a remote peer makes to them.
//!
//! The rule of the design's memory-safety section lives here: region memory may
//! be written by a remote peer at any moment, so no safe call hands out a
//! `&[u8]` or `&mut [u8]` over it. Access is by copy in, copy out and atomic
//! operations on [`Segment`]s, each checked against the region's protection
//! domain, access rights and bounds first. A key that does not name a region,
//! a range outside it or a missing right is an [`AccessError`], never a touch
//! of other memory.

mod backing;
mod board;
#[cfg(test)]
mod last_byte_watch;
mod pieces;

use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

pub(crate) use backing::WORD_COPY_MAX;
pub use backing::{RegionMemory, copy_bytes};
pub use board::{CopyBoard, SHARE_MIN};
pub use pieces::{HeldPiece, HeldRegions, PacketPieces, PieceSink};

/// Access rights of a memory region (values as libibverbs' `IBV_ACCESS_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No rights beyond local read.
    pub const NONE: Access = Access(0);
    /// The local HCA may write (receives, READ responses, atomic results).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Remote peers may RDMA WRITE.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Remote peers may RDMA READ.
    pub const REMOTE_READ: Access = Access(4);
    /// Remote peers may do atomics.
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// Every right.
    pub const ALL: Access = Access(15);

    /// The rights of a libibverbs access mask (unknown bits dropped).
    pub const fn from_bits(bits: u32) -> Access {
        Access(bits & 15)
    }
    /// The libibverbs access mask.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// Both sets of rights.
    #[must_use]
    pub const fn with(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }
    /// All of `other` is granted.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
    /// Rights the IB spec says need LOCAL_WRITE alongside them.
    pub const fn needs_local_write(self) -> bool {
        self.0 & (Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0) != 0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        self.with(rhs)
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Access::LOCAL_WRITE, "LOCAL_WRITE"),
            (Access::REMOTE_WRITE, "REMOTE_WRITE"),
            (Access::REMOTE_READ, "REMOTE_READ"),
            (Access::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
        ];
        let mut first = true;
        for (a, n) in names {
            if self.contains(a) {
                if !first {
                    f.write_str("|")?;
                }
                f.write_str(n)?;
                first = false;
            }
        }
        if first {
            f.write_str("none")?;
        }
        Ok(())
    }
}

/// A protection domain's number.
pub type PdId = u64;

/// Why an access to registered memory is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// No region has this key.
    #[error("no memory region has key {0:#010x}")]
    UnknownKey(u32),
    /// The region belongs to another protection domain.
    #[error("memory region {key:#010x} is in another protection domain")]
    WrongPd {
        /// The key.
        key: u32,
    },
    /// The range is not inside the region.
    #[error("range {addr:#x}+{len} is outside memory region {key:#010x}")]
    OutOfBounds {
        /// The key.
        key: u32,
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// The region lacks a right the access needs.
    #[error("memory region {key:#010x} lacks {missing} access")]
    NotPermitted {
        /// The key.
        key: u32,
        /// The missing rights.
        missing: Access,
    },
    /// An atomic on an address that is not 8-byte aligned.
    #[error("atomic operation on unaligned address {0:#x}")]
    Unaligned(u64),
    /// The key is an lkey used remotely or the reverse.
    #[error("key {0:#010x} cannot be used this way")]
    WrongKeyKind(u32),
}

/// A registered memory region.
#[derive(Debug)]
pub struct Region {
    /// Protection domain.
    pub pd: PdId,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
    /// The address peers and SGEs use for the first byte.
    pub iova: u64,
    /// Bytes.
    pub len: usize,
    /// Rights.
    pub access: Access,
    memory: Arc<RegionMemory>,
    /// Where the region starts in `memory`.
    offset: usize,
    /// Its rkey was invalidated (SEND with invalidate, local invalidate):
    /// remote accesses fail from then on. An atomic, so that a transport
    /// holding the table's read lock invalidates before it completes the
    /// operation and before it looks at the next packet.
    remote_invalid: AtomicBool,
}

impl Region {
    /// A region over `memory[offset..offset + len]`, addressed from `iova`.
    pub fn new(
        pd: PdId,
        keys: (u32, u32),
        memory: Arc<RegionMemory>,
        offset: usize,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Region, AccessError> {
        let end = offset.checked_add(len);
        if end.is_none_or(|e| e > memory.len()) || iova.checked_add(len as u64).is_none() {
            return Err(AccessError::OutOfBounds {
                key: keys.0,
                addr: iova,
                len: len as u64,
            });
        }
        Ok(Region {
            pd,
            lkey: keys.0,
            rkey: keys.1,
            iova,
            len,
            access,
            memory,
            offset,
            remote_invalid: AtomicBool::new(false),
        })
    }

    /// The backing memory.
    pub fn memory(&self) -> &Arc<RegionMemory> {
        &self.memory
    }

    /// The backing memory, taken out of the region.
    pub fn into_memory(self) -> Arc<RegionMemory> {
        self.memory
    }

    fn range(&self, key: u32, addr: u64, len: u64) -> Result<usize, AccessError> {
        let oob = AccessError::OutOfBounds { key, addr, len };
        let start = addr.checked_sub(self.iova).ok_or(oob)?;
        let end = start.checked_add(len).ok_or(oob)?;
        if end > self.len as u64 {
            return Err(oob);
        }
        Ok(self.offset + start as usize)
    }
}

/// A checked range of a region: what an SGE or a remote address resolves to.
/// It owns a reference to its region (`Segment`), or borrows it from the
/// table for one operation ([`SegmentRef`]: no reference count touched,
/// which is most of a lookup's cost on the shared-memory path).
#[derive(Debug, Clone)]
pub struct Segment<R = Arc<Region>> {
    region: R,
    /// Offset in the backing memory.
    offset: usize,
    len: usize,
}

/// A [`Segment`] borrowing its region from an [`MrTable`] (so it lives no
/// longer than the table's read lock).
pub type SegmentRef<'a> = Segment<&'a Region>;

impl Segment {
    /// The region.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }
}

impl<R: Borrow<Region>> Segment<R> {
    fn at(region: R, offset: usize, len: usize) -> Segment<R> {
        Segment {
            region,
            offset,
            len,
        }
    }
    fn memory(&self) -> &RegionMemory {
        &self.region.borrow().memory
    }
    /// Bytes in the segment.
    pub fn len(&self) -> usize {
        self.len
    }
    /// The segment is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether `at..at + len` lies inside the segment.
    pub fn covers(&self, at: usize, len: usize) -> bool {
        fits(at, len, self.len)
    }
    /// A sub-range, `at..at + len` of this segment.
    pub fn slice(&self, at: usize, len: usize) -> Option<Segment<R>>
    where
        R: Clone,
    {
        let end = at.checked_add(len)?;
        (end <= self.len).then(|| Segment {
            region: self.region.clone(),
            offset: self.offset + at,
            len,
        })
    }
    /// Copies `data` into the segment at `at`.
    ///
    /// # Panics
    /// If the data does not fit: callers size their copies from the segment.
    pub fn write(&self, at: usize, data: &[u8]) {
        assert!(fits(at, data.len(), self.len), "write past the segment");
        self.memory().write(self.offset + at, data);
    }
    /// Copies from the segment at `at` into `out`.
    ///
    /// # Panics
    /// If `out` reaches past the segment.
    pub fn read(&self, at: usize, out: &mut [u8]) {
        assert!(fits(at, out.len(), self.len), "read past the segment");
        self.memory().read(self.offset + at, out);
    }
    /// Copies `len` bytes from `src` (at `src_at`) into this segment at `at`:
    /// region to region, the one copy of a shared-memory transfer.
    ///
    /// # Panics
    /// If either range reaches past its segment.
    pub fn copy_from<S: Borrow<Region>>(
        &self,
        at: usize,
        src: &Segment<S>,
        src_at: usize,
        len: usize,
    ) {
        assert!(fits(at, len, self.len), "write past the segment");
        assert!(fits(src_at, len, src.len), "read past the segment");
        self.memory()
            .copy_from(self.offset + at, src.memory(), src.offset + src_at, len);
    }
    /// The address of `at..at + len` of the segment, for a copy made
    /// through raw pointers while the caller holds the segment
    /// ([`CopyBoard`]).
    ///
    /// # Panics
    /// If the range reaches past the segment.
    fn ptr_at(&self, at: usize, len: usize) -> *mut u8 {
        assert!(fits(at, len, self.len), "range past the segment");
        self.memory().ptr_at(self.offset + at, len)
    }
    /// Atomic compare-and-swap of the 8-byte word at the start of the segment
    /// (in host byte order, as rxe and NICs keep it); returns the old value.
    pub fn compare_swap(&self, compare: u64, swap: u64) -> u64 {
        self.memory().compare_swap(self.offset, compare, swap)
    }
    /// Atomic fetch-and-add of the 8 bytes at the start of the segment; returns the old value.
    pub fn fetch_add(&self, add: u64) -> u64 {
        self.memory().fetch_add(self.offset, add)
    }
    /// The bytes of the segment for gather I/O.
    ///
    /// # Safety
    /// The caller must not keep the slice beyond the send it builds, and accepts
    /// that a peer's concurrent remote write to these bytes makes what is sent
    /// undefined (as on hardware); see [`RegionMemory::slice`].
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: the range was checked against the region, which keeps the
        // memory alive; the caller takes the aliasing contract above.
        unsafe { self.memory().slice(self.offset, self.len) }
    }
}

/// Whether `at..at + len` lies inside `0..bound` (a sum that would wrap
/// does not).
fn fits(at: usize, len: usize, bound: usize) -> bool {
    at.checked_add(len).is_some_and(|end| end <= bound)
}

/// One `readv(2)` from `fd`: into the region ranges `spans` (each a segment
/// and a range `at..at + len` of it) in order, then into the buffers of
/// `tail`. Returns how many bytes came (0 at end of stream). How a stream
/// provider places a payload with no staging buffer and reads the bytes after
/// it (trailer, next header) in the same system call.
///
/// # Panics
/// If a range reaches past its segment.
pub fn read_vectored_from_fd<R: Borrow<Region>>(
    fd: std::os::fd::BorrowedFd<'_>,
    spans: &[(&Segment<R>, usize, usize)],
    tail: &mut [&mut [u8]],
) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut iov: smallvec::SmallVec<[libc::iovec; 16]> = smallvec::SmallVec::new();
    for &(seg, at, len) in spans {
        assert!(fits(at, len, seg.len), "read past the segment");
        if len > 0 {
            iov.push(seg.memory().iovec_mut(seg.offset + at, len));
        }
    }
    for b in tail.iter_mut().filter(|b| !b.is_empty()) {
        iov.push(libc::iovec {
            iov_base: b.as_mut_ptr().cast::<libc::c_void>(),
            iov_len: b.len(),
        });
    }
    // SAFETY: every iovec points into live memory for its length: region
    // ranges checked against their segments (the regions outlive this call
    // through `spans`), and `tail`, borrowed mutably here. The kernel writes
    // through raw pointers; no Rust reference to region bytes is formed, and
    // what a concurrent reader sees of them is unspecified, as with DMA.
    let n = unsafe { libc::readv(fd.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Keys are random 32-bit numbers: a multiplicative hash spreads them
/// (SipHash, the default, costs more than the rest of a lookup). Also for
/// the providers' tables of QPs by number, looked up per packet.
pub(crate) type KeyHash = std::hash::BuildHasherDefault<KeyHasher>;

#[derive(Debug, Default)]
pub(crate) struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, k: u32) {
        self.0 = u64::from(k).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// Every registered region of a device, by key.
#[derive(Debug, Default)]
pub struct MrTable {
    regions: HashMap<u32, Arc<Region>, KeyHash>,
}

impl MrTable {
    /// An empty table.
    pub fn new() -> MrTable {
        MrTable::default()
    }

    /// Whether a key is taken (as lkey or rkey).
    pub fn key_in_use(&self, key: u32) -> bool {
        self.regions.contains_key(&key)
    }

    /// Adds a region under its keys (lkey and rkey may be equal).
    pub fn insert(&mut self, region: Region) -> Arc<Region> {
        let r = Arc::new(region);
        self.regions.insert(r.lkey, r.clone());
        self.regions.insert(r.rkey, r.clone());
        r
    }

    /// The region whose local key is `lkey`.
    pub fn by_lkey(&self, lkey: u32) -> Option<&Arc<Region>> {
        self.regions.get(&lkey).filter(|r| r.lkey == lkey)
    }

    /// Adds a region of another table under its lkey only: a cache of the
    /// regions local accesses use (remove it with [`MrTable::remove`]).
    pub fn insert_local(&mut self, region: Arc<Region>) {
        self.regions.insert(region.lkey, region);
    }

    /// Invalidates `rkey` (SEND with invalidate, local invalidate) if it is
    /// a remote key (distinct from its lkey) of a region of `pd`: later
    /// remote accesses with it fail; local use of the region goes on.
    /// Invalidating a key already invalid succeeds (as siw and rxe allow).
    /// Returns whether it was such a key.
    pub fn invalidate(&self, pd: PdId, rkey: u32) -> bool {
        match self.regions.get(&rkey) {
            Some(r) if r.rkey == rkey && r.lkey != rkey && r.pd == pd => {
                r.remote_invalid.store(true, Ordering::Release);
                true
            }
            _ => false,
        }
    }

    /// Removes the region with this lkey; later accesses with its keys fail.
    pub fn remove(&mut self, lkey: u32) -> Option<Arc<Region>> {
        let r = self.regions.get(&lkey).filter(|r| r.lkey == lkey)?.clone();
        self.regions.remove(&r.lkey);
        // The rkey may be another region's (registered with the same key).
        if self
            .regions
            .get(&r.rkey)
            .is_some_and(|o| Arc::ptr_eq(o, &r))
        {
            self.regions.remove(&r.rkey);
        }
        Some(r)
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.regions.iter().filter(|(k, r)| **k == r.lkey).count()
    }

    /// The table is empty.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Resolves a local SGE: `lkey`, `addr`, `len`, in protection domain `pd`,
    /// needing `need` (LOCAL_WRITE when the HCA writes into it).
    pub fn local(
        &self,
        pd: PdId,
        lkey: u32,
        addr: u64,
        len: u32,
        need: Access,
    ) -> Result<Segment, AccessError> {
        let (r, offset) = self.find(pd, lkey, false, addr, u64::from(len), need)?;
        Ok(Segment::at(r.clone(), offset, len as usize))
    }

    /// As [`MrTable::local`], borrowing the region for one operation.
    pub fn local_ref(
        &self,
        pd: PdId,
        lkey: u32,
        addr: u64,
        len: u32,
        need: Access,
    ) -> Result<SegmentRef<'_>, AccessError> {
        let (r, offset) = self.find(pd, lkey, false, addr, u64::from(len), need)?;
        Ok(Segment::at(&**r, offset, len as usize))
    }

    /// Resolves a remote access: `rkey`, `va`, `len`, from a QP in `pd`, needing
    /// one of the REMOTE rights.
    pub fn remote(
        &self,
        pd: PdId,
        rkey: u32,
        va: u64,
        len: u64,
        need: Access,
    ) -> Result<Segment, AccessError> {
        let (r, offset) = self.find(pd, rkey, true, va, len, need)?;
        Ok(Segment::at(r.clone(), offset, len as usize))
    }

    /// As [`MrTable::remote`], borrowing the region for one operation.
    pub fn remote_ref(
        &self,
        pd: PdId,
        rkey: u32,
        va: u64,
        len: u64,
        need: Access,
    ) -> Result<SegmentRef<'_>, AccessError> {
        let (r, offset) = self.find(pd, rkey, true, va, len, need)?;
        Ok(Segment::at(&**r, offset, len as usize))
    }

    /// The region `key` names (as an rkey if `remote`, else as an lkey) and
    /// the backing offset of `addr`, once every check passed.
    fn find(
        &self,
        pd: PdId,
        key: u32,
        remote: bool,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(&Arc<Region>, usize), AccessError> {
        let r = self.regions.get(&key).ok_or(AccessError::UnknownKey(key))?;
        if (if remote { r.rkey } else { r.lkey }) != key {
            return Err(AccessError::WrongKeyKind(key));
        }
        if remote && r.remote_invalid.load(Ordering::Acquire) {
            return Err(AccessError::UnknownKey(key));
        }
        if r.pd != pd {
            return Err(AccessError::WrongPd { key });
        }
        if !r.access.contains(need) {
            return Err(AccessError::NotPermitted {
                key,
                missing: Access(need.0 & !r.access.0),
            });
        }
        let offset = r.range(key, addr, len)?;
        // The host word must be aligned too, whatever iova the region advertises.
        if need.contains(Access::REMOTE_ATOMIC)
            && (!addr.is_multiple_of(8) || !(r.memory.addr() + offset as u64).is_multiple_of(8))
        {
            return Err(AccessError::Unaligned(addr));
        }
        Ok((r, offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> (MrTable, Arc<RegionMemory>) {
        let mem = Arc::new(RegionMemory::zeroed(4096).unwrap());
        let mut t = MrTable::new();
        let r = Region::new(
            7,
            (0x1111, 0x2222),
            mem.clone(),
            0,
            4096,
            0x10_0000,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        )
        .unwrap();
        t.insert(r);
        (t, mem)
    }

    /// A range whose end wraps `usize` is past the segment, not before it.
    #[test]
    #[should_panic(expected = "write past the segment")]
    fn a_wrapping_range_is_past_the_segment() {
        let (t, _) = table();
        let seg = t
            .local(7, 0x1111, 0x10_0010, 16, Access::LOCAL_WRITE)
            .unwrap();
        seg.write(usize::MAX, &[0; 2]);
    }

    #[test]
    fn checks_keys_pd_rights_bounds() {
        let (t, _) = table();
        assert!(
            t.local(7, 0x1111, 0x10_0000, 4096, Access::LOCAL_WRITE)
                .is_ok()
        );
        assert_eq!(
            t.local(7, 0x3333, 0x10_0000, 1, Access::NONE).unwrap_err(),
            AccessError::UnknownKey(0x3333)
        );
        assert_eq!(
            t.local(7, 0x2222, 0x10_0000, 1, Access::NONE).unwrap_err(),
            AccessError::WrongKeyKind(0x2222)
        );
        assert_eq!(
            t.remote(8, 0x2222, 0x10_0000, 1, Access::REMOTE_WRITE)
                .unwrap_err(),
            AccessError::WrongPd { key: 0x2222 }
        );
        assert!(matches!(
            t.remote(7, 0x2222, 0x10_0000, 1, Access::REMOTE_READ),
            Err(AccessError::NotPermitted { .. })
        ));
        assert!(matches!(
            t.remote(7, 0x2222, 0x10_0fff, 2, Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.remote(7, 0x2222, 0x0f_ffff, 1, Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.remote(7, 0x2222, u64::MAX, 2, Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert_eq!(
            t.remote(7, 0x2222, 0x10_0004, 8, Access::REMOTE_ATOMIC)
                .unwrap_err(),
            AccessError::Unaligned(0x10_0004)
        );
    }

    #[test]
    fn copies_and_atomics() {
        let (t, _) = table();
        let s = t
            .remote(7, 0x2222, 0x10_0010, 16, Access::REMOTE_WRITE)
            .unwrap();
        s.write(0, b"0123456789abcdef");
        let l = t.local(7, 0x1111, 0x10_0014, 4, Access::NONE).unwrap();
        let mut out = [0u8; 4];
        l.read(0, &mut out);
        assert_eq!(&out, b"4567");
        let a = t
            .remote(7, 0x2222, 0x10_0100, 8, Access::REMOTE_ATOMIC)
            .unwrap();
        assert_eq!(a.fetch_add(5), 0);
        assert_eq!(a.fetch_add(1), 5);
        assert_eq!(a.compare_swap(6, 100), 6);
        assert_eq!(a.compare_swap(6, 200), 100);
        let mut b = [0u8; 8];
        a.read(0, &mut b);
        assert_eq!(
            u64::from_ne_bytes(b),
            100,
            "atomics act on host-order words"
        );
    }

    #[test]
    fn removal_ends_access() {
        let (mut t, _) = table();
        assert!(t.remove(0x2222).is_none(), "removal is by lkey");
        let r = t.remove(0x1111).unwrap();
        assert_eq!(r.rkey, 0x2222);
        assert!(t.is_empty());
        assert!(
            t.remote(7, 0x2222, 0x10_0000, 1, Access::REMOTE_WRITE)
                .is_err()
        );
    }

    #[test]
    fn access_display() {
        assert_eq!(
            (Access::REMOTE_READ | Access::LOCAL_WRITE).to_string(),
            "LOCAL_WRITE|REMOTE_READ"
        );
        assert_eq!(Access::NONE.to_string(), "none");
    }
}
