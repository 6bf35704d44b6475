//! What every Refit program does first: logging and signal handling.

pub use refit_node::logging::{DEFAULT_LOG, LOG_FORMAT_ENV, LogFormat, init_logging};

/// Sets a program up: [`init_logging`], then
/// [`install_signal_handlers`](crate::node::signals::install_signal_handlers), so that
/// SIGINT and SIGTERM release shared-memory segments before the process exits (with status
/// 130 or 143). Every binary and example calls it first thing in `main`. With feature `cli`
/// (on by default), a program whose environment names an address in
/// [`REFIT_METRICS_ADDR`](crate::metrics_page::METRICS_ADDR_ENV) also serves its update
/// phase timings there ([`serve_from_env`](crate::metrics_page::serve_from_env)); `refit
/// launch --metrics-addr` sets it for each rank.
///
/// # Errors
/// If the signal handlers cannot be installed, or the metrics address is bad or taken.
pub fn init() -> crate::runtime::Result<()> {
    init_logging();
    crate::node::signals::install_signal_handlers()?;
    // `refit launch --metrics-addr` names each rank's page in its environment
    #[cfg(feature = "cli")]
    crate::metrics_page::serve_from_env()?;
    Ok(())
}

/// The exit code of a program's `main` for `result`: success, or failure after printing the
/// error as one `error: ...` line on stderr (its Display form, never Rust's `Error: Debug`
/// form). Under `refit launch` that line is what the launcher repeats as the rank's cause.
/// In a process a signal is stopping, it waits for the signal's release actions instead
/// (the signal's thread then exits the process with 128 + the signal).
///
/// ```no_run
/// fn run() -> Result<(), Box<dyn std::error::Error>> {
///     Ok(())
/// }
///
/// fn main() -> std::process::ExitCode {
///     refit::exit_code(run())
/// }
/// ```
pub fn exit_code<E: std::fmt::Display>(
    result: std::result::Result<(), E>,
) -> std::process::ExitCode {
    if crate::runtime::cleanup::stopping() {
        // A signal is stopping this process: its thread runs the release actions (a
        // checkpoint on the way out, shared memory) and then exits with 128 + the signal.
        // Returning now would end the process under them; what the run answered is the
        // stop's consequence, not a failure of its own.
        if let Err(e) = &result {
            eprintln!("stopping on a signal; the run ended with: {e}");
        }
        std::thread::sleep(
            crate::runtime::cleanup::release_bound() + std::time::Duration::from_secs(2),
        );
    }
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
