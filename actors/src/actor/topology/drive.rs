//! Drive: one driver per model (take a batch, train, publish, notify) until the common
//! stop decision; then the rollout workers stop and the run's report is gathered.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_runtime::sync_policy::{StalenessStats, SyncConfig, SyncMode};
use refit_runtime::{ModelId, Version};
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::roles::Roles;

use super::spawn::Spawned;
use super::{ModelReport, RunConfig, RunReport, StopRule, UpdateRecord};
use crate::actor::controller::{
    AwaitDrained, AwaitSynced, GetStatus, VersionNotifier, WeightSyncController,
};
use crate::actor::engine::GetEngineStats;
use crate::actor::rollout::{AwaitBatch, StopRollouts, TakeBatch, TrajectoryPool};
use crate::actor::workers::{TrainAndPublish, Trainer};

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

/// Runs one driver per model to the end, stops the rollout workers and the arbiters, and
/// gathers the report.
///
/// # Errors
/// The first error of a trainer or driver (named by model); an actor that cannot be
/// reached.
pub(super) async fn drive_all<R: Roles>(
    cfg: &RunConfig,
    sync: &SyncConfig,
    ids: &[ModelId],
    trainers: Vec<Addr<Trainer>>,
    spawned: Spawned<R>,
    started: Instant,
) -> Result<RunReport> {
    // One driver per model: take a batch, train, publish, notify.
    let board = Arc::new(Mutex::new(StopBoard::default()));
    let mut drivers = Vec::new();
    for (((spec, trainer), pool), notifier) in cfg
        .models
        .iter()
        .zip(trainers)
        .zip(spawned.pools.iter().cloned())
        .zip(spawned.notifiers)
    {
        let d = drive(
            spec.id.clone(),
            trainer,
            pool,
            spawned.controller.clone(),
            notifier,
            sync.sync_mode,
            cfg.stop.clone(),
            cfg.wait,
            Arc::clone(&board),
            started,
        );
        drivers.push(actix_rt::spawn(d));
    }
    let mut joined = Vec::with_capacity(drivers.len());
    for d in drivers {
        joined.push(d.await);
    }
    let (mut reports, first_error) = reports_of(ids, joined);
    for (id, ws) in ids.iter().zip(&spawned.workers) {
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
    let status = spawned
        .controller
        .send(GetStatus)
        .await
        .map_err(|e| Error::Actor(format!("controller: {e}")))?;
    let engine_stats = spawned
        .engine
        .send(GetEngineStats)
        .await
        .map_err(|e| Error::Actor(format!("engine: {e}")))?;
    for a in spawned.arbiters {
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

/// Each model's report from its driver's outcome (in `ids` order), and the first error: a
/// driver that failed or panicked, named by model.
pub(crate) fn reports_of(
    ids: &[ModelId],
    joined: Vec<std::result::Result<Result<ModelReport>, actix_rt::task::JoinError>>,
) -> (BTreeMap<ModelId, ModelReport>, Option<Error>) {
    let mut reports = BTreeMap::new();
    let mut first_error = None;
    for (id, d) in ids.iter().zip(joined) {
        match d {
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
    (reports, first_error)
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
