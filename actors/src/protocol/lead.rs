//! The run lead's protocol (rank 0): each model's driver reports its progress and gets the
//! common stop decision, hands in its report at the end; a rank that restarted asks to be
//! taken back.

use std::net::SocketAddr;

use actix::prelude::*;
use refit_runtime::{ModelId, Version};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::run::report::ModelReport;

/// One model's driver finished an update: where it is, whether its model reached the
/// target, whether it ran out of budget. Answers the version every model stops at, once a
/// stop rule fired (every model stops at the same version, so the last barrier round
/// completes).
#[derive(Debug, Clone, Message, Serialize, Deserialize)]
#[rtype(result = "Option<Version>")]
pub struct Progress {
    /// The model.
    pub model: ModelId,
    /// The version it just published.
    pub version: Version,
    /// It reached the target.
    pub solved: bool,
    /// It spent its update or time budget.
    pub out_of_budget: bool,
    /// Its mean return (reward) after the update.
    pub mean_return: f64,
    /// The oldest and newest weight version among the samples it trained on.
    pub sample_versions: (Version, Version),
    /// What the update trained on, and what it took (the update's line in the log).
    pub update: UpdateLine,
}

/// What one update trained on and took, as its line in rank 0's log says it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateLine {
    /// The batch was generated completions (else environment steps).
    pub generated: bool,
    /// Samples in the batch: completions, or environment steps (frames).
    pub samples: u64,
    /// The largest staleness among them (trainer version - acting version).
    pub max_staleness: u64,
    /// Samples the pool dropped as older than the staleness it allows, while gathering it.
    pub dropped: u64,
    /// The staleness the pool allows (`None`: any, in `fully-async`).
    pub allowed_staleness: Option<u64>,
    /// Training and publishing, in milliseconds.
    pub train_ms: u64,
    /// The trainer's publish alone, in milliseconds (not reported by a sharded trainer).
    pub publish_ms: Option<f64>,
    /// The held-out validation (greedy) that ran at this version, if one did.
    pub held_out: Option<f64>,
}

/// One model's driver is over: its report, or why it failed.
#[derive(Debug, Clone, Message, Serialize, Deserialize)]
#[rtype(result = "()")]
pub struct ModelDone {
    /// The model.
    pub model: ModelId,
    /// The model's report, or its driver's error.
    pub report: std::result::Result<ModelReport, String>,
}

/// A rank that restarted (a new incarnation) serves again: its engine, its rollout workers.
/// The lead brings its engine to the versions the others serve, adds it to the controller's
/// engine set, and answers once its rollout workers may start.
#[derive(Debug, Clone, Message, Serialize, Deserialize)]
#[rtype(result = "Result<()>")]
pub struct Rejoin {
    /// The rank.
    pub rank: u32,
    /// Its incarnation (1 after its first restart).
    pub incarnation: u32,
    /// Its node's address.
    pub node: SocketAddr,
    /// The rank contract it speaks ([`CONTRACT_VERSION`](super::CONTRACT_VERSION); 0 from
    /// a build of before contract versions): the lead refuses another, naming both.
    #[serde(default)]
    pub contract: u32,
}

crate::remote_reply!(ModelReport);

crate::remote::wire_names! {
    Progress => "lead.progress",
    ModelDone => "lead.model_done",
    Rejoin => "lead.rejoin",
}

crate::protocol::role_ref! {
    /// The run's lead, in this process or another.
    pub struct LeadRef {
        /// Progress of a driver.
        progress: Progress,
        /// A driver's end.
        done: ModelDone,
        /// A restarted rank.
        rejoin: Rejoin,
    }
    /// The reference of a lead of this process.
    pub fn local(lead);
    /// The reference of the lead another process serves.
    ///
    /// # Panics
    /// Outside a running actix system.
    pub fn remote(lead);
    /// Serves the lead's protocol on `node` under `target`.
    pub fn serve;
}
