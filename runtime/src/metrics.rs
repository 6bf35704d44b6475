//! Per-update phase timings, through the [`metrics`](https://docs.rs/metrics) facade and as
//! [`tracing`] spans, so an application plugs in the exporter it runs (Prometheus or other)
//! and the subscriber it uses. With neither installed, recording costs a clock read.
//!
//! Every update is timed in phases, each a histogram sample (seconds) of
//! [`PHASE_SECONDS`] labelled `phase`, `model` and `transport`:
//!
//! | phase | side | what it covers |
//! | --- | --- | --- |
//! | `convert` | sender or receiver | converting a version to the layout and dtypes an engine wants ([`crate::convert`]), on the side that converts |
//! | `assemble` | sender | making the version available: the transport's publish (write a slot, a file, hash and plan buckets, swap a pointer) |
//! | `wire` | receiver | moving the bytes in, from a version seen to its bytes whole in memory |
//! | `verify` | receiver | checking content before apply (checksums), where the transport has such a check |
//! | `apply` | receiver | the scheme's manifest and version checks and the switch of the served snapshot |
//! | `engine_pause` | engine | how long an inference engine paused the model to load the weights |
//!
//! Each timed phase is also a `tracing` span named `refit.phase` with the same fields.

use std::time::{Duration, Instant};

/// Name of the histogram every phase is recorded in (seconds).
pub const PHASE_SECONDS: &str = "refit_update_phase_seconds";

/// One phase of an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Sender or receiver: converting a version to an engine's layout and dtypes.
    Convert,
    /// Sender: making a version available to receivers.
    Assemble,
    /// Receiver: moving the bytes in.
    Wire,
    /// Receiver: checking content before apply.
    Verify,
    /// Receiver: checks and the switch of the served snapshot.
    Apply,
    /// Engine: the model paused while its weights load.
    EnginePause,
}

impl Phase {
    /// Every phase, in update order.
    pub const ALL: [Phase; 6] = [
        Phase::Convert,
        Phase::Assemble,
        Phase::Wire,
        Phase::Verify,
        Phase::Apply,
        Phase::EnginePause,
    ];

    /// The `phase` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Convert => "convert",
            Phase::Assemble => "assemble",
            Phase::Wire => "wire",
            Phase::Verify => "verify",
            Phase::Apply => "apply",
            Phase::EnginePause => "engine_pause",
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Records one phase that took `took` for `model` over `transport`.
pub fn record(phase: Phase, transport: &'static str, model: &str, took: Duration) {
    metrics::histogram!(
        PHASE_SECONDS,
        "phase" => phase.as_str(),
        "model" => model.to_string(),
        "transport" => transport,
    )
    .record(took.as_secs_f64());
}

/// Times a phase: the span is entered now, and the sample recorded by
/// [`PhaseTimer::finish`]; a timer dropped unfinished (the phase failed) records nothing.
///
/// ```
/// use refit_runtime::metrics::{Phase, timed};
/// let t = timed(Phase::Wire, "file", "policy");
/// // ... move the bytes ...
/// let took = t.finish(); // recorded here
/// ```
pub fn timed(phase: Phase, transport: &'static str, model: &str) -> PhaseTimer {
    let span = tracing::info_span!(
        "refit.phase",
        phase = phase.as_str(),
        model = model,
        transport = transport
    );
    PhaseTimer {
        phase,
        transport,
        models: vec![model.to_string()],
        started: Instant::now(),
        _span: span.entered(),
    }
}

/// Times a phase of an update of several models (one sample per model, same duration).
pub fn timed_group<'a>(
    phase: Phase,
    transport: &'static str,
    models: impl IntoIterator<Item = &'a str>,
) -> PhaseTimer {
    let models: Vec<String> = models.into_iter().map(str::to_string).collect();
    let span = tracing::info_span!(
        "refit.phase",
        phase = phase.as_str(),
        model = models.join("+"),
        transport = transport
    );
    PhaseTimer {
        phase,
        transport,
        models,
        started: Instant::now(),
        _span: span.entered(),
    }
}

/// A phase being timed (see [`timed`]); [`PhaseTimer::finish`] records it.
#[derive(Debug)]
#[must_use = "the phase is recorded by `finish`"]
pub struct PhaseTimer {
    phase: Phase,
    transport: &'static str,
    models: Vec<String>,
    started: Instant,
    _span: tracing::span::EnteredSpan,
}

impl PhaseTimer {
    /// Stops the timer, records the phase (once per model) and returns its duration.
    pub fn finish(self) -> Duration {
        let took = self.started.elapsed();
        for m in &self.models {
            record(self.phase, self.transport, m, took);
        }
        took
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_have_stable_labels() {
        let labels: Vec<&str> = Phase::ALL.iter().map(|p| p.as_str()).collect();
        assert_eq!(
            labels,
            [
                "convert",
                "assemble",
                "wire",
                "verify",
                "apply",
                "engine_pause"
            ]
        );
        // without a recorder installed, timing is harmless
        let t = timed(Phase::Apply, "inproc", "policy");
        std::thread::sleep(Duration::from_millis(2));
        assert!(t.finish() >= Duration::from_millis(2));
        let _ = timed_group(Phase::Assemble, "inproc", ["a", "b"]).finish();
    }
}
