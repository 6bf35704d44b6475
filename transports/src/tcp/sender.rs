//! The sender agent: serves the latest versions of one model set to registered receivers.
//!
//! Handlers (on the sender's node, addressed by the agent's uuid): `register`,
//! `request_transfer` (answers a transfer: which source to pull from, which buckets, the
//! tensors' checksums where they are known, and the bucket plan itself when the receiver
//! does not hold it yet),
//! `transfer_done` (the completion signal), `ack`, and the `pull` stream. Publishing calls
//! `_receive_weights_scheme` on every receiver.
//!
//! The bucket plan of each model is computed once, when the agent starts, from the model's
//! manifest and [`TcpConfig::bucket_size`]: receivers adopt the sender's manifests when they
//! register (the scheme checks them against the ones they expect), so one plan per model
//! serves every receiver and is replayed for every version.
//!
//! Publishing hashes nothing: a version is announced at once, and each bucket is hashed when
//! it is first served, its header declaring its pieces' checksums ([`Hashes`]); so the hash
//! overlaps the transfer. A delta needs every checksum of the version and of its base, so a
//! delta's request hashes what is missing first. A version a receiver holds was hashed
//! whole on its way (served whole, or compared for a delta), so a base's checksums are whole
//! after the sender lets its bytes go.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use refit_node::{CallInfo, ClusterToken, ConnId, Node, NodeConfig, Peer};
use refit_runtime::delta::BucketDelta;
use refit_runtime::metrics::{self, Phase};
use refit_runtime::wait::{Wait, wait_until};
use refit_runtime::{
    Ack, AckBook, BucketPlan, Error, Group, Manifests, ModelId, Result, SenderTransport, Version,
    WeightSet, wire,
};
use tokio::sync::watch;
use uuid::Uuid;

use super::data::{Hashes, Serve, ServeStats, Source, serve_pull};
use super::encoded::Encodings;
use super::messages::*;
use super::relay::{RelayBook, Src, Want};
use super::wait::wait_changes;
use super::{NAME, TcpConfig, TcpEndpoint, TcpReceiverSpec};

#[derive(Debug, Default)]
struct ModelSlot {
    versions: VecDeque<Arc<WeightSet>>,
    /// Checksums of recent versions (pieces and buckets, cut by the plan), hashed a bucket
    /// at a time as pulls ask for them. A version a receiver holds was hashed whole (served
    /// whole, or compared for a delta), so the checksums of any version that can be a delta
    /// base are whole, whether or not the sender still keeps its bytes.
    sums: VecDeque<(Version, Arc<Hashes>)>,
    /// The bucket plan (and its fingerprint) every version of the model travels by.
    plan: Option<(u64, Arc<BucketPlan>)>,
    /// Element-level encodings of recent versions against their bases, bucket by bucket,
    /// made as pulls ask for them (the newest few pairs).
    encodings: VecDeque<Arc<Encodings>>,
}

/// Pairs of versions whose encodings a model keeps.
const KEPT_ENCODINGS: usize = 4;

#[derive(Debug)]
struct Recv {
    uuid: Uuid,
    node: SocketAddr,
    conn: ConnId,
    peer: Option<Peer>,
}

#[derive(Debug)]
struct State {
    models: BTreeMap<ModelId, ModelSlot>,
    receivers: BTreeMap<u32, Recv>,
    next_id: u32,
    acks: AckBook,
    /// Which source serves which pull, and the leases (plain bookkeeping taking `now`).
    relays: RelayBook,
    closed: bool,
}

impl State {
    fn new(cfg: &TcpConfig) -> Self {
        Self {
            models: BTreeMap::new(),
            receivers: BTreeMap::new(),
            next_id: 0,
            acks: AckBook::default(),
            relays: RelayBook::new(cfg.relay, cfg.relay_fanout, cfg.transfer_timeout),
            closed: false,
        }
    }

    fn remove_receiver(&mut self, id: u32) {
        if self.receivers.remove(&id).is_none() {
            return;
        }
        self.acks.remove(id);
        self.relays.leave(id);
        self.count_receivers();
    }

    /// Sets the receivers gauge of every model served.
    fn count_receivers(&self) {
        metrics::receivers_connected(
            NAME,
            self.models.keys().map(ModelId::as_str),
            self.receivers.len(),
        );
    }
}

pub(crate) struct Agent {
    pub(crate) id: Uuid,
    addr: SocketAddr,
    cfg: TcpConfig,
    state: Mutex<State>,
    cv: Condvar,
    changed: watch::Sender<u64>,
    pub(crate) stats: ServeStats,
}

impl Agent {
    fn lock(&self) -> MutexGuard<'_, State> {
        // the state is plain bookkeeping; a panicking handler leaves it usable
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on the condition variable for at most `left` (the park of `wait_until`).
    fn park<'a>(&self, st: MutexGuard<'a, State>, left: Duration) -> MutexGuard<'a, State> {
        self.cv
            .wait_timeout(st, left)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }

    fn notify(&self) {
        self.cv.notify_all();
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The source of a pull of `version` of `model`, its buckets encoded against `base`
    /// when one is named (an error when it is no longer kept).
    fn find(
        &self,
        model: &ModelId,
        version: Version,
        base: Option<Version>,
    ) -> std::result::Result<Source, String> {
        let mut st = self.lock();
        // the version first: a pull of one no longer kept makes no encodings (which would
        // push out a pair still in use)
        let weights = st
            .models
            .get(model)
            .and_then(|s| s.versions.iter().find(|w| w.version() == version))
            .cloned()
            .ok_or_else(|| {
                format!("model `{model}` version {version} is not kept by the sender")
            })?;
        let encoded = match base {
            Some(b) => Some(encodings(&mut st, model, b, version)?),
            None => None,
        };
        let slot = st.models.get(model);
        let (plan_id, plan) = slot
            .and_then(|s| s.plan.clone())
            .ok_or_else(|| format!("model `{model}` has no bucket plan"))?;
        let sums = slot
            .and_then(|s| s.sums.iter().find(|(v, _)| *v == version))
            .map(|s| Arc::clone(&s.1))
            .ok_or_else(|| format!("the checksums of `{model}` version {version} are gone"))?;
        Ok(Source {
            weights,
            plan,
            plan_id,
            sums,
            encoded,
        })
    }

    /// What a delta of `req` needs hashed and is not yet: every bucket of the version asked
    /// for and of the base the receiver holds, with their bytes (where the sender keeps
    /// them). Nothing for a request that cannot become a delta: an unregistered receiver,
    /// another mode, no base, a base whose checksums are gone or were cut by another plan.
    fn delta_todo(&self, req: &TransferReq) -> Vec<(Arc<Hashes>, Arc<WeightSet>)> {
        let (TransferMode::Delta | TransferMode::Elements, Some(have)) = (req.mode, req.have)
        else {
            return Vec::new();
        };
        let st = self.lock();
        if !st.receivers.contains_key(&req.receiver) {
            return Vec::new();
        }
        let Some(slot) = st.models.get(&req.model) else {
            return Vec::new();
        };
        let plan_id = slot.plan.as_ref().map(|p| p.0);
        let hashes = |v: Version| {
            slot.sums
                .iter()
                .find(|(sv, _)| *sv == v)
                .map(|h| Arc::clone(&h.1))
                .filter(|h| Some(h.plan_id()) == plan_id)
        };
        let bytes = |v: Version| slot.versions.iter().find(|w| w.version() == v).cloned();
        let (Some(new), Some(base)) = (hashes(req.version), hashes(have)) else {
            return Vec::new();
        };
        [(new, req.version), (base, have)]
            .into_iter()
            .filter(|(h, _)| h.whole().is_none())
            .filter_map(|(h, v)| Some((h, bytes(v)?)))
            .collect()
    }

    /// One attempt at a plan; `None` means "wait for a source to free up".
    fn plan(&self, st: &mut State, req: &TransferReq) -> Option<Result<TransferReply>> {
        let Some(slot) = st.models.get_mut(&req.model) else {
            return Some(Err(Error::UnknownModel(req.model.clone())));
        };
        if !slot.versions.iter().any(|w| w.version() == req.version) {
            let latest = slot.versions.back().map_or(Version::ZERO, |w| w.version());
            return Some(Ok(TransferReply::Superseded { latest }));
        }
        let Some((plan_id, bucket_plan)) = slot.plan.clone() else {
            return Some(Err(Error::State("a model without a bucket plan")));
        };
        let Some(entry) = slot.sums.iter_mut().find(|(v, _)| *v == req.version) else {
            return Some(Err(Error::State("checksums of a kept version are missing")));
        };
        if entry.1.plan_id() != plan_id {
            // the plan was replaced since publish (a test hook): cut the sums anew
            entry.1 = Arc::new(Hashes::new(Arc::clone(&bucket_plan), plan_id));
        }
        // the version's checksums where every bucket is hashed (a delta's request hashed
        // them); else each bucket's header declares its own
        let sums = entry.1.whole();
        let sums_of = |v: Version| {
            slot.sums
                .iter()
                .find(|(sv, _)| *sv == v)
                .and_then(|s| s.1.whole())
        };
        // a delta moves the buckets holding a byte of a changed tensor, whole
        let base = match (req.mode, req.have, &sums) {
            (TransferMode::Delta | TransferMode::Elements, Some(have), Some(new)) => {
                sums_of(have).filter(|b| b.plan_id == new.plan_id)
            }
            _ => None,
        };
        let new_pieces = sums.as_ref().map_or(&[][..], |s| s.pieces.as_slice());
        let delta = BucketDelta::plan(
            &bucket_plan,
            base.as_ref().map(|b| b.pieces.as_slice()),
            new_pieces,
        );
        // element-level deltas, from the sender only, against a version it still keeps
        let keeps = |v: Version| slot.versions.iter().any(|w| w.version() == v);
        let encode_against = match (req.mode, req.have) {
            (TransferMode::Elements, Some(have)) if !delta.full && keeps(have) => Some(have),
            _ => None,
        };
        let buckets: Vec<u32> = delta
            .buckets
            .iter()
            .filter_map(|&i| u32::try_from(i).ok())
            .collect();
        let full = delta.full;
        let want = Want {
            receiver: req.receiver,
            model: &req.model,
            version: req.version,
            buckets: &buckets,
            relay_in_flight: req.relay_in_flight,
        };
        let (lease, source) = st.relays.grant(want, Instant::now())?;
        let (addr, target) = match source {
            Src::Sender => (self.addr, self.id),
            Src::Receiver(r) => match st.receivers.get(&r) {
                Some(rc) => (rc.node, rc.uuid),
                None => {
                    st.relays.release(lease);
                    return None;
                }
            },
        };
        Some(Ok(TransferReply::Plan(Plan {
            lease,
            source: addr,
            target,
            from_sender: source == Src::Sender,
            plan_id,
            bucket_plan: (req.plan != Some(plan_id)).then(|| (*bucket_plan).clone()),
            buckets,
            full,
            checksums: new_pieces.to_vec(),
            encoded_base: encode_against.filter(|_| source == Src::Sender),
        })))
    }
}

/// The encodings of `version` of `model` against `base`, kept in the model's slot (made
/// empty now unless a pull made them already); an error when the base is no longer kept
/// (the caller found `version`).
fn encodings(
    st: &mut State,
    model: &ModelId,
    base: Version,
    version: Version,
) -> std::result::Result<Arc<Encodings>, String> {
    let slot = st
        .models
        .get_mut(model)
        .ok_or_else(|| format!("model `{model}` is not served"))?;
    if let Some(e) = slot.encodings.iter().find(|e| e.is(base, version)) {
        return Ok(Arc::clone(e));
    }
    let base_ws = slot
        .versions
        .iter()
        .find(|w| w.version() == base)
        .cloned()
        .ok_or_else(|| {
            format!(
                "model `{model}` version {base}, the delta's base, is no longer kept by the sender"
            )
        })?;
    let buckets = slot.plan.as_ref().map_or(0, |p| p.1.len());
    let e = Arc::new(Encodings::new(base_ws, version, buckets));
    slot.encodings.push_back(Arc::clone(&e));
    while slot.encodings.len() > KEPT_ENCODINGS {
        slot.encodings.pop_front();
    }
    Ok(e)
}

/// The sending end: a sender agent on a node.
pub struct TcpSender {
    agent: Arc<Agent>,
    node: Node,
    owns_node: bool,
    token: ClusterToken,
    closed: bool,
}

impl std::fmt::Debug for TcpSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpSender")
            .field("agent", &self.agent.id)
            .field("addr", &self.agent.addr)
            .field("closed", &self.closed)
            .finish()
    }
}

impl TcpSender {
    /// Starts a node of its own (on `config.bind`, loopback by default) and a sender agent
    /// on it. Local only: nobody is contacted.
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound; [`refit_node::Error::Unauthorized`]
    /// (inside [`Error::Node`]) for a bad `REFIT_TOKEN`.
    pub fn bind(config: TcpConfig, manifests: &Manifests) -> Result<Self> {
        super::advertised("the tcp sender", config.bind, config.advertise)?;
        let token = match &config.token {
            Some(t) => t.clone(),
            None => ClusterToken::from_env_or_random()?,
        };
        let node = Node::start(NodeConfig::loopback(token).with_bind(config.bind))?;
        let mut s = Self::on_node(&node, config, manifests)?;
        s.owns_node = true;
        Ok(s)
    }

    /// A sender agent on an existing node (which may host other handlers, a store, other
    /// agents). `config.bind` and `config.token` are ignored: the node's are used.
    ///
    /// # Errors
    /// [`Error::State`] for an empty model set; [`Error::Bucket`] when
    /// [`TcpConfig::bucket_size`] is zero or not a multiple of [`refit_runtime::ALIGN`].
    pub fn on_node(node: &Node, config: TcpConfig, manifests: &Manifests) -> Result<Self> {
        if manifests.is_empty() {
            return Err(Error::State("a tcp sender needs at least one model"));
        }
        let mut plans = Vec::with_capacity(manifests.len());
        for (id, m) in manifests.iter() {
            let plan = BucketPlan::compute(id, m, m, config.bucket_size)?;
            plans.push((id.clone(), plan.fingerprint()?, Arc::new(plan)));
        }
        let addr = super::advertised("the tcp sender", node.advertised(), config.advertise)?;
        let (changed, _) = watch::channel(0);
        let state = Mutex::new(State::new(&config));
        let agent = Arc::new(Agent {
            id: Uuid::new_v4(),
            addr,
            cfg: config,
            state,
            cv: Condvar::new(),
            changed,
            stats: ServeStats::default(),
        });
        {
            let mut st = agent.lock();
            for (id, plan_id, plan) in plans {
                let slot = ModelSlot {
                    plan: Some((plan_id, plan)),
                    ..ModelSlot::default()
                };
                st.models.insert(id, slot);
            }
            st.count_receivers();
        }
        register_handlers(node, &agent, manifests.clone());
        Ok(Self {
            agent,
            node: node.clone(),
            owns_node: false,
            token: node.token().clone(),
            closed: false,
        })
    }

    /// Where the agent is, without the token: what to print, store or ship to receivers,
    /// who add their own token with [`TcpReceiverSpec::new`].
    pub fn endpoint(&self) -> TcpEndpoint {
        TcpEndpoint {
            addr: self.agent.addr,
            agent: self.agent.id,
        }
    }

    /// What a receiver needs to attach. Holds the cluster token: treat it as a secret (ship
    /// [`TcpSender::endpoint`] instead).
    pub fn receiver_spec(&self) -> TcpReceiverSpec {
        TcpReceiverSpec {
            addr: self.agent.addr,
            agent: self.agent.id,
            token: self.token.expose().to_owned(),
        }
    }

    /// The address receivers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.agent.addr
    }

    /// The node the agent runs on.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// Receivers registered now.
    pub fn receivers(&self) -> usize {
        self.agent.lock().receivers.len()
    }

    /// Bytes of weights this sender has written on its data streams (relayed bytes are not
    /// counted here).
    pub fn bytes_sent(&self) -> u64 {
        self.agent.stats.bytes.load(Ordering::Relaxed)
    }

    /// The bucket plan `model` travels by (computed once from its manifest and
    /// [`TcpConfig::bucket_size`]); `None` for a model this sender does not serve.
    pub fn bucket_plan(&self, model: &ModelId) -> Option<Arc<BucketPlan>> {
        self.agent
            .lock()
            .models
            .get(model)
            .and_then(|s| s.plan.as_ref().map(|p| Arc::clone(&p.1)))
    }

    /// Test hook (feature `test-util`): replaces the plan this sender ships and serves
    /// `plan.model` by, as a forged or buggy sender would. Receivers must refuse a plan that
    /// does not fit their manifest.
    ///
    /// # Errors
    /// [`Error::UnknownModel`] when the sender does not serve the plan's model; wire errors.
    #[cfg(feature = "test-util")]
    pub fn replace_bucket_plan(&self, plan: BucketPlan) -> Result<()> {
        let id = plan.fingerprint()?;
        let mut st = self.agent.lock();
        let slot = st
            .models
            .get_mut(&plan.model)
            .ok_or_else(|| Error::UnknownModel(plan.model.clone()))?;
        slot.plan = Some((id, Arc::new(plan)));
        Ok(())
    }

    /// Test hook (feature `test-util`): flips one byte in each of the next `chunks` chunks
    /// (1 MiB) this sender serves, as a faulty network or disk would. Receivers must catch
    /// it by checksum.
    #[cfg(feature = "test-util")]
    pub fn inject_corruption(&self, chunks: u32) {
        self.agent
            .stats
            .corrupt_chunks
            .store(chunks, Ordering::Release);
    }

    fn announce(
        &self,
        entries: Vec<(ModelId, Version)>,
        closing: bool,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let targets: Vec<(u32, Uuid, SocketAddr, Option<Peer>)> = self
            .agent
            .lock()
            .receivers
            .iter()
            .map(|(id, r)| (*id, r.uuid, r.node, r.peer.clone()))
            .collect();
        let timeout = self.agent.cfg.call_timeout;
        let mut tasks = Vec::with_capacity(targets.len());
        for (id, uuid, addr, peer) in targets {
            let agent = Arc::clone(&self.agent);
            let node = self.node.clone();
            let msg = Announce {
                entries: entries.clone(),
                closing,
            };
            tasks.push(self.node.handle().spawn(async move {
                let peer = match peer.filter(|p| !p.is_closed()) {
                    Some(p) => Ok(p),
                    None => node.connect_async(addr, timeout).await,
                };
                drop(node);
                let result = match peer {
                    Ok(p) => {
                        if let Some(r) = agent.lock().receivers.get_mut(&id) {
                            r.peer = Some(p.clone());
                        }
                        p.call_async::<_, ()>(uuid, RECEIVE_WEIGHTS, &msg, timeout)
                            .await
                    }
                    Err(e) => Err(e),
                };
                if let Err(e) = result {
                    if closing {
                        return;
                    }
                    tracing::warn!(receiver = id, error = %e, "announcement failed; dropping the receiver");
                    if matches!(
                        e,
                        refit_node::Error::Core(Error::PeerGone { .. } | Error::Io { .. })
                            | refit_node::Error::Unauthorized { .. }
                    ) {
                        agent.lock().remove_receiver(id);
                        agent.notify();
                    }
                }
            }));
        }
        tasks
    }
}

/// A delta compares checksums: what `r` needs is hashed first, off the state's lock, within
/// half the time left before `deadline` (left unfinished, the plan sends every byte, and the
/// other half is for that plan to reach the receiver before it stops waiting).
async fn hash_for_delta(a: &Agent, r: &TransferReq, deadline: tokio::time::Instant) {
    let todo = a.delta_todo(r);
    if todo.is_empty() {
        return;
    }
    let now = tokio::time::Instant::now();
    let by = now + deadline.saturating_duration_since(now) / 2;
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let hashing = tokio::task::spawn_blocking(move || {
        for (h, ws) in todo {
            h.complete(&ws, threads);
        }
    });
    let _ = tokio::time::timeout_at(by, hashing).await;
}

fn register_handlers(node: &Node, agent: &Arc<Agent>, manifests: Manifests) {
    let target = agent.id;
    let a = Arc::clone(agent);
    node.register(target, REGISTER, move |info: CallInfo, r: Register| {
        let a = Arc::clone(&a);
        let models: Vec<_> = manifests
            .iter()
            .map(|(id, m)| (id.clone(), (**m).clone()))
            .collect();
        async move {
            // a receiver of another version is refused before it joins the book
            Error::check_protocol(
                format!("the tcp receiver at {}", r.node),
                PROTOCOL_NAME,
                PROTOCOL_VERSION,
                r.protocol,
            )?;
            let mut st = a.lock();
            if st.closed {
                return Err(Error::State("the tcp sender is shut down"));
            }
            let id = st.next_id;
            st.next_id += 1;
            st.acks.register(id);
            st.receivers.insert(
                id,
                Recv {
                    uuid: r.receiver,
                    node: r.node,
                    conn: info.conn,
                    peer: None,
                },
            );
            st.relays.join(id, r.relay);
            st.count_receivers();
            let latest = st
                .models
                .iter()
                .filter_map(|(m, s)| s.versions.back().map(|w| (m.clone(), w.version())))
                .collect();
            drop(st);
            a.notify();
            tracing::debug!(receiver = id, node = %r.node, "receiver registered");
            Ok(Registered {
                protocol: PROTOCOL_VERSION,
                id,
                models,
                latest,
            })
        }
    });
    let a = Arc::clone(agent);
    node.register(target, TRANSFER, move |info: CallInfo, r: TransferReq| {
        let a = Arc::clone(&a);
        async move {
            let deadline = tokio::time::Instant::from_std(info.deadline);
            hash_for_delta(&a, &r, deadline).await;
            let rx = a.changed.subscribe();
            // re-plan on every change; wake now and then too, for leases that expire
            let arm = || {
                let mut next = rx.clone();
                next.borrow_and_update();
                async move {
                    let _ = next.changed().await;
                }
            };
            let plan = || {
                let mut st = a.lock();
                if !st.receivers.contains_key(&r.receiver) {
                    return Err(Error::State("unknown receiver: register first"));
                }
                a.plan(&mut st, &r).transpose()
            };
            wait_changes(deadline, Some(Duration::from_millis(200)), arm, plan)
                .await?
                .ok_or_else(|| Error::Timeout {
                    what: format!("a free source for `{}` version {}", r.model, r.version),
                    after: Duration::ZERO,
                })
        }
    });
    let a = Arc::clone(agent);
    node.register(target, DONE, move |_, d: Done| {
        let a = Arc::clone(&a);
        async move {
            let mut st = a.lock();
            if let Some(l) = st.relays.done(d.lease, d.ok) {
                if d.ok {
                    metrics::record(Phase::Wire, NAME, l.model.as_str(), l.granted.elapsed());
                } else {
                    // a relay that failed is no longer offered this version (the book's rule)
                    tracing::warn!(receiver = d.receiver, reason = %d.reason, "transfer failed");
                }
            }
            drop(st);
            a.notify();
            Ok::<_, Error>(())
        }
    });
    let a = Arc::clone(agent);
    node.register(target, ACK, move |_, r: AckReq| {
        let a = Arc::clone(&a);
        async move {
            let mut st = a.lock();
            if st.receivers.contains_key(&r.receiver) {
                st.acks.record(&Ack {
                    receiver: r.receiver,
                    applied: r.applied,
                });
            }
            drop(st);
            a.notify();
            Ok::<_, Error>(())
        }
    });
    let a = Arc::clone(agent);
    node.register_stream(target, PULL, move |_, bytes, stream| {
        let a = Arc::clone(&a);
        Box::pin(async move {
            let req: PullReq = wire::decode(&bytes, wire::MAX_CONTROL_MESSAGE)?;
            let ws = a.find(&req.model, req.version, req.base).map(Serve::Whole);
            Ok(serve_pull(stream, ws, req, &a.stats).await?)
        })
    });
    let a = Arc::downgrade(agent);
    node.on_disconnect(move |conn| {
        let Some(a) = a.upgrade() else { return };
        let mut st = a.lock();
        let gone: Vec<u32> = st
            .receivers
            .iter()
            .filter(|(_, r)| r.conn == conn)
            .map(|(id, _)| *id)
            .collect();
        for id in &gone {
            tracing::info!(receiver = id, "receiver disconnected");
            st.remove_receiver(*id);
        }
        drop(st);
        if !gone.is_empty() {
            a.notify();
        }
    });
}

impl SenderTransport for TcpSender {
    fn name(&self) -> &'static str {
        NAME
    }

    fn connect(&mut self, initial: &Group, deadline: Instant) -> Result<()> {
        let agent = &self.agent;
        let want = agent.cfg.expected_receivers;
        wait_until(
            deadline,
            agent.lock(),
            |st| {
                let n = st.receivers.len();
                Ok(if n >= want {
                    Wait::Done(())
                } else {
                    Wait::Pending(n)
                })
            },
            |st, left| agent.park(st, left),
            |n| {
                format!(
                    "{want} tcp receivers to register at {} ({n} did)",
                    agent.addr
                )
            },
        )?;
        self.publish(initial, deadline)
    }

    fn publish(&mut self, group: &Group, _deadline: Instant) -> Result<()> {
        if self.closed {
            return Err(Error::State("tcp sender is shut down"));
        }
        // nothing is hashed here: each bucket is, when first served
        let plans: Vec<Option<(u64, Arc<BucketPlan>)>> = {
            let st = self.agent.lock();
            group
                .iter()
                .map(|w| st.models.get(w.model()).and_then(|s| s.plan.clone()))
                .collect()
        };
        let sums: Vec<Arc<Hashes>> = group
            .iter()
            .zip(plans)
            .map(|(w, plan)| {
                let (id, plan) = plan.ok_or_else(|| Error::UnknownModel(w.model().clone()))?;
                Ok(Arc::new(Hashes::new(plan, id)))
            })
            .collect::<Result<_>>()?;
        let keep = self.agent.cfg.keep_versions.max(1);
        let mut retired = Vec::new();
        {
            let history = self.agent.cfg.checksum_history.max(keep);
            let mut st = self.agent.lock();
            for (w, s) in group.iter().zip(sums) {
                let slot = st.models.entry(w.model().clone()).or_default();
                slot.versions.push_back(Arc::clone(w));
                while slot.versions.len() > keep {
                    retired.extend(slot.versions.pop_front());
                }
                // encodings of or against a retired version go with it (they hold the
                // base's arena and can be served no more)
                let kept = |v: Version| slot.versions.iter().any(|w| w.version() == v);
                slot.encodings
                    .retain(|e| kept(e.base_version()) && kept(e.version()));
                slot.sums.push_back((w.version(), s));
                while slot.sums.len() > history {
                    slot.sums.pop_front();
                }
            }
        }
        self.agent.notify();
        let entries = group
            .iter()
            .map(|w| (w.model().clone(), w.version()))
            .collect();
        drop(self.announce(entries, false));
        // a retired version may be the last owner of its arena: unmapping hundreds of MiB
        // takes tens of milliseconds, which publish need not wait for; rayon's pool drops
        // it, so publishing starts no thread
        if !retired.is_empty() {
            rayon::spawn(move || drop(retired));
        }
        Ok(())
    }

    fn wait_acks(&mut self, entries: &[(ModelId, Version)], deadline: Instant) -> Result<()> {
        let agent = &self.agent;
        wait_until(
            deadline,
            agent.lock(),
            |st| Ok(st.acks.awaiting(entries)),
            |st, left| agent.park(st, left),
            |missing| format!("tcp receivers {missing:?} to acknowledge {entries:?}"),
        )
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.agent.lock().closed = true;
        if !self.owns_node {
            // receivers on a shared node would not see the connection drop: tell them
            let tasks = self.announce(Vec::new(), true);
            let node = self.node.clone();
            let _ = node.block_on(async move {
                let all = async {
                    for t in tasks {
                        let _ = t.await;
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(1), all).await;
                Ok(())
            });
        }
        self.node.unregister(self.agent.id);
        {
            let mut st = self.agent.lock();
            st.receivers.clear();
            st.count_receivers();
            st.models.clear();
        }
        self.agent.notify();
        if self.owns_node {
            self.node.shutdown();
        }
        Ok(())
    }
}

impl Drop for TcpSender {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
