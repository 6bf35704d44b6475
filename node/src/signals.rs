//! SIGINT and SIGTERM turned into the core's cleanup: every action registered with
//! [`refit_runtime::cleanup::on_exit_signal`] runs ([`refit_runtime::cleanup::release_all`]),
//! then the process exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
//!
//! The signal handler (tokio's) only wakes a thread; that thread, ordinary code, runs the
//! actions. Without [`install_signal_handlers`] the signals keep their default effect.

use std::sync::OnceLock;

use refit_runtime::cleanup::release_all;

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

    #[test]
    fn installing_twice_is_fine() {
        install_signal_handlers().unwrap();
        install_signal_handlers().unwrap();
    }
}
