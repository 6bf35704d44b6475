//! The one error type of the RL crate, which the actors crate (`refit-actors`) shares.

use std::time::Duration;

use crate::device::Device;

/// Result alias used across the RL and actors crates.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error the RL crate and the actors built on it report. Messages are lowercase and keep their cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A weight-sync or weight-layout failure reported by the runtime.
    #[error("runtime: {0}")]
    Runtime(#[from] refit_runtime::Error),
    /// A failure inside candle (the trainer's tensor library).
    #[cfg(feature = "candle")]
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// A device that this build cannot run on.
    #[error("device {0} is not supported (only cpu is implemented)")]
    DeviceNotSupported(Device),
    /// `split_trajs` was asked for while `track_traj_ids` is off.
    #[error("split_trajs requires track_traj_ids (trajectories are split by their ids)")]
    SplitTrajsWithoutTrajIds,
    /// A configuration value that cannot work.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An environment failed to reset or step.
    #[error("environment {env}: {message}")]
    Env {
        /// Index of the environment inside its collector.
        env: usize,
        /// What went wrong.
        message: String,
    },
    /// A user hook (pre/post collect, postproc) failed; collection stops.
    #[error("{hook} failed: {message}")]
    Hook {
        /// Which hook.
        hook: &'static str,
        /// What it reported.
        message: String,
    },
    /// A weight set was offered under a model id it does not belong to.
    #[error("weight set of model `{found}` offered as model `{expected}`")]
    ModelMismatch {
        /// The id the caller named.
        expected: String,
        /// The id the weight set carries.
        found: String,
    },
    /// `update_policy_weights` was called with no registered policy.
    #[error("no policy is registered to pull weights from (call register_policy first)")]
    NoRegisteredPolicy,
    /// A collector worker reported an error.
    #[error("worker {worker}: {source}")]
    Worker {
        /// Worker index.
        worker: usize,
        /// What it reported.
        #[source]
        source: Box<Error>,
    },
    /// A collector worker stopped without reporting (panic, closed channel).
    #[error("worker {worker} is gone: {reason}")]
    WorkerGone {
        /// Worker index.
        worker: usize,
        /// Why we believe so.
        reason: String,
    },
    /// The collector was used after shutdown.
    #[error("collector is shut down")]
    Closed,
    /// An actor could not be reached or stopped (mailbox closed, timed out).
    #[error("actor: {0}")]
    Actor(String),
    /// A request of an episode that was cancelled (an eval step's leader cancels in-flight
    /// episodes so that pause and load are not contended).
    #[error("episode cancelled (the engine's cancellation epoch is now {epoch})")]
    Cancelled {
        /// The engine's cancellation epoch after the cancellation.
        epoch: u64,
    },
    /// A generation request refused before it ran (the engine keeps serving the others).
    #[error("bad request: {field} {reason}")]
    BadRequest {
        /// The request field at fault (`prompt`, `max_tokens`, `temperature`, ...).
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A generating backend failed at a decoding step or refused a weight set (the engine
    /// keeps serving the version it has).
    #[error("generator of model `{model}`: {reason}")]
    Generator {
        /// The model it serves.
        model: String,
        /// What went wrong, naming the tensor, request or step.
        reason: String,
    },
    /// A trainer input that cannot be trained on.
    #[error("trainer: {0}")]
    Trainer(String),
    /// A shard of a sharded trainer failed one update of its model: it died, missed the
    /// deadline, or wrote a part of another version, layout or size. The version is not
    /// published; the previous one stays served.
    #[error(
        "sharded trainer of model `{model}`, version {version}: shard {shard} (rank {rank}) {reason}"
    )]
    Shard {
        /// The model.
        model: refit_runtime::ModelId,
        /// The version being assembled.
        version: refit_runtime::Version,
        /// The shard's index among the trainer's ranks (0 publishes).
        shard: usize,
        /// The rank of the topology holding that shard.
        rank: u32,
        /// What went wrong.
        reason: String,
    },
    /// A message to an actor in another process failed (see `remote`, feature `actix`).
    #[error("remote actor `{actor}`, message `{message}`: {failure}")]
    Remote {
        /// The actor, as named when its handle was made.
        actor: String,
        /// The message's wire name.
        message: &'static str,
        /// What went wrong.
        failure: RemoteFailure,
    },
}

/// How a message to an actor in another process failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RemoteFailure {
    /// The connection to the actor's process is gone (the process died or closed it), or
    /// could not be made.
    PeerGone {
        /// Why we believe so.
        reason: String,
    },
    /// No answer came within the call's deadline.
    Timeout {
        /// The deadline.
        after: Duration,
    },
    /// The actor's node refused the call: no such actor or message there, or a request it
    /// could not decode.
    Refused {
        /// What the node said.
        reason: String,
    },
    /// The message could not be encoded, or the answer could not be decoded.
    Malformed {
        /// The codec's complaint.
        reason: String,
    },
    /// The actor's process lives but the actor is stopped (its mailbox is closed).
    ActorStopped {
        /// What the mailbox said.
        reason: String,
    },
    /// The actor handled the message and answered with an error.
    Failed {
        /// The actor's error, as the remote side wrote it.
        error: String,
    },
}

impl std::fmt::Display for RemoteFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PeerGone { reason } => write!(f, "its process is gone: {reason}"),
            Self::Timeout { after } => write!(f, "no answer within {after:?}"),
            Self::Refused { reason } => write!(f, "refused by its node: {reason}"),
            Self::Malformed { reason } => write!(f, "malformed message: {reason}"),
            Self::ActorStopped { reason } => write!(f, "the actor is stopped: {reason}"),
            Self::Failed { error } => write!(f, "the actor failed: {error}"),
        }
    }
}

impl Error {
    /// Checks a model's sizes: [`Error::Config`] naming the first of `sizes` that is zero,
    /// as `{kind} {name} must be positive`.
    ///
    /// # Errors
    /// As said.
    pub(crate) fn check_positive(kind: &str, sizes: &[(&str, usize)]) -> Result<()> {
        match sizes.iter().find(|(_, v)| *v == 0) {
            Some((name, _)) => Err(Self::Config(format!("{kind} {name} must be positive"))),
            None => Ok(()),
        }
    }

    /// Builds an [`Error::Hook`], for hooks that fail.
    pub fn hook(hook: &'static str, message: impl Into<String>) -> Self {
        Self::Hook {
            hook,
            message: message.into(),
        }
    }

    /// The failure of a remote call, if this is one ([`Error::Remote`]).
    pub fn remote_failure(&self) -> Option<&RemoteFailure> {
        match self {
            Self::Remote { failure, .. } => Some(failure),
            _ => None,
        }
    }

    /// Builds an [`Error::BadRequest`] naming `field`.
    pub fn bad_request(field: &'static str, reason: impl Into<String>) -> Self {
        Self::BadRequest {
            field,
            reason: reason.into(),
        }
    }

    /// Builds an [`Error::Env`], for environments that fail.
    pub fn env(env: usize, message: impl Into<String>) -> Self {
        Self::Env {
            env,
            message: message.into(),
        }
    }
}

impl From<refit_node::Error> for Error {
    fn from(e: refit_node::Error) -> Self {
        Self::Runtime(e.into())
    }
}
