//! Refit RL: the reinforcement-learning loop in plain Rust, on top of the runtime (no actix;
//! the actix actors that host these pieces are in `refit-actors`). Everything but
//! [`process`] is synchronous; the process collectors talk to their worker processes over a
//! node (`refit-node`) on a tokio runtime of their own, which is why this crate depends on
//! both.
//!
//! - [`mod@env`]: the [`Env`] trait and [`CartPole`] (Gymnasium `CartPole-v1`, exactly).
//! - [`policy`]: the [`Policy`] trait and [`MlpPolicy`], a tanh MLP whose single-observation
//!   forward is plain Rust; weights load through a refit [`Strategy`](refit_runtime::Strategy).
//! - [`collector`]: [`Collector`], the per-step rollout loop with a carrier, trajectory ids,
//!   hooks, `postproc`, `split_trajs`, direct replay-buffer writes and a frame budget.
//! - [`multi`]: [`MultiSyncCollector`] and [`MultiAsyncCollector`] on worker threads, fed with
//!   weights through a refit scheme ([`run_worker`] is generic over the receiving transport;
//!   `refit_transports::inproc` between threads); [`process`]: the same with worker
//!   processes.
//! - [`generation`]: what a generating engine is asked and answers ([`SamplingParams`],
//!   [`Completion`] with per-token versions), and the [`Generator`] backend trait;
//!   [`task`]: the [`Task`] role (prompts and a verifiable reward); [`scheduler`]: the
//!   continuous-batching [`Scheduler`] a generating engine decodes with (requests join and
//!   leave between steps, versions swap at step boundaries as the [`PauseMode`] says);
//!   [`bigram`]: the smallest [`Generator`], a bigram table.
//! - [`sampling`]: a plain batched sampling loop over any [`Generator`] (temperature or
//!   greedy); [`tasks`]: token tasks with verifiable rewards ([`ReverseDigits`]);
//!   [`local_grpo`]: GRPO in one process (sample, reward, train, evaluate held-out).
//! - `transformer` (feature `candle`): a GPT-style transformer, trained in candle (`f32`,
//!   separate `q`/`k`/`v`) and served by `TransformerGenerator` (fused `qkv` in `bf16`,
//!   reached through refit's conversions, KV caches, continuous batching); `grpo`: the GRPO
//!   learner; `grpo_roles`: `GrpoRoles`, one implementation of [`GenRoles`].
//! - [`learner`]: the [`Learner`] trait (batches in, versioned weights out) a trainer hosts.
//! - [`llama`]: [`LlamaShape`], the layout of Hugging Face's `LlamaForCausalLM`, which a
//!   model of `arch = "llama"` is trained (by a Python learner) and served (by Python
//!   engines) in.
//! - [`roles`]: the [`Roles`] factory a topology takes (learner, policy and environment per
//!   model) and [`ModelSpec`]; `cartpole_ppo` (feature `candle`): PPO + [`MlpPolicy`] +
//!   [`CartPole`] as one implementation of them.
//! - [`link`]: type-erased scheme ends ([`WeightInlet`], [`WeightOutlet`]) for actors.
//! - `ppo` (feature `candle`, on by default): `PpoTrainer`, PPO with candle on CPU,
//!   exporting the [`MlpPolicy`] layout.
//! - [`error`]: the one error type of this crate.
//!
//! Without default features the crate holds the environments, policies, role traits and
//! collectors only, and builds without candle.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

pub mod batch;
pub mod bigram;
#[cfg(feature = "candle")]
pub mod cartpole_ppo;
pub mod collector;
pub mod device;
pub mod env;
pub mod error;
pub mod generation;
#[cfg(feature = "candle")]
pub mod grpo;
#[cfg(feature = "candle")]
pub mod grpo_roles;
pub mod learner;
pub mod link;
pub mod llama;
pub mod local_grpo;
pub mod multi;
#[cfg(feature = "candle")]
pub mod optim;
pub mod policy;
#[cfg(feature = "candle")]
pub mod ppo;
pub mod process;
pub mod roles;
pub mod sampling;
pub mod scheduler;
#[cfg(feature = "candle")]
pub mod state;
pub mod task;
pub mod tasks;
#[cfg(feature = "candle")]
pub mod transformer;

pub use batch::{
    Batch, EpisodeStats, Observation, ReplayBuffer, RingBuffer, Sequence, TrajPool, TrajSpan,
    Transition,
};
#[cfg(feature = "candle")]
pub use cartpole_ppo::CartPolePpo;
pub use collector::{
    Collector, CollectorBuilder, CollectorConfig, UpdatePolicyWeights, WeightSource,
    policy_model_id,
};
pub use device::Device;
pub use env::{CartPole, Env, StepResult};
pub use error::{Error, Result};
pub use generation::{Completion, Finish, Generator, PauseMode, SamplingParams, StepInput, Token};
#[cfg(feature = "candle")]
pub use grpo::{Correction, GrpoConfig, GrpoLearner};
#[cfg(feature = "candle")]
pub use grpo_roles::GrpoRoles;
pub use learner::{LearnStats, Learner};
pub use link::{WeightInlet, WeightOutlet};
pub use llama::LlamaShape;
pub use multi::{
    MultiAsyncCollector, MultiConfig, MultiSyncCollector, WorkerCommand, WorkerLink, WorkerMessage,
    WorkerMode, run_worker,
};
pub use policy::{ActionOut, MlpPolicy, Policy};
#[cfg(feature = "candle")]
pub use ppo::{PpoConfig, PpoStats, PpoTrainer};
pub use roles::{EngineShape, GenRoles, ModelSpec, Roles};
pub use scheduler::{RequestId, Scheduler, SchedulerConfig, SchedulerStats, StepReport, Swap};
pub use task::{Reward, Task};
pub use tasks::{ReverseConfig, ReverseDigits};
#[cfg(feature = "candle")]
pub use transformer::{Transformer, TransformerConfig, TransformerGenerator};
