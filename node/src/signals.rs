//! SIGINT and SIGTERM turned into the core's cleanup: every action registered with
//! [`refit_runtime::cleanup::on_exit_signal`] runs ([`refit_runtime::cleanup::release_all`]),
//! then the process exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
//!
//! The signal handler (tokio's) only wakes a thread; that thread, ordinary code, starts the
//! actions on a thread of their own and waits for them at most
//! `refit_runtime::cleanup::release_bound` (3 s unless the program set
//! another). The process then exits whatever they still do: when they are done, when the
//! bound passes, or at once on a second SIGINT/SIGTERM. If the C library's exit handlers
//! hang, the process ends without them a second later (`_exit`). A signalled process
//! always ends. Without [`install_signal_handlers`] the signals keep their default effect.

use std::sync::OnceLock;
use std::time::Duration;

use refit_runtime::cleanup::{release_all, release_bound};

use crate::error::{Error, Result};

/// Starts the thread that turns SIGINT and SIGTERM into [`release_all`] and an exit with
/// status 128 + signal. Idempotent; the handlers are in place when this returns.
///
/// # Errors
/// An I/O error ([`Error::Core`]) if the signal handlers or the thread cannot be set up.
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
        .enable_time()
        .build()
        .map_err(|e| Error::io("starting the signal runtime", e))?;
    // The run is stopping the moment a signal arrives, not when the thread below gets to
    // run: a peer that closes its connection meanwhile (the launcher signals every rank at
    // once) is then logged as expected, not as a fault.
    for signo in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the action only stores to an atomic (`mark_stopping`), which is
        // async-signal-safe; it allocates, locks and logs nothing.
        unsafe { signal_hook_registry::register(signo, refit_runtime::cleanup::mark_stopping) }
            .map_err(|e| Error::io("registering SIGINT and SIGTERM", e))?;
    }
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
                    _ = int.recv() => ("SIGINT", libc::SIGINT),
                    _ = term.recv() => ("SIGTERM", libc::SIGTERM),
                }
            });
            refit_runtime::cleanup::mark_stopping();
            let bound = release_bound();
            // told, not warned: a signal is how a user or a scheduler ends a run
            tracing::info!(
                signal = name,
                "stopping: releasing shared memory and child processes (at most {bound:?})"
            );
            // the actions run on a thread of their own: one that blocks holds neither this
            // thread nor the exit
            let (done, released) = tokio::sync::oneshot::channel();
            let started = std::thread::Builder::new()
                .name("refit-release".into())
                .spawn(move || {
                    let _ = done.send(release_all());
                });
            if let Err(e) = started {
                tracing::warn!(error = %e, "cannot start the release thread; exiting without it");
            } else {
                rt.block_on(async {
                    tokio::select! {
                        n = released => {
                            tracing::debug!(released = n.unwrap_or(0), "released; exiting");
                        }
                        () = tokio::time::sleep(bound) => {
                            tracing::warn!("the release still runs after {bound:?}; exiting anyway");
                        }
                        _ = int.recv() => tracing::warn!("SIGINT again; exiting now"),
                        _ = term.recv() => tracing::warn!("SIGTERM again; exiting now"),
                    }
                });
            }
            exit_within(128 + signo, Duration::from_secs(1));
        })
        .map_err(|e| Error::io("starting the signal thread", e))?;
    Ok(())
}

/// Exits with `code`; if the exit handlers (the C library's, or ones a library registered)
/// have not ended the process after `bound`, ends it without them.
fn exit_within(code: i32, bound: Duration) -> ! {
    let _ = std::thread::Builder::new()
        .name("refit-exit".into())
        .spawn(move || {
            std::thread::sleep(bound);
            // SAFETY: `_exit` has no preconditions: it ends the process at once, running no
            // exit handler and touching no lock, so nothing can hold it (exercised by the
            // test whose exit handler never returns, node/tests/signals.rs)
            unsafe { libc::_exit(code) }
        });
    std::process::exit(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installing_twice_is_fine() {
        install_signal_handlers().unwrap();
        install_signal_handlers().unwrap();
    }
}
