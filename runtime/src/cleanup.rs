//! Releasing what a process holds outside itself (shared-memory segments, child
//! processes) when SIGINT or SIGTERM ends it.
//!
//! A component registers a release action with [`on_exit_signal`] for as long as it holds
//! such resources (the returned [`ExitGuard`] deregisters it on drop, when the component
//! releases them itself). A program opts in once with [`install_signal_handlers`]: a thread
//! then waits for SIGINT and SIGTERM. The signal handler (tokio's) only wakes that thread;
//! the thread, ordinary code, runs every registered action and exits with the conventional
//! status, 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
//!
//! Sockets need no action: the kernel closes them when the process exits. Without
//! [`install_signal_handlers`] the signals keep their default effect and nothing runs.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use crate::{Error, Result};

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
/// [`install_signal_handlers`] was called). Actions must be quick and idempotent: the
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

/// Starts the thread that turns SIGINT and SIGTERM into [`release_all`] and an exit with
/// status 128 + signal. Idempotent; the handlers are in place when this returns.
///
/// # Errors
/// [`Error::Io`] if the signal handlers or the thread cannot be set up.
pub fn install_signal_handlers() -> Result<()> {
    static INSTALLED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| install().map_err(|e| e.to_string()))
        .clone()
        .map_err(|e| Error::io("installing signal handlers", std::io::Error::other(e)))
}

fn install() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|e| Error::io("starting the signal runtime", e))?;
    // registered here, before returning, so that no signal slips between the call and the
    // thread's first poll
    let (mut int, mut term) = rt
        .block_on(async {
            Ok::<_, std::io::Error>((
                signal(SignalKind::interrupt())?,
                signal(SignalKind::terminate())?,
            ))
        })
        .map_err(|e| Error::io("registering SIGINT and SIGTERM", e))?;
    std::thread::Builder::new()
        .name("refit-signals".into())
        .spawn(move || {
            let (name, signo) = rt.block_on(async {
                tokio::select! {
                    _ = int.recv() => ("SIGINT", 2),
                    _ = term.recv() => ("SIGTERM", 15),
                }
            });
            tracing::warn!(
                signal = name,
                "stopping: releasing shared memory and child processes"
            );
            let n = release_all();
            tracing::info!(released = n, "released; exiting");
            std::process::exit(128 + signo);
        })
        .map_err(|e| Error::io("starting the signal thread", e))?;
    Ok(())
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
        install_signal_handlers().unwrap();
        install_signal_handlers().unwrap();
    }
}
