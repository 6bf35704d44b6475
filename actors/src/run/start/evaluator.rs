//! The evaluator's starter: on the rank that holds the evaluator, the route over the
//! run's engines (engines are added as their ranks join) and the evaluator asking it.

use actix::prelude::*;
use refit_runtime::topology::Role;

use crate::error::Result;
use crate::protocol::eval::RunEval;
use crate::remote::serve;

use super::RankCtx;
use crate::run::gate::EngineRoute;
use crate::run::ids::{Served, actor_id};
use crate::run::workload::Inference;

/// The evaluator of a rank that holds it, and the route it asks.
#[derive(Default)]
pub(crate) struct Evaluating {
    /// The route over the run's engines.
    pub(crate) route: Option<Addr<EngineRoute>>,
    /// The evaluator (served as `Served::Evaluator`).
    pub(crate) evaluator: Option<Recipient<RunEval>>,
}

/// Starts the route and the evaluator where this rank holds the evaluator.
///
/// # Errors
/// As the roles' evaluator.
pub(crate) fn start(ctx: &RankCtx) -> Result<Evaluating> {
    if !ctx.plan.has(Role::Evaluator) {
        return Ok(Evaluating::default());
    }
    let route = EngineRoute::new(Vec::new()).start();
    let evaluator = ctx.setup.work.start_evaluator(
        &ctx.setup.specs,
        Inference {
            act: route.clone().recipient(),
            generate: route.clone().recipient(),
            deadline: ctx.sync.timeouts.eval(),
        },
        ctx.setup.eval_episodes,
        ctx.setup.topo.run.seed,
    )?;
    serve(
        &ctx.node,
        actor_id(Served::Evaluator, ctx.me, 0, 0),
        evaluator.clone(),
    );
    Ok(Evaluating {
        route: Some(route),
        evaluator: Some(evaluator),
    })
}
