//! What nodes say to each other: typed structs in named msgpack, nothing executable.

use std::net::SocketAddr;

use refit_runtime::{Error as CoreError, wire};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Error, Result};

/// Largest hello frame accepted before the peer has proven it holds the token.
pub const MAX_HELLO: usize = 4096;

/// The version of the node protocol (the hello, the welcome, remote calls and streams)
/// this build speaks. Every hello and welcome carries it; a node refuses a peer of another
/// version, naming both, before it reads anything else. Raised with every change of these
/// messages that an older peer would misread.
pub const PROTOCOL_VERSION: u32 = 1;

/// The first frame of every connection.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Hello {
    /// The node protocol version the connecting node speaks ([`PROTOCOL_VERSION`]; 0 from
    /// a node of before protocol versions). Read first, alone.
    #[serde(default)]
    pub(crate) protocol: u32,
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
        /// The node protocol version it speaks (0 from a node of before protocol
        /// versions); the connecting node checks it too.
        #[serde(default)]
        protocol: u32,
    },
    /// Refused, and why (the connection closes).
    Refused {
        /// Why.
        reason: String,
        /// The refusing node's protocol version, when the refusal is about the version.
        #[serde(default)]
        protocol: Option<u32>,
    },
}

/// The name of the node protocol in errors.
pub(crate) const PROTOCOL_NAME: &str = "node";

impl Hello {
    /// Decodes a hello frame, its protocol version first: a peer of another version is
    /// refused naming both (whatever the rest of its hello holds).
    ///
    /// # Errors
    /// [`CoreError::Protocol`] for another version; [`CoreError::Wire`] for a malformed hello.
    pub(crate) fn decode(body: &[u8], peer: SocketAddr) -> refit_runtime::Result<Self> {
        let theirs = wire::peek_protocol(body, MAX_HELLO)?;
        CoreError::check_protocol(
            format!("node at {peer}"),
            PROTOCOL_NAME,
            PROTOCOL_VERSION,
            theirs,
        )?;
        wire::decode(body, MAX_HELLO)
    }
}

impl Welcome {
    /// The welcome of a node that refuses a hello of another protocol version.
    pub(crate) fn wrong_protocol(e: &CoreError) -> Self {
        Self::Refused {
            reason: e.to_string(),
            protocol: Some(PROTOCOL_VERSION),
        }
    }

    /// What a connecting node makes of the welcome of the node at `addr`: the answering
    /// node's id.
    ///
    /// # Errors
    /// [`CoreError::Protocol`] naming both versions when the node speaks another protocol
    /// version (its welcome says so, or it refused ours for it); [`Error::Unauthorized`]
    /// when it refused us for another reason.
    pub(crate) fn accepted(self, addr: SocketAddr) -> Result<Uuid> {
        let check = |theirs| {
            CoreError::check_protocol(
                format!("node at {addr}"),
                PROTOCOL_NAME,
                PROTOCOL_VERSION,
                theirs,
            )
        };
        match self {
            Welcome::Ok { node, protocol } => {
                check(protocol)?;
                Ok(node)
            }
            Welcome::Refused {
                reason,
                protocol: Some(theirs),
            } => {
                check(theirs)?;
                Err(Error::Unauthorized {
                    peer: addr.to_string(),
                    reason,
                })
            }
            Welcome::Refused { reason, .. } => Err(Error::Unauthorized {
                peer: addr.to_string(),
                reason,
            }),
        }
    }
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
