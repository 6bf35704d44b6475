//! The serving side: a local actor exposed on a node.

use actix::Recipient;
use refit_node::Node;
use refit_runtime::wire::{self, MAX_CONTROL_MESSAGE};
use uuid::Uuid;

use super::message::{Answer, RemoteMessage, RemoteReply};

/// Exposes the actor behind `recipient` to other processes: calls of `M::NAME` on `target`
/// at `node` are decoded, sent to the actor, and its answer is sent back.
///
/// Call once per message type the actor serves, with the same `target`. A request that does
/// not decode as `M` is refused (the caller gets [`RemoteFailure::Refused`]); a stopped
/// actor answers [`RemoteFailure::ActorStopped`]; an actor that has not answered by the
/// caller's deadline answers [`RemoteFailure::Timeout`]. None of them disturbs the node or
/// the other calls. Serving the same `(target, M::NAME)` again replaces the earlier one;
/// [`Node::unregister`] withdraws every message of `target`.
///
/// [`RemoteFailure::Refused`]: crate::RemoteFailure::Refused
/// [`RemoteFailure::ActorStopped`]: crate::RemoteFailure::ActorStopped
/// [`RemoteFailure::Timeout`]: crate::RemoteFailure::Timeout
pub fn serve<M: RemoteMessage>(node: &Node, target: Uuid, recipient: Recipient<M>) {
    node.register_raw(target, M::NAME, move |info, bytes| {
        // decoded and put in the actor's mailbox now, as the call's frame arrives: calls of
        // one connection reach the mailbox in the order they were sent
        let request = wire::decode::<M>(&bytes, MAX_CONTROL_MESSAGE)
            .map(|msg| recipient.send(msg))
            .map_err(|e| refit_runtime::Error::Wire(format!("message `{}` refused: {e}", M::NAME)));
        Box::pin(async move {
            let request = request?;
            let deadline = tokio::time::Instant::from_std(info.deadline);
            let answer = match tokio::time::timeout_at(deadline, request).await {
                Ok(Ok(reply)) => Answer::Reply(reply.into_wire()),
                Ok(Err(e)) => Answer::Stopped(e.to_string()),
                Err(_) => {
                    tracing::warn!(message = M::NAME, %target, caller = %info.peer,
                        "an actor did not answer before the caller's deadline");
                    Answer::TimedOut
                }
            };
            Ok(wire::encode(&answer)?)
        })
    });
}
