//! Large host copies split across threads.
//!
//! One core copies about 8-10 GB/s; a server's memory system takes several times that. A
//! copy that feeds a DMA engine (pinned staging for a GPU, 50 GB/s and more) is bound by the
//! CPU side unless it is split. [`copy_parallel`] splits a copy into contiguous pieces of at
//! least [`MIN_PIECE`] bytes, one per thread (the caller's thread takes the first), and
//! returns when every piece is copied.

/// Pieces are never smaller than this (1 MiB): below it a thread costs more than it saves.
pub const MIN_PIECE: usize = 1 << 20;

/// Copies shorter than this (8 MiB) stay on the caller's thread: starting threads costs
/// more than it saves there (on the 2-core development machine a 4 MiB copy split in two
/// took 1.1x to 1.6x one thread's, a 64 MiB one 0.66x to 0.71x).
pub const SPLIT_FROM: usize = 8 << 20;

/// The environment variable that sets [`copy_threads`] (1 turns splitting off).
pub const COPY_THREADS_ENV: &str = "REFIT_COPY_THREADS";

/// Threads a copy may use: `REFIT_COPY_THREADS` when it holds a number from 1 to 64, else
/// the machine's parallelism, at most 8 (beyond that the memory system, not the cores,
/// bounds a copy). Read once per process.
pub fn copy_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        let set = std::env::var(COPY_THREADS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|n| (1..=64).contains(n));
        set.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .clamp(1, 8)
        })
    })
}

/// Copies `src` into `dst` (same length) with up to `threads` threads, pieces of at least
/// [`MIN_PIECE`] bytes; a copy shorter than [`SPLIT_FROM`] runs on the caller's thread
/// alone.
///
/// # Panics
/// When `dst` and `src` differ in length (as `copy_from_slice`).
pub fn copy_parallel(dst: &mut [u8], src: &[u8], threads: usize) {
    assert_eq!(dst.len(), src.len(), "copy_parallel: lengths differ");
    let pieces = if src.len() < SPLIT_FROM {
        1
    } else {
        threads.min(src.len() / MIN_PIECE).max(1)
    };
    if pieces == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let piece = src.len().div_ceil(pieces);
    std::thread::scope(|s| {
        let mut parts = dst.chunks_mut(piece).zip(src.chunks(piece));
        let first = parts.next();
        for (d, from) in parts {
            s.spawn(move || d.copy_from_slice(from));
        }
        if let Some((d, from)) = first {
            d.copy_from_slice(from);
        }
    });
}

/// Times `rounds` copies of `src` into a buffer already touched, after one untimed copy:
/// the `memcpy` baseline benchmarks print their figures against (one thread, or split
/// across `threads` as [`copy_parallel`] splits the transports' copies).
pub fn time_copy(src: &[u8], rounds: usize, threads: usize) -> Vec<std::time::Duration> {
    let mut dst = vec![1u8; src.len()];
    let mut out = Vec::with_capacity(rounds);
    for i in 0..=rounds {
        let t = std::time::Instant::now();
        copy_parallel(&mut dst, std::hint::black_box(src), threads);
        std::hint::black_box(&mut dst);
        if i > 0 {
            out.push(t.elapsed());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_copy_answers_one_sample_per_timed_round() {
        let src = vec![3u8; 1 << 16];
        let t = time_copy(&src, 4, 2);
        assert_eq!(t.len(), 4);
        assert!(t.iter().all(|d| *d < std::time::Duration::from_secs(1)));
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn every_split_copies_every_byte() {
        for (len, threads) in [
            (0, 4),
            (17, 4),
            (MIN_PIECE, 4),
            (2 * MIN_PIECE + 3, 2),
            (5 * MIN_PIECE + 7, 3),
            (SPLIT_FROM, 8),
            (SPLIT_FROM + 3 * MIN_PIECE + 13, 3),
            (SPLIT_FROM + 5, 64),
        ] {
            let src = pattern(len);
            let mut dst = vec![0u8; len];
            copy_parallel(&mut dst, &src, threads);
            assert!(dst == src, "len {len}, {threads} threads");
        }
    }

    #[test]
    fn threads_are_bounded() {
        let n = copy_threads();
        assert!((1..=64).contains(&n));
    }
}
