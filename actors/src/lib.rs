//! Refit actors: the actix actors and remote actors, hosting the plain-Rust RL of
//! `refit-rl` (which this crate re-exports, so `refit_actors::Collector` and
//! `refit_actors::collector::...` name the same items as `refit_rl::...`; the error type is
//! this crate's own, [`Error`]).
//!
//! - `actor` (feature `actix`, on by default): the actix actors — inference engine,
//!   weight-sync controller (sync modes, staleness, validation cadence, multi-model version
//!   barrier), rollout workers, trajectory pool, evaluator, trainer (hosting any
//!   [`Learner`]) — and `actor::topology::run`, a training run generic over [`Roles`].
//! - `remote` (feature `actix`): typed handles to actors in other processes or hosts, over
//!   the node layer (`refit-node`).
//! - Re-exported from `refit-rl`: [`mod@env`], [`policy`], [`collector`], [`multi`],
//!   [`process`], [`learner`], [`roles`], [`link`], [`batch`], [`device`], and with feature
//!   `candle` `ppo` and `cartpole_ppo`.
//! - [`error`]: the actor layer's error ([`Error`]), which keeps the configuration, runtime
//!   and generator failures of the layers below in the same variants.
//!
//! Without default features the crate is the RL re-exports and its error only, and builds
//! without candle and actix; `actix` alone builds the actors without candle. Cargo enforces that actix
//! stays here: `refit-rl` does not depend on it.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

#[cfg(feature = "actix")]
pub mod actor;
pub mod error;
pub use error::{Error, RemoteFailure, Result};
#[cfg(feature = "actix")]
pub mod conformance;
#[cfg(feature = "actix")]
pub mod protocol;
#[cfg(feature = "actix")]
pub mod remote;
#[cfg(feature = "actix")]
pub mod run;

pub use refit_rl::{
    ActionOut, Batch, CartPole, Collector, CollectorBuilder, CollectorConfig, Device, Env,
    EpisodeStats, LearnStats, Learner, MlpPolicy, ModelSpec, MultiAsyncCollector, MultiConfig,
    MultiSyncCollector, Observation, Policy, ReplayBuffer, RingBuffer, Roles, StepResult, TrajPool,
    TrajSpan, Transition, UpdatePolicyWeights, WeightInlet, WeightOutlet, WeightSource,
    WorkerCommand, WorkerLink, WorkerMessage, WorkerMode, policy_model_id, run_worker,
};
#[cfg(feature = "candle")]
pub use refit_rl::{
    CartPolePpo, GrpoConfig, GrpoLearner, GrpoRoles, PpoConfig, PpoStats, PpoTrainer, cartpole_ppo,
    grpo, grpo_roles, ppo, transformer,
};
pub use refit_rl::{
    Completion, EngineShape, Finish, GenRoles, Generator, LlamaShape, PauseMode, Reward,
    SamplingParams, Sequence, Task, Token,
};
pub use refit_rl::{
    batch, bigram, collector, device, env, generation, learner, link, llama, multi, policy,
    process, roles, scheduler, task,
};
