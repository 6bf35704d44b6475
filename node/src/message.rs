//! What nodes say to each other: typed structs in named msgpack, nothing executable.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Largest hello frame accepted before the peer has proven it holds the token.
pub const MAX_HELLO: usize = 4096;

/// The first frame of every connection.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Hello {
    /// The cluster token.
    pub(crate) token: String,
    /// The connecting node.
    pub(crate) node: Uuid,
    /// What the connection is for.
    pub(crate) kind: ConnKind,
}

/// What a connection carries after the hello.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum ConnKind {
    /// Request/reply frames.
    Rpc,
    /// One request frame, then raw bytes written by a stream handler.
    Stream {
        /// The handler's owner.
        target: Uuid,
        /// The handler's method.
        method: String,
    },
}

/// The answer to a hello.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Welcome {
    /// Accepted; the answering node's id.
    Ok {
        /// The answering node.
        node: Uuid,
    },
    /// Refused, and why (the connection closes).
    Refused {
        /// Why.
        reason: String,
    },
}

/// One remote call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Request {
    /// Matches the reply to the call.
    pub(crate) call: u64,
    /// The handler's owner.
    pub(crate) target: Uuid,
    /// The handler's method.
    pub(crate) method: String,
    /// How long the caller waits, in milliseconds (the handler is cut off after it).
    pub(crate) timeout_ms: u64,
    /// The argument, msgpack of the handler's request type.
    #[serde(with = "serde_bytes")]
    pub(crate) payload: Vec<u8>,
}

/// The answer to one call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Reply {
    /// The call answered.
    pub(crate) call: u64,
    /// The handler's result or error message.
    pub(crate) outcome: Outcome,
}

/// What a handler produced.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Outcome {
    /// msgpack of the handler's response type.
    Ok(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The handler's error, as text.
    Err(String),
    /// The handler did not finish within the call's timeout (the caller's own deadline,
    /// reached on the server first): the caller reports a timeout, as when its timer fires.
    TimedOut,
}

/// The head of a stream a stream handler writes: how many raw bytes follow, or why none.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum StreamHead {
    /// This many raw bytes follow.
    Ok {
        /// Byte count.
        len: u64,
    },
    /// Nothing follows.
    Err {
        /// Why.
        reason: String,
    },
}
