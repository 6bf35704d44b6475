//! Rank 0: learners and weight senders, the leader card, then the controller, pools,
//! trainers and evaluator driving the engines of the other ranks, watching every rank.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_node::Peer;
use refit_runtime::topology::{OnFailure, RankPlan, Role, Topology, TransportKind};
use refit_runtime::{HasWeights, ModelId, Version, WeightSet};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::remote::{RemoteAddr, serve};
use crate::roles::{ModelSpec, Roles, check_fit};

use super::cards::*;
use super::gate::{ActRoute, RankGate, RankLost};
use super::links;
use super::rendezvous::{self, RankDeath, Rendezvous, STOP_KEY, rank_key};
use super::{call_deadline, describe, stop_rule};
use crate::actor::controller::{
    AwaitRollout, DropEngine, GetStatus, RolloutDone, WeightSyncController,
};
use crate::actor::engine::{
    ActBatch, CancelInFlight, EngineHandle, EngineStats, ServedVersions, UpdateModel,
};
use crate::actor::rollout::{PushFragment, RolloutStats};
use crate::actor::topology::{self, RunReport, StopBoard, start_evaluator};
use crate::actor::workers::Trainer;

/// Removes rank 0's shared-memory segments on every way out.
pub(super) struct Segments(Vec<std::path::PathBuf>);

impl Drop for Segments {
    fn drop(&mut self) {
        links::remove_leftovers(&self.0);
    }
}

pub(super) struct Leader {
    /// Started once the links are connected ([`Leader::start_trainers`]).
    trainers: Vec<Addr<Trainer>>,
    /// Per model: its learner, its first weights and its links, opened, not connected.
    pending: Vec<(
        Box<dyn crate::learner::Learner>,
        WeightSet,
        links::OpenedLinks,
    )>,
    segments: Segments,
    gates: BTreeMap<u32, Uuid>,
    pools: BTreeMap<ModelId, Uuid>,
}

/// Rank 0, before the actors start: learners, weight senders, the leader card.
pub(super) fn prepare_lead<R: Roles>(
    topo: &Topology,
    rv: &Rendezvous,
    roles: &R,
    specs: &[ModelSpec],
) -> Result<Leader> {
    let engine_ranks = topo.engine_ranks();
    if engine_ranks.is_empty() {
        return Err(Error::Config(
            "the topology has no engine: rollouts need one".into(),
        ));
    }
    // each transport in use, with the number of engine ranks it serves
    let mut kinds: Vec<(TransportKind, usize)> = Vec::new();
    for r in &engine_ranks {
        let k = topo.weights_transport(0, *r);
        match kinds.iter_mut().find(|(kind, _)| *kind == k) {
            Some((_, n)) => *n += 1,
            None => kinds.push((k, 1)),
        }
    }
    let mut pending = Vec::new();
    let mut segments = Segments(Vec::new());
    for spec in specs {
        let mut learner = roles.learner(spec)?;
        let policy = roles.policy(spec)?;
        check_fit(&spec.id, &roles.env(spec, topo.run.seed)?, &policy)?;
        policy
            .weight_manifest()?
            .check_same_schema(&spec.id, &learner.manifest())?;
        let initial = learner.export()?;
        if initial.model() != &spec.id || initial.version() != Version(1) {
            return Err(Error::Config(format!(
                "the learner of model `{}` exported its first weights as model `{}` v{} \
                 (a fresh learner exports v1 of its own model)",
                spec.id,
                initial.model(),
                initial.version()
            )));
        }
        let out = links::open_links(rv.node(), &initial, &kinds)?;
        for link in &out.specs {
            println!(
                "rank 0: pid {}, model `{}` weights: {link}",
                std::process::id(),
                spec.id
            );
        }
        segments.0.extend(out.leftovers.iter().cloned());
        rv.put(&weights_key(&spec.id), &out.specs)?;
        pending.push((learner, initial, out));
    }
    let gates = engine_ranks.iter().map(|r| (*r, Uuid::new_v4())).collect();
    let pools = specs
        .iter()
        .map(|s| (s.id.clone(), Uuid::new_v4()))
        .collect();
    Ok(Leader {
        trainers: Vec::new(),
        pending,
        segments,
        gates,
        pools,
    })
}

impl Leader {
    /// Connects every model's links with its first weights and starts its trainer.
    fn start_trainers(&mut self, wait: Duration) -> Result<()> {
        for (learner, initial, links) in self.pending.drain(..) {
            let out = links.connect(&initial, wait)?;
            self.trainers
                .push(Trainer::start_with_outlet(learner, out.outlet));
        }
        Ok(())
    }
}

/// Rank 0.
pub(super) fn lead<R: Roles>(
    topo: &Topology,
    plan: &RankPlan,
    rv: &Rendezvous,
    roles: &Arc<R>,
    specs: &[ModelSpec],
) -> Result<RunReport> {
    let started = Instant::now();
    let wait = topo.wait();
    let ids: Vec<ModelId> = specs.iter().map(|s| s.id.clone()).collect();
    let mut sync = topo.sync.clone();
    sync.models = ids.clone();
    sync.check()?;
    // the actix system first: the trainers' threads are sync arbiters
    let system = actix_rt::System::new();
    let mut leader = system.block_on(async { prepare_lead(topo, rv, roles.as_ref(), specs) })?;
    rv.put(
        &rank_key(0),
        &LeaderCard {
            gates: leader.gates.clone(),
            pools: leader.pools.clone(),
        },
    )?;
    // the engine ranks connect their inlets now; a sender that waits for its receivers at
    // connect (a broadcast group) finds them coming
    system.block_on(async { leader.start_trainers(wait) })?;
    // every other rank joins
    let deadline = Instant::now() + wait;
    let mut cards = BTreeMap::new();
    let mut peers: BTreeMap<u32, Peer> = BTreeMap::new();
    for p in topo.ranks().iter().skip(1) {
        let left = deadline.saturating_duration_since(Instant::now());
        let card: RankCard = rv.take(&rank_key(p.rank), left).map_err(|e| {
            Error::Config(format!("{} did not join within {wait:?}: {e}", describe(p)))
        })?;
        let peer = rv.node().connect(card.node, wait).map_err(|e| {
            Error::Config(format!(
                "{}: its node at {} is not reachable: {e}",
                describe(p),
                card.node
            ))
        })?;
        tracing::info!(rank = p.rank, pid = card.pid, node = %card.node, "rank joined");
        peers.insert(p.rank, peer);
        cards.insert(p.rank, card);
    }
    println!(
        "rank 0: {} ranks joined in {:.1} s",
        topo.world_size(),
        started.elapsed().as_secs_f64()
    );
    let result = system.block_on(run_lead(
        topo, plan, rv, roles, specs, sync, leader, cards, peers, started,
    ));
    // the other ranks stop whatever happened here
    if let Err(e) = rv.put(STOP_KEY, &()) {
        tracing::warn!("telling the other ranks to stop: {e}");
    }
    result
}

type Deaths = tokio::sync::mpsc::UnboundedReceiver<RankDeath>;

#[allow(clippy::too_many_arguments)]
pub(super) async fn run_lead<R: Roles>(
    topo: &Topology,
    plan: &RankPlan,
    rv: &Rendezvous,
    roles: &Arc<R>,
    specs: &[ModelSpec],
    sync: refit_runtime::sync_policy::SyncConfig,
    leader: Leader,
    cards: BTreeMap<u32, RankCard>,
    peers: BTreeMap<u32, Peer>,
    started: Instant,
) -> Result<RunReport> {
    let node = rv.node();
    let deadline = call_deadline(topo);
    let ids: Vec<ModelId> = specs.iter().map(|s| s.id.clone()).collect();
    let engine_ranks = topo.engine_ranks();
    let Leader {
        trainers,
        segments,
        gates,
        pools: pool_ids,
        ..
    } = leader;
    let _segments = segments;

    // The engines, through remote handles.
    let mut engines = Vec::new();
    let mut act = Vec::new();
    for r in &engine_ranks {
        let (Some(card), Some(peer)) = (cards.get(r), peers.get(r)) else {
            return Err(Error::Config(format!("engine rank {r} did not join")));
        };
        let addr = RemoteAddr::new(
            peer.clone(),
            card.engine,
            format!("engine of rank {r}"),
            deadline,
        );
        engines.push(EngineHandle {
            update: addr.recipient::<UpdateModel>(),
            cancel: addr.recipient::<CancelInFlight>(),
            versions: addr.recipient::<ServedVersions>(),
        });
        act.push((*r, addr.recipient::<ActBatch>()));
    }
    let route = ActRoute::new(act).start();
    let evaluator = if plan.has(Role::Evaluator) {
        Some(
            start_evaluator(
                Arc::clone(roles),
                specs,
                route.clone().recipient(),
                10,
                topo.run.seed,
            )
            .recipient(),
        )
    } else {
        None
    };
    let controller = WeightSyncController::new(&sync, ids.clone(), engines, evaluator)?.start();

    // One gate per engine rank, one pool per model: served to the other ranks.
    let mut gate_addrs = BTreeMap::new();
    for (r, id) in &gates {
        let gate = RankGate::new(
            *r,
            controller.clone().recipient(),
            controller.clone().recipient(),
        )
        .start();
        serve::<AwaitRollout>(node, *id, gate.clone().recipient());
        serve::<RolloutDone>(node, *id, gate.clone().recipient());
        gate_addrs.insert(*r, gate);
    }
    let mut pools = Vec::new();
    for spec in specs {
        let pool = topology::start_pool(spec, &sync, &controller);
        if let Some(id) = pool_ids.get(&spec.id) {
            serve::<PushFragment>(node, *id, pool.clone().recipient());
        }
        pools.push(pool);
    }

    // Version 1 lands everywhere before any rollout runs.
    let notifiers = topology::land_version_one(&controller, &ids, &sync).await?;

    // Watch every rank from now on.
    let (tx, mut deaths): (_, Deaths) = tokio::sync::mpsc::unbounded_channel();
    let watched: Vec<(u32, SocketAddr)> = cards.iter().map(|(r, c)| (*r, c.node)).collect();
    let watch = rendezvous::watch(node, watched, topo.wait(), move |d| {
        let _ = tx.send(d);
    })?;
    rv.put(START_KEY, &())?;
    println!(
        "rank 0: version 1 serves on {} engines; rollouts start ({} mode)",
        engine_ranks.len(),
        sync.sync_mode
    );

    // One driver per model.
    let board = Arc::new(Mutex::new(StopBoard::default()));
    let mut drivers = Vec::new();
    for (((spec, trainer), pool), notifier) in specs
        .iter()
        .zip(trainers)
        .zip(pools.iter().cloned())
        .zip(notifiers)
    {
        drivers.push(actix_rt::spawn(topology::drive(
            spec.id.clone(),
            trainer,
            pool,
            controller.clone(),
            notifier,
            sync.sync_mode,
            stop_rule(topo),
            topo.wait(),
            Arc::clone(&board),
            started,
        )));
    }
    let all = async {
        let mut out = Vec::new();
        for d in drivers {
            out.push(d.await);
        }
        out
    };
    tokio::pin!(all);
    let mut lost = BTreeSet::new();
    let joined = loop {
        tokio::select! {
            joined = &mut all => break joined,
            Some(death) = deaths.recv() => {
                let who = topo
                    .rank(death.rank)
                    .map_or_else(|_| format!("rank {}", death.rank), |p| describe(&p));
                eprintln!("rank 0: {who} is gone: {}", death.reason);
                lost.insert(death.rank);
                match topo.run.on_failure {
                    OnFailure::Abort => {
                        return Err(Error::Actor(format!(
                            "{who} is gone ({}); on_failure = \"abort\" ends the run",
                            death.reason
                        )));
                    }
                    OnFailure::Continue => {
                        if lost.len() == engine_ranks.len() {
                            return Err(Error::Actor(format!(
                                "{who} is gone ({}) and no engine is left",
                                death.reason
                            )));
                        }
                        if let Some(i) = engine_ranks.iter().position(|r| *r == death.rank) {
                            controller.do_send(DropEngine { index: i });
                        }
                        route.do_send(RankLost { rank: death.rank });
                        if let Some(g) = gate_addrs.get(&death.rank) {
                            g.do_send(RankLost { rank: death.rank });
                        }
                        eprintln!(
                            "rank 0: on_failure = \"continue\": the run goes on with {} engines",
                            engine_ranks.len() - lost.len()
                        );
                    }
                }
            }
        }
    };
    drop(watch);
    let (mut reports, first_error) = topology::reports_of(&ids, joined);
    if let Some(e) = first_error {
        return Err(e);
    }
    let status = controller
        .send(GetStatus)
        .await
        .map_err(|e| Error::Actor(format!("controller: {e}")))?;
    // the other ranks stop and say what their engines and workers did
    rv.put(STOP_KEY, &())?;
    let mut engine = EngineStats::default();
    for r in &engine_ranks {
        if lost.contains(r) {
            continue;
        }
        let key = stats_key(*r);
        let rv2 = rv.clone();
        let got = actix_rt::task::spawn_blocking(move || {
            rv2.take::<RankStats>(&key, Duration::from_secs(10))
        })
        .await
        .map_err(|e| Error::Actor(format!("stats of rank {r}: {e}")))?;
        match got {
            Ok(s) => {
                engine.loads += s.loads;
                engine.paused_total += s.paused_total;
                engine.paused_max = engine.paused_max.max(s.paused_max);
                engine.staged_total += s.staged_total;
                engine.cancelled += s.cancelled;
                for (m, ws) in s.workers {
                    if let Some(rep) = reports.get_mut(&m) {
                        rep.workers.extend(ws.into_iter().map(RolloutStats::from));
                    }
                }
            }
            Err(e) => tracing::warn!(rank = r, "no statistics from the rank: {e}"),
        }
    }
    let stop = stop_rule(topo);
    let solved = stop
        .target_return
        .is_some_and(|t| reports.values().all(|r| r.mean_return >= t));
    Ok(RunReport {
        models: reports,
        controller: status,
        engine,
        elapsed: started.elapsed(),
        solved,
    })
}
