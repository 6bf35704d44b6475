//! The local stand-in of a remote actor: an actor that forwards every [`RemoteMessage`].

use std::future::Future;
use std::pin::Pin;

use actix::dev::{MessageResponse, OneshotSender};
use actix::{Actor, Context, Handler, Recipient};

use super::addr::RemoteAddr;
use super::message::{RemoteMessage, RemoteReply};

/// Forwards messages to a [`RemoteAddr`] (see [`RemoteAddr::recipient`]).
pub(super) struct Proxy {
    addr: RemoteAddr,
}

impl Proxy {
    pub(super) fn new(addr: RemoteAddr) -> Self {
        Self { addr }
    }
}

impl RemoteAddr {
    /// A local `Recipient<M>` that forwards to the remote actor (with the default deadline):
    /// code holding a `Recipient<M>` cannot tell it from a local actor's. A failed call
    /// answers as [`RemoteReply`] says: `Err(Error::Remote { .. })` for `crate::Result`
    /// answers, otherwise a dropped reply (`MailboxError::Closed`), logged with the actor
    /// and message names. Calls through one recipient run concurrently.
    ///
    /// # Panics
    /// Outside a running actix system (the proxy is an actor on the current arbiter), like
    /// [`Actor::start`].
    pub fn recipient<M: RemoteMessage>(&self) -> Recipient<M> {
        Proxy::new(self.clone()).start().recipient()
    }
}

impl Actor for Proxy {
    type Context = Context<Self>;
}

/// A forwarded call in flight: answers the sender, or drops its reply when the failure
/// cannot be expressed in `M::Result`.
pub(super) struct Forwarded<M: RemoteMessage>(Pin<Box<dyn Future<Output = Option<M::Result>>>>);

impl<M: RemoteMessage> MessageResponse<Proxy, M> for Forwarded<M> {
    fn handle(self, _: &mut Context<Proxy>, tx: Option<OneshotSender<M::Result>>) {
        actix::spawn(async move {
            if let (Some(reply), Some(tx)) = (self.0.await, tx) {
                let _ = tx.send(reply);
            }
        });
    }
}

impl<M: RemoteMessage> Handler<M> for Proxy {
    type Result = Forwarded<M>;

    fn handle(&mut self, msg: M, _: &mut Context<Self>) -> Forwarded<M> {
        let addr = self.addr.clone();
        Forwarded(Box::pin(async move {
            match addr.send(msg).await {
                Ok(reply) => Some(reply),
                Err(e) => {
                    refit_runtime::unless_stopping!(warn, actor = addr.name(), message = M::NAME,
                        error = %e, "a message to a remote actor failed");
                    <M::Result as RemoteReply>::from_failure(e)
                }
            }
        }))
    }
}
