//! The one error type of the RL crate. The actors crate (`refit-actors`) has its own, which
//! keeps this one's configuration, runtime and generator failures as they are and carries
//! the rest whole.

use crate::device::Device;

/// Result alias used across the RL crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error the RL crate reports. Messages are lowercase and keep their cause.
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
    ///
    /// This one, `Runtime`, `BadRequest` and `Generator` are the actors' too:
    /// `refit_actors::Error`'s conversion from this error keeps them as themselves (a variant
    /// added here that the actors share belongs in that conversion).
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

    /// Checks that one size divides another: [`Error::Config`] as
    /// `{kind} {part} ({p}) must divide {whole} ({w})` when it does not.
    ///
    /// # Errors
    /// As said.
    pub(crate) fn check_divides(
        kind: &str,
        (part, p): (&str, usize),
        (whole, w): (&str, usize),
    ) -> Result<()> {
        if w.is_multiple_of(p) {
            Ok(())
        } else {
            Err(Self::Config(format!(
                "{kind} {part} ({p}) must divide {whole} ({w})"
            )))
        }
    }

    /// Builds an [`Error::Hook`], for hooks that fail.
    pub fn hook(hook: &'static str, message: impl Into<String>) -> Self {
        Self::Hook {
            hook,
            message: message.into(),
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
