//! The generating engine actor: serves [`Generate`] requests for one or several models with
//! continuous batching, each model decoded by a [`Scheduler`] on its own thread.
//!
//! A load ([`UpdateModel`](crate::protocol::engine::UpdateModel), or [`LoadWeights`] for weights pushed by the caller) runs beside
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
mod verify;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_runtime::topology::Verify;
use refit_runtime::{ModelId, Version, WeightSet};
use tokio::sync::oneshot;

use crate::actor::verify::{Damage, ServedHashes};
use crate::error::{Error, Result};
use crate::generation::{Completion, Generator, PauseMode};
use crate::link::WeightInlet;
use crate::scheduler::{Scheduler, SchedulerConfig, SchedulerStats};

use super::staging::{Holds, StagedEngine, StagingFuture, weight_plane_handlers};
use crate::protocol::engine::{
    CancelInFlight, EngineStats, Generate, GetEngineStats, LoadReport, LoadWeights, Score,
    ServedVersions,
};
use decode_loop::{Command, Commands, Shared};
use load::{Held, LoadJob, Source};

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
    stager: Option<G>,
    inlet: Option<Box<dyn WeightInlet>>,
    initial: Option<Arc<WeightSet>>,
    max_batch: usize,
    follows: Option<(ModelId, u64)>,
    verify: Verify,
}

impl<G> std::fmt::Debug for GenModel<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenModel")
            .field("id", &self.id)
            .field("inlet", &self.inlet.is_some())
            .field("initial", &self.initial.as_ref().map(|w| w.version()))
            .field("max_batch", &self.max_batch)
            .field("follows", &self.follows)
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
            stager: Some(stager),
            inlet: None,
            initial: None,
            max_batch: 64,
            follows: None,
            verify: Verify::Off,
        }
    }

    /// Model `id`, a reference that follows model `of` of the same engine: it serves `of`'s
    /// staged weights (the same memory: nothing is fetched or staged again) from `of`'s
    /// first version on, refreshed at the first of `of`'s versions that is at least `every`
    /// versions past the one it serves. It has no loads of its own; it answers
    /// [`Generate`] and [`Score`] like any model (a KL reference scores completions).
    pub fn follower(id: ModelId, generator: G, of: ModelId, every: u64) -> Self {
        Self {
            id,
            generator,
            stager: None,
            inlet: None,
            initial: None,
            max_batch: 64,
            follows: Some((of, every.max(1))),
            verify: Verify::Off,
        }
    }

    /// Fed through `inlet` ([`UpdateModel`](crate::protocol::engine::UpdateModel) loads through it).
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

    /// Verifies what the model serves at `level` (a topology's `verify`): from `startup`, a
    /// corrupt-then-restore self-test at its first version (a copy with every element
    /// changed is staged and read back through [`Generator::export`], then the version:
    /// a tensor the staging does not carry fails that load, naming it); at `hashes`, each
    /// version staged is read back against its bytes (a staging that did not land whole
    /// fails), and the weights served are read back again at the next version (a change is
    /// reported by that load's [`LoadReport::damaged`]). A follower serves its leader's
    /// weights and verifies nothing of its own.
    #[must_use]
    pub fn verify(mut self, level: Verify) -> Self {
        self.verify = level;
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
struct Loader<G: Generator> {
    /// `None` for a follower (it never stages).
    stager: Option<G>,
    inlet: Option<Box<dyn WeightInlet>>,
    /// The model's `verify` from `startup` on.
    verify: Option<ServedHashes>,
    /// With `verify`: the weights served (swapped in by the last load).
    served: Option<(Arc<G::Weights>, Version)>,
    /// With `verify = "hashes"`: how the weights served differed from their version,
    /// found by this load's staging and reported by its commit.
    damaged: Option<Damage>,
}

struct Slot<G: Generator> {
    commands: Commands<G::Weights>,
    shared: Arc<Shared>,
    loader: Arc<tokio::sync::Mutex<Loader<G>>>,
    /// The model this one follows, if it is a follower.
    follows: Option<ModelId>,
    /// The followers this model's loads refresh.
    followers: Vec<Follower<G::Weights>>,
}

/// Serves [`Generate`] for one or several models; see the [module documentation](self).
pub struct GenerationEngine<G: Generator> {
    models: BTreeMap<ModelId, Slot<G>>,
    mode: PauseMode,
    epoch: u64,
    push_timeout: Duration,
    /// Staging time and refused requests (the decoding threads count the rest).
    stats: EngineStats,
    /// The versions staged for fleet-wide commits ([`StageModel`]).
    holds: Holds<Held<G>>,
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
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl<G: Generator> GenerationEngine<G> {
    /// An engine with no model yet, swapping versions as `mode` says (the run's pause mode).
    pub fn new(mode: PauseMode) -> Self {
        Self {
            models: BTreeMap::new(),
            mode,
            epoch: 0,
            push_timeout: Duration::from_secs(60),
            stats: EngineStats::default(),
            holds: Holds::default(),
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
    /// cannot start; a follower of a model the engine does not serve (yet) or of another
    /// layout; the initial weights' staging error.
    pub fn with_model(mut self, model: GenModel<G>) -> Result<Self> {
        let GenModel {
            id,
            generator,
            stager,
            inlet,
            initial,
            max_batch,
            follows,
            verify,
        } = model;
        if self.models.contains_key(&id) {
            return Err(Error::Config(format!(
                "model `{id}` is served twice by one engine"
            )));
        }
        if let Some(stager) = &stager
            && !same_model(&generator, stager)
        {
            return Err(Error::Config(format!(
                "model `{id}`: the stager is not the same model as the generator (layout, \
                 vocabulary or context differ)"
            )));
        }
        if let Some((of, _)) = &follows {
            let leader = self.models.get(of).ok_or_else(|| {
                Error::Config(format!(
                    "model `{id}` follows model `{of}`, which this engine does not serve \
                     (add `{of}` first)"
                ))
            })?;
            let lead = leader
                .loader
                .try_lock()
                .map_err(|_| Error::Config(format!("model `{id}`: model `{of}` is loading")))?;
            if lead
                .stager
                .as_ref()
                .is_some_and(|s| !same_model(&generator, s))
            {
                return Err(Error::Config(format!(
                    "model `{id}` follows model `{of}` and is not the same model (layout, \
                     vocabulary or context differ): it serves `{of}`'s weights as they are"
                )));
            }
        }
        let initial = match (initial, &stager) {
            (Some(ws), Some(stager)) => Some((Arc::new(stager.stage(&ws)?), ws.version())),
            (Some(_), None) => {
                return Err(Error::Config(format!(
                    "model `{id}` is a follower: it serves its leader's weights, not initial ones"
                )));
            }
            (None, _) => None,
        };
        let cfg = SchedulerConfig::new(id.clone(), max_batch, self.mode);
        let mut scheduler = Scheduler::new(generator, cfg)?;
        if let Some((w, v)) = initial {
            scheduler = scheduler.with_weights(w, v);
        }
        let (commands, shared) = decode_loop::spawn(&id, scheduler)?;
        if let Some((of, every)) = &follows
            && let Some(leader) = self.models.get_mut(of)
        {
            leader.followers.push(Follower {
                model: id.clone(),
                every: *every,
                commands: commands.clone(),
                shared: Arc::clone(&shared),
                last: Arc::new(std::sync::Mutex::new(None)),
            });
        }
        let loader = Loader {
            verify: stager
                .as_ref()
                .and_then(|s| ServedHashes::new(id.clone(), s.manifest(), verify)),
            served: None,
            damaged: None,
            stager,
            inlet,
        };
        let loader = Arc::new(tokio::sync::Mutex::new(loader));
        self.models.insert(
            id,
            Slot {
                commands,
                shared,
                loader,
                follows: follows.map(|(of, _)| of),
                followers: Vec::new(),
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
        if let Some(of) = &slot.follows {
            return Err(Error::Config(format!(
                "model `{model}` follows model `{of}` on this engine: it is refreshed by \
                 `{of}`'s loads and loads nothing itself"
            )));
        }
        Ok(LoadJob {
            model: model.clone(),
            commands: slot.commands.clone(),
            shared: Arc::clone(&slot.shared),
            loader: Arc::clone(&slot.loader),
            followers: slot.followers.clone(),
        })
    }

    /// Hands a request to `model`'s decoding thread and waits for its answer.
    fn ask(
        &mut self,
        model: ModelId,
        epoch: Option<u64>,
        command: impl FnOnce(oneshot::Sender<Result<Completion>>) -> Command<G::Weights>,
    ) -> ResponseFuture<Result<Completion>> {
        if epoch.is_some_and(|g| g != self.epoch) {
            self.stats.cancelled += 1;
            let epoch = self.epoch;
            return Box::pin(async move { Err(Error::Cancelled { epoch }) });
        }
        let commands = match self.slot(&model) {
            Ok(s) => s.commands.clone(),
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        let (reply, answer) = oneshot::channel();
        let sent = commands.send(command(reply));
        Box::pin(async move {
            sent.map_err(|_| loop_gone(&model))?;
            answer.await.map_err(|_| loop_gone(&model))?
        })
    }
}

/// Whether two generators are the same model (layout, vocabulary, context).
fn same_model<G: Generator>(a: &G, b: &G) -> bool {
    a.manifest().schema_hash() == b.manifest().schema_hash()
        && a.vocab_size() == b.vocab_size()
        && a.max_context() == b.max_context()
}

/// A follower as its leader's loads see it.
struct Follower<W> {
    model: ModelId,
    every: u64,
    commands: Commands<W>,
    shared: Arc<Shared>,
    /// The leader's version it was last handed.
    last: Arc<std::sync::Mutex<Option<Version>>>,
}

impl<W> Clone for Follower<W> {
    fn clone(&self) -> Self {
        Self {
            model: self.model.clone(),
            every: self.every,
            commands: self.commands.clone(),
            shared: Arc::clone(&self.shared),
            last: Arc::clone(&self.last),
        }
    }
}

impl<W> Follower<W> {
    /// Hands the leader's freshly swapped `version` to the follower when it is due (its
    /// first, or `every` past the last one); the follower swaps it in at its own boundary.
    fn refresh(&self, weights: &Arc<W>, version: Version) {
        // the mark is one plain value, consistent whatever a panicking writer did
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.is_some_and(|l| version.get() < l.get().saturating_add(self.every)) {
            return;
        }
        // nobody waits for the follower's swap: its answer goes nowhere
        let (reply, _) = oneshot::channel();
        let offer = Command::Offer {
            weights: Arc::clone(weights),
            version,
            reply,
        };
        if self.commands.send(offer).is_ok() {
            self.shared.offered(version);
            *last = Some(version);
            tracing::debug!(model = %self.model, %version, "reference refreshed");
        } else {
            tracing::warn!(model = %self.model, "refresh: {}", loop_gone(&self.model));
        }
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
        let Generate {
            model,
            prompt,
            params,
            epoch,
        } = msg;
        self.ask(model, epoch, |reply| Command::Submit {
            prompt,
            params,
            epoch,
            reply,
        })
    }
}

impl<G: Generator> Handler<Score> for GenerationEngine<G> {
    type Result = ResponseFuture<Result<Completion>>;

    fn handle(&mut self, msg: Score, _: &mut Context<Self>) -> Self::Result {
        let Score {
            model,
            prompt,
            tokens,
            temperature,
            epoch,
        } = msg;
        self.ask(model, epoch, |reply| Command::Score {
            prompt,
            tokens,
            temperature,
            epoch,
            reply,
        })
    }
}

impl<G: Generator> StagedEngine for GenerationEngine<G> {
    type Held = Held<G>;

    fn holds(&mut self) -> &mut Holds<Held<G>> {
        &mut self.holds
    }

    fn staged_total(&mut self) -> &mut Duration {
        &mut self.stats.staged_total
    }

    /// Refused for a follower, which loads nothing itself.
    fn served(&self, model: &ModelId) -> Result<Version> {
        Ok(self.job(model)?.served().unwrap_or(Version::ZERO))
    }

    fn stage(
        &mut self,
        model: &ModelId,
        version: Version,
        deadline: Instant,
        held: Option<Held<G>>,
    ) -> StagingFuture<Self> {
        let job = match self.job(model) {
            Ok(j) => j,
            Err(e) => return Box::pin(fut::ready((Err(e), Duration::ZERO))),
        };
        let (source, held) = (Source::Inlet { version }, held.map(Held::into_guard));
        Box::pin(async move { job.stage(source, deadline, held).await }.into_actor(self))
    }

    /// Offers the version to the decoding thread and waits for its swap.
    fn commit(
        &mut self,
        model: ModelId,
        held: Held<G>,
        deadline: Instant,
    ) -> ResponseActFuture<Self, Result<LoadReport>> {
        let job = match self.job(&model) {
            Ok(j) => j,
            Err(e) => return Box::pin(fut::ready(Err(e))),
        };
        let commit = async move {
            let r = job.commit(held, deadline).await;
            if r.is_err() {
                refit_runtime::metrics::failed(refit_runtime::metrics::Side::Engine, "engine");
            }
            r
        };
        Box::pin(commit.into_actor(self))
    }
}

weight_plane_handlers!(impl[G: Generator] GenerationEngine<G>);

impl<G: Generator> Handler<LoadWeights> for GenerationEngine<G> {
    type Result = ResponseActFuture<Self, Result<Version>>;

    fn handle(&mut self, msg: LoadWeights, _: &mut Context<Self>) -> Self::Result {
        let job = match self.job(msg.weights.model()) {
            Ok(j) => j,
            Err(e) => return Box::pin(fut::ready(Err(e))),
        };
        Box::pin(
            job.run(Source::Pushed(msg.weights), self.push_timeout, None)
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

    /// Requests of older cancellation epochs are refused from now on; the decoding threads end the
    /// ones they hold at their next step boundary (before any load sent after this).
    fn handle(&mut self, _: CancelInFlight, _: &mut Context<Self>) -> u64 {
        self.epoch += 1;
        for (model, slot) in &self.models {
            let below = self.epoch;
            if slot.commands.send(Command::Cancel { below }).is_err() {
                tracing::warn!(model = %model, "cancel: {}", loop_gone(model));
            }
        }
        self.epoch
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
        // a follower's swaps pause nobody and its scoring is not generation
        for slot in self.models.values().filter(|s| s.follows.is_none()) {
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
