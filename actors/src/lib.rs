//! Refit actors: the reinforcement-learning loop on top of the runtime.
//!
//! - [`mod@env`]: the [`Env`] trait and [`CartPole`] (Gymnasium `CartPole-v1`, exactly).
//! - [`policy`]: the [`Policy`] trait and [`MlpPolicy`], a tanh MLP whose single-observation
//!   forward is plain Rust; weights load through a refit [`Strategy`](refit_runtime::Strategy).
//! - [`collector`]: [`Collector`], the per-step rollout loop with a carrier, trajectory ids,
//!   hooks, `postproc`, `split_trajs`, direct replay-buffer writes and a frame budget.
//! - [`multi`]: [`MultiSyncCollector`] and [`MultiAsyncCollector`] on worker threads, fed with
//!   weights through a refit scheme ([`run_worker`] is generic over the receiving transport;
//!   `refit_transports::inproc` between threads).
//! - `actor` (feature `actix`, on by default): the actix actors — inference engine, weight-sync controller (sync modes,
//!   staleness, validation cadence, multi-model version barrier), rollout workers,
//!   trajectory pool, evaluator, trainer (hosting any [`Learner`]) — and
//!   `actor::topology::run`, a training run generic over [`Roles`].
//! - [`learner`]: the [`Learner`] trait (batches in, versioned weights out) a trainer hosts.
//! - [`roles`]: the [`Roles`] factory a topology takes (learner, policy and environment per
//!   model) and [`ModelSpec`]; `cartpole_ppo` (feature `candle`): PPO + [`MlpPolicy`] +
//!   [`CartPole`] as one implementation of them.
//! - `remote` (feature `actix`): typed handles to actors in other processes or hosts, over
//!   the runtime's node layer ([`refit_node`]).
//! - [`link`]: type-erased scheme ends ([`WeightInlet`], [`WeightOutlet`]) for actors.
//! - `ppo` (feature `candle`, on by default): `PpoTrainer`, PPO with candle on CPU,
//!   exporting the [`MlpPolicy`] layout.
//!
//! Without default features the crate holds the environments, policies, role traits and
//! collectors only, and builds without candle and actix; `actix` alone builds the actors
//! without candle.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

#[cfg(feature = "actix")]
pub mod actor;
pub mod batch;
#[cfg(feature = "candle")]
pub mod cartpole_ppo;
pub mod collector;
pub mod device;
pub mod env;
pub mod error;
pub mod learner;
pub mod link;
pub mod multi;
pub mod policy;
#[cfg(feature = "candle")]
pub mod ppo;
pub mod process;
#[cfg(feature = "actix")]
pub mod remote;
pub mod roles;

pub use batch::{Batch, EpisodeStats, ReplayBuffer, RingBuffer, TrajPool, TrajSpan, Transition};
#[cfg(feature = "candle")]
pub use cartpole_ppo::CartPolePpo;
pub use collector::{
    Collector, CollectorBuilder, CollectorConfig, UpdatePolicyWeights, WeightSource,
    policy_model_id,
};
pub use device::Device;
pub use env::{CartPole, Env, StepResult};
pub use error::{Error, RemoteFailure, Result};
pub use learner::{LearnStats, Learner};
pub use link::{WeightInlet, WeightOutlet};
pub use multi::{
    MultiAsyncCollector, MultiConfig, MultiSyncCollector, WorkerCommand, WorkerLink, WorkerMessage,
    WorkerMode, run_worker,
};
pub use policy::{ActionOut, MlpPolicy, Policy};
#[cfg(feature = "candle")]
pub use ppo::{PpoConfig, PpoStats, PpoTrainer};
pub use roles::{ModelSpec, Roles};
