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
use crate::metrics::{self, Phase, Side};
use crate::protocol::{Admission, Group, Manifests, entries};
use crate::weights::WeightSet;

// ANCHOR: transport_traits
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
    /// What this receiver's transfers landed and read off the wire, where the transport
    /// counts it (default: not counted).
    fn meter(&self) -> Option<Arc<dyn WireMeter>> {
        None
    }
    /// Receives the next group as [`next_group`](Self::next_group) does, but hands `apply`
    /// each tensor on its own as soon as its bytes are in and verified: a weight set of that
    /// one tensor ([`WeightSet::single`]) under its model and version. Returns the
    /// `(model, version)` entries streamed; `None` when `deadline` passes with nothing new.
    ///
    /// A transport that streams (a TCP receiver made `streaming`) keeps no copy of the
    /// version: while it arrives, its memory is a few buckets' worth of tensors (at least the
    /// largest), not the model. The default receives the group whole, then hands over a copy
    /// of each tensor.
    ///
    /// # Errors
    /// As [`next_group`](Self::next_group); an error of `apply` stops the transfer. Once a
    /// tensor of the update was applied, a failure is [`Error::PartlyApplied`] (the caller's
    /// model then holds a mix of two versions); before, the failure itself.
    fn stream_next(
        &mut self,
        deadline: Instant,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
    ) -> Result<Option<Vec<(ModelId, Version)>>> {
        let Some(group) = self.next_group(deadline)? else {
            return Ok(None);
        };
        stream_group(&group, apply)?;
        Ok(Some(entries(&group)))
    }
}
// ANCHOR_END: transport_traits

/// Hands `apply` a copy of each tensor of `group`, one at a time, as
/// [`ReceiverTransport::stream_next`] does for a transport that receives versions whole.
///
/// # Errors
/// As [`StreamProgress::apply`].
pub fn stream_group(
    group: &[Arc<WeightSet>],
    apply: &mut dyn FnMut(WeightSet) -> Result<()>,
) -> Result<()> {
    let mut progress = StreamProgress::new(group.iter().map(|w| w.manifest().len()).sum());
    for ws in group {
        progress.at(ws.model(), ws.version());
        for spec in ws.manifest().tensors() {
            let one = ws.single_copy(spec).map_err(|e| progress.fail(e))?;
            progress.apply(apply, one)?;
        }
    }
    Ok(())
}

/// How far one update (the versions of one or several models) got through a streaming
/// apply, so that a failure says whether the caller's models are mixed
/// ([`Error::PartlyApplied`]) or untouched.
#[derive(Debug, Clone)]
pub struct StreamProgress {
    model: Option<(ModelId, Version)>,
    tensors: usize,
    applied: usize,
}

impl StreamProgress {
    /// Nothing applied yet of an update of `tensors` tensors in all.
    pub fn new(tensors: usize) -> Self {
        Self {
            model: None,
            tensors,
            applied: 0,
        }
    }

    /// The next tensors are of `version` of `model`.
    pub fn at(&mut self, model: &ModelId, version: Version) {
        self.model = Some((model.clone(), version));
    }

    /// Hands `one` to `apply`, counting it once applied.
    ///
    /// # Errors
    /// `apply`'s error, as [`StreamProgress::fail`] reports it.
    pub fn apply(
        &mut self,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
        one: WeightSet,
    ) -> Result<()> {
        apply(one).map_err(|e| self.fail(e))?;
        self.applied += 1;
        Ok(())
    }

    /// The error to report for `e`: itself while nothing was applied, else
    /// [`Error::PartlyApplied`] carrying it.
    pub fn fail(&self, e: Error) -> Error {
        match &self.model {
            Some((model, version))
                if self.applied > 0 && !matches!(e, Error::PartlyApplied { .. }) =>
            {
                Error::PartlyApplied {
                    model: model.clone(),
                    version: *version,
                    applied: self.applied,
                    tensors: self.tensors,
                    source: Box::new(e),
                }
            }
            _ => e,
        }
    }
}

/// Counts, readable from any thread, of the weight bytes a receiver's transfers landed and
/// of the bytes they read off the wire for them (fewer where deltas encode what changed).
pub trait WireMeter: Send + Sync {
    /// Weight bytes landed so far.
    fn landed(&self) -> u64;
    /// Bytes of weights read off the wire so far.
    fn on_wire(&self) -> u64;
}

impl std::fmt::Debug for dyn SenderTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SenderTransport({})", self.name())
    }
}

impl std::fmt::Debug for dyn ReceiverTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReceiverTransport({})", self.name())
    }
}

/// A boxed sender end is a sender end: what a link factory hands out
/// (`refit_transports::link`) drives the same scheme as a concrete transport.
impl<T: SenderTransport + ?Sized> SenderTransport for Box<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn connect(&mut self, initial: &Group, deadline: Instant) -> Result<()> {
        (**self).connect(initial, deadline)
    }
    fn publish(&mut self, group: &Group, deadline: Instant) -> Result<()> {
        (**self).publish(group, deadline)
    }
    fn wait_acks(&mut self, entries: &[(ModelId, Version)], deadline: Instant) -> Result<()> {
        (**self).wait_acks(entries, deadline)
    }
    fn shutdown(&mut self) -> Result<()> {
        (**self).shutdown()
    }
}

/// A boxed receiver end is a receiver end (see the sender's impl).
impl<T: ReceiverTransport + ?Sized> ReceiverTransport for Box<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn connect(&mut self, deadline: Instant) -> Result<Manifests> {
        (**self).connect(deadline)
    }
    fn next_group(&mut self, deadline: Instant) -> Result<Option<Group>> {
        (**self).next_group(deadline)
    }
    fn ack(&mut self, applied: &[(ModelId, Version)]) -> Result<()> {
        (**self).ack(applied)
    }
    fn shutdown(&mut self) -> Result<()> {
        (**self).shutdown()
    }
    fn meter(&self) -> Option<Arc<dyn WireMeter>> {
        (**self).meter()
    }
    fn stream_next(
        &mut self,
        deadline: Instant,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
    ) -> Result<Option<Vec<(ModelId, Version)>>> {
        (**self).stream_next(deadline, apply)
    }
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
    pub fn connect(self, initial: Vec<WeightSet>, timeout: Duration) -> Result<Sender<T>> {
        let name = self.transport.name();
        // shown at zero from the start, so that a page lists it before any failure
        metrics::failures(Side::Sender, name).increment(0);
        self.connect_inner(initial, timeout).inspect_err(|_| {
            metrics::failed(Side::Sender, name);
        })
    }

    fn connect_inner(mut self, initial: Vec<WeightSet>, timeout: Duration) -> Result<Sender<T>> {
        let deadline = deadline_in(timeout);
        let group: Group = initial.into_iter().map(Arc::new).collect();
        let mut admission = Admission::new(self.manifests);
        let every_model = group.len() == admission.manifests().len();
        let transport = &mut self.transport;
        let (entries, ()) = admission.admit(&group, |_| {
            if !every_model {
                return Err(Error::State(
                    "connect needs initial weights for every model",
                ));
            }
            transport.connect(&group, deadline)
        })?;
        count_sent(self.transport.name(), &group);
        let mut sender = Sender {
            transport: self.transport,
            admission,
            ack_timeout: self.ack_timeout,
            closed: false,
        };
        sender.transport.wait_acks(&entries, deadline)?;
        Ok(sender)
    }
}

/// Counts a published group, one model at a time.
fn count_sent(transport: &'static str, group: &Group) {
    for w in group {
        metrics::sent(
            transport,
            w.model().as_str(),
            w.version().0,
            w.manifest().total_len() as u64,
        );
    }
}

/// A connected sender: publishes versions.
#[derive(Debug)]
pub struct Sender<T: SenderTransport> {
    transport: T,
    admission: Admission,
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
        let name = self.transport.name();
        self.wait(&pending, self.ack_timeout).inspect_err(|e| {
            if e.is_timeout() {
                metrics::failed(Side::Sender, name);
            }
        })?;
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
        let transport = &mut self.transport;
        let deadline = deadline_in(self.ack_timeout);
        let admitted = self.admission.admit(&group, |_| {
            let timer = metrics::timed_group(
                Phase::Assemble,
                transport.name(),
                group.iter().map(|w| w.model().as_str()),
            );
            transport.publish(&group, deadline)?;
            timer.finish();
            Ok(())
        });
        let name = self.transport.name();
        let (entries, ()) = admitted.inspect_err(|_| metrics::failed(Side::Sender, name))?;
        count_sent(name, &group);
        Ok(PendingSend { entries })
    }

    /// Waits for the acknowledgements of a published update.
    ///
    /// # Errors
    /// [`Error::Timeout`] naming late receivers; [`Error::PeerGone`].
    pub fn wait(&mut self, pending: &PendingSend, timeout: Duration) -> Result<()> {
        let name = self.transport.name();
        // a timeout is counted by whoever gives up (`send_group`): a caller may wait in
        // slices
        self.transport
            .wait_acks(&pending.entries, deadline_in(timeout))
            .inspect_err(|e| {
                if !e.is_timeout() {
                    metrics::failed(Side::Sender, name);
                }
            })
    }

    /// The version in force for a model.
    pub fn version(&self, model: &ModelId) -> Version {
        self.admission.current(model)
    }

    /// Changes how long `send` waits for buffers and acknowledgements.
    pub fn set_ack_timeout(&mut self, timeout: Duration) {
        self.ack_timeout = timeout;
    }

    /// The agreed manifests.
    pub fn manifests(&self) -> &Manifests {
        self.admission.manifests()
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

    /// This snapshot without the models of `entries` (streamed into a caller's model).
    fn without(&self, entries: &[(ModelId, Version)]) -> Self {
        let mut models = self.models.clone();
        for (m, _) in entries {
            models.remove(m);
        }
        Self { models }
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
        // shown at zero from the start, so that a page lists it before any failure
        metrics::failures(Side::Receiver, self.transport.name()).increment(0);
        let deadline = deadline_in(timeout);
        let announced = self.transport.connect(deadline)?;
        if let Some(expected) = &self.expected {
            expected.check_agree(&announced)?;
        }
        let mut receiver = Receiver {
            transport: self.transport,
            admission: Admission::new(announced),
            served: Served::default(),
            acked: BTreeMap::new(),
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

    /// Rendez-vous for a receiver whose caller applies every version as it streams in
    /// ([`Receiver::stream`]): attaches and checks manifests, without receiving the initial
    /// weights here; the first [`Receiver::stream`] hands over the version in force.
    ///
    /// # Errors
    /// As [`ReceiverInit::connect`], but for the initial weights.
    pub fn connect_streaming(mut self, timeout: Duration) -> Result<Receiver<T>> {
        metrics::failures(Side::Receiver, self.transport.name()).increment(0);
        let announced = self.transport.connect(deadline_in(timeout))?;
        if let Some(expected) = &self.expected {
            expected.check_agree(&announced)?;
        }
        Ok(Receiver {
            transport: self.transport,
            admission: Admission::new(announced),
            served: Served::default(),
            acked: BTreeMap::new(),
            closed: false,
        })
    }
}

/// A connected receiver.
#[derive(Debug)]
pub struct Receiver<T: ReceiverTransport> {
    transport: T,
    admission: Admission,
    served: Served,
    /// The newest version acknowledged per model: acknowledging it or an older one again
    /// is a no-op, whatever the transport.
    acked: BTreeMap<ModelId, Version>,
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

/// Counts `e` as a failed update of the receiver of transport `name`, unless the sender is
/// gone (every run ends so) or a wait ran out (the caller may wait again).
fn count_failure(name: &'static str, e: &Error) {
    if !matches!(e, Error::PeerGone { .. } | Error::Timeout { .. }) {
        metrics::failed(Side::Receiver, name);
    }
}

impl<T: ReceiverTransport> Receiver<T> {
    /// The transport's name, while this receiver is open.
    fn open_name(&self) -> Result<&'static str> {
        if self.closed {
            return Err(Error::State("receiver is shut down"));
        }
        Ok(self.transport.name())
    }

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
        let Some(update) = self.stage(timeout)? else {
            return Ok(None);
        };
        self.ack(&update.entries())?;
        Ok(Some(update))
    }

    /// As [`Receiver::receive`], without the acknowledgement: for a caller whose "applied"
    /// comes later (an engine that swaps the version into the policy it serves), which then
    /// calls [`Receiver::ack`]. The version is admitted and becomes this receiver's served
    /// snapshot; the sender still waits for it.
    ///
    /// # Errors
    /// As [`Receiver::receive`].
    pub fn stage(&mut self, timeout: Duration) -> Result<Option<Update>> {
        let name = self.open_name()?;
        let failed = |e: &Error| count_failure(name, e);
        let next = self.transport.next_group(deadline_in(timeout));
        let Some(group) = next.inspect_err(failed)? else {
            return Ok(None);
        };
        let timer =
            metrics::timed_group(Phase::Apply, name, group.iter().map(|w| w.model().as_str()));
        let served = &self.served;
        self.admission
            .admit(&group, |_| {
                served.store(served.load().with(&group));
                Ok(())
            })
            .inspect_err(failed)?;
        timer.finish();
        for w in &group {
            metrics::received(
                name,
                w.model().as_str(),
                w.version().0,
                w.manifest().total_len() as u64,
            );
        }
        Ok(Some(Update { group }))
    }

    /// Waits up to `timeout` for the next version of each model with a newer one and streams
    /// it into the caller's model ([`ReceiverTransport::stream_next`]): `apply` gets each
    /// tensor once its bytes are verified and must put it where it is served. Once every
    /// tensor of the group is applied, the versions are admitted and acknowledged. The
    /// receiver keeps no copy: [`Receiver::current`] is `None` for those models from then on
    /// (their weights live in the caller's model). `Ok(None)` when the timeout passes with
    /// nothing new.
    ///
    /// # Errors
    /// As [`ReceiverTransport::stream_next`]: [`Error::PartlyApplied`] once part of an update
    /// was applied (the caller's model is mixed until a later version streams in whole: a
    /// streaming TCP receiver pulls the same version again at the next call while the
    /// sender keeps it; a transport that received it whole hands over the next version),
    /// otherwise the failure itself with nothing applied.
    pub fn stream(
        &mut self,
        timeout: Duration,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
    ) -> Result<Option<Vec<(ModelId, Version)>>> {
        let Some(entries) = self.stream_staged(timeout, apply)? else {
            return Ok(None);
        };
        self.ack(&entries)?;
        Ok(Some(entries))
    }

    /// As [`Receiver::stream`], without the acknowledgement: for a caller whose "applied"
    /// comes later (an engine that completes a load after its last tensor), which then
    /// calls [`Receiver::ack`].
    ///
    /// # Errors
    /// As [`Receiver::stream`].
    pub fn stream_staged(
        &mut self,
        timeout: Duration,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
    ) -> Result<Option<Vec<(ModelId, Version)>>> {
        let name = self.open_name()?;
        let failed = |e: &Error| count_failure(name, e);
        let streamed = self.transport.stream_next(deadline_in(timeout), apply);
        let Some(entries) = streamed.inspect_err(failed)? else {
            return Ok(None);
        };
        self.admission
            .admit_versions(&entries)
            .inspect_err(failed)?;
        self.served.store(self.served.load().without(&entries));
        for (m, v) in &entries {
            let bytes = self
                .admission
                .manifests()
                .get(m)
                .map_or(0, |man| man.total_len() as u64);
            metrics::received(name, m.as_str(), v.0, bytes);
        }
        Ok(Some(entries))
    }

    /// Tells the sender these versions are applied (after [`Receiver::stage`] or
    /// [`Receiver::stream_staged`]). Versions
    /// only grow: acknowledging a version acknowledges the older ones it replaced, and a
    /// version already acknowledged (or older) is not acknowledged again.
    ///
    /// # Errors
    /// As [`ReceiverTransport::ack`]; [`Error::State`] after shutdown.
    pub fn ack(&mut self, applied: &[(ModelId, Version)]) -> Result<()> {
        if self.closed {
            return Err(Error::State("receiver is shut down"));
        }
        let fresh: Vec<(ModelId, Version)> = applied
            .iter()
            .filter(|(m, v)| self.acked.get(m).is_none_or(|a| v > a))
            .cloned()
            .collect();
        if fresh.is_empty() {
            return Ok(());
        }
        self.transport.ack(&fresh)?;
        for (m, v) in fresh {
            let newest = self.acked.entry(m).or_insert(v);
            *newest = (*newest).max(v);
        }
        Ok(())
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
        self.admission.current(model)
    }

    /// The agreed manifests.
    pub fn manifests(&self) -> &Manifests {
        self.admission.manifests()
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

#[cfg(test)]
mod tests {
    //! The lifecycle driven through the core's in-memory pair ([`crate::inproc`]), no sockets.
    use super::*;
    use crate::DType;
    use crate::inproc::{InProc, InProcReceiver, InProcSender};
    use crate::manifest::Manifest;
    use crate::testing::{self, id};

    const LONG: Duration = Duration::from_secs(30);

    fn manifest(dtype: DType, len: usize) -> Arc<Manifest> {
        testing::manifest(&[("w", dtype, &[len])])
    }

    /// `model` at `version` with every f32 of `w` equal to `fill`.
    fn weights(model: &str, m: &Arc<Manifest>, version: u64, fill: f32) -> WeightSet {
        testing::filled(&id(model), m, version, fill)
    }

    fn policy_manifests(m: &Arc<Manifest>) -> Manifests {
        testing::manifests(&[("policy", m)])
    }

    /// A connected sender and one receiver over a fresh hub, policy at version 1 (all 1.0).
    fn connected(m: &Arc<Manifest>) -> (Sender<InProcSender>, Receiver<InProcReceiver>) {
        let hub = InProc::new();
        let rx = hub.receiver();
        let expected = policy_manifests(m);
        let joiner =
            std::thread::spawn(move || ReceiverInit::new(rx, Some(expected)).connect(LONG));
        let tx = SenderInit::new(hub.sender().unwrap(), policy_manifests(m))
            .with_ack_timeout(LONG)
            .connect(vec![weights("policy", m, 1, 1.0)], LONG)
            .unwrap();
        let rx = joiner.join().unwrap().unwrap();
        (tx, rx)
    }

    fn served_fill(rx: &Receiver<InProcReceiver>) -> (Version, f32) {
        let snap = rx.served().load();
        let w = snap.get(&id("policy")).unwrap();
        (w.version(), w.view::<f32>("w").unwrap()[0])
    }

    #[test]
    fn connect_delivers_the_initial_weights_and_acks_them() {
        let m = manifest(DType::F32, 8);
        let (tx, rx) = connected(&m);
        assert_eq!(tx.version(&id("policy")), Version(1));
        assert_eq!(rx.version(&id("policy")), Version(1));
        assert_eq!(served_fill(&rx), (Version(1), 1.0));
        assert!(rx.manifests().check_agree(tx.manifests()).is_ok());
    }

    #[test]
    fn publish_receive_and_ack() {
        let m = manifest(DType::F32, 8);
        let (mut tx, mut rx) = connected(&m);
        let pending = tx.send_async(vec![weights("policy", &m, 2, 2.0)]).unwrap();
        assert_eq!(pending.entries(), &[(id("policy"), Version(2))]);
        // not applied yet: the ack is owed and a short wait names the late receiver
        let late = tx.wait(&pending, Duration::from_millis(20)).unwrap_err();
        assert!(late.is_timeout(), "{late}");
        assert!(late.to_string().contains("receivers [0]"), "{late}");
        let update = rx.receive(LONG).unwrap().expect("version 2 arrives");
        assert_eq!(update.entries(), vec![(id("policy"), Version(2))]);
        assert_eq!(served_fill(&rx), (Version(2), 2.0));
        tx.wait(&pending, LONG).unwrap();
        // nothing new: the deadline passes quietly
        assert!(rx.receive(Duration::from_millis(10)).unwrap().is_none());
        // a skipped version is fine, the newest lands
        let _skipped = tx.send_async(vec![weights("policy", &m, 3, 3.0)]).unwrap();
        let pending = tx.send_async(vec![weights("policy", &m, 7, 7.0)]).unwrap();
        let update = rx.receive(LONG).unwrap().unwrap();
        assert_eq!(update.entries(), vec![(id("policy"), Version(7))]);
        tx.wait(&pending, LONG).unwrap();
        assert_eq!(served_fill(&rx), (Version(7), 7.0));
    }

    #[test]
    fn a_staged_version_is_acknowledged_when_the_caller_says() {
        let m = manifest(DType::F32, 8);
        let (mut tx, mut rx) = connected(&m);
        let pending = tx.send_async(vec![weights("policy", &m, 2, 2.0)]).unwrap();
        let update = rx.stage(LONG).unwrap().expect("version 2 arrives");
        // admitted and served by the receiver, but not acknowledged
        assert_eq!(served_fill(&rx), (Version(2), 2.0));
        let late = tx.wait(&pending, Duration::from_millis(20)).unwrap_err();
        assert!(late.is_timeout(), "{late}");
        rx.ack(&update.entries()).unwrap();
        tx.wait(&pending, LONG).unwrap();
    }

    #[test]
    fn the_sender_refuses_before_publishing() {
        let m = manifest(DType::F32, 8);
        let (mut tx, mut rx) = connected(&m);
        let stale = tx
            .send_async(vec![weights("policy", &m, 1, 9.0)])
            .unwrap_err();
        assert!(matches!(stale, Error::StaleVersion { .. }), "{stale}");
        let shape = tx
            .send_async(vec![weights("policy", &manifest(DType::F32, 9), 2, 9.0)])
            .unwrap_err();
        assert!(shape.to_string().contains("tensor `w`"), "{shape}");
        let ghost = tx
            .send_async(vec![weights("ghost", &m, 2, 9.0)])
            .unwrap_err();
        assert!(matches!(ghost, Error::UnknownModel(_)), "{ghost}");
        assert_eq!(tx.version(&id("policy")), Version(1));
        // nothing reached the receiver
        assert!(rx.receive(Duration::from_millis(10)).unwrap().is_none());
        assert_eq!(served_fill(&rx), (Version(1), 1.0));
    }

    #[test]
    fn the_receiver_refuses_a_bad_update_and_keeps_the_old_version() {
        let m = manifest(DType::F32, 8);
        let (mut tx, mut rx) = connected(&m);
        // bypass the sender's own checks: publish straight on the transport
        let raw = |tx: &mut Sender<InProcSender>, w: WeightSet| {
            tx.transport_mut()
                .publish(&vec![Arc::new(w)], deadline_in(LONG))
                .unwrap();
        };
        raw(&mut tx, weights("ghost", &m, 2, 9.0));
        let e = rx.receive(LONG).unwrap_err();
        assert!(matches!(e, Error::UnknownModel(_)), "{e}");
        raw(&mut tx, weights("policy", &manifest(DType::F16, 8), 2, 9.0));
        let e = rx.receive(LONG).unwrap_err();
        assert!(e.to_string().contains("tensor `w`"), "{e}");
        raw(&mut tx, weights("policy", &manifest(DType::F32, 4), 3, 9.0));
        let e = rx.receive(LONG).unwrap_err();
        assert!(e.to_string().contains("tensor `w`"), "{e}");
        // the old version stays served and none of them was acknowledged
        assert_eq!(rx.version(&id("policy")), Version(1));
        assert_eq!(served_fill(&rx), (Version(1), 1.0));
        let refused = [(id("policy"), Version(3))];
        assert!(
            tx.transport_mut()
                .wait_acks(&refused, Instant::now())
                .unwrap_err()
                .is_timeout()
        );
        // a good version after the refusals lands
        let pending = tx.send_async(vec![weights("policy", &m, 4, 4.0)]).unwrap();
        assert!(rx.receive(LONG).unwrap().is_some());
        tx.wait(&pending, LONG).unwrap();
        assert_eq!(served_fill(&rx), (Version(4), 4.0));
    }

    #[test]
    fn a_receiver_refuses_a_sender_with_other_manifests() {
        let hub = InProc::new();
        let rx = hub.receiver();
        let expected = policy_manifests(&manifest(DType::F16, 8));
        let joiner =
            std::thread::spawn(move || ReceiverInit::new(rx, Some(expected)).connect(LONG));
        let m = manifest(DType::F32, 8);
        let sent = SenderInit::new(hub.sender().unwrap(), policy_manifests(&m)).connect(
            vec![weights("policy", &m, 1, 1.0)],
            Duration::from_millis(50),
        );
        let refused = joiner.join().unwrap().unwrap_err();
        assert!(refused.to_string().contains("tensor `w`"), "{refused}");
        // the refusing receiver left without acking: the sender either times out or, once
        // the receiver is gone, owes nobody; it never hangs
        if let Err(e) = sent {
            assert!(e.is_timeout(), "{e}");
        }
    }

    /// Counters and gauges recorded on this thread, by `name{label=value,...}`.
    #[derive(Default)]
    struct Capture(std::sync::Mutex<BTreeMap<String, Arc<std::sync::atomic::AtomicU64>>>);

    impl Capture {
        fn cell(&self, key: &::metrics::Key) -> Arc<std::sync::atomic::AtomicU64> {
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            let name = format!("{}{{{}}}", key.name(), labels.join(","));
            Arc::clone(self.0.lock().unwrap().entry(name).or_default())
        }

        /// A counter's value.
        fn count(&self, name: &str) -> Option<u64> {
            let cells = self.0.lock().unwrap();
            cells.get(name).map(|c| c.load(Ordering::Relaxed))
        }

        /// A gauge's value.
        fn gauge(&self, name: &str) -> Option<f64> {
            self.count(name).map(f64::from_bits)
        }
    }

    impl ::metrics::Recorder for Capture {
        fn describe_counter(
            &self,
            _: ::metrics::KeyName,
            _: Option<::metrics::Unit>,
            _: ::metrics::SharedString,
        ) {
        }
        fn describe_gauge(
            &self,
            _: ::metrics::KeyName,
            _: Option<::metrics::Unit>,
            _: ::metrics::SharedString,
        ) {
        }
        fn describe_histogram(
            &self,
            _: ::metrics::KeyName,
            _: Option<::metrics::Unit>,
            _: ::metrics::SharedString,
        ) {
        }
        fn register_counter(
            &self,
            key: &::metrics::Key,
            _: &::metrics::Metadata<'_>,
        ) -> ::metrics::Counter {
            ::metrics::Counter::from_arc(self.cell(key))
        }
        fn register_gauge(
            &self,
            key: &::metrics::Key,
            _: &::metrics::Metadata<'_>,
        ) -> ::metrics::Gauge {
            ::metrics::Gauge::from_arc(self.cell(key))
        }
        fn register_histogram(
            &self,
            _: &::metrics::Key,
            _: &::metrics::Metadata<'_>,
        ) -> ::metrics::Histogram {
            ::metrics::Histogram::noop()
        }
    }

    /// Each end counts its updates (and their bytes) and shows its version; refused
    /// updates count as failures on the side that refused them; a wait that runs out is no
    /// failure, a send whose acknowledgements do not come is one.
    #[test]
    fn each_end_counts_its_updates_and_failures() {
        let m = manifest(DType::F32, 8);
        let (mut tx, mut rx) = connected(&m);
        let cap = Capture::default();
        ::metrics::with_local_recorder(&cap, || {
            let pending = tx.send_async(vec![weights("policy", &m, 2, 2.0)]).unwrap();
            // a wait in slices: running out is not a failure
            assert!(tx.wait(&pending, Duration::ZERO).unwrap_err().is_timeout());
            rx.receive(LONG).unwrap().unwrap();
            tx.wait(&pending, LONG).unwrap();
            // refused by the sender: a stale version
            assert!(tx.send_async(vec![weights("policy", &m, 2, 9.0)]).is_err());
            // refused by the receiver: a version that reached it past the sender's checks
            tx.transport_mut()
                .publish(
                    &vec![Arc::new(weights("ghost", &m, 3, 9.0))],
                    deadline_in(LONG),
                )
                .unwrap();
            assert!(rx.receive(LONG).is_err());
            // a send whose acknowledgement does not come in time fails
            tx.set_ack_timeout(Duration::from_millis(20));
            assert!(
                tx.send(weights("policy", &m, 4, 4.0))
                    .unwrap_err()
                    .is_timeout()
            );
        });
        let key =
            |name: &str, side: &str| format!("{name}{{side={side},model=policy,transport=inproc}}");
        let bytes = m.total_len() as u64;
        assert_eq!(cap.count(&key(metrics::UPDATES_TOTAL, "sender")), Some(2));
        assert_eq!(
            cap.count(&key(metrics::UPDATE_BYTES_TOTAL, "sender")),
            Some(2 * bytes)
        );
        assert_eq!(cap.count(&key(metrics::UPDATES_TOTAL, "receiver")), Some(1));
        assert_eq!(
            cap.count(&key(metrics::UPDATE_BYTES_TOTAL, "receiver")),
            Some(bytes)
        );
        let version = |name: &str| format!("{name}{{model=policy,transport=inproc}}");
        assert_eq!(cap.gauge(&version(metrics::PUBLISHED_VERSION)), Some(4.0));
        assert_eq!(cap.gauge(&version(metrics::SERVED_VERSION)), Some(2.0));
        let failures = |side: &str| {
            format!(
                "{}{{side={side},transport=inproc}}",
                metrics::UPDATE_FAILURES_TOTAL
            )
        };
        // the stale version and the late acknowledgement
        assert_eq!(cap.count(&failures("sender")), Some(2));
        // the ghost model
        assert_eq!(cap.count(&failures("receiver")), Some(1));
    }

    #[test]
    fn a_dead_sender_is_an_error_not_a_hang() {
        let m = manifest(DType::F32, 8);
        let (tx, mut rx) = connected(&m);
        tx.shutdown().unwrap();
        let e = rx.receive(LONG).unwrap_err();
        assert!(matches!(e, Error::PeerGone { .. }), "{e}");
        assert_eq!(served_fill(&rx), (Version(1), 1.0));
    }
}
