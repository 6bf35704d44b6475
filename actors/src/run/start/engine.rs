//! The engine's starter: the engine of the models this rank serves, fed through their
//! connected inlets, on an arbiter of its own and served for rank 0 and the evaluator.

use crate::error::Result;
use crate::protocol::engine::EngineHandle;
use crate::run::ids::{Served, actor_id};
use crate::run::workload::EngineSetup;

use super::RankCtx;
use super::links::ModelInlet;

/// Starts the engine of `inlets`' models; `None` on a rank that serves none.
///
/// # Errors
/// As the roles' engine; a model served twice.
pub(crate) fn start(ctx: &mut RankCtx, inlets: Vec<ModelInlet>) -> Result<Option<EngineHandle>> {
    if inlets.is_empty() {
        return Ok(None);
    }
    let started = ctx.setup.work.start_engine(
        inlets,
        &EngineSetup {
            seed: ctx.setup.topo.run.seed.wrapping_add(u64::from(ctx.me)),
            pause: ctx.sync.pause_mode,
            queue_deadline: ctx.call,
        },
    )?;
    started
        .handle
        .serve(&ctx.node, actor_id(Served::Engine, ctx.me, 0, 0));
    ctx.arbiters.push(started.arbiter);
    Ok(Some(started.handle))
}
