//! What every Refit program does first: logging and signal handling.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Logging when `RUST_LOG` is not set: warnings and errors from everything, and Refit's
/// own progress notes.
pub const DEFAULT_LOG: &str = "warn,refit=info,refit_runtime=info,refit_node=info,refit_transports=info,refit_rl=info,refit_actors=info";

/// Installs a `tracing` subscriber writing to stderr (stdout stays free for a program's
/// output), filtered by `RUST_LOG` (for example `RUST_LOG=debug` or
/// `RUST_LOG=refit_transports=trace`), else by [`DEFAULT_LOG`]. A `RUST_LOG` that does not
/// parse is reported on stderr and the default is used. Lines are coloured only when
/// stderr is a terminal and `NO_COLOR` is unset or empty (<https://no-color.org>).
/// Calling it again does nothing.
pub fn init_logging() {
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            eprintln!("refit: ignoring RUST_LOG={spec:?} ({e}); using {DEFAULT_LOG:?}");
            EnvFilter::new(DEFAULT_LOG)
        }),
        _ => EnvFilter::new(DEFAULT_LOG),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR").as_deref(),
        ))
        .try_init();
}

/// Whether log lines are coloured: on a terminal, unless `NO_COLOR` holds anything.
fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

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

#[cfg(test)]
mod tests {
    use super::colour;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_and_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some(OsStr::new(""))));
        assert!(!colour(true, Some(OsStr::new("1"))));
        assert!(!colour(false, None));
    }
}
