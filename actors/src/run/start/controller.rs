//! The controller's starter: rank 0 starts the weight-sync controller, one gate per
//! engine rank (its way to the controller) and the run's lead, and serves them; every
//! other rank reaches them on rank 0's node.

use std::collections::BTreeMap;
use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::actor::controller::WeightSyncController;
use crate::error::Result;
use crate::protocol::controller::{ControllerLink, ControllerRef};
use crate::protocol::lead::LeadRef;
use crate::remote::RemoteAddr;
use crate::run::checkpoint;
use crate::run::gate::RankGate;
use crate::run::ids::{RANK_LOG, Served, actor_id};
use crate::run::lead::{Lead, LeadSetup};

use super::{Evaluating, RankCtx};

/// What rank 0 keeps to lead the run.
pub(crate) struct Leading {
    /// The weight-sync controller.
    pub(crate) controller: Addr<WeightSyncController>,
    /// The run's lead.
    pub(crate) lead: Addr<Lead>,
    /// Every engine rank's gate.
    pub(crate) gates: BTreeMap<u32, Addr<RankGate>>,
    /// Answered once every driver is done, or the run must end.
    pub(crate) done: oneshot::Receiver<Result<()>>,
}

/// The controller and the lead as this rank reaches them (local on rank 0), and on rank 0
/// what it keeps to lead.
pub(crate) struct Heads {
    /// The controller.
    pub(crate) controller: ControllerRef,
    /// The run's lead.
    pub(crate) lead: LeadRef,
    /// Rank 0's own actors; `None` on the other ranks.
    pub(crate) leading: Option<Leading>,
    /// The evaluator of another rank than 0, kept for the rank's life (rank 0's goes to
    /// its controller and lead).
    pub(crate) _evaluating: Option<Evaluating>,
}

/// Rank 0: starts and serves the controller (asking `eval`'s evaluator), the gates and
/// the lead. The other ranks: references to them on rank 0's node.
///
/// # Errors
/// A controller configuration the controller refuses.
pub(crate) fn start(ctx: &RankCtx, eval: Evaluating) -> Result<Heads> {
    if ctx.me != 0 {
        let at = |kind, name: &str| {
            RemoteAddr::new(
                ctx.lead_peer.clone(),
                actor_id(kind, 0, 0, 0),
                name,
                ctx.call,
            )
        };
        return Ok(Heads {
            controller: ControllerRef::remote(&at(Served::Controller, "controller")),
            lead: LeadRef::remote(&at(Served::Lead, "the run's lead")),
            leading: None,
            _evaluating: Some(eval),
        });
    }
    let node = &ctx.node;
    let c = ctx.setup.topo.models.iter().fold(
        WeightSyncController::new(&ctx.sync, ctx.ids.clone(), Vec::new(), eval.evaluator)?,
        |c, m| c.with_commit(m.id.clone(), m.commit),
    );
    let c = carried(ctx, c)?.start();
    let cref = ControllerRef::local(&c);
    cref.serve(node, actor_id(Served::Controller, 0, 0, 0));
    let mut gates = BTreeMap::new();
    for r in ctx.setup.topo.engine_ranks() {
        let g = RankGate::new(r, c.clone().recipient(), c.clone().recipient()).start();
        ControllerLink {
            await_rollout: g.clone().recipient(),
            done: g.clone().recipient(),
        }
        .serve(node, actor_id(Served::Gate, r, 0, 0));
        gates.insert(r, g);
    }
    let (done_tx, done_rx) = oneshot::channel();
    let l = Lead::new(LeadSetup {
        topo: Arc::clone(&ctx.setup.topo),
        node: node.clone(),
        call: ctx.call,
        controller: c.clone(),
        route: eval.route,
        gates: gates.clone(),
        done: done_tx,
        started: ctx.started,
        family: ctx.setup.work.family(),
    })
    .start();
    let lref = LeadRef::local(&l);
    lref.serve(node, actor_id(Served::Lead, 0, 0, 0));
    Ok(Heads {
        controller: cref,
        lead: lref,
        leading: Some(Leading {
            controller: c,
            lead: l,
            gates,
            done: done_rx,
        }),
        _evaluating: None,
    })
}

/// With `[checkpoint] resume`: the controller carrying each model's counts from the run
/// state beside the checkpoint it resumes (a checkpoint without one, written on a signal,
/// starts them from zero, said in the log).
///
/// # Errors
/// A run state that cannot be read, or of another model, version or format, naming it.
fn carried(ctx: &RankCtx, mut c: WeightSyncController) -> Result<WeightSyncController> {
    let Some(cfg) = ctx.setup.topo.checkpoint.as_ref().filter(|c| c.resume) else {
        return Ok(c);
    };
    let at = checkpoint::resume_version(cfg, &ctx.ids)?;
    for m in &ctx.ids {
        match checkpoint::read_state(&cfg.dir, m, at)? {
            Some(state) => {
                tracing::info!(target: RANK_LOG,
                    "{}: model `{m}`: the controller's counts go on from version {at}'s: {} \
                     rollouts admitted, {} loads, {} eval steps",
                    ctx.who, state.status.admissions, state.status.loads, state.evals);
                c = c.carrying(m, &state.status, state.evals);
            }
            None => tracing::info!(target: RANK_LOG,
                "{}: model `{m}`: version {at}'s checkpoint carries no run state; the \
                 controller's counts start from zero", ctx.who),
        }
    }
    Ok(c)
}
