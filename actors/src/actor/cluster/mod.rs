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

mod cards;
mod follow;
mod gate;
mod lead;
pub mod links;
pub mod rendezvous;

use std::sync::Arc;
use std::time::Duration;

use refit_node::{ClusterToken, LaunchEnv};
use refit_runtime::topology::{RankPlan, Role, Topology};

use crate::error::{Error, Result};
use crate::roles::{ModelSpec, Roles};

use super::topology::{self, RunConfig, RunReport, StopRule};
use follow::follow;
use lead::lead;
use rendezvous::Rendezvous;

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
/// Launch variables that do not fit the topology (named); a `[links]` transport the link
/// factory does not know or that cannot reach an engine; no cluster token; a rank that
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
    // the `[links]` transport exists and reaches every engine (the link factory knows)
    topo.check_links(refit_transports::link::reach_of)?;
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
    let token = ClusterToken::from_env()
        .map_err(refit_runtime::Error::from)?
        .ok_or_else(|| {
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

/// Deadline of remote calls: the longest a controller, pool or engine may take to answer.
fn call_deadline(topo: &Topology) -> Duration {
    let t = &topo.sync.timeouts;
    topo.wait() + t.rollout_wait().max(t.load()).max(t.eval()) + Duration::from_secs(5)
}
