//! The region pieces a packet's payload is sent from: what an engine hands
//! a provider for zero-copy gather I/O. Each piece's region stays alive
//! until the send that reads it is made: a `Segment` piece holds it, a
//! [`HeldPiece`] its batch's [`HeldRegions`].

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use super::{Region, Segment, fits};

/// Where an engine puts the region pieces of the packet it builds.
pub trait PieceSink {
    /// `len` bytes of `seg` from `at` on.
    ///
    /// # Panics
    /// If the range reaches past the segment (engines size pieces from it).
    fn push_range(&mut self, seg: &Segment, at: usize, len: usize);
    /// All of `seg`.
    fn push_segment(&mut self, seg: Segment);
    /// Forgets the packet's pieces so far.
    fn clear_pieces(&mut self);
}

/// One segment per piece, each with its own reference to its region.
impl PieceSink for Vec<Segment> {
    fn push_range(&mut self, seg: &Segment, at: usize, len: usize) {
        self.push(seg.slice(at, len).expect("a piece inside its segment"));
    }
    fn push_segment(&mut self, seg: Segment) {
        self.push(seg);
    }
    fn clear_pieces(&mut self) {
        self.clear();
    }
}

/// The regions a batch of packets is sent from, each referenced once for
/// the batch: a reference per packet piece (an atomic increment as it is
/// taken and a decrement after the send) cost a RoCEv2 sender about 3 % of
/// its time in a 64 KiB WRITE stream, where one region serves the batch.
#[derive(Debug)]
pub struct HeldRegions {
    regions: Vec<Arc<Region>>,
    /// Counts releases, from a start of its own: a piece of an earlier
    /// batch, or of another holder, is refused, not read from whatever
    /// region took its place.
    generation: u32,
}

impl Default for HeldRegions {
    fn default() -> HeldRegions {
        // Holders start far apart: one's pieces do not pass for another's.
        static STARTS: AtomicU32 = AtomicU32::new(0);
        HeldRegions {
            regions: Vec::new(),
            generation: STARTS.fetch_add(1 << 16, Ordering::Relaxed),
        }
    }
}

/// A piece of a region that a [`HeldRegions`] holds.
#[derive(Debug, Clone, Copy)]
pub struct HeldPiece {
    region: u32,
    generation: u32,
    /// Offset in the region's backing memory.
    offset: usize,
    len: usize,
}

impl HeldPiece {
    /// Bytes in the piece.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The piece is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Regions looked at for one already held before another reference is
/// taken: a batch's pieces mostly come from one or two.
const HELD_LOOKS: usize = 4;

impl HeldRegions {
    /// A sink for one packet's pieces, which go to `pieces`.
    pub fn sink<'a>(&'a mut self, pieces: &'a mut Vec<HeldPiece>) -> PacketPieces<'a> {
        PacketPieces { held: self, pieces }
    }

    /// The index of `region`, taking a reference (`region`'s own, or a
    /// clone of a borrowed one) if it is not among the last held.
    fn hold(&mut self, region: Cow<'_, Arc<Region>>) -> u32 {
        if let Some(i) = self.recent(&region) {
            return i;
        }
        self.regions.push(region.into_owned());
        (self.regions.len() - 1) as u32
    }

    fn recent(&self, region: &Arc<Region>) -> Option<u32> {
        let n = self.regions.len();
        self.regions
            .iter()
            .rev()
            .take(HELD_LOOKS)
            .position(|r| Arc::ptr_eq(r, region))
            .map(|back| (n - 1 - back) as u32)
    }

    /// The bytes of `piece` for gather I/O.
    ///
    /// # Panics
    /// If `piece` was taken before the last [`HeldRegions::release`].
    ///
    /// # Safety
    /// As [`Segment::bytes`]: the caller must not keep the slice beyond the
    /// send it builds, and accepts that a peer's concurrent remote write to
    /// these bytes makes what is sent undefined (as on hardware).
    pub unsafe fn bytes(&self, piece: &HeldPiece) -> &[u8] {
        assert_eq!(
            piece.generation, self.generation,
            "a piece of a released batch"
        );
        let memory = self.regions[piece.region as usize].memory();
        assert!(
            fits(piece.offset, piece.len, memory.len()),
            "a piece past its region's memory"
        );
        // SAFETY: the range lies inside the memory, which the held region
        // keeps alive; the caller takes the aliasing contract above.
        unsafe { memory.slice(piece.offset, piece.len) }
    }

    /// Drops the batch's references. The caller has cleared the batch's
    /// pieces (a piece kept is refused by [`HeldRegions::bytes`]).
    pub fn release(&mut self) {
        self.regions.clear();
        self.generation = self.generation.wrapping_add(1);
    }
}

/// The [`PieceSink`] of one packet of a batch: pieces to the packet's list,
/// their regions held by the batch.
#[derive(Debug)]
pub struct PacketPieces<'a> {
    held: &'a mut HeldRegions,
    pieces: &'a mut Vec<HeldPiece>,
}

impl PieceSink for PacketPieces<'_> {
    fn push_range(&mut self, seg: &Segment, at: usize, len: usize) {
        assert!(seg.covers(at, len), "a piece inside its segment");
        let region = self.held.hold(Cow::Borrowed(&seg.region));
        self.pieces.push(HeldPiece {
            region,
            generation: self.held.generation,
            offset: seg.offset + at,
            len,
        });
    }

    fn push_segment(&mut self, seg: Segment) {
        let (offset, len) = (seg.offset, seg.len);
        let region = self.held.hold(Cow::Owned(seg.region));
        self.pieces.push(HeldPiece {
            region,
            generation: self.held.generation,
            offset,
            len,
        });
    }

    fn clear_pieces(&mut self) {
        self.pieces.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Access, MrTable, RegionMemory};

    const LKEY: u32 = 0x1111;
    const IOVA: u64 = 0x1000;

    /// A table with one 8 KiB region whose byte k holds k mod 256.
    fn table() -> MrTable {
        let mem: Vec<u8> = (0..=255u8).cycle().take(8192).collect();
        let mem = Arc::new(RegionMemory::from_vec(mem));
        let r = Region::new(7, (LKEY, 0x2222), mem, 0, 8192, IOVA, Access::LOCAL_WRITE).unwrap();
        let mut t = MrTable::new();
        t.insert(r);
        t
    }

    fn segment(t: &MrTable, at: u64, len: u32) -> Segment {
        t.local(7, LKEY, IOVA + at, len, Access::NONE).unwrap()
    }

    #[test]
    fn a_batch_holds_each_region_once_and_reads_each_piece() {
        let t = table();
        let seg = segment(&t, 0, 8192);
        let region = seg.region().clone();
        let before = Arc::strong_count(&region);
        let mut held = HeldRegions::default();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        held.sink(&mut a).push_range(&seg, 100, 4);
        held.sink(&mut b).push_range(&seg, 4096, 3);
        held.sink(&mut b).push_segment(segment(&t, 10, 2));
        // One reference for the batch, however many pieces.
        assert_eq!(Arc::strong_count(&region), before + 1);
        // SAFETY: read here only; nothing writes the region.
        unsafe {
            assert_eq!(held.bytes(&a[0]), &[100, 101, 102, 103]);
            assert_eq!(held.bytes(&b[0]), &[0, 1, 2]);
            assert_eq!(held.bytes(&b[1]), &[10, 11]);
        }
        held.release();
        assert_eq!(Arc::strong_count(&region), before);
    }

    #[test]
    #[should_panic(expected = "a piece of a released batch")]
    fn a_piece_of_a_released_batch_is_refused() {
        let t = table();
        let seg = segment(&t, 0, 8192);
        let mut held = HeldRegions::default();
        let mut p = Vec::new();
        held.sink(&mut p).push_range(&seg, 0, 8);
        held.release();
        held.sink(&mut Vec::new()).push_range(&seg, 0, 8);
        // SAFETY: read only; it panics before reading.
        let _ = unsafe { held.bytes(&p[0]) };
    }

    #[test]
    #[should_panic(expected = "a piece inside its segment")]
    fn a_range_past_its_segment_is_refused() {
        let t = table();
        let seg = segment(&t, 0, 16);
        HeldRegions::default()
            .sink(&mut Vec::new())
            .push_range(&seg, 8, 9);
    }
}
