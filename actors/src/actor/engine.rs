//! The inference engine actor: serves actions for one or several models; pauses, loads and
//! continues one model at a time, with the bytes staged before the pause.
//!
//! A version loaded through a model's inlet is acknowledged to its sender only once it is
//! served: the inlet stages it without an ack ([`WeightInlet::fetch`]), the engine swaps it
//! into the policy and answers the requests that queued meanwhile, and only then tells the
//! inlet it is applied ([`WeightInlet::applied`]); the [`LoadReport`] follows the ack.
//!
//! The apply itself (copying a version into the policy) runs on a blocking thread, not in
//! the actor's handler: while one model's weights are applied, that model's requests queue
//! and every other model's requests are answered.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use refit_runtime::metrics::{self, Phase, Side};
use refit_runtime::topology::Verify;
use refit_runtime::{ArenaStrategy, ModelId, Strategy, Version, WeightSet};
use tokio::sync::{Mutex, oneshot};

use crate::collector::policy_model_id;
use crate::error::{Error, Result};
use crate::link::WeightInlet;
use crate::policy::{ActionOut, Policy};
use crate::protocol::engine::{
    Act, ActBatch, Acted, ActedBatch, CancelInFlight, Continue, EngineStats, GetEngineStats,
    LoadReport, LoadWeights, Pause, ServedVersion, ServedVersions,
};

use super::staging::{
    Holds, Stage, StagedEngine, StagedVersion, StagingFuture, load_lock, weight_plane_handlers,
};
use super::stale;
use super::verify::{Damage, ServedHashes, Unverified};

type Waiter = oneshot::Sender<Result<ActedBatch>>;
type SharedInlet = Arc<Mutex<Box<dyn WeightInlet>>>;
type InletGuard = tokio::sync::OwnedMutexGuard<Box<dyn WeightInlet>>;

/// A version staged (fetched newer than the one served), holding the model's inlet lock
/// until it is acknowledged.
pub(crate) struct Held {
    weights: Arc<WeightSet>,
    guard: InletGuard,
    /// Lock wait and fetch.
    staged: Duration,
}

impl StagedVersion for Held {
    fn version(&self) -> Version {
        self.weights.version()
    }
}

struct Slot<P> {
    /// `None` while its weights are applied on a blocking thread (or after an apply that
    /// panicked took it down).
    policy: Option<P>,
    /// True while its weights are applied: its requests queue.
    applying: bool,
    version: Version,
    obs_dim: usize,
    inlet: Option<SharedInlet>,
    queued: VecDeque<(ActBatch, Waiter)>,
    /// With `verify = "hashes"`: the hashes of the version served (lent to the apply thread
    /// with the policy).
    verify: Option<ServedHashes>,
    /// Serialises the applies of this model (a load through the inlet and pushed loads).
    apply_lock: Arc<Mutex<()>>,
}

/// Serves actions for one or several models; pauses, loads weights and continues.
pub struct InferenceEngine<P: Policy> {
    models: BTreeMap<ModelId, Slot<P>>,
    default: ModelId,
    paused: bool,
    /// How long a request may queue (engine paused, or its model's weights applied) before
    /// it is answered with a timeout.
    queue_deadline: Duration,
    epoch: u64,
    rng: SmallRng,
    stats: EngineStats,
    /// The versions staged for fleet-wide commits.
    holds: Holds<Held>,
}

/// How long a request queues on a paused engine by default before it is answered with a
/// timeout: longer than any pause the controller makes with its default deadlines.
pub const DEFAULT_QUEUE_DEADLINE: Duration = Duration::from_secs(120);

impl<P: Policy> std::fmt::Debug for InferenceEngine<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let versions: BTreeMap<_, _> = self.models.iter().map(|(m, s)| (m, s.version)).collect();
        f.debug_struct("InferenceEngine")
            .field("versions", &versions)
            .field("paused", &self.paused)
            .field("epoch", &self.epoch)
            .finish()
    }
}

fn obs_dim<P: Policy>(policy: &P) -> Result<usize> {
    match policy.obs_dim() {
        0 => Err(Error::Config(
            "a policy whose observations have no values cannot serve".into(),
        )),
        d => Ok(d),
    }
}

impl<P: Policy + Unpin + 'static> InferenceEngine<P> {
    /// An engine serving `policy` as the default model (`policy_model_id()`, version 0 until
    /// weights load), with no inlet (weights are pushed with [`LoadWeights`]).
    ///
    /// # Errors
    /// As [`InferenceEngine::with_model`].
    pub fn new(policy: P, seed: u64) -> Result<Self> {
        Self::empty(seed).with_model(policy_model_id(), policy, None)
    }

    /// An engine with no model yet.
    pub fn empty(seed: u64) -> Self {
        Self {
            models: BTreeMap::new(),
            default: policy_model_id(),
            paused: false,
            queue_deadline: DEFAULT_QUEUE_DEADLINE,
            epoch: 0,
            rng: SmallRng::seed_from_u64(seed),
            stats: EngineStats::default(),
            holds: Holds::default(),
        }
    }

    /// Sets how long a request may queue while the engine is paused (or its model's weights
    /// are applied) before it is answered with a timeout ([`DEFAULT_QUEUE_DEADLINE`] unless
    /// set): a pause that never ends (its controller gone) does not hold a caller for good.
    #[must_use]
    pub fn with_queue_deadline(mut self, deadline: Duration) -> Self {
        self.queue_deadline = deadline;
        self
    }

    /// Verifies what `model` serves, at `level` (a topology's `verify`): from `startup`, a
    /// corrupt-then-restore self-test at the first apply (a tensor the update path does not
    /// carry fails that load, naming it); at `hashes`, also after each apply the policy's
    /// weights are hashed and compared with the version applied (an apply that did not land
    /// whole fails), and again at the next update (weights changed while served are reported
    /// by that update's [`LoadReport::damaged`], naming the tensor). `off` and `names` ask
    /// nothing more of this engine: a version whose tensors are not the policy's is refused
    /// before it is applied, always.
    ///
    /// # Errors
    /// An unknown model; a policy whose weights have no manifest.
    pub fn verify_served(mut self, model: &ModelId, level: Verify) -> Result<Self> {
        let slot = self.slot(model)?;
        let policy = slot.policy.as_ref().ok_or_else(|| lost(model))?;
        let manifest = Arc::new(policy.weight_manifest()?);
        slot.verify = ServedHashes::new(model.clone(), manifest, level);
        Ok(self)
    }

    /// Adds a model, fed through `inlet` when given. The first model added is the default.
    ///
    /// # Errors
    /// [`Error::Config`] for a model added twice or a policy whose observation length is zero.
    pub fn with_model(
        mut self,
        id: ModelId,
        policy: P,
        inlet: Option<Box<dyn WeightInlet>>,
    ) -> Result<Self> {
        if self.models.contains_key(&id) {
            return Err(Error::Config(format!(
                "model `{id}` is served twice by one engine"
            )));
        }
        if self.models.is_empty() {
            self.default = id.clone();
        }
        let slot = Slot {
            obs_dim: obs_dim(&policy)?,
            policy: Some(policy),
            applying: false,
            version: Version::ZERO,
            inlet: inlet.map(|i| Arc::new(Mutex::new(i))),
            queued: VecDeque::new(),
            verify: None,
            apply_lock: Arc::default(),
        };
        self.models.insert(id, slot);
        Ok(self)
    }

    fn slot(&mut self, model: &ModelId) -> Result<&mut Slot<P>> {
        self.models
            .get_mut(model)
            .ok_or_else(|| Error::Runtime(refit_runtime::Error::UnknownModel(model.clone())))
    }

    fn act_now(&mut self, req: &ActBatch) -> Result<ActedBatch> {
        if req.epoch.is_some_and(|g| g != self.epoch) {
            self.stats.cancelled += 1;
            return Err(Error::Cancelled { epoch: self.epoch });
        }
        let epoch = self.epoch;
        let Self { models, rng, .. } = self;
        let slot = models
            .get_mut(&req.model)
            .ok_or_else(|| Error::Runtime(refit_runtime::Error::UnknownModel(req.model.clone())))?;
        let d = slot.obs_dim;
        let Some(policy) = slot.policy.as_mut() else {
            return Err(lost(&req.model));
        };
        if req.obs.is_empty() || !req.obs.len().is_multiple_of(d) {
            return Err(Error::Config(format!(
                "{} observation values do not make whole observations of length {d} for model `{}`",
                req.obs.len(),
                req.model
            )));
        }
        let actions = req
            .obs
            .chunks_exact(d)
            .map(|o| {
                if req.greedy {
                    let action = policy.act_greedy(o, rng);
                    ActionOut {
                        action,
                        log_prob: 0.0,
                    }
                } else {
                    policy.act(o, rng)
                }
            })
            .collect();
        Ok(ActedBatch {
            actions,
            version: slot.version,
            epoch,
        })
    }

    fn drain(&mut self, model: &ModelId) {
        if self.paused {
            return;
        }
        let queued = match self.models.get_mut(model) {
            Some(s) if !s.applying => std::mem::take(&mut s.queued),
            _ => return,
        };
        for (req, tx) in queued {
            // a request whose caller stopped waiting (its deadline passed) is not served
            if !tx.is_closed() {
                let _ = tx.send(self.act_now(&req));
            }
        }
    }

    /// Applies `weights` to their model off the actor's thread: waits for the model's apply
    /// lock, checks the version, lends the policy to a blocking thread (the model's requests
    /// queue meanwhile; other models are served), takes it back and answers the queued
    /// requests. Answers how long the model was paused, and (`verify = "hashes"`) the damage
    /// found in the version served before this one.
    fn apply(&mut self, weights: Arc<WeightSet>) -> ResponseActFuture<Self, Result<Applied>> {
        let lock = match self.slot(weights.model()) {
            Ok(s) => Arc::clone(&s.apply_lock),
            Err(e) => return Box::pin(fut::ready(Err(e))),
        };
        let locked = async move { lock.lock_owned().await };
        Box::pin(locked.into_actor(self).then(move |guard, act, _| {
            let (policy, verify) = match act.begin_apply(&weights) {
                Ok(p) => p,
                Err(e) => return Box::pin(fut::ready(Err(e))) as ResponseActFuture<_, _>,
            };
            let paused_at = Instant::now();
            let w = Arc::clone(&weights);
            let job = actix_rt::task::spawn_blocking(move || apply_verified(policy, verify, &w));
            Box::pin(job.into_actor(act).map(move |joined, act, _| {
                let r = act.end_apply(&weights, joined, paused_at.elapsed());
                drop(guard);
                r
            }))
        }))
    }

    /// Takes the model's policy (and its verification) for an apply (its requests queue
    /// until [`Self::end_apply`]).
    fn begin_apply(&mut self, weights: &WeightSet) -> Result<(P, Option<ServedHashes>)> {
        let model = weights.model();
        let slot = self.slot(model)?;
        if weights.version() <= slot.version {
            return Err(stale(model, weights.version(), slot.version));
        }
        let policy = slot.policy.take().ok_or_else(|| lost(model))?;
        slot.applying = true;
        Ok((policy, slot.verify.take()))
    }

    /// Gives the policy back, records the version when the apply succeeded, and answers the
    /// requests that queued meanwhile.
    fn end_apply(
        &mut self,
        weights: &WeightSet,
        joined: std::result::Result<ApplyJob<P>, actix_rt::task::JoinError>,
        paused: Duration,
    ) -> Result<Applied> {
        let model = weights.model().clone();
        let slot = self.slot(&model)?;
        slot.applying = false;
        let mut damaged = None;
        let applied = match joined {
            Ok(job) => {
                slot.policy = Some(job.policy);
                slot.verify = job.verify;
                damaged = job.damaged.map(|d| d.to_string());
                if job.applied.is_ok() {
                    slot.version = weights.version();
                }
                job.applied
            }
            Err(e) => {
                // the policy went down with the thread: the model cannot serve any more
                for (_, tx) in std::mem::take(&mut slot.queued) {
                    let _ = tx.send(Err(lost(&model)));
                }
                Err(Error::Actor(format!(
                    "the weight apply of model `{model}` failed on its thread: {e}"
                )))
            }
        };
        self.drain(&model);
        // the pause spans an await, so it is recorded as a sample, not as an entered span
        match &applied {
            Ok(()) => metrics::engine_loaded(model.as_str(), weights.version().0, paused),
            Err(_) => {
                metrics::record(Phase::EnginePause, "engine", model.as_str(), paused);
                metrics::failed(Side::Engine, "engine");
            }
        }
        if let Some(d) = &damaged {
            tracing::error!(model = %model, "the weights served before v{} changed since they were applied: {d}", weights.version());
        }
        applied?;
        self.stats.loads += 1;
        self.stats.paused_total += paused;
        self.stats.paused_max = self.stats.paused_max.max(paused);
        Ok(Applied { paused, damaged })
    }
}

/// What an apply answers.
#[derive(Debug)]
struct Applied {
    /// How long the model was paused.
    paused: Duration,
    /// `verify = "hashes"`: how the weights served before this version differed from the
    /// version applied (the apply replaced them whole).
    damaged: Option<String>,
}

/// What the apply thread gives back.
struct ApplyJob<P> {
    policy: P,
    verify: Option<ServedHashes>,
    applied: Result<()>,
    damaged: Option<Damage>,
}

/// Applies `weights` to `policy` on the apply thread; with `verify`, hashes what it served
/// before (damage is reported, the apply goes on: it replaces the weights whole) and what it
/// serves after (an apply that did not land whole fails).
fn apply_verified<P: Policy>(
    mut policy: P,
    mut verify: Option<ServedHashes>,
    weights: &WeightSet,
) -> ApplyJob<P> {
    let damaged = verify.as_mut().and_then(|v| v.check(&policy).err());
    let apply = |w: &WeightSet, p: &mut P| ArenaStrategy.apply(w, p).map_err(Error::Runtime);
    let applied = match verify.as_mut() {
        None => apply(weights, &mut policy),
        Some(v) => v.apply(weights, &mut policy, apply).map_err(|e| match e {
            Unverified::Apply(e) => e,
            e => Error::Actor(e.to_string()),
        }),
    };
    ApplyJob {
        policy,
        verify,
        applied,
        damaged,
    }
}

fn lost(model: &ModelId) -> Error {
    Error::Actor(format!(
        "model `{model}` cannot serve: an earlier weight apply failed on its thread"
    ))
}

impl<P: Policy + Unpin + 'static> Actor for InferenceEngine<P> {
    type Context = Context<Self>;
}

impl<P: Policy + Unpin + 'static> Handler<ActBatch> for InferenceEngine<P> {
    type Result = ResponseFuture<Result<ActedBatch>>;

    fn handle(&mut self, msg: ActBatch, _: &mut Context<Self>) -> Self::Result {
        let paused = self.paused;
        let applying = match self.slot(&msg.model) {
            Ok(slot) => slot.applying,
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        if paused || applying {
            let msg_model = msg.model.clone();
            let (tx, rx) = oneshot::channel();
            match self.slot(&msg.model) {
                Ok(slot) => slot.queued.push_back((msg, tx)),
                Err(e) => return Box::pin(async move { Err(e) }),
            }
            let (deadline, model) = (self.queue_deadline, msg_model);
            return Box::pin(async move {
                match tokio::time::timeout(deadline, rx).await {
                    Ok(answer) => {
                        answer.map_err(|_| Error::Actor("inference engine stopped".into()))?
                    }
                    Err(_) => Err(Error::Runtime(refit_runtime::Error::Timeout {
                        what: format!(
                            "the inference engine to serve model `{model}` (its requests queue \
                             while it is paused or its weights are applied)"
                        ),
                        after: deadline,
                    })),
                }
            });
        }
        let r = self.act_now(&msg);
        Box::pin(async move { r })
    }
}

impl<P: Policy + Unpin + 'static> Handler<Act> for InferenceEngine<P> {
    type Result = ResponseFuture<Result<Acted>>;

    fn handle(&mut self, msg: Act, ctx: &mut Context<Self>) -> Self::Result {
        let req = ActBatch {
            model: self.default.clone(),
            obs: msg.obs,
            epoch: None,
            greedy: false,
        };
        let fut = <Self as Handler<ActBatch>>::handle(self, req, ctx);
        Box::pin(async move {
            let b = fut.await?;
            let out = b
                .actions
                .first()
                .copied()
                .ok_or_else(|| Error::Actor("engine answered no action".into()))?;
            Ok(Acted {
                out,
                version: b.version,
            })
        })
    }
}

impl<P: Policy + Unpin + 'static> Handler<Pause> for InferenceEngine<P> {
    type Result = ();
    fn handle(&mut self, _: Pause, _: &mut Context<Self>) {
        self.paused = true;
    }
}

impl<P: Policy + Unpin + 'static> Handler<Continue> for InferenceEngine<P> {
    type Result = ();
    fn handle(&mut self, _: Continue, _: &mut Context<Self>) {
        self.paused = false;
        let models: Vec<ModelId> = self.models.keys().cloned().collect();
        for m in &models {
            self.drain(m);
        }
    }
}

impl<P: Policy + Unpin + 'static> Handler<CancelInFlight> for InferenceEngine<P> {
    type Result = u64;
    fn handle(&mut self, _: CancelInFlight, _: &mut Context<Self>) -> u64 {
        self.epoch += 1;
        let epoch = self.epoch;
        for slot in self.models.values_mut() {
            for (req, tx) in std::mem::take(&mut slot.queued) {
                if req.epoch.is_some() {
                    self.stats.cancelled += 1;
                    let _ = tx.send(Err(Error::Cancelled { epoch }));
                } else {
                    slot.queued.push_back((req, tx));
                }
            }
        }
        epoch
    }
}

impl<P: Policy + Unpin + 'static> Handler<LoadWeights> for InferenceEngine<P> {
    type Result = ResponseActFuture<Self, Result<Version>>;
    fn handle(&mut self, msg: LoadWeights, _: &mut Context<Self>) -> Self::Result {
        let version = msg.weights.version();
        Box::pin(self.apply(msg.weights).map(move |r, _, _| {
            let applied = r?;
            match applied.damaged {
                // the version is served whole now; what was served before it was not
                Some(d) => Err(Error::Actor(format!(
                    "v{version} applied, but the weights served before it had changed since \
                     they were applied: {d}"
                ))),
                None => Ok(version),
            }
        }))
    }
}

impl<P: Policy + Unpin + 'static> StagedEngine for InferenceEngine<P> {
    type Held = Held;

    fn holds(&mut self) -> &mut Holds<Held> {
        &mut self.holds
    }

    fn staged_total(&mut self) -> &mut Duration {
        &mut self.stats.staged_total
    }

    fn served(&self, model: &ModelId) -> Result<Version> {
        self.models
            .get(model)
            .map(|s| s.version)
            .ok_or_else(|| Error::Runtime(refit_runtime::Error::UnknownModel(model.clone())))
    }

    /// Fetches `version` (or newer) of `model` through its inlet on a blocking thread,
    /// under the model's inlet lock (`held`'s, else taken here, FIFO, by `deadline`).
    fn stage(
        &mut self,
        model: &ModelId,
        version: Version,
        deadline: Instant,
        held: Option<Held>,
    ) -> StagingFuture<Self> {
        let inlet = match self.slot(model).map(|s| s.inlet.clone()) {
            Ok(Some(inlet)) => inlet,
            Ok(None) => {
                let e = Error::Config(format!(
                    "model `{model}` has no inlet on this engine (push weights with LoadWeights)"
                ));
                return Box::pin(fut::ready((Err(e), Duration::ZERO)));
            }
            Err(e) => return Box::pin(fut::ready((Err(e), Duration::ZERO))),
        };
        let started = Instant::now();
        let fetch_model = model.clone();
        let stage = async move {
            // The per-model lock: loads of one model are serialised, FIFO.
            let mut guard =
                load_lock(held.map(|h| h.guard), &inlet, &fetch_model, deadline).await?;
            let fetched = actix_rt::task::spawn_blocking(move || {
                let left = deadline.saturating_duration_since(Instant::now());
                let r = guard
                    .fetch(&fetch_model, version, left)
                    .map_err(Error::from);
                (guard, r)
            })
            .await;
            fetched.map_err(|e| Error::Actor(format!("weight fetch thread failed: {e}")))
        };
        let model = model.clone();
        Box::pin(stage.into_actor(self).map(move |fetched, act, _| {
            let staged = started.elapsed();
            let current = act.slot(&model).map(|s| s.version);
            let r = match (fetched, current) {
                (Ok((guard, Ok(weights))), Ok(current)) if weights.version() > current => {
                    Ok(Stage::New(Held {
                        weights,
                        guard,
                        staged,
                    }))
                }
                // a newer version already landed through an earlier load
                (Ok((_, Ok(_))), Ok(current)) => Ok(Stage::Served(current)),
                (Ok((_, Err(e))), _) | (Err(e), _) | (_, Err(e)) => Err(e),
            };
            (r, staged)
        }))
    }

    /// Applies the staged weights (the model paused), then acknowledges them to the sender
    /// under the inlet lock (an ack means served: the requests that queued during the
    /// apply were answered by it first).
    fn commit(
        &mut self,
        model: ModelId,
        held: Held,
        _deadline: Instant,
    ) -> ResponseActFuture<Self, Result<LoadReport>> {
        let Held {
            weights,
            guard,
            staged,
        } = held;
        Box::pin(self.apply(weights).then(move |paused, act, _| {
            let served = act.slot(&model).map(|s| s.version);
            let (applied, version, mut guard) = match (paused, served) {
                (Ok(a), Ok(v)) => (a, v, guard),
                (Err(e), _) | (_, Err(e)) => {
                    return Box::pin(fut::ready(Err(e))) as ResponseActFuture<_, _>;
                }
            };
            let acked = model.clone();
            let ack = actix_rt::task::spawn_blocking(move || guard.applied(&acked, version));
            Box::pin(ack.into_actor(act).map(move |joined, _, _| {
                joined.map_err(|e| Error::Actor(format!("weight ack thread failed: {e}")))??;
                Ok(LoadReport {
                    model,
                    version,
                    staged,
                    paused: applied.paused,
                    damaged: applied.damaged,
                })
            }))
        }))
    }
}

weight_plane_handlers!(impl[P: Policy + Unpin + 'static] InferenceEngine<P>);

impl<P: Policy + Unpin + 'static> Handler<ServedVersion> for InferenceEngine<P> {
    type Result = MessageResult<ServedVersion>;
    fn handle(&mut self, _: ServedVersion, _: &mut Context<Self>) -> Self::Result {
        MessageResult(
            self.models
                .get(&self.default)
                .map_or(Version::ZERO, |s| s.version),
        )
    }
}

impl<P: Policy + Unpin + 'static> Handler<ServedVersions> for InferenceEngine<P> {
    type Result = MessageResult<ServedVersions>;
    fn handle(&mut self, _: ServedVersions, _: &mut Context<Self>) -> Self::Result {
        MessageResult(
            self.models
                .iter()
                .map(|(m, s)| (m.clone(), s.version))
                .collect(),
        )
    }
}

impl<P: Policy + Unpin + 'static> Handler<GetEngineStats> for InferenceEngine<P> {
    type Result = MessageResult<GetEngineStats>;
    fn handle(&mut self, _: GetEngineStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.stats.clone())
    }
}
