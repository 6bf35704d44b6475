//! The aligned byte arena that holds every tensor of one weight set.

use crate::manifest::ALIGN;

/// One cache line; the unit the arena is allocated in, so its start is [`ALIGN`]-aligned.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Line([u8; ALIGN]);

/// A heap buffer whose first byte is [`ALIGN`]-aligned, zero-filled at creation.
pub struct AlignedBuf {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (the allocator hands out zeroed pages; no memset pass).
    pub fn zeroed(len: usize) -> Self {
        Self {
            lines: bytemuck::zeroed_vec(len.div_ceil(ALIGN)),
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

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
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
        for len in [0, 1, 63, 64, 65, 4096 + 3] {
            let mut b = AlignedBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice().fill(7);
            let c = b.clone();
            assert_eq!(c.as_slice(), b.as_slice());
        }
    }
}
