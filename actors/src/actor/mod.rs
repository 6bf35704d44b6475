//! The actix actors of a topology.
//!
//! - [`InferenceEngine`] serves actions for one or several models; it pauses, loads and
//!   continues one model at a time, staging the bytes through the model's inlet before the
//!   pause so that the pause covers only the apply.
//! - [`WeightSyncController`] decides *when* weights move: sync modes, the rollout status
//!   check, validation cadence and the multi-model version barrier (the rules are plain code
//!   in [`refit_runtime::sync_policy`]; this actor carries them out).
//! - [`RolloutWorker`] steps environments with actions from an engine, asking the controller
//!   before each rollout fragment; [`TrajectoryPool`] gathers fragments into batches through
//!   the staleness filter; [`Evaluator`] runs validation episodes.
//! - [`GenerationEngine`] serves [`Generate`] requests (LLM-shaped RL) with continuous
//!   batching, swapping versions at step boundaries as the run's pause mode says;
//!   [`GenRolloutWorker`] turns a task's prompts into fragments of rewarded sequences
//!   through it, and [`GenEvaluator`] validates greedily on the task's held-out prompts.
//! - [`CollectorWorker`] and [`Trainer`] wrap the plain-Rust collector and a user's
//!   [`Learner`](crate::learner::Learner) on their own threads.
//! - [`topology`] wires them into a training run: one trainer per model, shared engine and
//!   controller, the user's code coming from a [`Roles`](crate::roles::Roles) factory.
//! - [`cluster`] spreads a topology over processes and hosts as a topology file places it:
//!   [`cluster::join`] runs one rank (trainer, controller and evaluator on rank 0; engines
//!   and rollout workers on the others), weights over shared memory or TCP per link, every
//!   other message through remote actors.
//!
//! Actix stays inside this module: the rest of the crate, the runtime and the transports are
//! plain Rust. CPU-heavy actors (collection, training) run on their own threads so they never
//! block an arbiter's event loop.

pub mod cluster;
pub mod controller;
pub mod engine;
pub mod eval;
pub mod gen_engine;
pub mod gen_eval;
pub mod gen_rollout;
pub mod rollout;
pub mod topology;
pub mod workers;

use refit_runtime::{ModelId, Version};

pub use controller::{
    Admission, AwaitDrained, AwaitRollout, AwaitSynced, BatchReady, CheckRollout, ControllerStatus,
    DropEngine, EndValidate, GetStatus, ModelStatus, NotifyOutcome, NotifyVersion, RolloutDone,
    SyncEvent, SyncEventKind, VersionNotifier, WeightSyncController,
};
pub use engine::{
    Act, ActBatch, Acted, ActedBatch, CancelInFlight, Continue, EngineHandle, EngineStats,
    GetEngineStats, InferenceEngine, LoadReport, LoadWeights, Pause, ServedVersion, ServedVersions,
    UpdateModel,
};
pub use eval::{EvalReport, Evaluator, ModelEval, RunEval};
pub use gen_engine::{GenModel, GenModelStatus, Generate, GenerationEngine, GetGenStatus};
pub use gen_eval::GenEvaluator;
pub use gen_rollout::{GenRolloutConfig, GenRolloutWorker};
pub use rollout::{
    AwaitBatch, ControllerLink, FragmentInfo, PoolBatch, PushFragment, RolloutConfig, RolloutStats,
    RolloutWorker, StartRollouts, StopRollouts, TakeBatch, TrajectoryPool,
};
pub use topology::{ModelSpec, RunConfig, RunReport, StopRule, UpdateRecord};
pub use workers::{CollectBatch, CollectorWorker, Train, TrainAndPublish, Trainer};

use crate::error::Error;

fn stale(model: &ModelId, offered: Version, current: Version) -> Error {
    Error::Runtime(refit_runtime::Error::StaleVersion {
        model: model.clone(),
        offered,
        current,
    })
}
