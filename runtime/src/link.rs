//! Type-erased ends of a weight-sync scheme, so that actors hold "where my weights come
//! from" and "where my weights go" without being generic over the transport.
//!
//! [`WeightInlet`] is implemented by every [`Receiver`] (inproc, shm, tcp, ...): an engine
//! stages a version by fetching it through its inlet — the bytes cross the transport and are
//! validated whole — before it pauses to apply, and acknowledges it through the inlet once
//! it serves it (so a sender's ack means applied, not staged). [`WeightOutlet`] is
//! implemented by every [`Sender`]: a trainer publishes through it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::ids::{ModelId, Version};
use crate::scheme::{Receiver, ReceiverTransport, Sender, SenderTransport};
use crate::weights::WeightSet;

/// Where an engine's weights come from.
pub trait WeightInlet: Send + 'static {
    /// Blocks until `model` is available at `at_least` or newer (validated whole by the
    /// transport and the scheme), and returns it; may return a newer version than asked.
    /// Nothing is acknowledged to the sender yet: see [`WeightInlet::applied`].
    ///
    /// # Errors
    /// A timeout naming the model and version; a refused update (the previous weights stay
    /// served); the sender gone.
    fn fetch(
        &mut self,
        model: &ModelId,
        at_least: Version,
        timeout: Duration,
    ) -> Result<Arc<WeightSet>>;

    /// Tells the sender `model` is served at `version` (and so every older version it
    /// fetched): called by the engine after the swap into the served policy.
    ///
    /// # Errors
    /// The transport failing to deliver the acknowledgement (the sender gone).
    fn applied(&mut self, model: &ModelId, version: Version) -> Result<()>;

    /// What the inlet's transfers landed and read off the wire, where its transport counts
    /// it (default: not counted).
    fn meter(&self) -> Option<Arc<dyn crate::WireMeter>> {
        None
    }
}

impl<T: ReceiverTransport + 'static> WeightInlet for Receiver<T> {
    fn fetch(
        &mut self,
        model: &ModelId,
        at_least: Version,
        timeout: Duration,
    ) -> Result<Arc<WeightSet>> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.version(model) >= at_least {
                return self
                    .current(model)
                    .ok_or_else(|| Error::UnknownModel(model.clone()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: format!(
                        "model `{model}` v{at_least} (serving v{})",
                        self.version(model)
                    ),
                    after: timeout,
                });
            }
            self.stage(left.min(Duration::from_millis(100)))?;
        }
    }

    fn applied(&mut self, model: &ModelId, version: Version) -> Result<()> {
        self.ack(&[(model.clone(), version)])
    }

    fn meter(&self) -> Option<Arc<dyn crate::WireMeter>> {
        self.transport().meter()
    }
}

/// Where a trainer's weights go.
pub trait WeightOutlet: Send + 'static {
    /// Publishes one version without waiting for receivers (the controller decides when
    /// they load it).
    ///
    /// # Errors
    /// A stale version, a manifest mismatch naming the tensor, the transport failing.
    fn publish(&mut self, weights: Arc<WeightSet>) -> Result<Version>;
}

impl<T: SenderTransport + 'static> WeightOutlet for Sender<T> {
    fn publish(&mut self, weights: Arc<WeightSet>) -> Result<Version> {
        let version = weights.version();
        // Receivers acknowledge when they load; the controller tracks that, not the sender.
        let _pending = self.publish_shared(vec![weights])?;
        Ok(version)
    }
}
