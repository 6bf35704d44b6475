//! Releasing what a process holds outside itself (shared-memory segments, child
//! processes) when SIGINT or SIGTERM ends it.
//!
//! A component registers a release action with [`on_exit_signal`] for as long as it holds
//! such resources (the returned [`ExitGuard`] deregisters it on drop, when the component
//! releases them itself). A program opts in once with `refit_node::signals::install_signal_handlers`
//! (the signal handling needs an I/O runtime, which the core does not carry): a thread then
//! waits for SIGINT and SIGTERM, runs every registered action ([`release_all`]) and exits
//! with the conventional status, 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
//!
//! Sockets need no action: the kernel closes them when the process exits. Without the signal
//! handlers installed the signals keep their default effect and nothing runs.
//!
//! The release is bounded: the actions run on a thread of their own, and the process exits
//! once they are done or the bound has passed, whichever comes first ([`release_bound`],
//! [`RELEASE_BOUND`] unless [`set_release_bound`] changed it; [`release_all_within`]), so an
//! action that blocks (on a lock, a peer, a device) never keeps a signalled process alive.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::Duration;

/// How long SIGINT/SIGTERM wait for the release actions before the process exits anyway,
/// unless [`set_release_bound`] says otherwise (under `refit launch`'s default grace period
/// of 5 s before SIGKILL).
pub const RELEASE_BOUND: Duration = Duration::from_secs(3);

/// The bound in milliseconds (0: not set, [`RELEASE_BOUND`]).
static BOUND_MS: AtomicU64 = AtomicU64::new(0);

/// How long SIGINT/SIGTERM wait for the release actions before the process exits anyway.
pub fn release_bound() -> Duration {
    match BOUND_MS.load(Ordering::Relaxed) {
        0 => RELEASE_BOUND,
        ms => Duration::from_millis(ms),
    }
}

/// Sets [`release_bound`] for this process (at least 1 ms): a program whose release takes
/// longer on purpose (a launcher stopping its ranks with a grace period) says so here.
pub fn set_release_bound(bound: Duration) {
    let ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX).max(1);
    BOUND_MS.store(ms, Ordering::Relaxed);
}

/// Set once a signal asked this process to stop.
static STOPPING: AtomicBool = AtomicBool::new(false);

/// Marks this process as stopping because it was asked to (SIGINT/SIGTERM: a user's Ctrl-C
/// on the launcher, a scheduler ending the job). What then happens around it (peers
/// closing their connections, ranks leaving) is expected, and is logged at debug level by
/// [`unless_stopping!`](crate::unless_stopping).
pub fn mark_stopping() {
    STOPPING.store(true, Ordering::SeqCst);
}

/// True once [`mark_stopping`] was called.
pub fn stopping() -> bool {
    STOPPING.load(Ordering::SeqCst)
}

/// A `tracing` event at `level` (`warn`, `error`, ...), or at debug level once the process
/// was asked to stop ([`cleanup::stopping`](crate::cleanup::stopping)): a peer that goes
/// away while everyone is being stopped is no news. `unless_stopping!(warn, "{peer} left")`.
/// The calling crate must depend on `tracing`.
#[macro_export]
macro_rules! unless_stopping {
    ($level:ident, $($arg:tt)+) => {
        if $crate::cleanup::stopping() {
            ::tracing::debug!($($arg)+)
        } else {
            ::tracing::$level!($($arg)+)
        }
    };
}

type Action = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
struct Registry {
    next: u64,
    actions: BTreeMap<u64, Action>,
}

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Mutex::default)
}

/// Keeps a release action registered; dropping it deregisters the action (without
/// running it).
#[derive(Debug)]
#[must_use = "the action is deregistered when the guard is dropped"]
pub struct ExitGuard {
    id: u64,
}

impl Drop for ExitGuard {
    fn drop(&mut self) {
        if let Ok(mut r) = registry().lock() {
            r.actions.remove(&self.id);
        }
    }
}

/// Registers `action` to run if SIGINT or SIGTERM ends the process (once
/// `refit_node::signals::install_signal_handlers` was called). Actions must be quick and
/// idempotent: the component may be releasing the same resources itself at that moment.
/// One that blocks does not keep the process alive: the process exits [`RELEASE_BOUND`]
/// after the signal whatever the actions still do.
pub fn on_exit_signal(action: impl Fn() + Send + Sync + 'static) -> ExitGuard {
    let mut r = registry()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    r.next += 1;
    let id = r.next;
    r.actions.insert(id, Box::new(action));
    ExitGuard { id }
}

/// Runs every registered action now (newest first) and deregisters it; returns how many
/// ran. The signal thread calls this before exiting.
pub fn release_all() -> usize {
    let actions: Vec<Action> = {
        let mut r = registry()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        std::mem::take(&mut r.actions).into_values().rev().collect()
    };
    for a in &actions {
        a();
    }
    actions.len()
}

/// [`release_all`] on a thread of its own, waiting for it at most `bound`: answers how many
/// actions ran, or `None` when they were still running at the deadline (they go on in the
/// background; the caller is about to exit) or no thread could be started (then none ran).
pub fn release_all_within(bound: Duration) -> Option<usize> {
    let (done, finished) = mpsc::channel();
    let started = std::thread::Builder::new()
        .name("refit-release".into())
        .spawn(move || {
            let _ = done.send(release_all());
        });
    match started {
        Ok(_) => finished.recv_timeout(bound).ok(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the release thread; releasing nothing");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The tests release every action of the process: one at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    #[test]
    fn a_process_is_stopping_only_once_marked() {
        // nothing in this crate's tests marks it but this test, which looks before and after
        assert!(!stopping());
        mark_stopping();
        assert!(stopping());
    }

    #[test]
    fn registered_actions_run_once_and_dropped_guards_never() {
        let _serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let ran = Arc::new(AtomicUsize::new(0));
        let (a, b) = (Arc::clone(&ran), Arc::clone(&ran));
        let kept = on_exit_signal(move || {
            a.fetch_add(1, Ordering::SeqCst);
        });
        let dropped = on_exit_signal(move || {
            b.fetch_add(100, Ordering::SeqCst);
        });
        drop(dropped);
        assert!(release_all() >= 1);
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        release_all();
        assert_eq!(ran.load(Ordering::SeqCst), 1, "an action ran twice");
        drop(kept);
    }

    #[test]
    fn a_blocking_action_does_not_hold_the_release_past_its_bound() {
        let _serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // the blocking action waits on a lock this test holds; the quick one counts
        let gate = Arc::new(Mutex::new(()));
        let held = gate.lock().unwrap();
        let blocked = Arc::clone(&gate);
        let ran = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&ran);
        let _blocking = on_exit_signal(move || {
            let _wait = blocked.lock();
        });
        let _quick = on_exit_signal(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        // the blocking action cannot finish while the lock is held: the deadline answers
        assert_eq!(release_all_within(Duration::from_millis(200)), None);
        // the quick one ran (newest first) or runs, on the release thread
        let start = std::time::Instant::now();
        while ran.load(Ordering::SeqCst) == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the quick action never ran"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(held);
        let _again = on_exit_signal(|| {});
        assert!(release_all_within(Duration::from_secs(30)).is_some());
    }
}
