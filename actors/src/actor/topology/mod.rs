//! A training run as actors: per model one trainer, one trajectory pool and rollout
//! workers; one inference engine serving every model; one weight-sync controller; an
//! evaluator for eval steps. Weights travel through a real scheme (the in-process transport
//! by default) from each trainer's outlet to the engine's inlet for that model.
//!
//! The topology hosts user code through a [`Roles`] factory (learner, policy, environment);
//! it names no algorithm, network or environment itself.
//!
//! Call [`run`] inside an actix system (`actix_rt::System::new().block_on(..)` or an
//! `#[actix_rt::test]`).
//!
//! [`run`] is three steps, one file each: `build` makes each model's trainer and the
//! engine, joined by one connected scheme per model; `spawn` starts the actors (engine,
//! evaluator, controller, pools, rollout workers) and lands version 1 everywhere; `drive`
//! runs one driver per model until the stop rule fires and gathers the report.

mod build;
mod drive;
mod spawn;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit_runtime::sync_policy::{StalenessStats, SyncConfig};
use refit_runtime::{ModelId, Version};

use crate::error::{Error, Result};
use crate::link::WeightInlet;
use crate::roles::Roles;

pub use crate::roles::ModelSpec;

pub(crate) use drive::{StopBoard, drive, reports_of};
pub(crate) use spawn::{land_version_one, start_evaluator, start_pool, start_rollout_worker};

use super::controller::ControllerStatus;
use super::engine::EngineStats;
use super::eval::EvalReport;
use super::rollout::{FragmentInfo, RolloutStats};

/// When a run stops. Every model stops at the same version, so that the last barrier
/// round completes.
#[derive(Debug, Clone)]
pub struct StopRule {
    /// Stop after this many updates.
    pub max_updates: u64,
    /// Stop once every model's mean return over its last 20 episodes reaches this.
    pub target_return: Option<f64>,
    /// Stop once this much time has passed.
    pub max_time: Duration,
}

/// Wraps an engine's inlet (for instance to model a slow link).
pub type InletWrapper = Arc<dyn Fn(Box<dyn WeightInlet>) -> Box<dyn WeightInlet> + Send + Sync>;

/// A run's settings.
#[derive(Clone)]
pub struct RunConfig {
    /// The controller's settings.
    pub sync: SyncConfig,
    /// The models.
    pub models: Vec<ModelSpec>,
    /// Validation episodes per model on eval steps.
    pub eval_episodes: usize,
    /// When to stop.
    pub stop: StopRule,
    /// Seed of the engine and the environments.
    pub seed: u64,
    /// Wraps every engine inlet, when set.
    pub wrap_inlet: Option<InletWrapper>,
    /// How long a pool may wait for a batch, and a scheme for its rendezvous.
    pub wait: Duration,
}

impl std::fmt::Debug for RunConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunConfig")
            .field("sync", &self.sync)
            .field("models", &self.models)
            .field("stop", &self.stop)
            .finish()
    }
}

/// One training update of one model.
#[derive(Debug, Clone)]
pub struct UpdateRecord {
    /// The version the trainer was at when it took the batch (trained on it).
    pub train_version: Version,
    /// The version it published.
    pub published: Version,
    /// Frames trained on.
    pub frames: usize,
    /// Lowest and highest sample version in the batch.
    pub sample_versions: (Version, Version),
    /// Largest staleness in the batch.
    pub max_staleness: u64,
    /// Samples dropped as too stale while gathering it.
    pub dropped: u64,
    /// Samples evicted from a full pool while gathering it.
    pub evicted: u64,
    /// The batch's fragments: admissions and sample versions.
    pub fragments: Vec<FragmentInfo>,
    /// Mean return over the model's last 20 episodes after this batch.
    pub mean_return: f64,
}

/// One model's run.
#[derive(Debug, Clone)]
pub struct ModelReport {
    /// Updates.
    pub updates: Vec<UpdateRecord>,
    /// Frames trained on.
    pub frames: u64,
    /// Episodes finished.
    pub episodes: u64,
    /// Mean return over the last 20 episodes.
    pub mean_return: f64,
    /// What the staleness filter kept and dropped.
    pub staleness: StalenessStats,
    /// Samples evicted from a full pool.
    pub evicted: u64,
    /// Validation results of the eval steps this trainer waited for.
    pub evals: Vec<EvalReport>,
    /// The rollout workers' statistics.
    pub workers: Vec<RolloutStats>,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// Per model.
    pub models: BTreeMap<ModelId, ModelReport>,
    /// The controller's final state and timeline.
    pub controller: ControllerStatus,
    /// The engine's load statistics.
    pub engine: EngineStats,
    /// Wall time.
    pub elapsed: Duration,
    /// True when every model reached the target return.
    pub solved: bool,
}

/// Runs a training topology until the stop rule fires; `roles` makes each model's learner,
/// policy and environments.
///
/// # Errors
/// Configuration errors (a policy that does not fit its environment, a learner whose
/// exports the policy cannot load: named by model); the first error of a trainer, pool,
/// controller or engine (named).
pub async fn run<R: Roles>(cfg: RunConfig, roles: R) -> Result<RunReport> {
    let started = Instant::now();
    if cfg.models.is_empty() {
        return Err(Error::Config("a run needs at least one model".into()));
    }
    let ids: Vec<ModelId> = cfg.models.iter().map(|m| m.id.clone()).collect();
    for spec in &cfg.models {
        spec.check()?;
    }
    let roles = Arc::new(roles);
    let mut sync = cfg.sync.clone();
    sync.models = ids.clone();
    sync.check()?;

    let build::Built { engine, trainers } = build::build(&cfg, &*roles)?;
    let spawned = spawn::spawn(&cfg, &sync, &ids, roles, engine).await?;
    drive::drive_all(&cfg, &sync, &ids, trainers, spawned, started).await
}

/// How long a blocked step may wait, by default.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(60);
