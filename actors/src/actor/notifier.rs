//! [`VersionNotifier`]: a trainer's client of the weight-sync controller.

use std::pin::Pin;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::sync_policy::SyncConfig;
use refit_runtime::{ModelId, Version};

use crate::error::{Error, Result};
use crate::protocol::controller::{NotifyOutcome, NotifyVersion};

/// A notification sent and not yet answered.
type Pending = Pin<Box<actix::dev::RecipientRequest<NotifyVersion>>>;

/// A trainer's handle on the controller: notifications go out in order, and a trainer may
/// run one step ahead — [`VersionNotifier::notify`] returns at once on non-eval steps after
/// the previous notification completed, and waits for the round (and its validation) on
/// eval steps.
pub struct VersionNotifier {
    controller: Recipient<NotifyVersion>,
    model: ModelId,
    cfg: SyncConfig,
    deadline: Duration,
    /// The round sent and not yet answered; it stays here until its answer arrives, so a
    /// dropped [`VersionNotifier::flush`] loses nothing.
    pending: Option<Pending>,
}

impl std::fmt::Debug for VersionNotifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VersionNotifier")
            .field("model", &self.model)
            .field("pending", &self.pending.is_some())
            .finish()
    }
}

impl VersionNotifier {
    /// A notifier for `model`'s trainer, to a controller in this process or another
    /// (`Addr<WeightSyncController>` or [`ControllerRef::notify`](crate::protocol::ControllerRef)).
    /// Each notification waits at most the longest round the configuration allows (the
    /// barrier's deadline plus, on eval steps, the loads and the validation).
    pub fn new(
        controller: impl Into<Recipient<NotifyVersion>>,
        model: ModelId,
        cfg: SyncConfig,
    ) -> Self {
        let t = &cfg.timeouts;
        let deadline = t.barrier() + t.load() * 2 + t.eval() + Duration::from_secs(5);
        Self {
            controller: controller.into(),
            model,
            cfg,
            deadline,
            pending: None,
        }
    }

    fn late(&self) -> Error {
        Error::Runtime(refit_runtime::Error::Timeout {
            what: format!("the controller's round for model `{}`", self.model),
            after: self.deadline,
        })
    }

    /// Waits for the previous notification's round, if one is pending.
    ///
    /// # Errors
    /// The previous round's failure; the controller gone; no answer within the deadline
    /// (the round is then given up).
    ///
    /// # Cancel safety
    /// Cancel-safe: the pending round stays in the notifier until its answer arrives, so
    /// when this future is dropped before, the next `flush` (or `notify`, which flushes
    /// first) waits for the same round and answers its outcome. Each call waits at most the
    /// notifier's deadline.
    pub async fn flush(&mut self) -> Result<Option<NotifyOutcome>> {
        let Some(req) = self.pending.as_mut() else {
            return Ok(None);
        };
        let answer = tokio::time::timeout(self.deadline, req).await;
        // answered or given up: only now is the round no longer pending
        self.pending = None;
        Ok(Some(answer.map_err(|_| self.late())?.map_err(|e| {
            Error::Actor(format!("weight-sync controller: {e}"))
        })??))
    }

    /// Notifies `version`: waits for the previous notification first (notifications are
    /// serialised), then returns at once on a non-eval step, or waits for the round and
    /// answers its outcome (with the validation) on an eval step.
    ///
    /// # Errors
    /// The previous or this round's failure (a stale version, a barrier deadline, a failed
    /// eval-step load or validation).
    ///
    /// # Cancel safety
    /// Dropped while it waits for the previous round, `version` is not sent and the
    /// previous round stays pending (as with [`VersionNotifier::flush`]); notify `version`
    /// again. Dropped while it waits for an eval step's round, the notification is already
    /// sent and stays pending: the next `flush` answers its outcome.
    pub async fn notify(&mut self, version: Version) -> Result<Option<NotifyOutcome>> {
        self.flush().await?;
        let req = self.controller.send(NotifyVersion {
            model: self.model.clone(),
            version,
        });
        self.pending = Some(Box::pin(req));
        if self.cfg.is_eval_step(version) {
            self.flush().await
        } else {
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// A controller that answers every notification after 100 ms.
    struct Slow {
        seen: Arc<AtomicU64>,
    }

    impl Actor for Slow {
        type Context = Context<Self>;
    }

    impl Handler<NotifyVersion> for Slow {
        type Result = ResponseFuture<Result<NotifyOutcome>>;
        fn handle(&mut self, msg: NotifyVersion, _: &mut Context<Self>) -> Self::Result {
            self.seen.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok(NotifyOutcome {
                    version: msg.version,
                    leader: true,
                    eval: None,
                })
            })
        }
    }

    #[actix_rt::test]
    async fn a_dropped_flush_or_notify_keeps_its_round() {
        let seen = Arc::new(AtomicU64::new(0));
        let controller = Slow { seen: seen.clone() }.start();
        let cfg = SyncConfig {
            validate_freq: 2,
            ..SyncConfig::default()
        };
        let model = ModelId::new("policy").unwrap();
        let mut n = VersionNotifier::new(controller.recipient(), model, cfg);
        // v1 is not an eval step: sent, pending
        assert!(n.notify(Version(1)).await.unwrap().is_none());
        // a flush dropped before the answer came...
        let dropped = tokio::time::timeout(Duration::from_millis(1), n.flush()).await;
        assert!(dropped.is_err(), "answered within 1 ms");
        // ... and one polled once, then dropped
        {
            let mut flush = std::pin::pin!(n.flush());
            let once = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(flush.as_mut().poll(cx).is_pending())
            });
            assert!(once.await, "answered at the first poll");
        }
        // the next flush still waits for the same round and answers it
        let outcome = n
            .flush()
            .await
            .unwrap()
            .expect("the round is still pending");
        assert_eq!(outcome.version, Version(1));
        assert!(n.flush().await.unwrap().is_none(), "answered once");
        // v2 is an eval step: a notify dropped while it waits leaves its round pending
        let dropped = tokio::time::timeout(Duration::from_millis(1), n.notify(Version(2))).await;
        assert!(dropped.is_err(), "answered within 1 ms");
        let outcome = n
            .flush()
            .await
            .unwrap()
            .expect("the eval round is still pending");
        assert_eq!(outcome.version, Version(2));
        // every notification was sent once
        assert_eq!(seen.load(Ordering::SeqCst), 2);
    }
}
