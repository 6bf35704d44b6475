//! Rollout workers that step environments with actions from an engine.

use std::future::Future;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::{ModelId, Version};

use crate::batch::{Batch, EpisodeStats, Observation, Transition};
use crate::env::Env;
use crate::error::{Error, Result};
use crate::policy::ActionOut;
use crate::protocol::controller::{AwaitRollout, ControllerLink};
use crate::protocol::engine::ActBatch;
use crate::protocol::pool::PushFragment;

use super::fragments::{FragmentLoop, Fragments, Outcome, deliver};

/// A vector of environments stepped together, with per-episode bookkeeping (an acting
/// rollout worker's state).
#[derive(Debug)]
pub struct VecEnv<E: Env> {
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
            .collect::<refit_rl::Result<Vec<_>>>()?;
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
                .map_err(|e| refit_rl::Error::env(i, e.to_string()))?;
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
    /// [`refit_runtime::Error::Timeout`] in its
    /// [`RolloutStats::error`](crate::protocol::rollout::RolloutStats::error).
    pub timeout: Duration,
}

/// What an acting rollout worker collects: steps of a vector of environments with actions
/// from an engine. Before each fragment it asks the controller (blocking as the sync mode
/// says), and pushes each finished fragment to the pool. A fragment whose episode is
/// cancelled is dropped and the environments reset.
pub struct ActingFragments<E> {
    cfg: RolloutConfig,
    engine: Recipient<ActBatch>,
    _envs: std::marker::PhantomData<fn() -> E>,
}

impl<E> std::fmt::Debug for ActingFragments<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActingFragments")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl<E> Clone for ActingFragments<E> {
    fn clone(&self) -> Self {
        Self {
            cfg: self.cfg.clone(),
            engine: self.engine.clone(),
            _envs: std::marker::PhantomData,
        }
    }
}

impl<E: Env + Unpin + 'static> Fragments for ActingFragments<E> {
    type State = VecEnv<E>;
    const KIND: &'static str = "RolloutWorker";

    fn model(&self) -> &ModelId {
        &self.cfg.model
    }

    fn worker(&self) -> usize {
        self.cfg.worker
    }

    fn run(
        &self,
        envs: &mut VecEnv<E>,
        controller: &ControllerLink,
        pool: &Recipient<PushFragment>,
    ) -> impl Future<Output = Result<Outcome>> {
        run_fragment(&self.cfg, envs, &self.engine, controller, pool)
    }
}

/// Steps a vector of environments with actions from an engine ([`ActingFragments`]).
pub type RolloutWorker<E> = FragmentLoop<ActingFragments<E>>;

impl<E: Env + Unpin + 'static> FragmentLoop<ActingFragments<E>> {
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
        if cfg.fragment_steps == 0 {
            return Err(Error::Config("fragment_steps must be at least 1".into()));
        }
        let envs = VecEnv::new(envs, cfg.seed)?;
        let fragments = ActingFragments {
            cfg,
            engine,
            _envs: std::marker::PhantomData,
        };
        Ok(Self::with(fragments, envs, controller.into(), pool))
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
                Error::unanswered(
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
