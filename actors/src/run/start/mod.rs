//! A rank is a table of role starters: each takes the rank's context ([`RankCtx`]) and
//! starts one role's actors, answering what later starters and the run itself need.
//! `rank_main` calls them in this order, whatever the placement:
//!
//! | starter | role | starts | answers |
//! |---|---|---|---|
//! | [`evaluator::start`] | evaluator | the engine route and the evaluator | [`Evaluating`] |
//! | [`controller::start`] | controller (rank 0) | the controller, a gate per engine rank, the lead | [`Heads`] |
//! | [`trainer::open`] | trainer | learners, first versions, weight links | [`Opened`](trainer::Opened) |
//! | [`shard::start_members`](crate::run::shard::start_members) | trainer (shards after the first) | a learner per shard, served for shard 0 | kept for the rank's life |
//! | [`links::connect`] | trainer, engine | senders and inlets, connected together | [`Links`](links::Links) |
//! | [`pool::start`] | trainer | trainers and trajectory pools | [`Training`](pool::Training) |
//! | [`engine::start`] | engine | the engine | its reference |
//! | [`rollout::start`] | rollout | rollout workers | their references |

pub(crate) mod controller;
pub(crate) mod engine;
pub(crate) mod evaluator;
pub(crate) mod links;
pub(crate) mod pool;
pub(crate) mod rollout;
pub(crate) mod trainer;

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Arbiter;
use refit_node::{Node, Peer};
use refit_runtime::ModelId;
use refit_runtime::sync_policy::SyncConfig;
use refit_runtime::topology::RankPlan;

use super::rendezvous::Rendezvous;
use super::setup::RankSetup;
use super::shard::ShardSite;

pub(crate) use controller::{Heads, Leading};
pub(crate) use evaluator::Evaluating;

/// What every starter of a rank reads: the run, this rank's place in it, its node and the
/// store; and the arbiters of the actors started on threads of their own (stopped with
/// the rank).
pub(crate) struct RankCtx {
    /// What the rank was started with: the topology, models, workload, stop rule and the
    /// rest, as given.
    pub(crate) setup: RankSetup,
    /// This rank's place in the topology.
    pub(crate) plan: RankPlan,
    /// This rank.
    pub(crate) me: u32,
    /// This rank, for messages.
    pub(crate) who: String,
    /// How long a blocked step may wait (`run.wait_s`).
    pub(crate) wait: Duration,
    /// The deadline of a remote call.
    pub(crate) call: Duration,
    /// When the rank started.
    pub(crate) started: Instant,
    /// The controller's settings, for this run's models.
    pub(crate) sync: SyncConfig,
    /// The run's models, in order.
    pub(crate) ids: Vec<ModelId>,
    /// A restarted rank, or one that joins a run already started: it asks rank 0 to take
    /// it back instead of waiting for the start.
    pub(crate) rejoining: bool,
    /// The rendezvous store.
    pub(crate) rv: Rendezvous,
    /// This rank's node.
    pub(crate) node: Node,
    /// The connection to rank 0's node (the store's).
    pub(crate) lead_peer: Peer,
    /// The arbiters of the engine and rollout workers started so far.
    pub(crate) arbiters: Vec<Arbiter>,
    /// What the engine's inlets landed and read off the wire, per model (inlets whose
    /// transport counts it).
    pub(crate) meters: Vec<(ModelId, Arc<dyn refit_runtime::WireMeter>)>,
}

impl RankCtx {
    /// Where this rank sets its trainer shards up.
    pub(crate) fn shard_site(&self) -> ShardSite<'_> {
        ShardSite {
            topo: &self.setup.topo,
            me: self.me,
            who: &self.who,
            node: &self.node,
            rv: &self.rv,
            wait: self.wait,
        }
    }

    /// Stops every arbiter started so far.
    pub(crate) fn stop_arbiters(&mut self) {
        for a in self.arbiters.drain(..) {
            a.stop();
        }
    }
}
