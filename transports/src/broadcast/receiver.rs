//! A receiver: joins the newest generation that lists it, runs the collective on its own
//! thread (prepare, bytes into the version being assembled, checksum, whole groups handed
//! over), acks through the store, and rejoins the next generation after a failure.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use refit_runtime::{
    BucketPlan, Error, Group, Manifest, Manifests, ModelId, ReceiverTransport, Result, Version,
    WeightSet, wire,
};

use super::messages::{self, Control, Prepare};
use super::{BroadcastConfig, BroadcastStats, Connector, check_member};
use crate::collective::{Communicator, Membership, Rendezvous};

/// Largest bucket a receiver accepts (a refused bucket's bytes still have to be consumed).
const MAX_BUCKET: usize = 1 << 30;

type Seqs = Arc<Mutex<HashMap<(ModelId, Version), u64>>>;

/// Called on the receiver's collective thread with every prepare message, before the
/// bucket's bytes are received (counting, progress, tests that kill a rank mid-broadcast).
pub type PrepareHook = Arc<dyn Fn(&Prepare) + Send + Sync>;

/// A receiving end of a broadcast scheme.
pub struct BroadcastReceiver<K: Connector> {
    member: String,
    config: BroadcastConfig,
    store: Arc<dyn Rendezvous>,
    connector: Option<K>,
    hook: Option<PrepareHook>,
    stats: Arc<BroadcastStats>,
    groups: Option<Receiver<Result<Group>>>,
    /// The publish number each delivered `(model, version)` came in (acks name it).
    seqs: Seqs,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// A node this end keeps running (the one its store client uses), dropped after it.
    keep: Option<refit_node::Node>,
}

impl<K: Connector> std::fmt::Debug for BroadcastReceiver<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BroadcastReceiver")
            .field("member", &self.member)
            .field("group", &self.config.group)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<K: Connector> BroadcastReceiver<K> {
    /// The receiver named `member` of `config.group`. Nothing is contacted before `connect`.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty name or one holding `/`.
    pub fn new(
        connector: K,
        store: Arc<dyn Rendezvous>,
        config: BroadcastConfig,
        member: impl Into<String>,
    ) -> Result<Self> {
        let member = member.into();
        check_member(&member)?;
        Ok(Self {
            member,
            config,
            store,
            connector: Some(connector),
            hook: None,
            stats: Arc::default(),
            groups: None,
            seqs: Arc::default(),
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
            keep: None,
        })
    }

    /// Calls `hook` with every prepare message, on the collective thread, before the bytes.
    #[must_use]
    pub fn with_prepare_hook(mut self, hook: PrepareHook) -> Self {
        self.hook = Some(hook);
        self
    }

    /// The counters (prepare messages received, bytes, generation, refusals).
    pub fn stats(&self) -> Arc<BroadcastStats> {
        Arc::clone(&self.stats)
    }

    /// This receiver's name.
    pub fn member(&self) -> &str {
        &self.member
    }

    /// Keeps `node` running as long as this end (the node its store client uses).
    #[must_use]
    pub fn keeping(mut self, node: refit_node::Node) -> Self {
        self.keep = Some(node);
        self
    }
}

/// The newest generation from `from` on that lists `member`: its membership.
fn join(
    cfg: &BroadcastConfig,
    store: &dyn Rendezvous,
    member: &str,
    mut generation: u64,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Membership> {
    let slice = Duration::from_millis(100);
    let started = Instant::now();
    loop {
        if stop.load(Ordering::Acquire) {
            return Err(Error::State("broadcast receiver is shut down"));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                what: format!(
                    "generation {generation} of broadcast group `{}` listing `{member}`",
                    cfg.group
                ),
                after: started.elapsed(),
            });
        }
        match store.wait_get(&cfg.members_key(generation), left.min(slice)) {
            Ok(raw) => {
                let members: Vec<String> = wire::decode(&raw, wire::MAX_CONTROL_MESSAGE)?;
                if let Some(i) = members.iter().position(|m| m == member) {
                    return Membership::new(
                        cfg.group.clone(),
                        generation,
                        i + 1,
                        members.len() + 1,
                    );
                }
                // not listed: wait for a later generation
                generation += 1;
            }
            Err(e) if e.is_timeout() => {}
            Err(e) => return Err(e),
        }
    }
}

/// Every model's manifest, as rank 0 announces them.
type ManifestList = Vec<(ModelId, Manifest)>;

/// Joins a generation and reads rank 0's hello (its protocol version, checked) and the
/// manifests.
fn enter<K: Connector>(
    connector: &mut K,
    cfg: &BroadcastConfig,
    store: &dyn Rendezvous,
    membership: Membership,
    deadline: Instant,
) -> Result<(K::Comm, ManifestList)> {
    let mut comm = connector.connect(membership, store, deadline)?;
    let refuse = |comm: &mut K::Comm, e: Error| {
        comm.abort(&e.to_string());
        Err(e)
    };
    let unexpected = |comm: &mut K::Comm, expected: &str, got: Option<Control>| {
        let got = match got {
            Some(Control::Hello { .. }) => "a second hello",
            Some(Control::Manifests(_)) => "the manifests",
            Some(Control::Prepare(_)) => "a prepare",
            Some(Control::Goodbye) => "the sender's goodbye",
            None => "a heartbeat",
        };
        let e = comm.membership().error(
            comm.backend(),
            format!("expected {expected} first, got {got}"),
        );
        refuse(comm, e)
    };
    // the sender's version first: one of another version is left, naming both (a sender of
    // before protocol versions opens with the manifests: version 0)
    let theirs = match messages::recv(&mut comm, deadline, deadline)? {
        Some(Control::Hello { protocol }) => protocol,
        Some(Control::Manifests(_)) => 0,
        other => return unexpected(&mut comm, "the hello", other),
    };
    let peer = format!(
        "rank 0 of broadcast group `{}` (generation {})",
        cfg.group,
        comm.membership().generation
    );
    if let Err(e) = Error::check_protocol(
        peer,
        messages::PROTOCOL_NAME,
        messages::PROTOCOL_VERSION,
        theirs,
    ) {
        return refuse(&mut comm, e);
    }
    match messages::recv(&mut comm, deadline, deadline)? {
        Some(Control::Manifests(m)) => Ok((comm, m)),
        other => unexpected(&mut comm, "the manifests", other),
    }
    .map_err(|e| {
        tracing::debug!(group = %cfg.group, "joining failed: {e}");
        e
    })
}

fn to_manifests(list: ManifestList) -> Result<Manifests> {
    Manifests::new(list.into_iter().map(|(id, m)| (id, Arc::new(m))))
}

/// The collective thread's state.
struct Worker<K: Connector> {
    connector: K,
    cfg: BroadcastConfig,
    store: Arc<dyn Rendezvous>,
    member: String,
    manifests: Manifests,
    hook: Option<PrepareHook>,
    stats: Arc<BroadcastStats>,
    out: Sender<Result<Group>>,
    seqs: Seqs,
    stop: Arc<AtomicBool>,
    plans: HashMap<(ModelId, u64), BucketPlan>,
    /// Newest version handed over per model (a regroup re-sends it; it is skipped).
    delivered: HashMap<ModelId, Version>,
    /// The last versions handed over per model: once the application dropped one (only
    /// this list holds it), its arena receives the next version instead of fresh memory.
    recent: HashMap<ModelId, Vec<Arc<WeightSet>>>,
}

/// Versions kept per model for their arenas (the one served, the one before, a spare).
const RECENT: usize = 3;

/// The group being assembled.
#[derive(Default)]
struct Assembly {
    done: Vec<Arc<WeightSet>>,
    current: Option<WeightSet>,
    entries: Vec<(ModelId, Version)>,
    seq: u64,
    refused: Option<Error>,
}

impl<K: Connector> Worker<K> {
    fn run(mut self, mut comm: K::Comm) {
        loop {
            let e = self.serve(&mut comm);
            comm.abort(&e.to_string());
            let generation = comm.membership().generation;
            drop(comm);
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            if self.out.send(Err(e)).is_err() {
                return;
            }
            // stay out until a later generation lists this receiver, then rejoin it
            comm = loop {
                let joined = join(
                    &self.cfg,
                    self.store.as_ref(),
                    &self.member,
                    generation + 1,
                    Instant::now() + Duration::from_secs(86400 * 365),
                    &self.stop,
                )
                .and_then(|m| {
                    let g = m.generation;
                    let deadline = Instant::now() + self.cfg.transfer_timeout;
                    let (comm, list) = enter(
                        &mut self.connector,
                        &self.cfg,
                        self.store.as_ref(),
                        m,
                        deadline,
                    )?;
                    self.manifests.check_agree(&to_manifests(list)?)?;
                    self.stats.generation.store(g, Ordering::Relaxed);
                    Ok(comm)
                });
                match joined {
                    Ok(c) => break c,
                    Err(_) if self.stop.load(Ordering::Acquire) => return,
                    Err(e) => {
                        if self.out.send(Err(e)).is_err() {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            };
        }
    }

    /// Serves one communicator until it fails (or the receiver stops): the error.
    fn serve(&mut self, comm: &mut K::Comm) -> Error {
        let mut asm = Assembly::default();
        loop {
            if self.stop.load(Ordering::Acquire) {
                return Error::State("broadcast receiver is shut down");
            }
            let now = Instant::now();
            let msg = match messages::recv(
                comm,
                now + self.cfg.idle_timeout,
                now + self.cfg.transfer_timeout,
            ) {
                Ok(m) => m,
                Err(e) => return e,
            };
            match msg {
                None => {}
                Some(Control::Manifests(_) | Control::Hello { .. }) => {
                    return comm.membership().error(
                        comm.backend(),
                        "manifests or a hello in the middle of a generation",
                    );
                }
                Some(Control::Prepare(p)) => {
                    if let Err(e) = self.bucket(comm, &mut asm, p) {
                        return e;
                    }
                }
                Some(Control::Goodbye) => {
                    return Error::PeerGone {
                        peer: format!("rank 0 of broadcast group `{}`", self.cfg.group),
                        reason: "the sender shut down".into(),
                    };
                }
            }
        }
    }

    /// One bucket: checks the prepare, receives the bytes (into the version being assembled,
    /// or dropped when refused), verifies them, hands the group over once whole. Errors only
    /// for communicator failures; a refused version is reported through the channel.
    fn bucket(&mut self, comm: &mut K::Comm, asm: &mut Assembly, p: Prepare) -> Result<()> {
        self.stats.prepares.fetch_add(1, Ordering::Relaxed);
        if let Some(hook) = &self.hook {
            hook(&p);
        }
        let first = p.model_index == 0 && p.header.index == 0;
        if first {
            *asm = Assembly {
                seq: p.seq,
                ..Assembly::default()
            };
        } else if p.seq != asm.seq && asm.refused.is_none() {
            asm.refused = Some(Error::Wire(format!(
                "bucket of publish {} inside publish {}",
                p.seq, asm.seq
            )));
        }
        let deadline = Instant::now() + self.cfg.transfer_timeout;
        let len = p.header.len;
        let checked = if asm.refused.is_some() {
            Err(None)
        } else {
            self.check(asm, &p).map_err(Some)
        };
        match checked {
            Ok(()) => {
                let ws = asm
                    .current
                    .as_mut()
                    .ok_or(Error::State("no version being assembled"))?;
                let range = p.header.start..p.header.start + len;
                let bytes = ws.bytes_mut()?;
                comm.broadcast_host(&mut bytes[range.clone()], 0, deadline)?;
                let manifest = Arc::clone(ws.manifest());
                let plan = &self.plans[&(p.model.clone(), p.bucket_size)];
                if let Err(e) = plan.check_checksum(&manifest, &p.header, &ws.bytes()[range]) {
                    asm.refused = Some(e);
                }
            }
            Err(reason) => {
                if len > MAX_BUCKET {
                    return Err(comm.membership().error(
                        comm.backend(),
                        format!("bucket of {len} bytes exceeds the {MAX_BUCKET}-byte limit"),
                    ));
                }
                let mut scratch = vec![0u8; len];
                comm.broadcast_host(&mut scratch, 0, deadline)?;
                if let Some(e) = reason {
                    asm.refused = Some(e);
                }
            }
        }
        self.stats.bytes.fetch_add(len as u64, Ordering::Relaxed);
        if !asm.entries.iter().any(|(m, _)| m == &p.model) {
            asm.entries.push((p.model.clone(), p.version));
        }
        let last_bucket = p.header.index + 1 == p.bucket_count as usize;
        if last_bucket
            && asm.refused.is_none()
            && let Some(ws) = asm.current.take()
        {
            asm.done.push(Arc::new(ws));
        }
        if last_bucket && p.model_index + 1 == p.model_count {
            self.hand_over(std::mem::take(asm));
        }
        Ok(())
    }

    /// Checks a prepare against the agreed manifest and the group being assembled; starts
    /// the model's staging version on its first bucket.
    fn check(&mut self, asm: &mut Assembly, p: &Prepare) -> Result<()> {
        let manifest = Arc::clone(self.manifests.get(&p.model)?);
        p.check(&manifest)?;
        let key = (p.model.clone(), p.bucket_size);
        if !self.plans.contains_key(&key) {
            let size = usize::try_from(p.bucket_size)
                .map_err(|_| Error::Wire("bucket size overflows".into()))?;
            let plan = BucketPlan::compute(&p.model, &manifest, &manifest, size)?;
            self.plans.insert(key.clone(), plan);
        }
        let plan = &self.plans[&key];
        plan.check_header(&p.header)?;
        if plan.len() != p.bucket_count as usize {
            return Err(Error::Bucket {
                index: p.header.index,
                reason: format!(
                    "the sender counts {} buckets, the plan has {}",
                    p.bucket_count,
                    plan.len()
                ),
            });
        }
        if p.header.version != p.version {
            return Err(Error::Bucket {
                index: p.header.index,
                reason: "header and prepare name different versions".into(),
            });
        }
        if p.header.index == 0 {
            if asm.current.is_some() || p.model_index as usize != asm.done.len() {
                return Err(Error::Wire(format!(
                    "model {} announced out of order in its group",
                    p.model
                )));
            }
            let mut ws = self
                .reusable(&p.model)
                .unwrap_or_else(|| WeightSet::zeroed(p.model.clone(), manifest));
            ws.set_version(p.version);
            asm.current = Some(ws);
        } else {
            let ok = asm
                .current
                .as_ref()
                .is_some_and(|w| w.model() == &p.model && w.version() == p.version);
            if !ok {
                return Err(Error::Bucket {
                    index: p.header.index,
                    reason: format!(
                        "of {} version {} arrived out of order",
                        p.model,
                        p.version.get()
                    ),
                });
            }
        }
        Ok(())
    }

    /// An arena of `model` that nobody but this receiver holds any more: every byte of it is
    /// overwritten by the next version's buckets (they cover the arena whole).
    fn reusable(&mut self, model: &ModelId) -> Option<WeightSet> {
        let recent = self.recent.get_mut(model)?;
        let i = recent.iter().position(|w| Arc::strong_count(w) == 1)?;
        Arc::try_unwrap(recent.remove(i)).ok()
    }

    fn hand_over(&mut self, asm: Assembly) {
        if let Some(e) = asm.refused {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            let why = format!("refused: {e}");
            for (model, version) in &asm.entries {
                let key = self.cfg.ack_key(&self.member, asm.seq, model, *version);
                if let Err(se) = self.store.set(&key, why.as_bytes()) {
                    tracing::warn!("could not report a refusal: {se}");
                }
            }
            let _ = self.out.send(Err(e));
            return;
        }
        let stale = asm.done.iter().all(|w| {
            self.delivered
                .get(w.model())
                .is_some_and(|v| *v >= w.version())
        });
        if stale {
            // a regroup re-sent what this receiver holds already: ack it under the new number
            for (model, version) in &asm.entries {
                let key = self.cfg.ack_key(&self.member, asm.seq, model, *version);
                if let Err(e) = self.store.set(&key, b"ok") {
                    tracing::warn!("could not ack a version held already: {e}");
                }
            }
            return;
        }
        {
            let mut seqs = self.seqs.lock().unwrap_or_else(|p| p.into_inner());
            for w in &asm.done {
                self.delivered.insert(w.model().clone(), w.version());
                seqs.insert((w.model().clone(), w.version()), asm.seq);
                let recent = self.recent.entry(w.model().clone()).or_default();
                recent.push(Arc::clone(w));
                if recent.len() > RECENT {
                    recent.remove(0);
                }
            }
        }
        let _ = self.out.send(Ok(asm.done));
    }
}

impl<K: Connector> ReceiverTransport for BroadcastReceiver<K> {
    fn name(&self) -> &'static str {
        "broadcast"
    }

    fn connect(&mut self, deadline: Instant) -> Result<Manifests> {
        let Some(mut connector) = self.connector.take() else {
            return Err(Error::State("broadcast receiver connected twice"));
        };
        let cfg = &self.config;
        let left = deadline.saturating_duration_since(Instant::now());
        let current = self.store.wait_get(&cfg.current_key(), left)?;
        let generation: u64 = std::str::from_utf8(&current)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                Error::Wire(format!(
                    "store key {} holds no generation",
                    cfg.current_key()
                ))
            })?;
        let m = join(
            cfg,
            self.store.as_ref(),
            &self.member,
            generation,
            deadline,
            &self.stop,
        )?;
        let g = m.generation;
        let (comm, list) = enter(&mut connector, cfg, self.store.as_ref(), m, deadline)?;
        let manifests = to_manifests(list)?;
        self.stats.generation.store(g, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        let worker = Worker {
            connector,
            cfg: self.config.clone(),
            store: Arc::clone(&self.store),
            member: self.member.clone(),
            manifests: manifests.clone(),
            hook: self.hook.clone(),
            stats: Arc::clone(&self.stats),
            out: tx,
            seqs: Arc::clone(&self.seqs),
            stop: Arc::clone(&self.stop),
            plans: HashMap::new(),
            delivered: HashMap::new(),
            recent: HashMap::new(),
        };
        self.thread = Some(
            std::thread::Builder::new()
                .name(format!("refit-bcast-{}", self.member))
                .spawn(move || worker.run(comm))
                .map_err(|e| Error::io("starting the broadcast receiver thread", e))?,
        );
        self.groups = Some(rx);
        Ok(manifests)
    }

    fn next_group(&mut self, deadline: Instant) -> Result<Option<Group>> {
        let Some(rx) = &self.groups else {
            return Err(Error::State("broadcast receiver is not connected"));
        };
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Ok(group)) => Ok(Some(group)),
            Ok(Err(e)) => Err(e),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(Error::PeerGone {
                peer: format!("broadcast group `{}`", self.config.group),
                reason: "the receiver's collective thread ended".into(),
            }),
        }
    }

    fn ack(&mut self, applied: &[(ModelId, Version)]) -> Result<()> {
        for (model, version) in applied {
            let seq = self
                .seqs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(model.clone(), *version))
                .ok_or_else(|| Error::Transport {
                    transport: "broadcast",
                    message: format!("{model} version {} was never received", version.get()),
                })?;
            self.store.set(
                &self.config.ack_key(&self.member, seq, model, *version),
                b"ok",
            )?;
        }
        Ok(())
    }

    fn shutdown(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Release);
        self.groups = None;
        if let Some(h) = self.thread.take() {
            let _ = h.join();
        }
        Ok(())
    }
}

impl<K: Connector> Drop for BroadcastReceiver<K> {
    fn drop(&mut self) {
        let _ = ReceiverTransport::shutdown(self);
    }
}
