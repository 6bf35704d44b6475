//! The framework's messages that cross processes in a distributed topology.

use std::time::Duration;

use refit_runtime::Version;
use serde::{Deserialize, Deserializer};

use super::message::RemoteMessage;
use crate::actor::{
    ActBatch, AwaitRollout, BatchReady, CancelInFlight, CheckRollout, ControllerStatus, GetStatus,
    ModelStatus, NotifyVersion, PushFragment, RolloutDone, RunEval, ServedVersions, UpdateModel,
};

macro_rules! remote {
    ($($ty:ty => $name:literal),* $(,)?) => {
        $(impl RemoteMessage for $ty {
            const NAME: &'static str = $name;
        })*
    };
}

remote! {
    // the engine: `UpdateModel` is the call that tells a receiver to pull fresh weights
    UpdateModel => "_receive_weights_scheme",
    CancelInFlight => "engine.cancel_in_flight",
    ServedVersions => "engine.served_versions",
    ActBatch => "engine.act_batch",
    // the weight-sync controller
    AwaitRollout => "controller.await_rollout",
    CheckRollout => "controller.check_rollout",
    RolloutDone => "controller.rollout_done",
    BatchReady => "controller.batch_ready",
    NotifyVersion => "controller.notify_version",
    GetStatus => "controller.get_status",
    // the trajectory pool
    PushFragment => "pool.push_fragment",
    // the evaluator
    RunEval => "evaluator.run_eval",
}

/// [`ModelStatus`] as it is read back: its state name is a `String` on the wire.
#[derive(Deserialize)]
struct ModelStatusWire {
    train_version: Version,
    rollout_version: Version,
    state: String,
    admissions: u64,
    blocked: u64,
    waited: Duration,
    max_staleness: u64,
    loads: u64,
    failed_loads: u64,
    last_error: Option<String>,
}

impl From<ModelStatusWire> for ModelStatus {
    fn from(w: ModelStatusWire) -> Self {
        // the controller's names are static; an unknown one reads as `unknown`
        let state = match w.state.as_str() {
            "running" => "running",
            "need_sync" => "need_sync",
            "syncing" => "syncing",
            _ => "unknown",
        };
        Self {
            train_version: w.train_version,
            rollout_version: w.rollout_version,
            state,
            admissions: w.admissions,
            blocked: w.blocked,
            waited: w.waited,
            max_staleness: w.max_staleness,
            loads: w.loads,
            failed_loads: w.failed_loads,
            last_error: w.last_error,
        }
    }
}

impl<'de> Deserialize<'de> for ModelStatus {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        ModelStatusWire::deserialize(d).map(Self::from)
    }
}

crate::remote_reply!(ControllerStatus);
