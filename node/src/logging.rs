//! A Refit process's log lines: a `tracing` subscriber on stderr, filtered by `RUST_LOG`,
//! in the format `REFIT_LOG_FORMAT` names. Every Refit program (the `refit` crate's
//! `init`) and every Python rank (the `refit` package) installs the same one, so the ranks
//! of one launch log alike.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Logging when `RUST_LOG` is not set: warnings and errors from everything, and Refit's
/// own progress notes.
pub const DEFAULT_LOG: &str = "warn,refit=info,refit_runtime=info,refit_node=info,refit_transports=info,refit_rl=info,refit_actors=info";

/// The variable that picks the log format: `text` (the default: one line per event, for
/// people) or `json` (one JSON object per line, for log collectors).
pub const LOG_FORMAT_ENV: &str = "REFIT_LOG_FORMAT";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One line per event: time, level, target, message and fields.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields` (the message
    /// among them) and the spans the event happened in (`span`, `spans`).
    Json,
}

impl LogFormat {
    /// `text` or `json` (any case); `None` for anything else.
    pub fn parse(value: &str) -> Option<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "text" | "" => Some(Self::Text),
            "json" => Some(Self::Json),
            _ => None,
        }
    }
}

/// Installs a `tracing` subscriber writing to stderr (stdout stays free for a program's
/// output), filtered by `RUST_LOG` (for example `RUST_LOG=debug` or
/// `RUST_LOG=refit_transports=trace`), else by [`DEFAULT_LOG`], in the format
/// [`REFIT_LOG_FORMAT`](LOG_FORMAT_ENV) names (`text`, the default, or `json`). A
/// `RUST_LOG` or a format that does not parse is reported on stderr and the default is
/// used. Text lines are coloured only when stderr is a terminal and `NO_COLOR` is unset or
/// empty (<https://no-color.org>). Calling it again does nothing.
pub fn init_logging() {
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            eprintln!("refit: ignoring RUST_LOG={spec:?} ({e}); using {DEFAULT_LOG:?}");
            EnvFilter::new(DEFAULT_LOG)
        }),
        _ => EnvFilter::new(DEFAULT_LOG),
    };
    let format = match std::env::var(LOG_FORMAT_ENV) {
        Ok(v) => LogFormat::parse(&v).unwrap_or_else(|| {
            eprintln!("refit: ignoring {LOG_FORMAT_ENV}={v:?} (not `text` or `json`); using text");
            LogFormat::Text
        }),
        Err(_) => LogFormat::Text,
    };
    init_logging_with(filter, format);
}

/// Installs the subscriber of [`init_logging`] with this filter and format.
fn init_logging_with(filter: EnvFilter, format: LogFormat) {
    // ANCHOR: subscriber
    // a closed stderr must not end the process: write errors are dropped, never reported
    // (reporting them on stderr would panic)
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .log_internal_errors(false);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(colour(
                std::io::stderr().is_terminal(),
                std::env::var_os("NO_COLOR").as_deref(),
            ))
            .try_init(),
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
    };
    // ANCHOR_END: subscriber
}

/// Whether log lines are coloured: on a terminal, unless `NO_COLOR` holds anything.
fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_and_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some(OsStr::new(""))));
        assert!(!colour(true, Some(OsStr::new("1"))));
        assert!(!colour(false, None));
    }

    #[test]
    fn log_formats_parse_in_any_case() {
        assert_eq!(LogFormat::parse("json"), Some(LogFormat::Json));
        assert_eq!(LogFormat::parse(" JSON "), Some(LogFormat::Json));
        assert_eq!(LogFormat::parse("text"), Some(LogFormat::Text));
        assert_eq!(LogFormat::parse(""), Some(LogFormat::Text));
        assert_eq!(LogFormat::parse("yaml"), None);
    }
}
