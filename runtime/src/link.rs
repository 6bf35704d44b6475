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
use crate::scheme::{Receiver, ReceiverInit, ReceiverTransport, Sender, SenderTransport};
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

    /// Streams the versions of `model` newer than the last one this inlet handed over into
    /// `apply`, tensor by tensor as each one's bytes are verified, until one of `at_least`
    /// or newer went through whole; answers that version. An older version that comes
    /// first goes through whole too (the caller's model holds each version in turn).
    /// Nothing is acknowledged: see [`WeightInlet::applied`].
    ///
    /// A [`Receiver`] connected to stream ([`ReceiverInit::connect_streaming`](crate::ReceiverInit::connect_streaming))
    /// keeps no copy where its transport streams (TCP). The default fetches the version
    /// whole ([`WeightInlet::fetch`]) and hands over a copy of each tensor.
    ///
    /// # Errors
    /// A timeout naming the model and version, with nothing applied; once a tensor was
    /// applied, [`Error::PartlyApplied`] (the caller's model is mixed); before, the failure
    /// itself (a refused update, the sender gone, `apply`'s error).
    fn stream(
        &mut self,
        model: &ModelId,
        at_least: Version,
        timeout: Duration,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
    ) -> Result<Version> {
        let weights = self.fetch(model, at_least, timeout)?;
        crate::scheme::stream_group(std::slice::from_ref(&weights), apply)?;
        Ok(weights.version())
    }

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
        let what = |r: &Self| {
            format!(
                "model `{model}` v{at_least} (serving v{})",
                r.version(model)
            )
        };
        polled(self, timeout, what, |r, left| {
            if r.version(model) >= at_least {
                return r
                    .current(model)
                    .map(Some)
                    .ok_or_else(|| Error::UnknownModel(model.clone()));
            }
            r.stage(left)?;
            Ok(None)
        })
    }

    fn applied(&mut self, model: &ModelId, version: Version) -> Result<()> {
        self.ack(&[(model.clone(), version)])
    }

    fn stream(
        &mut self,
        model: &ModelId,
        at_least: Version,
        timeout: Duration,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
    ) -> Result<Version> {
        let what = |r: &Self| {
            let last = r.version(model);
            format!("model `{model}` v{at_least} streamed (v{last} streamed last)")
        };
        polled(self, timeout, what, |r, left| {
            let streamed = r.stream_staged(left, apply)?;
            let mine = streamed.iter().flatten().find(|(m, _)| m == model);
            Ok(mine.map(|&(_, v)| v).filter(|&v| v >= at_least))
        })
    }

    fn meter(&self) -> Option<Arc<dyn crate::WireMeter>> {
        self.transport().meter()
    }
}

/// Calls `step` with the time left (at most 100 ms a call, so that the loop sees its
/// deadline) until it answers something; a timeout naming `what` once `timeout` passed.
fn polled<R, T>(
    receiver: &mut R,
    timeout: Duration,
    what: impl Fn(&R) -> String,
    mut step: impl FnMut(&mut R, Duration) -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(t) = step(receiver, left.min(Duration::from_millis(100)))? {
            return Ok(t);
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: what(receiver),
                after: timeout,
            });
        }
    }
}

/// An engine's inlet that hands versions over tensor by tensor ([`WeightInlet::stream`])
/// and keeps no copy of them, but for the version in force at connect: that one is
/// received whole (and acknowledged, as [`ReceiverInit::connect`] does, so that the
/// sender's connect goes on), kept until the first stream hands it over, then dropped. So
/// an engine holds a second copy of the model at its start only, never during an update.
#[derive(Debug)]
pub struct StreamingInlet<T: ReceiverTransport> {
    receiver: Receiver<T>,
    initial: Option<Arc<WeightSet>>,
}

impl<T: ReceiverTransport> StreamingInlet<T> {
    /// Attaches ([`ReceiverInit::connect_streaming`]) and receives the version in force,
    /// each model's, within `timeout`.
    ///
    /// # Errors
    /// As [`ReceiverInit::connect`].
    pub fn connect(init: ReceiverInit<T>, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let mut receiver = init.connect_streaming(timeout)?;
        let mut landing: std::collections::BTreeMap<ModelId, WeightSet> = receiver
            .manifests()
            .iter()
            .map(|(m, man)| (m.clone(), WeightSet::zeroed(m.clone(), Arc::clone(man))))
            .collect();
        let mut land = |one: WeightSet| -> Result<()> {
            let into = landing
                .get_mut(one.model())
                .ok_or_else(|| Error::UnknownModel(one.model().clone()))?;
            for t in one.manifest().tensors() {
                into.tensor_bytes_mut(&t.name)?
                    .copy_from_slice(&one.bytes()[t.range()]);
            }
            into.set_version(one.version());
            Ok(())
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if receiver.stream(left, &mut land)?.is_none() {
            return Err(Error::Timeout {
                what: format!("initial weights over {}", receiver.transport().name()),
                after: timeout,
            });
        }
        let initial = match landing.len() {
            1 => landing.into_values().next().map(Arc::new),
            _ => {
                return Err(Error::State(
                    "a streaming inlet carries one model (an engine connects one per model)",
                ));
            }
        };
        Ok(Self { receiver, initial })
    }
}

impl<T: ReceiverTransport + 'static> WeightInlet for StreamingInlet<T> {
    /// The version in force at connect, while no stream took it; a streaming inlet holds
    /// no other.
    fn fetch(
        &mut self,
        model: &ModelId,
        at_least: Version,
        _timeout: Duration,
    ) -> Result<Arc<WeightSet>> {
        match &self.initial {
            Some(w) if w.model() == model && w.version() >= at_least => Ok(Arc::clone(w)),
            _ => Err(Error::State(
                "a streaming inlet hands versions over tensor by tensor (stream), not whole",
            )),
        }
    }

    fn applied(&mut self, model: &ModelId, version: Version) -> Result<()> {
        self.receiver.ack(&[(model.clone(), version)])
    }

    fn stream(
        &mut self,
        model: &ModelId,
        at_least: Version,
        timeout: Duration,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
    ) -> Result<Version> {
        // the version in force at connect goes once (an older one than asked is dropped)
        if let Some(w) = self.initial.take_if(|w| w.model() == model)
            && w.version() >= at_least
        {
            crate::scheme::stream_group(std::slice::from_ref(&w), apply)?;
            return Ok(w.version());
        }
        WeightInlet::stream(&mut self.receiver, model, at_least, timeout, apply)
    }

    fn meter(&self) -> Option<Arc<dyn crate::WireMeter>> {
        self.receiver.transport().meter()
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
