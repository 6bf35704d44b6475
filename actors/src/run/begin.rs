//! The start of a run, once a rank's roles are started: rank 0 takes every other rank's
//! card, adds every engine rank to the lead, lands every model's first version everywhere, watches every
//! rank and says start ([`admit`]); a restarted rank asks rank 0 to take it back, the
//! others wait for the start ([`await_start`]).

use std::net::SocketAddr;
use std::time::Instant;

use actix::prelude::*;
use refit_runtime::sync_policy::SyncConfig;
use refit_runtime::{ModelId, Version};

use crate::actor::controller::WeightSyncController;
use crate::actor::notifier::VersionNotifier;
use crate::error::{Error, Result};
use crate::protocol::engine::EngineHandle;
use crate::protocol::lead::{LeadRef, Rejoin};
use crate::protocol::rollout::RolloutRef;
use crate::remote::RemoteAddr;

use super::describe;
use super::ids::{
    RANK_LOG, RankCard, START_KEY, STOP_KEY, Served, actor_id, first_version_key, rank_key,
};
use super::keepalive::LeadWatch;
use super::lead::{AddRank, RankDown};
use super::peers::{blocking, rollout_refs};
use super::rendezvous::{WatchGuard, watch};
use super::start::{Leading, RankCtx};

/// Tells the controller that every model's first version (`firsts`: 1, or the one after a
/// resumed checkpoint) is out and waits until it landed everywhere.
///
/// # Errors
/// The controller refused or is gone.
pub(crate) async fn land_first(
    controller: &Addr<WeightSyncController>,
    firsts: &[(ModelId, Version)],
    sync: &SyncConfig,
) -> Result<()> {
    let mut notifiers: Vec<(VersionNotifier, Version)> = firsts
        .iter()
        .map(|(id, v)| {
            (
                VersionNotifier::new(controller.clone(), id.clone(), sync.clone()),
                *v,
            )
        })
        .collect();
    for (n, v) in &mut notifiers {
        n.notify(*v).await?;
    }
    for (n, _) in &mut notifiers {
        n.flush().await?;
    }
    Ok(())
}

/// Every model's first version, as its trainer rank set it in the store before its card.
///
/// # Errors
/// A model whose trainer rank set none; the store unreachable.
fn first_versions(ctx: &RankCtx) -> Result<Vec<(ModelId, Version)>> {
    ctx.ids
        .iter()
        .map(|m| {
            let v = ctx
                .rv
                .peek::<Version>(&first_version_key(m))?
                .ok_or_else(|| {
                    Error::Config(format!(
                        "model `{m}`: its trainer rank set no first version"
                    ))
                })?;
            Ok((m.clone(), v))
        })
        .collect()
}

/// Rank 0: waits for every rank's card, adds every engine rank (its own `engine` and
/// `rollouts` among them), lands version 1, watches every rank and says start. Keep the
/// answer (the watch) until the run ends.
///
/// # Errors
/// A rank that does not join within `run.wait_s`; the lead or the controller refusing.
pub(crate) async fn admit(
    ctx: &RankCtx,
    l: &Leading,
    engine: Option<&EngineHandle>,
    rollouts: &[(ModelId, RolloutRef)],
) -> Result<WatchGuard> {
    let nodes = take_cards(ctx).await?;
    add_engine_ranks(ctx, l, &nodes, engine, rollouts).await?;
    let firsts = first_versions(ctx)?;
    land_first(&l.controller, &firsts, &ctx.sync).await?;
    let lead = l.lead.clone();
    let watching = watch(
        &ctx.node,
        nodes,
        ctx.setup.topo.keepalive(),
        ctx.setup.topo.dead_after(),
        move |d| lead.do_send(RankDown(d)),
    );
    ctx.rv.put(START_KEY, &())?;
    let first = firsts.first().map_or(Version(1), |(_, v)| *v);
    let resumed = if first > Version(1) {
        format!(" (resumed from version {})", first.0 - 1)
    } else {
        String::new()
    };
    tracing::info!(target: RANK_LOG,
        "rank 0: version {first} serves on {} engines{resumed}; rollouts start ({} mode)",
        ctx.setup.topo.engine_ranks().len(),
        ctx.sync.sync_mode
    );
    Ok(watching)
}

/// Every other rank's card, within `run.wait_s` in all: (rank, incarnation, node).
async fn take_cards(ctx: &RankCtx) -> Result<Vec<(u32, u32, SocketAddr)>> {
    let (topo, wait) = (&ctx.setup.topo, ctx.wait);
    let deadline = Instant::now() + wait;
    let mut nodes = Vec::new();
    for p in topo.ranks().iter().skip(1) {
        let left = deadline.saturating_duration_since(Instant::now());
        let key = rank_key(p.rank);
        let rv2 = ctx.rv.clone();
        let card: RankCard = blocking("waiting for a rank", move || rv2.take(&key, left))
            .await
            .map_err(|e| {
                Error::Config(format!("{} did not join within {wait:?}: {e}", describe(p)))
            })?;
        let card = card.checked(p.rank)?;
        tracing::info!(target: RANK_LOG, rank = p.rank, pid = card.pid, node = %card.node, "rank joined");
        nodes.push((p.rank, card.incarnation, card.node));
    }
    if topo.world_size() > 1 {
        tracing::info!(target: RANK_LOG,
            "rank 0: {} ranks joined in {:.1} s",
            topo.world_size(),
            ctx.started.elapsed().as_secs_f64()
        );
    }
    Ok(nodes)
}

/// Adds every engine rank to the lead: rank 0's own engine and rollout workers, the
/// others' reached on their nodes.
async fn add_engine_ranks(
    ctx: &RankCtx,
    l: &Leading,
    nodes: &[(u32, u32, SocketAddr)],
    engine: Option<&EngineHandle>,
    rollouts: &[(ModelId, RolloutRef)],
) -> Result<()> {
    let topo = &ctx.setup.topo;
    for r in topo.engine_ranks() {
        let (engine, rollouts) = if r == ctx.me {
            (
                engine
                    .cloned()
                    .ok_or_else(|| Error::Config(format!("{}: no engine", ctx.who)))?,
                rollouts.to_vec(),
            )
        } else {
            let addr = nodes
                .iter()
                .find(|(n, _, _)| *n == r)
                .map(|(_, _, a)| *a)
                .ok_or_else(|| Error::Config(format!("engine rank {r} did not join")))?;
            let name = topo
                .rank(r)
                .map_or_else(|_| format!("rank {r}"), |p| describe(&p));
            let remote = RemoteAddr::connect(
                &ctx.node,
                addr,
                actor_id(Served::Engine, r, 0, 0),
                format!("engine of {name}"),
                ctx.call,
            )
            .await?;
            (
                EngineHandle::remote(&remote, ctx.setup.work.family()),
                rollout_refs(topo, r, &remote),
            )
        };
        l.lead
            .send(AddRank {
                rank: r,
                incarnation: 0,
                engine,
                rollouts,
                watch: None,
            })
            .timeout(ctx.call)
            .await
            .map_err(|e| Error::Actor(format!("the run's lead: {e}")))??;
    }
    Ok(())
}

/// A rank other than 0: a restarted one asks `lead` to take it back; the others wait for
/// rank 0's start. Answers `false` when the run is already over (the rank stops).
///
/// # Errors
/// The lead refusing the rejoin; rank 0 gone before the start.
pub(crate) async fn await_start(ctx: &RankCtx, lead: &LeadRef, watch: &LeadWatch) -> Result<bool> {
    if ctx.rejoining {
        if ctx.rv.peek::<()>(STOP_KEY)?.is_some() {
            return Ok(false);
        }
        lead.rejoin
            .send(Rejoin {
                rank: ctx.me,
                incarnation: ctx.setup.incarnation,
                node: ctx.rv.advertised(),
                contract: crate::protocol::CONTRACT_VERSION,
            })
            .timeout(ctx.call * 2)
            .await
            .map_err(|e| Error::Actor(format!("{}: rejoining: {e}", ctx.who)))??;
        tracing::info!(target: RANK_LOG,
            "{}: rejoined the run (incarnation {})",
            ctx.who,
            ctx.setup.incarnation
        );
        return Ok(true);
    }
    match watch.wait_keys(&ctx.rv, &[START_KEY, STOP_KEY]).await? {
        Some(START_KEY) => Ok(true),
        Some(_) => Ok(false),
        None => Err(watch.lead_gone(&ctx.who)),
    }
}
