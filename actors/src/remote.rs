//! Remote actors: typed handles to actors in other processes or hosts.
//!
//! An actor is exposed with [`serve`] on a [`Node`](refit_node::Node) under a
//! uuid, once per message type; another process reaches it through a [`RemoteAddr`] (the
//! connection to that node, the uuid, a name for errors, a default deadline). A message
//! crossing processes implements [`RemoteMessage`]: it and its answer travel as msgpack of
//! the types themselves (rmp-serde), under the method name `RemoteMessage::NAME`.
//!
//! - [`RemoteAddr::send`] answers `Result<M::Result>`: the outer error is the call's
//!   ([`Error::Remote`](crate::Error::Remote) naming the actor and the message, with a
//!   [`RemoteFailure`](crate::RemoteFailure): the peer is gone, the deadline passed, the
//!   node refused the call, a malformed message, a stopped actor); the inner value is what
//!   the actor answered. Every send has a deadline, and a dead peer fails every call
//!   pending on it at once.
//! - [`RemoteAddr::recipient`] makes a local `Recipient<M>` that forwards to the remote
//!   actor, so code written against a `Recipient` (an `EngineHandle`, a rollout worker's
//!   pool) uses a remote actor exactly as a local one. Messages answering
//!   `crate::Result<T>` report a failed call as `Err(Error::Remote { .. })`; other answers
//!   (`()`, `u64`, a status) cannot hold an error, so a failed call drops the reply — the
//!   sender sees `MailboxError::Closed`, as from a stopped local actor — and is logged
//!   naming the actor and the message. A `do_send` of a `()` message is fire-and-forget.
//! - Give a handle a deadline above the longest wait the actor itself applies (the
//!   controller's `AwaitRollout` waits up to `rollout_wait_s`, `NotifyVersion` for the
//!   version barrier), or such calls their own with [`RemoteAddr::send_within`] /
//!   [`RemoteAddr::with_deadline`]. A handle does not reconnect: after its peer died, make
//!   a new one.
//! - An error the actor answers crosses as text and comes back as `Error::Remote` with
//!   [`RemoteFailure::Failed`](crate::RemoteFailure::Failed), except
//!   [`Error::Cancelled`](crate::Error::Cancelled), which keeps its variant (rollouts branch
//!   on it).
//!
//! The messages a distributed topology sends (engine loads — `UpdateModel`, named
//! `_receive_weights_scheme` on the wire —, cancellation, served versions, act requests;
//! the controller's status checks and notifications; the pool's fragments; validation) are
//! remote-capable; [`serve_engine`], [`serve_controller`], [`serve_pool`] and
//! [`serve_evaluator`] serve each actor's set under one uuid, and [`engine_handle`] makes
//! the `EngineHandle` of a remote engine.
//!
//! ```
//! use std::time::Duration;
//!
//! use actix::prelude::*;
//! use refit_actors::remote::{RemoteAddr, RemoteMessage, serve};
//! use refit_node::{ClusterToken, Node};
//! use serde::{Deserialize, Serialize};
//! use uuid::Uuid;
//!
//! /// Adds one.
//! #[derive(Message, Serialize, Deserialize)]
//! #[rtype(result = "refit_actors::Result<u64>")]
//! struct Incr(u64);
//!
//! impl RemoteMessage for Incr {
//!     const NAME: &'static str = "counter.incr";
//! }
//!
//! struct Counter;
//! impl Actor for Counter {
//!     type Context = Context<Self>;
//! }
//! impl Handler<Incr> for Counter {
//!     type Result = refit_actors::Result<u64>;
//!     fn handle(&mut self, Incr(n): Incr, _: &mut Context<Self>) -> Self::Result {
//!         Ok(n + 1)
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let token = ClusterToken::new("doc-token-0123456789")?;
//! let server = Node::loopback(token.clone())?; // in the serving process
//! let client = Node::loopback(token)?; // in the calling process
//! let counter = Uuid::new_v4();
//! actix::System::new().block_on(async move {
//!     serve::<Incr>(&server, counter, Counter.start().recipient());
//!     let remote = RemoteAddr::connect(
//!         &client, server.addr(), counter, "counter", Duration::from_secs(5),
//!     )
//!     .await?;
//!     assert_eq!(remote.send(Incr(41)).await??, 42);
//!     // the same actor behind a plain `Recipient`
//!     let r: Recipient<Incr> = remote.recipient();
//!     assert_eq!(r.send(Incr(1)).await??, 2);
//!     Ok::<(), Box<dyn std::error::Error>>(())
//! })
//! # }
//! ```

mod addr;
mod framework;
mod impls;
mod message;
mod proxy;
mod serve;

pub use addr::RemoteAddr;
pub use framework::{
    engine_handle, serve_controller, serve_engine, serve_evaluator, serve_gen_engine, serve_pool,
};
pub use message::{RemoteMessage, RemoteReply, WireError};
pub use serve::serve;
/// Actors are addressed by uuid on their node (re-exported for convenience).
pub use uuid::Uuid;

#[cfg(test)]
mod tests;
