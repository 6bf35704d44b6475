//! A rollout worker's protocol: start, stop and report; [`RolloutRef`] reaches a worker of
//! any kind (acting or generating) in this process or another.

use std::time::Duration;

use actix::prelude::*;
use serde::{Deserialize, Serialize};

/// Starts the worker's fragment loop.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "()")]
pub struct StartRollouts;

/// Stops the worker after its current fragment; answers what it did.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "RolloutStats")]
pub struct StopRollouts;

/// Asks what a worker did so far, without stopping it.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "RolloutStats")]
pub struct GetRolloutStats;

/// What a rollout worker did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutStats {
    /// Fragments pushed to the pool.
    pub fragments: u64,
    /// Fragments abandoned because their episodes were cancelled.
    pub cancelled: u64,
    /// Time spent blocked at the status check.
    pub blocked: Duration,
    /// Status checks that had to wait.
    pub blocked_checks: u64,
    /// The error that stopped the worker, if one did.
    pub error: Option<String>,
}

crate::remote_reply!(RolloutStats);

crate::remote::wire_names! {
    StartRollouts => "rollout.start",
    StopRollouts => "rollout.stop",
    GetRolloutStats => "rollout.stats",
}

crate::protocol::role_ref! {
    /// One rollout worker, in this process or another.
    pub struct RolloutRef {
        /// Starts its fragment loop.
        start: StartRollouts,
        /// Stops it after its current fragment; answers its statistics.
        stop: StopRollouts,
        /// Its statistics so far.
        stats: GetRolloutStats,
    }
    /// The reference of a worker of this process.
    pub fn local(worker);
    /// The reference of a worker another process serves ([`RolloutRef::serve`]).
    ///
    /// # Panics
    /// Outside a running actix system.
    pub fn remote(worker);
    /// Serves the worker's protocol on `node` under `target`.
    pub fn serve;
}
