//! Role protocols: one module per role of a topology, holding the role's messages, the
//! names they cross processes under, and one typed reference to the role that is built from
//! a local `Addr` or from a remote handle ([`RemoteAddr`](crate::remote::RemoteAddr)) and
//! used the same way.
//!
//! | role | module | reference |
//! | --- | --- | --- |
//! | inference engine (acting or generating) | [`engine`] | [`EngineRef`] |
//! | weight-sync controller | [`controller`] | [`ControllerRef`], [`ControllerLink`] |
//! | trajectory pool | [`pool`] | [`PoolRef`] |
//! | rollout worker | [`rollout`] | [`RolloutRef`] |
//! | evaluator | [`eval`] | `Recipient<RunEval>` |
//! | trainer | [`trainer`] | `Recipient<TrainAndPublish>` (always beside its driver); a sharded trainer's other shards: [`ShardRef`](trainer::ShardRef), its assembly: [`AssemblyRef`](trainer::AssemblyRef) |
//! | the run's lead | [`lead`] | [`LeadRef`] |
//!
//! Actors import protocols, never each other: a role's implementation can change, or run
//! in another process, without its callers noticing.

pub mod controller;
pub mod engine;
pub mod eval;
pub mod lead;
pub mod pool;
pub mod rollout;
pub mod trainer;

pub use controller::{ControllerLink, ControllerRef};
pub use engine::{EngineActor, EngineRef};
pub use lead::LeadRef;
pub use pool::PoolRef;
pub use rollout::RolloutRef;
