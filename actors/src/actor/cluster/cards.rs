//! What the ranks publish for each other in the rendezvous store: rank 0's leader card,
//! each engine rank's card and its final statistics, and the keys they live under.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use refit_runtime::ModelId;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::actor::rollout::RolloutStats;

/// The store key rank 0 sets once every rank joined and version 1 serves everywhere: the
/// rollout workers start.
pub(super) const START_KEY: &str = "refit/run/start";

pub(super) fn weights_key(model: &ModelId) -> String {
    format!("refit/weights/{model}")
}

pub(super) fn stats_key(rank: u32) -> String {
    format!("refit/rank/{rank}/stats")
}

/// What rank 0 publishes for the others.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct LeaderCard {
    /// The controller's stand-in of each engine rank.
    pub(super) gates: BTreeMap<u32, Uuid>,
    /// The trajectory pool of each model.
    pub(super) pools: BTreeMap<ModelId, Uuid>,
}

/// What an engine rank publishes for rank 0.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct RankCard {
    pub(super) node: SocketAddr,
    pub(super) engine: Uuid,
    pub(super) pid: u32,
}

/// What an engine rank reports when it stops.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct RankStats {
    pub(super) loads: u64,
    pub(super) paused_total: Duration,
    pub(super) paused_max: Duration,
    pub(super) staged_total: Duration,
    pub(super) cancelled: u64,
    /// Per model: the rollout workers' statistics.
    pub(super) workers: BTreeMap<ModelId, Vec<WorkerStats>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct WorkerStats {
    pub(super) fragments: u64,
    pub(super) cancelled: u64,
    pub(super) blocked: Duration,
    pub(super) blocked_checks: u64,
    pub(super) error: Option<String>,
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
