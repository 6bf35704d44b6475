//! An engine whose model runs in a backend of its own: vLLM, SGLang, a Python object, any
//! program that generates tokens and takes weights in its own way. The [`BackendEngine`]
//! actor answers the engine contract for it (the weight plane the controller drives, and
//! completions and scores); the backend implements [`EngineBackend`], a handful of
//! blocking calls, and never sees an actor, a socket or a deadline.
//!
//! An update is split the way the contract wants it:
//!
//! 1. **fetch and stage, beside generation**: the version comes through the model's inlet
//!    (pulled, checked whole), then [`EngineBackend::stage`] takes it into the backend's own
//!    staging form (pinned buffers, a copy per tensor-parallel worker), on a blocking thread
//!    while batches keep running;
//! 2. **commit, the only pause**: once the batch running now ends, no new one starts until
//!    [`EngineBackend::commit`] returned; the pause reported is that call alone (or the
//!    part of it the backend says it stopped generation), and the wait for the running
//!    batch is reported as drained time, not pause. A backend that commits in flight
//!    ([`EngineBackend::commits_in_flight`], vLLM between its steps) is committed during
//!    the running batch under `pause_mode = "keep"`: its sequences go on under the new
//!    version, and their tokens say which version made each; its wait for a step
//!    boundary is drained time too;
//! 3. **acknowledge** the version to its sender: it is served.
//!
//! A model taken in tensor by tensor (`apply = "streaming"`, [`BackendEngine::streamed`])
//! goes another way: its stage only takes the model's load lock, and its commit, once the
//! running batch ended, pulls the version and hands the backend each tensor as its bytes
//! are verified ([`EngineBackend::commit_streamed`], [`TensorStream`]); the pause holds
//! the transfer.
//!
//! Requests are batched: those that arrive while a batch runs go together into the next
//! [`EngineBackend::generate`] call, so a backend with its own continuous batching (vLLM's
//! `LLM.generate`) sees many prompts at once. Each completion's tokens carry the version
//! that made them: the backend may say so itself (vLLM's `weight_versions`), otherwise
//! every token carries the version served when its batch started (no commit lands inside a
//! batch; a backend that commits in flight must say so itself). A request of a cancelled
//! episode is refused, or answered cancelled when its batch ends after the cancellation.

mod batches;
mod generator;
mod stream;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_runtime::metrics::Side;
use refit_runtime::{Manifest, ModelId, Version, WeightSet};
use tokio::sync::{OwnedMutexGuard, oneshot};

use crate::actor::staging::{
    Holds, Stage, StagedEngine, StagedVersion, StagingFuture, load_lock, timed_out,
    weight_plane_handlers,
};
use crate::error::{Error, Result};
use crate::generation::{Completion, PauseMode};
use crate::link::WeightInlet;
use crate::protocol::engine::{
    CancelInFlight, EngineStats, Generate, GetEngineStats, LoadReport, Score, ServedVersions,
};

use batches::{Pending, Request};
pub use generator::GeneratorBackend;
pub use stream::TensorStream;

// ANCHOR: backend
/// What a backend does for a [`BackendEngine`]: blocking calls. `stage`, `commit`,
/// `generate` and `score` run on blocking threads beside the actor; `name`, `manifest`,
/// `abort` and `interrupt` run on the actor's own thread and must be quick. Stages of one
/// model never overlap. Commits and batches never overlap (a commit waits for the running
/// batch, and no batch starts until it returns, so a commit pauses every model the engine
/// serves, as `pause_mode = "wait"` does; under `abort` the backend is first asked to end
/// the running batch's sequences of the model, [`EngineBackend::interrupt`]), unless the
/// backend commits in flight ([`EngineBackend::commits_in_flight`]) and the topology's
/// `pause_mode` is `keep`.
pub trait EngineBackend: Send + Sync + 'static {
    /// A name for messages (`"vllm"`, `"python engine"`).
    fn name(&self) -> String;

    /// True when the backend can serve a version committed while a batch runs: it loads it
    /// at its next step boundary and the batch's sequences go on under it (vLLM's `keep`;
    /// their KV entries kept, or recomputed under the new weights, as the backend does),
    /// and it labels each token it generates or scores with the version that made it. Under
    /// `pause_mode = "keep"`, the engine then commits without waiting for the running
    /// batch (commits of different models may run at once: the backend orders them as it
    /// needs), and the backend's wait for its step boundary is not a pause: its
    /// [`EngineBackend::commit`] says how long it stopped generation. Default: false.
    fn commits_in_flight(&self) -> bool {
        false
    }

    /// The layout `model`'s weights come in (the names, dtypes and shapes the backend
    /// loads; the link converts the trainer's layout to it).
    ///
    /// # Errors
    /// A model the backend does not serve, naming it.
    fn manifest(&self, model: &ModelId) -> Result<Arc<Manifest>>;

    /// Takes `weights` (fetched and checked whole against [`EngineBackend::manifest`]) into
    /// the backend's staging form, beside generation. A second stage of a model replaces
    /// what the first staged.
    ///
    /// # Errors
    /// A version the backend refuses (an unknown name, a wrong shape, values it cannot
    /// take), naming the tensor; the version served stays served.
    fn stage(&self, weights: Arc<WeightSet>) -> Result<()>;

    /// Serves what was staged last of `model`, `version`: the only part of an update that
    /// may stop the backend's generation of the model. Answers the time generation stopped
    /// for it when the backend measured it (`Some`: a backend committed in flight first
    /// waits for a step boundary, during which tokens are still made), or `None`: the
    /// whole call is the pause (as it always is when the engine waited for the batch).
    ///
    /// # Errors
    /// A load that failed; the engine then serves no new version (and says so).
    fn commit(&self, model: &ModelId, version: Version) -> Result<Option<Duration>>;

    /// True when the backend can take a version in tensor by tensor inside its commit
    /// ([`EngineBackend::commit_streamed`]), as a model with `apply = "streaming"` needs.
    /// Default: false.
    fn streams(&self) -> bool {
        false
    }

    /// Serves `version` of `model`, or a newer one, pulled inside the call: the backend
    /// stops generating the model, calls [`TensorStream::run`] once with a function that
    /// puts each tensor where the model is served, completes its load, and answers. The
    /// whole call is the pause (the running batch ended before it; no batch starts until
    /// it returns). It ends the model's interrupt, as a commit does. For a model with
    /// `apply = "streaming"`: the engine holds no second copy of it. Run the stream on the
    /// calling thread, and return once it ended.
    ///
    /// # Errors
    /// The stream's failure, or a load the backend refuses. After part of the version was
    /// applied the backend's model is mixed: the backend refuses to generate with it until
    /// a version streams in whole (the controller fences the engine meanwhile).
    fn commit_streamed(
        &self,
        model: &ModelId,
        version: Version,
        stream: &TensorStream,
    ) -> Result<()> {
        let _ = (version, stream);
        Err(Error::Config(format!(
            "model `{model}`: the {} backend does not stream versions in \
             (apply = \"streaming\"); stage them (apply = \"staged\")",
            self.name()
        )))
    }

    /// Drops what was staged of `model`, serving nothing new, and ends its interrupt
    /// ([`EngineBackend::interrupt`]): the fleet did not commit it, its hold ran out, a
    /// newer load took its place, its commit failed, or the commit's wait for the running
    /// batch ran out (default: nothing to drop). Called on the engine's own thread: it must
    /// not wait long (a backend may queue it, in order with its later calls, as the Python
    /// engine does).
    fn abort(&self, model: &ModelId) {
        let _ = model;
    }

    /// Under `pause_mode = "abort"`, before `version` of `model` is committed: ends the
    /// batch's sequences of `model` at the backend's next step boundary, each answered with
    /// the tokens made so far and [`Finish::Aborted`](crate::generation::Finish) (`by` is
    /// `version`; a rollout worker asks again, under the new version), so that the commit
    /// waits for a step, not for the batch (sequences of other models in the batch still
    /// run to their end). It holds until the model's next
    /// [`EngineBackend::commit`], [`EngineBackend::commit_streamed`] or
    /// [`EngineBackend::abort`], one of which always follows it: the
    /// batch running when it comes, or one the engine started that the backend has not
    /// entered yet, ends; none starts between it and that call. Called whether or not a
    /// batch runs. The default does nothing: the commit waits for the batch, as under
    /// `wait`. Called on the engine's own thread: it must not wait (a backend may queue
    /// it, in order with its later calls).
    fn interrupt(&self, model: &ModelId, version: Version) {
        let _ = (model, version);
    }

    /// Completions of `batch`, one answer per request, in order; `served` is the version
    /// of each model served when this batch started. A completion whose `versions` is
    /// empty gets the served version for each of its tokens (refused from a backend that
    /// commits in flight).
    fn generate(
        &self,
        batch: &[Generate],
        served: &BTreeMap<ModelId, Version>,
    ) -> Vec<Result<Completion>>;

    /// Scores of `batch` (teacher forcing), as [`EngineBackend::generate`]. The default
    /// refuses every request: a backend that cannot score serves no KL reference.
    fn score(
        &self,
        batch: &[Score],
        served: &BTreeMap<ModelId, Version>,
    ) -> Vec<Result<Completion>> {
        let _ = served;
        batch
            .iter()
            .map(|_| {
                Err(Error::bad_request(
                    "model",
                    format!("the {} backend does not score", self.name()),
                ))
            })
            .collect()
    }
}
// ANCHOR_END: backend

/// One model's inlet, behind its load lock (a staged version holds the lock until its
/// commit).
struct Slot {
    inlet: Box<dyn WeightInlet>,
}

/// A version staged and held for its commit, with its model's load lock.
pub(crate) struct Held {
    /// The lock (taken by its commit, or by the load that takes its place).
    guard: Option<OwnedMutexGuard<Slot>>,
    version: Version,
    staged: Duration,
    /// Drops what the backend staged when the version goes uncommitted (an abort, its hold
    /// running out, a load taking its place, a commit refused); disarmed by its commit.
    abort: Option<Box<dyn FnOnce() + Send>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(abort) = self.abort.take() {
            abort();
        }
    }
}

impl StagedVersion for Held {
    fn version(&self) -> Version {
        self.version
    }
}

/// The versions served, per model (read by staging threads, written after commits).
type Served = Arc<Mutex<BTreeMap<ModelId, Version>>>;

fn served_of(served: &Served, model: &ModelId) -> Version {
    served
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(model)
        .copied()
        .unwrap_or(Version::ZERO)
}

/// The engine actor of a backend: see the [module](self).
pub struct BackendEngine<B: EngineBackend> {
    backend: Arc<B>,
    slots: BTreeMap<ModelId, Arc<tokio::sync::Mutex<Slot>>>,
    served: Served,
    holds: Holds<Held>,
    /// Commits and batches take turns on this lock (tokio's is fair: a commit waiting for
    /// the running batch goes before the next batch); a commit in flight does not take it.
    turn: Arc<tokio::sync::Mutex<()>>,
    pending: Pending,
    running: bool,
    epoch: u64,
    /// The epoch, for a batch that waited for its turn to look at before it runs.
    epoch_now: Arc<AtomicU64>,
    /// Commits land during batches (`keep`, a backend that commits in flight).
    in_flight: bool,
    /// A commit first interrupts the running batch (`abort`).
    interrupts: bool,
    /// The models taken in tensor by tensor at their commit (`apply = "streaming"`).
    streaming: BTreeSet<ModelId>,
    stats: EngineStats,
}

impl<B: EngineBackend> std::fmt::Debug for BackendEngine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendEngine")
            .field("backend", &self.backend.name())
            .field("models", &self.slots.keys().collect::<Vec<_>>())
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

impl<B: EngineBackend> BackendEngine<B> {
    /// An engine of `backend` serving `models`, each fed through its inlet; nothing is
    /// served before the first load.
    ///
    /// # Errors
    /// [`Error::Config`] for a model given twice or one the backend has no layout for.
    pub fn new(backend: Arc<B>, models: Vec<(ModelId, Box<dyn WeightInlet>)>) -> Result<Self> {
        let mut slots = BTreeMap::new();
        let mut served = BTreeMap::new();
        for (model, inlet) in models {
            backend.manifest(&model)?;
            if slots.contains_key(&model) {
                return Err(Error::Config(format!(
                    "model `{model}` is given twice to the {} engine",
                    backend.name()
                )));
            }
            served.insert(model.clone(), Version::ZERO);
            let slot = Arc::new(tokio::sync::Mutex::new(Slot { inlet }));
            slots.insert(model, slot);
        }
        Ok(Self {
            backend,
            slots,
            served: Arc::new(Mutex::new(served)),
            holds: Holds::default(),
            turn: Arc::new(tokio::sync::Mutex::new(())),
            pending: Pending::default(),
            running: false,
            epoch: 0,
            epoch_now: Arc::new(AtomicU64::new(0)),
            in_flight: false,
            interrupts: false,
            streaming: BTreeSet::new(),
            stats: EngineStats::default(),
        })
    }

    /// Takes `model` in tensor by tensor at each commit ([`EngineBackend::commit_streamed`],
    /// a topology's `apply = "streaming"`): its stage only takes the model's load lock, and
    /// its commit (always after the running batch, whatever the pause mode) pulls the
    /// version. Its inlet must stream ([`WeightInlet::stream`]): a
    /// [`StreamingInlet`](refit_runtime::link::StreamingInlet), which hands the version in
    /// force at connect over at the first commit (a [`refit_runtime::Receiver`] connected
    /// to receive whole keeps that one, and streams only the versions after it).
    ///
    /// # Errors
    /// [`Error::Runtime`] (unknown model) for a model the engine does not serve;
    /// [`Error::Config`] for a backend that does not stream ([`EngineBackend::streams`]),
    /// naming both.
    pub fn streamed(mut self, model: &ModelId) -> Result<Self> {
        self.slot(model)?;
        if !self.backend.streams() {
            return Err(Error::Config(format!(
                "model `{model}` has apply = \"streaming\", and the {} engine does not \
                 stream versions in (use apply = \"staged\")",
                self.backend.name()
            )));
        }
        self.streaming.insert(model.clone());
        Ok(self)
    }

    /// What the engine does with a running batch at a commit: with `keep`, a backend that
    /// commits in flight ([`EngineBackend::commits_in_flight`]) is committed during the
    /// batch; with `abort`, the backend is asked to end the batch's sequences of the model
    /// ([`EngineBackend::interrupt`]) and the commit waits for the batch to end, as it
    /// does otherwise (with `wait`, or `keep` and a backend that does not commit in
    /// flight).
    #[must_use]
    pub fn pause_mode(mut self, mode: PauseMode) -> Self {
        self.in_flight = mode == PauseMode::Keep && self.backend.commits_in_flight();
        self.interrupts = mode == PauseMode::Abort;
        self
    }

    fn slot(&self, model: &ModelId) -> Result<Arc<tokio::sync::Mutex<Slot>>> {
        self.slots
            .get(model)
            .cloned()
            .ok_or_else(|| Error::Runtime(refit_runtime::Error::UnknownModel(model.clone())))
    }

    fn job(&self, model: &ModelId) -> Result<Job<B>> {
        Ok(Job {
            model: model.clone(),
            slot: self.slot(model)?,
            backend: Arc::clone(&self.backend),
            served: Arc::clone(&self.served),
            turn: Arc::clone(&self.turn),
            // a streamed version is pulled during the commit: never beside a batch
            in_flight: self.in_flight && !self.streaming.contains(model),
            interrupts: self.interrupts,
            streaming: self.streaming.contains(model),
        })
    }
}

impl<B: EngineBackend> Actor for BackendEngine<B> {
    type Context = Context<Self>;
}

/// What one load needs of the engine, so that it runs without borrowing it.
struct Job<B: EngineBackend> {
    model: ModelId,
    slot: Arc<tokio::sync::Mutex<Slot>>,
    backend: Arc<B>,
    served: Served,
    turn: Arc<tokio::sync::Mutex<()>>,
    /// The commit does not wait for the running batch.
    in_flight: bool,
    /// The commit interrupts the running batch before it waits for it.
    interrupts: bool,
    /// The version is pulled at the commit, tensor by tensor.
    streaming: bool,
}

/// What a commit did, for the report and the statistics.
struct Committed {
    version: Version,
    paused: Duration,
    drained: Duration,
}

impl<B: EngineBackend> Job<B> {
    /// Takes the model's load lock (or `held`, a staged version's) by `deadline`, then
    /// fetches at least `version` and stages it on a blocking thread. Answers what was
    /// staged and how long the lock wait, fetch and stage took.
    ///
    /// # Cancel safety
    /// Cancel safe for the engine: dropped, the lock is let go once the staging thread
    /// ends; what that thread staged in the backend stays there until the next stage of
    /// the model replaces it.
    async fn stage(
        &self,
        version: Version,
        deadline: Instant,
        held: Option<OwnedMutexGuard<Slot>>,
    ) -> (Result<Stage<Held>>, Duration) {
        let started = Instant::now();
        let guard = match load_lock(held, &self.slot, &self.model, deadline).await {
            Ok(g) => g,
            Err(e) => return (Err(e), started.elapsed()),
        };
        if self.streaming {
            return (
                Ok(self.hold_for_stream(guard, version, started)),
                started.elapsed(),
            );
        }
        let (model, backend, served) = (
            self.model.clone(),
            Arc::clone(&self.backend),
            Arc::clone(&self.served),
        );
        let staging = actix_rt::task::spawn_blocking(move || {
            let mut guard = guard;
            let current = served_of(&served, &model);
            if current >= version {
                return (guard, Ok(None));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let fetched = guard
                .inlet
                .fetch(&model, version, left)
                .map_err(Error::from);
            let r = fetched.and_then(|w| {
                let v = w.version();
                if v <= served_of(&served, &model) {
                    return Ok(None);
                }
                // the layout the backend loads, whatever inlet it was given
                let loads = backend.manifest(&model)?;
                if w.manifest().schema_hash() != loads.schema_hash() {
                    return Err(Error::Generator {
                        model: model.to_string(),
                        reason: format!(
                            "v{v} came in a layout of {} tensors, not the {} backend's ({})",
                            w.manifest().tensors().len(),
                            backend.name(),
                            loads.tensors().len()
                        ),
                    });
                }
                backend.stage(w).map(|()| Some(v))
            });
            (guard, r)
        })
        .await;
        let staged = started.elapsed();
        let r = match staging {
            Ok((guard, Ok(Some(version)))) => {
                let (backend, model) = (Arc::clone(&self.backend), self.model.clone());
                Ok(Stage::New(Held {
                    guard: Some(guard),
                    version,
                    staged,
                    abort: Some(Box::new(move || backend.abort(&model))),
                }))
            }
            Ok((_, Ok(None))) => Ok(Stage::Served(served_of(&self.served, &self.model))),
            Ok((_, Err(e))) => Err(e),
            Err(e) => Err(Error::Actor(format!(
                "the staging thread of model `{}` failed: {e}",
                self.model
            ))),
        };
        (r, staged)
    }

    /// Serves the staged version: waits for the running batch (drained; not when the
    /// backend commits in flight; interrupted first under `abort`), commits on a blocking thread (the pause: the call, or
    /// in flight the part of it the backend measured, the rest drained), then acknowledges
    /// the version.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped after the commit started, the version may be served and
    /// not acknowledged.
    async fn commit(&self, held: Held, deadline: Instant) -> Result<Committed> {
        let mut held = held;
        // the backend drops what it staged if the commit does not happen
        let abort = held.abort.take();
        let version = held.version;
        let guard = held.guard.take().ok_or_else(|| {
            Error::Actor(format!(
                "model `{}`: v{version} was staged without its load lock",
                self.model
            ))
        })?;
        let asked = Instant::now();
        let wait = deadline.saturating_duration_since(asked).max(MIN_TURN_WAIT);
        let turn = if self.in_flight {
            None
        } else {
            if self.interrupts {
                self.backend.interrupt(&self.model, version);
            }
            let lock = Arc::clone(&self.turn).lock_owned();
            let Ok(turn) = actix_rt::time::timeout(wait, lock).await else {
                if let Some(abort) = abort {
                    abort();
                }
                let what = "waiting for the running batch to end";
                return Err(timed_out(&self.model, what, wait));
            };
            Some(turn)
        };
        let drained = asked.elapsed();
        let (model, backend, served) = (
            self.model.clone(),
            Arc::clone(&self.backend),
            Arc::clone(&self.served),
        );
        // out of flight, no batch runs during the call: all of it is a pause
        let (in_flight, streaming) = (self.in_flight, self.streaming);
        let done = actix_rt::task::spawn_blocking(move || {
            let started = Instant::now();
            let served_now = if streaming {
                // the transfer is the commit's: its time runs from here, at least
                // MIN_TURN_WAIT, whatever the wait for the batch took
                let until = deadline.max(started + MIN_TURN_WAIT);
                stream::commit(backend.as_ref(), &model, version, guard, until)
                    .map(|(guard, v)| (guard, v, None))
            } else {
                let measured = backend.commit(&model, version);
                measured.map(|m| (guard, version, m))
            };
            let (mut guard, landed, measured) = match served_now {
                Ok(v) => v,
                Err(e) => {
                    if let Some(abort) = abort {
                        abort();
                    }
                    return Err(e);
                }
            };
            let (paused, waited) = pause_of(started.elapsed(), measured.filter(|_| in_flight));
            // the next batch, which waits for the turn, sees the version it runs under
            served
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(model.clone(), landed);
            drop(turn);
            guard.inlet.applied(&model, landed)?;
            if landed < version {
                // a stream whose version did not come in time, after an older one went
                // through whole: that one is served, and the commit failed
                return Err(timed_out(
                    &model,
                    &format!("v{version} streamed (v{landed} came whole, and is served)"),
                    started.elapsed(),
                ));
            }
            Ok((landed, paused, waited))
        })
        .await
        .map_err(|e| {
            // a commit that panicked did not abort: what it staged, and its interrupt,
            // are dropped here
            self.backend.abort(&self.model);
            Error::Actor(format!(
                "the commit thread of model `{}` failed: {e}",
                self.model
            ))
        })?;
        let (version, paused, waited) = done.map_err(|e: Error| {
            tracing::error!(model = %self.model, "v{version} did not load: {e}");
            e
        })?;
        Ok(Committed {
            version,
            paused,
            drained: drained + waited,
        })
    }
}

/// A commit call's pause and the rest of it, which the backend spent waiting while its
/// batch went on (drained time): the backend's own measure of its pause, at most the call;
/// the whole call when it measured none.
fn pause_of(call: Duration, measured: Option<Duration>) -> (Duration, Duration) {
    let paused = measured.map_or(call, |m| m.min(call));
    (paused, call.saturating_sub(paused))
}

/// The least time a staged version waits for the running batch to end, even when the fetch
/// and the stage ate the load's deadline (a backend's batch has no bound of its own); and
/// the least a streamed version's transfer is given, whatever that wait took.
const MIN_TURN_WAIT: Duration = Duration::from_secs(5);

impl<B: EngineBackend> BackendEngine<B> {
    /// Counts a commit and answers its report.
    fn committed(&mut self, model: ModelId, staged: Duration, c: Committed) -> LoadReport {
        self.stats.loads += 1;
        self.stats.paused_total += c.paused;
        self.stats.paused_max = self.stats.paused_max.max(c.paused);
        self.stats.drained_total += c.drained;
        refit_runtime::metrics::engine_loaded(model.as_str(), c.version.0, c.paused);
        LoadReport {
            model,
            version: c.version,
            staged,
            paused: c.paused,
            damaged: None,
        }
    }
}

impl<B: EngineBackend> StagedEngine for BackendEngine<B> {
    type Held = Held;

    fn holds(&mut self) -> &mut Holds<Held> {
        &mut self.holds
    }

    fn staged_total(&mut self) -> &mut Duration {
        &mut self.stats.staged_total
    }

    fn served(&self, model: &ModelId) -> Result<Version> {
        self.slot(model)?;
        Ok(served_of(&self.served, model))
    }

    /// The backend drops what `held` staged ([`EngineBackend::abort`]) and its lock goes
    /// to this stage.
    fn stage(
        &mut self,
        model: &ModelId,
        version: Version,
        deadline: Instant,
        held: Option<Held>,
    ) -> StagingFuture<Self> {
        let job = match self.job(model) {
            Ok(j) => j,
            Err(e) => return Box::pin(fut::ready((Err(e), Duration::ZERO))),
        };
        let held = held.and_then(|mut h| h.guard.take());
        Box::pin(async move { job.stage(version, deadline, held).await }.into_actor(self))
    }

    fn commit(
        &mut self,
        model: ModelId,
        held: Held,
        deadline: Instant,
    ) -> ResponseActFuture<Self, Result<LoadReport>> {
        let job = match self.job(&model) {
            Ok(j) => j,
            Err(e) => return Box::pin(fut::ready(Err(e))),
        };
        let staged = held.staged;
        let commit = async move { job.commit(held, deadline).await };
        Box::pin(commit.into_actor(self).map(move |r, act, ctx| {
            act.start_batch(ctx);
            if r.is_err() {
                refit_runtime::metrics::failed(Side::Engine, "engine");
            }
            Ok(act.committed(model, staged, r?))
        }))
    }
}

weight_plane_handlers!(impl[B: EngineBackend] BackendEngine<B>);

impl<B: EngineBackend> Handler<CancelInFlight> for BackendEngine<B> {
    type Result = u64;

    /// Requests of older epochs are refused from now on: those waiting are answered at
    /// once, those in the running batch when it ends.
    fn handle(&mut self, _: CancelInFlight, _: &mut Context<Self>) -> u64 {
        self.epoch += 1;
        self.epoch_now.store(self.epoch, Ordering::Release);
        self.stats.cancelled += self.pending.cancel_other_than(self.epoch);
        self.epoch
    }
}

impl<B: EngineBackend> Handler<ServedVersions> for BackendEngine<B> {
    type Result = MessageResult<ServedVersions>;

    fn handle(&mut self, _: ServedVersions, _: &mut Context<Self>) -> Self::Result {
        MessageResult(
            self.served
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        )
    }
}

impl<B: EngineBackend> Handler<GetEngineStats> for BackendEngine<B> {
    type Result = MessageResult<GetEngineStats>;

    fn handle(&mut self, _: GetEngineStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.stats.clone())
    }
}

impl<B: EngineBackend> Handler<Generate> for BackendEngine<B> {
    type Result = ResponseFuture<Result<Completion>>;

    fn handle(&mut self, msg: Generate, ctx: &mut Context<Self>) -> Self::Result {
        let (epoch, model) = (msg.epoch, msg.model.clone());
        self.request(Request::Generate(msg), &model, epoch, ctx)
    }
}

impl<B: EngineBackend> Handler<Score> for BackendEngine<B> {
    type Result = ResponseFuture<Result<Completion>>;

    fn handle(&mut self, msg: Score, ctx: &mut Context<Self>) -> Self::Result {
        let (epoch, model) = (msg.epoch, msg.model.clone());
        self.request(Request::Score(msg), &model, epoch, ctx)
    }
}

impl<B: EngineBackend> BackendEngine<B> {
    /// Queues a request for the next batch (refused at once for an unknown model or a
    /// cancelled episode) and answers it when its batch ends.
    fn request(
        &mut self,
        req: Request,
        model: &ModelId,
        epoch: Option<u64>,
        ctx: &mut Context<Self>,
    ) -> ResponseFuture<Result<Completion>> {
        if let Err(e) = self.slot(model) {
            return Box::pin(async move { Err(e) });
        }
        if epoch.is_some_and(|e| e != self.epoch) {
            self.stats.cancelled += 1;
            let epoch = self.epoch;
            return Box::pin(async move { Err(Error::Cancelled { epoch }) });
        }
        let (tx, rx) = oneshot::channel();
        self.pending.push(req, tx);
        self.start_batch(ctx);
        let backend = self.backend.name();
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| {
                Err(Error::Actor(format!(
                    "the {backend} engine stopped before answering"
                )))
            })
        })
    }

    /// Starts the next batch when none runs: the requests waiting whose model serves a
    /// version, in one backend call each for completions and for scores, after any commit
    /// waiting for its turn.
    fn start_batch(&mut self, ctx: &mut Context<Self>) {
        if self.running {
            return;
        }
        let served = self
            .served
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let batch = self.pending.take_ready(&served);
        if batch.is_empty() {
            return;
        }
        self.running = true;
        let (backend, turn) = (Arc::clone(&self.backend), Arc::clone(&self.turn));
        let (served, epoch) = (Arc::clone(&self.served), Arc::clone(&self.epoch_now));
        let (name, in_flight) = (self.backend.name(), self.in_flight);
        let run = async move {
            let turn = turn.lock_owned().await;
            let answered = actix_rt::task::spawn_blocking(move || {
                // the versions served once the batch has its turn: no commit lands
                // before it ends (but one in flight, whose backend labels its tokens)
                let served = served
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                let epoch = epoch.load(Ordering::Acquire);
                let answered = batch.run(backend.as_ref(), &served, epoch, in_flight);
                drop(turn);
                answered
            })
            .await;
            // a backend that panicked answers nobody: its callers hear the engine is gone
            answered
                .map_err(|e| tracing::error!("a batch of the {name} engine failed: {e}"))
                .ok()
        };
        ctx.spawn(run.into_actor(self).map(|answered, act, ctx| {
            act.running = false;
            if let Some(a) = answered {
                let counts = a.answer(act.epoch);
                act.stats.tokens += counts.tokens;
                act.stats.cancelled += counts.cancelled;
                act.stats.aborted += counts.aborted;
            }
            act.start_batch(ctx);
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_pauses_for_what_the_backend_measured_at_most_the_call() {
        let ms = Duration::from_millis;
        // no measure: the whole call
        assert_eq!(pause_of(ms(30), None), (ms(30), ms(0)));
        // measured: the rest was a wait while the batch went on
        assert_eq!(pause_of(ms(30), Some(ms(4))), (ms(4), ms(26)));
        // a measure longer than the call is the call
        assert_eq!(pause_of(ms(30), Some(ms(90))), (ms(30), ms(0)));
    }
}
