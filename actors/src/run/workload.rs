//! What a run hosts, behind one interface: the acting family (a [`Roles`] factory:
//! environments and policies) and the generating family (a
//! [`GenRoles`](crate::roles::GenRoles) factory: tasks and generators) plug into the same
//! rank runtime through [`Workload`]. The runtime never names an engine, a rollout worker
//! or an evaluator type: it asks the workload to start one and gets a typed reference.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::convert::Want;
use refit_runtime::sync_policy::PauseMode;
use refit_runtime::topology::{Apply, Verify};
use refit_runtime::{HasWeights, Manifest, ModelId, Version, WeightSet};

use crate::actor::engine::InferenceEngine;
use crate::actor::eval::Evaluator;
use crate::actor::gen_engine::{GenModel, GenerationEngine};
use crate::actor::gen_eval::GenEvaluator;
use crate::actor::gen_rollout::{GenRolloutConfig, GenRolloutWorker};
use crate::actor::rollout::{RolloutConfig, RolloutWorker};
use crate::error::{Error, Result};
use crate::generation::Generator;
use crate::learner::Learner;
use crate::link::WeightInlet;
use crate::protocol::controller::ControllerLink;
use crate::protocol::engine::{ActBatch, EngineHandle, Family, Generate};
use crate::protocol::eval::RunEval;
use crate::protocol::pool::PushFragment;
use crate::protocol::rollout::RolloutRef;
use crate::roles::{GenRoles, ModelSpec, Roles, check_fit};
use crate::task::Task;

/// How an engine is set up.
#[derive(Debug, Clone)]
pub struct EngineSetup {
    /// Seed of its sampling.
    pub seed: u64,
    /// What a generating engine does with sequences in flight at a swap.
    pub pause: PauseMode,
    /// How long a request may queue on an acting engine that is paused or applying weights
    /// before it is answered with a timeout.
    pub queue_deadline: Duration,
}

/// Where an evaluator asks for actions or completions (a route over the run's engines).
#[derive(Debug, Clone)]
pub struct Inference {
    /// Actions for observations.
    pub act: Recipient<ActBatch>,
    /// Completions for prompts.
    pub generate: Recipient<Generate>,
    /// How long the evaluator waits for each answer (a run gives its eval timeout).
    pub deadline: Duration,
}

/// An actor started on an arbiter of its own (stopped with the run).
#[derive(Debug)]
pub struct Started<T> {
    /// Its typed reference.
    pub handle: T,
    /// Its arbiter.
    pub arbiter: Arbiter,
}

// ANCHOR: workload
/// What a run hosts for each model: [`join`](super::join) and [`run`](super::run) wrap a
/// [`Roles`] factory (acting), [`join_generating`](super::join_generating) and
/// [`run_generating`](super::run_generating) a `GenRoles` factory (generating).
pub trait Workload: Send + Sync + 'static {
    /// A fresh learner for `model`.
    ///
    /// # Errors
    /// As the roles' learner.
    fn learner(&self, model: &ModelSpec) -> Result<Box<dyn Learner>>;

    /// False when this program never trains: its learner is another program's (an engine
    /// rank whose engine is a backend), so the launch check does not build one.
    fn hosts_learner(&self) -> bool {
        true
    }

    /// The layout the engines of `model` load.
    ///
    /// # Errors
    /// As the roles' policy or generator.
    fn engine_manifest(&self, model: &ModelSpec) -> Result<Arc<Manifest>>;

    /// The conversion from the learner's layout to the engines' that the roles ask for
    /// (a topology file's `[model.convert]` takes its place when given).
    ///
    /// # Errors
    /// As the roles.
    fn want(&self, model: &ModelSpec) -> Result<Option<Want>>;

    /// Checks `model`'s roles against each other before anything starts (a policy that
    /// does not fit its environment, a task that does not fit its generator).
    ///
    /// # Errors
    /// [`Error::Config`] naming the model and the mismatch.
    fn check(&self, model: &ModelSpec, seed: u64) -> Result<()>;

    /// Starts an engine serving `models` (each fed through its inlet), on an arbiter of its
    /// own.
    ///
    /// # Errors
    /// As the roles; a model served twice.
    fn start_engine(
        &self,
        models: Vec<(ModelSpec, Box<dyn WeightInlet>)>,
        setup: &EngineSetup,
    ) -> Result<Started<EngineHandle>>;

    /// Which requests its engines serve (how other ranks reach them).
    fn family(&self) -> Family;

    /// Starts one rollout worker of `model`, acting through `engine`, admitted through
    /// `controller`, pushing fragments to `pool`; it waits for `StartRollouts`.
    ///
    /// # Errors
    /// As the roles; a bad worker configuration.
    fn start_rollout(
        &self,
        model: &ModelSpec,
        cfg: RolloutConfig,
        engine: &EngineHandle,
        controller: ControllerLink,
        pool: Recipient<PushFragment>,
    ) -> Result<Started<RolloutRef>>;

    /// Starts the evaluator of `models` (`episodes` validation episodes or prompts each),
    /// asking `engines`.
    ///
    /// # Errors
    /// As the roles.
    fn start_evaluator(
        &self,
        models: &[ModelSpec],
        engines: Inference,
        episodes: usize,
        seed: u64,
    ) -> Result<Recipient<RunEval>>;
}
// ANCHOR_END: workload

impl<T> Started<T> {
    /// Starts `actor` on an arbiter (a thread) of its own, `handle` making its typed
    /// reference from its address.
    pub(crate) fn on_arbiter<A: Actor<Context = Context<A>> + Send>(
        actor: A,
        handle: impl FnOnce(&Addr<A>) -> T,
    ) -> Self {
        let arbiter = Arbiter::new();
        let addr = A::start_in_arbiter(&arbiter.handle(), move |_| actor);
        Self {
            handle: handle(&addr),
            arbiter,
        }
    }
}

/// A [`Roles`] factory as a workload: an [`InferenceEngine`] of its policies,
/// [`RolloutWorker`]s of its environments, an [`Evaluator`].
#[derive(Debug)]
pub(crate) struct Acting<R>(pub(crate) Arc<R>);

impl<R: Roles> Workload for Acting<R> {
    fn learner(&self, model: &ModelSpec) -> Result<Box<dyn Learner>> {
        Ok(self.0.learner(model)?)
    }

    fn engine_manifest(&self, model: &ModelSpec) -> Result<Arc<Manifest>> {
        Ok(Arc::new(self.0.policy(model)?.weight_manifest()?))
    }

    fn want(&self, _: &ModelSpec) -> Result<Option<Want>> {
        Ok(None)
    }

    fn check(&self, model: &ModelSpec, seed: u64) -> Result<()> {
        Ok(check_fit(
            &model.id,
            &self.0.env(model, seed)?,
            &self.0.policy(model)?,
        )?)
    }

    fn start_engine(
        &self,
        models: Vec<(ModelSpec, Box<dyn WeightInlet>)>,
        setup: &EngineSetup,
    ) -> Result<Started<EngineHandle>> {
        let mut engine = InferenceEngine::<R::Policy>::empty(setup.seed)
            .with_queue_deadline(setup.queue_deadline);
        for (spec, inlet) in models {
            staged_only(&spec, "acting")?;
            let policy = self.0.policy(&spec)?;
            engine = engine.with_model(spec.id.clone(), policy, Some(inlet))?;
            engine = engine.verify_served(&spec.id, spec.verify)?;
        }
        Ok(Started::on_arbiter(engine, EngineHandle::acting))
    }

    fn family(&self) -> Family {
        Family::Acting
    }

    fn start_rollout(
        &self,
        model: &ModelSpec,
        cfg: RolloutConfig,
        engine: &EngineHandle,
        controller: ControllerLink,
        pool: Recipient<PushFragment>,
    ) -> Result<Started<RolloutRef>> {
        let envs = (0..model.envs_per_worker)
            .map(|i| self.0.env(model, cfg.seed.wrapping_add(i as u64)))
            .collect::<refit_rl::Result<Vec<_>>>()?;
        let act = engine.act()?.act.clone();
        let worker = RolloutWorker::new(cfg, envs, act, controller, pool)?;
        Ok(Started::on_arbiter(worker, RolloutRef::local))
    }

    fn start_evaluator(
        &self,
        models: &[ModelSpec],
        engines: Inference,
        episodes: usize,
        seed: u64,
    ) -> Result<Recipient<RunEval>> {
        let ids = models.iter().map(|s| s.id.clone()).collect();
        let by_id: BTreeMap<ModelId, ModelSpec> =
            models.iter().map(|s| (s.id.clone(), s.clone())).collect();
        let roles = Arc::clone(&self.0);
        Ok(Evaluator::new(
            engines.act,
            ids,
            move |model, i| {
                let spec = by_id.get(model).ok_or_else(|| {
                    Error::Runtime(refit_runtime::Error::UnknownModel(model.clone()))
                })?;
                Ok(roles.env(
                    spec,
                    seed.wrapping_mul(31).wrapping_add(1_000_000 + i as u64),
                )?)
            },
            episodes,
            10_000,
            seed,
        )
        .with_request_deadline(engines.deadline)
        .start()
        .recipient())
    }
}

/// A [`GenRoles`] factory as a workload: a [`GenerationEngine`] of its generators,
/// [`GenRolloutWorker`]s of its tasks, a [`GenEvaluator`] on their held-out prompts.
#[derive(Debug)]
pub(crate) struct Generating<G>(pub(crate) Arc<G>);

impl<G: GenRoles> Workload for Generating<G> {
    fn learner(&self, model: &ModelSpec) -> Result<Box<dyn Learner>> {
        Ok(self.0.learner(model)?)
    }

    fn engine_manifest(&self, model: &ModelSpec) -> Result<Arc<Manifest>> {
        Ok(self.0.engine_shape(model)?.manifest)
    }

    fn want(&self, model: &ModelSpec) -> Result<Option<Want>> {
        Ok(self.0.want(model)?)
    }

    fn check(&self, model: &ModelSpec, seed: u64) -> Result<()> {
        // the model's params first: a typo there is named as such, not as a failure of
        // what reads them
        let engines = self.0.engine_shape(model)?;
        if model.verify >= Verify::Startup {
            let generator = self.0.generator(model).map_err(|e| {
                Error::Config(format!(
                    "verify = \"{}\" reads the weights served back through Refit's \
                     generator: {e}",
                    model.verify.as_str()
                ))
            })?;
            can_read_back(model, &generator)?;
        }
        let task = self.0.task(model, seed)?;
        if task.vocab_size() > engines.vocab {
            return Err(Error::Config(format!(
                "model `{}`: the task writes in {} tokens, the engines' model knows {}",
                model.id,
                task.vocab_size(),
                engines.vocab
            )));
        }
        let longest = task
            .heldout()
            .iter()
            .map(Vec::len)
            .max()
            .unwrap_or(0)
            .saturating_add(task.sampling().max_tokens as usize);
        if longest > engines.context {
            return Err(Error::Config(format!(
                "model `{}`: the task's prompts and answers need {longest} tokens of context, \
                 the engines' model holds {}",
                model.id, engines.context
            )));
        }
        Ok(())
    }

    fn start_engine(
        &self,
        models: Vec<(ModelSpec, Box<dyn WeightInlet>)>,
        setup: &EngineSetup,
    ) -> Result<Started<EngineHandle>> {
        let mut engine = GenerationEngine::<G::Generator>::new(setup.pause);
        for (spec, inlet) in models {
            staged_only(&spec, "generating")?;
            let generator = self.0.generator(&spec)?;
            let stager = self.0.generator(&spec)?;
            engine = engine.with_model(
                GenModel::new(spec.id.clone(), generator, stager)
                    .inlet(inlet)
                    .verify(spec.verify),
            )?;
            // ANCHOR: reference
            // the reference the workers score under: the model's own weights, refreshed
            // every `reference_every` versions
            if let Some(every) = spec.reference_every {
                let reference = GenModel::follower(
                    spec.reference_id()?,
                    self.0.generator(&spec)?,
                    spec.id.clone(),
                    every as u64,
                );
                engine = engine.with_model(reference)?;
            }
            // ANCHOR_END: reference
        }
        Ok(Started::on_arbiter(engine, EngineHandle::generating))
    }

    fn family(&self) -> Family {
        Family::Generating
    }

    fn start_rollout(
        &self,
        model: &ModelSpec,
        cfg: RolloutConfig,
        engine: &EngineHandle,
        controller: ControllerLink,
        pool: Recipient<PushFragment>,
    ) -> Result<Started<RolloutRef>> {
        let task = self.0.task(model, cfg.seed)?;
        let mut gen_cfg = GenRolloutConfig::new(cfg.model, cfg.worker);
        gen_cfg.prompts_per_fragment = model.prompts_per_fragment;
        gen_cfg.group_size = model.group_size;
        gen_cfg.seed = cfg.seed;
        gen_cfg.timeout = cfg.timeout;
        if model.reference_every.is_some() {
            gen_cfg.reference = Some(model.reference_id()?);
        }
        let requests = engine.generate()?;
        let worker =
            GenRolloutWorker::new(gen_cfg, task, requests.generate.clone(), controller, pool)?
                .scorer(requests.score.clone());
        Ok(Started::on_arbiter(worker, RolloutRef::local))
    }

    fn start_evaluator(
        &self,
        models: &[ModelSpec],
        engines: Inference,
        _episodes: usize,
        seed: u64,
    ) -> Result<Recipient<RunEval>> {
        let tasks = models
            .iter()
            .map(|m| Ok((m.id.clone(), self.0.task(m, seed.wrapping_add(7_777))?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(GenEvaluator::new(engines.generate, tasks, engines.deadline)
            .start()
            .recipient())
    }
}

/// The first weights of a learner of `spec`: version 1 of its own model when it is fresh,
/// the version after `resumed` when it was restored from a checkpoint of that version.
///
/// # Errors
/// The learner's export; weights of another model or version, naming both.
pub(crate) fn first_export(
    learner: &mut dyn Learner,
    spec: &ModelSpec,
    resumed: Option<Version>,
) -> Result<WeightSet> {
    let want = resumed.map_or(Version(1), Version::next);
    let first = learner.export()?;
    if first.model() != &spec.id || first.version() != want {
        let what = match resumed {
            None => "a fresh learner exports v1 of its own model".to_string(),
            Some(v) => format!("a learner restored at v{v} exports v{want} of its own model"),
        };
        return Err(Error::Config(format!(
            "the learner of model `{}` exported its first weights as model `{}` v{} ({what})",
            spec.id,
            first.model(),
            first.version(),
        )));
    }
    Ok(first)
}

/// Refuses a `verify` the generator cannot serve: it must read its serving weights back
/// ([`Generator::export`]), tried on a staged copy of zeros.
fn can_read_back<G: Generator>(model: &ModelSpec, generator: &G) -> Result<()> {
    let zeros = WeightSet::zeroed(model.id.clone(), generator.manifest());
    let staged = generator.stage(&zeros)?;
    generator.export(&staged, &mut zeros.clone()).map_err(|e| {
        Error::Config(format!(
            "model `{}`: verify = \"{}\" reads the weights served back, and {e}",
            model.id,
            model.verify.as_str()
        ))
    })
}

/// Refit's own engines stage every version: a model with `apply = "streaming"` is refused
/// where one of them would serve it (checked when the engine starts, since another rank's
/// engine may be a backend's that streams).
fn staged_only(spec: &ModelSpec, engine: &str) -> Result<()> {
    if spec.apply == Apply::Streaming {
        return Err(Error::Config(format!(
            "model `{}`: apply = \"streaming\", and Refit's {engine} engine stages every \
             version (streaming is offered by backend engines: the Python engine, vLLM's); \
             use apply = \"staged\"",
            spec.id
        )));
    }
    Ok(())
}
