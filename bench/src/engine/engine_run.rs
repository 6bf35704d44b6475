//! One engine of the bench: a generating engine fed over one link in one pause mode, its
//! updates timed while clients keep requests decoding.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_rl::transformer::{TransformerConfig, TransformerGenerator};
use refit_runtime::convert::{Conversions, ConvertingSender};
use refit_runtime::{Manifests, ModelId, PendingSend, SenderTransport, Version, WeightSet};
use refit_transports::link::{self, LinkOptions, OpenedLink};

use super::clients::{self, Clients, Engine};
use super::transport::connect_pair;
use super::{PauseBenchConfig, VOCAB, WAIT, model_id};
use refit_actors::actor::{GenModel, GenerationEngine};
use refit_actors::generation::PauseMode;
use refit_actors::protocol::engine::UpdateModel;
use refit_actors::{Error, Result};

/// One engine's updates.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineFigures {
    /// The link's name.
    pub link: String,
    /// The engine's pause mode.
    pub mode: PauseMode,
    /// Requests the clients kept decoding.
    pub requests: usize,
    /// Each timed update.
    pub updates: Vec<UpdateFigures>,
    /// Requests the clients completed during the run (aborted and cancelled ones count).
    pub completed: u64,
}

impl EngineFigures {
    /// One figure of every update.
    pub fn each<T>(&self, f: impl Fn(&UpdateFigures) -> T) -> Vec<T> {
        self.updates.iter().map(f).collect()
    }
}

/// One update of an engine.
#[derive(Clone, Debug, PartialEq)]
pub struct UpdateFigures {
    /// The version loaded.
    pub version: Version,
    /// [`LoadReport::paused`](refit_actors::protocol::engine::LoadReport::paused): the swap at a
    /// step boundary, the time no token was produced because of the update.
    pub paused: Duration,
    /// [`LoadReport::staged`](refit_actors::protocol::engine::LoadReport::staged): fetching and
    /// staging the version, beside generation.
    pub staged: Duration,
    /// The whole load, from [`UpdateModel`] sent to its answer (staging, the wait for the
    /// step boundary, wait mode's drain, the acknowledgement).
    pub load: Duration,
    /// The trainer's publish: the conversion to the engine's layout and the link's publish.
    pub publish: Duration,
    /// The conversion alone (the converting sender's clock).
    pub convert: Duration,
    /// The mean decoding step before the update (no load running).
    pub step: Duration,
    /// The mean decoding step during the load (staging shares the machine).
    pub step_in_load: Option<Duration>,
    /// Sequences running when the load was asked.
    pub running: usize,
    /// Sequences the swap aborted (abort mode).
    pub aborted: u64,
    /// Wait mode's drain (decoding under the old version until the running sequences end).
    pub drained: Duration,
    /// Tokens generated during the load.
    pub tokens_in_load: u64,
}

type TrainerSender = refit_runtime::Sender<ConvertingSender<Box<dyn SenderTransport>>>;

/// What one engine of the bench is made of.
pub(super) struct EngineRun<'a> {
    pub(super) link: &'a str,
    pub(super) mode: PauseMode,
    pub(super) shape: TransformerConfig,
    pub(super) conversions: &'a Conversions,
    pub(super) cfg: &'a PauseBenchConfig,
}

impl EngineRun<'_> {
    /// Runs the engine with the trainer's weights (updated in place, version after
    /// version) and hands them back.
    pub(super) fn measure(
        &self,
        trainer: Arc<WeightSet>,
    ) -> Result<(EngineFigures, Arc<WeightSet>)> {
        let what = format!(
            "engine pause bench ({} MiB over {}, {} mode)",
            (self.shape.params() * 2) >> 20,
            self.link,
            self.mode
        );
        let options = LinkOptions {
            expected_receivers: 1,
            ..LinkOptions::default()
        };
        let wire = self.conversions.target();
        let opened = link::open(self.link, wire, &options)?;
        let leftovers = opened.leftovers.clone();
        let result = actix_rt::System::new().block_on(self.on_system(opened, trainer));
        OpenedLink::cleanup(&leftovers);
        result.map_err(|e| Error::Actor(format!("{what}: {e}")))
    }

    async fn on_system(
        &self,
        opened: OpenedLink,
        trainer: Arc<WeightSet>,
    ) -> Result<(EngineFigures, Arc<WeightSet>)> {
        let model = model_id()?;
        let source = self.conversions.source().clone();
        let wire: Manifests = self.conversions.target().clone();
        let sender = ConvertingSender::new(opened.sender, self.conversions.clone());
        let initial = trainer.view_as(trainer.version())?;
        let (link, spec) = (self.link.to_owned(), opened.spec);
        let (sender, receiver) =
            blocking(move || connect_pair(&link, sender, &spec, source, &wire, initial)).await?;
        let engine = GenerationEngine::new(self.mode).with_model(
            GenModel::new(
                model.clone(),
                TransformerGenerator::new(self.shape, self.cfg.threads)?,
                TransformerGenerator::new(self.shape, self.cfg.threads)?,
            )
            .inlet(Box::new(receiver))
            .max_batch(self.cfg.requests),
        )?;
        let arbiter = Arbiter::new();
        let engine = GenerationEngine::start_in_arbiter(&arbiter.handle(), move |_| engine);
        let result = self.updates(&engine, &model, sender, trainer).await;
        drop(engine);
        arbiter.stop();
        blocking(move || {
            arbiter
                .join()
                .map_err(|_| Error::Actor("the engine's arbiter panicked".into()))
        })
        .await?;
        result
    }

    async fn updates(
        &self,
        engine: &Engine,
        model: &ModelId,
        mut sender: TrainerSender,
        mut trainer: Arc<WeightSet>,
    ) -> Result<(EngineFigures, Arc<WeightSet>)> {
        let cfg = self.cfg;
        // the first version, as a run's first load
        let first = UpdateModel {
            model: model.clone(),
            version: trainer.version(),
            timeout: WAIT,
        };
        clients::within("the first load", engine.send(first)).await??;
        let clients = Clients::start(engine, model, cfg.requests, cfg.max_tokens, VOCAB);
        let mut figures = EngineFigures {
            link: self.link.to_owned(),
            mode: self.mode,
            requests: cfg.requests,
            updates: Vec::with_capacity(cfg.updates),
            completed: 0,
        };
        let measured = async {
            for i in 0..cfg.warmup + cfg.updates {
                let (u, s, t) = self.one_update(engine, model, sender, trainer).await?;
                (sender, trainer) = (s, t);
                if i >= cfg.warmup {
                    figures.updates.push(u);
                }
            }
            Ok::<_, Error>((sender, trainer))
        }
        .await;
        let stopped = clients.stop(engine).await;
        let (sender, trainer) = measured?;
        figures.completed = stopped?;
        blocking(move || Ok(sender.shutdown()?)).await?;
        Ok((figures, trainer))
    }

    /// One update: requests running, a step timed, the next version published by the
    /// trainer, then loaded by the engine.
    async fn one_update(
        &self,
        engine: &Engine,
        model: &ModelId,
        sender: TrainerSender,
        trainer: Arc<WeightSet>,
    ) -> Result<(UpdateFigures, TrainerSender, Arc<WeightSet>)> {
        clients::wait_running(engine, model, self.cfg.requests).await?;
        let step = clients::step_time(engine, model).await?;
        let (mut sender, trainer, pending, publish) =
            blocking(move || publish_next(sender, trainer)).await?;
        let convert = sender.transport().stats().last;
        let version = trainer.version();
        // the status that showed the requests running: read again, it may find them all
        // finished between the two reads
        let before = clients::wait_running(engine, model, self.cfg.requests).await?;
        let stats_before = clients::stats(engine).await?;
        let asked = Instant::now();
        let ask = UpdateModel {
            model: model.clone(),
            version,
            timeout: WAIT,
        };
        let report = clients::within("a load", engine.send(ask)).await??;
        let load = asked.elapsed();
        let after = clients::status(engine, model).await?;
        let stats_after = clients::stats(engine).await?;
        if report.version != version || after.served != Some(version) {
            return Err(Error::Actor(format!(
                "asked to load version {version}, the engine loaded {} and serves {:?}",
                report.version, after.served
            )));
        }
        if before.running == 0 {
            return Err(Error::Actor(format!(
                "no request was decoding when version {version} was asked"
            )));
        }
        sender = blocking(move || {
            sender.wait(&pending, WAIT)?;
            Ok(sender)
        })
        .await?;
        let steps = after.stats.steps - before.stats.steps;
        let figures = UpdateFigures {
            version,
            paused: report.paused,
            staged: report.staged,
            load,
            publish,
            convert,
            step,
            step_in_load: u32::try_from(steps)
                .ok()
                .filter(|&n| n > 0)
                .map(|n| load / n),
            running: before.running,
            aborted: stats_after.aborted - stats_before.aborted,
            drained: stats_after.drained_total - stats_before.drained_total,
            tokens_in_load: after.stats.tokens - before.stats.tokens,
        };
        Ok((figures, sender, trainer))
    }
}

/// The trainer's next version: one value of every tensor changed, the version stamped,
/// published through the converting sender; answers the time of the publish.
fn publish_next(
    mut sender: TrainerSender,
    mut trainer: Arc<WeightSet>,
) -> Result<(TrainerSender, Arc<WeightSet>, PendingSend, Duration)> {
    // 1e-3 on the first value: the bf16 on the link keeps it for the small weights (a change
    // in the lowest byte of an f32 never survives the cast, and a TCP delta would move
    // nothing; a norm weight at 1.0 changes on the link every few versions)
    let next = crate::links::next_version::<f32>(&mut trainer, |x, _| *x += 1e-3)?;
    let version = trainer.view_as(next)?;
    let t = Instant::now();
    let pending = sender.publish_shared(vec![Arc::new(version)])?;
    let publish = t.elapsed();
    Ok((sender, trainer, pending, publish))
}

/// `f` on a blocking thread of the system.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    actix_rt::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Actor(format!("a blocking task of the bench failed: {e}")))?
}
