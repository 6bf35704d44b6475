//! Build: per model a learner and a policy from the roles, checked against each other and
//! the environment, joined by one connected scheme (the trainer's outlet, the engine's
//! inlet) that already carries version 1.

use std::sync::Arc;

use refit_runtime::topology::{Reach, TransportKind};
use refit_runtime::{Manifests, ReceiverInit, SenderInit, Version};
use refit_transports::link::{self, LinkOptions};

use crate::error::{Error, Result};
use crate::link::WeightInlet;
use crate::roles::{Roles, check_fit};

use super::RunConfig;
use crate::actor::engine::InferenceEngine;
use crate::actor::workers::Trainer;

/// What [`build`] makes.
pub(super) struct Built<R: Roles> {
    /// The engine (not started) holding every model's policy and inlet.
    pub(super) engine: InferenceEngine<R::Policy>,
    /// Each model's trainer, in `cfg.models` order.
    pub(super) trainers: Vec<actix::Addr<Trainer>>,
}

/// The engine and the trainers of a run, one connected scheme per model between them.
///
/// # Errors
/// A policy that does not fit its environment, a learner whose exports the policy cannot
/// load or whose first export is not version 1 of its model (named by model); a scheme that
/// does not connect within `cfg.wait`.
pub(super) fn build<R: Roles>(cfg: &RunConfig, roles: &R) -> Result<Built<R>> {
    // Trainers, their outlets, and the engine's inlets: one in-process scheme per model.
    let mut engine = InferenceEngine::<R::Policy>::empty(cfg.seed);
    let mut trainers = Vec::new();
    for spec in &cfg.models {
        let mut learner = roles.learner(spec)?;
        let policy = roles.policy(spec)?;
        check_fit(&spec.id, &roles.env(spec, cfg.seed)?, &policy)?;
        let served = refit_runtime::HasWeights::weight_manifest(&policy)?;
        served.check_same_schema(&spec.id, &learner.manifest())?;
        let initial = learner.export()?;
        if initial.model() != &spec.id {
            return Err(Error::ModelMismatch {
                expected: spec.id.to_string(),
                found: initial.model().to_string(),
            });
        }
        if initial.version() != Version(1) {
            return Err(Error::Config(format!(
                "the learner of model `{}` exported its first weights as v{} (a fresh learner exports v1)",
                spec.id,
                initial.version()
            )));
        }
        let manifests = Manifests::new([(spec.id.clone(), Arc::clone(initial.manifest()))])?;
        // both ends in this process: the link factory's nearest transport that stays in one
        let opened = link::for_kind(&TransportKind::Nearest(Reach::Process))?
            .open(&manifests, &LinkOptions::default())?;
        let receiver = ReceiverInit::new(
            opened.spec.receiver(&LinkOptions::default())?,
            Some(manifests.clone()),
        );
        let wait = cfg.wait;
        let (sender, receiver) = std::thread::scope(|s| {
            let r = s.spawn(move || receiver.connect(wait));
            let sender = SenderInit::new(opened.sender, manifests).connect(vec![initial], wait);
            let receiver = r
                .join()
                .map_err(|_| refit_runtime::Error::State("receiver connect thread panicked"))?;
            Ok::<_, refit_runtime::Error>((sender?, receiver?))
        })?;
        let mut inlet: Box<dyn WeightInlet> = Box::new(receiver);
        if let Some(wrap) = &cfg.wrap_inlet {
            inlet = wrap(inlet);
        }
        engine = engine.with_model(spec.id.clone(), policy, Some(inlet))?;
        trainers.push(Trainer::start_with_outlet(learner, Box::new(sender)));
    }
    Ok(Built { engine, trainers })
}
