//! The controller's configuration, from TOML.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::ModelId;

/// When rollouts wait for weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyncMode {
    /// Rollouts block from the moment a batch is ready until the trainer's next version has
    /// landed on every engine: every sample is produced by the version that trains on it.
    #[default]
    Sync,
    /// Rollouts never block on weights; every new version is loaded as soon as possible
    /// (intermediate versions are skipped when a load is still in flight).
    FullyAsync,
    /// Rollouts block only while `train_version - rollout_version >= staleness_threshold`.
    BatchAsync,
}

impl SyncMode {
    /// The name used in configuration files and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::FullyAsync => "fully-async",
            Self::BatchAsync => "batch-async",
        }
    }

    /// Parses `sync`, `fully-async` or `batch-async`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the accepted values.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "sync" => Ok(Self::Sync),
            "fully-async" => Ok(Self::FullyAsync),
            "batch-async" => Ok(Self::BatchAsync),
            other => Err(Error::Config(format!(
                "sync_mode `{other}` is not one of `sync`, `fully-async`, `batch-async`"
            ))),
        }
    }
}

impl std::fmt::Display for SyncMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a generating engine does with the sequences in flight when a new version is ready
/// (the swap itself happens at a decoding-step boundary, after the version was staged
/// beside generation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseMode {
    /// In-flight requests end at the swap, reported as aborted (with their tokens so far).
    Abort,
    /// No new request starts; the ones in flight finish under the old version; then the
    /// swap.
    Wait,
    /// In-flight sequences continue under the new version (their KV caches kept); their
    /// per-token versions show the change.
    #[default]
    Keep,
}

impl PauseMode {
    /// The name used in configuration files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Abort => "abort",
            Self::Wait => "wait",
            Self::Keep => "keep",
        }
    }

    /// Parses `abort`, `wait` or `keep`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the accepted values.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "abort" => Ok(Self::Abort),
            "wait" => Ok(Self::Wait),
            "keep" => Ok(Self::Keep),
            other => Err(Error::Config(format!(
                "pause mode `{other}` is not one of `abort`, `wait`, `keep`"
            ))),
        }
    }
}

impl std::fmt::Display for PauseMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Deadlines, in seconds, on every wait the controller makes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// One model's load on one engine (stage + apply).
    pub load_s: f64,
    /// How long a rollout may stay blocked before its status check fails.
    pub rollout_wait_s: f64,
    /// How long a trainer may wait at the version barrier for the other trainers.
    pub barrier_s: f64,
    /// One validation run.
    pub eval_s: f64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            load_s: 30.0,
            rollout_wait_s: 120.0,
            barrier_s: 300.0,
            eval_s: 300.0,
        }
    }
}

impl Timeouts {
    /// [`Timeouts::load_s`] as a duration.
    pub fn load(&self) -> Duration {
        Duration::from_secs_f64(self.load_s)
    }
    /// [`Timeouts::rollout_wait_s`] as a duration.
    pub fn rollout_wait(&self) -> Duration {
        Duration::from_secs_f64(self.rollout_wait_s)
    }
    /// [`Timeouts::barrier_s`] as a duration.
    pub fn barrier(&self) -> Duration {
        Duration::from_secs_f64(self.barrier_s)
    }
    /// [`Timeouts::eval_s`] as a duration.
    pub fn eval(&self) -> Duration {
        Duration::from_secs_f64(self.eval_s)
    }
}

/// Everything the weight-sync controller decides by.
///
/// ```toml
/// sync_mode = "batch-async"      # "sync" | "fully-async" | "batch-async"
/// staleness_threshold = 2        # batch-async: block when train - rollout >= 2
/// max_staleness = 2              # drop samples older than this (default: by mode)
/// validate_freq = 5              # every 5th version is an eval step (0 = never)
/// pause_mode = "keep"            # generating engines at a swap: "abort" | "wait" | "keep"
/// models = ["solver", "verifier"]
///
/// [timeouts]
/// load_s = 30.0
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyncConfig {
    /// When rollouts wait for weights.
    pub sync_mode: SyncMode,
    /// `batch-async` blocks rollouts while `train - rollout >= staleness_threshold` (>= 1).
    pub staleness_threshold: u64,
    /// Samples whose version is more than this behind the trainer are dropped. Default by
    /// mode: `sync` 0, `batch-async` the threshold, `fully-async` none dropped.
    pub max_staleness: Option<u64>,
    /// The trajectory pool holds at most this many batches of frames; when rollouts outrun
    /// the trainer the oldest fragments are evicted (and counted), so that a backlog never
    /// makes trained samples older than the rollouts that produce them (>= 1).
    pub max_buffered_batches: u64,
    /// Every version divisible by this is an eval step: rollouts pause, every model loads in
    /// order, validation runs, rollouts resume. 0 turns validation off.
    pub validate_freq: u64,
    /// The models the controller synchronises (one trainer each); the leader loads them in
    /// this order's sorted order on eval steps. Empty means the single default model.
    pub models: Vec<ModelId>,
    /// What generating engines do with sequences in flight at a swap.
    pub pause_mode: PauseMode,
    /// Deadlines.
    pub timeouts: Timeouts,
}

impl Default for SyncConfig {
    fn default() -> Self {
        Self {
            sync_mode: SyncMode::Sync,
            staleness_threshold: 2,
            max_staleness: None,
            max_buffered_batches: 2,
            validate_freq: 0,
            models: Vec::new(),
            pause_mode: PauseMode::default(),
            timeouts: Timeouts::default(),
        }
    }
}

impl SyncConfig {
    /// A default configuration in `mode`.
    pub fn with_mode(mode: SyncMode) -> Self {
        Self {
            sync_mode: mode,
            ..Self::default()
        }
    }

    /// Parses and checks a TOML document.
    ///
    /// # Errors
    /// [`Error::Config`] for malformed TOML, unknown keys (named, with the accepted ones),
    /// values of the wrong type and values that cannot work (see [`SyncConfig::check`]).
    pub fn from_toml(text: &str) -> Result<Self> {
        let cfg: Self = toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        cfg.check()?;
        Ok(cfg)
    }

    /// Parses and checks the text of the TOML file at `path` (which the caller read: this
    /// crate reads no configuration files).
    ///
    /// # Errors
    /// As [`SyncConfig::from_toml`], with the path in the message.
    pub fn from_file_text(text: &str, path: &Path) -> Result<Self> {
        Self::from_toml(text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    /// Checks values that parse but cannot work.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key: a zero `staleness_threshold` in `batch-async`
    /// (rollouts would never run), a model listed twice, a deadline that is not a positive
    /// finite number of seconds.
    pub fn check(&self) -> Result<()> {
        if self.sync_mode == SyncMode::BatchAsync && self.staleness_threshold == 0 {
            return Err(Error::Config(
                "staleness_threshold must be at least 1 in batch-async mode (0 would block every rollout)".into(),
            ));
        }
        if self.max_buffered_batches == 0 {
            return Err(Error::Config(
                "max_buffered_batches must be at least 1 (the pool must hold one batch)".into(),
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for m in &self.models {
            if !seen.insert(m) {
                return Err(Error::Config(format!("models: `{m}` is listed twice")));
            }
        }
        let t = &self.timeouts;
        for (key, v) in [
            ("timeouts.load_s", t.load_s),
            ("timeouts.rollout_wait_s", t.rollout_wait_s),
            ("timeouts.barrier_s", t.barrier_s),
            ("timeouts.eval_s", t.eval_s),
        ] {
            if !(v.is_finite() && v > 0.0 && v < 1e9) {
                return Err(Error::Config(format!(
                    "{key} must be a positive number of seconds, not {v}"
                )));
            }
        }
        Ok(())
    }

    /// The staleness the filter allows: [`SyncConfig::max_staleness`], or the mode's default.
    pub fn allowed_staleness(&self) -> Option<u64> {
        self.max_staleness.or(match self.sync_mode {
            SyncMode::Sync => Some(0),
            SyncMode::BatchAsync => Some(self.staleness_threshold),
            SyncMode::FullyAsync => None,
        })
    }

    /// True when `version` is an eval step.
    pub fn is_eval_step(&self, version: crate::ids::Version) -> bool {
        self.validate_freq > 0 && version.0 > 0 && version.0.is_multiple_of(self.validate_freq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_file_parses() {
        let cfg = SyncConfig::from_toml(
            r#"
            sync_mode = "batch-async"
            staleness_threshold = 3
            validate_freq = 5
            models = ["verifier", "solver"]
            [timeouts]
            load_s = 2.5
            "#,
        )
        .unwrap();
        assert_eq!(cfg.sync_mode, SyncMode::BatchAsync);
        assert_eq!(cfg.staleness_threshold, 3);
        assert_eq!(cfg.allowed_staleness(), Some(3));
        assert_eq!(cfg.timeouts.load(), Duration::from_millis(2500));
        assert_eq!(cfg.timeouts.barrier_s, 300.0);
        assert!(cfg.is_eval_step(crate::Version(10)));
        assert!(!cfg.is_eval_step(crate::Version(11)));
    }

    #[test]
    fn empty_file_is_the_default() {
        assert_eq!(SyncConfig::from_toml("").unwrap(), SyncConfig::default());
        assert_eq!(SyncConfig::default().allowed_staleness(), Some(0));
        assert_eq!(
            SyncConfig::with_mode(SyncMode::FullyAsync).allowed_staleness(),
            None
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let e = SyncConfig::from_toml("sync_mod = \"sync\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `sync_mod`"), "{e}");
        assert!(e.contains("sync_mode"), "{e}");
        let e = SyncConfig::from_toml("[timeouts]\nload = 1.0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `load`"), "{e}");
        let e = SyncConfig::from_toml("sync_mode = \"eventually\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("eventually") && e.contains("batch-async"), "{e}");
        let e = SyncConfig::from_toml("validate_freq = -1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("validate_freq"), "{e}");
        let e = SyncConfig::from_toml("sync_mode = \"batch-async\"\nstaleness_threshold = 0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("staleness_threshold"), "{e}");
        let e = SyncConfig::from_toml("max_buffered_batches = 0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_buffered_batches"), "{e}");
        let e = SyncConfig::from_toml("models = [\"a\", \"a\"]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`a` is listed twice"), "{e}");
        let e = SyncConfig::from_toml("models = [\"\"]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("models"), "{e}");
        let e = SyncConfig::from_toml("[timeouts]\neval_s = 0.0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("timeouts.eval_s"), "{e}");
        assert!(SyncMode::parse("batch").is_err());
        assert_eq!(
            SyncMode::parse("fully-async").unwrap(),
            SyncMode::FullyAsync
        );
    }

    #[test]
    fn file_errors_name_the_path() {
        let p = Path::new("conf/sync.toml");
        let e = SyncConfig::from_file_text("validate_freq = \"often\"", p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("conf/sync.toml") && e.contains("validate_freq"),
            "{e}"
        );
        assert!(SyncConfig::from_file_text("", p).is_ok());
    }
}
