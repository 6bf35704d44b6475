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

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

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
/// `refit_node::signals::install_signal_handlers` was called). Actions must be quick and idempotent: the
/// component may be releasing the same resources itself at that moment.
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn registered_actions_run_once_and_dropped_guards_never() {
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
}
