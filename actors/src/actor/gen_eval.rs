//! Validation of a generating topology: every held-out prompt of each model's task,
//! generated greedily through an engine and rewarded by the task, recording the version of
//! every token so the controller can check that an eval step saw every model at the round's
//! version.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::ModelId;

use crate::error::{Error, Result};
use crate::generation::SamplingParams;
use crate::task::Task;

use super::gen_rollout::generate_whole;
use crate::protocol::engine::Generate;
use crate::protocol::eval::{EvalReport, ModelEval, RunEval};

/// Completions ended by an update are generated again at most this many times.
const REGENERATIONS: u32 = 8;

/// Runs greedy validation generations through an engine for each model.
pub struct GenEvaluator<T: Task> {
    engine: Recipient<Generate>,
    tasks: Vec<(ModelId, Arc<Mutex<T>>)>,
    timeout: Duration,
}

impl<T: Task> std::fmt::Debug for GenEvaluator<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let models: Vec<_> = self.tasks.iter().map(|(m, _)| m).collect();
        f.debug_struct("GenEvaluator")
            .field("models", &models)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl<T: Task + Unpin> GenEvaluator<T> {
    /// An evaluator of each `(model, task)`, generating through `engine`; each request has
    /// the deadline `timeout`.
    pub fn new(engine: Recipient<Generate>, tasks: Vec<(ModelId, T)>, timeout: Duration) -> Self {
        Self {
            engine,
            tasks: tasks
                .into_iter()
                .map(|(m, t)| (m, Arc::new(Mutex::new(t))))
                .collect(),
            timeout,
        }
    }
}

fn lock<'a, T>(model: &ModelId, task: &'a Mutex<T>) -> Result<std::sync::MutexGuard<'a, T>> {
    task.lock().map_err(|_: PoisonError<_>| {
        Error::Actor(format!(
            "the task of model `{model}` panicked in an earlier call"
        ))
    })
}

/// Evaluates one model: every held-out prompt at once, greedy.
async fn evaluate<T: Task>(
    engine: Recipient<Generate>,
    model: ModelId,
    task: Arc<Mutex<T>>,
    timeout: Duration,
) -> Result<ModelEval> {
    let (prompts, sampling) = {
        let t = lock(&model, &task)?;
        (t.heldout(), t.sampling())
    };
    let params = SamplingParams {
        temperature: 0.0,
        seed: 0,
        ..sampling
    };
    let jobs: Vec<_> = prompts
        .iter()
        .map(|prompt| {
            let request = Generate {
                model: model.clone(),
                prompt: prompt.clone(),
                params,
                epoch: None,
            };
            actix_rt::spawn(generate_whole(
                engine.clone(),
                request,
                timeout,
                REGENERATIONS,
            ))
        })
        .collect();
    let mut versions = BTreeSet::new();
    let mut total = 0.0;
    let mut episodes = 0;
    for (prompt, job) in prompts.iter().zip(jobs) {
        let (completion, _) = job.await.map_err(|e| {
            Error::Actor(format!(
                "an evaluation request of model `{model}` failed on its task: {e}"
            ))
        })??;
        versions.extend(completion.versions.iter().copied());
        total += f64::from(
            lock(&model, &task)?
                .reward(prompt, &completion.tokens)?
                .total,
        );
        episodes += 1;
    }
    Ok(ModelEval {
        versions,
        mean_return: if episodes == 0 {
            0.0
        } else {
            total / episodes as f64
        },
        episodes,
    })
}

impl<T: Task + Unpin> Actor for GenEvaluator<T> {
    type Context = Context<Self>;
}

impl<T: Task + Unpin> Handler<RunEval> for GenEvaluator<T> {
    type Result = ResponseFuture<Result<EvalReport>>;

    fn handle(&mut self, msg: RunEval, _: &mut Context<Self>) -> Self::Result {
        let runs: Vec<_> = self
            .tasks
            .iter()
            .map(|(m, t)| {
                let job = evaluate(self.engine.clone(), m.clone(), Arc::clone(t), self.timeout);
                (m.clone(), actix_rt::spawn(job))
            })
            .collect();
        Box::pin(async move {
            let mut models = BTreeMap::new();
            for (model, run) in runs {
                let eval = run.await.map_err(|e| {
                    Error::Actor(format!("the evaluation of model `{model}` failed: {e}"))
                })??;
                models.insert(model, eval);
            }
            Ok(EvalReport {
                step: msg.step,
                models,
            })
        })
    }
}
