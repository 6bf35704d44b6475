//! The trainer's starter, second half: per model this rank trains, its trainer actor
//! (shard 0's assembling lead, for a sharded trainer) and its trajectory pool, served for
//! the rollout workers.

use std::collections::BTreeMap;

use actix::prelude::*;
use refit_runtime::{ModelId, Version};

use crate::actor::pool::TrajectoryPool;
use crate::actor::workers::Trainer;
use crate::error::Result;
use crate::protocol::controller::ControllerRef;
use crate::protocol::pool::PoolRef;
use crate::protocol::trainer::{SaveState, TrainAndPublish};
use crate::roles::ModelSpec;
use crate::run::ids::{Served, actor_id};
use crate::run::shard;

use super::RankCtx;
use super::links::ModelOutlet;

/// What a model's driver drives.
pub(crate) struct Driven {
    /// The model.
    pub(crate) spec: ModelSpec,
    /// Its trainer.
    pub(crate) trainer: Recipient<TrainAndPublish>,
    /// Its trainer's state, for checkpoints (`None`: a sharded trainer).
    pub(crate) save: Option<Recipient<SaveState>>,
    /// Its pool.
    pub(crate) pool: PoolRef,
    /// The version its trainer published first (1, or the one after a resumed checkpoint).
    pub(crate) first: Version,
}

/// The trainers and pools of a rank.
#[derive(Default)]
pub(crate) struct Training {
    /// Per model it trains: what its driver drives.
    pub(crate) drivers: Vec<Driven>,
    /// Its pools, for its own rollout workers.
    pub(crate) pools: BTreeMap<ModelId, PoolRef>,
}

/// Starts a trainer and a pool (reporting its batches to `controller`) for every model in
/// `outlets`.
///
/// # Errors
/// A sharded trainer whose shards do not join in time or cannot be reached.
pub(crate) async fn start(
    ctx: &RankCtx,
    outlets: Vec<ModelOutlet>,
    controller: &ControllerRef,
) -> Result<Training> {
    let mut out = Training::default();
    for (spec, learner, outlet) in outlets {
        let first = learner.version();
        let (trainer, save) = if ctx.setup.topo.trainer_ranks(&spec.id).len() > 1 {
            let (lead, save) = shard::start_lead(&ctx.shard_site(), &spec, learner, outlet).await?;
            (lead, Some(save))
        } else {
            let t = Trainer::start_with_outlet(learner, outlet);
            (t.clone().recipient(), Some(t.recipient()))
        };
        let pool = TrajectoryPool::new(
            spec.id.clone(),
            spec.batch_frames,
            ctx.sync.allowed_staleness(),
            Some(controller.batch_ready.clone()),
        )
        .with_capacity_batches(ctx.sync.max_buffered_batches)
        .start();
        let pref = PoolRef::local(&pool);
        let mi = ctx.setup.topo.model_index(&spec.id).unwrap_or(0);
        pref.serve(&ctx.node, actor_id(Served::Pool, ctx.me, mi, 0));
        out.pools.insert(spec.id.clone(), pref.clone());
        out.drivers.push(Driven {
            spec,
            trainer,
            save,
            pool: pref,
            first,
        });
    }
    Ok(out)
}
