//! A training topology spread over processes and hosts, as a topology file places it.
//!
//! Every rank runs the same program and calls [`join`] with the topology, its launch
//! variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; `REFIT_TOKEN` holds the
//! cluster token) and the user's [`Roles`]:
//!
//! - **rank 0** (trainer, controller, evaluator) serves the rendezvous store at
//!   `MASTER_ADDR:MASTER_PORT`, builds each model's learner and opens its weight senders
//!   (shared memory for engines on its host, TCP for the others: one sender per transport
//!   serves every engine), publishes where they are, waits for every rank to join, then
//!   runs the controller, the trajectory pools and the trainers, driving the engines and
//!   hearing the rollout workers of the other ranks through remote actors. It watches every
//!   rank: one that dies is reported at once (named by rank and process) and, as
//!   `[run] on_failure` says, ends the run or is dropped (the controller stops loading on
//!   its engine, its admitted rollouts are given up, the evaluator uses another engine).
//!   It answers the [`RunReport`].
//! - **every other rank** (engine, rollout) connects one inlet per model from the published
//!   link (its transport chosen by placement), serves its inference engine to the
//!   controller, runs its rollout workers against the remote controller and pools, and
//!   stops when rank 0 says so (or when rank 0 goes away).
//!
//! A topology of one process runs in that process ([`super::topology::run`]).

mod gate;
pub mod links;
pub mod rendezvous;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_runtime::node::{ClusterToken, LaunchEnv, Peer};
use refit_runtime::topology::{OnFailure, RankPlan, Role, Topology, TransportKind};
use refit_runtime::{HasWeights, Manifests, ModelId, Version};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::remote::{RemoteAddr, serve};
use crate::roles::{ModelSpec, Roles, check_fit};

use super::controller::{
    AwaitRollout, DropEngine, GetStatus, RolloutDone, VersionNotifier, WeightSyncController,
};
use super::engine::{
    ActBatch, CancelInFlight, EngineHandle, EngineStats, GetEngineStats, InferenceEngine,
    ServedVersions, UpdateModel,
};
use super::rollout::{
    ControllerLink, PushFragment, RolloutConfig, RolloutStats, RolloutWorker, StartRollouts,
    StopRollouts, TrajectoryPool,
};
use super::topology::{
    self, ModelReport, RunConfig, RunReport, StopBoard, StopRule, start_evaluator,
    start_rollout_worker,
};
use super::workers::Trainer;
use gate::{ActRoute, RankGate, RankLost};
use refit_transports::link::ReceiverSpec;
use rendezvous::{RankDeath, Rendezvous, STOP_KEY, rank_key};

/// The store key rank 0 sets once every rank joined and version 1 serves everywhere: the
/// rollout workers start.
const START_KEY: &str = "refit/run/start";

fn weights_key(model: &ModelId) -> String {
    format!("refit/weights/{model}")
}

fn stats_key(rank: u32) -> String {
    format!("refit/rank/{rank}/stats")
}

/// What rank 0 publishes for the others.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaderCard {
    /// The controller's stand-in of each engine rank.
    gates: BTreeMap<u32, Uuid>,
    /// The trajectory pool of each model.
    pools: BTreeMap<ModelId, Uuid>,
}

/// What an engine rank publishes for rank 0.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RankCard {
    node: SocketAddr,
    engine: Uuid,
    pid: u32,
}

/// What an engine rank reports when it stops.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct RankStats {
    loads: u64,
    paused_total: Duration,
    paused_max: Duration,
    staged_total: Duration,
    cancelled: u64,
    /// Per model: the rollout workers' statistics.
    workers: BTreeMap<ModelId, Vec<WorkerStats>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct WorkerStats {
    fragments: u64,
    cancelled: u64,
    blocked: Duration,
    blocked_checks: u64,
    error: Option<String>,
}

impl From<&RolloutStats> for WorkerStats {
    fn from(s: &RolloutStats) -> Self {
        Self {
            fragments: s.fragments,
            cancelled: s.cancelled,
            blocked: s.blocked,
            blocked_checks: s.blocked_checks,
            error: s.error.clone(),
        }
    }
}

impl From<WorkerStats> for RolloutStats {
    fn from(s: WorkerStats) -> Self {
        Self {
            fragments: s.fragments,
            cancelled: s.cancelled,
            blocked: s.blocked,
            blocked_checks: s.blocked_checks,
            error: s.error,
        }
    }
}

/// The models of a topology as the roles see them.
fn model_specs(topo: &Topology) -> Result<Vec<ModelSpec>> {
    topo.models
        .iter()
        .map(|m| {
            let spec = ModelSpec::from_params(m.id.clone(), topo.run.seed, &m.params)?;
            spec.check()?;
            Ok(spec)
        })
        .collect()
}

/// The stop rule of a topology.
fn stop_rule(topo: &Topology) -> StopRule {
    StopRule {
        max_updates: topo.stop.max_updates.unwrap_or(u64::MAX),
        target_return: topo.stop.target_return,
        max_time: topo
            .stop
            .max_time_s
            .map_or(Duration::from_secs(86_400 * 365), Duration::from_secs_f64),
    }
}

/// Who a rank is, for messages: `rank 2 (process `actor`, replica 1)`.
pub fn describe(plan: &RankPlan) -> String {
    format!(
        "rank {} (process `{}`, replica {})",
        plan.rank, plan.process, plan.replica
    )
}

/// Runs this rank's part of `topo`: rank 0 answers the run's report, the other ranks `None`
/// once rank 0 tells them to stop.
///
/// Blocking: it starts its own actix system (call it from `main`, not from inside one).
///
/// # Errors
/// Launch variables that do not fit the topology (named); no cluster token; a rank that
/// does not join in time; a configuration error of the roles (named by model); on rank 0,
/// the first error of a trainer, pool or controller, or a dead rank under `on_failure =
/// "abort"`; on another rank, rank 0 going away before the end of the run.
pub fn join<R: Roles>(topo: &Topology, launch: &LaunchEnv, roles: R) -> Result<Option<RunReport>> {
    if launch.world_size != topo.world_size() {
        return Err(Error::Config(format!(
            "launch variable WORLD_SIZE is {} but the topology has {} ranks",
            launch.world_size,
            topo.world_size()
        )));
    }
    let plan = topo.rank(launch.rank)?;
    let specs = model_specs(topo)?;
    if topo.world_size() == 1 {
        let cfg = RunConfig {
            sync: topo.sync.clone(),
            models: specs,
            eval_episodes: 10,
            stop: stop_rule(topo),
            seed: topo.run.seed,
            wrap_inlet: None,
            wait: topo.wait(),
        };
        let report = actix_rt::System::new().block_on(topology::run(cfg, roles))?;
        return Ok(Some(report));
    }
    for p in topo.ranks() {
        let lone = p.rank != 0 && p.has(Role::Rollout) && !p.has(Role::Engine);
        if lone || (p.rank == 0 && (p.has(Role::Engine) || p.has(Role::Rollout))) {
            return Err(Error::Config(format!(
                "{}: in a run of several processes, rank 0 holds the trainer and the \
                 controller (and the evaluator) and every other rank an engine and its \
                 rollout workers",
                describe(p)
            )));
        }
    }
    let token = ClusterToken::from_env()?.ok_or_else(|| {
        Error::Config(
            "REFIT_TOKEN (or REFIT_TOKEN_FILE) is not set: every rank needs the cluster token \
             (`refit launch` sets one)"
                .into(),
        )
    })?;
    let rv = Rendezvous::join(launch, &plan.host.addr, token, topo.wait())?;
    let roles = Arc::new(roles);
    if launch.is_master() {
        lead(topo, &plan, &rv, &roles, &specs).map(Some)
    } else {
        follow(topo, &plan, &rv, &roles, &specs).map(|()| None)
    }
}

/// Removes rank 0's shared-memory segments on every way out.
struct Segments(Vec<std::path::PathBuf>);

impl Drop for Segments {
    fn drop(&mut self) {
        links::remove_leftovers(&self.0);
    }
}

/// Deadline of remote calls: the longest a controller, pool or engine may take to answer.
fn call_deadline(topo: &Topology) -> Duration {
    let t = &topo.sync.timeouts;
    topo.wait() + t.rollout_wait().max(t.load()).max(t.eval()) + Duration::from_secs(5)
}

struct Leader {
    trainers: Vec<Addr<Trainer>>,
    segments: Segments,
    gates: BTreeMap<u32, Uuid>,
    pools: BTreeMap<ModelId, Uuid>,
}

/// Rank 0, before the actors start: learners, weight senders, the leader card.
fn prepare_lead<R: Roles>(
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
    let mut kinds: Vec<TransportKind> = Vec::new();
    for r in &engine_ranks {
        let k = topo.weights_transport(0, *r);
        if !kinds.contains(&k) {
            kinds.push(k);
        }
    }
    let mut trainers = Vec::new();
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
        let out = links::open_outlets(rv.node(), &initial, &kinds, topo.wait())?;
        for link in &out.specs {
            println!(
                "rank 0: pid {}, model `{}` weights: {link}",
                std::process::id(),
                spec.id
            );
        }
        segments.0.extend(out.leftovers);
        rv.put(&weights_key(&spec.id), &out.specs)?;
        trainers.push(Trainer::start_with_outlet(learner, out.outlet));
    }
    let gates = engine_ranks.iter().map(|r| (*r, Uuid::new_v4())).collect();
    let pools = specs
        .iter()
        .map(|s| (s.id.clone(), Uuid::new_v4()))
        .collect();
    Ok(Leader {
        trainers,
        segments,
        gates,
        pools,
    })
}

/// Rank 0.
fn lead<R: Roles>(
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
    let leader = system.block_on(async { prepare_lead(topo, rv, roles.as_ref(), specs) })?;
    rv.put(
        &rank_key(0),
        &LeaderCard {
            gates: leader.gates.clone(),
            pools: leader.pools.clone(),
        },
    )?;
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
async fn run_lead<R: Roles>(
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
        let pool = TrajectoryPool::new(
            spec.id.clone(),
            spec.batch_frames,
            sync.allowed_staleness(),
            Some(controller.clone().recipient()),
        )
        .with_capacity_batches(sync.max_buffered_batches)
        .start();
        if let Some(id) = pool_ids.get(&spec.id) {
            serve::<PushFragment>(node, *id, pool.clone().recipient());
        }
        pools.push(pool);
    }

    // Version 1 lands everywhere before any rollout runs.
    let mut notifiers: Vec<VersionNotifier> = ids
        .iter()
        .map(|id| VersionNotifier::new(controller.clone(), id.clone(), sync.clone()))
        .collect();
    for n in &mut notifiers {
        n.notify(Version(1)).await?;
    }
    for n in &mut notifiers {
        n.flush().await?;
    }

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
    let mut reports: BTreeMap<ModelId, ModelReport> = BTreeMap::new();
    let mut first_error = None;
    for (id, d) in ids.iter().zip(joined) {
        match d {
            Ok(Ok(r)) => {
                reports.insert(id.clone(), r);
            }
            Ok(Err(e)) => {
                first_error.get_or_insert(Error::Actor(format!("trainer of model `{id}`: {e}")));
            }
            Err(e) => {
                first_error.get_or_insert(Error::Actor(format!(
                    "trainer of model `{id}` panicked: {e}"
                )));
            }
        }
    }
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

/// An engine rank.
fn follow<R: Roles>(
    topo: &Topology,
    plan: &RankPlan,
    rv: &Rendezvous,
    roles: &Arc<R>,
    specs: &[ModelSpec],
) -> Result<()> {
    let wait = topo.wait();
    let rank = plan.rank;
    let who = describe(plan);
    let leader: LeaderCard = rv
        .take(&rank_key(0), wait)
        .map_err(|e| Error::Config(format!("{who}: rank 0 did not publish its card: {e}")))?;
    let kind = topo.weights_transport(0, rank);
    let mut engine =
        InferenceEngine::<R::Policy>::empty(topo.run.seed.wrapping_add(u64::from(rank)));
    for spec in specs {
        let policy = roles.policy(spec)?;
        let expected = Manifests::new([(spec.id.clone(), Arc::new(policy.weight_manifest()?))])?;
        let links: Vec<ReceiverSpec> = rv.take(&weights_key(&spec.id), wait)?;
        let link = links
            .iter()
            .find(|l| l.transport() == kind.as_str())
            .ok_or_else(|| {
                Error::Config(format!(
                    "{who}: rank 0 opened no {kind} link for model `{}`",
                    spec.id
                ))
            })?;
        let inlet = links::connect_inlet(&spec.id, link, rv.node(), expected, wait)?;
        engine = engine.with_model(spec.id.clone(), policy, Some(inlet))?;
        println!(
            "{who}: pid {}, model `{}` weights over {kind}",
            std::process::id(),
            spec.id
        );
    }
    let gate = *leader
        .gates
        .get(&rank)
        .ok_or_else(|| Error::Config(format!("{who}: rank 0 has no controller gate for it")))?;
    actix_rt::System::new().block_on(async move {
        let engine_arbiter = Arbiter::new();
        let engine = InferenceEngine::start_in_arbiter(&engine_arbiter.handle(), move |_| engine);
        let engine_id = Uuid::new_v4();
        let node = rv.node();
        serve::<UpdateModel>(node, engine_id, engine.clone().recipient());
        serve::<CancelInFlight>(node, engine_id, engine.clone().recipient());
        serve::<ServedVersions>(node, engine_id, engine.clone().recipient());
        serve::<ActBatch>(node, engine_id, engine.clone().recipient());

        let deadline = call_deadline(topo);
        let leader_peer = rv.store().peer().clone();
        let controller = RemoteAddr::new(leader_peer.clone(), gate, "controller", deadline);
        let link = ControllerLink {
            await_rollout: controller.recipient::<AwaitRollout>(),
            done: controller.recipient::<RolloutDone>(),
        };
        let mut workers: Vec<(ModelId, Addr<RolloutWorker<R::Env>>)> = Vec::new();
        let mut arbiters = vec![engine_arbiter];
        for (mi, spec) in specs.iter().enumerate() {
            let pool_id = *leader.pools.get(&spec.id).ok_or_else(|| {
                Error::Config(format!("{who}: rank 0 has no pool for model `{}`", spec.id))
            })?;
            let pool = RemoteAddr::new(
                leader_peer.clone(),
                pool_id,
                format!("trajectory pool of `{}`", spec.id),
                deadline,
            );
            for w in 0..plan.rollout_workers as usize {
                let index = (rank as usize) * 1000 + w;
                let base = topo
                    .run
                    .seed
                    .wrapping_mul(1000)
                    .wrapping_add((mi * 100_000 + index) as u64 * 17);
                let (arbiter, addr) = start_rollout_worker(
                    &**roles,
                    spec,
                    RolloutConfig {
                        model: spec.id.clone(),
                        worker: index,
                        fragment_steps: spec.fragment_steps,
                        seed: base,
                        timeout: topo.wait(),
                    },
                    engine.clone().recipient(),
                    link.clone(),
                    pool.recipient::<PushFragment>(),
                )?;
                arbiters.push(arbiter);
                workers.push((spec.id.clone(), addr));
            }
        }
        rv.put(
            &rank_key(rank),
            &RankCard {
                node: node.addr(),
                engine: engine_id,
                pid: std::process::id(),
            },
        )?;
        // wait for rank 0's go (or its end)
        let rv2 = rv.clone();
        let started = actix_rt::task::spawn_blocking(move || {
            loop {
                match rv2
                    .store()
                    .wait(&[START_KEY, STOP_KEY], Duration::from_secs(1))
                {
                    Ok(()) => return true,
                    Err(refit_runtime::Error::Timeout { .. }) => {
                        if rv2.store().get(START_KEY).ok().flatten().is_some() {
                            return true;
                        }
                        if rv2.store().get(STOP_KEY).ok().flatten().is_some()
                            || rv2.store().peer().is_closed()
                        {
                            return false;
                        }
                    }
                    Err(_) => return false,
                }
            }
        })
        .await
        .unwrap_or(false);
        if started {
            for (_, w) in &workers {
                w.do_send(StartRollouts);
            }
            println!("{who}: {} rollout workers running", workers.len());
        }
        let rv2 = rv.clone();
        let stopped = actix_rt::task::spawn_blocking(move || rv2.wait_stop())
            .await
            .map_err(|e| Error::Actor(format!("{who}: waiting for the end: {e}")))??;
        let mut stats = RankStats::default();
        for (m, w) in &workers {
            let s = w
                .send(StopRollouts)
                .await
                .map_err(|e| Error::Actor(format!("{who}: rollout worker: {e}")))?;
            stats
                .workers
                .entry(m.clone())
                .or_default()
                .push(WorkerStats::from(&s));
        }
        let es = engine
            .send(GetEngineStats)
            .await
            .map_err(|e| Error::Actor(format!("{who}: engine: {e}")))?;
        stats.loads = es.loads;
        stats.paused_total = es.paused_total;
        stats.paused_max = es.paused_max;
        stats.staged_total = es.staged_total;
        stats.cancelled = es.cancelled;
        for a in arbiters {
            a.stop();
        }
        if !stopped {
            return Err(Error::Actor(format!(
                "{who}: rank 0 went away before the end of the run"
            )));
        }
        if let Err(e) = rv.put(&stats_key(rank), &stats) {
            tracing::warn!("{who}: reporting statistics: {e}");
        }
        println!(
            "{who}: stopped; engine loaded {} versions (paused {:.2} ms in total)",
            stats.loads,
            stats.paused_total.as_secs_f64() * 1e3
        );
        Ok(())
    })
}
