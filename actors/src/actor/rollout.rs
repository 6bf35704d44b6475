//! Rollout workers that step environments with actions from an engine.

use std::time::Duration;

use actix::prelude::*;
use refit_runtime::{ModelId, Version};

use crate::batch::{Batch, EpisodeStats, Observation, Transition};
use crate::env::Env;
use crate::error::{Error, Result};
use crate::policy::ActionOut;
use crate::protocol::controller::{AwaitRollout, ControllerLink, RolloutDone};
use crate::protocol::engine::ActBatch;
use crate::protocol::pool::PushFragment;
use crate::protocol::rollout::{GetRolloutStats, RolloutStats, StartRollouts, StopRollouts};

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
                    obs: Observation::from(std::mem::take(&mut self.obs[i])),
                    action: a.action,
                    log_prob: a.log_prob,
                    reward: r.reward,
                    next_obs: Observation::from_slice(&r.obs),
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
            let fragment = run_fragment(&cfg, &mut envs, &engine, &controller, &pool);
            let r = then_done(&controller, &cfg.model, fragment).await;
            (envs, r)
        };
        ctx.spawn(work.into_actor(self).map(|(envs, r), act, ctx| {
            act.envs = Some(envs);
            if settle(
                &mut act.stats,
                &mut act.running,
                &act.cfg.model,
                act.cfg.worker,
                r,
            ) {
                ctx.notify(NextFragment);
            }
        }));
    }
}

/// How one rollout fragment ended (any rollout worker's).
pub(crate) struct Outcome {
    /// How long its admission waited.
    pub(crate) waited: Duration,
    /// Its episodes were cancelled; nothing went to the pool.
    pub(crate) cancelled: bool,
}

/// Runs `fragment`, then tells the controller it is over: only after the pool has it (or
/// after it failed), so the controller never counts a fragment done that is still coming.
pub(crate) async fn then_done(
    controller: &ControllerLink,
    model: &ModelId,
    fragment: impl std::future::Future<Output = Result<Outcome>>,
) -> Result<Outcome> {
    let r = fragment.await;
    controller.done.do_send(RolloutDone {
        model: model.clone(),
    });
    r
}

/// Records how a fragment ended in a worker's statistics; answers whether the worker goes
/// on (an error stops it, kept in its statistics and logged).
pub(crate) fn settle(
    stats: &mut RolloutStats,
    running: &mut bool,
    model: &ModelId,
    worker: usize,
    r: Result<Outcome>,
) -> bool {
    match r {
        Ok(outcome) => {
            stats.blocked += outcome.waited;
            stats.blocked_checks += u64::from(!outcome.waited.is_zero());
            if outcome.cancelled {
                stats.cancelled += 1;
            } else {
                stats.fragments += 1;
            }
            *running
        }
        Err(e) => {
            refit_runtime::unless_stopping!(error, worker, model = %model, "rollout worker stops: {e}");
            stats.error = Some(e.to_string());
            *running = false;
            false
        }
    }
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
            engine: None,
        })
        .await
        .map_err(|e| Error::Actor(format!("controller unreachable: {e}")))??;
    let mut fragment = Batch::default();
    let mut epoch = None;
    for _ in 0..cfg.fragment_steps {
        let asked = engine
            .send(ActBatch {
                model: cfg.model.clone(),
                obs: envs.obs_flat(),
                epoch,
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
        epoch = Some(acted.epoch);
        envs.step(
            &acted.actions,
            acted.version,
            cfg.worker,
            Some(&mut fragment),
        )?;
    }
    let waited = admission.waited;
    deliver(pool, fragment, admission, cfg.timeout, &cfg.model).await?;
    Ok(Outcome {
        waited,
        cancelled: false,
    })
}

/// Hands a collected fragment to the model's trajectory pool, within `timeout`.
pub(crate) async fn deliver(
    pool: &Recipient<PushFragment>,
    fragment: Batch,
    admission: crate::protocol::controller::Admission,
    timeout: Duration,
    model: &ModelId,
) -> Result<()> {
    pool.send(PushFragment {
        fragment,
        admission,
    })
    .timeout(timeout)
    .await
    .map_err(|e| {
        unanswered(
            e,
            timeout,
            format!("the trajectory pool of model `{model}`"),
        )
    })
}

/// A request that got no answer: past its deadline, or to an actor that stopped.
pub(crate) fn unanswered(e: MailboxError, after: Duration, what: String) -> Error {
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

impl<E: Env + Unpin + 'static> Handler<GetRolloutStats> for RolloutWorker<E> {
    type Result = MessageResult<GetRolloutStats>;
    fn handle(&mut self, _: GetRolloutStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.stats.clone())
    }
}

impl<E: Env + Unpin + 'static> Handler<StopRollouts> for RolloutWorker<E> {
    type Result = MessageResult<StopRollouts>;
    fn handle(&mut self, _: StopRollouts, _: &mut Context<Self>) -> Self::Result {
        self.running = false;
        MessageResult(self.stats.clone())
    }
}
