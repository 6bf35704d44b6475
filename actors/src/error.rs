//! The one error type of the actor layer.
//!
//! It keeps what every layer below reports in the same variants (`Runtime`, `Config`,
//! `Generator`, `BadRequest`), so a caller matches a configuration error the same way
//! whether a topology check or a learner found it, and adds what only actors report: an
//! actor out of reach, a cancelled episode, a failed shard of a sharded trainer, a failed
//! call to an actor in another process. The rest of what the RL crate reports (an
//! environment, a hook, a collector's worker) is carried whole in [`Error::Rl`].

use std::time::Duration;

/// Result alias used across the actors crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error the actor layer reports. Messages are lowercase and keep their cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A weight-sync or weight-layout failure reported by the runtime (or by a transport or a
    /// node, which the runtime's error carries).
    #[error("runtime: {0}")]
    Runtime(#[from] refit_runtime::Error),
    /// A configuration value that cannot work.
    #[error("invalid configuration: {0}")]
    Config(String),
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
    /// Any other failure of the RL layer (a learner, an environment, a hook, a collector).
    /// Built by `?` or `.into()` from a [`refit_rl::Error`], which never puts one of the
    /// variants above here; do not construct it directly.
    #[error(transparent)]
    Rl(refit_rl::Error),
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

    /// A request to a local actor that got no answer: past its deadline `after` (a
    /// timeout naming `what`), or to an actor that stopped.
    #[cfg(feature = "actix")]
    pub(crate) fn unanswered(e: actix::MailboxError, after: Duration, what: String) -> Self {
        match e {
            actix::MailboxError::Timeout => {
                Self::Runtime(refit_runtime::Error::Timeout { what, after })
            }
            actix::MailboxError::Closed => Self::Actor(format!("{what}: it stopped")),
        }
    }
}

/// What the RL layer reports keeps its variant where the actor layer has the same one, so
/// `Error::Config` means a configuration error wherever it was found.
impl From<refit_rl::Error> for Error {
    fn from(e: refit_rl::Error) -> Self {
        match e {
            refit_rl::Error::Runtime(e) => Self::Runtime(e),
            refit_rl::Error::Config(m) => Self::Config(m),
            refit_rl::Error::BadRequest { field, reason } => Self::BadRequest { field, reason },
            refit_rl::Error::Generator { model, reason } => Self::Generator { model, reason },
            e => Self::Rl(e),
        }
    }
}

#[cfg(feature = "actix")]
impl From<refit_node::Error> for Error {
    fn from(e: refit_node::Error) -> Self {
        Self::Runtime(e.into())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_rl_layers_errors_keep_their_variant_or_are_carried_whole() {
        let config = Error::from(refit_rl::Error::Config("lr must be positive".into()));
        assert!(matches!(&config, Error::Config(m) if m == "lr must be positive"));
        assert_eq!(
            config.to_string(),
            "invalid configuration: lr must be positive"
        );
        let bad = Error::from(refit_rl::Error::bad_request("prompt", "is empty"));
        assert!(
            matches!(&bad, Error::BadRequest { field: "prompt", reason } if reason == "is empty")
        );
        let generator = Error::from(refit_rl::Error::Generator {
            model: "policy".into(),
            reason: "step 3 failed".into(),
        });
        assert!(matches!(
            &generator,
            Error::Generator { model, reason } if model == "policy" && reason == "step 3 failed"
        ));
        let critic = refit_runtime::ModelId::new("critic").unwrap();
        let runtime = Error::from(refit_rl::Error::Runtime(
            refit_runtime::Error::UnknownModel(critic),
        ));
        assert!(matches!(
            &runtime,
            Error::Runtime(refit_runtime::Error::UnknownModel(m)) if m.as_str() == "critic"
        ));
        assert!(runtime.to_string().starts_with("runtime: "), "{runtime}");
        let env = Error::from(refit_rl::Error::env(3, "diverged"));
        assert!(matches!(
            &env,
            Error::Rl(refit_rl::Error::Env { env: 3, .. })
        ));
        assert_eq!(env.to_string(), "environment 3: diverged");
    }
}
