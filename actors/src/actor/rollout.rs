//! Rollout workers that act through an engine, and the trajectory pool that batches their
//! fragments through the staleness filter.

use std::collections::VecDeque;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::sync_policy::StalenessStats;
use refit_runtime::{ModelId, StalenessFilter, Version};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::batch::{Batch, EpisodeStats, Transition};
use crate::env::Env;
use crate::error::{Error, Result};
use crate::policy::ActionOut;

use super::controller::{Admission, AwaitRollout, BatchReady, RolloutDone, WeightSyncController};

use super::engine::ActBatch;

/// A vector of environments stepped together, with per-episode bookkeeping.
#[derive(Debug)]
pub(crate) struct VecEnv<E: Env> {
    envs: Vec<E>,
    obs: Vec<Vec<f32>>,
    ret: Vec<f64>,
    len: Vec<u32>,
    dim: usize,
}

impl<E: Env> VecEnv<E> {
    pub(crate) fn new(mut envs: Vec<E>, seed: u64) -> Result<Self> {
        let dim = envs
            .first()
            .map(Env::obs_dim)
            .ok_or_else(|| Error::Config("a rollout needs at least one environment".into()))?;
        let obs = envs
            .iter_mut()
            .enumerate()
            .map(|(i, e)| e.reset(Some(seed.wrapping_add(i as u64))))
            .collect::<Result<Vec<_>>>()?;
        let n = envs.len();
        Ok(Self {
            envs,
            obs,
            ret: vec![0.0; n],
            len: vec![0; n],
            dim,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.envs.len()
    }

    pub(crate) fn obs_flat(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len() * self.dim);
        for o in &self.obs {
            out.extend_from_slice(o);
        }
        out
    }

    /// Starts fresh episodes everywhere (after a cancellation).
    pub(crate) fn reset_all(&mut self) -> Result<()> {
        for (i, e) in self.envs.iter_mut().enumerate() {
            self.obs[i] = e.reset(None)?;
            self.ret[i] = 0.0;
            self.len[i] = 0;
        }
        Ok(())
    }

    /// Applies one action per environment; records transitions into `out` when given and
    /// answers the episodes that ended.
    pub(crate) fn step(
        &mut self,
        actions: &[ActionOut],
        version: Version,
        worker: usize,
        mut out: Option<&mut Batch>,
    ) -> Result<Vec<EpisodeStats>> {
        if actions.len() != self.len() {
            return Err(Error::Actor(format!(
                "engine answered {} actions for {} environments",
                actions.len(),
                self.len()
            )));
        }
        let mut ended = Vec::new();
        for (i, (env, a)) in self.envs.iter_mut().zip(actions).enumerate() {
            let r = env
                .step(a.action)
                .map_err(|e| Error::env(i, e.to_string()))?;
            self.ret[i] += f64::from(r.reward);
            let step = self.len[i];
            self.len[i] += 1;
            let done = r.done();
            if let Some(out) = out.as_deref_mut() {
                out.transitions.push(Transition {
                    obs: std::mem::take(&mut self.obs[i]),
                    action: a.action,
                    log_prob: a.log_prob,
                    reward: r.reward,
                    next_obs: r.obs.clone(),
                    terminated: r.terminated,
                    truncated: r.truncated,
                    traj_id: None,
                    version,
                    worker,
                    env: i,
                    step,
                });
                out.frames += 1;
            }
            if done {
                ended.push(EpisodeStats {
                    traj_id: None,
                    ret: self.ret[i],
                    len: self.len[i],
                    worker,
                    env: i,
                    version,
                });
                self.obs[i] = env.reset(None)?;
                self.ret[i] = 0.0;
                self.len[i] = 0;
            } else {
                self.obs[i] = r.obs;
            }
        }
        if let Some(out) = out {
            out.episodes.extend(ended.iter().cloned());
        }
        Ok(ended)
    }
}

/// A fragment for the pool, with the admission that let it run.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "()")]
pub struct PushFragment {
    /// The fragment's transitions and ended episodes.
    pub fragment: Batch,
    /// The controller's answer to the status check that started it.
    pub admission: Admission,
}

/// Starts the worker's fragment loop.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct StartRollouts;

/// Stops the worker after its current fragment; answers what it did.
#[derive(Debug, Message)]
#[rtype(result = "RolloutStats")]
pub struct StopRollouts;

/// What a rollout worker did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RolloutStats {
    /// Fragments pushed to the pool.
    pub fragments: u64,
    /// Fragments abandoned because their episodes were cancelled.
    pub cancelled: u64,
    /// Time spent blocked at the status check.
    pub blocked: Duration,
    /// Status checks that had to wait.
    pub blocked_checks: u64,
    /// The error that stopped the worker, if one did.
    pub error: Option<String>,
}

/// Settings of a rollout worker.
#[derive(Debug, Clone)]
pub struct RolloutConfig {
    /// The model it acts with.
    pub model: ModelId,
    /// Its index (stamped on transitions).
    pub worker: usize,
    /// Steps per fragment (each step acts on every environment).
    pub fragment_steps: usize,
    /// Seed of the environments' first resets.
    pub seed: u64,
    /// Deadline of each engine request (a `Pause` never followed by `Continue` shows here)
    /// and of handing a fragment to the pool: past it the worker stops with
    /// [`refit_runtime::Error::Timeout`] in its [`RolloutStats::error`].
    pub timeout: Duration,
}

/// How a rollout worker reaches the weight-sync controller: the two messages it sends, as
/// recipients, so that a controller in another process (through
/// [`RemoteAddr::recipient`](crate::remote::RemoteAddr::recipient)) fits as well as a local
/// one.
#[derive(Debug, Clone)]
pub struct ControllerLink {
    /// The status check that waits.
    pub await_rollout: Recipient<AwaitRollout>,
    /// The end of an admitted rollout.
    pub done: Recipient<RolloutDone>,
}

impl ControllerLink {
    /// The link to a controller of this process.
    pub fn of(controller: &Addr<WeightSyncController>) -> Self {
        Self {
            await_rollout: controller.clone().recipient(),
            done: controller.clone().recipient(),
        }
    }
}

impl From<Addr<WeightSyncController>> for ControllerLink {
    fn from(controller: Addr<WeightSyncController>) -> Self {
        Self::of(&controller)
    }
}

impl From<&Addr<WeightSyncController>> for ControllerLink {
    fn from(controller: &Addr<WeightSyncController>) -> Self {
        Self::of(controller)
    }
}

/// Steps a vector of environments with actions from an engine: before each fragment it
/// asks the controller (blocking as the sync mode says), and pushes each finished fragment
/// to the pool. A fragment whose episode is cancelled is dropped and the environments reset.
pub struct RolloutWorker<E: Env> {
    cfg: RolloutConfig,
    envs: Option<VecEnv<E>>,
    engine: Recipient<ActBatch>,
    controller: ControllerLink,
    pool: Recipient<PushFragment>,
    running: bool,
    stats: RolloutStats,
}

impl<E: Env> std::fmt::Debug for RolloutWorker<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RolloutWorker")
            .field("model", &self.cfg.model)
            .field("worker", &self.cfg.worker)
            .field("stats", &self.stats)
            .finish()
    }
}

impl<E: Env + Unpin + 'static> RolloutWorker<E> {
    /// A worker over `envs`, acting through `engine`, admitted by `controller` (an
    /// `&Addr<WeightSyncController>` or a [`ControllerLink`]), pushing to `pool`.
    ///
    /// # Errors
    /// [`Error::Config`] with no environments or zero steps per fragment; reset failures.
    pub fn new(
        cfg: RolloutConfig,
        envs: Vec<E>,
        engine: Recipient<ActBatch>,
        controller: impl Into<ControllerLink>,
        pool: Recipient<PushFragment>,
    ) -> Result<Self> {
        let controller = controller.into();
        if cfg.fragment_steps == 0 {
            return Err(Error::Config("fragment_steps must be at least 1".into()));
        }
        Ok(Self {
            envs: Some(VecEnv::new(envs, cfg.seed)?),
            cfg,
            engine,
            controller,
            pool,
            running: false,
            stats: RolloutStats::default(),
        })
    }

    fn next_fragment(&mut self, ctx: &mut Context<Self>) {
        if !self.running {
            return;
        }
        let Some(mut envs) = self.envs.take() else {
            return;
        };
        let cfg = self.cfg.clone();
        let engine = self.engine.clone();
        let controller = self.controller.clone();
        let pool = self.pool.clone();
        let work = async move {
            let r = run_fragment(&cfg, &mut envs, &engine, &controller, &pool).await;
            // The controller learns the fragment is over only after the pool has it.
            controller.done.do_send(RolloutDone {
                model: cfg.model.clone(),
            });
            (envs, r)
        };
        ctx.spawn(work.into_actor(self).map(|(envs, r), act, ctx| {
            act.envs = Some(envs);
            match r {
                Ok(outcome) => {
                    act.stats.blocked += outcome.waited;
                    act.stats.blocked_checks += u64::from(!outcome.waited.is_zero());
                    if outcome.cancelled {
                        act.stats.cancelled += 1;
                    } else {
                        act.stats.fragments += 1;
                    }
                    ctx.notify(NextFragment);
                }
                Err(e) => {
                    tracing::error!(worker = act.cfg.worker, model = %act.cfg.model, "rollout worker stops: {e}");
                    act.stats.error = Some(e.to_string());
                    act.running = false;
                }
            }
        }));
    }
}

struct Outcome {
    waited: Duration,
    cancelled: bool,
}

async fn run_fragment<E: Env>(
    cfg: &RolloutConfig,
    envs: &mut VecEnv<E>,
    engine: &Recipient<ActBatch>,
    controller: &ControllerLink,
    pool: &Recipient<PushFragment>,
) -> Result<Outcome> {
    let admission = controller
        .await_rollout
        .send(AwaitRollout {
            model: cfg.model.clone(),
        })
        .await
        .map_err(|e| Error::Actor(format!("controller unreachable: {e}")))??;
    let mut fragment = Batch::default();
    let mut generation = None;
    for _ in 0..cfg.fragment_steps {
        let asked = engine
            .send(ActBatch {
                model: cfg.model.clone(),
                obs: envs.obs_flat(),
                generation,
                greedy: false,
            })
            .timeout(cfg.timeout)
            .await
            .map_err(|e| {
                unanswered(
                    e,
                    cfg.timeout,
                    format!("the engine to act for model `{}`", cfg.model),
                )
            })?;
        let acted = match asked {
            Ok(a) => a,
            Err(Error::Cancelled { .. }) => {
                envs.reset_all()?;
                return Ok(Outcome {
                    waited: admission.waited,
                    cancelled: true,
                });
            }
            Err(e) => return Err(e),
        };
        generation = Some(acted.generation);
        envs.step(
            &acted.actions,
            acted.version,
            cfg.worker,
            Some(&mut fragment),
        )?;
    }
    let waited = admission.waited;
    pool.send(PushFragment {
        fragment,
        admission,
    })
    .timeout(cfg.timeout)
    .await
    .map_err(|e| {
        unanswered(
            e,
            cfg.timeout,
            format!("the trajectory pool of model `{}`", cfg.model),
        )
    })?;
    Ok(Outcome {
        waited,
        cancelled: false,
    })
}

/// A request that got no answer: past its deadline, or to an actor that stopped.
pub(super) fn unanswered(e: MailboxError, after: Duration, what: String) -> Error {
    match e {
        MailboxError::Timeout => Error::Runtime(refit_runtime::Error::Timeout { what, after }),
        MailboxError::Closed => Error::Actor(format!("{what}: it stopped")),
    }
}

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct NextFragment;

impl<E: Env + Unpin + 'static> Actor for RolloutWorker<E> {
    type Context = Context<Self>;
}

impl<E: Env + Unpin + 'static> Handler<NextFragment> for RolloutWorker<E> {
    type Result = ();
    fn handle(&mut self, _: NextFragment, ctx: &mut Context<Self>) {
        self.next_fragment(ctx);
    }
}

impl<E: Env + Unpin + 'static> Handler<StartRollouts> for RolloutWorker<E> {
    type Result = ();
    fn handle(&mut self, _: StartRollouts, ctx: &mut Context<Self>) {
        if !self.running {
            self.running = true;
            self.next_fragment(ctx);
        }
    }
}

impl<E: Env + Unpin + 'static> Handler<StopRollouts> for RolloutWorker<E> {
    type Result = MessageResult<StopRollouts>;
    fn handle(&mut self, _: StopRollouts, _: &mut Context<Self>) -> Self::Result {
        self.running = false;
        MessageResult(self.stats.clone())
    }
}

/// Waits until the pool holds a batch for a trainer at `train_version`, without taking it.
#[derive(Debug, Message)]
#[rtype(result = "Result<usize>")]
pub struct AwaitBatch {
    /// The trainer's version (staleness is counted against it).
    pub train_version: Version,
    /// Deadline.
    pub timeout: Duration,
}

/// Takes fragments, oldest first, once at least a batch is there: whole fragments until
/// the batch size is reached, or every fragment with `all`.
#[derive(Debug, Message)]
#[rtype(result = "Result<PoolBatch>")]
pub struct TakeBatch {
    /// The trainer's version (staleness is counted against it).
    pub train_version: Version,
    /// Take every fragment (`sync` mode, after draining: all of them are on-policy).
    pub all: bool,
    /// Deadline.
    pub timeout: Duration,
}

/// A batch out of the pool.
#[derive(Debug, Clone)]
pub struct PoolBatch {
    /// The transitions; each fragment is its own stream (`worker` holds the fragment's
    /// number in the pool, so advantage estimation never runs across a dropped or
    /// cancelled fragment).
    pub batch: Batch,
    /// Samples dropped as too stale while this batch was gathered.
    pub dropped: u64,
    /// Samples evicted because the pool was full while this batch was gathered.
    pub evicted: u64,
    /// Largest staleness in this batch.
    pub max_staleness: u64,
    /// The fragments of this batch: their admissions and sample versions.
    pub fragments: Vec<FragmentInfo>,
    /// Everything the filter saw so far.
    pub totals: StalenessStats,
}

/// One fragment of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FragmentInfo {
    /// The controller's admission that started it.
    pub admission: Admission,
    /// Lowest and highest version that acted in it.
    pub versions: (Version, Version),
    /// Frames it holds.
    pub frames: usize,
}

/// A trainer waiting on the pool: to know a batch is there, or to take it.
enum Want {
    Ready(oneshot::Sender<Result<usize>>),
    Take {
        all: bool,
        tx: oneshot::Sender<Result<PoolBatch>>,
    },
}

struct Waiting {
    id: u64,
    want: Want,
}

/// Gathers fragments into batches for one model's trainer; drops samples older than the
/// allowed staleness (counted) and tells the controller when a batch is ready. A sample is a
/// transition, or a generated sequence, whose staleness is its oldest token's (a stale
/// sequence is dropped whole).
pub struct TrajectoryPool {
    model: ModelId,
    batch_frames: usize,
    filter: StalenessFilter,
    train_version: Version,
    fragments: VecDeque<(Batch, Admission)>,
    dropped_since_take: u64,
    evicted_since_take: u64,
    evicted_total: u64,
    capacity: usize,
    controller: Option<Recipient<BatchReady>>,
    ready_sent: bool,
    waiting: Vec<Waiting>,
    next_id: u64,
    next_stream: usize,
}

impl std::fmt::Debug for TrajectoryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrajectoryPool")
            .field("model", &self.model)
            .field("frames", &self.frames())
            .field("stats", self.filter.stats())
            .finish()
    }
}

impl TrajectoryPool {
    /// A pool handing out batches of at least `batch_frames` frames, dropping samples more
    /// than `max_staleness` versions behind the trainer.
    pub fn new(
        model: ModelId,
        batch_frames: usize,
        max_staleness: Option<u64>,
        controller: Option<Recipient<BatchReady>>,
    ) -> Self {
        Self {
            model,
            batch_frames: batch_frames.max(1),
            filter: StalenessFilter::new(max_staleness),
            train_version: Version::ZERO,
            fragments: VecDeque::new(),
            dropped_since_take: 0,
            evicted_since_take: 0,
            evicted_total: 0,
            capacity: batch_frames.max(1) * 2,
            controller,
            ready_sent: false,
            waiting: Vec::new(),
            next_id: 0,
            next_stream: 0,
        }
    }

    /// Holds at most `batches` batches of frames; older fragments are evicted.
    #[must_use]
    pub fn with_capacity_batches(mut self, batches: u64) -> Self {
        let b = usize::try_from(batches.max(1)).unwrap_or(usize::MAX);
        self.capacity = self.batch_frames.saturating_mul(b);
        self
    }

    /// Samples evicted so far because the pool was full.
    pub fn evicted(&self) -> u64 {
        self.evicted_total
    }

    fn evict(&mut self) {
        let mut frames = self.frames();
        while frames > self.capacity && self.fragments.len() > 1 {
            if let Some((b, _)) = self.fragments.pop_front() {
                frames -= b.frames;
                self.evicted_since_take += b.frames as u64;
                self.evicted_total += b.frames as u64;
            }
        }
    }

    fn frames(&self) -> usize {
        self.fragments.iter().map(|(b, _)| b.frames).sum()
    }

    /// Drops (and counts) samples too old for the trainer's version.
    fn prune(&mut self) {
        let Some(max) = self.filter.max() else {
            return;
        };
        let train = self.train_version;
        let Self {
            fragments,
            filter,
            dropped_since_take,
            ..
        } = self;
        for (b, _) in fragments.iter_mut() {
            let before = b.transitions.len();
            b.transitions.retain(|t| {
                let keep = StalenessFilter::staleness(t.version, train) <= max;
                if !keep {
                    filter.admit(t.version, train, 1);
                }
                keep
            });
            // a generated sequence is as stale as its oldest token; it goes whole
            let before_seqs = b.sequences.len();
            b.sequences.retain(|s| {
                let Some(oldest) = s.oldest_version() else {
                    return true;
                };
                let keep = StalenessFilter::staleness(oldest, train) <= max;
                if !keep {
                    filter.admit(oldest, train, 1);
                }
                keep
            });
            let dropped = before - b.transitions.len() + before_seqs - b.sequences.len();
            *dropped_since_take += dropped as u64;
            b.frames = b.frames.saturating_sub(dropped);
        }
        fragments.retain(|(b, _)| b.frames > 0);
    }

    /// Tells the controller, once per batch, that a batch is ready.
    fn announce_ready(&mut self) {
        if self.frames() >= self.batch_frames && !self.ready_sent {
            self.ready_sent = true;
            if let Some(c) = &self.controller {
                c.do_send(BatchReady {
                    model: self.model.clone(),
                });
            }
        }
    }

    fn serve(&mut self) {
        self.prune();
        if self.frames() < self.batch_frames {
            return;
        }
        self.announce_ready();
        for w in std::mem::take(&mut self.waiting) {
            match w.want {
                Want::Ready(tx) => {
                    let _ = tx.send(Ok(self.frames()));
                }
                // an earlier take in this loop may have emptied the pool
                Want::Take { all, tx } if self.frames() >= self.batch_frames => {
                    let _ = tx.send(Ok(self.take(all)));
                }
                want @ Want::Take { .. } => self.waiting.push(Waiting { id: w.id, want }),
            }
        }
    }

    fn take(&mut self, all: bool) -> PoolBatch {
        let train = self.train_version;
        let mut parts = Vec::with_capacity(self.fragments.len());
        let mut fragments = Vec::with_capacity(self.fragments.len());
        let mut max_staleness = 0;
        let mut frames = 0;
        while let Some((mut b, adm)) = self.fragments.pop_front() {
            if !all && frames >= self.batch_frames {
                self.fragments.push_front((b, adm));
                break;
            }
            frames += b.frames;
            let stream = self.next_stream;
            self.next_stream += 1;
            for t in &mut b.transitions {
                let s = StalenessFilter::staleness(t.version, train);
                max_staleness = max_staleness.max(s);
                self.filter.admit(t.version, train, 1);
                t.worker = stream;
            }
            // generated sequences keep their worker index (GRPO groups by `group`)
            for seq in &b.sequences {
                if let Some(oldest) = seq.oldest_version() {
                    let s = StalenessFilter::staleness(oldest, train);
                    max_staleness = max_staleness.max(s);
                    self.filter.admit(oldest, train, 1);
                }
            }
            if let Some(versions) = b.version_range() {
                fragments.push(FragmentInfo {
                    admission: adm,
                    versions,
                    frames: b.frames,
                });
            }
            parts.push(b);
        }
        self.ready_sent = false;
        // after a partial take, a full batch may already be waiting
        self.announce_ready();
        PoolBatch {
            batch: Batch::concat(parts),
            dropped: std::mem::take(&mut self.dropped_since_take),
            evicted: std::mem::take(&mut self.evicted_since_take),
            max_staleness,
            fragments,
            totals: self.filter.stats().clone(),
        }
    }

    /// Queues `want` with a deadline, then serves what can be served now.
    fn enqueue(
        &mut self,
        train_version: Version,
        want: Want,
        timeout: Duration,
        ctx: &mut Context<Self>,
    ) {
        self.train_version = self.train_version.max(train_version);
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push(Waiting { id, want });
        ctx.run_later(timeout, move |act, _| {
            let Some(i) = act.waiting.iter().position(|w| w.id == id) else {
                return;
            };
            let w = act.waiting.swap_remove(i);
            let e = Error::Runtime(refit_runtime::Error::Timeout {
                what: format!(
                    "a batch of {} frames for model `{}` (the pool holds {})",
                    act.batch_frames,
                    act.model,
                    act.frames()
                ),
                after: timeout,
            });
            match w.want {
                Want::Ready(tx) => drop(tx.send(Err(e))),
                Want::Take { tx, .. } => drop(tx.send(Err(e))),
            }
        });
        self.serve();
    }
}

async fn answer<T>(rx: oneshot::Receiver<Result<T>>) -> Result<T> {
    rx.await
        .map_err(|_| Error::Actor("trajectory pool stopped".into()))?
}

impl Actor for TrajectoryPool {
    type Context = Context<Self>;
}

impl Handler<PushFragment> for TrajectoryPool {
    type Result = ();
    fn handle(&mut self, msg: PushFragment, _: &mut Context<Self>) {
        if msg.fragment.frames > 0 {
            self.fragments.push_back((msg.fragment, msg.admission));
        }
        self.evict();
        self.serve();
    }
}

impl Handler<AwaitBatch> for TrajectoryPool {
    type Result = ResponseFuture<Result<usize>>;
    fn handle(&mut self, msg: AwaitBatch, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.enqueue(msg.train_version, Want::Ready(tx), msg.timeout, ctx);
        Box::pin(answer(rx))
    }
}

impl Handler<TakeBatch> for TrajectoryPool {
    type Result = ResponseFuture<Result<PoolBatch>>;
    fn handle(&mut self, msg: TakeBatch, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        let want = Want::Take { all: msg.all, tx };
        self.enqueue(msg.train_version, want, msg.timeout, ctx);
        Box::pin(answer(rx))
    }
}
