//! The receiving end: registers with a sender agent, learns of versions through
//! `_receive_weights_scheme`, verifies the sender's bucket plan, pulls the buckets over
//! parallel streams, verifies every tensor, relays.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use refit_node::{ClusterToken, Node, NodeConfig, OpenStream, Peer, open_stream};
use refit_runtime::delta::BucketDelta;
use refit_runtime::metrics::{self, Phase};
use refit_runtime::wait::{Wait, poll_until};
use refit_runtime::{
    BucketPlan, Error, Group, Manifest, Manifests, ModelId, ReceiverTransport, Result, Version,
    WeightSet, wire,
};
use uuid::Uuid;

use super::data::{
    Counters, Dest, Expect, Hashes, Serve, ServeStats, Sink, Source, Sums, Verified, assign,
    covered, piece_starts, pull_buckets, serve_pull,
};
use super::inflight::InFlight;
use super::messages::*;
use super::stream_sink::StreamSink;
use super::{NAME, TcpReceiverSpec};

mod stream;
use crate::pool::{BufPool, PooledBuf};

/// How a receiver pulls.
#[derive(Debug, Clone)]
pub struct TcpReceiverConfig {
    /// Parallel streams per transfer, each pulling whole buckets (default 4; never more
    /// than the buckets to pull).
    pub streams: usize,
    /// `Full`, `Delta` or `Elements` (default `Delta`: once a version is held, only the
    /// buckets holding a changed tensor; `Elements`: those buckets as element-level deltas
    /// against the version held, for links where bytes are dear).
    pub mode: TransferMode,
    /// Serve held versions to other receivers (default true).
    pub relay: bool,
    /// Where the receiver's own node listens when it starts one (default `127.0.0.1:0`; the
    /// sender must reach it, so use a routable address across hosts).
    pub bind: SocketAddr,
    /// The address the sender and other receivers are told to use (default: the bound one).
    pub advertise: Option<SocketAddr>,
    /// Versions held per model for relaying and as delta bases (default 2).
    pub keep_versions: usize,
    /// Deadline of control calls (register, plan, ack; default 120 s: a plan may wait for a
    /// relay source to free up).
    pub call_timeout: Duration,
    /// Longest wait for any single read or write on a data stream (default 30 s).
    pub stream_timeout: Duration,
    /// How `next_group` honours its caller's deadline while a pull is under way: past the
    /// deadline the pull goes on only while bytes keep arriving, and is abandoned with
    /// [`Error::Timeout`] once none arrived for this long (default 1 s). It is also the
    /// least time a pull's control call and stream opening get, so that a short poll can
    /// still start one.
    pub stall_timeout: Duration,
}

impl Default for TcpReceiverConfig {
    fn default() -> Self {
        Self {
            streams: 4,
            mode: TransferMode::Delta,
            relay: true,
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            keep_versions: 2,
            call_timeout: Duration::from_secs(120),
            stream_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(1),
        }
    }
}

/// How this receiver's transfers went, counted since it started ([`TcpReceiver::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Transfers of every byte of a version.
    pub full: u64,
    /// Of those, transfers where this receiver asked for a delta from a version it held and
    /// the sender sent every byte instead (it no longer knew that version, or its plan
    /// changed).
    pub full_instead_of_delta: u64,
    /// Transfers of the buckets holding a changed tensor, raw.
    pub delta: u64,
    /// Transfers of those buckets as element-level deltas against the version held.
    pub elements: u64,
    /// Weight bytes the transfers landed (each bucket's whole length).
    pub bytes_landed: u64,
    /// Bytes of weights read off the data streams: the landed bytes, less what the
    /// element-level encodings saved.
    pub bytes_on_wire: u64,
}

#[derive(Debug, Default)]
struct TransferCounts {
    full: AtomicU64,
    full_instead_of_delta: AtomicU64,
    delta: AtomicU64,
    elements: AtomicU64,
}

#[derive(Debug, Default)]
struct Inbox {
    pending: BTreeMap<ModelId, Version>,
    closing: bool,
}

/// How long a relayed pull waits for this receiver's own pull of the version to start.
const RELAY_START: Duration = Duration::from_secs(5);

/// Where a receiver writes a transfer instead of an arena of its pool (see
/// [`TcpReceiver::with_sinks`]): called once per transfer with the model, the version and
/// its manifest; `None` takes an arena from the pool.
pub type SinkSource =
    dyn Fn(&ModelId, Version, &Arc<Manifest>) -> Result<Option<Box<dyn Sink>>> + Send + Sync;

/// A verified version this receiver can relay, with its checksums.
type Relayable = (Arc<WeightSet>, Arc<Hashes>);

#[derive(Debug, Default)]
struct Shared {
    inbox: Mutex<Inbox>,
    cv: Condvar,
    held: Mutex<BTreeMap<ModelId, VecDeque<Arc<WeightSet>>>>,
    /// Verified versions this receiver serves as a relay. A version enters before the
    /// sender hears the transfer is done (so a puller the sender sends here finds it), which
    /// may be before its group is returned; `held` tracks what was returned. Each comes with
    /// its checksums, so relaying hashes nothing.
    relayable: Mutex<BTreeMap<ModelId, VecDeque<Relayable>>>,
    /// The version of each model being pulled now, served to relayed pulls as its bytes
    /// arrive.
    inflight: Mutex<BTreeMap<ModelId, Arc<InFlight>>>,
    relay: ServeStats,
    pulled: Arc<AtomicU64>,
    /// Weight bytes the transfers planned so far will have pulled once done.
    planned: Arc<AtomicU64>,
    /// Bucket headers received (one control message per bucket pulled).
    headers: Arc<AtomicU64>,
    /// Weight bytes read off the data streams (encodings counted as sent).
    wire: AtomicU64,
    /// Transfers by kind.
    kinds: TransferCounts,
    /// Arenas of dropped versions, reused by the next pulls.
    pool: Arc<BufPool>,
    /// The verified bucket plan of each model (and its fingerprint).
    plans: Mutex<BTreeMap<ModelId, (u64, Arc<BucketPlan>)>>,
    /// The newest version of each model streamed into the caller's model
    /// ([`ReceiverTransport::stream_next`]): applied, but not held here.
    streamed: Mutex<BTreeMap<ModelId, Version>>,
    /// The most bytes a streaming transfer held at once (tensors put together, waiting for
    /// the caller, or being applied).
    stream_peak: Arc<AtomicU64>,
    /// Counts the caller's applies of streamed tensors twice, at their start and at their
    /// end (odd: one under way): the watchdog counts them as progress.
    caller: AtomicU64,
}

impl Shared {
    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        // plain bookkeeping, consistent even after a panic elsewhere
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn held(&self) -> MutexGuard<'_, BTreeMap<ModelId, VecDeque<Arc<WeightSet>>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn merge(&self, entries: &[(ModelId, Version)]) {
        let mut ib = self.inbox();
        for (m, v) in entries {
            let e = ib.pending.entry(m.clone()).or_insert(*v);
            *e = (*e).max(*v);
        }
        drop(ib);
        self.cv.notify_all();
    }

    fn plan(&self, model: &ModelId) -> Option<(u64, Arc<BucketPlan>)> {
        self.plans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(model)
            .cloned()
    }

    fn set_plan(&self, model: &ModelId, id: u64, plan: Arc<BucketPlan>) {
        self.plans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(model.clone(), (id, plan));
    }

    /// What this receiver serves a relayed pull from: a verified version it holds, else the
    /// one it is pulling now; `None` when it has neither.
    fn source(
        &self,
        model: &ModelId,
        version: Version,
    ) -> Option<std::result::Result<Serve, String>> {
        let held = self
            .relayable
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(model)
            .and_then(|q| q.iter().find(|w| w.0.version() == version).cloned());
        if let Some((weights, sums)) = held {
            let Some((plan_id, plan)) = self.plan(model) else {
                return Some(Err(format!(
                    "this receiver holds no bucket plan of `{model}`"
                )));
            };
            return Some(Ok(Serve::Whole(Source {
                weights,
                plan,
                plan_id,
                sums,
                encoded: None,
            })));
        }
        self.inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(model)
            .filter(|f| f.version() == version)
            .map(|f| Ok(Serve::Landing(Arc::clone(f))))
    }

    fn set_inflight(&self, model: &ModelId, flight: Option<&Arc<InFlight>>) {
        let mut m = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        match flight {
            Some(f) => m.insert(model.clone(), Arc::clone(f)),
            None => m.remove(model),
        };
    }

    /// Makes a verified version available to relayed pulls, keeping the newest `keep`.
    fn offer(&self, ws: &Arc<WeightSet>, sums: Hashes, keep: usize) {
        let mut r = self.relayable.lock().unwrap_or_else(|p| p.into_inner());
        let q = r.entry(ws.model().clone()).or_default();
        q.push_back((Arc::clone(ws), Arc::new(sums)));
        while q.len() > keep.max(1) {
            q.pop_front();
        }
    }

    fn held_version(&self, model: &ModelId) -> Version {
        let held = self
            .held()
            .get(model)
            .and_then(|q| q.back())
            .map_or(Version::ZERO, |w| w.version());
        let streamed = self
            .streamed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(model)
            .copied()
            .unwrap_or(Version::ZERO);
        held.max(streamed)
    }
}

/// Where one transfer writes ([`TcpReceiver::prepare_target`]).
struct Target {
    /// An arena of the pool, as the version in flight (none when a sink takes the bytes).
    flight: Option<Arc<InFlight>>,
    sink: Option<Box<dyn Sink>>,
    /// The arena is a fresh map (none to recycle): its pages are faulted in beside the
    /// streams.
    fresh: bool,
}

/// One transfer under way: what is pulled, on which terms, and by when.
struct Job<'a> {
    model: &'a ModelId,
    version: Version,
    manifest: &'a Arc<Manifest>,
    plan: &'a Arc<BucketPlan>,
    t: &'a Plan,
    starts: &'a [usize],
    /// The checksums of the pieces verified so far.
    verified: &'a Verified,
    token: &'a ClusterToken,
    deadline: Instant,
    /// When the pull began (its first attempt).
    started: Instant,
}

impl Job<'_> {
    /// The error of a pull the watchdog abandoned.
    fn expired(&self) -> Error {
        Error::Timeout {
            what: format!(
                "`{}` v{} from {} (bytes stopped arriving past the deadline)",
                self.model, self.version, self.t.source
            ),
            after: self.started.elapsed(),
        }
    }
}

/// Watches a pull against its caller's deadline: once the deadline passed and no byte
/// arrived for a stall window, it shuts the pull's streams (their blocked reads return at
/// once) and marks the pull expired.
#[derive(Default)]
struct Watchdog {
    state: Mutex<Watched>,
    cv: Condvar,
}

#[derive(Default)]
struct Watched {
    streams: Vec<std::net::TcpStream>,
    expired: bool,
    finished: bool,
}

impl Watchdog {
    fn state(&self) -> MutexGuard<'_, Watched> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a handle on a stream the pull opened; false once the pull expired.
    fn register(&self, stream: &std::net::TcpStream) -> bool {
        let mut st = self.state();
        if st.expired {
            return false;
        }
        if let Ok(s) = stream.try_clone() {
            st.streams.push(s);
        }
        true
    }

    fn finish(&self) {
        self.state().finished = true;
        self.cv.notify_all();
    }

    fn expired(&self) -> bool {
        self.state().expired
    }

    /// Waits until the pull finishes (false) or expires (true): past `deadline`, once
    /// `progress` stayed the same for `stall` (`None`: progress under way, whatever came
    /// before).
    fn watch(
        &self,
        deadline: Instant,
        stall: Duration,
        progress: &dyn Fn() -> Option<(u64, u64)>,
    ) -> bool {
        let mut st = self.state();
        let mut until = deadline;
        let mut last = None;
        loop {
            if st.finished {
                return false;
            }
            let now = Instant::now();
            if now < until {
                st = self
                    .cv
                    .wait_timeout(st, until - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                continue;
            }
            let bytes = progress();
            if bytes.is_some() && last == bytes {
                st.expired = true;
                for s in &st.streams {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
                return true;
            }
            last = bytes;
            until = now + stall;
        }
    }
}

/// The receiving end of the TCP transport.
pub struct TcpReceiver {
    spec: TcpReceiverSpec,
    cfg: TcpReceiverConfig,
    node: Option<Node>,
    owns_node: bool,
    me: Uuid,
    id: u32,
    ctl: Option<Peer>,
    manifests: Option<Manifests>,
    shared: Arc<Shared>,
    sinks: Option<Arc<SinkSource>>,
    /// Versions are applied as they stream in ([`TcpReceiver::streaming`]).
    streaming: bool,
    closed: bool,
}

impl std::fmt::Debug for TcpReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpReceiver")
            .field("sender", &self.spec.addr)
            .field("id", &self.id)
            .field("connected", &self.ctl.is_some())
            .finish()
    }
}

impl TcpReceiver {
    /// A receiver of the sender described by `spec` (local only: nothing is contacted until
    /// `connect`).
    pub fn new(spec: TcpReceiverSpec) -> Self {
        Self {
            spec,
            cfg: TcpReceiverConfig::default(),
            node: None,
            owns_node: false,
            me: Uuid::new_v4(),
            id: u32::MAX,
            ctl: None,
            manifests: None,
            shared: Arc::default(),
            sinks: None,
            streaming: false,
            closed: false,
        }
    }

    /// Applies every version as it streams in
    /// ([`stream_next`](ReceiverTransport::stream_next)), keeping no copy: whatever its
    /// config says, the receiver registers as no relay, asks for every byte of each version
    /// (a delta needs a base held here), and makes no arena ahead of the first pull. Bounded
    /// memory for an engine whose model is as large as the host allows, at the cost of
    /// applying while the bytes arrive (the model is mixed until the last tensor is in).
    #[must_use]
    pub fn streaming(mut self) -> Self {
        self.streaming = true;
        self
    }

    /// The most bytes a streaming transfer held at once: tensors being put together from
    /// their buckets, waiting for the caller, or being applied.
    pub fn streaming_peak(&self) -> u64 {
        self.shared.stream_peak.load(Ordering::Relaxed)
    }

    /// Writes each transfer into a sink from `source` (when it gives one) instead of an
    /// arena of the receiver's pool: e.g. the file the weights are bound for, written as the
    /// bytes arrive and verified bucket by bucket, so nothing makes a second pass over them
    /// (what `refit pull` does). Used when every bucket of the plan is covered by its tensors
    /// (no padding between them); otherwise, or when `source` gives `None`, the transfer
    /// lands in an arena. An error from `source` fails the transfer and the previous
    /// version stays served.
    #[must_use]
    pub fn with_sinks(
        mut self,
        source: impl Fn(&ModelId, Version, &Arc<Manifest>) -> Result<Option<Box<dyn Sink>>>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.sinks = Some(Arc::new(source));
        self
    }

    /// Replaces the configuration.
    #[must_use]
    pub fn with_config(mut self, cfg: TcpReceiverConfig) -> Self {
        self.cfg = cfg;
        self
    }

    /// Uses an existing node (its token must be the cluster's) instead of starting one.
    #[must_use]
    pub fn with_node(mut self, node: Node) -> Self {
        self.node = Some(node);
        self.owns_node = false;
        self
    }

    /// The uuid this receiver's handlers are registered under on its node (the target of
    /// `_receive_weights_scheme`).
    pub fn handler_id(&self) -> Uuid {
        self.me
    }

    /// A counter of weight bytes pulled so far (for progress bars), readable from any thread.
    pub fn progress(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.shared.pulled)
    }

    /// A counter of the weight bytes the transfers planned so far will have pulled once
    /// done (the end of a progress bar whose position is [`progress`](Self::progress)).
    pub fn progress_total(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.shared.planned)
    }

    /// Bucket control messages (headers) this receiver has received: one per bucket pulled,
    /// so a full transfer adds the plan's bucket count.
    pub fn bucket_headers(&self) -> u64 {
        self.shared.headers.load(Ordering::Relaxed)
    }

    /// The bucket plan this receiver verified for `model` (none before its first pull).
    pub fn bucket_plan(&self, model: &ModelId) -> Option<Arc<BucketPlan>> {
        self.shared.plan(model).map(|p| p.1)
    }

    /// How this receiver's transfers went: how many were full, deltas or element-level
    /// deltas, and the bytes landed against the bytes read off the wire.
    pub fn stats(&self) -> TransferStats {
        let k = &self.shared.kinds;
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TransferStats {
            full: n(&k.full),
            full_instead_of_delta: n(&k.full_instead_of_delta),
            delta: n(&k.delta),
            elements: n(&k.elements),
            bytes_landed: n(&self.shared.pulled),
            bytes_on_wire: n(&self.shared.wire),
        }
    }

    /// Bytes this receiver served to other receivers as a relay.
    pub fn bytes_relayed(&self) -> u64 {
        self.shared.relay.bytes.load(Ordering::Relaxed)
    }

    fn ctl(&self) -> Result<&Peer> {
        self.ctl.as_ref().ok_or(Error::State(
            "tcp receiver used before connect or after shutdown",
        ))
    }

    fn gone(&self, reason: &str) -> Error {
        Error::PeerGone {
            peer: format!("tcp sender at {}", self.spec.addr),
            reason: reason.into(),
        }
    }

    fn register_handlers(&self, node: &Node) {
        let sh = Arc::clone(&self.shared);
        node.register(self.me, RECEIVE_WEIGHTS, move |_, a: Announce| {
            if a.closing {
                sh.inbox().closing = true;
                sh.cv.notify_all();
            } else {
                sh.merge(&a.entries);
            }
            async { Ok::<_, Error>(()) }
        });
        let sh = Arc::clone(&self.shared);
        node.register_stream(self.me, PULL, move |_, bytes, stream| {
            let sh = Arc::clone(&sh);
            Box::pin(async move {
                let req: PullReq = wire::decode(&bytes, wire::MAX_CONTROL_MESSAGE)?;
                // the sender may send a puller here a moment before this receiver's own pull
                // of the version has started: wait a little for it
                let deadline = tokio::time::Instant::now() + RELAY_START;
                let src = loop {
                    if let Some(src) = sh.source(&req.model, req.version) {
                        break src;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        break Err(format!(
                            "this receiver holds no `{}` version {}",
                            req.model, req.version
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                };
                Ok(serve_pull(stream, src, req, &sh.relay).await?)
            })
        });
    }

    fn done(&self, lease: u64, ok: bool, reason: String) {
        let d = Done {
            receiver: self.id,
            lease,
            ok,
            reason,
        };
        let sent = self.ctl().and_then(|ctl| {
            Ok(ctl.call::<_, ()>(self.spec.agent, DONE, &d, self.cfg.call_timeout)?)
        });
        if let Err(e) = sent {
            tracing::warn!(error = %e, "could not signal transfer completion");
        }
    }

    /// The sender's plan for `model`: the one held when the transfer names it, else the
    /// shipped one once it verified against this end's manifest (then held for later
    /// transfers and for relaying).
    fn accept_plan(
        &self,
        model: &ModelId,
        manifest: &Manifest,
        t: &Plan,
    ) -> Result<Arc<BucketPlan>> {
        let Some(plan) = &t.bucket_plan else {
            return match self.shared.plan(model) {
                Some((id, p)) if id == t.plan_id => Ok(p),
                _ => Err(Error::transport(
                    NAME,
                    format!(
                        "the sender named bucket plan {:#018x} of `{model}` without shipping it",
                        t.plan_id
                    ),
                )),
            };
        };
        if &plan.model != model {
            return Err(Error::Bucket {
                index: 0,
                reason: format!("the plan of model `{}` came for `{model}`", plan.model),
            });
        }
        plan.verify(manifest)?;
        let id = plan.fingerprint()?;
        if id != t.plan_id {
            return Err(Error::transport(
                NAME,
                format!(
                    "the shipped bucket plan hashes to {id:#018x}, the sender named {:#018x}",
                    t.plan_id
                ),
            ));
        }
        let plan = Arc::new(plan.clone());
        self.shared.set_plan(model, id, Arc::clone(&plan));
        Ok(plan)
    }

    /// How long a step of a pull may wait for `deadline`: the time left, at least the stall
    /// window, at most `cap`.
    fn within(&self, deadline: Instant, cap: Duration) -> Duration {
        cap.min(
            deadline
                .saturating_duration_since(Instant::now())
                .max(self.cfg.stall_timeout),
        )
    }

    /// Pulls one version; `Ok(Err(latest))` when the sender no longer keeps it. Honours
    /// `deadline` as [`TcpReceiverConfig::stall_timeout`] says. With `stream`, the bytes go
    /// to that streaming sink when the plan lets a sink take them (`Ok(Ok(None))`: nothing
    /// is held here), else to an arena as usual.
    fn pull(
        &self,
        model: &ModelId,
        version: Version,
        deadline: Instant,
        stream: Option<&StreamSink>,
    ) -> Result<std::result::Result<Option<Arc<WeightSet>>, Version>> {
        let manifest: Arc<Manifest> = Arc::clone(
            self.manifests
                .as_ref()
                .ok_or(Error::State("tcp receiver used before connect"))?
                .get(model)?,
        );
        let base = self
            .shared
            .held()
            .get(model)
            .and_then(|q| q.back().cloned());
        let token = ClusterToken::new(self.spec.token.clone())?;
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let t = match self.request_transfer(model, version, base.as_deref(), deadline)? {
                TransferReply::Superseded { latest } => return Ok(Err(latest)),
                TransferReply::Plan(p) => p,
            };
            let held = base.as_ref().map(|b| b.version());
            let (plan, starts) = self.verify_transfer(model, &manifest, &t, held)?;
            let verified = Verified::new(starts.last().copied().unwrap_or(0));
            let planned: u64 = t
                .buckets
                .iter()
                .filter_map(|&i| plan.buckets.get(i as usize))
                .map(|b| b.len as u64)
                .sum();
            let job = Job {
                model,
                version,
                manifest: &manifest,
                plan: &plan,
                t: &t,
                starts: &starts,
                verified: &verified,
                token: &token,
                deadline,
                started,
            };
            let Target {
                flight,
                sink,
                fresh,
            } = self.prepare_target(&job, base.as_deref(), stream.is_some())?;
            self.shared.planned.fetch_add(planned, Ordering::Relaxed);
            if let Some(f) = &flight
                && self.cfg.relay
            {
                self.shared.set_inflight(model, Some(f));
            }
            let watchdog = Watchdog::default();
            let stream = stream.filter(|_| flight.is_none() && sink.is_none());
            let result = self.receive(&job, flight.as_ref(), sink, stream, fresh, &watchdog);
            if result.is_err() && watchdog.expired() {
                self.abandon(model, t.lease);
                return Err(job.expired());
            }
            match result {
                Ok(None) => {
                    // every byte is in and verified (the last tensors may still be on their
                    // way to the caller): the transfer itself succeeded
                    self.count(&t, held);
                    self.done(t.lease, true, String::new());
                    return Ok(Ok(None));
                }
                Ok(Some(ws)) => {
                    self.count(&t, held);
                    if !self.streaming {
                        // the terms' checksums, else those the headers declared (every bucket
                        // of a full transfer was verified against them)
                        let pieces = if t.checksums.is_empty() {
                            verified.take()
                        } else {
                            t.checksums.clone()
                        };
                        let sums = Sums::of_arena(&plan, t.plan_id, &manifest, ws.bytes(), pieces);
                        let relayed = Hashes::known(Arc::clone(&plan), sums);
                        self.shared.offer(&ws, relayed, self.cfg.keep_versions);
                    }
                    self.shared.set_inflight(model, None);
                    self.done(t.lease, true, String::new());
                    if flight.is_some() {
                        // the next pulls' arena, faulted in while this version is applied
                        let steady = self.cfg.keep_versions.max(1) + 1;
                        self.shared.pool.warm_spare(manifest.total_len(), steady);
                    }
                    return Ok(Ok(Some(ws)));
                }
                Err(e) => {
                    self.shared.set_inflight(model, None);
                    self.done(t.lease, false, e.to_string());
                    // a streaming sink that handed tensors over already leaves what comes
                    // next to its caller (the version stays pending); one that handed over
                    // none starts again from nothing
                    if t.from_sender || attempt >= 4 || stream.is_some_and(|s| s.handed() > 0) {
                        return Err(e);
                    }
                    if let Some(s) = stream {
                        s.reset();
                    }
                    tracing::warn!(source = %t.source, error = %e, "relay pull failed; asking for another source");
                }
            }
        }
    }

    /// Waits until `deadline` for versions newer than those held (or streamed): each
    /// model's newest announced, `None` when the deadline passes first.
    fn pending(&self, deadline: Instant) -> Result<Option<Vec<(ModelId, Version)>>> {
        poll_until(
            deadline,
            self.shared.inbox(),
            |ib| {
                if ib.closing {
                    return Err(self.gone("shut down"));
                }
                if self.ctl()?.is_closed() {
                    return Err(self.gone("the control connection closed"));
                }
                let want: Vec<(ModelId, Version)> = ib
                    .pending
                    .iter()
                    .filter(|(m, v)| **v > self.shared.held_version(m))
                    .map(|(m, v)| (m.clone(), *v))
                    .collect();
                Ok(if want.is_empty() {
                    Wait::Pending(())
                } else {
                    Wait::Done(want)
                })
            },
            |ib, left| {
                self.shared
                    .cv
                    .wait_timeout(ib, left.min(Duration::from_millis(50)))
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            },
        )
    }

    /// The sender no longer keeps `version` of `model`, `latest` being its newest: what is
    /// pending changes to that (or to nothing, when it is no newer).
    fn superseded(&self, model: &ModelId, version: Version, latest: Version) {
        let mut ib = self.shared.inbox();
        if ib.pending.get(model) == Some(&version) {
            if latest > version {
                ib.pending.insert(model.clone(), latest);
            } else {
                ib.pending.remove(model);
            }
        }
    }

    /// Asks the sender for a transfer of `version` (a delta from `base` when one is held and
    /// the mode allows): its plan, or word that a later version superseded it.
    fn request_transfer(
        &self,
        model: &ModelId,
        version: Version,
        base: Option<&WeightSet>,
        deadline: Instant,
    ) -> Result<TransferReply> {
        let req = TransferReq {
            receiver: self.id,
            model: model.clone(),
            version,
            have: base.map(|b| b.version()),
            // a sink takes raw bytes
            mode: match self.cfg.mode {
                _ if self.streaming => TransferMode::Full,
                TransferMode::Elements if self.sinks.is_some() => TransferMode::Delta,
                m => m,
            },
            plan: self.shared.plan(model).map(|p| p.0),
            relay_in_flight: self.cfg.relay && self.sinks.is_none() && !self.streaming,
        };
        Ok(self.ctl()?.call(
            self.spec.agent,
            TRANSFER,
            &req,
            self.within(deadline, self.cfg.call_timeout),
        )?)
    }

    /// Checks a transfer's terms before a byte is pulled: its bucket plan (accepted as
    /// [`Self::accept_plan`] says), a checksum per piece (or, for a full transfer, none: each
    /// bucket's header declares its own), every bucket for a full transfer, a base held for a
    /// delta. Returns the plan and where each bucket's pieces start; a refused
    /// transfer is reported to the sender as failed.
    fn verify_transfer(
        &self,
        model: &ModelId,
        manifest: &Manifest,
        t: &Plan,
        held: Option<Version>,
    ) -> Result<(Arc<BucketPlan>, Vec<usize>)> {
        let plan = match self.accept_plan(model, manifest, t) {
            Ok(p) => p,
            Err(e) => {
                self.done(t.lease, false, format!("bucket plan refused: {e}"));
                return Err(e);
            }
        };
        let starts = piece_starts(&plan);
        let pieces = starts.last().copied().unwrap_or(0);
        let in_headers = t.checksums.is_empty() && t.full;
        if t.checksums.len() != pieces && !in_headers {
            self.done(t.lease, false, "checksum count".into());
            return Err(Error::transport(
                NAME,
                format!(
                    "{} checksums for the plan's {pieces} pieces",
                    t.checksums.len()
                ),
            ));
        }
        if t.full && t.buckets.len() != plan.len() {
            self.done(
                t.lease,
                false,
                "a full transfer without every bucket".into(),
            );
            return Err(Error::transport(
                NAME,
                format!(
                    "a full transfer lists {} of the plan's {} buckets",
                    t.buckets.len(),
                    plan.len()
                ),
            ));
        }
        if let Some(b) = t.encoded_base
            && held != Some(b)
        {
            self.done(t.lease, false, "encoded against a version not held".into());
            return Err(Error::transport(
                NAME,
                format!(
                    "sender encoded the buckets against version {b}, this receiver holds {}",
                    held.map_or_else(|| "none".into(), |v| v.to_string())
                ),
            ));
        }
        if !t.full && held.is_none() {
            self.done(t.lease, false, "delta plan without a base".into());
            return Err(Error::transport(
                NAME,
                "sender planned a delta but this receiver holds no base",
            ));
        }
        Ok((plan, starts))
    }

    /// Counts a transfer that landed, by its kind.
    fn count(&self, t: &Plan, held: Option<Version>) {
        let k = &self.shared.kinds;
        let kind = match (t.full, t.encoded_base) {
            (true, _) => {
                if held.is_some() && self.cfg.mode != TransferMode::Full {
                    k.full_instead_of_delta.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(
                        held = ?held,
                        "asked for a delta, the sender sends every byte (it no longer knows the version held)"
                    );
                }
                &k.full
            }
            (false, Some(_)) => &k.elements,
            (false, None) => &k.delta,
        };
        kind.fetch_add(1, Ordering::Relaxed);
    }

    /// Where `job`'s bytes go: a sink of the caller's (when one is given and the plan
    /// covers the arena) or an arena of the pool as a version in flight, either holding the
    /// buckets a delta does not pull already copied from `base`. A failure is reported to
    /// the sender.
    fn prepare_target(
        &self,
        job: &Job<'_>,
        base: Option<&WeightSet>,
        streamed: bool,
    ) -> Result<Target> {
        let (model, version, manifest, plan, t) =
            (job.model, job.version, job.manifest, job.plan, job.t);
        // the buckets a delta does not pull, from the version held
        let kept: Vec<std::ops::Range<usize>> = match (base, t.full) {
            (Some(_), false) => {
                let moved: Vec<usize> = t.buckets.iter().map(|&i| i as usize).collect();
                BucketDelta::kept(plan, &moved)
            }
            _ => Vec::new(),
        };
        let base_bytes = base.map_or(&[][..], |b| b.bytes());
        let sink = match &self.sinks {
            Some(source) if covered(plan) && !streamed => source(model, version, manifest),
            _ => Ok(None),
        };
        let sink = match sink {
            Ok(s) => s,
            Err(e) => {
                self.done(t.lease, false, format!("no sink: {e}"));
                return Err(e);
            }
        };
        // a fresh arena (none to recycle): its pages are faulted in beside the streams
        let mut fresh = false;
        let flight = match &sink {
            // a streaming sink takes every byte of a full transfer (no base is held)
            None if streamed && kept.is_empty() => None,
            Some(sink) => {
                let copied = kept.iter().try_for_each(|r| {
                    sink.write_at(r.start, base_bytes.get(r.clone()).unwrap_or_default())
                });
                if let Err(e) = copied {
                    self.done(t.lease, false, e.to_string());
                    return Err(e);
                }
                None
            }
            None => match self.arena_flight(job, &kept, base_bytes) {
                Ok((f, new)) => {
                    fresh = new;
                    Some(f)
                }
                Err(e) => {
                    self.done(t.lease, false, e.to_string());
                    return Err(e);
                }
            },
        };
        Ok(Target {
            flight,
            sink,
            fresh,
        })
    }

    /// Pulls the transfer's buckets over parallel streams into `flight` (an arena) or `sink`,
    /// under a watchdog that abandons the pull once bytes stop arriving past the deadline; a
    /// `fresh` arena is faulted in on a thread of its own meanwhile. A version in flight that
    /// failed is marked so.
    fn receive(
        &self,
        job: &Job<'_>,
        flight: Option<&Arc<InFlight>>,
        sink: Option<Box<dyn Sink>>,
        stream: Option<&StreamSink>,
        fresh: bool,
        watchdog: &Watchdog,
    ) -> Result<Option<Arc<WeightSet>>> {
        let (model, version, manifest) = (job.model, job.version, job.manifest);
        let parts = assign(job.plan, &job.t.buckets, self.cfg.streams.max(1));
        let exp = Expect {
            model,
            version,
            manifest,
            plan: job.plan,
            sums: &job.t.checksums,
            starts: job.starts,
            verified: job.verified,
        };
        let counters = Counters {
            bytes: &self.shared.pulled,
            wire: &self.shared.wire,
            headers: &self.shared.headers,
        };
        let me = self.node.as_ref().map_or_else(Uuid::nil, Node::id);
        let open = |part: &[u32]| self.open_pull(job, me, part, watchdog);
        // progress is bytes off the wire (an encoded bucket lands whole only once its
        // encoding is in), and, for a streaming pull, the caller applying tensors: a pull
        // held back by a slow apply is not stalled
        let stall = self.cfg.stall_timeout;
        let (wire, caller) = (&self.shared.wire, &self.shared.caller);
        let progress = || {
            let applied = caller.load(Ordering::Relaxed);
            // an odd count: an apply under way, which counts as progress however long
            (applied % 2 == 0).then(|| (wire.load(Ordering::Relaxed), applied))
        };
        let prefaulted = AtomicBool::new(false);
        let result = std::thread::scope(|scope| {
            let watch = scope.spawn(|| watchdog.watch(job.deadline, stall, &progress));
            let prefault = match flight {
                Some(f) if fresh => Some(scope.spawn(|| f.prefault(&prefaulted))),
                _ => None,
            };
            let r = match (flight, sink, stream) {
                (Some(f), _, _) => pull_buckets(Dest::Arena(f), &parts, exp, &open, counters)
                    .and_then(|_| f.finish())
                    .map(Some),
                (None, None, Some(s)) => pull_buckets(Dest::Sink(s), &parts, exp, &open, counters)
                    .and_then(|_| s.check_done())
                    .map(|()| None),
                (None, Some(sink), _) => {
                    pull_buckets(Dest::Sink(&*sink), &parts, exp, &open, counters)
                        .and_then(|_| sink.finish())
                        .and_then(|storage| {
                            WeightSet::from_shared(
                                model.clone(),
                                version,
                                Arc::clone(manifest),
                                storage,
                            )
                        })
                        .map(|ws| Some(Arc::new(ws)))
                }
                (None, None, None) => Err(Error::State("a transfer with neither arena nor sink")),
            };
            watchdog.finish();
            let _ = watch.join();
            prefaulted.store(true, Ordering::Relaxed);
            if let Some(p) = prefault {
                let _ = p.join();
            }
            r
        });
        if let Some(f) = flight
            && result.is_err()
        {
            f.fail();
        }
        result
    }

    /// Opens one stream of a pull, for the buckets of `part`: its reads wait as long as the
    /// config says, and `watchdog` holds it (refused once the pull expired).
    fn open_pull(
        &self,
        job: &Job<'_>,
        me: Uuid,
        part: &[u32],
        watchdog: &Watchdog,
    ) -> Result<OpenStream> {
        let t = job.t;
        let req = PullReq {
            model: job.model.clone(),
            version: job.version,
            plan: t.plan_id,
            buckets: part.to_vec(),
            base: t.encoded_base,
        };
        let s = open_stream(
            t.source,
            job.token,
            me,
            t.target,
            PULL,
            &req,
            self.within(job.deadline, self.cfg.stream_timeout),
        )?;
        // reads wait as long as the config says: the watchdog enforces the deadline
        s.stream
            .set_read_timeout(Some(self.cfg.stream_timeout))
            .map_err(|e| Error::io("setting a pull stream's read timeout", e))?;
        if watchdog.register(&s.stream) {
            Ok(s)
        } else {
            Err(job.expired())
        }
    }

    /// Gives up a pull the watchdog expired: the version is no longer in flight, and the
    /// sender hears the pull failed.
    fn abandon(&self, model: &ModelId, lease: u64) {
        self.shared.set_inflight(model, None);
        // tell the sender without waiting on it: it may be the one that hangs
        if let Ok(ctl) = self.ctl() {
            // a short-lived thread: the report waits one stall window at most (a
            // sender that misses it frees the lease on its own timeout)
            let (ctl, agent, timeout) = (
                ctl.clone(),
                self.spec.agent,
                self.cfg.stall_timeout.min(self.cfg.call_timeout),
            );
            let d = Done {
                receiver: self.id,
                lease,
                ok: false,
                reason: "the pull timed out".into(),
            };
            std::thread::spawn(move || ctl.call::<_, ()>(agent, DONE, &d, timeout));
        }
    }

    /// A recycled arena for `job`, as a version in flight: a full transfer overwrites
    /// every byte (the verified plan covers the arena), a delta first copies the `kept`
    /// ranges from the base. True when the pool had none to recycle and the arena is a
    /// fresh map.
    fn arena_flight(
        &self,
        job: &Job<'_>,
        kept: &[std::ops::Range<usize>],
        base: &[u8],
    ) -> Result<(Arc<InFlight>, bool)> {
        let (model, version, manifest, plan, t) =
            (job.model, job.version, job.manifest, job.plan, job.t);
        let (buf, fresh) = self.shared.pool.take_marked(manifest.total_len());
        // only a large arena (a map of its own) is worth a prefault thread
        let fresh = fresh && buf.is_mapped();
        let mut ws = WeightSet::from_shared(
            model.clone(),
            version,
            Arc::clone(manifest),
            Arc::new(PooledBuf::new(buf, &self.shared.pool)),
        )?;
        let dst = ws.bytes_mut()?;
        if t.encoded_base.is_some() {
            // encoded buckets apply to the base's bytes: the whole version held first
            if dst.len() != base.len() {
                return Err(Error::transport(
                    NAME,
                    format!(
                        "model `{model}` version {version} is encoded against a base of {} \
                         bytes; the version held has {}",
                        dst.len(),
                        base.len()
                    ),
                ));
            }
            dst.copy_from_slice(base);
        } else {
            for r in kept {
                if let (Some(d), Some(s)) = (dst.get_mut(r.clone()), base.get(r.clone())) {
                    d.copy_from_slice(s);
                }
            }
        }
        let flight = InFlight::new(
            ws,
            Arc::clone(plan),
            t.plan_id,
            &t.buckets,
            self.cfg.stream_timeout,
        )?;
        Ok((Arc::new(flight), fresh))
    }
}

impl refit_runtime::WireMeter for Shared {
    fn landed(&self) -> u64 {
        self.pulled.load(Ordering::Relaxed)
    }

    fn on_wire(&self) -> u64 {
        self.wire.load(Ordering::Relaxed)
    }
}

impl ReceiverTransport for TcpReceiver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn meter(&self) -> Option<Arc<dyn refit_runtime::WireMeter>> {
        Some(Arc::clone(&self.shared) as Arc<dyn refit_runtime::WireMeter>)
    }

    fn connect(&mut self, deadline: Instant) -> Result<Manifests> {
        if self.closed {
            return Err(Error::State("tcp receiver is shut down"));
        }
        if self.node.is_none() {
            // refuse before binding: an unspecified address cannot be reached
            super::advertised("the tcp receiver", self.cfg.bind, self.cfg.advertise)?;
        }
        let node = match &self.node {
            Some(n) => n.clone(),
            None => {
                let token = ClusterToken::new(self.spec.token.clone())?;
                let n = Node::start(NodeConfig::loopback(token).with_bind(self.cfg.bind))?;
                self.node = Some(n.clone());
                self.owns_node = true;
                n
            }
        };
        self.register_handlers(&node);
        let remaining = || deadline.saturating_duration_since(Instant::now());
        let ctl = node.connect(self.spec.addr, remaining())?;
        let reg = Register {
            protocol: PROTOCOL_VERSION,
            receiver: self.me,
            node: super::advertised("the tcp receiver", node.advertised(), self.cfg.advertise)?,
            relay: self.cfg.relay && !self.streaming,
        };
        let registered: Registered = ctl.call(self.spec.agent, REGISTER, &reg, remaining())?;
        Error::check_protocol(
            format!("the tcp sender at {}", self.spec.addr),
            PROTOCOL_NAME,
            PROTOCOL_VERSION,
            registered.protocol,
        )?;
        self.id = registered.id;
        self.ctl = Some(ctl);
        let manifests = Manifests::new(
            registered
                .models
                .into_iter()
                .map(|(id, m)| (id, Arc::new(m))),
        )?;
        self.manifests = Some(manifests.clone());
        if self.sinks.is_none() && !self.streaming {
            // the first pull's arena, faulted in on a thread of its own from now on: while
            // the sender publishes (or announces) the version, not while its bytes arrive
            let steady = self.cfg.keep_versions.max(1) + 1;
            for (_, m) in manifests.iter() {
                self.shared.pool.warm_spare(m.total_len(), steady);
            }
        }
        self.shared.merge(&registered.latest);
        Ok(manifests)
    }

    fn next_group(&mut self, deadline: Instant) -> Result<Option<Group>> {
        loop {
            let Some(want) = self.pending(deadline)? else {
                return Ok(None);
            };
            let mut group: Group = Vec::with_capacity(want.len());
            let mut superseded = false;
            for (m, v) in &want {
                let wire = metrics::timed(Phase::Wire, NAME, m.as_str());
                match self.pull(m, *v, deadline, None)? {
                    Ok(Some(ws)) => {
                        wire.finish();
                        group.push(ws);
                    }
                    Ok(None) => return Err(Error::State("a whole pull landed nowhere")),
                    Err(latest) => {
                        self.superseded(m, *v, latest);
                        superseded = true;
                        break;
                    }
                }
            }
            if superseded {
                continue;
            }
            {
                let keep = self.cfg.keep_versions.max(1);
                let mut held = self.shared.held();
                for w in &group {
                    let q = held.entry(w.model().clone()).or_default();
                    q.push_back(Arc::clone(w));
                    while q.len() > keep {
                        q.pop_front();
                    }
                }
            }
            let mut ib = self.shared.inbox();
            for w in &group {
                if ib.pending.get(w.model()).is_some_and(|v| *v <= w.version()) {
                    ib.pending.remove(w.model());
                }
            }
            return Ok(Some(group));
        }
    }

    fn stream_next(
        &mut self,
        deadline: Instant,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
    ) -> Result<Option<Vec<(ModelId, Version)>>> {
        self.stream_versions(deadline, apply)
    }

    fn ack(&mut self, applied: &[(ModelId, Version)]) -> Result<()> {
        let req = AckReq {
            receiver: self.id,
            applied: applied.to_vec(),
        };
        let acked: Result<()> = self
            .ctl()?
            .call(self.spec.agent, ACK, &req, self.cfg.call_timeout)
            .map_err(Error::from);
        match acked {
            // The sender went away while the acknowledgement was on its way: a sender that
            // shuts down as soon as its last version is acknowledged closes its node before
            // the reply is written. The version is applied here either way, and nobody is
            // left to tell; the next receive reports the sender gone.
            Err(Error::PeerGone { .. }) => {
                tracing::debug!(
                    receiver = self.id,
                    "the sender left before acknowledging the ack"
                );
                Ok(())
            }
            other => other,
        }
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        if let Some(ctl) = self.ctl.take() {
            ctl.close();
        }
        if let Some(node) = self.node.take() {
            node.unregister(self.me);
            if self.owns_node {
                node.shutdown();
            }
        }
        Ok(())
    }
}

impl Drop for TcpReceiver {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::{TcpConfig, TcpSender};
    use refit_runtime::DType;

    #[test]
    fn connect_starts_making_the_first_pulls_arena() {
        let m = Manifest::builder()
            .tensor("w", DType::F32, &[1 << 20])
            .build()
            .unwrap();
        let ms = Manifests::new([(ModelId::new("policy").unwrap(), Arc::new(m))]).unwrap();
        let cfg = TcpConfig {
            token: Some(ClusterToken::random()),
            ..TcpConfig::default()
        };
        let sender = TcpSender::bind(cfg, &ms).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        // registered, before any version: its arena is on its way
        let mut r = TcpReceiver::new(sender.receiver_spec());
        r.connect(deadline).unwrap();
        assert_eq!(r.shared.pool.made(), 1);
        let (buf, fresh) = r.shared.pool.take_marked(4 << 20);
        assert_eq!(buf.len(), 4 << 20);
        assert!(buf.as_slice().iter().all(|&b| b == 0));
        assert_eq!(r.shared.pool.made(), 1, "the pull took the spare: {fresh}");
        // a receiver writing into sinks needs none
        let mut s = TcpReceiver::new(sender.receiver_spec()).with_sinks(|_, _, _| Ok(None));
        s.connect(deadline).unwrap();
        assert_eq!(s.shared.pool.made(), 0);
    }
}
