//! Rank 0: publishes versions by broadcast, heartbeats while idle, waits for acks in the
//! store, and starts a new generation when the membership changes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use refit_runtime::{
    BucketPlan, Error, Group, ModelId, Result, SenderTransport, Version, protocol::entries,
};

use super::messages::{self, Control, Prepare};
use super::{BroadcastConfig, BroadcastStats, Connector, check_member};
use crate::collective::{Communicator, Membership, Rendezvous};

/// Rank 0's communicator, shared with the heartbeat thread.
#[derive(Debug)]
struct Link<C> {
    comm: Option<C>,
    /// Why the communicator failed, if it did (the first error).
    failed: Option<String>,
    last_use: Instant,
}

type Shared<C> = Arc<Mutex<Link<C>>>;

fn lock<C>(link: &Shared<C>) -> MutexGuard<'_, Link<C>> {
    // the link's fields stay consistent across a panic (plain assignments)
    link.lock().unwrap_or_else(|p| p.into_inner())
}

/// The sending end (rank 0) of a broadcast scheme.
#[derive(Debug)]
pub struct BroadcastSender<K: Connector> {
    connector: K,
    store: Arc<dyn Rendezvous>,
    config: BroadcastConfig,
    members: Vec<String>,
    generation: u64,
    link: Shared<K::Comm>,
    stop: Arc<AtomicBool>,
    heartbeat: Option<JoinHandle<()>>,
    manifests: Vec<(ModelId, refit_runtime::Manifest)>,
    plans: HashMap<(ModelId, u64), BucketPlan>,
    last: Option<Group>,
    /// Publish number of the last group broadcast, and the one each entry went out in.
    seq: u64,
    sent_in: HashMap<(ModelId, Version), u64>,
    stats: Arc<BroadcastStats>,
    /// A node this end keeps running (the one serving its store), dropped after it.
    keep: Option<refit_node::Node>,
    /// Test hook: buckets still to corrupt ([`BroadcastSender::inject_corruption`]).
    #[cfg(feature = "test-util")]
    corrupt: std::sync::atomic::AtomicU32,
}

impl<K: Connector> BroadcastSender<K> {
    /// Rank 0 of `config.group`, broadcasting to the named receivers (ranks 1.. in this
    /// order). Nothing is contacted before `connect`.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty or repeated member name, or one holding `/`.
    pub fn new(
        connector: K,
        store: Arc<dyn Rendezvous>,
        config: BroadcastConfig,
        members: Vec<String>,
    ) -> Result<Self> {
        check_members(&members)?;
        Ok(Self {
            connector,
            store,
            config,
            members,
            generation: 0,
            link: Arc::new(Mutex::new(Link {
                comm: None,
                failed: None,
                last_use: Instant::now(),
            })),
            stop: Arc::new(AtomicBool::new(false)),
            heartbeat: None,
            manifests: Vec::new(),
            plans: HashMap::new(),
            last: None,
            seq: 0,
            sent_in: HashMap::new(),
            stats: Arc::default(),
            keep: None,
            #[cfg(feature = "test-util")]
            corrupt: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// Test hook (feature `test-util`): flips one byte in each of the next `buckets` buckets
    /// this sender broadcasts, after their prepare message (which keeps the true checksum),
    /// as a faulty link or device would. Receivers must refuse the version whole.
    #[cfg(feature = "test-util")]
    pub fn inject_corruption(&self, buckets: u32) {
        self.corrupt.store(buckets, Ordering::Release);
    }

    /// The bytes that go out for a bucket: `bytes`, or with the test hook a damaged copy.
    #[cfg(feature = "test-util")]
    fn outgoing<'a>(&self, bytes: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        let take = |n: u32| n.checked_sub(1);
        if self
            .corrupt
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, take)
            .is_err()
        {
            return std::borrow::Cow::Borrowed(bytes);
        }
        let mut damaged = bytes.to_vec();
        if let Some(b) = damaged.get_mut(bytes.len() / 2) {
            *b ^= 0x40;
        }
        std::borrow::Cow::Owned(damaged)
    }

    #[cfg(not(feature = "test-util"))]
    fn outgoing<'a>(&self, bytes: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        std::borrow::Cow::Borrowed(bytes)
    }

    /// The counters (prepare messages sent, bytes, generation).
    pub fn stats(&self) -> Arc<BroadcastStats> {
        Arc::clone(&self.stats)
    }

    /// The receivers of the current generation.
    pub fn members(&self) -> &[String] {
        &self.members
    }

    /// The current membership generation (0 before `connect`).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Keeps `node` running as long as this end (the node serving or reaching its store).
    #[must_use]
    pub fn keeping(mut self, node: refit_node::Node) -> Self {
        self.keep = Some(node);
        self
    }

    /// Starts the next generation with `members` (receivers joining or leaving): the old
    /// communicator is dropped, the new one formed, and the newest version published so far
    /// broadcast again so joiners catch up (receivers that hold it already skip it). Returns
    /// the entries to wait for with [`SenderTransport::wait_acks`].
    ///
    /// # Errors
    /// As [`BroadcastSender::new`] for the names; [`Error::Timeout`] when a member does not
    /// join by `deadline`; transfer errors.
    pub fn regroup(
        &mut self,
        members: Vec<String>,
        deadline: Instant,
    ) -> Result<Vec<(ModelId, Version)>> {
        check_members(&members)?;
        if self.generation == 0 {
            return Err(Error::State("regroup before connect"));
        }
        self.members = members;
        self.form(deadline)?;
        match self.last.clone() {
            Some(group) => {
                self.publish_group(&group, deadline)?;
                Ok(entries(&group))
            }
            None => Ok(Vec::new()),
        }
    }

    /// Sets the receivers gauge of every model to `n`.
    fn count_receivers(&self, n: usize) {
        refit_runtime::metrics::receivers_connected(
            "broadcast",
            self.manifests.iter().map(|(m, _)| m.as_str()),
            n,
        );
    }

    /// Forms the next generation's communicator and sends it the manifests.
    fn form(&mut self, deadline: Instant) -> Result<()> {
        {
            let mut link = lock(&self.link);
            if let Some(mut old) = link.comm.take() {
                old.abort("a new generation starts");
            }
            link.failed = None;
        }
        self.generation += 1;
        let g = self.generation;
        let cfg = &self.config;
        self.store.set(
            &cfg.members_key(g),
            &refit_runtime::wire::encode(&self.members)?,
        )?;
        self.store
            .set(&cfg.current_key(), g.to_string().as_bytes())?;
        let membership = Membership::new(cfg.group.clone(), g, 0, self.members.len() + 1)?;
        let mut comm = self
            .connector
            .connect(membership, self.store.as_ref(), deadline)?;
        let hello = Control::Hello {
            protocol: messages::PROTOCOL_VERSION,
        };
        messages::send(&mut comm, &hello, deadline)?;
        messages::send(
            &mut comm,
            &Control::Manifests(self.manifests.clone()),
            deadline,
        )?;
        self.stats.generation.store(g, Ordering::Relaxed);
        self.count_receivers(self.members.len());
        let mut link = lock(&self.link);
        link.comm = Some(comm);
        link.last_use = Instant::now();
        drop(link);
        self.start_heartbeat();
        Ok(())
    }

    fn start_heartbeat(&mut self) {
        if self.heartbeat.is_some() {
            return;
        }
        let (link, stop) = (Arc::clone(&self.link), Arc::clone(&self.stop));
        let every = self.config.heartbeat;
        self.heartbeat = std::thread::Builder::new()
            .name("refit-bcast-heartbeat".into())
            .spawn(move || heartbeat_loop(&link, &stop, every))
            .ok();
    }

    fn publish_group(&mut self, group: &Group, deadline: Instant) -> Result<()> {
        let link = Arc::clone(&self.link);
        let mut link = lock(&link);
        if let Some(reason) = &link.failed {
            return Err(self.failed_error(reason));
        }
        let Some(comm) = link.comm.as_mut() else {
            return Err(Error::State("broadcast sender is not connected"));
        };
        let out = self.broadcast_group(comm, group, deadline);
        link.last_use = Instant::now();
        if let Err(e) = &out {
            if let Some(c) = link.comm.as_mut() {
                c.abort(&e.to_string());
            }
            link.failed = Some(e.to_string());
        }
        out
    }

    fn failed_error(&self, reason: &str) -> Error {
        Error::Collective {
            backend: "broadcast",
            group: self.config.group.clone(),
            generation: self.generation,
            rank: 0,
            reason: format!("the communicator failed ({reason}); regroup to go on"),
        }
    }

    fn broadcast_group(
        &mut self,
        comm: &mut K::Comm,
        group: &Group,
        deadline: Instant,
    ) -> Result<()> {
        let model_count = u32::try_from(group.len())
            .map_err(|_| Error::Config("too many models in one group".into()))?;
        self.seq += 1;
        let seq = self.seq;
        // acks are awaited for recent publishes only: forget those long past
        self.sent_in.retain(|_, s| *s + 1024 > seq);
        for w in group {
            self.sent_in.insert((w.model().clone(), w.version()), seq);
        }
        for (i, w) in group.iter().enumerate() {
            let m = w.manifest();
            let key = (w.model().clone(), m.schema_hash());
            if !self.plans.contains_key(&key) {
                let plan = BucketPlan::compute(w.model(), m, m, self.config.bucket_size)?;
                self.plans.insert(key.clone(), plan);
            }
            let plan = &self.plans[&key];
            if plan.is_empty() {
                return Err(Error::Transport {
                    transport: "broadcast",
                    message: format!("model {} has an empty arena", w.model()),
                });
            }
            for b in 0..plan.len() {
                let (prepare, bytes) = prepare(plan, w, b, (i as u32, model_count), seq)?;
                messages::send(comm, &Control::Prepare(prepare), deadline)?;
                self.stats.prepares.fetch_add(1, Ordering::Relaxed);
                comm.broadcast_send(&self.outgoing(bytes), deadline)?;
                self.stats
                    .bytes
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// The error of a communicator that failed since the last call, if any.
    fn link_failure(&self) -> Option<Error> {
        lock(&self.link)
            .failed
            .clone()
            .map(|r| self.failed_error(&r))
    }
}

/// The prepare message of bucket `b` of `w` (model `at.0` of `at.1` in publish `seq`), and
/// the bytes it announces.
pub(super) fn prepare<'a>(
    plan: &BucketPlan,
    w: &'a refit_runtime::WeightSet,
    b: usize,
    at: (u32, u32),
    seq: u64,
) -> Result<(Prepare, &'a [u8])> {
    let m = w.manifest();
    let bucket_count =
        u32::try_from(plan.len()).map_err(|_| Error::Config("too many buckets".into()))?;
    let (header, bytes) = plan.bucket(w, b)?;
    let touched: std::collections::BTreeSet<usize> =
        header.pieces.iter().map(|p| p.tensor).collect();
    let prepare = Prepare {
        model: w.model().clone(),
        version: w.version(),
        seq,
        model_index: at.0,
        model_count: at.1,
        bucket_count,
        bucket_size: plan.bucket_size as u64,
        schema_hash: m.schema_hash(),
        tensors: touched.iter().map(|&t| m.tensors()[t].clone()).collect(),
        header,
    };
    Ok((prepare, bytes))
}

fn check_members(members: &[String]) -> Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    for m in members {
        check_member(m)?;
        if !seen.insert(m) {
            return Err(Error::Config(format!(
                "broadcast member `{m}` is listed twice"
            )));
        }
    }
    Ok(())
}

fn heartbeat_loop<C: Communicator>(link: &Shared<C>, stop: &AtomicBool, every: Duration) {
    let tick = (every / 4).max(Duration::from_millis(5));
    while !stop.load(Ordering::Acquire) {
        std::thread::park_timeout(tick);
        if stop.load(Ordering::Acquire) {
            break;
        }
        // a publish holds the lock: it is proof of life already
        let Ok(mut l) = link.try_lock() else { continue };
        if l.failed.is_some() || l.last_use.elapsed() < every {
            continue;
        }
        let Some(comm) = l.comm.as_mut() else {
            continue;
        };
        let out = messages::heartbeat(comm, Instant::now() + every * 4);
        l.last_use = Instant::now();
        if let Err(e) = out {
            tracing::warn!("broadcast heartbeat failed: {e}");
            l.failed = Some(e.to_string());
        }
    }
}

impl<K: Connector> SenderTransport for BroadcastSender<K> {
    fn name(&self) -> &'static str {
        "broadcast"
    }

    fn connect(&mut self, initial: &Group, deadline: Instant) -> Result<()> {
        self.manifests = initial
            .iter()
            .map(|w| (w.model().clone(), (**w.manifest()).clone()))
            .collect();
        self.form(deadline)?;
        self.publish_group(initial, deadline)?;
        self.last = Some(initial.clone());
        Ok(())
    }

    fn publish(&mut self, group: &Group, deadline: Instant) -> Result<()> {
        self.publish_group(group, deadline)?;
        self.last = Some(group.clone());
        Ok(())
    }

    fn wait_acks(&mut self, entries: &[(ModelId, Version)], deadline: Instant) -> Result<()> {
        let started = Instant::now();
        let slice = Duration::from_millis(100);
        let mut late = Vec::new();
        for member in &self.members {
            for (model, version) in entries {
                let Some(seq) = self.sent_in.get(&(model.clone(), *version)) else {
                    return Err(Error::Transport {
                        transport: "broadcast",
                        message: format!("{model} version {} was never published", version.get()),
                    });
                };
                let key = self.config.ack_key(member, *seq, model, *version);
                loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match self.store.wait_get(&key, left.min(slice)) {
                        Ok(v) if v == b"ok" => break,
                        Ok(v) => {
                            return Err(Error::Transport {
                                transport: "broadcast",
                                message: format!(
                                    "receiver `{member}` refused {model} version {}: {}",
                                    version.get(),
                                    String::from_utf8_lossy(&v)
                                ),
                            });
                        }
                        Err(e) if e.is_timeout() => {
                            if let Some(failed) = self.link_failure() {
                                return Err(failed);
                            }
                            if left <= slice {
                                late.push(member.clone());
                                break;
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
                if late.last() == Some(member) {
                    break;
                }
            }
        }
        if late.is_empty() {
            return Ok(());
        }
        Err(Error::Timeout {
            what: format!(
                "acks of {entries:?} from broadcast receivers {late:?} of `{}`",
                self.config.group
            ),
            after: started.elapsed(),
        })
    }

    fn shutdown(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.heartbeat.take() {
            h.thread().unpark();
            let _ = h.join();
        }
        let mut link = lock(&self.link);
        if let Some(mut comm) = link.comm.take() {
            if link.failed.is_none() {
                // best effort: a receiver that misses it learns from its idle timeout
                let bye = Instant::now() + Duration::from_secs(1);
                if let Err(e) = messages::send(&mut comm, &Control::Goodbye, bye) {
                    tracing::debug!("broadcast goodbye not sent: {e}");
                }
            }
            comm.abort("the sender shut down");
        }
        link.failed = Some("the sender shut down".into());
        drop(link);
        self.count_receivers(0);
        Ok(())
    }
}

impl<K: Connector> Drop for BroadcastSender<K> {
    fn drop(&mut self) {
        let _ = SenderTransport::shutdown(self);
    }
}
