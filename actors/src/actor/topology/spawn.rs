//! Spawn: the engine on an arbiter of its own, the evaluator, the controller; version 1
//! announced everywhere; per model a trajectory pool and its rollout workers, rolling out.

use std::collections::BTreeMap;
use std::sync::Arc;

use actix::prelude::*;
use refit_runtime::sync_policy::SyncConfig;
use refit_runtime::{ModelId, Version};

use crate::error::{Error, Result};
use crate::roles::{ModelSpec, Roles};

use super::RunConfig;
use crate::actor::controller::{VersionNotifier, WeightSyncController};
use crate::actor::engine::{ActBatch, EngineHandle, InferenceEngine};
use crate::actor::eval::Evaluator;
use crate::actor::rollout::{
    ControllerLink, PushFragment, RolloutConfig, RolloutWorker, StartRollouts, TrajectoryPool,
};

/// The actors of a running topology, before its drivers start.
pub(super) struct Spawned<R: Roles> {
    pub(super) engine: Addr<InferenceEngine<R::Policy>>,
    pub(super) controller: Addr<WeightSyncController>,
    pub(super) notifiers: Vec<VersionNotifier>,
    pub(super) pools: Vec<Addr<TrajectoryPool>>,
    pub(super) workers: Vec<Vec<Addr<RolloutWorker<R::Env>>>>,
    pub(super) arbiters: Vec<Arbiter>,
}

/// Starts every actor of the run around `engine` and lands version 1 everywhere.
///
/// # Errors
/// A controller configuration that does not hold, a notification that fails, a rollout
/// worker that cannot be built.
pub(super) async fn spawn<R: Roles>(
    cfg: &RunConfig,
    sync: &SyncConfig,
    ids: &[ModelId],
    roles: Arc<R>,
    engine: InferenceEngine<R::Policy>,
) -> Result<Spawned<R>> {
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
        sync,
        ids.to_vec(),
        vec![EngineHandle::of(&engine)],
        Some(evaluator.recipient()),
    )?
    .start();

    // Version 1 lands everywhere before any rollout runs.
    let notifiers = land_version_one(&controller, ids, sync).await?;

    // Pools and rollout workers.
    let mut pools = Vec::new();
    let mut workers: Vec<Vec<Addr<RolloutWorker<R::Env>>>> = Vec::new();
    let mut arbiters = vec![engine_arbiter];
    for (mi, spec) in cfg.models.iter().enumerate() {
        let pool = start_pool(spec, sync, &controller);
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
    Ok(Spawned {
        engine,
        controller,
        notifiers,
        pools,
        workers,
        arbiters,
    })
}

/// The trajectory pool of one model: batches of `spec.batch_frames`, filtered by the sync
/// policy's staleness, at most `max_buffered_batches` buffered, ready batches told to the
/// controller.
pub(crate) fn start_pool(
    spec: &ModelSpec,
    sync: &SyncConfig,
    controller: &Addr<WeightSyncController>,
) -> Addr<TrajectoryPool> {
    TrajectoryPool::new(
        spec.id.clone(),
        spec.batch_frames,
        sync.allowed_staleness(),
        Some(controller.clone().recipient()),
    )
    .with_capacity_batches(sync.max_buffered_batches)
    .start()
}

/// Tells the controller that version 1 of every model is out and waits until it landed
/// everywhere; returns each model's notifier, for the drivers.
///
/// # Errors
/// The controller refused or is gone.
pub(crate) async fn land_version_one(
    controller: &Addr<WeightSyncController>,
    ids: &[ModelId],
    sync: &SyncConfig,
) -> Result<Vec<VersionNotifier>> {
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
    Ok(notifiers)
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
