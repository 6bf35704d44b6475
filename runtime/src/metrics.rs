//! What Refit measures, through the [`metrics`](https://docs.rs/metrics) facade (and phases
//! also as [`tracing`] spans), so an application plugs in the exporter it runs (Prometheus
//! or other) and the subscriber it uses. With neither installed, recording costs a clock
//! read. [`METRICS`] lists every metric with its type, labels and meaning; `refit serve
//! --metrics-addr` and the ranks of `refit launch --metrics-addr` serve them as a Prometheus
//! page, phases as histograms with the buckets of [`PHASE_BUCKETS`].
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
//!
//! The scheme ([`crate::scheme`]) counts what every sender and receiver does whatever its
//! transport ([`sent`], [`received`], [`failed`]); transports report their receivers
//! ([`receivers_connected`]); engines their loads ([`engine_loaded`]); the weight-sync
//! controller the versions it sees ([`sync_state`]).

use std::time::{Duration, Instant};

/// Name of the histogram every phase is recorded in (seconds).
pub const PHASE_SECONDS: &str = "refit_update_phase_seconds";
/// Versions published by a sender, or applied by a receiver (counter; `side`, `model`,
/// `transport`).
pub const UPDATES_TOTAL: &str = "refit_updates_total";
/// Bytes of the versions published or applied (counter; `side`, `model`, `transport`).
pub const UPDATE_BYTES_TOTAL: &str = "refit_update_bytes_total";
/// Updates that failed (counter; `side`, `transport`).
pub const UPDATE_FAILURES_TOTAL: &str = "refit_update_failures_total";
/// The newest version a sender published (gauge; `model`, `transport`).
pub const PUBLISHED_VERSION: &str = "refit_published_version";
/// The version a receiver serves (gauge; `model`, `transport`).
pub const SERVED_VERSION: &str = "refit_served_version";
/// Receivers attached to a sender (gauge; `model`, `transport`).
pub const RECEIVERS_CONNECTED: &str = "refit_receivers_connected";
/// The version an inference engine serves requests with (gauge; `model`).
pub const ENGINE_VERSION: &str = "refit_engine_version";
/// Times an inference engine paused a model to load weights (counter; `model`).
pub const ENGINE_PAUSES_TOTAL: &str = "refit_engine_pauses_total";
/// The newest version a trainer finished, as the weight-sync controller knows it (gauge;
/// `model`).
pub const TRAIN_VERSION: &str = "refit_train_version";
/// The version every engine serves, as the weight-sync controller knows it (gauge; `model`).
pub const ROLLOUT_VERSION: &str = "refit_rollout_version";
/// Versions the engines lag behind the trainer: train version minus rollout version
/// (gauge; `model`).
pub const STALENESS_VERSIONS: &str = "refit_staleness_versions";

/// The upper bounds (seconds) of the buckets of [`PHASE_SECONDS`]: from 100 µs (an
/// in-process pointer swap) to a minute (gigabytes over a slow network).
pub const PHASE_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

/// The kind of a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up (per process); rate it.
    Counter,
    /// Goes up and down; the value now.
    Gauge,
    /// Samples in buckets ([`PHASE_BUCKETS`]); aggregate across processes by summing the
    /// buckets.
    Histogram,
}

impl MetricKind {
    /// `counter`, `gauge` or `histogram`, as Prometheus names them.
    pub fn as_str(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        }
    }
}

/// One metric Refit records: its name, kind, labels and meaning.
#[derive(Debug, Clone, Copy)]
pub struct MetricInfo {
    /// The metric's name.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: MetricKind,
    /// Its labels (a program may add its own to every metric; `refit launch` adds `rank`).
    pub labels: &'static [&'static str],
    /// Where it is recorded and what it means.
    pub help: &'static str,
}

// ANCHOR: metrics
/// Every metric Refit records.
pub const METRICS: &[MetricInfo] = &[
    MetricInfo {
        name: PHASE_SECONDS,
        kind: MetricKind::Histogram,
        labels: &["phase", "model", "transport"],
        help: "Seconds each phase of an update took (convert, assemble, wire, verify, apply, engine_pause).",
    },
    MetricInfo {
        name: UPDATES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["side", "model", "transport"],
        help: "Versions a sender published (side=sender) or a receiver applied (side=receiver), the first one included.",
    },
    MetricInfo {
        name: UPDATE_BYTES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["side", "model", "transport"],
        help: "Bytes of the versions a sender published or a receiver applied (a delta pull moves fewer over the wire).",
    },
    MetricInfo {
        name: UPDATE_FAILURES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["side", "transport"],
        help: "Updates that failed: a version refused, not published or not acknowledged in time by send (sender), refused or broken in transit (receiver; a sender gone or a wait that ran out is not counted), a load that failed (side=engine, transport=engine).",
    },
    MetricInfo {
        name: PUBLISHED_VERSION,
        kind: MetricKind::Gauge,
        labels: &["model", "transport"],
        help: "The newest version a sender published.",
    },
    MetricInfo {
        name: SERVED_VERSION,
        kind: MetricKind::Gauge,
        labels: &["model", "transport"],
        help: "The version a receiver serves (its newest applied one).",
    },
    MetricInfo {
        name: RECEIVERS_CONNECTED,
        kind: MetricKind::Gauge,
        labels: &["model", "transport"],
        help: "Receivers attached to a sender now (tcp, shm and broadcast senders; the readers of a file or of an in-process hub are not counted).",
    },
    MetricInfo {
        name: ENGINE_VERSION,
        kind: MetricKind::Gauge,
        labels: &["model"],
        help: "The version an inference engine serves requests with.",
    },
    MetricInfo {
        name: ENGINE_PAUSES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["model"],
        help: "Times an inference engine paused a model to load weights (each pause's length is the engine_pause phase).",
    },
    MetricInfo {
        name: TRAIN_VERSION,
        kind: MetricKind::Gauge,
        labels: &["model"],
        help: "The newest version a trainer finished, as the weight-sync controller knows it.",
    },
    MetricInfo {
        name: ROLLOUT_VERSION,
        kind: MetricKind::Gauge,
        labels: &["model"],
        help: "The version every engine serves, as the weight-sync controller knows it.",
    },
    MetricInfo {
        name: STALENESS_VERSIONS,
        kind: MetricKind::Gauge,
        labels: &["model"],
        help: "Versions the engines lag behind the trainer (train version minus rollout version).",
    },
];
// ANCHOR_END: metrics

/// Registers the description of every metric of [`METRICS`] with the recorder installed
/// now (the `# HELP` lines of a Prometheus page); an exporter calls it once installed.
pub fn describe() {
    for m in METRICS {
        let unit = (m.kind == MetricKind::Histogram).then_some(metrics::Unit::Seconds);
        match (m.kind, unit) {
            (MetricKind::Counter, _) => metrics::describe_counter!(m.name, m.help),
            (MetricKind::Gauge, _) => metrics::describe_gauge!(m.name, m.help),
            (MetricKind::Histogram, Some(u)) => metrics::describe_histogram!(m.name, u, m.help),
            (MetricKind::Histogram, None) => metrics::describe_histogram!(m.name, m.help),
        }
    }
}

/// Which end of a scheme a count is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A sender (publishes versions).
    Sender,
    /// A receiver (applies versions).
    Receiver,
    /// An inference engine (loads versions into the model it serves).
    Engine,
}

impl Side {
    /// The `side` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Sender => "sender",
            Side::Receiver => "receiver",
            Side::Engine => "engine",
        }
    }
}

/// Counts one update on `side` and sets its version gauge `gauge`.
fn updated(
    side: Side,
    gauge: &'static str,
    transport: &'static str,
    model: &str,
    version: u64,
    bytes: u64,
) {
    let labels = [
        ("side", side.as_str().to_owned()),
        ("model", model.to_owned()),
        ("transport", transport.to_owned()),
    ];
    metrics::counter!(UPDATES_TOTAL, &labels).increment(1);
    metrics::counter!(UPDATE_BYTES_TOTAL, &labels).increment(bytes);
    metrics::gauge!(gauge, "model" => model.to_owned(), "transport" => transport)
        .set(version as f64);
}

/// A sender published `version` of `model`, `bytes` long, over `transport`.
pub fn sent(transport: &'static str, model: &str, version: u64, bytes: u64) {
    updated(
        Side::Sender,
        PUBLISHED_VERSION,
        transport,
        model,
        version,
        bytes,
    );
}

/// A receiver applied `version` of `model`, `bytes` long, over `transport`.
pub fn received(transport: &'static str, model: &str, version: u64, bytes: u64) {
    updated(
        Side::Receiver,
        SERVED_VERSION,
        transport,
        model,
        version,
        bytes,
    );
}

/// An update failed on `side` of `transport`.
pub fn failed(side: Side, transport: &'static str) {
    failures(side, transport).increment(1);
}

/// The failure counter of `side` of `transport`; incrementing it by zero shows it on a
/// page before any failure (a sender or receiver does so when it connects).
pub fn failures(side: Side, transport: &'static str) -> metrics::Counter {
    metrics::counter!(UPDATE_FAILURES_TOTAL, "side" => side.as_str(), "transport" => transport)
}

/// `count` receivers are attached to the sender of `models` over `transport`.
pub fn receivers_connected<'a>(
    transport: &'static str,
    models: impl IntoIterator<Item = &'a str>,
    count: usize,
) {
    for m in models {
        metrics::gauge!(RECEIVERS_CONNECTED, "model" => m.to_owned(), "transport" => transport)
            .set(count as f64);
    }
}

/// An inference engine loaded `version` of `model`, pausing it for `paused`: the
/// `engine_pause` phase, a pause counted, the engine's version set.
pub fn engine_loaded(model: &str, version: u64, paused: Duration) {
    record(Phase::EnginePause, "engine", model, paused);
    metrics::counter!(ENGINE_PAUSES_TOTAL, "model" => model.to_owned()).increment(1);
    metrics::gauge!(ENGINE_VERSION, "model" => model.to_owned()).set(version as f64);
    failures(Side::Engine, "engine").increment(0);
}

/// The weight-sync controller's view of `model`: the trainer's newest version and the one
/// every engine serves (staleness is their difference).
pub fn sync_state(model: &str, train_version: u64, rollout_version: u64) {
    metrics::gauge!(TRAIN_VERSION, "model" => model.to_owned()).set(train_version as f64);
    metrics::gauge!(ROLLOUT_VERSION, "model" => model.to_owned()).set(rollout_version as f64);
    metrics::gauge!(STALENESS_VERSIONS, "model" => model.to_owned())
        .set(train_version.saturating_sub(rollout_version) as f64);
}

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
