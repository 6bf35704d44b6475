//! Role protocols: one module per role of a topology, holding the role's messages, the
//! names they cross processes under, and one typed reference to the role that is built from
//! a local `Addr` or from a remote handle ([`RemoteAddr`](crate::remote::RemoteAddr)) and
//! used the same way. Each reference is declared once (`role_ref!`): one recipient per
//! message, from which its `local` and `remote` constructors and `serve` follow.
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
mod role_ref;
pub mod rollout;
pub mod trainer;

pub(crate) use role_ref::role_ref;

/// The version of the rank contract this build speaks: the messages of every role above,
/// under their wire names, and what ranks publish to the rendezvous. Each rank's card
/// carries it and rank 0 refuses a rank of another version, naming both, before it sends
/// that rank anything (a `refit` Python package and a `refit` binary of different builds).
/// Raised with every change of these messages that a rank of the previous build would
/// misread. The node protocol below it has its own version
/// ([`refit_node::PROTOCOL_VERSION`]).
pub const CONTRACT_VERSION: u32 = 1;

pub use controller::{ControllerLink, ControllerRef};
pub use engine::{EngineActor, EngineRef};
pub use lead::LeadRef;
pub use pool::PoolRef;
pub use rollout::RolloutRef;
