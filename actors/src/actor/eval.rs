//! Validation: episodes run through the engine with every model, recording the version
//! that answered each request so the controller can check that an eval step saw every model
//! at the round's version.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::ModelId;

use crate::env::Env;
use crate::error::{Error, Result};
use crate::protocol::engine::ActBatch;
use crate::protocol::eval::{EvalReport, ModelEval, RunEval};

use super::rollout::VecEnv;

/// Builds evaluation environment `i` of a model.
type MakeEnv<E> = dyn Fn(&ModelId, usize) -> Result<E> + Send;

/// How long an evaluator waits for one answer of its engine by default (an acting
/// evaluator's batch of actions, a generating evaluator's completion).
pub const DEFAULT_EVAL_REQUEST_DEADLINE: Duration = Duration::from_secs(300);

/// Runs greedy validation episodes through an engine for each model.
pub struct Evaluator<E: Env> {
    engine: Recipient<ActBatch>,
    request_deadline: Duration,
    models: Vec<ModelId>,
    make_env: Box<MakeEnv<E>>,
    episodes: usize,
    seed: u64,
    max_steps: usize,
}

impl<E: Env> std::fmt::Debug for Evaluator<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Evaluator")
            .field("models", &self.models)
            .field("episodes", &self.episodes)
            .finish()
    }
}

impl<E: Env + Unpin + 'static> Evaluator<E> {
    /// An evaluator running `episodes` episodes (environments from `make_env(model, i)`)
    /// per model, each at most `max_steps` steps.
    pub fn new(
        engine: Recipient<ActBatch>,
        models: Vec<ModelId>,
        make_env: impl Fn(&ModelId, usize) -> Result<E> + Send + 'static,
        episodes: usize,
        max_steps: usize,
        seed: u64,
    ) -> Self {
        Self {
            engine,
            request_deadline: DEFAULT_EVAL_REQUEST_DEADLINE,
            models,
            make_env: Box::new(make_env),
            episodes: episodes.max(1),
            seed,
            max_steps: max_steps.max(1),
        }
    }
}

impl<E: Env> Evaluator<E> {
    /// Sets how long the evaluator waits for each batch of actions from its engine
    /// ([`DEFAULT_EVAL_REQUEST_DEADLINE`] unless set); past it the eval step fails with a
    /// timeout naming the model, and the evaluator takes the next step.
    #[must_use]
    pub fn with_request_deadline(mut self, deadline: Duration) -> Self {
        self.request_deadline = deadline;
        self
    }
}

impl<E: Env + Unpin + 'static> Actor for Evaluator<E> {
    type Context = Context<Self>;
}

impl<E: Env + Unpin + 'static> Handler<RunEval> for Evaluator<E> {
    type Result = ResponseFuture<Result<EvalReport>>;

    fn handle(&mut self, msg: RunEval, _: &mut Context<Self>) -> Self::Result {
        let runs: Result<Vec<(ModelId, Vec<E>)>> = self
            .models
            .iter()
            .map(|m| {
                let envs = (0..self.episodes)
                    .map(|i| (self.make_env)(m, i))
                    .collect::<Result<Vec<E>>>()?;
                Ok((m.clone(), envs))
            })
            .collect();
        let engine = self.engine.clone();
        let seed = self.seed.wrapping_add(msg.step.0 * 7919);
        let max_steps = self.max_steps;
        let deadline = self.request_deadline;
        Box::pin(async move {
            let runs = runs?;
            let mut models = BTreeMap::new();
            for (model, envs) in runs {
                let n = envs.len();
                let mut venv = VecEnv::new(envs, seed)?;
                let mut versions = BTreeSet::new();
                let mut returns: Vec<Option<f64>> = vec![None; n];
                for _ in 0..max_steps {
                    let acted = engine
                        .send(ActBatch {
                            model: model.clone(),
                            obs: venv.obs_flat(),
                            epoch: None,
                            greedy: true,
                        })
                        .timeout(deadline)
                        .await
                        .map_err(|e| match e {
                            MailboxError::Timeout => {
                                Error::Runtime(refit_runtime::Error::Timeout {
                                    what: format!(
                                        "the engine to act for the evaluation of model `{model}` \
                                     (step {})",
                                        msg.step
                                    ),
                                    after: deadline,
                                })
                            }
                            MailboxError::Closed => {
                                Error::Actor(format!("engine unreachable: {e}"))
                            }
                        })??;
                    versions.insert(acted.version);
                    for ep in venv.step(&acted.actions, acted.version, 0, None)? {
                        if returns[ep.env].is_none() {
                            returns[ep.env] = Some(ep.ret);
                        }
                    }
                    if returns.iter().all(Option::is_some) {
                        break;
                    }
                }
                let done: Vec<f64> = returns.iter().flatten().copied().collect();
                let mean_return = if done.is_empty() {
                    0.0
                } else {
                    done.iter().sum::<f64>() / done.len() as f64
                };
                models.insert(
                    model,
                    ModelEval {
                        versions,
                        mean_return,
                        episodes: done.len(),
                    },
                );
            }
            Ok(EvalReport {
                step: msg.step,
                models,
            })
        })
    }
}
