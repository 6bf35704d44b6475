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
use crate::topology::Apply;
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
    /// first goes through whole too (the caller's model holds each version in turn): when
    /// the timeout passes after one did, that one is answered (it is what the caller's
    /// model holds). Nothing is acknowledged: see [`WeightInlet::applied`].
    ///
    /// A [`Receiver`] connected to stream ([`ReceiverInit::connect_streaming`](crate::ReceiverInit::connect_streaming))
    /// keeps no copy where its transport streams (TCP). The default fetches the version
    /// whole ([`WeightInlet::fetch`]) and hands over a copy of each tensor.
    ///
    /// # Errors
    /// A timeout naming the model and version, with no version applied whole (nor in part);
    /// once a tensor of a version was applied, [`Error::PartlyApplied`] (the caller's model
    /// is mixed); before, the failure itself (a refused update, the sender gone, `apply`'s
    /// error): the caller's model is then as it was, or holds an older version that went
    /// through whole before the failure. A caller that counts what its `apply` wrote knows
    /// which.
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
        let here = |r: &Self| (r.version(model) >= at_least).then(|| r.current(model));
        let step = |r: &mut Self, left: Duration| {
            // what came in the last step counts, even past the deadline
            if here(r).is_none() {
                r.stage(left)?;
            }
            match here(r) {
                Some(w) => w
                    .map(Some)
                    .ok_or_else(|| Error::UnknownModel(model.clone())),
                None => Ok(None),
            }
        };
        polled(self, step, timeout, |r| {
            let serving = r.version(model);
            let what = format!("model `{model}` v{at_least} (serving v{serving})");
            Err(Error::Timeout {
                what,
                after: timeout,
            })
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
        // an older version than asked that went through whole: the caller's model holds it
        let older = std::cell::Cell::new(None);
        let step = |r: &mut Self, left: Duration| {
            let streamed = r.stream_staged(left, apply)?;
            let mine = streamed.iter().flatten().find(|(m, _)| m == model);
            Ok(match mine.map(|&(_, v)| v) {
                Some(v) if v >= at_least => Some(v),
                v => {
                    older.set(v.or(older.get()));
                    None
                }
            })
        };
        polled(self, step, timeout, |r| match older.get() {
            Some(v) => Ok(v),
            None => {
                let last = r.version(model);
                let what = format!("model `{model}` v{at_least} streamed (v{last} streamed last)");
                Err(Error::Timeout {
                    what,
                    after: timeout,
                })
            }
        })
    }

    fn meter(&self) -> Option<Arc<dyn crate::WireMeter>> {
        self.transport().meter()
    }
}

/// Calls `step` with the time left (at most 100 ms a call, so that the loop sees its
/// deadline) until it answers something, at least once; once `timeout` passed, what
/// `expired` answers.
fn polled<R, T>(
    receiver: &mut R,
    mut step: impl FnMut(&mut R, Duration) -> Result<Option<T>>,
    timeout: Duration,
    expired: impl FnOnce(&R) -> Result<T>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(t) = step(receiver, left.min(Duration::from_millis(100)))? {
            return Ok(t);
        }
        if Instant::now() >= deadline {
            return expired(receiver);
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
    /// Attaches ([`ReceiverInit::connect_streaming`]) and receives the version in force
    /// within `timeout`.
    ///
    /// # Errors
    /// As [`ReceiverInit::connect`]; [`Error::State`] for a sender of several models (an
    /// engine connects one inlet per model).
    pub fn connect(init: ReceiverInit<T>, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let mut receiver = init.connect_streaming(timeout)?;
        if receiver.manifests().len() != 1 {
            return Err(Error::State(
                "a streaming inlet carries one model (an engine connects one per model)",
            ));
        }
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
        let initial = landing.into_values().next().map(Arc::new);
        Ok(Self { receiver, initial })
    }
}

/// Connects `init` as the inlet of a model taken in as `apply` says: a [`Receiver`] that
/// receives each version whole ([`Apply::Staged`]), or a [`StreamingInlet`]
/// ([`Apply::Streaming`]).
///
/// # Errors
/// As [`ReceiverInit::connect`] or [`StreamingInlet::connect`].
pub fn connect_applied<T: ReceiverTransport + 'static>(
    init: ReceiverInit<T>,
    apply: Apply,
    timeout: Duration,
) -> Result<Box<dyn WeightInlet>> {
    Ok(match apply {
        Apply::Staged => Box::new(init.connect(timeout)?),
        Apply::Streaming => Box::new(StreamingInlet::connect(init, timeout)?),
    })
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
        // the version in force at connect goes once, kept until it went through whole (an
        // older one than asked is dropped)
        if let Some(w) = self.initial.clone().filter(|w| w.model() == model) {
            if w.version() >= at_least {
                crate::scheme::stream_group(std::slice::from_ref(&w), apply)?;
                self.initial = None;
                return Ok(w.version());
            }
            self.initial = None;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inproc::InProc;
    use crate::testing::{filled, id, manifest, manifests};
    use crate::{DType, SenderInit};

    const T: Duration = Duration::from_secs(10);

    /// A sender of `policy` at v1 and a streaming inlet of it, connected over one hub.
    fn pair() -> (
        Sender<crate::inproc::InProcSender>,
        StreamingInlet<crate::inproc::InProcReceiver>,
    ) {
        let m = manifest(&[("a", DType::F32, &[4]), ("b", DType::F32, &[2, 2])]);
        let ms = manifests(&[("policy", &m)]);
        let hub = InProc::new();
        let init = ReceiverInit::new(hub.receiver(), Some(ms.clone()));
        let joining = std::thread::spawn(move || StreamingInlet::connect(init, T).unwrap());
        let sender = SenderInit::new(hub.sender().unwrap(), ms)
            .connect(vec![filled(&id("policy"), &m, 1, 1.0)], T)
            .unwrap();
        (sender, joining.join().unwrap())
    }

    /// What `inlet` streams of `policy` at `at_least` within `timeout`: the version, and the
    /// first element of each tensor handed over.
    fn streamed(
        inlet: &mut StreamingInlet<crate::inproc::InProcReceiver>,
        at_least: u64,
        timeout: Duration,
    ) -> Result<(Version, Vec<f32>)> {
        let mut firsts = Vec::new();
        let v = inlet.stream(&id("policy"), Version(at_least), timeout, &mut |one| {
            firsts.push(one.view::<f32>(one.first_name())?[0]);
            Ok(())
        })?;
        Ok((v, firsts))
    }

    #[test]
    fn a_streaming_inlet_hands_the_version_in_force_over_once_then_each_next_one() {
        let (mut sender, mut inlet) = pair();
        let policy = id("policy");
        // the version in force, whole, once; fetch has nothing whole after it
        assert!(inlet.fetch(&policy, Version(1), T).is_ok());
        assert_eq!(
            streamed(&mut inlet, 1, T).unwrap(),
            (Version(1), vec![1.0, 1.0])
        );
        assert!(inlet.fetch(&policy, Version(1), T).is_err());
        let m = Arc::clone(inlet.receiver.manifests().get(&policy).unwrap());
        let _ = sender
            .send_async(vec![filled(&policy, &m, 2, 2.0)])
            .unwrap();
        assert_eq!(
            streamed(&mut inlet, 2, T).unwrap(),
            (Version(2), vec![2.0, 2.0])
        );
        inlet.applied(&policy, Version(2)).unwrap();
    }

    #[test]
    fn a_stream_that_times_out_after_an_older_version_went_through_answers_that_one() {
        let (mut sender, mut inlet) = pair();
        let policy = id("policy");
        let m = Arc::clone(inlet.receiver.manifests().get(&policy).unwrap());
        assert_eq!(streamed(&mut inlet, 1, T).unwrap().0, Version(1));
        // nothing newer comes in time: a timeout, nothing applied
        let e = streamed(&mut inlet, 2, Duration::from_millis(150)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        // v2 comes, v3 is asked and never comes: v2 went through whole, and is answered
        let _ = sender
            .send_async(vec![filled(&policy, &m, 2, 2.0)])
            .unwrap();
        let got = streamed(&mut inlet, 3, Duration::from_millis(300)).unwrap();
        assert_eq!(got, (Version(2), vec![2.0, 2.0]));
    }

    #[test]
    fn an_apply_that_fails_keeps_the_version_in_force_for_the_next_stream() {
        let (_sender, mut inlet) = pair();
        let policy = id("policy");
        let e = inlet
            .stream(&policy, Version(1), T, &mut |_| {
                Err(Error::State("refused"))
            })
            .unwrap_err();
        assert!(matches!(e, Error::State("refused")), "{e}");
        assert_eq!(
            streamed(&mut inlet, 1, T).unwrap(),
            (Version(1), vec![1.0, 1.0])
        );
    }
}
