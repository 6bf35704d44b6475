//! Large copies and hashes cut into [`PIECE`]s that threads take as they go: a thread that
//! shares its core with another process (a receiver starting, a build) does fewer pieces
//! instead of holding the others up, as a fixed split into one part per thread would (there
//! the slowest part sets the time).

use std::sync::{Mutex, PoisonError};

/// Bytes one thread copies or hashes at a time.
pub(crate) const PIECE: usize = 1 << 20;

/// Work below this is done on the caller's thread (as `refit_runtime::copy` does).
const SPLIT_FROM: usize = refit_runtime::copy::SPLIT_FROM;

/// Threads worth starting for `len` bytes when `threads` may run.
pub(crate) fn threads_for(len: usize, threads: usize) -> usize {
    if len < SPLIT_FROM {
        1
    } else {
        threads.clamp(1, len.div_ceil(PIECE))
    }
}

/// Runs `work` on every item of `items` on `threads` threads (this one among them), each
/// taking the next item once done with its last.
pub(crate) fn share<I, F>(threads: usize, items: I, work: F)
where
    I: Iterator + Send,
    F: Fn(I::Item) + Sync,
{
    let items = Mutex::new(items);
    // a panicking `work` (a bug) would poison the lock: the others finish their items
    let next = || items.lock().unwrap_or_else(PoisonError::into_inner).next();
    let run = || {
        while let Some(item) = next() {
            work(item);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(run);
        }
        run();
    });
}

/// Copies `src` into `dst` on up to `threads` threads.
///
/// # Panics
/// If the lengths differ (a caller's bug: every caller sizes both from one manifest).
pub(crate) fn copy(dst: &mut [u8], src: &[u8], threads: usize) {
    assert_eq!(dst.len(), src.len(), "shm copy: lengths differ");
    let threads = threads_for(src.len(), threads);
    if threads == 1 {
        dst.copy_from_slice(src);
        return;
    }
    share(
        threads,
        dst.chunks_mut(PIECE).zip(src.chunks(PIECE)),
        |(d, s)| d.copy_from_slice(s),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_piece_is_copied_once_whatever_the_threads() {
        for len in [0, 17, PIECE, SPLIT_FROM - 1, SPLIT_FROM + 3 * PIECE + 5] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            for threads in [1, 2, 3, 64] {
                let mut dst = vec![0u8; len];
                copy(&mut dst, &src, threads);
                assert!(dst == src, "len {len}, {threads} threads");
            }
        }
        let done = AtomicUsize::new(0);
        share(4, 0..1000, |i| {
            done.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(done.into_inner(), 999 * 1000 / 2);
    }
}
