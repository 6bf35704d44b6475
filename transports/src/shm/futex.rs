//! Process-shared futex waits and wake-ups, and process liveness checks (Linux).

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `word` holds `expected`, at most `timeout` (spurious wake-ups are possible).
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: `word` is a live, 4-byte-aligned AtomicU32 (in a shared mapping or on the heap)
    // for the duration of the call; FUTEX_WAIT without the PRIVATE flag keys the wait on the
    // physical page, so waiters in other processes mapping the same file are woken too. The
    // kernel only reads the word and the timespec; a changed value returns EAGAIN at once.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every process waiting on `word`.
pub(crate) fn wake_all(word: &AtomicU32) {
    // SAFETY: as in `wait`; FUTEX_WAKE only uses the address as a key and never writes it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// True when a process with this pid exists and has not exited (a zombie, exited but not yet
/// reaped by its parent, counts as dead).
pub(crate) fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks that the pid exists and that we
    // may signal it. No memory is touched.
    let r = unsafe { libc::kill(pid, 0) };
    if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    // "pid (comm) S ...": the state letter follows the last ')'
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next()),
            Some('Z' | 'X')
        ),
        Err(_) => true,
    }
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
    fn liveness() {
        assert!(alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let t = Instant::now();
        while alive(pid) {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "exited child still alive"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(!alive(pid));
        assert!(!alive(0));
        assert!(!alive(u32::MAX));
    }
}
