//! The framework's messages that cross processes in a distributed topology.

use super::message::RemoteMessage;
use crate::actor::{
    ActBatch, AwaitRollout, BatchReady, CancelInFlight, CheckRollout, ControllerStatus, Generate,
    GetStatus, NotifyVersion, PushFragment, RolloutDone, RunEval, ServedVersions, UpdateModel,
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
    // a generating engine (it shares the load, cancel and versions messages above)
    Generate => "engine.generate",
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

crate::remote_reply!(ControllerStatus);
