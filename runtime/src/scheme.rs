//! The lifecycle of one scheme: `init` (local, no communication) → `connect` (rendez-vous
//! with a deadline, manifests checked, initial weights delivered) → `send` / `receive` →
//! `shutdown`.
//!
//! A scheme is built from a transport (how bytes move) and the sync protocol of
//! [`crate::protocol`] (what may be applied). Transports implement [`SenderTransport`] and
//! [`ReceiverTransport`]; this module adds the rules every transport shares, so each
//! transport stays small.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use crate::error::{Error, Result};
use crate::ids::{ModelId, Version};
use crate::metrics::{self, Phase};
use crate::protocol::{Group, Manifests, VersionGate, entries, validate_group};
use crate::weights::WeightSet;

/// The sending side of a transport.
pub trait SenderTransport: Send {
    /// Short name for errors and logs (`"shm"`, `"inproc"`).
    fn name(&self) -> &'static str;
    /// Rendez-vous: waits (until `deadline`) for the expected receivers and makes `initial`
    /// available to them.
    ///
    /// # Errors
    /// [`Error::Timeout`] when receivers do not show up in time.
    fn connect(&mut self, initial: &Group, deadline: Instant) -> Result<()>;
    /// Publishes one atomic group; returns once receivers can see it (not when they applied it).
    ///
    /// # Errors
    /// Transport failures; a deadline error if no buffer frees up in time.
    fn publish(&mut self, group: &Group, deadline: Instant) -> Result<()>;
    /// Waits until every live receiver acknowledged every `(model, version)` entry.
    ///
    /// # Errors
    /// [`Error::Timeout`] naming who is late, [`Error::PeerGone`] if a receiver died.
    fn wait_acks(&mut self, entries: &[(ModelId, Version)], deadline: Instant) -> Result<()>;
    /// Releases every resource; idempotent.
    ///
    /// # Errors
    /// Failures releasing resources (they are all attempted).
    fn shutdown(&mut self) -> Result<()>;
}

/// The receiving side of a transport.
pub trait ReceiverTransport: Send {
    /// Short name for errors and logs.
    fn name(&self) -> &'static str;
    /// Rendez-vous: attaches to the sender (until `deadline`) and returns its manifests.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::PeerGone`], or a decoding error.
    fn connect(&mut self, deadline: Instant) -> Result<Manifests>;
    /// The newest group not yet returned, waiting until `deadline`; `None` when it passes.
    ///
    /// # Errors
    /// [`Error::PeerGone`] when the sender died, transport failures.
    fn next_group(&mut self, deadline: Instant) -> Result<Option<Group>>;
    /// Tells the sender these versions are applied.
    ///
    /// # Errors
    /// Transport failures.
    fn ack(&mut self, applied: &[(ModelId, Version)]) -> Result<()>;
    /// Releases every resource; idempotent.
    ///
    /// # Errors
    /// Failures releasing resources.
    fn shutdown(&mut self) -> Result<()>;
}

/// Deadline `timeout` from now (saturating).
pub fn deadline_in(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or(now + Duration::from_secs(86400 * 365))
}

/// A sender that is initialised but not connected.
#[derive(Debug)]
pub struct SenderInit<T> {
    transport: T,
    manifests: Manifests,
    ack_timeout: Duration,
}

impl<T: SenderTransport> SenderInit<T> {
    /// Local setup only; no communication.
    pub fn new(transport: T, manifests: Manifests) -> Self {
        Self {
            transport,
            manifests,
            ack_timeout: Duration::from_secs(30),
        }
    }

    /// How long `send` waits for acknowledgements (default 30 s).
    #[must_use]
    pub fn with_ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// The transport (e.g. to derive receiver descriptions before connecting).
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Blocking rendez-vous: delivers `initial` (one weight set per model, version >= 1).
    ///
    /// # Errors
    /// Validation errors for `initial`; [`Error::Timeout`] if receivers do not attach in time.
    pub fn connect(mut self, initial: Vec<WeightSet>, timeout: Duration) -> Result<Sender<T>> {
        let deadline = deadline_in(timeout);
        let group: Group = initial.into_iter().map(Arc::new).collect();
        validate_group(&self.manifests, &group)?;
        if group.len() != self.manifests.len() {
            return Err(Error::State(
                "connect needs initial weights for every model",
            ));
        }
        let mut gate = VersionGate::default();
        gate.admit(&entries(&group))?;
        self.transport.connect(&group, deadline)?;
        let mut sender = Sender {
            transport: self.transport,
            manifests: self.manifests,
            gate,
            ack_timeout: self.ack_timeout,
            closed: false,
        };
        sender.transport.wait_acks(&entries(&group), deadline)?;
        Ok(sender)
    }
}

/// A connected sender: publishes versions.
#[derive(Debug)]
pub struct Sender<T: SenderTransport> {
    transport: T,
    manifests: Manifests,
    gate: VersionGate,
    ack_timeout: Duration,
    closed: bool,
}

/// A published update whose acknowledgements have not been awaited yet.
#[derive(Debug, Clone)]
#[must_use = "wait on it to know the receivers applied the update"]
pub struct PendingSend {
    entries: Vec<(ModelId, Version)>,
}

impl PendingSend {
    /// The `(model, version)` entries published.
    pub fn entries(&self) -> &[(ModelId, Version)] {
        &self.entries
    }
}

impl<T: SenderTransport> Sender<T> {
    /// Publishes one model's new version and waits for every receiver to acknowledge it.
    ///
    /// # Errors
    /// A stale version, a manifest mismatch naming the tensor, a timeout naming late receivers.
    pub fn send(&mut self, weights: WeightSet) -> Result<Vec<(ModelId, Version)>> {
        self.send_group(vec![weights])
    }

    /// Publishes several models as one atomic update (both or neither) and waits for acks.
    ///
    /// # Errors
    /// As [`Sender::send`].
    pub fn send_group(&mut self, weights: Vec<WeightSet>) -> Result<Vec<(ModelId, Version)>> {
        let pending = self.send_async(weights)?;
        self.wait(&pending, self.ack_timeout)?;
        Ok(pending.entries)
    }

    /// Publishes without waiting for acknowledgements.
    ///
    /// # Errors
    /// As [`Sender::send`], minus the ack timeout.
    pub fn send_async(&mut self, weights: Vec<WeightSet>) -> Result<PendingSend> {
        self.publish_shared(weights.into_iter().map(Arc::new).collect())
    }

    /// Publishes already-shared weight sets without waiting (no copy on the in-process path).
    ///
    /// # Errors
    /// As [`Sender::send_async`].
    pub fn publish_shared(&mut self, group: Group) -> Result<PendingSend> {
        if self.closed {
            return Err(Error::State("sender is shut down"));
        }
        validate_group(&self.manifests, &group)?;
        let entries = entries(&group);
        self.gate.check(&entries)?;
        let timer = metrics::timed_group(
            Phase::Assemble,
            self.transport.name(),
            group.iter().map(|w| w.model().as_str()),
        );
        self.transport
            .publish(&group, deadline_in(self.ack_timeout))?;
        timer.finish();
        self.gate.commit(&entries);
        Ok(PendingSend { entries })
    }

    /// Waits for the acknowledgements of a published update.
    ///
    /// # Errors
    /// [`Error::Timeout`] naming late receivers; [`Error::PeerGone`].
    pub fn wait(&mut self, pending: &PendingSend, timeout: Duration) -> Result<()> {
        self.transport
            .wait_acks(&pending.entries, deadline_in(timeout))
    }

    /// The version in force for a model.
    pub fn version(&self, model: &ModelId) -> Version {
        self.gate.current(model)
    }

    /// Changes how long `send` waits for buffers and acknowledgements.
    pub fn set_ack_timeout(&mut self, timeout: Duration) {
        self.ack_timeout = timeout;
    }

    /// The agreed manifests.
    pub fn manifests(&self) -> &Manifests {
        &self.manifests
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Mutable access to the transport.
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Releases everything the transport holds.
    ///
    /// # Errors
    /// As [`SenderTransport::shutdown`].
    pub fn shutdown(mut self) -> Result<()> {
        self.closed = true;
        self.transport.shutdown()
    }
}

impl<T: SenderTransport> Drop for Sender<T> {
    fn drop(&mut self) {
        if !self.closed {
            let _ = self.transport.shutdown();
        }
    }
}

/// What a reader sees: every model of a scheme at the versions last applied together.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    models: BTreeMap<ModelId, Arc<WeightSet>>,
}

impl Snapshot {
    /// One model's weights.
    pub fn get(&self, model: &ModelId) -> Option<&Arc<WeightSet>> {
        self.models.get(model)
    }

    /// The version of one model ([`Version::ZERO`] if absent).
    pub fn version(&self, model: &ModelId) -> Version {
        self.models
            .get(model)
            .map_or(Version::ZERO, |w| w.version())
    }

    /// Every model.
    pub fn iter(&self) -> impl Iterator<Item = (&ModelId, &Arc<WeightSet>)> {
        self.models.iter()
    }

    fn with(&self, group: &Group) -> Self {
        let mut models = self.models.clone();
        for w in group {
            models.insert(w.model().clone(), Arc::clone(w));
        }
        Self { models }
    }
}

/// A cheap, cloneable handle on the snapshot a receiver serves; readers on other threads
/// load it without locks and always see whole versions.
#[derive(Debug, Clone, Default)]
pub struct Served(Arc<ArcSwap<Snapshot>>);

impl Served {
    /// The snapshot in force now.
    pub fn load(&self) -> Arc<Snapshot> {
        self.0.load_full()
    }

    fn store(&self, s: Snapshot) {
        self.0.store(Arc::new(s));
    }
}

/// A receiver that is initialised but not connected.
#[derive(Debug)]
pub struct ReceiverInit<T> {
    transport: T,
    expected: Option<Manifests>,
}

impl<T: ReceiverTransport> ReceiverInit<T> {
    /// Local setup only; no communication. With `expected`, connect refuses a sender whose
    /// manifests differ (naming the tensor).
    pub fn new(transport: T, expected: Option<Manifests>) -> Self {
        Self {
            transport,
            expected,
        }
    }

    /// Blocking rendez-vous: attaches, checks manifests, applies the initial weights.
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing arrives in time; manifest mismatches.
    pub fn connect(mut self, timeout: Duration) -> Result<Receiver<T>> {
        let deadline = deadline_in(timeout);
        let announced = self.transport.connect(deadline)?;
        if let Some(expected) = &self.expected {
            expected.check_agree(&announced)?;
        }
        let mut receiver = Receiver {
            transport: self.transport,
            manifests: announced,
            gate: VersionGate::default(),
            served: Served::default(),
            closed: false,
        };
        let remaining = deadline.saturating_duration_since(Instant::now());
        if receiver.receive(remaining)?.is_none() {
            return Err(Error::Timeout {
                what: format!("initial weights over {}", receiver.transport.name()),
                after: timeout,
            });
        }
        Ok(receiver)
    }
}

/// A connected receiver.
#[derive(Debug)]
pub struct Receiver<T: ReceiverTransport> {
    transport: T,
    manifests: Manifests,
    gate: VersionGate,
    served: Served,
    closed: bool,
}

/// One applied update.
#[derive(Debug, Clone)]
pub struct Update {
    /// The weight sets that landed together.
    pub group: Group,
}

impl Update {
    /// `(model, version)` of each weight set.
    pub fn entries(&self) -> Vec<(ModelId, Version)> {
        entries(&self.group)
    }
}

impl<T: ReceiverTransport> Receiver<T> {
    /// The transport (e.g. to read its transfer counters).
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Waits up to `timeout` for the next update, validates it whole, applies it (the served
    /// snapshot switches to it in one step) and acknowledges it. `Ok(None)` when the timeout
    /// passes with nothing new.
    ///
    /// # Errors
    /// A refused update (stale version, wrong manifest, naming the tensor): the previous
    /// weights stay served. [`Error::PeerGone`] if the sender died.
    pub fn receive(&mut self, timeout: Duration) -> Result<Option<Update>> {
        if self.closed {
            return Err(Error::State("receiver is shut down"));
        }
        let Some(group) = self.transport.next_group(deadline_in(timeout))? else {
            return Ok(None);
        };
        let timer = metrics::timed_group(
            Phase::Apply,
            self.transport.name(),
            group.iter().map(|w| w.model().as_str()),
        );
        validate_group(&self.manifests, &group)?;
        let entries = entries(&group);
        self.gate.check(&entries)?;
        let snapshot = self.served.load().with(&group);
        self.served.store(snapshot);
        self.gate.commit(&entries);
        timer.finish();
        self.transport.ack(&entries)?;
        Ok(Some(Update { group }))
    }

    /// The snapshot handle readers load from.
    pub fn served(&self) -> Served {
        self.served.clone()
    }

    /// The weights in force for one model.
    pub fn current(&self, model: &ModelId) -> Option<Arc<WeightSet>> {
        self.served.load().get(model).cloned()
    }

    /// The version in force for one model.
    pub fn version(&self, model: &ModelId) -> Version {
        self.gate.current(model)
    }

    /// The agreed manifests.
    pub fn manifests(&self) -> &Manifests {
        &self.manifests
    }

    /// Runs `receive` on a background thread until stopped; `on_update` sees every applied
    /// update, `on_error` every refused one (the loop goes on unless it returns `false`).
    pub fn spawn_loop(
        self,
        mut on_update: impl FnMut(&Update) + Send + 'static,
        mut on_error: impl FnMut(&Error) -> bool + Send + 'static,
    ) -> ReceiverLoop<T>
    where
        T: 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let served = self.served();
        let flag = Arc::clone(&stop);
        let mut me = self;
        let handle = std::thread::Builder::new()
            .name("refit-receiver".into())
            .spawn(move || {
                while !flag.load(Ordering::Acquire) {
                    match me.receive(Duration::from_millis(50)) {
                        Ok(Some(u)) => on_update(&u),
                        Ok(None) => {}
                        Err(e) => {
                            if !on_error(&e) {
                                break;
                            }
                        }
                    }
                }
                me
            });
        ReceiverLoop {
            served,
            stop,
            handle: handle.ok(),
        }
    }

    /// Releases everything the transport holds.
    ///
    /// # Errors
    /// As [`ReceiverTransport::shutdown`].
    pub fn shutdown(mut self) -> Result<()> {
        self.closed = true;
        self.transport.shutdown()
    }
}

impl<T: ReceiverTransport> Drop for Receiver<T> {
    fn drop(&mut self) {
        if !self.closed {
            let _ = self.transport.shutdown();
        }
    }
}

/// A receiver running on its own thread.
#[derive(Debug)]
pub struct ReceiverLoop<T: ReceiverTransport> {
    served: Served,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Receiver<T>>>,
}

impl<T: ReceiverTransport> ReceiverLoop<T> {
    /// The snapshot handle readers load from.
    pub fn served(&self) -> Served {
        self.served.clone()
    }

    /// Stops the loop and hands the receiver back.
    ///
    /// # Errors
    /// [`Error::State`] if the loop thread could not start or panicked.
    pub fn stop(mut self) -> Result<Receiver<T>> {
        self.stop.store(true, Ordering::Release);
        self.handle
            .take()
            .ok_or(Error::State("receiver loop thread did not start"))?
            .join()
            .map_err(|_| Error::State("receiver loop thread panicked"))
    }
}

impl<T: ReceiverTransport> Drop for ReceiverLoop<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
