//! Shared memory: memfds, sealed so that no process can shrink them under a
//! mapping (which would turn an access into SIGBUS), mapped MAP_SHARED into
//! [`RegionMemory`]. One of the few places with `unsafe`: `mmap` and `munmap`.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::memory::RegionMemory;

const PAGE: usize = 4096;

/// A MAP_SHARED mapping; unmapped when dropped (after the RegionMemory over
/// it, which owns it).
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory, reached only through the
// RegionMemory's raw-pointer copies and atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length; the RegionMemory that
        // used it is gone (it owns this Mapping and drops it last).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// `statfs`'s file-system type of shmem, where memfds live (linux/magic.h).
const TMPFS_MAGIC: u64 = 0x0102_1994;

/// `len` bytes (rounded up to pages) of new shared memory, zeroed and sealed
/// at that size: the memory, mapped here, and the memfd to pass to peers.
pub(crate) fn create(len: usize, name: &str) -> io::Result<(RegionMemory, OwnedFd)> {
    if len == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "shared memory of 0 bytes",
        ));
    }
    let size = len.div_ceil(PAGE) * PAGE;
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, size as u64)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    let memory = map(fd.as_fd(), len)?;
    Ok((memory, fd))
}

/// Maps `len` bytes of a peer's memfd. Refused unless the memfd is sealed
/// against shrinking and holds `len` bytes: a peer cannot make this side's
/// accesses fault.
pub(crate) fn map(fd: BorrowedFd<'_>, len: usize) -> io::Result<RegionMemory> {
    let refuse = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
    if len == 0 {
        return Err(refuse("a shared region of 0 bytes"));
    }
    let seals = rustix::fs::fcntl_get_seals(fd)?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(refuse("shared memory that is not sealed against shrinking"));
    }
    let st = rustix::fs::fstat(fd)?;
    if (st.st_size as u64) < len as u64 {
        return Err(refuse("shared memory smaller than announced"));
    }
    // Plain shmem only: a hugetlbfs memfd faults (SIGBUS) once its pool
    // runs dry, which would kill this process on the peer's say-so.
    if rustix::fs::fstatfs(fd)?.f_type as u64 != TMPFS_MAGIC {
        return Err(refuse("shared memory that is not plain shmem (tmpfs)"));
    }
    // SAFETY: a new mapping chosen by the kernel (null hint), of a memfd
    // sealed at a size of at least `len` bytes; nothing else refers to it.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            0,
        )?
    };
    let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| refuse("mmap returned null"))?;
    let keeper = Mapping { ptr, len };
    // SAFETY: `ptr` is a fresh page-aligned read/write mapping of `len`
    // bytes, alive as long as `keeper`, which the RegionMemory owns; other
    // processes mapping the same memfd are peers whose accesses are their
    // own race, as a NIC's DMA is.
    Ok(unsafe { RegionMemory::from_raw_parts(ptr, len, Box::new(keeper)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_share_bytes_and_atomics() {
        let (a, fd) = create(10_000, "test").unwrap();
        let b = map(fd.as_fd(), 10_000).unwrap();
        a.write(9_000, b"shared");
        let mut got = [0u8; 6];
        b.read(9_000, &mut got);
        assert_eq!(&got, b"shared");
        b.fetch_add(64, 5);
        assert_eq!(a.fetch_add(64, 1), 5);
    }

    #[test]
    fn unsealed_or_short_memory_is_refused() {
        let (_a, fd) = create(4096, "test").unwrap();
        assert!(map(fd.as_fd(), 8192).is_err(), "longer than the memfd");
        let plain = rustix::fs::memfd_create("plain", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&plain, 4096).unwrap();
        assert!(map(plain.as_fd(), 4096).is_err(), "not sealed");
        assert!(create(0, "test").is_err());
    }
}
