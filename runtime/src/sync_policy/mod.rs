//! The sync policy as plain code: *when* weights move and when rollouts may run.
//!
//! Nothing here does I/O, sleeps or knows about actors; the controller actor
//! (`refit_actors::actor::controller`) feeds these types the events it receives and carries
//! out what they decide.
//!
//! - [`SyncConfig`]: mode, staleness threshold, staleness filter, validation cadence,
//!   models and deadlines, read from TOML with errors for unknown keys and bad values.
//! - [`SyncPolicy`]: per model `train_version`, `rollout_version` and a state
//!   `running | need_sync | syncing`; answers the rollout status check (`continue` or
//!   `block`, with the reason), and turns batch-ready, trainer-finished, sync-done and
//!   end-of-validation events into sync orders.
//! - [`StalenessFilter`]: drops samples older than allowed and counts them.
//! - [`VersionBarrier`]: records each trainer's version and names the round's leader once
//!   every model has arrived at the same version; [`LeaderStep`] is the leader's fixed
//!   sequence on eval steps.

mod barrier;
mod config;
mod policy;
mod staleness;

pub use barrier::{LeaderStep, Round, VersionBarrier, leader_sequence};
pub use config::{PauseMode, SyncConfig, SyncMode, Timeouts};
pub use policy::{BlockReason, Decision, ModelSync, RolloutState, SyncOrder, SyncPolicy};
pub use staleness::{StalenessFilter, StalenessStats};
