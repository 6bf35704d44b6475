//! A rank whose engine is a backend ([`EngineBackend`]: vLLM, a Python object, any
//! generator): the roles' workload with the engine replaced, so that the rank keeps
//! everything else a rank does (the rendezvous, keepalive, restarts and rejoin, the
//! rollout workers of its models, the report) and the controller drives the backend's
//! engine through the same contract as Refit's own.

use std::sync::Arc;

use actix::prelude::*;
use refit_node::LaunchEnv;
use refit_runtime::convert::Want;
use refit_runtime::topology::{Apply, Topology, Verify};
use refit_runtime::{Manifest, ModelId};

use crate::actor::backend::{BackendEngine, EngineBackend};
use crate::actor::rollout::RolloutConfig;
use crate::error::{Error, Result};
use crate::learner::Learner;
use crate::link::WeightInlet;
use crate::protocol::controller::ControllerLink;
use crate::protocol::engine::{EngineHandle, Family};
use crate::protocol::eval::RunEval;
use crate::protocol::pool::PushFragment;
use crate::protocol::rollout::RolloutRef;
use crate::roles::{GenRoles, ModelSpec};

use super::workload::{EngineSetup, Generating, Inference, Started, Workload};
use super::{RunReport, join_workload};

/// Runs this rank's part of `topo` as [`join_generating`](super::join_generating) does,
/// except that its engine is a [`BackendEngine`] of `backend`: `roles` still make the
/// learners, tasks and evaluators (the rollout workers of an engine rank run the roles'
/// task against the backend's completions).
///
/// Blocking: it starts its own actix system.
///
/// # Errors
/// As [`join`](super::join); before anything starts, a model whose layout the backend
/// loads is not the one the roles' engines load (the link would deliver another layout),
/// or a model setting the backend cannot serve (`reference_every`, `verify` beyond
/// `names`), naming the model.
pub fn join_backend<G: GenRoles, B: EngineBackend>(
    topo: &Topology,
    launch: &LaunchEnv,
    roles: G,
    backend: B,
) -> Result<Option<RunReport>> {
    let work = Backed {
        roles: Generating(Arc::new(roles)),
        backend: Arc::new(backend),
    };
    join_workload(topo, launch, Arc::new(work))
}

/// The roles' workload with its engines replaced by a backend's.
struct Backed<G, B> {
    roles: Generating<G>,
    backend: Arc<B>,
}

impl<G: GenRoles, B: EngineBackend> Workload for Backed<G, B> {
    fn learner(&self, model: &ModelSpec) -> Result<Box<dyn Learner>> {
        self.roles.learner(model)
    }

    /// A backend's program is an engine rank's: the model's learner is another program's
    /// (a Python learner's, or Refit's trainer), checked by that program.
    fn hosts_learner(&self) -> bool {
        false
    }

    fn engine_manifest(&self, model: &ModelSpec) -> Result<Arc<Manifest>> {
        self.backend.manifest(&model.id)
    }

    fn want(&self, model: &ModelSpec) -> Result<Option<Want>> {
        self.roles.want(model)
    }

    /// The backend's own refusals first (they name what the backend does not do), then
    /// the roles' checks, then the layouts.
    fn check(&self, model: &ModelSpec, seed: u64) -> Result<()> {
        let name = self.backend.name();
        let refused = |what: String| Err(Error::Config(format!("model `{}`: {what}", model.id)));
        if model.reference_every.is_some() {
            return refused(format!(
                "params.reference_every asks the engines to serve a KL reference, and an engine \
                 of the {name} backend hosts no reference model yet (drop it, or use Refit's \
                 generating engine)"
            ));
        }
        if model.apply == Apply::Streaming && !self.backend.streams() {
            return refused(format!(
                "apply = \"streaming\" asks the engines to take versions in tensor by \
                 tensor, and the {name} engine does not (use \"staged\")"
            ));
        }
        if model.verify > Verify::Names {
            return refused(format!(
                "verify = \"{}\" reads the weights served back, which the {name} engine does \
                 not (use \"off\" or \"names\")",
                model.verify.as_str()
            ));
        }
        self.roles.check(model, seed)?;
        let (theirs, ours) = (
            self.backend.manifest(&model.id)?,
            self.roles.engine_manifest(model)?,
        );
        if theirs.schema_hash() != ours.schema_hash() {
            return refused(format!(
                "the {name} engine loads another layout than the roles' engines ({} tensors \
                 against {}; first difference: {})",
                theirs.tensors().len(),
                ours.tensors().len(),
                first_difference(&theirs, &ours)
            ));
        }
        Ok(())
    }

    fn start_engine(
        &self,
        models: Vec<(ModelSpec, Box<dyn WeightInlet>)>,
        setup: &EngineSetup,
    ) -> Result<Started<EngineHandle>> {
        let streamed: Vec<ModelId> = models
            .iter()
            .filter(|(s, _)| s.apply == Apply::Streaming)
            .map(|(s, _)| s.id.clone())
            .collect();
        let inlets: Vec<(ModelId, Box<dyn WeightInlet>)> =
            models.into_iter().map(|(s, i)| (s.id, i)).collect();
        let mut engine =
            BackendEngine::new(Arc::clone(&self.backend), inlets)?.pause_mode(setup.pause);
        for model in &streamed {
            engine = engine.streamed(model)?;
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
        self.roles
            .start_rollout(model, cfg, engine, controller, pool)
    }

    fn start_evaluator(
        &self,
        models: &[ModelSpec],
        engines: Inference,
        episodes: usize,
        seed: u64,
    ) -> Result<Recipient<RunEval>> {
        self.roles.start_evaluator(models, engines, episodes, seed)
    }
}

/// The first tensor in which two layouts differ, for a message.
fn first_difference(a: &Manifest, b: &Manifest) -> String {
    let (ta, tb) = (a.tensors(), b.tensors());
    for (x, y) in ta.iter().zip(tb) {
        if x.name != y.name || x.dtype != y.dtype || x.shape != y.shape {
            return format!(
                "`{}` {:?} {:?} against `{}` {:?} {:?}",
                x.name, x.dtype, x.shape, y.name, y.dtype, y.shape
            );
        }
    }
    match ta.len().cmp(&tb.len()) {
        std::cmp::Ordering::Greater => format!("`{}` is extra", ta[tb.len()].name),
        std::cmp::Ordering::Less => format!("`{}` is missing", tb[ta.len()].name),
        std::cmp::Ordering::Equal => "the same tensors, another order or offsets".into(),
    }
}
