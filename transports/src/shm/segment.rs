//! A file in shared memory mapped into this process, with typed access to the atomic words
//! the layout places in it.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::MmapRaw;
use refit_runtime::copy::copy_threads;
use refit_runtime::{Error, Result};

/// The unit the kernel maps memory in (offsets given to `madvise` are multiples of it).
const PAGE_SIZE: usize = 4096;

/// One mapped segment.
#[derive(Debug)]
pub(crate) struct Segment {
    map: MmapRaw,
    /// Kept open for [`Segment::reserve`] (the sender's data segments grow).
    file: File,
    path: PathBuf,
    len: usize,
}

fn path_err(context: &'static str, path: &Path, source: std::io::Error) -> Error {
    Error::Path {
        context,
        path: path.to_path_buf(),
        source,
    }
}

/// Reserves `len` bytes of the segment's memory from `off` now (tmpfs allocates pages lazily
/// otherwise, and the first updates would pay for it); a full `/dev/shm` is reported here,
/// not as a fault mid-update.
fn allocate(file: &File, path: &Path, off: usize, len: usize) -> Result<()> {
    use std::os::fd::AsRawFd;
    let (Ok(off), Ok(len)) = (libc::off_t::try_from(off), libc::off_t::try_from(len)) else {
        return Err(Error::transport(
            "shm",
            format!("segment {} is too large", path.display()),
        ));
    };
    if len == 0 {
        return Ok(());
    }
    // SAFETY: the descriptor belongs to `file`, open for writing, for the whole call;
    // posix_fallocate touches no memory of ours.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), off, len) };
    if rc == libc::ENOSPC {
        return Err(no_space(path, len as u64));
    }
    if rc != 0 {
        return Err(path_err(
            "reserving memory for shared-memory segment",
            path,
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(())
}

/// `1.5 GiB`, `64.0 MiB`, `12 KiB`.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    if v < 1024.0 {
        return format!("{bytes} B");
    }
    let mut unit = UNITS[0];
    for u in UNITS {
        v /= 1024.0;
        unit = u;
        if v < 1024.0 {
            break;
        }
    }
    format!("{v:.1} {unit}")
}

/// The error for a segment that does not fit: says how much is missing and how to get it
/// (typed: an [`Error::Path`] whose source is [`std::io::ErrorKind::StorageFull`]).
pub(crate) fn no_space(path: &Path, needed: u64) -> Error {
    let dir = path.parent().unwrap_or(path);
    let room = rustix::fs::statvfs(dir)
        .map(|s| {
            format!(
                "{} free of {}",
                human(s.f_bavail.saturating_mul(s.f_frsize)),
                human(s.f_blocks.saturating_mul(s.f_frsize))
            )
        })
        .unwrap_or_else(|e| format!("free space unknown ({e})"));
    Error::Path {
        context: "not enough shared memory for segment",
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            format!(
                "{} needed, {room} in {}; enlarge it (Docker: `docker run --shm-size=8g`, \
                 Compose: `shm_size: 8gb`; Kubernetes: mount an `emptyDir` volume with \
                 `medium: Memory` and a `sizeLimit` at /dev/shm) or point `ShmConfig::dir` \
                 at a larger tmpfs",
                human(needed),
                dir.display()
            ),
        ),
    }
}

/// Fails early, before anything is created, when `dir` has less than `needed` bytes free
/// (the segments of a scheme are created one after another; finding out at the last one
/// would waste the others). A directory whose free space cannot be read is not checked:
/// creating the segments reports its own error.
pub(crate) fn check_space(dir: &Path, first: &Path, needed: u64) -> Result<()> {
    if let Ok(s) = rustix::fs::statvfs(dir)
        && s.f_bavail.saturating_mul(s.f_frsize) < needed
    {
        return Err(no_space(first, needed));
    }
    Ok(())
}

impl Segment {
    /// Creates a new zero-filled segment, its memory reserved; fails if the file exists.
    pub(crate) fn create(path: &Path, len: usize) -> Result<Self> {
        let seg = Self::create_sparse(path, len)?;
        allocate(&seg.file, path, 0, len)?;
        Ok(seg)
    }

    /// Creates a new segment of `len` bytes with no memory reserved yet (see
    /// [`Segment::reserve`]); fails if the file exists.
    pub(crate) fn create_sparse(path: &Path, len: usize) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| path_err("creating shared-memory segment", path, e))?;
        file.set_len(len as u64)
            .map_err(|e| path_err("sizing shared-memory segment", path, e))?;
        Self::map(file, path, len, true)
    }

    /// Reserves the memory of `len` bytes at `off` and maps every page of it into this
    /// (writable) mapping, split across `threads`: what the first write there would
    /// otherwise pay page by page (a fault per 4 KiB, several times a `memcpy` of the same
    /// bytes), paid now, before any version is on its way.
    ///
    /// # Errors
    /// Out of bounds; no room left in the directory ([`no_space`]). A kernel without
    /// `MADV_POPULATE_WRITE` (before Linux 5.14) only loses the prefault.
    pub(crate) fn reserve(&self, off: usize, len: usize, threads: usize) -> Result<()> {
        self.check(off, len, 1)?;
        allocate(&self.file, &self.path, off, len)?;
        let pieces = threads.clamp(1, len.div_ceil(16 << 20).max(1));
        let piece = len.div_ceil(pieces).next_multiple_of(PAGE_SIZE);
        std::thread::scope(|s| {
            let mut at = off;
            while at < off + len {
                let n = piece.min(off + len - at);
                let map = &self.map;
                s.spawn(move || {
                    if let Err(e) = map.advise_range(memmap2::Advice::PopulateWrite, at, n) {
                        tracing::debug!(error = %e, "shm: prefaulting a segment failed");
                    }
                });
                at += n;
            }
        });
        Ok(())
    }

    /// Opens an existing segment.
    pub(crate) fn open(path: &Path, writable: bool) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(|e| path_err("opening shared-memory segment", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| path_err("reading size of", path, e))?
            .len();
        let len = usize::try_from(len).map_err(|_| {
            Error::transport("shm", format!("segment {} is too large", path.display()))
        })?;
        Self::map(file, path, len, writable)
    }

    fn map(file: File, path: &Path, len: usize, writable: bool) -> Result<Self> {
        let map = if writable {
            memmap2::MmapOptions::new().len(len).map_raw(&file)
        } else {
            memmap2::MmapOptions::new()
                .len(len)
                .map_raw_read_only(&file)
        }
        .map_err(|e| path_err("mapping", path, e))?;
        Ok(Self {
            map,
            file,
            path: path.to_path_buf(),
            len,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self, off: usize, size: usize, align: usize) -> Result<()> {
        if !off.is_multiple_of(align) || off.checked_add(size).is_none_or(|end| end > self.len) {
            return Err(Error::transport(
                "shm",
                format!(
                    "segment {}: {size} bytes at {off} fall outside its {} bytes",
                    self.path.display(),
                    self.len
                ),
            ));
        }
        Ok(())
    }

    /// The atomic u32 at `off`.
    pub(crate) fn u32_at(&self, off: usize) -> Result<&AtomicU32> {
        self.check(off, 4, 4)?;
        // SAFETY: the mapping starts page-aligned and lives as long as `self`; `off` is
        // 4-aligned and in bounds (checked above). AtomicU32 has the size and alignment of
        // u32, and every process touches these words only through atomics.
        Ok(unsafe { &*self.map.as_ptr().add(off).cast::<AtomicU32>() })
    }

    /// The atomic u64 at `off`.
    pub(crate) fn u64_at(&self, off: usize) -> Result<&AtomicU64> {
        self.check(off, 8, 8)?;
        // SAFETY: as in `u32_at`, with 8-byte alignment checked.
        Ok(unsafe { &*self.map.as_ptr().add(off).cast::<AtomicU64>() })
    }

    /// Reads `len` bytes at `off`.
    ///
    /// The caller guarantees no process writes them meanwhile (the slot is pinned).
    pub(crate) fn bytes(&self, off: usize, len: usize) -> Result<&[u8]> {
        self.check(off, len, 1)?;
        // SAFETY: in bounds (checked); the mapping outlives the borrow. The protocol keeps
        // writers off a pinned slot, so the bytes do not change while borrowed.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off), len) })
    }

    /// A pointer to `len` bytes at `off`, for a slot lent to one writer (bounds checked;
    /// dereferencing it is the caller's business).
    pub(crate) fn ptr_mut(&self, off: usize, len: usize) -> Result<*mut u8> {
        self.check(off, len, 1)?;
        // SAFETY: `off` is within the mapping (checked), so the offset pointer stays inside
        // the same allocation.
        Ok(unsafe { self.map.as_mut_ptr().add(off) })
    }

    /// Writes `src` at `off` (the caller holds the slot in its writing state).
    pub(crate) fn write(&self, off: usize, src: &[u8]) -> Result<()> {
        self.check(off, src.len(), 1)?;
        if self.map.as_mut_ptr().is_null() {
            return Err(Error::State("segment is not mapped"));
        }
        // SAFETY: in bounds (checked); the mapping is writable (writers map with `create` or
        // `open(.., true)`); no reader looks at a slot in its writing state, so nothing else
        // reads or writes the destination while this slice lives (until the copy below
        // returns); `src` is ordinary process memory, so the ranges do not overlap.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), src.len()) };
        // A large publish is split across threads taking pieces as they go, with streaming
        // stores (see `refit_runtime::copy`).
        refit_runtime::copy::copy_parallel(dst, src, copy_threads());
        Ok(())
    }

    /// As [`Segment::write`], answering the checksum of the bytes written
    /// ([`super::checksum`]), each piece hashed right after it is copied.
    pub(crate) fn write_hashed(&self, off: usize, src: &[u8]) -> Result<u64> {
        self.check(off, src.len(), 1)?;
        if self.map.as_mut_ptr().is_null() {
            return Err(Error::State("segment is not mapped"));
        }
        // SAFETY: as in `write`: in bounds, writable, the slot is in its writing state so
        // nothing else touches the destination while this slice lives, and `src` is process
        // memory that does not overlap it.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), src.len()) };
        Ok(super::checksum::copy_hashed(dst, src, copy_threads()))
    }

    /// Removes the file (mappings stay valid until dropped).
    pub(crate) fn unlink(&self) -> Result<()> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(path_err("removing", &self.path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn typed_words_are_bounds_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("seg");
        let s = Segment::create(&p, 4096).unwrap();
        assert!(Segment::create(&p, 4096).is_err());
        s.u64_at(8).unwrap().store(77, Ordering::SeqCst);
        s.write(100, b"hello").unwrap();
        let r = Segment::open(&p, false).unwrap();
        assert_eq!(r.len(), 4096);
        assert_eq!(r.u64_at(8).unwrap().load(Ordering::SeqCst), 77);
        assert_eq!(r.bytes(100, 5).unwrap(), b"hello");
        assert!(s.u64_at(4).is_err());
        assert!(s.u32_at(4094).is_err());
        assert!(s.bytes(4000, 200).is_err());
        assert!(s.write(usize::MAX, b"x").is_err());
        s.unlink().unwrap();
        s.unlink().unwrap();
        assert!(!p.exists());
    }

    #[test]
    fn a_sparse_segment_reserves_on_demand_and_hashes_what_it_writes() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("seg");
        let s = Segment::create_sparse(&p, 64 * PAGE_SIZE).unwrap();
        let allocated = || std::fs::metadata(&p).unwrap().blocks() * 512;
        assert!(allocated() < 16 * PAGE_SIZE as u64, "{}", allocated());
        s.reserve(16 * PAGE_SIZE, 32 * PAGE_SIZE, 3).unwrap();
        assert!(allocated() >= 32 * PAGE_SIZE as u64, "{}", allocated());
        assert!(s.reserve(60 * PAGE_SIZE, 8 * PAGE_SIZE, 1).is_err());
        let src: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        let sum = s.write_hashed(16 * PAGE_SIZE + 3, &src).unwrap();
        assert_eq!(s.bytes(16 * PAGE_SIZE + 3, src.len()).unwrap(), &src[..]);
        assert_eq!(sum, super::super::checksum::checksum(&src, 1));
        assert!(s.write_hashed(64 * PAGE_SIZE - 1, b"xy").is_err());
    }

    #[test]
    fn a_full_directory_says_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("seg");
        // more than any test machine has: refused before anything is created
        let e = check_space(dir.path(), &p, 1 << 60).unwrap_err();
        let Error::Path { source, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(source.kind(), std::io::ErrorKind::StorageFull);
        let msg = e.to_string();
        for needle in ["--shm-size", "emptyDir", "medium: Memory", "free of"] {
            assert!(msg.contains(needle), "{msg}");
        }
        assert!(msg.contains("1048576.0 TiB"), "{msg}");
        assert!(!p.exists());
        check_space(dir.path(), &p, 4096).unwrap();
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 29), "1.5 GiB");
    }
}
