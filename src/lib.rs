//! Refit: an actor framework for reinforcement-learning pipelines whose core job is to move
//! fresh model weights from trainers to everything that runs the policy — versioned, never
//! torn, with clear errors and nothing lost.
//!
//! This facade re-exports the workspace crates:
//! - [`runtime`]: weight sets, manifests, versions, strategies, the scheme lifecycle and the
//!   sans-IO sync protocol;
//! - [`transports`]: in-process and shared-memory transports;
//! - [`actors`]: environments, policies, collectors, the PPO trainer and the actors.
//!
//! The most used items are also at the root: see the [`prelude`].
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

pub use refit_actors as actors;
pub use refit_runtime as runtime;
pub use refit_transports as transports;

mod setup;
pub use setup::{DEFAULT_LOG, init, init_logging};

/// The items most programs need.
pub mod prelude {
    pub use refit_runtime::{
        ArenaStrategy, DType, Error, HasWeights, Manifest, Manifests, ModelId, Receiver,
        ReceiverInit, Result, Sender, SenderInit, SharedBytes, Strategy, Version, WeightSet,
    };
    pub use refit_transports::inproc::InProc;
    pub use refit_transports::shm::{
        ShmConfig, ShmReadMode, ShmReceiver, ShmReceiverSpec, ShmSender,
    };
}
