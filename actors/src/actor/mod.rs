//! The actix actors of a topology, one file per role; what they exchange is in each role's
//! protocol module ([`crate::protocol`], re-exported here).
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
//!
//! [`crate::run`] wires them into a training run, in one process or across processes and
//! hosts, as a topology file places them.
//!
//! Actix stays inside this crate: the runtime and the transports are plain Rust. CPU-heavy
//! actors (collection, training) run on their own threads so they never block an arbiter's
//! event loop.

pub mod backend;
pub mod controller;
pub mod engine;
pub mod eval;
pub mod fragments;
pub mod gen_engine;
pub mod gen_eval;
pub mod gen_rollout;
pub mod notifier;
pub mod pool;
pub mod rollout;
mod staging;
pub mod verify;
pub mod workers;

use refit_runtime::{ModelId, Version};

pub use crate::protocol::controller::{
    AddEngine, Admission, AwaitDrained, AwaitRollout, AwaitSynced, BatchReady, CheckRollout,
    ControllerLink, ControllerRef, ControllerStatus, DropEngine, EndValidate, GetStatus,
    ModelStatus, NotifyOutcome, NotifyVersion, RolloutDone, SyncEvent, SyncEventKind,
};
pub use crate::protocol::engine::{
    AbortStage, Act, ActBatch, Acted, ActedBatch, CancelInFlight, CommitModel, Continue,
    EngineActor, EngineRef, EngineStats, Generate, GetEngineStats, LoadReport, LoadWeights, Pause,
    Score, ServedVersion, ServedVersions, StageModel, StageReport, UpdateModel,
};
pub use crate::protocol::eval::{EvalReport, ModelEval, RunEval};
pub use crate::protocol::pool::{
    AwaitBatch, FragmentInfo, PoolBatch, PoolRef, PushFragment, TakeBatch,
};
pub use crate::protocol::rollout::{
    GetRolloutStats, RolloutRef, RolloutStats, StartRollouts, StopRollouts,
};
pub use crate::protocol::trainer::{Train, TrainAndPublish};
pub use backend::{BackendEngine, EngineBackend, GeneratorBackend, TensorStream};
pub use controller::WeightSyncController;
pub use engine::{DEFAULT_QUEUE_DEADLINE, InferenceEngine};
pub use eval::{DEFAULT_EVAL_REQUEST_DEADLINE, Evaluator};
pub use fragments::{FragmentLoop, Fragments};
pub use gen_engine::{GenModel, GenModelStatus, GenerationEngine, GetGenStatus};
pub use gen_eval::GenEvaluator;
pub use gen_rollout::{GenFragments, GenRolloutConfig, GenRolloutWorker};
pub use notifier::VersionNotifier;
pub use pool::TrajectoryPool;
pub use rollout::{ActingFragments, RolloutConfig, RolloutWorker};
pub use workers::{CollectBatch, CollectorWorker, Trainer};

use crate::error::Error;

fn stale(model: &ModelId, offered: Version, current: Version) -> Error {
    Error::Runtime(refit_runtime::Error::StaleVersion {
        model: model.clone(),
        offered,
        current,
    })
}
