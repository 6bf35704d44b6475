//! The weight-sync controller's protocol: what trainers, trajectory pools, rollout workers
//! and the run's lead ask of it, under which wire names, and the typed references to it
//! ([`ControllerRef`] for the whole protocol, [`ControllerLink`] for what a rollout worker
//! needs).

use std::collections::BTreeMap;
use std::time::Duration;

use actix::dev::ToEnvelope;
use actix::prelude::*;
use refit_runtime::sync_policy::{BlockReason, Decision, LeaderStep, RolloutState};
use refit_runtime::{ModelId, Version};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::protocol::engine::EngineRef;
use crate::protocol::eval::EvalReport;

/// The rollout status check: `continue` or `block`, answered at once.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<Decision>")]
pub struct CheckRollout {
    /// The model the rollout uses.
    pub model: ModelId,
}

/// The status check that waits: answers when the rollout may run (or fails at the
/// configured `rollout_wait_s` deadline, saying why it was blocked).
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<Admission>")]
pub struct AwaitRollout {
    /// The model the rollout uses.
    pub model: ModelId,
    /// The engine it acts through, by its id in the controller's set (a run's engine rank):
    /// while that engine is fenced, the rollout waits. `None`: not engine-aware.
    pub engine: Option<usize>,
}

/// Why a rollout was let through, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    /// The controller's event number of the admission (orders it against sync events).
    pub seq: u64,
    /// The trainer's version at admission.
    pub train_version: Version,
    /// The version every engine served at admission.
    pub rollout_version: Version,
    /// `train_version - rollout_version` at admission.
    pub staleness: u64,
    /// How long the check waited.
    pub waited: Duration,
}

/// A rollout admitted by [`AwaitRollout`] is over (its fragment is in the pool, or it was
/// cancelled).
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "()")]
pub struct RolloutDone {
    /// The model.
    pub model: ModelId,
}

/// Waits until no admitted rollout of `model` is running (`sync` mode gathers every
/// on-policy fragment before training).
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<()>")]
pub struct AwaitDrained {
    /// The model.
    pub model: ModelId,
}

/// Waits until every engine serves `model` at `version` or newer (a run's last version, or
/// a test's sync point). Fails at the load deadline, with the last load error.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<Version>")]
pub struct AwaitSynced {
    /// The model.
    pub model: ModelId,
    /// The least version.
    pub version: Version,
}

/// The trajectory pool has a batch ready for `model`.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "()")]
pub struct BatchReady {
    /// The model.
    pub model: ModelId,
}

/// `model`'s trainer finished `version` and published it. Answers once the version
/// barrier released the round (and, on eval steps, once validation ran).
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<NotifyOutcome>")]
pub struct NotifyVersion {
    /// The model.
    pub model: ModelId,
    /// The version the trainer published.
    pub version: Version,
}

/// The answer to [`NotifyVersion`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NotifyOutcome {
    /// The round's version.
    pub version: Version,
    /// True for the trainer whose arrival completed the round.
    pub leader: bool,
    /// The validation of an eval step (every model at `version`).
    pub eval: Option<EvalReport>,
}

/// Ends a validation run by hand (when no evaluator is registered): data acquisition
/// resumes.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct EndValidate;

/// Asks for the controller's state and timeline.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "ControllerStatus")]
pub struct GetStatus;

/// Asks for the controller's state without its timeline (whose events can number 100 000):
/// what a checkpoint carries, asked at every one.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "ControllerStatus")]
pub struct GetCounts;

/// One model as the controller sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelStatus {
    /// The trainer's newest version.
    pub train_version: Version,
    /// The version every engine serves.
    pub rollout_version: Version,
    /// `running`, `need_sync` or `syncing`.
    pub state: RolloutState,
    /// Rollouts admitted.
    pub admissions: u64,
    /// Admissions that had to wait.
    pub blocked: u64,
    /// Total waiting time of admissions.
    pub waited: Duration,
    /// Largest staleness at admission.
    pub max_staleness: u64,
    /// Loads completed.
    pub loads: u64,
    /// Loads that failed (the previous version stayed served).
    pub failed_loads: u64,
    /// Loads that found an engine serving weights changed since it applied them
    /// (`verify = "hashes"`; the load replaced them whole).
    pub damaged: u64,
    /// Times an engine was fenced (it could not stage or commit a version the fleet
    /// committed: no rollouts were admitted from it until it served the fleet's version).
    pub fences: u64,
    /// Total time engines spent fenced (fences that ended).
    pub fenced_for: Duration,
    /// The engines fenced now.
    pub fenced: Vec<usize>,
    /// The last load error, or the last sync-policy error.
    pub last_error: Option<String>,
}

impl ModelStatus {
    /// One line on the engines fenced during the run (`None` when none was): how often, how
    /// long in all, and which are fenced now.
    pub fn fences_line(&self) -> Option<String> {
        (self.fences > 0).then(|| {
            format!(
                "an engine was fenced {} times (it could not take a version the others \
                 committed; no rollouts from it meanwhile), {:.1} s in all; fenced now: {:?}",
                self.fences,
                self.fenced_for.as_secs_f64(),
                self.fenced
            )
        })
    }
}

/// The controller's state and its event timeline.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ControllerStatus {
    /// Per model.
    pub models: BTreeMap<ModelId, ModelStatus>,
    /// True while data acquisition is paused.
    pub acquisition_paused: bool,
    /// Eval steps completed.
    pub evals: u64,
    /// Every event, in order (capped at the newest 100 000).
    pub events: Vec<SyncEvent>,
}

/// One entry of the controller's timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncEvent {
    /// Event number (strictly increasing).
    pub seq: u64,
    /// Time since the controller started.
    pub at: Duration,
    /// The model it concerns, if one.
    pub model: Option<ModelId>,
    /// What happened.
    pub kind: SyncEventKind,
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum SyncEventKind {
    /// A batch is ready.
    BatchReady,
    /// The trainer finished a version.
    TrainerFinished(Version),
    /// A load was ordered on every engine.
    LoadStarted(Version),
    /// Every engine serves this version: the sync point.
    Landed(Version),
    /// A load failed.
    LoadFailed(Version, String),
    /// A load found an engine serving weights changed since it applied them (named, with
    /// the tensor); the load replaced them whole.
    Damaged(String),
    /// A rollout was admitted.
    Admitted(Admission),
    /// A rollout status check answered `block`.
    Blocked(BlockReason),
    /// A trainer arrived at the barrier.
    Arrived(Version),
    /// A barrier round completed; its leader runs the round.
    Leader {
        /// The round's version.
        version: Version,
        /// Whether it is an eval step.
        eval: bool,
    },
    /// A step of the leader's eval sequence began.
    Step(LeaderStep),
    /// Validation finished.
    Evaluated(Version),
    /// Every trainer of the round was released.
    Released(Version),
    /// A sync-policy rule refused a step the controller was carrying out (the message
    /// names it); also the model's `last_error`.
    PolicyError(String),
    /// An engine could not stage or commit a version the fleet committed: no rollouts are
    /// admitted from it until it serves the fleet's version again.
    Fenced {
        /// The engine's id.
        engine: usize,
        /// Why.
        reason: String,
    },
    /// A fenced engine serves the fleet's version again.
    Unfenced {
        /// The engine's id.
        engine: usize,
        /// How long it was fenced.
        after: Duration,
    },
}

impl std::fmt::Display for SyncEventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BatchReady => f.write_str("batch ready"),
            Self::TrainerFinished(v) => write!(f, "trainer finished v{v}"),
            Self::LoadStarted(v) => write!(f, "load v{v} started"),
            Self::Landed(v) => write!(f, "v{v} landed on every engine"),
            Self::LoadFailed(v, e) => write!(f, "load v{v} failed: {e}"),
            Self::Damaged(e) => write!(f, "served weights damaged: {e}"),
            Self::Fenced { engine, reason } => write!(f, "engine {engine} fenced: {reason}"),
            Self::Unfenced { engine, after } => {
                write!(f, "engine {engine} back after {after:?} fenced")
            }
            Self::Admitted(a) => write!(
                f,
                "rollout admitted (train v{}, rollout v{}, waited {:?})",
                a.train_version, a.rollout_version, a.waited
            ),
            Self::Blocked(r) => write!(f, "rollout blocked ({r:?})"),
            Self::Arrived(v) => write!(f, "arrived at the barrier with v{v}"),
            Self::Leader { version, eval } => write!(
                f,
                "barrier complete at v{version}: leader{}",
                if *eval { " (eval step)" } else { "" }
            ),
            Self::Step(s) => write!(f, "leader: {s}"),
            Self::Evaluated(v) => write!(f, "validation at v{v} done"),
            Self::Released(v) => write!(f, "trainers released at v{v}"),
            Self::PolicyError(e) => write!(f, "sync policy error: {e}"),
        }
    }
}

/// Stops loading on an engine (its process died): the engine registered as `index` (its
/// position in the list the controller was made with, or the id of an [`AddEngine`]).
/// Loads in flight land on the others; the last engine cannot be dropped.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "Result<()>")]
pub struct DropEngine {
    /// The engine's id.
    pub index: usize,
}

/// Adds an engine to the set the controller loads on (a rank that rejoined): every model is
/// first brought to the version the others serve, then the engine takes part in every load
/// from then on. Answers the versions it serves.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<BTreeMap<ModelId, Version>>")]
pub struct AddEngine {
    /// Its id (for a later [`DropEngine`]); an id already in the set is replaced.
    pub index: usize,
    /// The engine.
    pub engine: EngineRef,
}

crate::remote_reply!(ControllerStatus);

crate::remote::wire_names! {
    AwaitRollout => "controller.await_rollout",
    CheckRollout => "controller.check_rollout",
    RolloutDone => "controller.rollout_done",
    BatchReady => "controller.batch_ready",
    NotifyVersion => "controller.notify_version",
    GetStatus => "controller.get_status",
    GetCounts => "controller.get_counts",
    AwaitDrained => "controller.await_drained",
    AwaitSynced => "controller.await_synced",
}

// ANCHOR: controller_ref
crate::protocol::role_ref! {
    /// The weight-sync controller, in this process or another.
    pub struct ControllerRef {
        /// What a rollout worker needs.
        rollouts: ControllerLink::of(AwaitRollout, RolloutDone),
        /// The status check that answers at once.
        check: CheckRollout,
        /// A trajectory pool's ready batch.
        batch_ready: BatchReady,
        /// A trainer's new version.
        notify: NotifyVersion,
        /// The controller's state and timeline.
        status: GetStatus,
        /// The controller's state without its timeline.
        counts: GetCounts,
        /// `sync` mode: the on-policy rollouts are over.
        await_drained: AwaitDrained,
        /// A version serves on every engine.
        await_synced: AwaitSynced,
    }
    /// The reference of a controller of this process.
    pub fn local(controller);
    /// The reference of a controller another process serves ([`ControllerRef::serve`]).
    ///
    /// # Panics
    /// Outside a running actix system (the forwarding proxies are actors).
    pub fn remote(controller);
    /// Serves the controller's protocol on `node` under `target`.
    pub fn serve;
}

crate::protocol::role_ref! {
    /// How a rollout worker reaches the weight-sync controller: the two messages it sends, so
    /// that a controller in another process (or a stand-in that counts a rank's rollouts) fits
    /// as well as a local one.
    pub struct ControllerLink {
        /// The status check that waits.
        await_rollout: AwaitRollout,
        /// The end of an admitted rollout.
        done: RolloutDone,
    }
    /// The link to a controller (or a stand-in) of this process.
    pub fn of(controller);
    /// The link to a controller (or a stand-in) another process serves.
    ///
    /// # Panics
    /// Outside a running actix system.
    pub fn remote(controller);
    /// Serves these two messages on `node` under `target`.
    pub fn serve;
}
// ANCHOR_END: controller_ref

/// An actor that answers the whole controller protocol (the
/// [`WeightSyncController`](crate::actor::WeightSyncController), or a stand-in).
pub trait ControllerActor:
    Actor
    + Handler<AwaitRollout>
    + Handler<RolloutDone>
    + Handler<CheckRollout>
    + Handler<BatchReady>
    + Handler<NotifyVersion>
    + Handler<GetStatus>
    + Handler<GetCounts>
    + Handler<AwaitDrained>
    + Handler<AwaitSynced>
where
    Self::Context: ToEnvelope<Self, AwaitRollout>
        + ToEnvelope<Self, RolloutDone>
        + ToEnvelope<Self, CheckRollout>
        + ToEnvelope<Self, BatchReady>
        + ToEnvelope<Self, NotifyVersion>
        + ToEnvelope<Self, GetStatus>
        + ToEnvelope<Self, GetCounts>
        + ToEnvelope<Self, AwaitDrained>
        + ToEnvelope<Self, AwaitSynced>,
{
}

impl<A> ControllerActor for A
where
    A: Actor
        + Handler<AwaitRollout>
        + Handler<RolloutDone>
        + Handler<CheckRollout>
        + Handler<BatchReady>
        + Handler<NotifyVersion>
        + Handler<GetStatus>
        + Handler<GetCounts>
        + Handler<AwaitDrained>
        + Handler<AwaitSynced>,
    A::Context: ToEnvelope<A, AwaitRollout>
        + ToEnvelope<A, RolloutDone>
        + ToEnvelope<A, CheckRollout>
        + ToEnvelope<A, BatchReady>
        + ToEnvelope<A, NotifyVersion>
        + ToEnvelope<A, GetStatus>
        + ToEnvelope<A, GetCounts>
        + ToEnvelope<A, AwaitDrained>
        + ToEnvelope<A, AwaitSynced>,
{
}
