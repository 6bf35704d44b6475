//! A training run, in one process or spread over processes and hosts, through one path.
//!
//! A run is a topology (a [`Topology`], from a topology file or built by [`run`]) expanded
//! into ranks; every rank runs [`join`] (or [`join_generating`]) with the same topology and
//! its launch variables, and hosts the roles its process holds:
//!
//! - **rank 0** leads: it serves the rendezvous store, the weight-sync controller, one gate
//!   per engine rank (counting that rank's admitted rollouts) and the run's lead (the
//!   common stop decision, rank deaths and rejoins, the report);
//! - a **trainer** rank (per model) builds the model's learner, opens its weight links (one
//!   sender per transport the engines need: in-process beside it, shared memory on its
//!   host, TCP across hosts; converting to the engines' layout when the model declares
//!   one), serves the model's trajectory pool and drives training; a trainer process with
//!   replicas is a sharded trainer: each of its ranks trains on every batch and writes its
//!   part of each version, which the first one assembles and publishes (`shard`);
//! - an **engine** rank connects one inlet per model it serves and serves its engine (an
//!   acting or a generating one); with `rollout` it runs rollout workers against it;
//! - the **evaluator** rank runs validation when the controller asks.
//!
//! Roles reach each other through their protocol's typed references ([`crate::protocol`]):
//! local `Addr`s when they share a process, remote handles otherwise. A run of one process
//! ([`run`]) is the same path with one rank, where every reference is local.
//!
//! Supervision: every rank pings rank 0 and rank 0 pings every rank (`[run] keepalive_s`);
//! a peer silent for `dead_after_s`, or whose connection closed, is dead. Rank 0 drops a
//! dead engine rank (its admitted rollouts are given up; the run goes on as `on_failure` or
//! the process's `restart` says) and takes it back when it restarts ([`RankEvent`]); every
//! other rank exits when rank 0 is dead. See the book's supervision page for the written
//! guarantees.

mod backend;
mod begin;
mod checkpoint;
mod drive;
mod end;
mod gate;
mod ids;
mod keepalive;
mod lead;
mod mesh;
mod peers;
mod rank;
mod rendezvous;
pub(crate) mod report;
mod setup;
mod shard;
mod start;
mod summary;
mod weights;
mod workload;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use refit_node::{ClusterToken, LaunchEnv};
use refit_runtime::ModelId;
use refit_runtime::sync_policy::SyncConfig;
use refit_runtime::topology::{RankPlan, Topology};

use crate::error::{Error, Result};
use crate::link::WeightInlet;
use crate::protocol::eval::EvalReport;
use crate::roles::{GenRoles, ModelSpec, Roles};

pub use backend::join_backend;
pub use checkpoint::resume_version;
pub use rendezvous::PING_TARGET;
pub use report::{
    ModelReport, RankEvent, RankEventKind, RankReport, RunReport, UNSOLVED, UpdateRecord,
    exit_unsolved,
};
pub use workload::{EngineSetup, Inference, Started, Workload};

/// When a run stops. Every model stops at the same version, so that the last barrier
/// round completes.
#[derive(Debug, Clone, PartialEq)]
pub struct StopRule {
    /// Stop after this many updates.
    pub max_updates: u64,
    /// Stop once every model's mean return reaches this: over its last 20 episodes
    /// (environment steps), or over the last batch (generated completions).
    pub target_return: Option<f64>,
    /// Stop once every model's latest validation (the evaluator's mean return or reward on
    /// held-out episodes or prompts) reaches this.
    pub target_eval: Option<f64>,
    /// Stop once this much time has passed.
    pub max_time: Duration,
}

impl StopRule {
    /// The stop rule of a topology's `[stop]`.
    pub fn of(topo: &Topology) -> Self {
        Self {
            max_updates: topo.stop.max_updates.unwrap_or(u64::MAX),
            target_return: topo.stop.target_return,
            target_eval: topo.stop.target_eval,
            max_time: topo
                .stop
                .max_time_s
                .map_or(Duration::from_secs(86_400 * 365), Duration::from_secs_f64),
        }
    }

    /// Whether `model` reached a target: its recent returns (the last 20 episodes, or the
    /// last batch of completions when `generated`) or its latest validation.
    pub(crate) fn solved(
        &self,
        model: &ModelId,
        recent: &VecDeque<f64>,
        generated: bool,
        evals: &[EvalReport],
    ) -> bool {
        let mean = if recent.is_empty() {
            f64::NEG_INFINITY
        } else {
            recent.iter().sum::<f64>() / recent.len() as f64
        };
        let by_return = self
            .target_return
            .is_some_and(|t| (generated || recent.len() == 20) && mean >= t);
        let by_eval = self.target_eval.is_some_and(|t| {
            evals
                .last()
                .and_then(|e| e.models.get(model))
                .is_some_and(|m| m.mean_return >= t)
        });
        by_return || by_eval
    }
}

/// Wraps an engine's inlet (for instance to model a slow link).
pub type InletWrapper = Arc<dyn Fn(Box<dyn WeightInlet>) -> Box<dyn WeightInlet> + Send + Sync>;

/// A run of one process, set up in code (see [`run`]).
#[derive(Clone)]
pub struct RunConfig {
    /// The controller's settings.
    pub sync: SyncConfig,
    /// The models.
    pub models: Vec<ModelSpec>,
    /// Validation episodes per model on eval steps.
    pub eval_episodes: usize,
    /// When to stop.
    pub stop: StopRule,
    /// Seed of the engine and the environments.
    pub seed: u64,
    /// Wraps every engine inlet, when set.
    pub wrap_inlet: Option<InletWrapper>,
    /// How long a pool may wait for a batch, and a scheme for its rendezvous.
    pub wait: Duration,
}

impl std::fmt::Debug for RunConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunConfig")
            .field("sync", &self.sync)
            .field("models", &self.models)
            .field("stop", &self.stop)
            .finish()
    }
}

/// Who a rank is, for messages: `rank 2 (process `actor`, replica 1)`.
pub fn describe(plan: &RankPlan) -> String {
    format!(
        "rank {} (process `{}`, replica {})",
        plan.rank, plan.process, plan.replica
    )
}

/// The models of a topology as the roles see them.
///
/// # Errors
/// A framework key of a model's params that is not a positive integer (named).
pub fn model_specs(topo: &Topology) -> Result<Vec<ModelSpec>> {
    topo.models
        .iter()
        .map(|m| {
            let mut spec = ModelSpec::from_params(m.id.clone(), topo.run.seed, &m.params)?;
            spec.verify = m.verify;
            spec.apply = m.apply;
            spec.check()?;
            Ok(spec)
        })
        .collect()
}

/// Runs this rank's part of `topo` with the acting roles `roles` (environments, policies):
/// rank 0 answers the run's report, the other ranks `None` once rank 0 tells them to stop.
///
/// Blocking: it starts its own actix system (call it from `main`, not from inside one).
///
/// # Errors
/// Launch variables that do not fit the topology (named); a link transport the link
/// factory does not know or that cannot reach an engine; no cluster token in a run of
/// several processes; a rank that does not join in time; a configuration error of the
/// roles (named by model); on rank 0, the first error of a trainer, pool or controller, or
/// a dead rank the run cannot go on without; on another rank, rank 0 going away before the
/// end of the run.
pub fn join<R: Roles>(topo: &Topology, launch: &LaunchEnv, roles: R) -> Result<Option<RunReport>> {
    join_workload(topo, launch, Arc::new(workload::Acting(Arc::new(roles))))
}

/// Runs this rank's part of `topo` with the generating roles `roles` (tasks, generators):
/// as [`join`], with generating engines, rollout workers and evaluator.
///
/// # Errors
/// As [`join`].
pub fn join_generating<G: GenRoles>(
    topo: &Topology,
    launch: &LaunchEnv,
    roles: G,
) -> Result<Option<RunReport>> {
    join_workload(
        topo,
        launch,
        Arc::new(workload::Generating(Arc::new(roles))),
    )
}

/// As [`join`], with any [`Workload`] (what [`join`] and [`join_generating`] build from
/// their roles).
///
/// # Errors
/// As [`join`].
pub fn join_workload(
    topo: &Topology,
    launch: &LaunchEnv,
    work: Arc<dyn Workload>,
) -> Result<Option<RunReport>> {
    if launch.world_size != topo.world_size() {
        return Err(Error::Config(format!(
            "launch variable WORLD_SIZE is {} but the topology has {} ranks",
            launch.world_size,
            topo.world_size()
        )));
    }
    topo.rank(launch.rank)?;
    topo.check_links(refit_transports::link::reach_of)?;
    if refit_node::launch::checking() {
        check_roles(topo, work.as_ref(), launch.rank)?;
        refit_node::launch::announce_passed();
        return Ok(None);
    }
    let token = match ClusterToken::from_env().map_err(refit_runtime::Error::from)? {
        Some(t) => t,
        None if topo.world_size() == 1 => ClusterToken::random(),
        None => {
            return Err(Error::Config(
                "REFIT_TOKEN (or REFIT_TOKEN_FILE) is not set: every rank needs the cluster token \
                 (`refit launch` sets one)"
                    .into(),
            ));
        }
    };
    let setup = setup::RankSetup {
        topo: Arc::new(topo.clone()),
        launch: launch.clone(),
        token,
        specs: model_specs(topo)?,
        work,
        stop: StopRule::of(topo),
        eval_episodes: 10,
        wrap_inlet: None,
        incarnation: refit_node::launch::incarnation().map_err(refit_runtime::Error::from)?,
    };
    let system = actix_rt::System::new();
    let answer = system.block_on(rank::rank_main(setup));
    // an error may end the rank right after it started actors on this thread (the lead,
    // on rank 0): they are polled once here, so that they have started before the
    // runtime is dropped (an actor first polled in the drop starts without a reactor, and
    // its timers panic)
    system.block_on(async {
        for _ in 0..4 {
            actix_rt::task::yield_now().await;
        }
    });
    answer
}

/// What rank `rank`'s program run as a check (`REFIT_CHECK`, before `refit launch` starts
/// any rank) checks: every model's framework params, and its roles built once (the
/// learner, where a trainer rank of the model runs this program and the program hosts one:
/// not an engine rank of a backend, nor one whose trainer is another program, a Python
/// learner; the engines' layout, the conversion between them, the roles against each
/// other), so that a bad value in `params` is refused before anything starts.
///
/// # Errors
/// The first refusal, naming the model and the key.
pub fn check_roles(topo: &Topology, work: &dyn Workload, rank: u32) -> Result<()> {
    let command = |r: u32| topo.rank(r).map(|p| p.command).ok();
    let ours = command(rank);
    for spec in model_specs(topo)? {
        work.check(&spec, topo.run.seed)?;
        let trains_here = topo
            .trainer_ranks(&spec.id)
            .into_iter()
            .any(|t| command(t) == ours);
        if work.hosts_learner() && trains_here {
            drop(work.learner(&spec)?);
        }
        work.engine_manifest(&spec)?;
        work.want(&spec)?;
    }
    Ok(())
}

/// Runs a training topology of one process until the stop rule fires; `roles` makes each
/// model's learner, policy and environments. Call it inside an actix system
/// (`actix_rt::System::new().block_on(..)` or an `#[actix_rt::test]`).
///
/// It is a run of one rank on the same path as a topology file's: the models' trainers,
/// pools, the engine (every model), the rollout workers (`spec.workers` per model), the
/// evaluator and the controller, weights through the in-process transport.
///
/// # Errors
/// Configuration errors (a policy that does not fit its environment, a learner whose
/// exports the policy cannot load: named by model); the first error of a trainer, pool,
/// controller or engine (named).
///
/// # Cancel safety
/// Not cancel-safe: dropping the future abandons the run without a report, and does not
/// stop the actors and threads it started (they end as their addresses drop, or with the
/// actix system). Stop a run through its stop rule instead.
pub async fn run<R: Roles>(cfg: RunConfig, roles: R) -> Result<RunReport> {
    run_workload(cfg, Arc::new(workload::Acting(Arc::new(roles)))).await
}

/// Runs a generating topology of one process (see [`run`]): `roles` makes each model's
/// learner, generator and task.
///
/// # Errors
/// As [`run`].
///
/// # Cancel safety
/// As [`run`].
pub async fn run_generating<G: GenRoles>(cfg: RunConfig, roles: G) -> Result<RunReport> {
    run_workload(cfg, Arc::new(workload::Generating(Arc::new(roles)))).await
}

/// As [`run`], with any [`Workload`].
///
/// # Errors
/// As [`run`].
///
/// # Cancel safety
/// As [`run`].
pub async fn run_workload(cfg: RunConfig, work: Arc<dyn Workload>) -> Result<RunReport> {
    if cfg.models.is_empty() {
        return Err(Error::Config("a run needs at least one model".into()));
    }
    for spec in &cfg.models {
        spec.check()?;
    }
    let topo = rank::one_process(&cfg)?;
    let setup = setup::RankSetup {
        topo: Arc::new(topo),
        launch: LaunchEnv {
            rank: 0,
            world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
        },
        token: ClusterToken::random(),
        specs: cfg.models.clone(),
        work,
        stop: cfg.stop.clone(),
        eval_episodes: cfg.eval_episodes,
        wrap_inlet: cfg.wrap_inlet.clone(),
        incarnation: 0,
    };
    rank::rank_main(setup)
        .await?
        .ok_or_else(|| Error::Actor("a run of one process ended without a report".into()))
}

/// How long a blocked step may wait, by default.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(60);
