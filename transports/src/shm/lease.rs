//! Liveness of the processes sharing a scheme, robust to pid reuse and pid namespaces.
//!
//! Every party (the sender, each receiver) keeps an *owner record* in the board: its pid,
//! its start time and pid namespace as `/proc` shows them, and a heartbeat (the monotonic
//! clock in nanoseconds) that a small thread rewrites [`BEATS_PER_LEASE`] times per lease.
//!
//! An observer decides:
//! - when it shares the owner's pid namespace (same `/proc/self/ns/pid` inode, and a `/proc`
//!   that shows that namespace): exactly, from `/proc/<pid>/stat`. Gone, a zombie, or a
//!   process with another start time (the pid was reused) is dead; anything else is alive,
//!   however long it was stalled (a stopped process is not reaped under its readers);
//! - otherwise (another container sharing `/dev/shm`, no `/proc`): from the heartbeat, dead
//!   once it is older than the lease. `CLOCK_MONOTONIC` is one clock for the whole host
//!   (time namespaces, which could shift it, are not used by Docker or Kubernetes).

use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use refit_runtime::{Error, Result};

use super::segment::Segment;

/// The owner's pid as it sees it (u32).
pub(crate) const REC_PID: usize = 0;
/// The lease in milliseconds (u32; the sender's record carries the scheme's lease).
pub(crate) const REC_LEASE_MS: usize = 4;
/// The owner's start time in clock ticks since boot (`/proc/<pid>/stat` field 22; 0 unknown).
pub(crate) const REC_START: usize = 8;
/// The inode of the owner's pid namespace (0 unknown).
pub(crate) const REC_NS: usize = 16;
/// The heartbeat: `CLOCK_MONOTONIC` in nanoseconds at the last beat.
pub(crate) const REC_BEAT: usize = 24;
/// Bytes of one owner record.
pub(crate) const REC_LEN: usize = 32;
/// Heartbeats per lease: a party is declared dead (where only the heartbeat can tell)
/// after missing this many in a row.
pub(crate) const BEATS_PER_LEASE: u32 = 8;

/// Who this process is, as the records store it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) pid: u32,
    /// 0 when `/proc` does not show this process under its own pid.
    pub(crate) start: u64,
    /// 0 when unknown (as `start`).
    pub(crate) ns: u64,
}

/// `(state letter, start time)` from `/proc/<pid>/stat`.
fn proc_stat(pid: &str) -> std::io::Result<(char, u64, String)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed stat");
    // "pid (comm) S ppid ...": the comm may hold spaces and parentheses; fields resume after
    // the last ')'. The start time is field 22, the 20th after the comm.
    let (head, rest) = stat.rsplit_once(')').ok_or_else(bad)?;
    let shown_pid = head.split_whitespace().next().ok_or_else(bad)?.to_string();
    let mut fields = rest.split_whitespace();
    let state = fields
        .next()
        .and_then(|f| f.chars().next())
        .ok_or_else(bad)?;
    let start = fields
        .nth(18)
        .and_then(|f| f.parse().ok())
        .ok_or_else(bad)?;
    Ok((state, start, shown_pid))
}

fn pid_namespace() -> Option<u64> {
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

impl Identity {
    /// This process (computed once).
    pub(crate) fn current() -> Self {
        static ME: OnceLock<Identity> = OnceLock::new();
        *ME.get_or_init(|| {
            let pid = std::process::id();
            // `/proc` may belong to another pid namespace (`unshare --pid` without
            // remounting it): then its entries say nothing about our pids, and only the
            // heartbeat is trusted, by us and about us.
            match (proc_stat("self"), pid_namespace()) {
                (Ok((_, start, shown)), Some(ns)) if shown == pid.to_string() => {
                    Self { pid, start, ns }
                }
                _ => Self {
                    pid,
                    start: 0,
                    ns: 0,
                },
            }
        })
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds (one clock for every process of the host).
pub(crate) fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    u64::try_from(t.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(t.tv_nsec).unwrap_or(0))
}

/// Writes `who` into the record at `off`, heartbeat first (an observer never sees an
/// identity with a stale beat).
pub(crate) fn write_record(seg: &Segment, off: usize, who: Identity) -> Result<()> {
    seg.u64_at(off + REC_BEAT)?
        .store(now_ns(), Ordering::SeqCst);
    seg.u64_at(off + REC_START)?
        .store(who.start, Ordering::SeqCst);
    seg.u64_at(off + REC_NS)?.store(who.ns, Ordering::SeqCst);
    seg.u32_at(off + REC_PID)?.store(who.pid, Ordering::SeqCst);
    Ok(())
}

/// Zeroes the record at `off`.
pub(crate) fn clear_record(seg: &Segment, off: usize) -> Result<()> {
    seg.u32_at(off + REC_PID)?.store(0, Ordering::SeqCst);
    seg.u64_at(off + REC_START)?.store(0, Ordering::SeqCst);
    seg.u64_at(off + REC_NS)?.store(0, Ordering::SeqCst);
    seg.u64_at(off + REC_BEAT)?.store(0, Ordering::SeqCst);
    Ok(())
}

/// The pid a record names (for messages).
pub(crate) fn record_pid(seg: &Segment, off: usize) -> u32 {
    seg.u32_at(off + REC_PID)
        .map_or(0, |p| p.load(Ordering::SeqCst))
}

/// What `/proc` can say of a process identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Known {
    /// It lives (same pid namespace, same start time).
    Alive,
    /// It is gone, for this reason.
    Exited(String),
    /// Another pid namespace, an identity without a start time, or an unreadable `/proc`.
    CannotTell,
}

/// Whether the process `who` still runs, as far as this process's `/proc` can tell: exact
/// in the same pid namespace (a reused pid shows another start time), silent across them.
pub(crate) fn exited(who: Identity) -> Known {
    let me = Identity::current();
    if who.pid == 0 || who.start == 0 || who.ns == 0 || me.ns != who.ns {
        return Known::CannotTell;
    }
    match proc_stat(&who.pid.to_string()) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Known::Exited("process exited".into())
        }
        Ok(('Z' | 'X', _, _)) => Known::Exited("process exited".into()),
        Ok((_, now_start, _)) if now_start != who.start => Known::Exited(format!(
            "process exited; pid {} now belongs to another process",
            who.pid
        )),
        Ok(_) => Known::Alive,
        Err(_) => Known::CannotTell,
    }
}

/// `Some(why)` when the owner of the record at `off` is dead, `None` while it lives.
///
/// # Errors
/// If the record lies outside the segment.
pub(crate) fn dead(seg: &Segment, off: usize, lease: Duration) -> Result<Option<String>> {
    let pid = seg.u32_at(off + REC_PID)?.load(Ordering::SeqCst);
    let start = seg.u64_at(off + REC_START)?.load(Ordering::SeqCst);
    let ns = seg.u64_at(off + REC_NS)?.load(Ordering::SeqCst);
    let beat = seg.u64_at(off + REC_BEAT)?.load(Ordering::SeqCst);
    match exited(Identity { pid, start, ns }) {
        Known::Exited(why) => return Ok(Some(why)),
        Known::Alive => return Ok(None),
        // another pid namespace or an unreadable /proc: the heartbeat decides
        Known::CannotTell => {}
    }
    let age = Duration::from_nanos(now_ns().saturating_sub(beat));
    if age > lease {
        return Ok(Some(format!(
            "no heartbeat for {age:.1?} (lease {lease:?}): process gone or frozen"
        )));
    }
    Ok(None)
}

/// The thread that keeps one record's heartbeat fresh; stops (and joins) on drop.
#[derive(Debug)]
pub(crate) struct Heartbeat {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    /// Starts beating the record at `off` every `lease / BEATS_PER_LEASE`.
    ///
    /// # Errors
    /// If the record lies outside the segment or the thread cannot start.
    pub(crate) fn start(seg: Arc<Segment>, off: usize, lease: Duration) -> Result<Self> {
        seg.u64_at(off + REC_BEAT)?;
        let period = (lease / BEATS_PER_LEASE).max(Duration::from_millis(1));
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("refit-shm-lease".into())
            .spawn(move || {
                let (lock, cv) = &*flag;
                let Ok(mut stopped) = lock.lock() else {
                    return;
                };
                while !*stopped {
                    if let Ok(beat) = seg.u64_at(off + REC_BEAT) {
                        beat.store(now_ns(), Ordering::SeqCst);
                    }
                    match cv.wait_timeout(stopped, period) {
                        Ok((guard, _)) => stopped = guard,
                        Err(_) => return,
                    }
                }
            })
            .map_err(|e| Error::io("starting the shm heartbeat thread", e))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        if let Ok(mut stopped) = lock.lock() {
            *stopped = true;
        }
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn board() -> (tempfile::TempDir, Arc<Segment>) {
        let dir = tempfile::tempdir().unwrap();
        let seg = Arc::new(Segment::create(&dir.path().join("board"), 4096).unwrap());
        (dir, seg)
    }

    #[test]
    fn identity_of_this_process_is_exact() {
        let me = Identity::current();
        assert_eq!(me.pid, std::process::id());
        // the test host shows its own pids in /proc
        assert_ne!(me.start, 0);
        assert_ne!(me.ns, 0);
    }

    #[test]
    fn a_live_owner_is_alive_and_an_exited_one_is_dead() {
        let (_d, seg) = board();
        let lease = Duration::from_secs(60);
        write_record(&seg, 0, Identity::current()).unwrap();
        assert_eq!(dead(&seg, 0, lease).unwrap(), None);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let (_, start, _) = proc_stat(&pid.to_string()).unwrap();
        let who = Identity {
            pid,
            start,
            ..Identity::current()
        };
        write_record(&seg, 64, who).unwrap();
        // a zombie (exited, not reaped) is dead, and so is a reaped process
        let t = Instant::now();
        while dead(&seg, 64, lease).unwrap().is_none() {
            assert!(t.elapsed() < Duration::from_secs(10), "exited child alive");
            std::thread::sleep(Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(dead(&seg, 64, lease).unwrap().is_some());
    }

    #[test]
    fn a_reused_pid_is_not_taken_for_the_owner() {
        let (_d, seg) = board();
        // the record names a live pid (ours) with another start time: the owner that wrote
        // it died and its pid went to this process
        let me = Identity::current();
        let stale = Identity {
            start: me.start - 1,
            ..me
        };
        write_record(&seg, 0, stale).unwrap();
        let why = dead(&seg, 0, Duration::from_secs(60)).unwrap().unwrap();
        assert!(why.contains("another process"), "{why}");
    }

    #[test]
    fn across_namespaces_the_heartbeat_decides() {
        let (_d, seg) = board();
        let lease = Duration::from_secs(1);
        // an owner in another pid namespace: pid 1 (alive here, but not it), unknown ns
        let foreign = Identity {
            pid: 1,
            start: 1,
            ns: Identity::current().ns + 1,
        };
        write_record(&seg, 0, foreign).unwrap();
        let beat = Heartbeat::start(Arc::clone(&seg), 0, lease).unwrap();
        std::thread::sleep(lease * 2);
        assert_eq!(
            dead(&seg, 0, lease).unwrap(),
            None,
            "beating owner declared dead"
        );
        drop(beat);
        let t = Instant::now();
        let why = loop {
            if let Some(why) = dead(&seg, 0, lease).unwrap() {
                break why;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "silent owner alive");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(why.contains("no heartbeat"), "{why}");
        assert!(
            t.elapsed() >= lease / 2,
            "declared dead before the lease ran out"
        );
        clear_record(&seg, 0).unwrap();
        assert_eq!(record_pid(&seg, 0), 0);
    }
}
