//! The aligned byte arena that holds every tensor of one weight set.

use crate::manifest::ALIGN;

/// One cache line; the unit a small arena is allocated in, so its start is
/// [`ALIGN`]-aligned.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Line([u8; ALIGN]);

/// Arenas at least this large are anonymous maps asking for transparent huge pages.
const HUGE_FROM: usize = 2 << 20;

/// Where the bytes live.
enum Lines {
    /// A small arena on the heap.
    Heap(Vec<Line>),
    /// A large arena: an anonymous map advised to use transparent huge pages, so its first
    /// write faults once per 2 MiB instead of once per 4 KiB (on a loaded VM, touching 1 GiB
    /// of new 4 KiB pages costs about as much as moving it over loopback TCP).
    Map(memmap2::MmapMut),
}

/// Whether large arenas ask for transparent huge pages: yes, unless fresh huge pages are
/// known to be cold (see [`huge_pages_cold`]), or `REFIT_ARENA_PAGES` says otherwise
/// (`huge` or `small`).
fn huge_pages_pay() -> bool {
    static PAY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PAY.get_or_init(|| match std::env::var("REFIT_ARENA_PAGES").as_deref() {
        Ok("huge") => true,
        Ok("small") => false,
        _ => !huge_pages_cold(std::path::Path::new("/sys")),
    })
}

/// True on a virtual machine whose balloon reports free memory to the hypervisor in blocks
/// as large as a huge page (Linux free page reporting, order <= 9): the host takes those
/// blocks back, so a fresh huge page is backed anew by the host on its first touch, which
/// on such a guest costs several times a 4 KiB page's (small pages come from the smaller
/// free blocks, which are never reported). Reads `sys` (the sysfs root).
pub(crate) fn huge_pages_cold(sys: &std::path::Path) -> bool {
    /// The order of a 2 MiB huge page in 4 KiB pages.
    const HUGE_ORDER: u32 = 9;
    /// The balloon device id and its free page reporting feature bit.
    const BALLOON: &str = "0x0005";
    const REPORTING: usize = 5;
    let order =
        std::fs::read_to_string(sys.join("module/page_reporting/parameters/page_reporting_order"));
    let Some(order) = order.ok().and_then(|o| o.trim().parse::<u32>().ok()) else {
        return false;
    };
    if order > HUGE_ORDER {
        return false;
    }
    let Ok(devices) = std::fs::read_dir(sys.join("bus/virtio/devices")) else {
        return false;
    };
    devices.flatten().any(|d| {
        let read = |f: &str| std::fs::read_to_string(d.path().join(f)).unwrap_or_default();
        read("device").trim() == BALLOON
            && read("features").as_bytes().get(REPORTING) == Some(&b'1')
    })
}

/// A buffer whose first byte is [`ALIGN`]-aligned, zero-filled at creation.
///
/// Large buffers ([`AlignedBuf::zeroed`] of 2 MiB or more) are anonymous maps advised to use
/// transparent huge pages where the platform offers them (Linux with THP `always` or
/// `madvise`) and they are not cold (as on a virtual machine whose balloon hands huge
/// pages back to its host): a fresh arena then costs its first transfer little more than a
/// reused one.
pub struct AlignedBuf {
    lines: Lines,
    len: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (fresh pages come zeroed; no memset pass). A large
    /// one asks for transparent huge pages unless they are cold on this machine
    /// (`REFIT_ARENA_PAGES=huge|small` overrides).
    pub fn zeroed(len: usize) -> Self {
        if len >= HUGE_FROM
            && let Ok(map) = memmap2::MmapMut::map_anon(len)
        {
            // advice only: without THP the map still works, with 4 KiB pages
            #[cfg(target_os = "linux")]
            if huge_pages_pay() {
                let _ = map.advise(memmap2::Advice::HugePage);
            }
            return Self {
                lines: Lines::Map(map),
                len,
            };
        }
        Self {
            lines: Lines::Heap(bytemuck::zeroed_vec(len.div_ceil(ALIGN))),
            len,
        }
    }

    /// True when large buffers ask for transparent huge pages on this machine (false where
    /// fresh huge pages are cold: a virtual machine whose balloon reports free huge-page
    /// blocks to the hypervisor; `REFIT_ARENA_PAGES=huge|small` overrides).
    pub fn huge_pages() -> bool {
        huge_pages_pay()
    }

    /// Faults every page of a large (mapped) buffer in as writable now, without changing a
    /// byte, so that its first writes later cost no page fault (Linux 5.14 or later; a small
    /// buffer, or another platform, is left as it is). True when the pages were populated.
    pub fn prefault(&mut self) -> bool {
        self.prefault_range(0..self.len)
    }

    /// As [`AlignedBuf::prefault`], for the pages holding `range` (clamped to the buffer).
    pub fn prefault_range(&mut self, range: std::ops::Range<usize>) -> bool {
        match &self.lines {
            #[cfg(target_os = "linux")]
            Lines::Map(m) => {
                let end = range.end.min(self.len);
                range.start >= end
                    || m.advise_range(
                        memmap2::Advice::PopulateWrite,
                        range.start,
                        end - range.start,
                    )
                    .is_ok()
            }
            _ => {
                let _ = range;
                false
            }
        }
    }

    /// A buffer holding a copy of `bytes` (a large one copied as
    /// [`copy_parallel`](crate::copy::copy_parallel) copies: across threads, streaming).
    pub fn copy_from(bytes: &[u8]) -> Self {
        let mut buf = Self::zeroed(bytes.len());
        crate::copy::copy_parallel(buf.as_mut_slice(), bytes, crate::copy::copy_threads());
        buf
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when the bytes live in an anonymous map advised to use huge pages (large
    /// buffers) rather than on the heap.
    pub fn is_mapped(&self) -> bool {
        matches!(self.lines, Lines::Map(_))
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.lines {
            Lines::Heap(v) => &bytemuck::cast_slice(v)[..self.len],
            Lines::Map(m) => &m[..self.len],
        }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.lines {
            Lines::Heap(v) => &mut bytemuck::cast_slice_mut(v)[..self.len],
            Lines::Map(m) => &mut m[..self.len],
        }
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> Self {
        Self::copy_from(self.as_slice())
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_are_cold_only_under_free_page_reporting() {
        let root = std::env::temp_dir().join(format!("refit-sysfs-{}", std::process::id()));
        let params = root.join("module/page_reporting/parameters");
        let balloon = root.join("bus/virtio/devices/virtio0");
        let disk = root.join("bus/virtio/devices/virtio1");
        for d in [&params, &balloon, &disk] {
            std::fs::create_dir_all(d).unwrap();
        }
        let write = |p: std::path::PathBuf, s: &str| std::fs::write(p, s).unwrap();
        // no reporting module: warm
        assert!(!huge_pages_cold(&root.join("nothing")));
        write(params.join("page_reporting_order"), "9\n");
        write(disk.join("device"), "0x0002\n");
        write(disk.join("features"), "00100010\n");
        // no balloon: nothing reports
        assert!(!huge_pages_cold(&root));
        write(balloon.join("device"), "0x0005\n");
        write(balloon.join("features"), "01100001\n");
        // a balloon without the reporting feature
        assert!(!huge_pages_cold(&root));
        write(balloon.join("features"), "01100101\n");
        assert!(huge_pages_cold(&root));
        // reported blocks larger than a huge page leave huge pages alone
        write(params.join("page_reporting_order"), "10\n");
        assert!(!huge_pages_cold(&root));
        write(params.join("page_reporting_order"), "garbage");
        assert!(!huge_pages_cold(&root));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn aligned_and_zeroed() {
        for len in [
            0,
            1,
            63,
            64,
            65,
            4096 + 3,
            HUGE_FROM - 1,
            HUGE_FROM,
            3 * HUGE_FROM + 5,
        ] {
            let mut b = AlignedBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.is_mapped(), len >= HUGE_FROM);
            assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            // populating the pages changes no byte (a small buffer is left as it is)
            assert_eq!(b.prefault(), cfg!(target_os = "linux") && len >= HUGE_FROM);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice().fill(7);
            b.prefault();
            b.prefault_range(len / 3..len + 5);
            assert!(b.as_slice().iter().all(|&x| x == 7));
            let c = b.clone();
            assert_eq!(c.as_slice(), b.as_slice());
            assert_eq!(c.is_mapped(), b.is_mapped());
        }
    }
}
