//! Any [`Generator`] (Refit's CPU transformer, the bigram) as an [`EngineBackend`]: the
//! backend a topology can use to run a backend engine rank without Python, and the
//! reference the contract's tests hold other backends to.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use refit_runtime::{Manifest, ModelId, Version, WeightSet};

use crate::error::{Error, Result};
use crate::generation::{Completion, Generator, PauseMode};
use crate::protocol::engine::{Generate, Score};
use crate::scheduler::{RequestId, Scheduler, SchedulerConfig};

use super::EngineBackend;

/// One model of a [`GeneratorBackend`].
struct Served<G: Generator> {
    manifest: Arc<Manifest>,
    /// Stages beside the decoding (a second instance of the same model).
    stager: Mutex<G>,
    staged: Mutex<Option<(Arc<G::Weights>, Version)>>,
    scheduler: Mutex<Scheduler<G>>,
    /// The version whose interrupt ends the model's requests, until its commit or abort
    /// (read between decoding steps).
    interrupted: Mutex<Option<Version>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Generators as a backend: each model's requests of a batch are decoded together
/// (continuous batching inside the batch), each token labelled with the version that made
/// it.
pub struct GeneratorBackend<G: Generator> {
    models: BTreeMap<ModelId, Served<G>>,
}

impl<G: Generator> std::fmt::Debug for GeneratorBackend<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GeneratorBackend")
            .field("models", &self.models.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl<G: Generator> GeneratorBackend<G> {
    /// A backend of no model yet.
    #[must_use]
    pub fn new() -> Self {
        Self {
            models: BTreeMap::new(),
        }
    }

    /// Serves `model` with `generator`, staging with `stager` (a second instance of the
    /// same model), decoding at most `max_batch` sequences at once.
    ///
    /// # Errors
    /// [`Error::Config`] naming the model: given twice, or a scheduler that cannot run
    /// the generator.
    pub fn with_model(
        mut self,
        model: ModelId,
        generator: G,
        stager: G,
        max_batch: usize,
    ) -> Result<Self> {
        if self.models.contains_key(&model) {
            return Err(Error::Config(format!("model `{model}` is given twice")));
        }
        let manifest = generator.manifest();
        let cfg = SchedulerConfig::new(model.clone(), max_batch, PauseMode::Keep);
        let served = Served {
            manifest,
            stager: Mutex::new(stager),
            staged: Mutex::new(None),
            scheduler: Mutex::new(Scheduler::new(generator, cfg)?),
            interrupted: Mutex::new(None),
        };
        self.models.insert(model, served);
        Ok(self)
    }

    fn model(&self, model: &ModelId) -> Result<&Served<G>> {
        self.models
            .get(model)
            .ok_or_else(|| Error::Config(format!("model `{model}` is not served by this backend")))
    }

    /// Runs `submit` for each request on its model's scheduler, then decodes every model's
    /// requests to their end (or until an interrupt of the model ends them): one answer
    /// per request, in order.
    fn run<R>(
        &self,
        batch: &[R],
        model_of: impl Fn(&R) -> &ModelId,
        submit: impl Fn(&mut Scheduler<G>, &R) -> refit_rl::Result<RequestId>,
    ) -> Vec<Result<Completion>> {
        let mut answers: Vec<Option<Result<Completion>>> = batch.iter().map(|_| None).collect();
        for (model, served) in &self.models {
            let mut scheduler = lock(&served.scheduler);
            let mut ids: BTreeMap<RequestId, usize> = BTreeMap::new();
            for (i, req) in batch.iter().enumerate() {
                if model_of(req) != model {
                    continue;
                }
                match submit(&mut scheduler, req) {
                    Ok(id) => {
                        ids.insert(id, i);
                    }
                    Err(e) => answers[i] = Some(Err(e.into())),
                }
            }
            while !ids.is_empty() && scheduler.has_work() {
                // read apart: the lock is not held during the step (an interrupt waits for it)
                let interrupted = *lock(&served.interrupted);
                let ended = match interrupted {
                    Some(by) => scheduler
                        .abort(by)
                        .into_iter()
                        .map(|(id, c)| (id, Ok(c)))
                        .collect(),
                    None => scheduler.step().finished,
                };
                for (id, answer) in ended {
                    if let Some(i) = ids.remove(&id) {
                        answers[i] = Some(answer.map_err(Error::from));
                    }
                }
            }
        }
        answers
            .into_iter()
            .zip(batch)
            .map(|(a, req)| {
                a.unwrap_or_else(|| {
                    Err(Error::Config(format!(
                        "model `{}` is not served by this backend, or has no weights yet",
                        model_of(req)
                    )))
                })
            })
            .collect()
    }
}

impl<G: Generator> Default for GeneratorBackend<G> {
    fn default() -> Self {
        Self::new()
    }
}

impl<G: Generator> EngineBackend for GeneratorBackend<G> {
    fn name(&self) -> String {
        "generator".into()
    }

    fn manifest(&self, model: &ModelId) -> Result<Arc<Manifest>> {
        Ok(Arc::clone(&self.model(model)?.manifest))
    }

    fn stage(&self, weights: Arc<WeightSet>) -> Result<()> {
        let served = self.model(weights.model())?;
        let staged = lock(&served.stager).stage(&weights)?;
        *lock(&served.staged) = Some((Arc::new(staged), weights.version()));
        Ok(())
    }

    fn commit(&self, model: &ModelId, version: Version) -> Result<Option<Duration>> {
        let served = self.model(model)?;
        lock(&served.interrupted).take();
        let staged = lock(&served.staged).take();
        let Some((weights, v)) = staged.filter(|(_, v)| *v == version) else {
            return Err(Error::Generator {
                model: model.to_string(),
                reason: format!("v{version} is not the version staged"),
            });
        };
        let mut scheduler = lock(&served.scheduler);
        scheduler.offer(weights, v)?;
        // nothing runs during a commit: the swap is made at this step's boundary
        let swap = scheduler.step().swap;
        match swap {
            Some(s) if s.to == version => Ok(None),
            _ => Err(Error::Generator {
                model: model.to_string(),
                reason: format!("v{version} was offered but not swapped in"),
            }),
        }
    }

    fn abort(&self, model: &ModelId) {
        if let Ok(served) = self.model(model) {
            lock(&served.interrupted).take();
            lock(&served.staged).take();
        }
    }

    /// Read between two decoding steps of the running batch: its requests of `model` end
    /// there, aborted by `version`, until the commit (or abort) that follows.
    fn interrupt(&self, model: &ModelId, version: Version) {
        if let Ok(served) = self.model(model) {
            *lock(&served.interrupted) = Some(version);
        }
    }

    fn generate(
        &self,
        batch: &[Generate],
        _: &BTreeMap<ModelId, Version>,
    ) -> Vec<Result<Completion>> {
        self.run(
            batch,
            |r| &r.model,
            |s, r| s.submit(r.prompt.clone(), r.params, r.epoch),
        )
    }

    fn score(&self, batch: &[Score], _: &BTreeMap<ModelId, Version>) -> Vec<Result<Completion>> {
        self.run(
            batch,
            |r| &r.model,
            |s, r| s.score(r.prompt.clone(), r.tokens.clone(), r.temperature, r.epoch),
        )
    }
}
