//! A rollout worker's protocol: start, stop and report; [`RolloutRef`] reaches a worker of
//! any kind (acting or generating) in this process or another.

use std::time::Duration;

use actix::dev::ToEnvelope;
use actix::prelude::*;
use refit_node::Node;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::remote::{RemoteAddr, serve};

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

/// One rollout worker, in this process or another.
#[derive(Debug, Clone)]
pub struct RolloutRef {
    /// Starts its fragment loop.
    pub start: Recipient<StartRollouts>,
    /// Stops it after its current fragment; answers its statistics.
    pub stop: Recipient<StopRollouts>,
    /// Its statistics so far.
    pub stats: Recipient<GetRolloutStats>,
}

impl RolloutRef {
    /// The reference of a worker of this process.
    pub fn local<A>(worker: &Addr<A>) -> Self
    where
        A: Actor + Handler<StartRollouts> + Handler<StopRollouts> + Handler<GetRolloutStats>,
        A::Context: ToEnvelope<A, StartRollouts>
            + ToEnvelope<A, StopRollouts>
            + ToEnvelope<A, GetRolloutStats>,
    {
        Self {
            start: worker.clone().recipient(),
            stop: worker.clone().recipient(),
            stats: worker.clone().recipient(),
        }
    }

    /// The reference of a worker another process serves ([`RolloutRef::serve`]).
    ///
    /// # Panics
    /// Outside a running actix system.
    pub fn remote(worker: &RemoteAddr) -> Self {
        Self {
            start: worker.recipient(),
            stop: worker.recipient(),
            stats: worker.recipient(),
        }
    }

    /// Serves the worker's protocol on `node` under `target`.
    pub fn serve(&self, node: &Node, target: Uuid) {
        serve(node, target, self.start.clone());
        serve(node, target, self.stop.clone());
        serve(node, target, self.stats.clone());
    }
}
