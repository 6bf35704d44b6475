//! Process-shared futex waits and wake-ups (Linux), through `rustix`.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::thread::futex;

/// Sleeps while `word` holds `expected`, at most `timeout` (spurious wake-ups are possible).
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = futex::Timespec {
        tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    // Without `Flags::PRIVATE` the wait is keyed on the physical page, so waiters in other
    // processes mapping the same file are woken too. A changed value (EAGAIN), the timeout
    // (ETIMEDOUT) and a signal (EINTR) all simply return: every caller loops and re-reads.
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&ts));
}

/// Wakes every process waiting on `word`.
pub(crate) fn wake_all(word: &AtomicU32) {
    // FUTEX_WAKE only uses the address as a key; it cannot fail for a valid, aligned word.
    // The count is an `int` to the kernel: `i32::MAX` means everyone (`u32::MAX` would read as -1).
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    #[test]
    fn wait_returns_on_timeout_and_on_wake() {
        let w = Arc::new(AtomicU32::new(0));
        let t = Instant::now();
        wait(&w, 0, Duration::from_millis(30));
        assert!(t.elapsed() >= Duration::from_millis(20));
        // value differs: returns at once
        let t = Instant::now();
        wait(&w, 1, Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(1));
        let w2 = Arc::clone(&w);
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            w2.store(1, Ordering::SeqCst);
            wake_all(&w2);
        });
        let t = Instant::now();
        while w.load(Ordering::SeqCst) == 0 {
            wait(&w, 0, Duration::from_secs(5));
        }
        assert!(t.elapsed() < Duration::from_secs(4));
        h.join().unwrap();
    }

    #[test]
    fn wake_all_wakes_every_waiter() {
        let w = Arc::new(AtomicU32::new(0));
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let w = Arc::clone(&w);
                std::thread::spawn(move || {
                    let t = Instant::now();
                    while w.load(Ordering::SeqCst) == 0 {
                        wait(&w, 0, Duration::from_secs(30));
                    }
                    t.elapsed()
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        w.store(1, Ordering::SeqCst);
        wake_all(&w);
        for h in waiters {
            // one wake-up each, long before the 30 s timeout
            assert!(h.join().unwrap() < Duration::from_secs(20));
        }
    }
}
