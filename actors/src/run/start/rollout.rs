//! The rollout workers' starter: per model this rank runs rollouts of, its workers
//! (`spec.workers` each, from the topology), acting through this rank's engine, admitted
//! through this rank's gate on rank 0, pushing to the model's pool (local, or on its
//! trainer's rank). They wait for `StartRollouts`.

use std::collections::BTreeMap;

use actix::prelude::*;
use refit_node::Peer;
use refit_runtime::ModelId;
use refit_runtime::topology::Role;

use crate::actor::rollout::RolloutConfig;
use crate::error::{Error, Result};
use crate::protocol::controller::ControllerLink;
use crate::protocol::engine::EngineHandle;
use crate::protocol::pool::{PoolRef, PushFragment};
use crate::protocol::rollout::RolloutRef;
use crate::remote::RemoteAddr;
use crate::roles::ModelSpec;
use crate::run::gate::RankGate;
use crate::run::ids::{Served, actor_id};
use crate::run::peers::peer_of;

use super::RankCtx;

/// Starts this rank's rollout workers: `pools` are the rank's own, `gates` rank 0's (on
/// rank 0), `engine` the rank's.
///
/// # Errors
/// A rank that runs rollouts without an engine; a model's trainer rank that does not join
/// in time; as the roles' rollout worker.
pub(crate) async fn start(
    ctx: &mut RankCtx,
    pools: &BTreeMap<ModelId, PoolRef>,
    gates: Option<&BTreeMap<u32, Addr<RankGate>>>,
    engine: Option<&EngineHandle>,
) -> Result<Vec<(ModelId, RolloutRef)>> {
    // the nodes of the other ranks this one calls (rank 0's is the store's)
    let mut peers: BTreeMap<u32, Peer> = BTreeMap::new();
    peers.insert(0, ctx.lead_peer.clone());
    let mut rollouts = Vec::new();
    let specs: Vec<ModelSpec> = ctx
        .setup
        .specs
        .iter()
        .filter(|s| ctx.plan.serves(Role::Rollout, &s.id))
        .cloned()
        .collect();
    for spec in &specs {
        let push = push_of(ctx, &mut peers, pools, &spec.id).await?;
        let gate = gate_of(ctx, gates)?;
        let engine = engine
            .ok_or_else(|| Error::Config(format!("{} runs rollouts without an engine", ctx.who)))?;
        start_workers(ctx, spec, engine, &gate, &push, &mut rollouts)?;
    }
    Ok(rollouts)
}

/// Where `model`'s workers push their fragments: its pool here, or on its trainer's rank.
async fn push_of(
    ctx: &RankCtx,
    peers: &mut BTreeMap<u32, Peer>,
    pools: &BTreeMap<ModelId, PoolRef>,
    model: &ModelId,
) -> Result<Recipient<PushFragment>> {
    if let Some(p) = pools.get(model) {
        return Ok(p.push.clone());
    }
    let topo = &ctx.setup.topo;
    let mi = topo.model_index(model).unwrap_or(0);
    let trainer = topo.trainer_ranks(model).first().copied().unwrap_or(0);
    let peer = peer_of(&ctx.rv, &ctx.node, peers, trainer, ctx.wait).await?;
    let pool = RemoteAddr::new(
        peer,
        actor_id(Served::Pool, trainer, mi, 0),
        format!("trajectory pool of `{model}`"),
        ctx.call,
    );
    Ok(pool.recipient())
}

/// This rank's gate: rank 0's own, or reached on rank 0's node.
fn gate_of(ctx: &RankCtx, gates: Option<&BTreeMap<u32, Addr<RankGate>>>) -> Result<ControllerLink> {
    let Some(gates) = gates else {
        return Ok(ControllerLink::remote(&RemoteAddr::new(
            ctx.lead_peer.clone(),
            actor_id(Served::Gate, ctx.me, 0, 0),
            "controller",
            ctx.call,
        )));
    };
    let g = gates
        .get(&ctx.me)
        .ok_or_else(|| Error::Config(format!("{} runs rollouts without an engine", ctx.who)))?;
    Ok(ControllerLink {
        await_rollout: g.clone().recipient(),
        done: g.clone().recipient(),
    })
}

/// Starts and serves the workers of `spec` on this rank.
fn start_workers(
    ctx: &mut RankCtx,
    spec: &ModelSpec,
    engine: &EngineHandle,
    gate: &ControllerLink,
    push: &Recipient<PushFragment>,
    rollouts: &mut Vec<(ModelId, RolloutRef)>,
) -> Result<()> {
    let model = &spec.id;
    let me = ctx.me;
    let topo = &ctx.setup.topo;
    let mi = topo.model_index(model).unwrap_or(0);
    for w in 0..topo.rollout_workers(me, model) as usize {
        let index = (me as usize) * 1000 + w;
        let seed = topo
            .run
            .seed
            .wrapping_mul(1000)
            .wrapping_add((mi * 100_000 + index) as u64 * 17);
        let started = ctx.setup.work.start_rollout(
            spec,
            RolloutConfig {
                model: model.clone(),
                worker: index,
                fragment_steps: spec.fragment_steps,
                seed,
                timeout: ctx.wait,
            },
            engine,
            gate.clone(),
            push.clone(),
        )?;
        started
            .handle
            .serve(&ctx.node, actor_id(Served::Rollout, me, mi, w));
        ctx.arbiters.push(started.arbiter);
        rollouts.push((model.clone(), started.handle));
    }
    Ok(())
}
