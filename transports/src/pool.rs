//! Arenas of earlier versions, kept for reuse by receivers that fill a private arena per
//! update (copying shared-memory readers, TCP pulls): a fresh arena per update would pay a
//! page fault (and the kernel's zeroing) per 4 KiB every time.

use std::sync::{Arc, Mutex};

use refit_runtime::{AlignedBuf, SharedBytes};

/// Free arenas, at most [`BufPool::KEEP`].
#[derive(Debug, Default)]
pub(crate) struct BufPool(Mutex<Vec<AlignedBuf>>);

impl BufPool {
    const KEEP: usize = 2;

    /// A free arena of `len` bytes (its old contents left in place), or a fresh zeroed one.
    pub(crate) fn take(&self, len: usize) -> AlignedBuf {
        self.take_marked(len).0
    }

    /// As [`BufPool::take`], and whether the arena is fresh (its pages never touched yet).
    pub(crate) fn take_marked(&self, len: usize) -> (AlignedBuf, bool) {
        let mut free = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match free.iter().position(|b| b.len() == len) {
            Some(i) => (free.swap_remove(i), false),
            None => (AlignedBuf::zeroed(len), true),
        }
    }

    fn give(&self, buf: AlignedBuf) {
        let mut free = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < Self::KEEP {
            free.push(buf);
        }
    }
}

/// An arena that returns to its pool when the last reader drops it; writable while its
/// weight set is the only owner.
pub(crate) struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: Arc<BufPool>,
}

impl PooledBuf {
    /// Wraps `buf`, to return to `pool` when dropped.
    pub(crate) fn new(buf: AlignedBuf, pool: &Arc<BufPool>) -> Self {
        Self {
            buf: Some(buf),
            pool: Arc::clone(pool),
        }
    }
}

impl SharedBytes for PooledBuf {
    fn bytes(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], AlignedBuf::as_slice)
    }

    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        self.buf.as_mut().map(AlignedBuf::as_mut_slice)
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give(b);
        }
    }
}
