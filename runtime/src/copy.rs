//! Large host copies: split across threads, written with streaming stores.
//!
//! One core copies a fraction of what the memory system takes; a copy that feeds a DMA
//! engine (pinned staging for a GPU) or a shared-memory slot is bound by the CPU side unless
//! it is split. [`copy_parallel`] cuts a copy into [`PIECE`]s that threads take as they go
//! ([`share`]): a thread that shares its core with another process (a receiver starting, a
//! build) does fewer pieces instead of holding the others up, as a fixed split into one
//! part per thread would (there the slowest part sets the time).
//!
//! A copy of [`STREAM_FROM`] bytes or more is written with streaming (non-temporal) stores
//! ([`copy_streaming`]): its destination is far larger than the caches and is read later,
//! by another core or process, so filling the caches with it (and reading every destination
//! line before writing it, as ordinary stores do) only costs bandwidth. On the 2-core
//! development machine a streaming copy of 512 MiB on one thread took 0.62x to 0.67x the
//! C library's `memcpy`, which streams only from 240 MiB up and never for a 1 MiB piece.
//!
//! Benchmarks set transports against the fastest simple copy measured in the same run
//! ([`fastest_copy`]): the C library's `memcpy` or a streaming copy, on one thread or split
//! in contiguous parts across threads.

use std::time::{Duration, Instant};

/// Bytes one thread copies at a time (1 MiB).
pub const PIECE: usize = 1 << 20;

/// Copies shorter than this (8 MiB) stay on the caller's thread: starting threads costs
/// more than it saves there (on the 2-core development machine a 4 MiB copy split in two
/// took 1.1x to 1.6x one thread's, a 64 MiB one 0.66x to 0.71x).
pub const SPLIT_FROM: usize = 8 << 20;

/// Copies of this many bytes (8 MiB) or more use streaming stores: below it source and
/// destination stay in the caches, where ordinary stores are faster (on the development
/// machine, one thread: 4 MiB 0.10 ms ordinary against 0.15 ms streaming; 16 MiB 2.05 ms
/// against 0.72 ms).
pub const STREAM_FROM: usize = 8 << 20;

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

/// Threads worth starting for `len` bytes when `threads` may run: one below
/// [`SPLIT_FROM`], else at most one per [`PIECE`].
pub fn threads_for(len: usize, threads: usize) -> usize {
    if len < SPLIT_FROM {
        1
    } else {
        threads.clamp(1, len.div_ceil(PIECE))
    }
}

/// Runs `work` on every item of `items` on `threads` threads (this one among them), each
/// taking the next item once done with its last.
pub fn share<I, F>(threads: usize, items: I, work: F)
where
    I: Iterator + Send,
    F: Fn(I::Item) + Sync,
{
    let items = std::sync::Mutex::new(items);
    // a panicking `work` (a bug) would poison the lock: the others finish their items
    let next = || {
        items
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .next()
    };
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

/// Copies `src` into `dst` (same length) on up to `threads` threads taking [`PIECE`]s as
/// they go; a copy shorter than [`SPLIT_FROM`] runs on the caller's thread alone, and one
/// of [`STREAM_FROM`] bytes or more is written with streaming stores. Every byte is in
/// `dst` when this returns, visible to any thread or process that synchronizes with the
/// caller afterwards.
///
/// # Panics
/// When `dst` and `src` differ in length (as `copy_from_slice`).
pub fn copy_parallel(dst: &mut [u8], src: &[u8], threads: usize) {
    assert_eq!(dst.len(), src.len(), "copy_parallel: lengths differ");
    let whole = src.len();
    let threads = threads_for(whole, threads);
    if threads == 1 {
        copy_piece(dst, src, whole);
        return;
    }
    share(
        threads,
        dst.chunks_mut(PIECE).zip(src.chunks(PIECE)),
        |(d, s)| copy_piece(d, s, whole),
    );
}

/// Copies one piece of a copy of `whole` bytes: with streaming stores when `whole` is
/// [`STREAM_FROM`] or more ([`copy_streaming`]), else with ordinary ones.
///
/// # Panics
/// When `dst` and `src` differ in length (as `copy_from_slice`).
pub fn copy_piece(dst: &mut [u8], src: &[u8], whole: usize) {
    if whole >= STREAM_FROM {
        copy_streaming(dst, src);
    } else {
        dst.copy_from_slice(src);
    }
}

/// Copies `src` into `dst` (same length) on this thread with streaming (non-temporal)
/// stores, which bypass the caches and do not read the destination first; ordinary stores
/// where the CPU has none (outside x86-64) and for the few bytes before the destination's
/// first 16-byte boundary and after its last. The stores are fenced before this returns,
/// so they are ordered before any later store of this thread (a sequence number, a flag).
///
/// # Panics
/// When `dst` and `src` differ in length (as `copy_from_slice`).
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        const LINE: usize = 64;
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let body = (dst.len() - head) / LINE * LINE;
        let (d_head, rest) = dst.split_at_mut(head);
        let (d_body, d_tail) = rest.split_at_mut(body);
        let (s_head, rest) = src.split_at(head);
        let (s_body, s_tail) = rest.split_at(body);
        d_head.copy_from_slice(s_head);
        d_tail.copy_from_slice(s_tail);
        if body == 0 {
            return;
        }
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let (d, s) = (d_body.as_mut_ptr(), s_body.as_ptr());
        for at in (0..body).step_by(LINE) {
            // SAFETY: SSE2 is part of x86-64, so these intrinsics are always available.
            // `at + 64 <= body`, so every 16-byte load reads inside `s_body` and every
            // store writes inside `d_body` (two distinct slices: `&mut` excludes overlap).
            // Loads are unaligned (`loadu`); the stores are 16-byte aligned as
            // `_mm_stream_si128` requires, since `d_body` starts at `head`, the
            // destination's first 16-byte boundary, and `at` is a multiple of 64.
            unsafe {
                let (d, s) = (d.add(at).cast::<__m128i>(), s.add(at).cast::<__m128i>());
                let a = _mm_loadu_si128(s);
                let b = _mm_loadu_si128(s.add(1));
                let c = _mm_loadu_si128(s.add(2));
                let e = _mm_loadu_si128(s.add(3));
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
        }
        // SAFETY: SSE is part of x86-64; the fence orders the streaming stores above
        // before every later store of this thread.
        unsafe { _mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// A simple copy a benchmark sets the transports against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimpleCopy {
    /// The C library's `memcpy` (through `copy_from_slice`).
    Memcpy,
    /// [`copy_streaming`]: streaming stores.
    Streaming,
}

impl SimpleCopy {
    /// Both, in the order they are tried.
    pub const ALL: [SimpleCopy; 2] = [SimpleCopy::Memcpy, SimpleCopy::Streaming];

    /// Its name in benchmark tables.
    pub fn name(self) -> &'static str {
        match self {
            SimpleCopy::Memcpy => "memcpy",
            SimpleCopy::Streaming => "streaming",
        }
    }

    /// Copies `src` into `dst` (same length), split in `threads` contiguous parts, one per
    /// thread, as a simple program splits a copy.
    ///
    /// # Panics
    /// When `dst` and `src` differ in length.
    pub fn copy(self, dst: &mut [u8], src: &[u8], threads: usize) {
        assert_eq!(dst.len(), src.len(), "SimpleCopy::copy: lengths differ");
        let one = |d: &mut [u8], s: &[u8]| match self {
            SimpleCopy::Memcpy => d.copy_from_slice(s),
            SimpleCopy::Streaming => copy_streaming(d, s),
        };
        let threads = threads.clamp(1, src.len().max(1));
        if threads == 1 {
            one(dst, src);
            return;
        }
        let part = src.len().div_ceil(threads);
        std::thread::scope(|s| {
            let mut parts = dst.chunks_mut(part).zip(src.chunks(part));
            let first = parts.next();
            for (d, from) in parts {
                s.spawn(move || one(d, from));
            }
            if let Some((d, from)) = first {
                one(d, from);
            }
        });
    }
}

/// The fastest simple copy of some bytes, and what each one tried took.
#[derive(Debug, Clone)]
pub struct CopyBaseline {
    /// The copy with the lowest median.
    pub best: SimpleCopy,
    /// Each copy tried and its timed rounds, in [`SimpleCopy::ALL`] order.
    pub tried: Vec<(SimpleCopy, Vec<Duration>)>,
}

impl CopyBaseline {
    /// The timed rounds of the fastest copy.
    pub fn times(&self) -> &[Duration] {
        self.tried
            .iter()
            .find(|(c, _)| *c == self.best)
            .map_or(&[], |(_, t)| t)
    }
}

fn median(times: &[Duration]) -> Duration {
    let mut t = times.to_vec();
    t.sort();
    t.get(t.len() / 2).copied().unwrap_or(Duration::MAX)
}

/// Times `rounds` copies of `src` into a buffer already touched, after one untimed round,
/// with each [`SimpleCopy`] split across `threads` (rounds alternate between them, so that
/// both see the same machine), and answers the fastest by median: the baseline benchmarks
/// print their figures against.
pub fn fastest_copy(src: &[u8], rounds: usize, threads: usize) -> CopyBaseline {
    let mut dst = vec![1u8; src.len()];
    let mut tried: Vec<(SimpleCopy, Vec<Duration>)> = SimpleCopy::ALL
        .iter()
        .map(|&c| (c, Vec::with_capacity(rounds)))
        .collect();
    for i in 0..=rounds {
        for (c, times) in &mut tried {
            let t = Instant::now();
            c.copy(&mut dst, std::hint::black_box(src), threads);
            std::hint::black_box(&mut dst);
            if i > 0 {
                times.push(t.elapsed());
            }
        }
    }
    let best = tried
        .iter()
        .min_by_key(|(_, t)| median(t))
        .map_or(SimpleCopy::Memcpy, |(c, _)| *c);
    CopyBaseline { best, tried }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fastest_copy_answers_one_sample_per_timed_round_of_each() {
        let src = vec![3u8; 1 << 16];
        let b = fastest_copy(&src, 4, 2);
        assert_eq!(b.tried.len(), SimpleCopy::ALL.len());
        assert!(b.tried.iter().all(|(_, t)| t.len() == 4));
        assert_eq!(b.times().len(), 4);
        let best = median(b.times());
        assert!(b.tried.iter().all(|(_, t)| median(t) >= best));
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn every_split_copies_every_byte() {
        for (len, threads) in [
            (0, 4),
            (17, 4),
            (PIECE, 4),
            (2 * PIECE + 3, 2),
            (5 * PIECE + 7, 3),
            (SPLIT_FROM, 8),
            (SPLIT_FROM + 3 * PIECE + 13, 3),
            (SPLIT_FROM + 5, 64),
        ] {
            let src = pattern(len);
            let mut dst = vec![0u8; len];
            copy_parallel(&mut dst, &src, threads);
            assert!(dst == src, "len {len}, {threads} threads");
            for c in SimpleCopy::ALL {
                let mut dst = vec![0u8; len];
                c.copy(&mut dst, &src, threads);
                assert!(dst == src, "{} len {len}, {threads} threads", c.name());
            }
        }
    }

    #[test]
    fn streaming_copies_every_byte_at_every_alignment_and_touches_no_other() {
        // lengths around the 64-byte body and offsets around the 16-byte boundary, with
        // guard bytes on both sides of the destination
        let src = pattern(4096 + 64);
        for len in [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4096] {
            for d_off in 0..17 {
                for s_off in [0, 1, 7, 16, 33] {
                    let mut buf = vec![0xAAu8; len + 64];
                    let from = &src[s_off..s_off + len];
                    copy_streaming(&mut buf[d_off..d_off + len], from);
                    assert_eq!(
                        &buf[d_off..d_off + len],
                        from,
                        "len {len} at {d_off}/{s_off}"
                    );
                    assert!(buf[..d_off].iter().all(|&b| b == 0xAA), "before, len {len}");
                    assert!(
                        buf[d_off + len..].iter().all(|&b| b == 0xAA),
                        "after, len {len}"
                    );
                }
            }
        }
        // a streamed copy large enough for the split path, seen whole by another thread
        let src = pattern(STREAM_FROM + 3 * PIECE + 11);
        let mut dst = vec![0u8; src.len()];
        copy_parallel(&mut dst, &src, 3);
        let dst = std::thread::spawn(move || dst).join().unwrap();
        assert!(dst == src);
    }

    #[test]
    fn shared_pieces_are_each_done_once() {
        let done = std::sync::atomic::AtomicUsize::new(0);
        share(4, 0..1000, |i| {
            done.fetch_add(i, std::sync::atomic::Ordering::Relaxed);
        });
        assert_eq!(done.into_inner(), 999 * 1000 / 2);
        assert_eq!(threads_for(SPLIT_FROM - 1, 8), 1);
        assert_eq!(threads_for(SPLIT_FROM, 64), SPLIT_FROM / PIECE);
        assert_eq!(threads_for(SPLIT_FROM, 2), 2);
    }

    #[test]
    fn threads_are_bounded() {
        let n = copy_threads();
        assert!((1..=64).contains(&n));
    }
}
