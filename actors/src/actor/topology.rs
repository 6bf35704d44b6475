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

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_runtime::sync_policy::{StalenessStats, SyncConfig, SyncMode};
use refit_runtime::topology::TransportKind;
use refit_runtime::{Manifests, ModelId, ReceiverInit, SenderInit, Version};
use refit_transports::link::{self, LinkOptions};
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::link::WeightInlet;
use crate::roles::{Roles, check_fit};

pub use crate::roles::ModelSpec;

use super::controller::{
    AwaitDrained, AwaitSynced, ControllerStatus, GetStatus, VersionNotifier, WeightSyncController,
};
use super::engine::ActBatch;
use super::engine::{EngineHandle, EngineStats, GetEngineStats, InferenceEngine};
use super::eval::{EvalReport, Evaluator};
use super::rollout::{
    AwaitBatch, ControllerLink, FragmentInfo, PushFragment, RolloutConfig, RolloutStats,
    RolloutWorker, StartRollouts, StopRollouts, TakeBatch, TrajectoryPool,
};
use super::workers::{TrainAndPublish, Trainer};

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

/// The common stop decision of a run's model drivers.
#[derive(Default)]
pub(crate) struct StopBoard {
    versions: BTreeMap<ModelId, Version>,
    solved: BTreeMap<ModelId, bool>,
    stop_at: Option<Version>,
}

impl StopBoard {
    /// Records `model` at `version`; decides the common last version once a rule fires.
    fn post(
        &mut self,
        model: &ModelId,
        version: Version,
        solved: bool,
        stop_now: bool,
    ) -> Option<Version> {
        self.versions.insert(model.clone(), version);
        self.solved.insert(model.clone(), solved);
        let all_solved =
            self.solved.len() == self.versions.len() && self.solved.values().all(|s| *s);
        if self.stop_at.is_none() && (stop_now || all_solved) {
            let max = self.versions.values().copied().max().unwrap_or(version);
            self.stop_at = Some(max);
        }
        self.stop_at
    }
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

    // Trainers, their outlets, and the engine's inlets: one in-process scheme per model.
    let mut engine = InferenceEngine::<R::Policy>::empty(cfg.seed);
    let mut trainers = Vec::new();
    for spec in &cfg.models {
        let mut learner = roles.learner(spec)?;
        let policy = roles.policy(spec)?;
        check_fit(&spec.id, &roles.env(spec, cfg.seed)?, &policy)?;
        let served = refit_runtime::HasWeights::weight_manifest(&policy)?;
        served.check_same_schema(&spec.id, &learner.manifest())?;
        let initial = learner.export()?;
        if initial.model() != &spec.id {
            return Err(Error::ModelMismatch {
                expected: spec.id.to_string(),
                found: initial.model().to_string(),
            });
        }
        if initial.version() != Version(1) {
            return Err(Error::Config(format!(
                "the learner of model `{}` exported its first weights as v{} (a fresh learner exports v1)",
                spec.id,
                initial.version()
            )));
        }
        let manifests = Manifests::new([(spec.id.clone(), Arc::clone(initial.manifest()))])?;
        // both ends in this process: the link factory's in-process transport, by the name
        // the topology resolves for a link inside one rank
        let opened = link::open(
            TransportKind::InProc.as_str(),
            &manifests,
            &LinkOptions::default(),
        )?;
        let receiver = ReceiverInit::new(
            opened.spec.receiver(&LinkOptions::default())?,
            Some(manifests.clone()),
        );
        let wait = cfg.wait;
        let (sender, receiver) = std::thread::scope(|s| {
            let r = s.spawn(move || receiver.connect(wait));
            let sender = SenderInit::new(opened.sender, manifests).connect(vec![initial], wait);
            let receiver = r
                .join()
                .map_err(|_| refit_runtime::Error::State("receiver connect thread panicked"))?;
            Ok::<_, refit_runtime::Error>((sender?, receiver?))
        })?;
        let mut inlet: Box<dyn WeightInlet> = Box::new(receiver);
        if let Some(wrap) = &cfg.wrap_inlet {
            inlet = wrap(inlet);
        }
        engine = engine.with_model(spec.id.clone(), policy, Some(inlet))?;
        trainers.push(Trainer::start_with_outlet(learner, Box::new(sender)));
    }
    let engine_arbiter = Arbiter::new();
    let engine = InferenceEngine::start_in_arbiter(&engine_arbiter.handle(), move |_| engine);

    let evaluator = start_evaluator(
        Arc::clone(&roles),
        &cfg.models,
        engine.clone().recipient(),
        cfg.eval_episodes,
        cfg.seed,
    );
    let controller = WeightSyncController::new(
        &sync,
        ids.clone(),
        vec![EngineHandle::of(&engine)],
        Some(evaluator.recipient()),
    )?
    .start();

    // Version 1 lands everywhere before any rollout runs.
    let mut notifiers: Vec<VersionNotifier> = ids
        .iter()
        .map(|id| VersionNotifier::new(controller.clone(), id.clone(), sync.clone()))
        .collect();
    for n in &mut notifiers {
        n.notify(Version(1)).await?;
    }
    for n in &mut notifiers {
        n.flush().await?;
    }

    // Pools and rollout workers.
    let mut pools = Vec::new();
    let mut workers: Vec<Vec<Addr<RolloutWorker<R::Env>>>> = Vec::new();
    let mut arbiters = vec![engine_arbiter];
    for (mi, spec) in cfg.models.iter().enumerate() {
        let pool = TrajectoryPool::new(
            spec.id.clone(),
            spec.batch_frames,
            sync.allowed_staleness(),
            Some(controller.clone().recipient()),
        )
        .with_capacity_batches(sync.max_buffered_batches)
        .start();
        let mut ws = Vec::new();
        for w in 0..spec.workers {
            let base = cfg
                .seed
                .wrapping_mul(1000)
                .wrapping_add((mi * 100 + w) as u64 * 17);
            let (arbiter, addr) = start_rollout_worker(
                &*roles,
                spec,
                RolloutConfig {
                    model: spec.id.clone(),
                    worker: w,
                    fragment_steps: spec.fragment_steps,
                    seed: base,
                    timeout: cfg.wait,
                },
                engine.clone().recipient(),
                &controller,
                pool.clone().recipient(),
            )?;
            addr.do_send(StartRollouts);
            arbiters.push(arbiter);
            ws.push(addr);
        }
        pools.push(pool);
        workers.push(ws);
    }

    // One driver per model: take a batch, train, publish, notify.
    let board = Arc::new(Mutex::new(StopBoard::default()));
    let mut drivers = Vec::new();
    for (((spec, trainer), pool), notifier) in cfg
        .models
        .iter()
        .zip(trainers)
        .zip(pools.iter().cloned())
        .zip(notifiers)
    {
        let d = drive(
            spec.id.clone(),
            trainer,
            pool,
            controller.clone(),
            notifier,
            sync.sync_mode,
            cfg.stop.clone(),
            cfg.wait,
            Arc::clone(&board),
            started,
        );
        drivers.push(actix_rt::spawn(d));
    }
    let mut reports = BTreeMap::new();
    let mut first_error = None;
    for (id, d) in ids.iter().zip(drivers) {
        match d.await {
            Ok(Ok(r)) => {
                reports.insert(id.clone(), r);
            }
            Ok(Err(e)) => {
                first_error.get_or_insert(Error::Actor(format!("trainer of model `{id}`: {e}")));
            }
            Err(e) => {
                first_error.get_or_insert(Error::Actor(format!(
                    "trainer of model `{id}` panicked: {e}"
                )));
            }
        }
    }
    for (id, ws) in ids.iter().zip(&workers) {
        for w in ws {
            let stats = w
                .send(StopRollouts)
                .await
                .map_err(|e| Error::Actor(format!("rollout worker of `{id}`: {e}")))?;
            if let Some(r) = reports.get_mut(id) {
                r.workers.push(stats);
            }
        }
    }
    let status = controller
        .send(GetStatus)
        .await
        .map_err(|e| Error::Actor(format!("controller: {e}")))?;
    let engine_stats = engine
        .send(GetEngineStats)
        .await
        .map_err(|e| Error::Actor(format!("engine: {e}")))?;
    for a in arbiters {
        a.stop();
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let solved = cfg
        .stop
        .target_return
        .is_some_and(|t| reports.values().all(|r| r.mean_return >= t));
    Ok(RunReport {
        models: reports,
        controller: status,
        engine: engine_stats,
        elapsed: started.elapsed(),
        solved,
    })
}

/// One model's driver: take a batch, train, publish, notify, until the stop board says
/// the run is over; answers the model's report.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn drive(
    model: ModelId,
    trainer: Addr<Trainer>,
    pool: Addr<TrajectoryPool>,
    controller: Addr<WeightSyncController>,
    mut notifier: VersionNotifier,
    mode: SyncMode,
    stop: StopRule,
    wait: Duration,
    board: Arc<Mutex<StopBoard>>,
    started: Instant,
) -> Result<ModelReport> {
    let mut version = Version(1);
    let mut last20: VecDeque<f64> = VecDeque::with_capacity(20);
    let mut report = ModelReport {
        updates: Vec::new(),
        frames: 0,
        episodes: 0,
        mean_return: 0.0,
        staleness: StalenessStats::default(),
        evicted: 0,
        evals: Vec::new(),
        workers: Vec::new(),
    };
    let unreachable =
        |what: &str, e: MailboxError| Error::Actor(format!("{what} of model `{model}`: {e}"));
    loop {
        let stop_at = board.lock().unwrap_or_else(PoisonError::into_inner).stop_at;
        if stop_at.is_some_and(|s| version >= s) {
            break;
        }
        if mode == SyncMode::Sync {
            // Every fragment admitted under this version is on-policy: wait for them all.
            pool.send(AwaitBatch {
                train_version: version,
                timeout: wait,
            })
            .await
            .map_err(|e| unreachable("pool", e))??;
            controller
                .send(AwaitDrained {
                    model: model.clone(),
                })
                .await
                .map_err(|e| unreachable("controller", e))??;
        }
        let pb = pool
            .send(TakeBatch {
                train_version: version,
                all: mode == SyncMode::Sync,
                timeout: wait,
            })
            .await
            .map_err(|e| unreachable("pool", e))??;
        for e in &pb.batch.episodes {
            if last20.len() == 20 {
                last20.pop_front();
            }
            last20.push_back(e.ret);
        }
        report.episodes += pb.batch.episodes.len() as u64;
        report.frames += pb.batch.frames as u64;
        let mean = if last20.is_empty() {
            0.0
        } else {
            last20.iter().sum::<f64>() / last20.len() as f64
        };
        report.mean_return = mean;
        report.staleness = pb.totals.clone();
        report.evicted += pb.evicted;
        let sample_versions = pb.batch.version_range().unwrap_or((version, version));
        let frames = pb.batch.frames;
        // one span per weight update: training, publishing, and the controller's round
        let span = tracing::info_span!(
            "weight_update",
            model = %model,
            from = %version,
            to = tracing::field::Empty
        );
        let update_started = Instant::now();
        let (_, published) = trainer
            .send(TrainAndPublish { batch: pb.batch })
            .instrument(span.clone())
            .await
            .map_err(|e| unreachable("trainer", e))??;
        span.record("to", tracing::field::display(published));
        span.in_scope(|| {
            tracing::info!(
                frames = report.frames,
                mean_return = format_args!("{mean:.1}"),
                max_staleness = pb.max_staleness,
                dropped = pb.dropped,
                train_ms = update_started.elapsed().as_millis() as u64,
                "trained and published"
            );
        });
        report.updates.push(UpdateRecord {
            train_version: version,
            published,
            frames,
            sample_versions,
            max_staleness: pb.max_staleness,
            dropped: pb.dropped,
            evicted: pb.evicted,
            fragments: pb.fragments,
            mean_return: mean,
        });
        version = published;
        let solved = stop
            .target_return
            .is_some_and(|t| last20.len() == 20 && mean >= t);
        let out_of_budget =
            report.updates.len() as u64 >= stop.max_updates || started.elapsed() >= stop.max_time;
        board.lock().unwrap_or_else(PoisonError::into_inner).post(
            &model,
            version,
            solved,
            out_of_budget,
        );
        if let Some(eval) = notifier
            .notify(version)
            .instrument(span)
            .await?
            .and_then(|o| o.eval)
        {
            report.evals.push(eval);
        }
    }
    notifier.flush().await?;
    // The run ends when its last version serves everywhere.
    controller
        .send(AwaitSynced {
            model: model.clone(),
            version,
        })
        .await
        .map_err(|e| unreachable("controller", e))??;
    Ok(report)
}

/// Starts the evaluator: `episodes` validation episodes per model through `engine`, on
/// environments the roles build with seeds apart from the rollout workers'.
pub(crate) fn start_evaluator<R: Roles>(
    roles: Arc<R>,
    specs: &[ModelSpec],
    engine: Recipient<ActBatch>,
    episodes: usize,
    seed: u64,
) -> Addr<Evaluator<R::Env>> {
    let ids = specs.iter().map(|s| s.id.clone()).collect();
    let by_id: BTreeMap<ModelId, ModelSpec> =
        specs.iter().map(|s| (s.id.clone(), s.clone())).collect();
    Evaluator::new(
        engine,
        ids,
        move |model, i| {
            let spec = by_id
                .get(model)
                .ok_or_else(|| Error::Runtime(refit_runtime::Error::UnknownModel(model.clone())))?;
            roles.env(
                spec,
                seed.wrapping_mul(31).wrapping_add(1_000_000 + i as u64),
            )
        },
        episodes,
        10_000,
        seed,
    )
    .start()
}

/// Builds a rollout worker's environments (`spec.envs_per_worker` of them, seeded from
/// `cfg.seed` on) and starts the worker on an arbiter of its own, not yet rolling out.
///
/// # Errors
/// An environment the roles cannot build; a bad worker configuration.
pub(crate) fn start_rollout_worker<R: Roles>(
    roles: &R,
    spec: &ModelSpec,
    cfg: RolloutConfig,
    engine: Recipient<ActBatch>,
    controller: impl Into<ControllerLink>,
    pool: Recipient<PushFragment>,
) -> Result<(Arbiter, Addr<RolloutWorker<R::Env>>)> {
    let envs = (0..spec.envs_per_worker)
        .map(|i| roles.env(spec, cfg.seed.wrapping_add(i as u64)))
        .collect::<Result<Vec<_>>>()?;
    let worker = RolloutWorker::new(cfg, envs, engine, controller, pool)?;
    let arbiter = Arbiter::new();
    let addr = RolloutWorker::start_in_arbiter(&arbiter.handle(), move |_| worker);
    Ok((arbiter, addr))
}

/// How long a blocked step may wait, by default.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(60);
