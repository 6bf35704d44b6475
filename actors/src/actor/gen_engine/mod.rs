//! The generating engine actor: serves [`Generate`] requests for one or several models with
//! continuous batching, each model decoded by a [`Scheduler`] on its own thread.
//!
//! A load ([`UpdateModel`], or [`LoadWeights`] for weights pushed by the caller) runs beside
//! generation: the bytes are fetched through the model's [`WeightInlet`] and staged by the
//! model's [`Generator::stage`] on a blocking thread (conversion included), then the staged
//! version is offered to the decoding thread, which swaps it in at a step boundary as the
//! engine's [`PauseMode`] says; only then is the version acknowledged through the inlet (an
//! ack means served) and the [`LoadReport`] answered. A version that fails to fetch or stage
//! is answered with the error; the old one keeps generating. Loads of one model are
//! serialised; loads of different models overlap.
//!
//! The engine answers the whole engine protocol ([`crate::protocol::engine`]):
//! [`CancelInFlight`], [`ServedVersions`] and [`GetEngineStats`] as the acting engine does,
//! so a controller drives it through an [`EngineRef`](crate::protocol::EngineRef)
//! unchanged; an `ActBatch` (observations) is refused, naming the model.

mod decode_loop;
mod load;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::{ModelId, Version, WeightSet};
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::generation::{Completion, Generator, PauseMode};
use crate::link::WeightInlet;
use crate::scheduler::{Scheduler, SchedulerConfig, SchedulerStats};

use crate::protocol::engine::{
    ActBatch, ActedBatch, CancelInFlight, EngineStats, Generate, GetEngineStats, LoadReport,
    LoadWeights, ServedVersions, UpdateModel,
};
use decode_loop::{Command, Commands, Shared};
use load::{LoadJob, Source};

/// Asks a generating engine where each model's decoding stands.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "BTreeMap<ModelId, GenModelStatus>")]
pub struct GetGenStatus;

/// Where one model's decoding stands (as of its decoding thread's last step).
#[derive(Debug, Clone, PartialEq)]
pub struct GenModelStatus {
    /// The version served (`None` before the first weights).
    pub served: Option<Version>,
    /// The newest version handed to the decoding thread; newer than `served` while it
    /// waits for its step boundary (a `wait`-mode drain).
    pub offered: Option<Version>,
    /// Sequences in the running batch.
    pub running: usize,
    /// Requests waiting to join.
    pub waiting: usize,
    /// The scheduler's counters.
    pub stats: SchedulerStats,
}

/// One model of a generating engine, builder style.
pub struct GenModel<G> {
    id: ModelId,
    generator: G,
    stager: G,
    inlet: Option<Box<dyn WeightInlet>>,
    initial: Option<Arc<WeightSet>>,
    max_batch: usize,
}

impl<G> std::fmt::Debug for GenModel<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenModel")
            .field("id", &self.id)
            .field("inlet", &self.inlet.is_some())
            .field("initial", &self.initial.as_ref().map(|w| w.version()))
            .field("max_batch", &self.max_batch)
            .finish()
    }
}

impl<G: Generator> GenModel<G> {
    /// Model `id`, decoded by `generator`; `stager` (a second instance of the same model,
    /// e.g. from a second call of `GenRoles::generator`) stages new versions on a thread
    /// beside the decoding one, so a load never waits for a step and a step never waits
    /// for a load. Batches of at most 64 sequences; no weights until the first load.
    pub fn new(id: ModelId, generator: G, stager: G) -> Self {
        Self {
            id,
            generator,
            stager,
            inlet: None,
            initial: None,
            max_batch: 64,
        }
    }

    /// Fed through `inlet` ([`UpdateModel`] loads through it).
    #[must_use]
    pub fn inlet(mut self, inlet: Box<dyn WeightInlet>) -> Self {
        self.inlet = Some(inlet);
        self
    }

    /// Serves `weights` from the start (staged when the model is added).
    #[must_use]
    pub fn initial(mut self, weights: Arc<WeightSet>) -> Self {
        self.initial = Some(weights);
        self
    }

    /// Decodes at most `n` sequences per step.
    #[must_use]
    pub fn max_batch(mut self, n: usize) -> Self {
        self.max_batch = n;
        self
    }
}

/// What a load holds while it runs: one at a time per model.
struct Loader<G> {
    stager: G,
    inlet: Option<Box<dyn WeightInlet>>,
}

struct Slot<G: Generator> {
    commands: Commands<G::Weights>,
    shared: Arc<Shared>,
    loader: Arc<tokio::sync::Mutex<Loader<G>>>,
}

/// Serves [`Generate`] for one or several models; see the [module documentation](self).
pub struct GenerationEngine<G: Generator> {
    models: BTreeMap<ModelId, Slot<G>>,
    mode: PauseMode,
    generation: u64,
    push_timeout: Duration,
    /// Staging time and refused requests (the decoding threads count the rest).
    stats: EngineStats,
}

impl<G: Generator> std::fmt::Debug for GenerationEngine<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let versions: BTreeMap<_, _> = self
            .models
            .iter()
            .map(|(m, s)| (m, s.shared.served()))
            .collect();
        f.debug_struct("GenerationEngine")
            .field("mode", &self.mode)
            .field("versions", &versions)
            .field("generation", &self.generation)
            .finish()
    }
}

impl<G: Generator> GenerationEngine<G> {
    /// An engine with no model yet, swapping versions as `mode` says (the run's pause mode).
    pub fn new(mode: PauseMode) -> Self {
        Self {
            models: BTreeMap::new(),
            mode,
            generation: 0,
            push_timeout: Duration::from_secs(60),
            stats: EngineStats::default(),
        }
    }

    /// The deadline of a [`LoadWeights`] (which carries none): staging plus the wait for
    /// the swap's boundary (60 s unless set).
    #[must_use]
    pub fn push_timeout(mut self, timeout: Duration) -> Self {
        self.push_timeout = timeout;
        self
    }

    /// The pause mode.
    pub fn mode(&self) -> PauseMode {
        self.mode
    }

    /// Adds a model and starts its decoding thread.
    ///
    /// # Errors
    /// [`Error::Config`] naming the model: added twice, a stager that is not the same model
    /// as the generator (layout, vocabulary, context), a batch size of zero, a thread that
    /// cannot start; the initial weights' staging error.
    pub fn with_model(mut self, model: GenModel<G>) -> Result<Self> {
        let GenModel {
            id,
            generator,
            stager,
            inlet,
            initial,
            max_batch,
        } = model;
        if self.models.contains_key(&id) {
            return Err(Error::Config(format!(
                "model `{id}` is served twice by one engine"
            )));
        }
        let (g, s) = (generator.manifest(), stager.manifest());
        if g.schema_hash() != s.schema_hash()
            || generator.vocab_size() != stager.vocab_size()
            || generator.max_context() != stager.max_context()
        {
            return Err(Error::Config(format!(
                "model `{id}`: the stager is not the same model as the generator (layout, \
                 vocabulary or context differ)"
            )));
        }
        let initial = match initial {
            Some(ws) => Some((Arc::new(stager.stage(&ws)?), ws.version())),
            None => None,
        };
        let cfg = SchedulerConfig::new(id.clone(), max_batch, self.mode);
        let mut scheduler = Scheduler::new(generator, cfg)?;
        if let Some((w, v)) = initial {
            scheduler = scheduler.with_weights(w, v);
        }
        let (commands, shared) = decode_loop::spawn(&id, scheduler)?;
        let loader = Arc::new(tokio::sync::Mutex::new(Loader { stager, inlet }));
        self.models.insert(
            id,
            Slot {
                commands,
                shared,
                loader,
            },
        );
        Ok(self)
    }

    fn slot(&self, model: &ModelId) -> Result<&Slot<G>> {
        self.models
            .get(model)
            .ok_or_else(|| Error::Runtime(refit_runtime::Error::UnknownModel(model.clone())))
    }

    fn job(&self, model: &ModelId) -> Result<LoadJob<G>> {
        let slot = self.slot(model)?;
        Ok(LoadJob {
            model: model.clone(),
            commands: slot.commands.clone(),
            shared: Arc::clone(&slot.shared),
            loader: Arc::clone(&slot.loader),
        })
    }
}

fn loop_gone(model: &ModelId) -> Error {
    Error::Actor(format!(
        "the decoding thread of model `{model}` is gone (it panicked or the engine stopped)"
    ))
}

impl<G: Generator> Actor for GenerationEngine<G> {
    type Context = Context<Self>;
}

impl<G: Generator> Handler<Generate> for GenerationEngine<G> {
    type Result = ResponseFuture<Result<Completion>>;

    fn handle(&mut self, msg: Generate, _: &mut Context<Self>) -> Self::Result {
        if msg.generation.is_some_and(|g| g != self.generation) {
            self.stats.cancelled += 1;
            let generation = self.generation;
            return Box::pin(async move { Err(Error::Cancelled { generation }) });
        }
        let commands = match self.slot(&msg.model) {
            Ok(s) => s.commands.clone(),
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        let Generate {
            model,
            prompt,
            params,
            generation,
        } = msg;
        let (reply, answer) = oneshot::channel();
        let sent = commands.send(Command::Submit {
            prompt,
            params,
            generation,
            reply,
        });
        Box::pin(async move {
            sent.map_err(|_| loop_gone(&model))?;
            answer.await.map_err(|_| loop_gone(&model))?
        })
    }
}

impl<G: Generator> Handler<UpdateModel> for GenerationEngine<G> {
    type Result = ResponseActFuture<Self, Result<LoadReport>>;

    fn handle(&mut self, msg: UpdateModel, _: &mut Context<Self>) -> Self::Result {
        let job = match self.job(&msg.model) {
            Ok(j) => j,
            Err(e) => return Box::pin(fut::ready(Err(e))),
        };
        let source = Source::Inlet {
            version: msg.version,
        };
        Box::pin(
            job.run(source, msg.timeout)
                .into_actor(self)
                .map(|(report, staged), act, _| {
                    act.stats.staged_total += staged;
                    report
                }),
        )
    }
}

impl<G: Generator> Handler<LoadWeights> for GenerationEngine<G> {
    type Result = ResponseActFuture<Self, Result<Version>>;

    fn handle(&mut self, msg: LoadWeights, _: &mut Context<Self>) -> Self::Result {
        let job = match self.job(msg.weights.model()) {
            Ok(j) => j,
            Err(e) => return Box::pin(fut::ready(Err(e))),
        };
        Box::pin(
            job.run(Source::Pushed(msg.weights), self.push_timeout)
                .into_actor(self)
                .map(|(report, staged), act, _| {
                    act.stats.staged_total += staged;
                    report.map(|r| r.version)
                }),
        )
    }
}

impl<G: Generator> Handler<CancelInFlight> for GenerationEngine<G> {
    type Result = u64;

    /// Requests of older generations are refused from now on; the decoding threads end the
    /// ones they hold at their next step boundary (before any load sent after this).
    fn handle(&mut self, _: CancelInFlight, _: &mut Context<Self>) -> u64 {
        self.generation += 1;
        for (model, slot) in &self.models {
            let below = self.generation;
            if slot.commands.send(Command::Cancel { below }).is_err() {
                tracing::warn!(model = %model, "cancel: {}", loop_gone(model));
            }
        }
        self.generation
    }
}

impl<G: Generator> Handler<ServedVersions> for GenerationEngine<G> {
    type Result = MessageResult<ServedVersions>;

    /// Version 0 for a model with no weights yet.
    fn handle(&mut self, _: ServedVersions, _: &mut Context<Self>) -> Self::Result {
        MessageResult(
            self.models
                .iter()
                .map(|(m, s)| (m.clone(), s.shared.served().unwrap_or(Version::ZERO)))
                .collect(),
        )
    }
}

impl<G: Generator> Handler<GetEngineStats> for GenerationEngine<G> {
    type Result = MessageResult<GetEngineStats>;

    fn handle(&mut self, _: GetEngineStats, _: &mut Context<Self>) -> Self::Result {
        let mut out = self.stats.clone();
        for slot in self.models.values() {
            let s = slot.shared.stats();
            out.loads += s.swaps;
            out.paused_total += s.paused_total;
            out.paused_max = out.paused_max.max(s.paused_max);
            out.drained_total += s.drained_total;
            out.cancelled += s.cancelled;
            out.tokens += s.tokens;
            out.aborted += s.aborted;
        }
        MessageResult(out)
    }
}

impl<G: Generator> Handler<GetGenStatus> for GenerationEngine<G> {
    type Result = MessageResult<GetGenStatus>;

    fn handle(&mut self, _: GetGenStatus, _: &mut Context<Self>) -> Self::Result {
        MessageResult(
            self.models
                .iter()
                .map(|(m, s)| (m.clone(), s.shared.status()))
                .collect(),
        )
    }
}

impl<G: Generator> Handler<ActBatch> for GenerationEngine<G> {
    type Result = Result<ActedBatch>;

    fn handle(&mut self, msg: ActBatch, _: &mut Context<Self>) -> Self::Result {
        Err(Error::Config(format!(
            "model `{}`: this engine generates completions for prompts (Generate), not \
             actions for observations (ActBatch); serve an acting model with an acting engine",
            msg.model
        )))
    }
}
