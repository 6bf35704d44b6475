//! What may cross processes: [`RemoteMessage`] and the wire form of its answer
//! ([`RemoteReply`]).

use actix::Message;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, RemoteFailure};

/// An actix message that can be sent to an actor in another process.
///
/// The message travels as msgpack (rmp-serde, fields by name) of the type itself and its
/// answer as the wire form of `Self::Result` (see [`RemoteReply`]: the type itself, or for
/// `crate::Result<T>` the value or a description of the error). `NAME` is the method name
/// on the actor's node: two messages served by one actor need different names.
pub trait RemoteMessage:
    Message<Result: RemoteReply> + Serialize + DeserializeOwned + Send + 'static
{
    /// The message's name on the wire (the node method it is served under).
    const NAME: &'static str;
}

/// The answer of a [`RemoteMessage`], as it crosses processes.
///
/// Implemented for the standard answer types, which cross as they are (a type of your own:
/// [`remote_reply!`](crate::remote_reply)), and for
/// [`crate::Result<T>`](crate::Result) of any `Serialize + DeserializeOwned` `T`, whose error crosses as [`WireError`] and comes back
/// as [`Error::Remote`] with [`RemoteFailure::Failed`] (or [`Error::Cancelled`], which
/// callers branch on, as itself).
///
/// What a failed call answers through a proxy `Recipient` ([`RemoteAddr::recipient`]):
/// `crate::Result<T>` answers `Err(Error::Remote { .. })`; other types cannot carry an
/// error, so the proxy drops the reply: the sender sees `MailboxError::Closed`, as from a
/// stopped local actor (and the failure is logged, naming actor and message).
///
/// [`RemoteAddr::recipient`]: super::RemoteAddr::recipient
pub trait RemoteReply: Sized + Send + 'static {
    /// The form on the wire.
    type Wire: Serialize + DeserializeOwned + Send + 'static;
    /// Into the wire form (serving side).
    fn into_wire(self) -> Self::Wire;
    /// Back from the wire form (calling side); `actor` and `message` name the call in errors.
    fn from_wire(wire: Self::Wire, actor: &str, message: &'static str) -> Self;
    /// The answer that reports a failed call, where this type can hold one.
    fn from_failure(error: Error) -> Option<Self>;
}

/// Names messages on the wire: `wire_names! { UpdateModel => "_receive_weights_scheme" }`
/// implements [`RemoteMessage`] for each type (used by the role protocols).
macro_rules! wire_names {
    ($($ty:ty => $name:literal),* $(,)?) => {
        $(impl $crate::remote::RemoteMessage for $ty {
            const NAME: &'static str = $name;
        })*
    };
}
pub(crate) use wire_names;

/// Implements [`RemoteReply`](crate::remote::RemoteReply) for answer types that cross
/// processes as they are (`Serialize + DeserializeOwned`); a failed call through a proxy
/// drops their reply (see [`RemoteReply`](crate::remote::RemoteReply)).
///
/// The standard types (`()`, integers, floats, `bool`, `String`, `Option`, `Vec`,
/// `BTreeMap`, versions and model ids) are covered; a message answering a type of its own
/// names it here:
///
/// ```
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Count(u64);
/// refit_actors::remote_reply!(Count);
/// ```
#[macro_export]
macro_rules! remote_reply {
    (@generic [$($gen:tt)*] $ty:ty) => {
        impl<$($gen)*> $crate::remote::RemoteReply for $ty {
            type Wire = Self;
            fn into_wire(self) -> Self {
                self
            }
            fn from_wire(wire: Self, _: &str, _: &'static str) -> Self {
                wire
            }
            fn from_failure(_: $crate::Error) -> Option<Self> {
                None
            }
        }
    };
    ($($ty:ty),* $(,)?) => {
        $(impl $crate::remote::RemoteReply for $ty {
            type Wire = Self;
            fn into_wire(self) -> Self {
                self
            }
            fn from_wire(wire: Self, _: &str, _: &'static str) -> Self {
                wire
            }
            fn from_failure(_: $crate::Error) -> Option<Self> {
                None
            }
        })*
    };
}

crate::remote_reply!(
    (),
    bool,
    u8,
    u16,
    u32,
    u64,
    usize,
    i8,
    i16,
    i32,
    i64,
    isize,
    f32,
    f64,
    String,
    refit_runtime::Version,
    refit_runtime::ModelId,
);

// Containers of wire values cross as they are.
crate::remote_reply!(@generic [T: Serialize + DeserializeOwned + Send + 'static] Option<T>);
crate::remote_reply!(@generic [T: Serialize + DeserializeOwned + Send + 'static] Vec<T>);
crate::remote_reply!(@generic [
    K: Ord + Serialize + DeserializeOwned + Send + 'static,
    V: Serialize + DeserializeOwned + Send + 'static
] std::collections::BTreeMap<K, V>);

impl<T: Serialize + DeserializeOwned + Send + 'static> RemoteReply for crate::Result<T> {
    type Wire = std::result::Result<T, WireError>;
    fn into_wire(self) -> Self::Wire {
        self.map_err(WireError::from)
    }
    fn from_wire(wire: Self::Wire, actor: &str, message: &'static str) -> Self {
        wire.map_err(|e| e.into_error(actor, message))
    }
    fn from_failure(error: Error) -> Option<Self> {
        Some(Err(error))
    }
}

/// An actor's error as it crosses processes: [`Error::Cancelled`] keeps its variant, every
/// other error travels as its message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    /// The epoch of an [`Error::Cancelled`].
    cancelled: Option<u64>,
    /// The error's message.
    message: String,
}

impl From<Error> for WireError {
    fn from(e: Error) -> Self {
        let cancelled = match e {
            Error::Cancelled { epoch } => Some(epoch),
            _ => None,
        };
        Self {
            cancelled,
            message: e.to_string(),
        }
    }
}

impl WireError {
    /// The error on the calling side.
    fn into_error(self, actor: &str, message: &'static str) -> Error {
        match self.cancelled {
            Some(epoch) => Error::Cancelled { epoch },
            None => Error::Remote {
                actor: actor.to_owned(),
                message,
                failure: RemoteFailure::Failed {
                    error: self.message,
                },
            },
        }
    }
}

/// What a serving node answers: the actor's reply, or why the actor could not answer.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Answer<W> {
    /// The actor's reply, in its wire form.
    Reply(W),
    /// The actor's mailbox is closed.
    Stopped(String),
    /// The actor did not answer before the call's deadline.
    TimedOut,
}
