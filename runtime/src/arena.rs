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

/// A buffer whose first byte is [`ALIGN`]-aligned, zero-filled at creation.
///
/// Large buffers ([`AlignedBuf::zeroed`] of 2 MiB or more) are anonymous maps advised to use
/// transparent huge pages where the platform offers them (Linux with THP `always` or
/// `madvise`): a fresh arena then costs its first transfer little more than a reused one.
pub struct AlignedBuf {
    lines: Lines,
    len: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (fresh pages come zeroed; no memset pass).
    pub fn zeroed(len: usize) -> Self {
        if len >= HUGE_FROM
            && let Ok(map) = memmap2::MmapMut::map_anon(len)
        {
            // advice only: without THP the map still works, with 4 KiB pages
            #[cfg(target_os = "linux")]
            let _ = map.advise(memmap2::Advice::HugePage);
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

    /// A buffer holding a copy of `bytes`.
    pub fn copy_from(bytes: &[u8]) -> Self {
        let mut buf = Self::zeroed(bytes.len());
        buf.as_mut_slice().copy_from_slice(bytes);
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
            b.as_mut_slice().fill(7);
            let c = b.clone();
            assert_eq!(c.as_slice(), b.as_slice());
            assert_eq!(c.is_mapped(), b.is_mapped());
        }
    }
}
