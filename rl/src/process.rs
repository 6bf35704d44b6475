//! Collector workers as separate processes.
//!
//! The parent spawns one process per worker (usually its own program, re-run with
//! arguments that say "worker"), hands each a receiver description for the weight scheme
//! (shared memory on one host, TCP across hosts), and talks to it through nodes, Refit's
//! one mechanism for calls between processes: the collector starts a
//! [`Node`](refit_node::Node) on loopback and tells each worker its address and the cluster
//! token in the worker's environment ([`COLLECTOR_ENV`], `REFIT_TOKEN`); the worker
//! connects and makes every message a call with a deadline (the three calls are described
//! at [`COLLECTOR_TARGET`]): it introduces itself, long-polls for how many batches it may
//! make, and delivers each batch (or its failure) as it is made. Weights never travel on
//! that connection, and the workers' standard input and output are left to them.
//!
//! - [`serve_worker`] is the child's loop: connect to the collector and the receiver
//!   (initial weights applied), then make the batches the collector asks for, polling for
//!   new weights before each.
//! - [`ProcessSyncCollector`] is the parent: every worker delivers one batch, the batch is
//!   their concatenation, workers wait for the next request. A worker that dies is
//!   reported at once (its connection closes), one that stays silent past the deadline
//!   when it passes ([`Error::WorkerGone`], naming it), never waited on forever.
//! - [`ProcessAsyncCollector`] is the asynchronous parent (TorchRL's
//!   `MultiaSyncDataCollector` with processes): workers collect continuously, a few batches
//!   ahead of the consumer; the parent yields whichever arrives first, with the worker's
//!   index and the policy version that produced it ([`WorkerBatch`]). A worker that dies is
//!   reported once, with its exit status, and the others go on.
//!
//! A worker whose collector dies ends on its own: its connection closes, and its next call
//! (at once when idle, after the batch it is making otherwise) fails. Calls to the
//! collector's node without the cluster token are refused by the node; calls that do not
//! decode, or that speak for a worker other than the caller's connection, are refused
//! and logged without disturbing the workers.
//!
//! Both parents take weights from an upstream [`WeightSource`] when one is attached and
//! forward each update to their workers' scheme (the cascade).
//!
//! Trajectory ids stay unique without shared state: worker `w` draws from the block
//! starting at `w * TRAJ_ID_BLOCK`.

mod parent;
mod protocol;
mod worker;

use std::collections::VecDeque;
use std::process::Command;
use std::time::{Duration, Instant};

use refit_node::{ClusterToken, TOKEN_ENV, TOKEN_FILE_ENV};
use refit_runtime::{
    Manifests, ModelId, PendingSend, ReceiverInit, ReceiverTransport, Sender, SenderInit,
    SenderTransport, Version, WeightSet,
};
use refit_transports::link::{self, LinkOptions, Reach, ReceiverSpec};

use crate::batch::Batch;
use crate::collector::{UpdatePolicyWeights, WeightSource, policy_model_id};
use crate::error::{Error, Result};
use crate::multi::cascade;

use parent::{Event, Workers};
pub use protocol::{COLLECTOR_TARGET, DELIVER, HELLO, POLL};
pub use worker::serve_worker;

/// The environment variable a worker process finds its collector's node in (its address),
/// set by the process collectors.
pub const COLLECTOR_ENV: &str = "REFIT_COLLECTOR_ADDR";
/// Largest batch a collector accepts from a worker (the largest frame of its node).
pub const MAX_BATCH_FRAME: usize = 256 << 20;
/// Width of each worker process's block of trajectory ids.
pub const TRAJ_ID_BLOCK: u64 = 1 << 40;

fn gone(worker: usize, reason: impl Into<String>) -> Error {
    Error::WorkerGone {
        worker,
        reason: reason.into(),
    }
}

// ANCHOR: worker_link
/// The environment variable a worker process finds its weight link in (a
/// [`ReceiverSpec::to_token`] text), set by [`WorkerLink::configure`].
pub const WORKER_LINK_ENV: &str = "REFIT_WORKER_LINK";

/// The weight link of worker processes, opened through the link factory: hand
/// [`WorkerLink::sender`] to a process collector's `spawn` and [`WorkerLink::configure`]
/// each worker's command; the worker connects with [`worker_receiver`].
pub struct WorkerLink {
    /// The sending end.
    pub sender: Box<dyn SenderTransport>,
    /// What the workers connect with.
    pub spec: ReceiverSpec,
    token: ClusterToken,
}

impl std::fmt::Debug for WorkerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerLink")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl WorkerLink {
    /// Opens the transport called `transport` (`shm`, `tcp`, `file`, ...) for the models of
    /// `initial`, waiting for `workers` receivers at connect. A transport with a cluster
    /// token uses the one of this process's environment (`REFIT_TOKEN`,
    /// `REFIT_TOKEN_FILE`), else a fresh random one.
    ///
    /// # Errors
    /// An unknown transport (the error names the known ones); one that cannot reach another
    /// process; a bad token in the environment; the transport's own setup errors.
    pub fn open(transport: &str, initial: &[WeightSet], workers: usize) -> Result<Self> {
        let factory = link::find(transport)?;
        if factory.reach() == Reach::Process {
            return Err(Error::Config(format!(
                "worker processes cannot receive weights over {} (it stays in one process)",
                factory.name()
            )));
        }
        let manifests = Manifests::new(
            initial
                .iter()
                .map(|w| (w.model().clone(), std::sync::Arc::clone(w.manifest()))),
        )?;
        let token = ClusterToken::from_env_or_random().map_err(refit_runtime::Error::from)?;
        let options = LinkOptions {
            expected_receivers: workers,
            token: Some(token.clone()),
            ..LinkOptions::default()
        };
        let opened = factory.open(&manifests, &options)?;
        if !opened.leftovers.is_empty() {
            tracing::debug!(leftovers = ?opened.leftovers, "the worker link leaves files behind its sender");
        }
        Ok(Self {
            sender: opened.sender,
            spec: opened.spec,
            token,
        })
    }

    /// Sets a worker's environment: the link ([`WORKER_LINK_ENV`]) and the cluster token
    /// (`REFIT_TOKEN`, never on the command line, which `ps` shows).
    ///
    /// # Errors
    /// A spec that cannot be encoded.
    pub fn configure(&self, cmd: &mut Command) -> Result<()> {
        cmd.env(WORKER_LINK_ENV, self.spec.to_token()?)
            .env(TOKEN_ENV, self.token.expose())
            .env_remove(TOKEN_FILE_ENV);
        Ok(())
    }
}

/// A worker's receiver from the link its parent set in its environment
/// ([`WorkerLink::configure`]): whatever the transport, made by the link factory.
///
/// # Errors
/// [`Error::Config`] when [`WORKER_LINK_ENV`] is not set; text that is not a spec; an
/// unknown transport; the transport's refusal.
pub fn worker_receiver() -> Result<ReceiverInit<Box<dyn ReceiverTransport>>> {
    let text = std::env::var(WORKER_LINK_ENV).map_err(|e| {
        Error::Config(format!(
            "{WORKER_LINK_ENV} does not hold a weight link ({e}): start workers through \
             WorkerLink::configure"
        ))
    })?;
    let spec = ReceiverSpec::from_token(&text)?;
    Ok(ReceiverInit::new(
        spec.receiver(&LinkOptions::default())?,
        None,
    ))
}
// ANCHOR_END: worker_link

/// Settings of a process collector.
#[derive(Clone, Debug)]
pub struct ProcessConfig {
    /// Stop after this many frames, all workers together (`None`: never).
    pub total_frames: Option<u64>,
    /// Deadline of the start: workers start, reach the collector and connect the scheme.
    pub connect_timeout: Duration,
    /// How long a worker may take to deliver one batch.
    pub batch_timeout: Duration,
    /// How long `send` waits for acknowledgements at connect.
    pub ack_timeout: Duration,
    /// The policy's model id.
    pub policy_id: ModelId,
    /// Asynchronous collector only: a worker runs at most `queue_depth + 1` batches ahead
    /// of the consumer (delivered and not yet taken), then waits for it; with the default
    /// 1, one batch waits while the worker makes the next.
    pub queue_depth: usize,
}

impl Default for ProcessConfig {
    fn default() -> Self {
        Self {
            total_frames: None,
            connect_timeout: Duration::from_secs(30),
            batch_timeout: Duration::from_secs(60),
            ack_timeout: Duration::from_secs(30),
            policy_id: policy_model_id(),
            queue_depth: 1,
        }
    }
}

/// The manifests a process collector's scheme agrees on: one per initial weight set, the
/// policy's among them; refused without workers.
fn worker_manifests(
    commands: &[Command],
    initial: &[WeightSet],
    policy: &ModelId,
) -> Result<Manifests> {
    if commands.is_empty() {
        return Err(Error::Config("a process collector needs workers".into()));
    }
    let manifests = Manifests::new(
        initial
            .iter()
            .map(|w| (w.model().clone(), std::sync::Arc::clone(w.manifest()))),
    )?;
    manifests.get(policy)?;
    Ok(manifests)
}

/// Starts the workers, connects their scheme (`initial` delivered and acknowledged by
/// every worker) and waits until every worker reached the collector's node.
fn start<T: SenderTransport>(
    sender: T,
    commands: Vec<Command>,
    initial: Vec<WeightSet>,
    config: &ProcessConfig,
) -> Result<(Workers, Sender<T>)> {
    let manifests = worker_manifests(&commands, &initial, &config.policy_id)?;
    let deadline = Instant::now() + config.connect_timeout;
    let mut workers = Workers::spawn(commands)?;
    let sender = SenderInit::new(sender, manifests)
        .with_ack_timeout(config.ack_timeout)
        .connect(initial, config.connect_timeout);
    let sender = match sender {
        Ok(s) => s,
        // a worker that failed or died says more than the rendezvous deadline
        Err(e) => return Err(workers.first_failure().unwrap_or_else(|| e.into())),
    };
    workers.await_hellos(deadline)?;
    Ok((workers, sender))
}

/// Every worker process delivers one batch; the concatenation is yielded; workers wait.
#[derive(Debug)]
pub struct ProcessSyncCollector<T: SenderTransport> {
    // first, so that dropping the collector stops the workers before the sender goes
    workers: Workers,
    sender: Option<Sender<T>>,
    config: ProcessConfig,
    pending: Option<PendingSend>,
    frames: u64,
    upstream: Upstream,
}

impl<T: SenderTransport> ProcessSyncCollector<T> {
    /// Spawns one process per command (told where the collector's node is and the cluster
    /// token, in their environment; their standard streams as the command sets them),
    /// connects the scheme (`sender` delivers `initial`) and returns once every worker
    /// applied the initial weights and reached the collector.
    ///
    /// The workers' cluster token is the one their commands carry (`REFIT_TOKEN`, as
    /// [`WorkerLink::configure`] sets it), else this process's, else a fresh one.
    ///
    /// # Errors
    /// [`Error::Config`] without workers or with commands carrying different tokens;
    /// [`Error::WorkerGone`] if a process cannot start, or exits or stays silent during the
    /// start; a worker's own failure ([`Error::Worker`]); the rendezvous deadline.
    pub fn spawn(
        sender: T,
        commands: Vec<Command>,
        initial: Vec<WeightSet>,
        config: ProcessConfig,
    ) -> Result<Self> {
        let (workers, sender) = start(sender, commands, initial, &config)?;
        Ok(Self {
            workers,
            sender: Some(sender),
            config,
            pending: None,
            frames: 0,
            upstream: Upstream(None),
        })
    }

    /// Asks every worker for a batch and yields their concatenation (worker order);
    /// `Ok(None)` once the frame budget is spent.
    ///
    /// # Errors
    /// [`Error::WorkerGone`] for a worker that died (at once: its connection closed, with
    /// its exit status) or missed the deadline, or that was reported before;
    /// [`Error::Worker`] for a worker's own collection error (the worker stops).
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        if self.config.total_frames.is_some_and(|t| self.frames >= t) {
            return Ok(None);
        }
        if let Some(w) = (0..self.workers.len()).find(|w| self.workers.is_dead(*w)) {
            return Err(gone(w, "it was reported gone or failed before"));
        }
        self.pull_upstream(false)?;
        let n = self.workers.len();
        let asked: Vec<u64> = (0..n).map(|w| self.workers.ask(w, 1)).collect();
        let deadline = Instant::now() + self.config.batch_timeout;
        let mut batches: Vec<Option<Batch>> = (0..n).map(|_| None).collect();
        while let Some(missing) = batches.iter().position(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.workers.next_event(left)? {
                // a batch of a round an error cut short is stale: dropped
                Some((w, Event::Batch { seq, batch })) if asked.get(w) == Some(&seq) => {
                    batches[w] = Some(batch);
                }
                Some((w, Event::Failed(e))) => return Err(self.workers.failed(w, e)),
                Some((w, Event::Gone)) if !self.workers.is_dead(w) => {
                    return Err(self.workers.gone(w));
                }
                Some(_) => {}
                None => {
                    return Err(gone(
                        missing,
                        format!("no batch within {:?}", self.config.batch_timeout),
                    ));
                }
            }
        }
        let batch = Batch::concat(batches.into_iter().flatten());
        self.frames += batch.frames as u64;
        Ok(Some(batch))
    }
}

/// The parts both process collectors share: their counters, sender and workers, the
/// upstream weight source (the cascade), stopping the workers when dropped, publishing
/// through their sender (without waiting: `$publish` says when the workers apply), and
/// iterating over batches.
macro_rules! process_collector_common {
    ($ty:ident, $publish:literal) => {
        impl<T: SenderTransport> $ty<T> {
            /// Frames delivered so far.
            pub fn frames(&self) -> u64 {
                self.frames
            }

            /// Process ids of the workers, in worker order.
            pub fn worker_pids(&self) -> Vec<u32> {
                self.workers.pids()
            }

            /// The address of the collector's node, which its workers call (loopback).
            pub fn addr(&self) -> std::net::SocketAddr {
                self.workers.addr()
            }

            /// Stops every worker (they finish the batch they are making; whoever is left
            /// after 5 s is killed), stops the collector's node and shuts the sender down.
            ///
            /// # Errors
            /// Sender shutdown errors.
            pub fn shutdown(mut self) -> Result<()> {
                self.workers.stop();
                match self.sender.take() {
                    Some(s) => Ok(s.shutdown()?),
                    None => Ok(()),
                }
            }

            /// The scheme's sender.
            pub fn sender(&self) -> Option<&Sender<T>> {
                self.sender.as_ref()
            }

            /// Takes weights from `source` (an upstream scheme's receiver) from now on:
            /// forwarded to the workers now if newer than theirs, then before each batch (the
            /// cascade).
            ///
            /// # Errors
            /// A group the workers' scheme refuses; [`Error::Closed`].
            pub fn attach_weight_source(&mut self, source: Box<dyn WeightSource>) -> Result<()> {
                self.upstream = Upstream(Some(source));
                self.pull_upstream(true)
            }

            fn pull_upstream(&mut self, initial: bool) -> Result<()> {
                let Some(source) = self.upstream.0.as_mut() else {
                    return Ok(());
                };
                let sender = self.sender.as_mut().ok_or(Error::Closed)?;
                if let Some(p) = cascade(source.as_mut(), sender, initial)? {
                    self.pending = Some(p);
                }
                Ok(())
            }
        }

        impl<T: SenderTransport> UpdatePolicyWeights for $ty<T> {
            fn policy_id(&self) -> &ModelId {
                &self.config.policy_id
            }

            fn version_of(&self, model: &ModelId) -> Version {
                self.sender
                    .as_ref()
                    .map_or(Version::ZERO, |s| s.version(model))
            }

            fn registered_policy_weights(&mut self) -> Result<WeightSet> {
                Err(Error::NoRegisteredPolicy)
            }

            #[doc = $publish]
            fn update_group(&mut self, group: Vec<WeightSet>) -> Result<()> {
                let sender = self.sender.as_mut().ok_or(Error::Closed)?;
                self.pending = Some(sender.send_async(group)?);
                Ok(())
            }
        }

        impl<T: SenderTransport> Iterator for $ty<T> {
            type Item = Result<Batch>;

            fn next(&mut self) -> Option<Self::Item> {
                self.next_batch().transpose()
            }
        }
    };
}

process_collector_common!(
    ProcessSyncCollector,
    "Publishes without waiting: workers poll before their next batch, which the next \
     `next_batch` asks for after the publication, so that batch uses the new weights."
);

/// An upstream weight source, if attached.
struct Upstream(Option<Box<dyn WeightSource>>);

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "attached" } else { "none" })
    }
}

/// One worker's batch, as a [`ProcessAsyncCollector`] yields it.
#[derive(Debug, Clone)]
pub struct WorkerBatch {
    /// The worker that collected it.
    pub worker: usize,
    /// The newest policy version that acted in it (the batch's transitions carry each
    /// step's version; see [`Batch::version_range`]).
    pub version: Version,
    /// The batch.
    pub batch: Batch,
}

/// Worker processes collect continuously and deliver their batches; the next batch is
/// whichever arrives first (TorchRL's `MultiaSyncDataCollector`, with processes). Each
/// worker runs at most [`ProcessConfig::queue_depth`]` + 1` batches ahead of the consumer.
/// Weights reach the workers through the scheme `sender` drives, each worker polling its
/// own receiver before every batch.
#[derive(Debug)]
pub struct ProcessAsyncCollector<T: SenderTransport> {
    // first, so that dropping the collector stops the workers before the sender goes
    workers: Workers,
    sender: Option<Sender<T>>,
    stash: VecDeque<WorkerBatch>,
    config: ProcessConfig,
    pending: Option<PendingSend>,
    frames: u64,
    upstream: Upstream,
}

impl<T: SenderTransport> ProcessAsyncCollector<T> {
    /// Spawns one process per command (as [`ProcessSyncCollector::spawn`] does), connects
    /// the scheme (`sender` delivers `initial`), then sets every worker collecting.
    ///
    /// # Errors
    /// As [`ProcessSyncCollector::spawn`].
    pub fn spawn(
        sender: T,
        commands: Vec<Command>,
        initial: Vec<WeightSet>,
        config: ProcessConfig,
    ) -> Result<Self> {
        let (workers, sender) = start(sender, commands, initial, &config)?;
        let ahead = config.queue_depth as u64 + 1;
        for w in 0..workers.len() {
            workers.ask(w, ahead);
        }
        Ok(Self {
            workers,
            sender: Some(sender),
            stash: VecDeque::new(),
            config,
            pending: None,
            frames: 0,
            upstream: Upstream(None),
        })
    }

    /// Indices of the workers not reported dead.
    pub fn live_workers(&self) -> Vec<usize> {
        self.workers.live()
    }

    /// Takes one message from the workers within `timeout`: `Ok(None)` on timeout or
    /// when it was not a batch of a live worker.
    fn recv(&mut self, timeout: Duration) -> Result<Option<WorkerBatch>> {
        match self.workers.next_event(timeout)? {
            Some((worker, Event::Batch { batch, .. })) if !self.workers.is_dead(worker) => {
                let version = batch.version_range().map_or(Version::ZERO, |(_, hi)| hi);
                Ok(Some(WorkerBatch {
                    worker,
                    version,
                    batch,
                }))
            }
            // reported once: the worker is then dead to this collector
            Some((w, Event::Failed(e))) if !self.workers.is_dead(w) => {
                Err(self.workers.failed(w, e))
            }
            Some((w, Event::Gone)) if !self.workers.is_dead(w) => Err(self.workers.gone(w)),
            _ => Ok(None),
        }
    }

    /// The next batch from whichever worker delivers first, with its worker index and
    /// policy version; `Ok(None)` once the frame budget is spent.
    ///
    /// # Errors
    /// [`Error::WorkerGone`] for a worker that died (once, with its exit status; the
    /// others keep collecting and later calls yield their batches), and when none is left;
    /// [`Error::Worker`] for a worker's own collection error (once; the worker stops);
    /// [`refit_runtime::Error::Timeout`] when no live worker delivers within
    /// [`ProcessConfig::batch_timeout`]; [`Error::Closed`].
    pub fn next_worker_batch(&mut self) -> Result<Option<WorkerBatch>> {
        if self.config.total_frames.is_some_and(|t| self.frames >= t) {
            return Ok(None);
        }
        self.pull_upstream(false)?;
        let b = match self.stash.pop_front() {
            Some(b) => b,
            None => self.await_batch()?,
        };
        // the consumer took one: the worker may make one more
        self.workers.ask(b.worker, 1);
        self.frames += b.batch.frames as u64;
        Ok(Some(b))
    }

    fn await_batch(&mut self) -> Result<WorkerBatch> {
        let deadline = Instant::now() + self.config.batch_timeout;
        loop {
            if self.workers.live().is_empty() {
                return Err(gone(
                    self.workers.len().saturating_sub(1),
                    "every worker is gone",
                ));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(b) = self.recv(left)? {
                return Ok(b);
            }
            if Instant::now() >= deadline {
                return Err(Error::Runtime(refit_runtime::Error::Timeout {
                    what: format!(
                        "a batch from any of the live workers {:?}",
                        self.live_workers()
                    ),
                    after: self.config.batch_timeout,
                }));
            }
        }
    }

    /// [`Self::next_worker_batch`]'s batch alone.
    ///
    /// # Errors
    /// As [`Self::next_worker_batch`].
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        Ok(self.next_worker_batch()?.map(|b| b.batch))
    }

    /// Waits until every worker applied the last published update (their acknowledgements).
    /// Batches that arrive meanwhile are kept and yielded first.
    ///
    /// # Errors
    /// [`refit_runtime::Error::Timeout`] naming the late receivers; a worker's death;
    /// [`Error::Closed`].
    pub fn wait_for_workers(&mut self, timeout: Duration) -> Result<()> {
        let Some(pending) = self.pending.take() else {
            return Ok(());
        };
        let start = Instant::now();
        loop {
            let slice = Duration::from_millis(5).min(timeout.saturating_sub(start.elapsed()));
            let sender = self.sender.as_mut().ok_or(Error::Closed)?;
            match sender.wait(&pending, slice) {
                Ok(()) => return Ok(()),
                Err(e) if e.is_timeout() && start.elapsed() < timeout => {}
                Err(e) => return Err(e.into()),
            }
            while let Some(b) = self.recv(Duration::ZERO)? {
                self.stash.push_back(b);
            }
        }
    }
}

process_collector_common!(
    ProcessAsyncCollector,
    "Publishes without waiting: each worker applies it before its next batch \
     ([`ProcessAsyncCollector::wait_for_workers`] waits for that)."
);
