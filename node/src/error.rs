//! The one error type of the node crate.

use std::path::PathBuf;

/// Result alias used across the node crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error the node layer reports: its own (a refused peer, a remote handler's error, a
/// bad launch variable, an exposed secret file) or one of the core's, kept whole.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error of the core (a deadline, a vanished peer, a socket, the wire codec), as the
    /// core reports it.
    #[error(transparent)]
    Core(#[from] refit_runtime::Error),
    /// A peer presented no cluster token or a wrong one, or refused ours.
    #[error("peer {peer} refused: {reason}")]
    Unauthorized {
        /// Who (address).
        peer: String,
        /// Why.
        reason: String,
    },
    /// A cluster token from this process's configuration that cannot be used: its length
    /// or characters, a token file too large, or both token variables set. Names where the
    /// token came from and what a token must be; never shows the token.
    #[error("{source_name} {reason}")]
    BadToken {
        /// Where the token came from (`REFIT_TOKEN`, a file's path, `cluster token`).
        source_name: String,
        /// What is wrong (a predicate: `is 5 bytes long`), and what a token must be.
        reason: String,
    },
    /// A remote handler answered with an error.
    #[error("remote call `{method}` on {peer} failed: {message}")]
    Remote {
        /// Who answered.
        peer: String,
        /// The method called.
        method: String,
        /// The remote error, as the remote side wrote it.
        message: String,
    },
    /// A launch variable (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) is missing or bad.
    #[error("launch variable `{var}`: {reason}")]
    Launch {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A rank's program cannot be started, or its check before the launch refused the file
    /// (the message names the rank, the program and what to do).
    #[error("{0}")]
    Start(String),
    /// A file holding a secret (the cluster token) that users other than its owner may
    /// read; the secret is not used.
    #[error(
        "secret file `{}` is readable by its group or others (mode {mode:04o}); make it owner-only: chmod 600 `{}`",
        path.display(),
        path.display()
    )]
    InsecureSecretFile {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
}

impl Error {
    /// Builds a core [`refit_runtime::Error::Io`] with the given context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Core(refit_runtime::Error::io(context, source))
    }

    /// The node error a core error carries, if it carries one (after a `?` turned it into a
    /// [`refit_runtime::Error::Node`]).
    pub fn find(e: &refit_runtime::Error) -> Option<&Self> {
        match e {
            refit_runtime::Error::Node(inner) => inner.downcast_ref::<Self>(),
            _ => None,
        }
    }

    /// The core error inside, if this is one.
    pub fn core(&self) -> Option<&refit_runtime::Error> {
        match self {
            Self::Core(e) => Some(e),
            _ => None,
        }
    }

    /// True when this error says a deadline passed.
    pub fn is_timeout(&self) -> bool {
        self.core().is_some_and(refit_runtime::Error::is_timeout)
    }
}

/// A node error as a core error: core errors come back as they were; the node's own travel
/// boxed in [`refit_runtime::Error::Node`] ([`Error::find`] gives them back typed).
impl From<Error> for refit_runtime::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Core(e) => e,
            other => Self::Node(Box::new(other)),
        }
    }
}
