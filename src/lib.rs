//! Refit: an actor framework for reinforcement-learning pipelines whose core job is to move
//! fresh model weights from trainers to everything that runs the policy — versioned, never
//! torn, with clear errors and nothing lost.
//!
//! This facade re-exports the workspace crates:
//! - [`runtime`]: weight sets, manifests, versions, strategies, the scheme lifecycle, the
//!   sans-IO sync protocol and the wire codec (no network I/O, no async runtime);
//! - [`node`]: processes that host handlers on TCP: remote calls, streams, the rendezvous
//!   store, launch variables, the cluster token, signal-driven cleanup;
//! - [`transports`]: in-process, shared-memory, TCP, file and broadcast transports (and,
//!   with feature `cuda`, the GPU links `nccl` and `cuda-ipc` and the CUDA/NCCL probe);
//! - `rl` (features `rl`, `candle`): environments, policies, collectors, the PPO trainer,
//!   in plain Rust;
//! - `actors` (features `rl`, `candle`, `actors`): the actix actors, their own error, and
//!   the modules and types of `rl` a topology uses, re-exported.
//!
//! The most used items are in the [`prelude`]: `use refit::prelude::*;`.
//!
//! # Features
//!
//! | feature | on by default | what it adds | what it pulls in |
//! | --- | --- | --- | --- |
//! | (none) | | weight sets, schemes, in-process / shared-memory / TCP transports | tokio, serde, safetensors |
//! | `rl` | yes | `refit::rl` (also re-exported by `refit::actors`): environments, policies, collectors | rand |
//! | `candle` | yes | a candle-nn `VarMap` as a weight set and back (`refit::runtime::candle`), the PPO trainer (`refit::rl::ppo`); implies `rl` | candle |
//! | `actors` | yes | the actix actors, their protocols and the training run (`refit::actors::{actor, protocol, run}`); implies `candle` | actix |
//! | `cli` | yes | the `refit` command-line tool | clap, indicatif, notify, refit-bench |
//! | `cuda` | no | the GPU links `nccl` and `cuda-ipc` and the CUDA/NCCL probe (CUDA and NCCL loaded at run time; without it the links refuse, saying so) | cudarc |
//! | `test-util` | no | the transports' test hooks (crash in mid-publish, corrupted chunks, forged bucket plans), for tests only | |
//!
//! A program that only moves weights depends on the runtime and the transports alone:
//!
//! ```toml
//! [dependencies]
//! refit = { version = "0.1", default-features = false }
//! ```
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

#[cfg(feature = "rl")]
pub use refit_actors as actors;
pub use refit_node as node;
#[cfg(feature = "rl")]
pub use refit_rl as rl;
pub use refit_runtime as runtime;
pub use refit_transports as transports;

mod config_file;
#[cfg(feature = "cli")]
pub mod metrics_page;
mod setup;
pub use config_file::read_config;
pub use setup::{DEFAULT_LOG, LOG_FORMAT_ENV, LogFormat, exit_code, init, init_logging};

/// The items most programs need: weight sets and their layout, the scheme lifecycle, the
/// wire codec, the cluster token, every transport's two ends, and (with their features) the
/// reinforcement-learning pieces and the actor topology's entry points.
pub mod prelude {
    pub use refit_node::ClusterToken;
    pub use refit_runtime::sync_policy::{SyncConfig, SyncMode};
    pub use refit_runtime::{
        ArenaStrategy, DType, Error, HasWeights, Manifest, Manifests, ModelId, Receiver,
        ReceiverInit, Result, Sender, SenderInit, SharedBytes, Strategy, Version, WeightSet, wire,
    };
    pub use refit_transports::inproc::InProc;
    pub use refit_transports::shm::{
        ShmConfig, ShmReadMode, ShmReceiver, ShmReceiverSpec, ShmSender,
    };
    pub use refit_transports::tcp::{
        TcpConfig, TcpEndpoint, TcpReceiver, TcpReceiverConfig, TcpReceiverSpec, TcpSender,
        TransferMode,
    };

    #[cfg(feature = "rl")]
    pub use refit_rl::{
        CartPole, Collector, CollectorConfig, Completion, Env, GenRoles, Generator, LearnStats,
        Learner, MlpPolicy, ModelSpec, MultiAsyncCollector, MultiConfig, MultiSyncCollector,
        Policy, Roles, SamplingParams, Task, UpdatePolicyWeights,
    };

    #[cfg(feature = "candle")]
    pub use refit_rl::{CartPolePpo, PpoConfig, PpoTrainer};

    /// The run's entry points: [`run::join`] for one rank of a topology file, [`run::run`]
    /// for a [`RunConfig`] of [`ModelSpec`]s in one process (on an actix system).
    #[cfg(feature = "actors")]
    pub use refit_actors::actor::{InferenceEngine, WeightSyncController};
    #[cfg(feature = "actors")]
    pub use refit_actors::run::{self, RunConfig, RunReport, StopRule};
}
