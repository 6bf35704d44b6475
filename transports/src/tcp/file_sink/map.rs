//! A writable map of a file held in memory (tmpfs, such as `/dev/shm`) that a transfer
//! receives into directly, so each byte lands once, where it stays.
//!
//! The map starts on a 2 MiB boundary, so every 2 MiB of the file can be one huge page.
//! Before bytes land in a stretch of the file its 2 MiB regions are prepared: collapsed into
//! huge pages (`MADV_COLLAPSE`, Linux 6.1 and later: tmpfs takes it whatever its `huge=`
//! mount option, and one huge page costs what a few 4 KiB ones do), then whatever is left
//! allocated in one call (`MADV_POPULATE_WRITE`). Every page exists before anything writes
//! it: a full file system is an error from the call, never a `SIGBUS`. Unlike `write(2)`,
//! nothing here takes the file's lock, so the streams of a transfer fill their parts at once
//! instead of queueing on it.
//!
//! Collapsing stops for the rest of the file when the kernel refuses it or when it turns
//! slow on average (memory a hypervisor took back, which it faults in again 4 KiB at a time
//! while the huge page is zeroed): [`FileMap::claim`] then answers `None` and the caller
//! writes with `write(2)`, which on 4 KiB pages costs less than faulting them into a map.

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use refit_runtime::{Error, Result, SharedBytes};

use crate::tcp::SinkSlice;

/// Bytes of one huge page, the unit regions are prepared in.
const HUGE: usize = 2 << 20;
/// Bytes of a base page.
const PAGE: usize = 4096;
/// `MADV_COLLAPSE` (Linux 6.1), spelled out: not every libc names it.
const MADV_COLLAPSE: libc::c_int = 25;
/// Average processor time per collapsed region past which huge pages cost more than writing
/// 4 KiB pages would (those cost about 1 ms more per 2 MiB; a huge page whose memory is warm
/// takes 0.1-0.5 ms). Memory a hypervisor took back (virtio-balloon free page reporting
/// hands it free 2 MiB blocks) takes ten times as long, faulted in page by page.
const SLOW_COLLAPSE: Duration = Duration::from_micros(1500);

/// How `refit pull` fills a file in memory: `REFIT_PULL_MAP` = `huge` (the map while huge
/// pages stay cheap, then positioned writes), `map` (the map throughout, on base pages once
/// huge ones are not cheap) or `write` (positioned writes only). Unset, the choice is `map`
/// on machines of [`MAP_CORES`] cores or more and `huge` below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MapMode {
    /// The map while collapsing into huge pages stays cheap, then positioned writes.
    Huge,
    /// The map throughout.
    Map,
    /// Positioned writes only.
    Write,
}

/// Cores from which base pages faulted into the map beat positioned writes: the file's lock
/// makes `write(2)` one writer at a time, while the streams fault their parts of a map in
/// parallel, given cores to do it on (on a 16-core machine 1 GiB into a new /dev/shm file
/// took 0.25 s over 4 threads through a map against 0.34-0.41 s with `pwrite`; on 2 cores
/// the map lost).
pub(crate) const MAP_CORES: usize = 8;

impl MapMode {
    /// The mode `REFIT_PULL_MAP` names, or the default for this machine.
    pub(crate) fn from_env() -> Self {
        match std::env::var("REFIT_PULL_MAP")
            .ok()
            .as_deref()
            .map(str::trim)
        {
            Some("huge") => Self::Huge,
            Some("map") => Self::Map,
            Some("write") => Self::Write,
            _ => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                if cores >= MAP_CORES {
                    Self::Map
                } else {
                    Self::Huge
                }
            }
        }
    }
}

/// Processor time of the calling thread (not counting time others held the core).
fn thread_cpu() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes the struct it is given, which lives on this stack.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// A shared, writable map of a whole tmpfs file, handed out in disjoint slices.
pub(crate) struct FileMap {
    /// The reservation the map lies in (unmapped whole on drop).
    reserved: *mut libc::c_void,
    reserved_len: usize,
    /// File offset 0, on a 2 MiB boundary inside the reservation.
    base: *mut u8,
    /// The file's length (the map covers it, rounded up to a page).
    len: usize,
    /// Per 2 MiB region of the file: prepared (its pages exist).
    ready: Vec<AtomicBool>,
    /// Held while regions are prepared (a region is prepared once, by one thread): the
    /// running average of a collapse's processor time.
    preparing: Mutex<Duration>,
    /// Whether collapsing into huge pages is still worth trying (false once the kernel
    /// says it does not know the call).
    huge: AtomicBool,
    /// Whether claims go on being answered with the map once huge pages are off.
    base_pages: bool,
    /// File ranges handed out by [`FileMap::claim`], never overlapping.
    claimed: Mutex<Vec<Range<usize>>>,
}

// SAFETY: the map is plain memory owned by this value; every writer gets a slice of its own
// (`claim` never hands out overlapping ranges) and the bookkeeping is behind mutexes and
// atomics, so sharing the value between threads is sound.
unsafe impl Send for FileMap {}
// SAFETY: as for `Send`: `&FileMap` gives out only disjoint slices and synchronised state.
unsafe impl Sync for FileMap {}

fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::io(context, source)
}

impl FileMap {
    /// A map of `file` (`len` bytes long) when the file lives in memory (tmpfs); `None` for
    /// files on other file systems, which positioned writes suit better.
    ///
    /// # Errors
    /// The system call's error when the file cannot be inspected or mapped.
    pub(crate) fn of(file: &File, len: usize, mode: MapMode) -> std::io::Result<Option<Self>> {
        if mode == MapMode::Write {
            return Ok(None);
        }
        // SAFETY: `fstatfs` writes into the zeroed struct it is given; the descriptor is open
        // for as long as `file` is borrowed.
        let in_memory = unsafe {
            let mut fs: libc::statfs = std::mem::zeroed();
            if libc::fstatfs(file.as_raw_fd(), &mut fs) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            fs.f_type as u64 == libc::TMPFS_MAGIC as u64
        };
        if !in_memory || len == 0 {
            return Ok(None);
        }
        let mapped = len.next_multiple_of(PAGE);
        let reserved_len = mapped + HUGE;
        // SAFETY: a fresh private reservation (no access) that nothing else refers to.
        let reserved = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserved_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if reserved == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let skip = (reserved as usize).next_multiple_of(HUGE) - reserved as usize;
        // SAFETY: `skip < HUGE`, so `[skip, skip + mapped)` lies inside the reservation, which
        // this function owns; MAP_FIXED replaces that part of it with the file's map.
        let base = unsafe {
            let at = reserved.cast::<u8>().add(skip).cast::<libc::c_void>();
            libc::mmap(
                at,
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            // SAFETY: the reservation made above, unmapped once.
            unsafe { libc::munmap(reserved, reserved_len) };
            return Err(e);
        }
        Ok(Some(Self {
            reserved,
            reserved_len,
            base: base.cast(),
            len,
            ready: (0..len.div_ceil(HUGE))
                .map(|_| AtomicBool::new(false))
                .collect(),
            preparing: Mutex::new(Duration::ZERO),
            huge: AtomicBool::new(true),
            base_pages: mode == MapMode::Map,
            claimed: Mutex::new(Vec::new()),
        }))
    }

    /// `madvise` on the file's bytes `range` (page-aligned, inside the map).
    fn advise(&self, range: Range<usize>, advice: libc::c_int) -> std::io::Result<()> {
        // SAFETY: `range` lies inside the file's map (callers clamp it to the mapped length),
        // and neither advice moves or frees memory: they allocate the file's pages (or merge
        // them into a huge page keeping their bytes) and map them.
        let r = unsafe { libc::madvise(self.base.add(range.start).cast(), range.len(), advice) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Collapses region `r` (inside the file) into a huge page: one page of it is
    /// allocated first (a collapse needs one; bytes already there are kept). Returns the
    /// processor time it took, or `None` when the kernel refused.
    fn collapse(&self, r: usize) -> Option<Duration> {
        let at = r * HUGE;
        let started = thread_cpu();
        self.advise(at..at + PAGE, libc::MADV_POPULATE_WRITE)
            .and_then(|()| self.advise(at..at + HUGE, MADV_COLLAPSE))
            .ok()?;
        Some(thread_cpu().saturating_sub(started))
    }

    /// Prepares the regions `regions` (indices of 2 MiB regions), none of them ready:
    /// collapsed into huge pages while that stays cheap (`cost`: the running average of a
    /// collapse's processor time), else their base pages allocated.
    fn prepare_run(&self, regions: Range<usize>, cost: &mut Duration) -> std::io::Result<()> {
        let whole = self.len / HUGE;
        for r in regions.clone() {
            // a region wholly inside the file can become a huge page; a refusal (a kernel
            // without the call, no huge page free) or collapses that crawl on average
            // (memory the hypervisor must fault in page by page) turn collapsing off
            if r >= whole || !self.huge.load(Ordering::Relaxed) {
                continue;
            }
            let cheap = self.collapse(r).is_some_and(|took| {
                // one slow collapse (a compaction) moves the average by 0.5 ms at most
                *cost = (*cost * 7 + took.min(SLOW_COLLAPSE * 8 / 3)) / 8;
                *cost <= SLOW_COLLAPSE
            });
            if !cheap {
                self.huge.store(false, Ordering::Relaxed);
            }
        }
        // allocates whatever no collapse covered (nothing when they all succeeded)
        let start = regions.start * HUGE;
        let end = (regions.end * HUGE).min(self.len.next_multiple_of(PAGE));
        self.advise(start..end, libc::MADV_POPULATE_WRITE)
    }

    /// Makes every page of the file's bytes `range` exist, preparing the regions it touches
    /// that no one prepared yet.
    fn prepare(&self, range: &Range<usize>) -> std::io::Result<()> {
        let regions = range.start / HUGE..range.end.div_ceil(HUGE);
        let is_ready = |r: usize| self.ready.get(r).is_none_or(|f| f.load(Ordering::Acquire));
        if regions.clone().all(is_ready) {
            return Ok(());
        }
        let mut cost = self.preparing.lock().unwrap_or_else(|p| p.into_inner());
        let mut r = regions.start;
        while r < regions.end {
            if is_ready(r) {
                r += 1;
                continue;
            }
            let run = r;
            while r < regions.end && !is_ready(r) {
                r += 1;
            }
            self.prepare_run(run..r, &mut cost)?;
            for f in self.ready.get(run..r).unwrap_or_default() {
                f.store(true, Ordering::Release);
            }
        }
        Ok(())
    }

    /// The file's bytes `range`, prepared, for one writer, while huge pages back the file;
    /// `None` once they do not (the caller then writes the bytes with `write(2)`, cheaper
    /// than base pages faulted into the map). A range overlapping one claimed before, or
    /// past the end of the file, is refused.
    ///
    /// # Errors
    /// [`Error::State`] for a range claimed twice or past the end; [`Error::Io`] when the
    /// pages cannot be allocated (the file system is full).
    pub(crate) fn claim(&self, range: Range<usize>) -> Result<Option<SinkSlice<'_>>> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::State("a claim past the end of the file"));
        }
        {
            let mut claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
            if claimed
                .iter()
                .any(|c| c.start < range.end && range.start < c.end)
            {
                return Err(Error::State("bytes of the file claimed twice"));
            }
            claimed.push(range.clone());
        }
        if !self.huge.load(Ordering::Relaxed) && !self.base_pages {
            // base pages faulted into a map cost more than positioned writes on a machine
            // of few cores: the caller writes these bytes instead
            return Ok(None);
        }
        self.prepare(&range)
            .map_err(io("allocating the pages of the file"))?;
        // SAFETY: `range` lies inside the map, which lives as long as `self` (the slice
        // borrows it); no other slice covers any of its bytes (checked above, and claims are
        // never released), and this value itself reads the bytes only after consuming
        // `self` (`into_bytes`), so the slice is the only reference to them.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(self.base.add(range.start), range.len()) };
        Ok(Some(SinkSlice::new(bytes)))
    }

    /// The file's bytes `data`, read-only from now on, as the storage of a weight set.
    ///
    /// # Errors
    /// [`Error::Io`] when the map cannot be made read-only; [`Error::State`] when `data` lies
    /// past the end of the file.
    pub(crate) fn into_bytes(self, data: Range<usize>) -> Result<MappedFile> {
        if data.start > data.end || data.end > self.len {
            return Err(Error::State("the weights lie past the end of the file"));
        }
        // SAFETY: the range is the file's map made above (page-aligned start, its length);
        // no slice of it outlives `self`, which this call consumes, so nothing writes it.
        let r = unsafe {
            libc::mprotect(
                self.base.cast(),
                self.len.next_multiple_of(PAGE),
                libc::PROT_READ,
            )
        };
        if r != 0 {
            return Err(io("making the file's map read-only")(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(MappedFile { map: self, data })
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: the reservation this value made and owns (the file's map lies inside it);
        // no slice of it outlives `self`.
        unsafe { libc::munmap(self.reserved, self.reserved_len) };
    }
}

/// A file's map made read-only: the storage of the weights a transfer wrote into it.
pub(crate) struct MappedFile {
    map: FileMap,
    data: Range<usize>,
}

impl SharedBytes for MappedFile {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `data` lies inside the map (checked in `into_bytes`), which is read-only
        // and lives as long as `self`; nothing writes it any more.
        unsafe { std::slice::from_raw_parts(self.map.base.add(self.data.start), self.data.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `len` bytes in /dev/shm (tmpfs on Linux), mapped.
    fn mapped(len: usize, mode: MapMode) -> (tempfile::TempDir, std::path::PathBuf, FileMap) {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("f");
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        file.set_len(len as u64).unwrap();
        let map = FileMap::of(&file, len, mode)
            .unwrap()
            .expect("/dev/shm is tmpfs");
        (dir, path, map)
    }

    #[test]
    fn claimed_bytes_land_in_the_file_and_read_back_from_the_map() {
        // three 2 MiB regions and a tail: huge pages where the kernel gives them
        let len = 3 * HUGE + 12_345;
        for mode in [MapMode::Huge, MapMode::Map] {
            claims_land(len, mode);
        }
    }

    /// Fills a file of `len` bytes through claims of a map in `mode`, then reads it back.
    fn claims_land(len: usize, mode: MapMode) {
        let (_dir, path, map) = mapped(len, mode);
        let fill = |map: &FileMap, range: Range<usize>, seed: u8| {
            match map.claim(range.clone()).unwrap() {
                Some(mut s) => {
                    for (i, b) in s.iter_mut().enumerate() {
                        *b = seed ^ (i % 251) as u8;
                    }
                }
                // collapsing turned off (slow or refused): the caller writes the bytes;
                // a map in `Map` mode answers every claim, on base pages if need be
                None => {
                    assert_ne!(mode, MapMode::Map, "a claim refused in map mode");
                    let bytes: Vec<u8> = (0..range.len()).map(|i| seed ^ (i % 251) as u8).collect();
                    std::os::unix::fs::FileExt::write_all_at(
                        &File::options().write(true).open(&path).unwrap(),
                        &bytes,
                        range.start as u64,
                    )
                    .unwrap();
                }
            }
        };
        // the first claim always gets the map (it tries the huge pages first)
        assert!(map.claim(0..100).unwrap().is_some());
        fill(&map, 100..HUGE + 7, 1);
        fill(&map, HUGE + 7..len, 2);
        let data = map.into_bytes(100..len).unwrap();
        let file = std::fs::read(&path).unwrap();
        assert_eq!(data.bytes(), &file[100..]);
        assert_eq!(data.bytes()[0], 1);
        assert_eq!(data.bytes()[HUGE + 7 - 100], 2);
        assert_eq!(data.bytes()[len - 101], 2 ^ ((len - HUGE - 8) % 251) as u8);
    }

    #[test]
    fn overlapping_or_outside_claims_are_refused() {
        let (_dir, _path, map) = mapped(HUGE + 64, MapMode::Huge);
        let first = map.claim(64..1000).unwrap();
        assert!(first.is_some());
        assert!(matches!(map.claim(999..2000), Err(Error::State(_))));
        assert!(matches!(map.claim(0..65), Err(Error::State(_))));
        assert!(matches!(map.claim(HUGE..HUGE + 65), Err(Error::State(_))));
        assert!(map.claim(1000..2000).is_ok());
    }
}
