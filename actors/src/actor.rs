//! The actix actors of a topology: [`InferenceEngine`] (serves actions; pause, load
//! weights, continue), [`CollectorWorker`] (collects batches with a [`Collector`]),
//! [`Trainer`] (PPO updates that publish new weights) and [`WeightSyncController`] (moves a
//! new version to every engine and worker and waits for their acknowledgements).
//!
//! Actix stays inside this module: the rest of the crate, the runtime and the transports are
//! plain Rust. CPU-heavy actors (collection, training) run on their own threads
//! (`SyncArbiter`) so they never block an arbiter's event loop.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use refit_runtime::{ArenaStrategy, ModelId, Strategy, Version, WeightSet};
use tokio::sync::oneshot;

use crate::batch::Batch;
use crate::collector::{Collector, UpdatePolicyWeights};
use crate::env::Env;
use crate::error::{Error, Result};
use crate::policy::{ActionOut, Policy};
use crate::ppo::{PpoStats, PpoTrainer};

/// Asks an engine for an action.
#[derive(Debug, Message)]
#[rtype(result = "Result<Acted>")]
pub struct Act {
    /// The observation.
    pub obs: Vec<f32>,
}

/// An action and the weights version that chose it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Acted {
    /// The action and its log-probability.
    pub out: ActionOut,
    /// The version of the weights that acted.
    pub version: Version,
}

/// Pauses generation: `Act` requests queue until [`Continue`].
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Pause;

/// Resumes generation and answers the queued requests.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Continue;

/// Loads a new version (validated whole first; a refused version leaves the served one).
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<Version>")]
pub struct LoadWeights {
    /// The weights.
    pub weights: Arc<WeightSet>,
}

/// Asks which version is served.
#[derive(Debug, Message)]
#[rtype(result = "Version")]
pub struct ServedVersion;

fn stale(model: &ModelId, offered: Version, current: Version) -> Error {
    Error::Runtime(refit_runtime::Error::StaleVersion {
        model: model.clone(),
        offered,
        current,
    })
}

/// Applies `weights` to `policy` if newer than `current`, all or nothing.
fn load_into<P: Policy>(
    policy: &mut P,
    current: &mut Version,
    weights: &WeightSet,
) -> Result<Version> {
    if weights.version() <= *current {
        return Err(stale(weights.model(), weights.version(), *current));
    }
    ArenaStrategy.apply(weights, policy)?;
    *current = weights.version();
    Ok(*current)
}

/// Serves actions for a policy; can pause, load weights and continue.
pub struct InferenceEngine<P: Policy> {
    policy: P,
    version: Version,
    paused: bool,
    queued: VecDeque<(Vec<f32>, oneshot::Sender<Result<Acted>>)>,
    rng: SmallRng,
}

impl<P: Policy> std::fmt::Debug for InferenceEngine<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InferenceEngine")
            .field("version", &self.version)
            .field("paused", &self.paused)
            .field("queued", &self.queued.len())
            .finish()
    }
}

impl<P: Policy + Unpin + 'static> InferenceEngine<P> {
    /// An engine serving `policy` (version 0 until weights load).
    pub fn new(policy: P, seed: u64) -> Self {
        Self {
            policy,
            version: Version::ZERO,
            paused: false,
            queued: VecDeque::new(),
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    fn act(&mut self, obs: &[f32]) -> Result<Acted> {
        let dim = self
            .policy
            .weight_manifest()?
            .tensors()
            .first()
            .map(|t| t.shape[t.shape.len() - 1]);
        if dim.is_some_and(|d| d != obs.len()) {
            return Err(Error::Config(format!(
                "observation of length {} does not fit the policy's input {dim:?}",
                obs.len()
            )));
        }
        Ok(Acted {
            out: self.policy.act(obs, &mut self.rng),
            version: self.version,
        })
    }
}

impl<P: Policy + Unpin + 'static> Actor for InferenceEngine<P> {
    type Context = Context<Self>;
}

impl<P: Policy + Unpin + 'static> Handler<Act> for InferenceEngine<P> {
    type Result = ResponseFuture<Result<Acted>>;

    fn handle(&mut self, msg: Act, _: &mut Context<Self>) -> Self::Result {
        if self.paused {
            let (tx, rx) = oneshot::channel();
            self.queued.push_back((msg.obs, tx));
            return Box::pin(async move {
                rx.await
                    .map_err(|_| Error::Actor("inference engine stopped".into()))?
            });
        }
        let r = self.act(&msg.obs);
        Box::pin(async move { r })
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
        while let Some((obs, tx)) = self.queued.pop_front() {
            let _ = tx.send(self.act(&obs));
        }
    }
}

impl<P: Policy + Unpin + 'static> Handler<LoadWeights> for InferenceEngine<P> {
    type Result = Result<Version>;
    fn handle(&mut self, msg: LoadWeights, _: &mut Context<Self>) -> Result<Version> {
        load_into(&mut self.policy, &mut self.version, &msg.weights)
    }
}

impl<P: Policy + Unpin + 'static> Handler<ServedVersion> for InferenceEngine<P> {
    type Result = MessageResult<ServedVersion>;
    fn handle(&mut self, _: ServedVersion, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.version)
    }
}

/// Asks a worker for one batch.
#[derive(Debug, Message)]
#[rtype(result = "Result<Option<Batch>>")]
pub struct CollectBatch;

/// Collects batches with a [`Collector`] on its own thread.
pub struct CollectorWorker<E: Env, P: Policy> {
    collector: Collector<E, P>,
}

impl<E: Env, P: Policy> std::fmt::Debug for CollectorWorker<E, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollectorWorker")
            .field("frames", &self.collector.frames())
            .finish()
    }
}

impl<E: Env + Unpin + 'static, P: Policy + Unpin + 'static> CollectorWorker<E, P> {
    /// Starts a worker on its own thread; `make` builds the collector there.
    pub fn start(make: impl Fn() -> Collector<E, P> + Send + Sync + 'static) -> Addr<Self> {
        SyncArbiter::start(1, move || Self { collector: make() })
    }
}

impl<E: Env + Unpin + 'static, P: Policy + Unpin + 'static> Actor for CollectorWorker<E, P> {
    type Context = SyncContext<Self>;
}

impl<E: Env + Unpin + 'static, P: Policy + Unpin + 'static> Handler<CollectBatch>
    for CollectorWorker<E, P>
{
    type Result = Result<Option<Batch>>;
    fn handle(&mut self, _: CollectBatch, _: &mut SyncContext<Self>) -> Self::Result {
        self.collector.next_batch()
    }
}

impl<E: Env + Unpin + 'static, P: Policy + Unpin + 'static> Handler<LoadWeights>
    for CollectorWorker<E, P>
{
    type Result = Result<Version>;
    fn handle(&mut self, msg: LoadWeights, _: &mut SyncContext<Self>) -> Result<Version> {
        self.collector.update_weights((*msg.weights).clone())?;
        Ok(self.collector.policy_version())
    }
}

/// One PPO update on a batch; answers the stats and the new weights.
#[derive(Debug, Message)]
#[rtype(result = "Result<(PpoStats, Arc<WeightSet>)>")]
pub struct Train {
    /// The batch.
    pub batch: Batch,
}

/// The trainer actor (PPO with candle), on its own thread.
pub struct Trainer {
    ppo: PpoTrainer,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("version", &self.ppo.version())
            .finish()
    }
}

impl Trainer {
    /// Starts a trainer on its own thread; `make` builds it there.
    pub fn start(make: impl Fn() -> PpoTrainer + Send + Sync + 'static) -> Addr<Self> {
        SyncArbiter::start(1, move || Self { ppo: make() })
    }
}

impl Actor for Trainer {
    type Context = SyncContext<Self>;
}

impl Handler<Train> for Trainer {
    type Result = Result<(PpoStats, Arc<WeightSet>)>;
    fn handle(&mut self, msg: Train, _: &mut SyncContext<Self>) -> Self::Result {
        let stats = self.ppo.update(&msg.batch)?;
        Ok((stats, Arc::new(self.ppo.export()?)))
    }
}

/// Publishes a version to every registered engine and worker.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<Version>>")]
pub struct Publish {
    /// The weights.
    pub weights: Arc<WeightSet>,
}

/// Decides when weights move; here: every published version goes to every target, and the
/// controller waits (with a deadline) until each has loaded it. Sync modes, staleness and
/// validation cadence build on this.
pub struct WeightSyncController {
    targets: Vec<Recipient<LoadWeights>>,
    timeout: Duration,
    train_version: Version,
    rollout_version: Version,
}

impl std::fmt::Debug for WeightSyncController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightSyncController")
            .field("targets", &self.targets.len())
            .field("train_version", &self.train_version)
            .field("rollout_version", &self.rollout_version)
            .finish()
    }
}

impl WeightSyncController {
    /// A controller for these targets; each load must finish within `timeout`.
    pub fn new(targets: Vec<Recipient<LoadWeights>>, timeout: Duration) -> Self {
        Self {
            targets,
            timeout,
            train_version: Version::ZERO,
            rollout_version: Version::ZERO,
        }
    }
}

impl Actor for WeightSyncController {
    type Context = Context<Self>;
}

impl Handler<Publish> for WeightSyncController {
    type Result = ResponseActFuture<Self, Result<Vec<Version>>>;

    fn handle(&mut self, msg: Publish, _: &mut Context<Self>) -> Self::Result {
        let version = msg.weights.version();
        if version <= self.train_version {
            let e = stale(msg.weights.model(), version, self.train_version);
            return Box::pin(async move { Err(e) }.into_actor(self));
        }
        self.train_version = version;
        let sends: Vec<_> = self
            .targets
            .iter()
            .map(|t| {
                t.send(LoadWeights {
                    weights: Arc::clone(&msg.weights),
                })
                .timeout(self.timeout)
            })
            .collect();
        let fut = async move {
            let mut acked = Vec::with_capacity(sends.len());
            for (i, s) in sends.into_iter().enumerate() {
                let v = s.await.map_err(|e| {
                    Error::Actor(format!("target {i} did not load version {version}: {e}"))
                })??;
                acked.push(v);
            }
            Ok(acked)
        };
        Box::pin(fut.into_actor(self).map(move |res, act, _| {
            if res.is_ok() {
                act.rollout_version = version;
            }
            res
        }))
    }
}

/// Asks the controller for `(train_version, rollout_version)`.
#[derive(Debug, Message)]
#[rtype(result = "(Version, Version)")]
pub struct Versions;

impl Handler<Versions> for WeightSyncController {
    type Result = MessageResult<Versions>;
    fn handle(&mut self, _: Versions, _: &mut Context<Self>) -> Self::Result {
        MessageResult((self.train_version, self.rollout_version))
    }
}
