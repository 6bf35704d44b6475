//! One model's driver, on its trainer's rank: take a batch from the model's pool, train,
//! publish, notify the controller, report progress to the lead, until the lead's common
//! stop decision; then wait until the last version serves everywhere.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_runtime::sync_policy::{StalenessStats, SyncMode};
use refit_runtime::{ModelId, Version};
use tracing::Instrument;

use crate::actor::notifier::VersionNotifier;
use crate::error::{Error, Result};
use crate::protocol::controller::{AwaitDrained, AwaitSynced, ControllerRef, GetCounts};
use crate::protocol::lead::{LeadRef, Progress, UpdateLine};
use crate::protocol::pool::{AwaitBatch, PoolBatch, PoolRef, TakeBatch};
use crate::protocol::trainer::{SaveState, TrainAndPublish};
use refit_runtime::topology::CheckpointSection;

use super::checkpoint::{self, RunState};
use super::ids::RANK_LOG;
use super::{ModelReport, StopRule, UpdateRecord};

/// Everything one model's driver talks to.
pub(crate) struct Driver {
    pub(crate) model: ModelId,
    /// The model's trainer (one rank's, or shard 0 of a sharded trainer).
    pub(crate) trainer: Recipient<TrainAndPublish>,
    /// The version the trainer published first (the run's version 1, or the one after the
    /// checkpoint it resumed from).
    pub(crate) first: Version,
    /// Where and how often the trainer's state is saved (`[checkpoint]`).
    pub(crate) checkpoints: Option<Checkpoints>,
    pub(crate) pool: PoolRef,
    pub(crate) controller: ControllerRef,
    pub(crate) notifier: VersionNotifier,
    pub(crate) lead: LeadRef,
    pub(crate) mode: SyncMode,
    /// The staleness the model's pool allows (for the update's line).
    pub(crate) allowed_staleness: Option<u64>,
    pub(crate) stop: StopRule,
    /// Deadline of a blocked step (a batch, a drain).
    pub(crate) wait: Duration,
    /// Deadline of a call whose answer waits on the controller (a barrier round, a load).
    pub(crate) call: Duration,
    pub(crate) started: Instant,
}

/// A run's checkpoints of one model: the section, and the trainer's state.
pub(crate) struct Checkpoints {
    /// `[checkpoint]`.
    pub(crate) cfg: CheckpointSection,
    /// The trainer's whole state.
    pub(crate) save: Recipient<SaveState>,
}

/// How long a signal's checkpoint waits for the trainer's state (within the release
/// bound of a signalled process).
const SIGNAL_SAVE_WAIT: Duration = Duration::from_secs(2);

/// Asks the trainer for its state from a plain thread (the signal's), and writes it.
fn save_now(
    cfg: &CheckpointSection,
    save: &Recipient<SaveState>,
    model: &ModelId,
) -> Result<std::path::PathBuf> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| Error::Actor(format!("a runtime to save the checkpoint: {e}")))?;
    let state = rt
        .block_on(async { tokio::time::timeout(SIGNAL_SAVE_WAIT, save.send(SaveState)).await })
        .map_err(|_| {
            Error::Actor(format!(
                "the trainer gave no state within {SIGNAL_SAVE_WAIT:?}"
            ))
        })?
        .map_err(|e| Error::Actor(format!("the trainer: {e}")))??;
    checkpoint::write(cfg, model, &state)
}

/// A request to one of `model`'s actors (`what`) that got no answer.
fn unanswered(model: &ModelId, what: &str, e: MailboxError, after: Duration) -> Error {
    Error::unanswered(e, after, format!("the {what} of model `{model}`"))
}

/// What rank 0's log line says of the update `record` (its held-out score is added once
/// validation answered).
fn update_line(record: &UpdateRecord, generated: bool, allowed: Option<u64>) -> UpdateLine {
    UpdateLine {
        generated,
        samples: record.frames as u64,
        max_staleness: record.max_staleness,
        dropped: record.dropped,
        allowed_staleness: allowed,
        train_ms: record.train.as_millis() as u64,
        // the trainer's publish through its outlet (not reported by a sharded trainer)
        publish_ms: record
            .learn
            .get(crate::LearnStats::PUBLISH_S)
            .map(|s| s * 1e3),
        held_out: None,
    }
}

/// Counts a batch into the report (its episodes and frames, the staleness totals, the
/// fragments evicted) and its returns into `last20`, the returns the mean is taken over (a
/// batch of completions, `generated`, is its own); answers that mean.
fn tally(
    report: &mut ModelReport,
    last20: &mut VecDeque<f64>,
    pb: &PoolBatch,
    generated: bool,
) -> f64 {
    if generated {
        // a batch of completions: its own mean reward
        last20.clear();
    }
    for e in &pb.batch.episodes {
        if !generated && last20.len() == 20 {
            last20.pop_front();
        }
        last20.push_back(e.ret);
    }
    report.episodes += pb.batch.episodes.len() as u64;
    report.frames += pb.batch.frames as u64;
    let mean_return = mean(last20);
    report.mean_return = mean_return;
    report.staleness = pb.totals.clone();
    report.evicted += pb.evicted;
    mean_return
}

/// The mean of the last (up to) 20 values.
fn mean(values: &VecDeque<f64>) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

impl Driver {
    /// Runs the driver to the end; answers the model's report.
    ///
    /// # Errors
    /// The first failure of the pool, trainer, controller or lead (named by model), a
    /// deadline passed.
    pub(crate) async fn run(mut self) -> Result<ModelReport> {
        let model = self.model.clone();
        let mut version = self.first;
        // SIGTERM (a preempted job, a scheduler's stop) saves the state first
        let _on_signal = self.checkpoint_on_signal();
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
        let call = self.call;
        loop {
            if self.mode == SyncMode::Sync {
                self.await_on_policy(version).await?;
            }
            let pb = self.take_batch(version).await?;
            let generated = !pb.batch.sequences.is_empty();
            let mean_return = tally(&mut report, &mut last20, &pb, generated);
            // one span per weight update: training, publishing, and the controller's round
            let span = tracing::info_span!(
                "weight_update",
                model = %model,
                from = %version,
                to = tracing::field::Empty
            );
            let record = self
                .train(pb, version, &span, report.frames, mean_return)
                .await?;
            let mut update = update_line(&record, generated, self.allowed_staleness);
            let sample_versions = record.sample_versions;
            version = record.published;
            report.updates.push(record);
            if let Some(eval) = self
                .notifier
                .notify(version)
                .instrument(span)
                .await?
                .and_then(|o| o.eval)
            {
                update.held_out = eval.models.get(&model).map(|m| m.mean_return);
                report.evals.push(eval);
            }
            self.checkpoint(version).await?;
            let solved = self.stop.solved(&model, &last20, generated, &report.evals);
            // counted from the run's version 1: a resumed run goes on to the same budget
            let out_of_budget = version.0.saturating_sub(1) >= self.stop.max_updates
                || self.started.elapsed() >= self.stop.max_time;
            let stop_at = self
                .lead
                .progress
                .send(Progress {
                    model: model.clone(),
                    version,
                    solved,
                    out_of_budget,
                    mean_return,
                    sample_versions,
                    update,
                })
                .timeout(call)
                .await
                .map_err(|e| unanswered(&model, "run's lead", e, call))?;
            if stop_at.is_some_and(|s| version >= s) {
                break;
            }
        }
        self.notifier.flush().await?;
        // The run ends when its last version serves everywhere.
        self.controller
            .await_synced
            .send(AwaitSynced {
                model: model.clone(),
                version,
            })
            .timeout(call)
            .await
            .map_err(|e| unanswered(&model, "controller (last version)", e, call))??;
        Ok(report)
    }

    /// Saves the trainer's state as `version`'s checkpoint when `[checkpoint] every`
    /// divides it (the file written on a blocking thread, the older ones pruned).
    ///
    /// # Errors
    /// The trainer's refusal (a learner without checkpoints), a file that cannot be
    /// written: the run stops rather than go on without the checkpoints it was told to keep.
    async fn checkpoint(&self, version: Version) -> Result<()> {
        let Some(c) = &self.checkpoints else {
            return Ok(());
        };
        if !version.0.is_multiple_of(c.cfg.every) {
            return Ok(());
        }
        let started = Instant::now();
        let state = c
            .save
            .send(SaveState)
            .timeout(self.call)
            .await
            .map_err(|e| unanswered(&self.model, "trainer (its state)", e, self.call))??;
        let (cfg, model) = (c.cfg.clone(), self.model.clone());
        let bytes = state.bytes().len();
        let path = actix_rt::task::spawn_blocking(move || checkpoint::write(&cfg, &model, &state))
            .await
            .map_err(|e| Error::Actor(format!("the checkpoint thread failed: {e}")))??;
        self.save_run_state(&c.cfg, version).await;
        tracing::info!(target: RANK_LOG,
            "model `{}` v{version}: checkpoint {} ({}) in {:.0} ms",
            self.model,
            path.display(),
            refit_runtime::units::bytes(bytes as u64),
            started.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }

    /// Writes what the controller counted of the model beside `version`'s checkpoint (a
    /// resumed run's counts go on from it). A controller that does not answer, or a file
    /// that cannot be written, is logged: the checkpoint stays usable, its counts start
    /// from zero when resumed.
    async fn save_run_state(&self, cfg: &CheckpointSection, version: Version) {
        let status = match self
            .controller
            .counts
            .send(GetCounts)
            .timeout(self.call)
            .await
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(target: RANK_LOG,
                    "model `{}` v{version}: no run state beside the checkpoint: the controller: {e}",
                    self.model);
                return;
            }
        };
        let Some(model) = status.models.get(&self.model) else {
            return;
        };
        let state = RunState {
            format: RunState::FORMAT,
            model: self.model.to_string(),
            version: version.0,
            evals: status.evals,
            status: model.clone(),
        };
        if let Err(e) = checkpoint::write_state(&cfg.dir, &self.model, &state) {
            tracing::warn!(target: RANK_LOG, "model `{}` v{version}: {e}", self.model);
        }
    }

    /// With checkpoints: an action that saves the trainer's state as its version's
    /// checkpoint when SIGINT or SIGTERM ends the process (after the update in progress:
    /// the trainer takes messages one at a time), within [`SIGNAL_SAVE_WAIT`].
    fn checkpoint_on_signal(&self) -> Option<refit_runtime::cleanup::ExitGuard> {
        let c = self.checkpoints.as_ref()?;
        let (cfg, save, model) = (c.cfg.clone(), c.save.clone(), self.model.clone());
        Some(refit_runtime::cleanup::on_exit_signal(
            move || match save_now(&cfg, &save, &model) {
                Ok(path) => tracing::info!(target: RANK_LOG,
                    "model `{model}`: checkpoint {} on the way out", path.display()),
                Err(e) => tracing::warn!(target: RANK_LOG,
                    "model `{model}`: no checkpoint on the way out: {e}"),
            },
        ))
    }

    /// How long a message that waits for a batch may go unanswered: a batch waits at most
    /// `wait`; the message's own deadline allows for the reply.
    fn slack(&self) -> Duration {
        self.wait + Duration::from_secs(5)
    }

    /// Sync mode, before each batch: waits for every fragment admitted under `version`, then
    /// for the controller to drain the model.
    async fn await_on_policy(&self, version: Version) -> Result<()> {
        let (model, wait, call, slack) = (&self.model, self.wait, self.call, self.slack());
        // Every fragment admitted under this version is on-policy: wait for them all.
        self.pool
            .await_batch
            .send(AwaitBatch {
                train_version: version,
                timeout: wait,
            })
            .timeout(slack)
            .await
            .map_err(|e| unanswered(model, "pool", e, slack))??;
        self.controller
            .await_drained
            .send(AwaitDrained {
                model: model.clone(),
            })
            .timeout(call)
            .await
            .map_err(|e| unanswered(model, "controller (drain)", e, call))??;
        Ok(())
    }

    /// The next batch from the pool to train `version` on (in sync mode, all it holds).
    async fn take_batch(&self, version: Version) -> Result<PoolBatch> {
        let slack = self.slack();
        self.pool
            .take
            .send(TakeBatch {
                train_version: version,
                all: self.mode == SyncMode::Sync,
                timeout: self.wait,
            })
            .timeout(slack)
            .await
            .map_err(|e| unanswered(&self.model, "pool", e, slack))?
    }

    /// Trains `version` on the batch and publishes the next, in `span` (which records the
    /// version published); answers the update's record. `frames` (the run's so far) and
    /// `mean_return` go to the debug line.
    async fn train(
        &self,
        pb: PoolBatch,
        version: Version,
        span: &tracing::Span,
        frames: u64,
        mean_return: f64,
    ) -> Result<UpdateRecord> {
        let slack = self.slack();
        let sample_versions = pb.batch.version_range().unwrap_or((version, version));
        let batch_frames = pb.batch.frames;
        let mixed = pb
            .batch
            .sequences
            .iter()
            .filter(|s| s.spans_versions())
            .count();
        let update_started = Instant::now();
        let (stats, published) = self
            .trainer
            .send(TrainAndPublish { batch: pb.batch })
            .timeout(slack)
            .instrument(span.clone())
            .await
            .map_err(|e| unanswered(&self.model, "trainer", e, slack))??;
        span.record("to", tracing::field::display(published));
        let train_ms = update_started.elapsed().as_millis() as u64;
        span.in_scope(|| {
            tracing::debug!(
                frames,
                mean_return = format_args!("{mean_return:.3}"),
                max_staleness = pb.max_staleness,
                dropped = pb.dropped,
                train_ms,
                "trained and published"
            );
        });
        Ok(UpdateRecord {
            train_version: version,
            published,
            frames: batch_frames,
            sample_versions,
            max_staleness: pb.max_staleness,
            dropped: pb.dropped,
            evicted: pb.evicted,
            fragments: pb.fragments,
            mean_return,
            elapsed: self.started.elapsed(),
            train: Duration::from_millis(train_ms),
            learn: stats,
            mixed,
        })
    }
}
