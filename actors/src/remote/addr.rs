//! The calling side: [`RemoteAddr`], a typed handle to an actor in another process.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use refit_node::{Node, Peer};
use refit_runtime::wire::{self, MAX_CONTROL_MESSAGE};
use uuid::Uuid;

use super::message::{Answer, RemoteMessage, RemoteReply};
use crate::error::{Error, RemoteFailure, Result};

/// A handle to an actor served (see [`serve`](super::serve)) by another process: the
/// connection to its node, its uuid there, a name for errors and a default deadline.
///
/// Cheap to clone; clones share the connection.
#[derive(Debug, Clone)]
pub struct RemoteAddr {
    peer: Peer,
    target: Uuid,
    name: Arc<str>,
    deadline: Duration,
}

impl RemoteAddr {
    /// The actor `target` on the node at the other end of `peer`, called `name` in errors;
    /// every send waits at most `deadline` unless told otherwise.
    pub fn new(peer: Peer, target: Uuid, name: impl Into<String>, deadline: Duration) -> Self {
        Self {
            peer,
            target,
            name: Arc::from(name.into()),
            deadline,
        }
    }

    /// Connects `node` to the node at `addr` (within `deadline`) and makes the handle of
    /// its actor `target`. The connection runs on `node`'s runtime: keep `node` alive while
    /// the handle is used (after it stops, calls fail at their deadline).
    ///
    /// # Errors
    /// [`Error::Remote`] naming the actor (message `connect`), with
    /// [`RemoteFailure::PeerGone`] when the node cannot be reached,
    /// [`RemoteFailure::Refused`] when it refuses our cluster token,
    /// [`RemoteFailure::Timeout`] past the deadline.
    ///
    /// # Cancel safety
    /// Dropping the future does not stop the connect: it runs on `node`'s runtime to its
    /// end (within `deadline`) and its outcome is dropped; no handle is made. Connect again.
    pub async fn connect(
        node: &Node,
        addr: SocketAddr,
        target: Uuid,
        name: impl Into<String>,
        deadline: Duration,
    ) -> Result<Self> {
        let name = name.into();
        let n = node.clone();
        let joined = node
            .handle()
            .spawn(async move { n.connect_async(addr, deadline).await })
            .await;
        let fail = |failure| Error::Remote {
            actor: name.clone(),
            message: "connect",
            failure,
        };
        let peer = match joined {
            Ok(Ok(peer)) => peer,
            Ok(Err(e)) => return Err(fail(failure_of(e))),
            Err(e) => {
                return Err(fail(RemoteFailure::PeerGone {
                    reason: format!("the node's runtime dropped the connect: {e}"),
                }));
            }
        };
        Ok(Self::new(peer, target, name, deadline))
    }

    /// Another actor served by the same node, on the same connection, called `name`.
    #[must_use]
    pub fn at(&self, target: Uuid, name: impl Into<String>) -> Self {
        Self {
            peer: self.peer.clone(),
            target,
            name: Arc::from(name.into()),
            deadline: self.deadline,
        }
    }

    /// The same handle with another default deadline.
    #[must_use]
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The actor's name (as given when the handle was made).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The actor's uuid on its node.
    pub fn target(&self) -> Uuid {
        self.target
    }

    /// The default deadline of a send.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The connection to the actor's node.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Sends `msg` and waits for the answer, at most the default deadline.
    ///
    /// Must be awaited inside a tokio runtime (an actix arbiter is one).
    ///
    /// # Errors
    /// [`Error::Remote`] naming the actor and `M::NAME`, with the [`RemoteFailure`]: the
    /// peer is gone, the deadline passed, the node refused the call, the message or answer
    /// is malformed, or the actor is stopped. An error *answered* by the actor is inside
    /// `Ok` (for `crate::Result` answers: `Ok(Err(..))`).
    ///
    /// # Cancel safety
    /// As [`RemoteAddr::send_within`].
    pub async fn send<M: RemoteMessage>(&self, msg: M) -> Result<M::Result> {
        self.send_within(msg, self.deadline).await
    }

    /// [`RemoteAddr::send`] with its own deadline.
    ///
    /// # Errors
    /// As [`RemoteAddr::send`].
    ///
    /// # Cancel safety
    /// Not cancel-safe: dropped before its first poll, nothing is sent; dropped after, the
    /// call is already on its way and the actor may still handle `msg`, but the answer is
    /// lost. Send again only what may be handled twice.
    pub async fn send_within<M: RemoteMessage>(
        &self,
        msg: M,
        deadline: Duration,
    ) -> Result<M::Result> {
        let fail = |failure| Error::Remote {
            actor: self.name.to_string(),
            message: M::NAME,
            failure,
        };
        let payload = wire::encode(&msg).map_err(|e| {
            fail(RemoteFailure::Malformed {
                reason: e.to_string(),
            })
        })?;
        let bytes = self
            .peer
            .call_raw_async(self.target, M::NAME, payload, deadline)
            .await
            .map_err(|e| fail(failure_of(e)))?;
        let answer: Answer<<M::Result as RemoteReply>::Wire> =
            wire::decode(&bytes, MAX_CONTROL_MESSAGE).map_err(|e| {
                fail(RemoteFailure::Malformed {
                    reason: format!("the answer: {e}"),
                })
            })?;
        match answer {
            Answer::Reply(w) => Ok(<M::Result as RemoteReply>::from_wire(
                w,
                &self.name,
                M::NAME,
            )),
            Answer::Stopped(reason) => Err(fail(RemoteFailure::ActorStopped { reason })),
            Answer::TimedOut => Err(fail(RemoteFailure::Timeout { after: deadline })),
        }
    }
}

/// The failure of a call, from the node's error.
fn failure_of(e: refit_node::Error) -> RemoteFailure {
    use refit_node::Error as N;
    use refit_runtime::Error as C;
    match e {
        N::Core(C::Timeout { after, .. }) => RemoteFailure::Timeout { after },
        N::Remote { message, .. } => RemoteFailure::Refused { reason: message },
        N::Core(C::Wire(reason)) => RemoteFailure::Malformed { reason },
        N::Core(C::PeerGone { reason, .. }) => RemoteFailure::PeerGone { reason },
        N::Unauthorized { reason, .. } => RemoteFailure::Refused { reason },
        other => RemoteFailure::PeerGone {
            reason: other.to_string(),
        },
    }
}
