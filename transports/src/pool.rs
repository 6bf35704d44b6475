//! Arenas of earlier versions, kept for reuse by receivers that fill a private arena per
//! update (copying shared-memory readers, TCP pulls): a fresh arena per update would pay a
//! page fault (and the kernel's zeroing) per 4 KiB every time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use refit_runtime::{AlignedBuf, SharedBytes};

/// Free arenas, at most [`BufPool::KEEP`], and the spare one being faulted in ahead of the
/// pull that will need it ([`BufPool::warm_spare`]).
#[derive(Debug, Default)]
pub(crate) struct BufPool {
    free: Mutex<Vec<AlignedBuf>>,
    spare: Mutex<Spare>,
}

/// Arenas this pool made, and the one being made in the background.
#[derive(Debug, Default)]
struct Spare {
    made: usize,
    pending: Option<Warming>,
}

/// A spare arena being faulted in, chunk by chunk, until done or taken.
#[derive(Debug)]
struct Warming {
    len: usize,
    taken: Arc<AtomicBool>,
    /// The arena, and whether every page of it is in.
    thread: std::thread::JoinHandle<(AlignedBuf, bool)>,
}

impl Drop for Spare {
    /// A receiver going away stops its spare after the chunk being faulted in.
    fn drop(&mut self) {
        if let Some(w) = &self.pending {
            w.taken.store(true, Ordering::Relaxed);
        }
    }
}

/// Bytes a spare is faulted in by at a time (the longest a pull taking it waits).
const WARM_CHUNK: usize = 16 << 20;

impl BufPool {
    const KEEP: usize = 2;

    /// A free arena of `len` bytes (its old contents left in place), or a fresh zeroed one.
    pub(crate) fn take(&self, len: usize) -> AlignedBuf {
        self.take_marked(len).0
    }

    /// As [`BufPool::take`], and whether the arena is fresh (some of its pages never touched
    /// yet): a free arena, else the spare (stopped after the chunk it is faulting in: fresh
    /// unless it was done), else a fresh one.
    pub(crate) fn take_marked(&self, len: usize) -> (AlignedBuf, bool) {
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = free.iter().position(|b| b.len() == len) {
                return (free.swap_remove(i), false);
            }
        }
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        if spare.pending.as_ref().is_some_and(|w| w.len == len)
            && let Some(w) = spare.pending.take()
        {
            w.taken.store(true, Ordering::Relaxed);
            if let Ok((buf, done)) = w.thread.join() {
                return (buf, !done);
            }
        }
        spare.made += 1;
        (AlignedBuf::zeroed(len), true)
    }

    /// Makes a spare arena of `len` bytes and faults its pages in, on a thread of its own,
    /// for the next pull to take, while this pool has made fewer than `upto` arenas, none is
    /// free and none is being made: the first pulls of a receiver (each of which needs an
    /// arena while the versions before it are still held) then find their arena ready, as
    /// steady-state pulls find a recycled one, instead of faulting fresh pages in while the
    /// bytes arrive. `upto` bounds the arenas at the number steady state keeps anyway.
    pub(crate) fn warm_spare(&self, len: usize, upto: usize) {
        if len < (2 << 20) {
            return;
        }
        if self
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|b| b.len() == len)
        {
            return;
        }
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        if spare.pending.is_some() || spare.made >= upto {
            return;
        }
        let taken = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&taken);
        let warming = std::thread::Builder::new()
            .name("refit-arena".into())
            .spawn(move || {
                let mut buf = AlignedBuf::zeroed(len);
                let mut at = 0;
                while at < len {
                    if stop.load(Ordering::Relaxed) || !buf.prefault_range(at..at + WARM_CHUNK) {
                        return (buf, false);
                    }
                    at += WARM_CHUNK;
                }
                (buf, true)
            });
        if let Ok(thread) = warming {
            spare.made += 1;
            spare.pending = Some(Warming { len, taken, thread });
        }
    }

    /// Arenas this pool made so far (fresh or spare).
    #[cfg(test)]
    pub(crate) fn made(&self) -> usize {
        self.spare.lock().unwrap_or_else(|p| p.into_inner()).made
    }

    fn give(&self, buf: AlignedBuf) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spares_are_taken_warm_and_bounded() {
        let pool = Arc::new(BufPool::default());
        let len = 4 << 20;
        let (a, fresh) = pool.take_marked(len);
        assert!(fresh);
        // a spare is made for the next pull, which takes it (not fresh)
        pool.warm_spare(len, 3);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let done = || {
            let spare = pool.spare.lock().unwrap();
            spare
                .pending
                .as_ref()
                .is_some_and(|w| w.thread.is_finished())
        };
        while !done() {
            assert!(
                std::time::Instant::now() < deadline,
                "spare not made in 30 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let (b, fresh) = pool.take_marked(len);
        // a spare made whole is not fresh (where pages can be populated ahead: Linux)
        assert_eq!(fresh, !cfg!(target_os = "linux"));
        assert_eq!(b.len(), len);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        // small arenas get no spare; a third arena is the bound
        pool.warm_spare(1024, 3);
        pool.warm_spare(len, 3);
        pool.warm_spare(len, 3);
        // taken at once: it may not be whole yet, and says so
        let (c, _) = pool.take_marked(len);
        assert!(c.as_slice().iter().all(|&x| x == 0));
        pool.warm_spare(len, 3);
        assert!(
            pool.take_marked(len).1,
            "past the bound a pull makes its own"
        );
        // a free arena is recycled first, and then no spare is made
        drop(PooledBuf::new(a, &pool));
        pool.warm_spare(len, 10);
        let (recycled, fresh) = pool.take_marked(len);
        assert!(!fresh);
        assert!(pool.spare.lock().unwrap().pending.is_none());
        drop((b, c, recycled));
    }
}
