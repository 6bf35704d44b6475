//! Multi-worker collectors on worker threads, fed with weights through a refit scheme.
//!
//! Each worker owns a [`Collector`] and a scheme [`Receiver`](refit_runtime::Receiver); the
//! collector object owns the [`Sender`]. Before every batch a worker polls its receiver with a
//! zero timeout and applies new weights through its strategy ([`run_worker`]), so weights
//! travel exactly as they would to another process: swap the transport, keep the loop.
//!
//! - [`MultiSyncCollector`]: every worker collects one batch, the batches are concatenated
//!   (worker order) and yielded; workers then wait for the next request.
//! - [`MultiAsyncCollector`]: workers collect continuously; batches are yielded as they
//!   arrive (one worker's batch each); each worker has at most `queue_depth` batches queued
//!   ahead of the consumer (its own [`Backlog`] count, so a fast worker cannot take the
//!   queue from a slow one).
//!
//! The cascade (TorchRL's two-level `update_policy_weights_`): a multi-collector given an
//! upstream [`WeightSource`] (`attach_weight_source`, e.g. the receiving end of a trainer's
//! scheme in another process) forwards every update it receives to its workers' own scheme
//! before the next batch, so one push at the top lands in every worker below.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use refit_runtime::protocol::Manifests;
use refit_runtime::{
    HasWeights, ModelId, PendingSend, ReceiverInit, ReceiverTransport, Sender, SenderInit,
    SenderTransport, Version, WeightSet,
};

use crate::batch::{Batch, TrajPool};
use crate::collector::{
    Collector, UpdatePolicyWeights, WeightSource, policy_model_id, registered_source,
};
use crate::env::Env;
use crate::error::{Error, Result};
use crate::policy::Policy;

/// How a worker hands its batches over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerMode {
    /// One batch per [`WorkerCommand::Collect`], then wait.
    Sync,
    /// Collect continuously until stopped.
    Async,
}

/// What the collector tells a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerCommand {
    /// Collect one batch (sync mode).
    Collect,
    /// Stop after the current batch.
    Stop,
}

/// What a worker sends back.
#[derive(Debug)]
pub enum WorkerMessage {
    /// A batch.
    Batch {
        /// Worker index.
        worker: usize,
        /// The batch.
        batch: Batch,
    },
    /// The worker failed and stopped.
    Failed {
        /// Worker index.
        worker: usize,
        /// Why.
        error: Error,
    },
}

/// A worker's channels to its collector.
#[derive(Debug)]
pub struct WorkerLink {
    /// Worker index.
    pub worker: usize,
    /// Sync or async.
    pub mode: WorkerMode,
    /// Requests from the collector.
    pub commands: mpsc::Receiver<WorkerCommand>,
    /// Batches and failures to the collector.
    pub out: mpsc::SyncSender<WorkerMessage>,
    /// Raised when the collector shuts down.
    pub stop: Arc<AtomicBool>,
    /// Deadline of the scheme rendez-vous.
    pub connect_timeout: Duration,
    /// Batches each worker has queued ahead of the consumer; a worker waits for room in
    /// its own count before it sends.
    pub backlog: Arc<Backlog>,
}

/// Per-worker counts of batches sent but not yet taken by the consumer, each bounded by
/// one depth.
///
/// One shared bounded channel is not enough: when it is full, a worker that is running
/// refills a freed slot before a woken one is scheduled, so on a busy machine one worker
/// can hold the whole queue for hundreds of batches while another waits with its batch
/// (made by an old version) in hand. With a count per worker, a worker only ever waits
/// for the consumer to take its own batches.
#[derive(Debug)]
pub struct Backlog {
    queued: Mutex<Vec<usize>>,
    taken: Condvar,
    depth: usize,
}

impl Backlog {
    /// Counts for `workers` workers, each allowed `depth` (at least 1) queued batches.
    #[must_use]
    pub fn new(workers: usize, depth: usize) -> Self {
        Self {
            queued: Mutex::new(vec![0; workers]),
            taken: Condvar::new(),
            depth: depth.max(1),
        }
    }

    /// Waits until `worker` has room, then counts one more batch queued for it. Answers
    /// `false` (nothing counted) once `stop` is raised: it blocks, looking at `stop` at
    /// least every 50 ms.
    pub fn reserve(&self, worker: usize, stop: &AtomicBool) -> bool {
        let mut queued = self.queued.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if stop.load(Ordering::Acquire) {
                return false;
            }
            match queued.get_mut(worker) {
                None => return true, // a worker the counts do not know is not held back
                Some(n) if *n < self.depth => {
                    *n += 1;
                    return true;
                }
                Some(_) => {}
            }
            queued = self
                .taken
                .wait_timeout(queued, Duration::from_millis(50))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// The consumer took one of `worker`'s batches.
    pub fn release(&self, worker: usize) {
        let mut queued = self.queued.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = queued.get_mut(worker) {
            *n = n.saturating_sub(1);
        }
        drop(queued);
        self.taken.notify_all();
    }

    /// Wakes every waiting worker (shutdown).
    fn wake_all(&self) {
        self.taken.notify_all();
    }
}

/// The worker loop, generic over the receiving transport: connect the receiver (initial
/// weights applied), then collect batches, each preceded by a zero-timeout `receive` whose
/// weights are applied through the collector's strategy. Failures are reported on
/// `link.out` before the function returns.
pub fn run_worker<E, P, T>(
    mut collector: Collector<E, P>,
    receiver: ReceiverInit<T>,
    link: WorkerLink,
) where
    E: Env,
    P: Policy,
    T: ReceiverTransport + 'static,
{
    let worker = link.worker;
    if let Err(error) = worker_body(&mut collector, receiver, &link) {
        let _ = link.out.send(WorkerMessage::Failed { worker, error });
    }
}

fn worker_body<E, P, T>(
    collector: &mut Collector<E, P>,
    receiver: ReceiverInit<T>,
    link: &WorkerLink,
) -> Result<()>
where
    E: Env,
    P: Policy,
    T: ReceiverTransport + 'static,
{
    let worker = link.worker;
    let receiver = receiver.connect(link.connect_timeout)?;
    collector.attach_weight_source(Box::new(receiver))?;
    loop {
        match link.mode {
            WorkerMode::Sync => match link.commands.recv() {
                Ok(WorkerCommand::Collect) => {}
                Ok(WorkerCommand::Stop) | Err(_) => return Ok(()),
            },
            WorkerMode::Async => {
                if link.stop.load(Ordering::Acquire)
                    || matches!(link.commands.try_recv(), Ok(WorkerCommand::Stop))
                {
                    return Ok(());
                }
            }
        }
        let Some(batch) = collector.next_batch()? else {
            return Ok(());
        };
        if !link.backlog.reserve(worker, &link.stop) {
            return Ok(()); // the collector is shutting down
        }
        let msg = WorkerMessage::Batch { worker, batch };
        if link.out.send(msg).is_err() {
            return Ok(()); // the collector is gone
        }
    }
}

/// Forwards what `source` has that `sender` has not published yet: the source's initial
/// weights when `initial` (the versions newer than the sender's), else one poll. Answers the
/// publication, if any.
pub(crate) fn cascade<T: SenderTransport>(
    source: &mut dyn WeightSource,
    sender: &mut Sender<T>,
    initial: bool,
) -> Result<Option<PendingSend>> {
    let group = if initial {
        let fresh: Vec<Arc<WeightSet>> = source
            .initial()
            .into_iter()
            .filter(|w| w.version() > sender.version(w.model()))
            .collect();
        (!fresh.is_empty()).then_some(fresh)
    } else {
        source.poll()?
    };
    match group {
        Some(g) => Ok(Some(sender.publish_shared(g)?)),
        None => Ok(None),
    }
}

/// Settings shared by the multi-worker collectors.
#[derive(Clone, Debug)]
pub struct MultiConfig {
    /// Stop after this many frames, all workers together (`None`: never).
    pub total_frames: Option<u64>,
    /// Deadline of the scheme rendez-vous (default 30 s).
    pub connect_timeout: Duration,
    /// How long `send` waits for acknowledgements (default 30 s).
    pub ack_timeout: Duration,
    /// The policy's model id (default `"policy"`).
    pub policy_id: ModelId,
    /// Async only: batches a worker may have queued ahead of the consumer (default 1).
    pub queue_depth: usize,
    /// How long `next_batch` waits for a live worker's batch before reporting it hung, and
    /// how long shutdown waits for a worker thread to end (default 60 s).
    pub batch_timeout: Duration,
}

impl Default for MultiConfig {
    fn default() -> Self {
        Self {
            total_frames: None,
            connect_timeout: Duration::from_secs(30),
            ack_timeout: Duration::from_secs(30),
            policy_id: policy_model_id(),
            queue_depth: 1,
            batch_timeout: Duration::from_secs(60),
        }
    }
}

type Registered = Box<dyn Fn(&ModelId) -> Result<WeightSet> + Send>;

struct Core<T: SenderTransport> {
    sender: Option<Sender<T>>,
    handles: Vec<Option<JoinHandle<()>>>,
    commands: Vec<mpsc::Sender<WorkerCommand>>,
    out: Option<mpsc::Receiver<WorkerMessage>>,
    stop: Arc<AtomicBool>,
    backlog: Arc<Backlog>,
    policy_id: ModelId,
    registered: Option<Registered>,
    upstream: Option<Box<dyn WeightSource>>,
    pending: Option<PendingSend>,
    frames: u64,
    total_frames: Option<u64>,
    traj_pool: TrajPool,
    stash: VecDeque<(usize, Batch)>,
    closed: bool,
    batch_timeout: Duration,
}

impl<T: SenderTransport> fmt::Debug for Core<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiCollector")
            .field("workers", &self.handles.len())
            .field("policy_id", &self.policy_id)
            .field("frames", &self.frames)
            .field("total_frames", &self.total_frames)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl<T: SenderTransport> Core<T> {
    fn spawn<E, P, R>(
        sender: T,
        workers: Vec<(Collector<E, P>, R)>,
        initial: Vec<WeightSet>,
        config: MultiConfig,
        mode: WorkerMode,
    ) -> Result<Self>
    where
        E: Env + 'static,
        P: Policy + 'static,
        R: ReceiverTransport + 'static,
    {
        if workers.is_empty() {
            return Err(Error::Config(
                "a multi-worker collector needs workers".into(),
            ));
        }
        let manifests = Manifests::new(
            initial
                .iter()
                .map(|w| (w.model().clone(), Arc::clone(w.manifest()))),
        )?;
        manifests.get(&config.policy_id)?;
        let n = workers.len();
        let depth = match mode {
            WorkerMode::Sync => 1,
            WorkerMode::Async => config.queue_depth.max(1),
        };
        let backlog = Arc::new(Backlog::new(n, depth));
        // the backlog bounds what is queued; a failure message has its own room
        let (out_tx, out_rx) = mpsc::sync_channel(n * (depth + 1));
        let stop = Arc::new(AtomicBool::new(false));
        let traj_pool = TrajPool::new();
        let mut core = Self {
            sender: None,
            handles: Vec::with_capacity(n),
            commands: Vec::with_capacity(n),
            out: Some(out_rx),
            stop: Arc::clone(&stop),
            backlog: Arc::clone(&backlog),
            policy_id: config.policy_id.clone(),
            registered: None,
            upstream: None,
            pending: None,
            frames: 0,
            total_frames: config.total_frames,
            traj_pool: traj_pool.clone(),
            stash: VecDeque::new(),
            closed: false,
            batch_timeout: config.batch_timeout,
        };
        for (worker, (mut collector, transport)) in workers.into_iter().enumerate() {
            collector.set_traj_pool(traj_pool.clone())?;
            collector.set_worker(worker);
            collector.set_total_frames(None);
            let (cmd_tx, cmd_rx) = mpsc::channel();
            let link = WorkerLink {
                worker,
                mode,
                commands: cmd_rx,
                out: out_tx.clone(),
                stop: Arc::clone(&stop),
                connect_timeout: config.connect_timeout,
                backlog: Arc::clone(&backlog),
            };
            let receiver = ReceiverInit::new(transport, Some(manifests.clone()));
            let handle = std::thread::Builder::new()
                .name(format!("refit-collector-{worker}"))
                .spawn(move || run_worker(collector, receiver, link))
                .map_err(|e| Error::WorkerGone {
                    worker,
                    reason: format!("thread could not start: {e}"),
                })?;
            core.handles.push(Some(handle));
            core.commands.push(cmd_tx);
        }
        drop(out_tx);
        let connected = SenderInit::new(sender, manifests)
            .with_ack_timeout(config.ack_timeout)
            .connect(initial, config.connect_timeout);
        match connected {
            Ok(s) => core.sender = Some(s),
            Err(e) => {
                // A worker's own failure explains more than the sender's timeout.
                let worker_error = core.out.as_ref().and_then(|rx| match rx.try_recv() {
                    Ok(WorkerMessage::Failed { worker, error }) => Some(Error::Worker {
                        worker,
                        source: Box::new(error),
                    }),
                    _ => None,
                });
                let _ = core.shutdown();
                return Err(worker_error.unwrap_or(Error::Runtime(e)));
            }
        }
        Ok(core)
    }

    fn budget_spent(&self) -> bool {
        self.total_frames.is_some_and(|t| self.frames >= t)
    }

    /// The next worker message, within `batch_timeout`: a worker whose thread lives but
    /// sends nothing (a hung environment or policy) is reported as a timeout naming
    /// `waiting` (the workers still awaited).
    fn recv(&mut self, waiting: &dyn Fn() -> String) -> Result<(usize, Batch)> {
        if let Some(b) = self.stash.pop_front() {
            return Ok(b);
        }
        let out = self.out.as_ref().ok_or(Error::Closed)?;
        let started = Instant::now();
        loop {
            let left = self.batch_timeout.saturating_sub(started.elapsed());
            let msg = match out.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => {
                    let gone = self
                        .handles
                        .iter()
                        .position(|h| h.as_ref().is_none_or(JoinHandle::is_finished));
                    let Some(worker) = gone else {
                        if started.elapsed() >= self.batch_timeout {
                            return Err(Error::Runtime(refit_runtime::Error::Timeout {
                                what: format!(
                                    "a batch from {} (the thread lives but sends nothing)",
                                    waiting()
                                ),
                                after: started.elapsed(),
                            }));
                        }
                        continue;
                    };
                    // A message sent just before the thread ended is already queued.
                    match out.try_recv() {
                        Ok(m) => m,
                        Err(_) => {
                            return Err(Error::WorkerGone {
                                worker,
                                reason: "its thread ended (panic or early exit)".into(),
                            });
                        }
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::WorkerGone {
                        worker: 0,
                        reason: "every worker ended".into(),
                    });
                }
            };
            return match msg {
                WorkerMessage::Batch { worker, batch } => {
                    self.backlog.release(worker);
                    Ok((worker, batch))
                }
                WorkerMessage::Failed { worker, error } => Err(Error::Worker {
                    worker,
                    source: Box::new(error),
                }),
            };
        }
    }

    fn sender_mut(&mut self) -> Result<&mut Sender<T>> {
        self.sender.as_mut().ok_or(Error::Closed)
    }

    /// Forwards an update waiting upstream to the workers (the cascade).
    fn pull_upstream(&mut self, initial: bool) -> Result<()> {
        let Some(mut source) = self.upstream.take() else {
            return Ok(());
        };
        let sent = match self.sender.as_mut() {
            Some(sender) => cascade(source.as_mut(), sender, initial),
            None => Err(Error::Closed),
        };
        self.upstream = Some(source);
        if let Some(p) = sent? {
            self.pending = Some(p);
        }
        Ok(())
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.stop.store(true, Ordering::Release);
        self.backlog.wake_all();
        for c in self.commands.drain(..) {
            let _ = c.send(WorkerCommand::Stop);
        }
        // Workers blocked on a full queue see the consumer gone and stop.
        drop(self.out.take());
        let mut first_error = None;
        // A hung worker is left behind (detached) after the deadline rather than joined
        // forever.
        let deadline = Instant::now() + self.batch_timeout;
        for (worker, h) in self.handles.iter_mut().enumerate() {
            let Some(h) = h.take() else { continue };
            while !h.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            let error = if !h.is_finished() {
                Some(Error::WorkerGone {
                    worker,
                    reason: format!(
                        "its thread did not stop within {:?} (left running)",
                        self.batch_timeout
                    ),
                })
            } else if h.join().is_err() {
                Some(Error::WorkerGone {
                    worker,
                    reason: "its thread panicked".into(),
                })
            } else {
                None
            };
            if first_error.is_none() {
                first_error = error;
            }
        }
        if let Some(s) = self.sender.take()
            && let Err(e) = s.shutdown()
        {
            first_error.get_or_insert(Error::Runtime(e));
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl<T: SenderTransport> Drop for Core<T> {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

macro_rules! common_methods {
    ($name:ident) => {
        impl<T: SenderTransport> $name<T> {
            /// Number of workers.
            pub fn num_workers(&self) -> usize {
                self.core.handles.len()
            }

            /// Frames yielded so far.
            pub fn frames(&self) -> u64 {
                self.core.frames
            }

            /// The trajectory-id pool every worker draws from.
            pub fn traj_pool(&self) -> &TrajPool {
                &self.core.traj_pool
            }

            /// The scheme's sender (versions in force, transport).
            pub fn sender(&self) -> Option<&Sender<T>> {
                self.core.sender.as_ref()
            }

            /// The last published update, if its acknowledgements were not awaited yet.
            pub fn pending_update(&self) -> Option<&PendingSend> {
                self.core.pending.as_ref()
            }

            /// Registers the model `update_policy_weights()` pulls weights from.
            pub fn register_policy<M: HasWeights + Send + 'static>(
                &mut self,
                model: Arc<Mutex<M>>,
            ) {
                self.core.registered = Some(registered_source(model));
            }

            /// Takes weights from `source` (an upstream scheme's receiver) from now on: its
            /// weights in force are forwarded to the workers now if newer than theirs, and
            /// every update it receives is forwarded to the workers' scheme before the
            /// next batch (the cascade).
            ///
            /// # Errors
            /// A group the workers' scheme refuses (unknown model, wrong manifest, stale
            /// version); [`Error::Closed`].
            pub fn attach_weight_source(&mut self, source: Box<dyn WeightSource>) -> Result<()> {
                self.core.upstream = Some(source);
                self.core.pull_upstream(true)
            }

            /// Stops every worker, joins the threads and shuts the sender down.
            ///
            /// # Errors
            /// [`Error::WorkerGone`] for a worker thread that panicked, or that did not stop
            /// within [`MultiConfig::batch_timeout`] (it is left running); sender shutdown
            /// errors.
            pub fn shutdown(mut self) -> Result<()> {
                self.core.shutdown()
            }
        }

        impl<T: SenderTransport> UpdatePolicyWeights for $name<T> {
            fn policy_id(&self) -> &ModelId {
                &self.core.policy_id
            }

            fn version_of(&self, model: &ModelId) -> Version {
                self.core
                    .sender
                    .as_ref()
                    .map_or(Version::ZERO, |s| s.version(model))
            }

            fn registered_policy_weights(&mut self) -> Result<WeightSet> {
                match &self.core.registered {
                    Some(f) => f(&self.core.policy_id),
                    None => Err(Error::NoRegisteredPolicy),
                }
            }

            /// Publishes without waiting: workers apply it before their next batch (the
            /// async collector's `wait_for_workers` waits for that).
            fn update_group(&mut self, group: Vec<WeightSet>) -> Result<()> {
                let pending = self.core.sender_mut()?.send_async(group)?;
                self.core.pending = Some(pending);
                Ok(())
            }
        }

        impl<T: SenderTransport> Iterator for $name<T> {
            type Item = Result<Batch>;

            fn next(&mut self) -> Option<Self::Item> {
                self.next_batch().transpose()
            }
        }
    };
}

/// All workers deliver one batch each; the concatenation is yielded; workers wait.
#[derive(Debug)]
pub struct MultiSyncCollector<T: SenderTransport> {
    core: Core<T>,
}

impl<T: SenderTransport> MultiSyncCollector<T> {
    /// Starts one thread per `(collector, receiving transport)` pair, connects the scheme
    /// (`sender` delivers `initial`, one weight set per model, version >= 1) and returns
    /// once every worker applied the initial weights. Workers share one trajectory pool.
    ///
    /// # Errors
    /// [`Error::Config`] without workers; manifest errors; a worker's connect failure or a
    /// rendez-vous timeout.
    pub fn spawn<E, P, R>(
        sender: T,
        workers: Vec<(Collector<E, P>, R)>,
        initial: Vec<WeightSet>,
        config: MultiConfig,
    ) -> Result<Self>
    where
        E: Env + 'static,
        P: Policy + 'static,
        R: ReceiverTransport + 'static,
    {
        Ok(Self {
            core: Core::spawn(sender, workers, initial, config, WorkerMode::Sync)?,
        })
    }

    /// Asks every worker for a batch and yields their concatenation (worker order).
    /// `Ok(None)` once the frame budget is spent.
    ///
    /// Workers poll for weights before collecting, so an update published before this call
    /// is in force for the whole batch (its acknowledgements arrive as workers start).
    ///
    /// # Errors
    /// A worker's failure ([`Error::Worker`]) or death ([`Error::WorkerGone`]);
    /// [`refit_runtime::Error::Timeout`] naming the late workers when a live worker sends
    /// nothing within [`MultiConfig::batch_timeout`].
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        if self.core.closed {
            return Err(Error::Closed);
        }
        if self.core.budget_spent() {
            return Ok(None);
        }
        self.core.pull_upstream(false)?;
        for (worker, c) in self.core.commands.iter().enumerate() {
            c.send(WorkerCommand::Collect)
                .map_err(|_| Error::WorkerGone {
                    worker,
                    reason: "its command channel is closed".into(),
                })?;
        }
        let n = self.core.commands.len();
        let mut parts: Vec<Option<Batch>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let late: Vec<usize> = (0..n).filter(|w| parts[*w].is_none()).collect();
            let (worker, batch) = self.core.recv(&|| format!("workers {late:?}"))?;
            if let Some(slot) = parts.get_mut(worker) {
                *slot = Some(batch);
            }
        }
        let batch = Batch::concat(parts.into_iter().flatten());
        self.core.frames += batch.frames as u64;
        self.core.pending = None;
        Ok(Some(batch))
    }
}

/// Workers collect continuously; each yielded batch is one worker's, as it arrives.
#[derive(Debug)]
pub struct MultiAsyncCollector<T: SenderTransport> {
    core: Core<T>,
}

impl<T: SenderTransport> MultiAsyncCollector<T> {
    /// As [`MultiSyncCollector::spawn`]; workers start collecting at once.
    ///
    /// # Errors
    /// As [`MultiSyncCollector::spawn`].
    pub fn spawn<E, P, R>(
        sender: T,
        workers: Vec<(Collector<E, P>, R)>,
        initial: Vec<WeightSet>,
        config: MultiConfig,
    ) -> Result<Self>
    where
        E: Env + 'static,
        P: Policy + 'static,
        R: ReceiverTransport + 'static,
    {
        Ok(Self {
            core: Core::spawn(sender, workers, initial, config, WorkerMode::Async)?,
        })
    }

    /// Waits until every worker applied the last published update. Batches that arrive
    /// meanwhile are kept (workers blocked on a full queue could not reach their next
    /// batch otherwise) and yielded first by [`Self::next_batch`].
    ///
    /// # Errors
    /// [`refit_runtime::Error::Timeout`] naming late workers; a worker's failure;
    /// [`Error::Closed`].
    pub fn wait_for_workers(&mut self, timeout: Duration) -> Result<()> {
        let Some(pending) = self.core.pending.take() else {
            return Ok(());
        };
        let start = Instant::now();
        loop {
            let slice = Duration::from_millis(5).min(timeout.saturating_sub(start.elapsed()));
            match self.core.sender_mut()?.wait(&pending, slice) {
                Ok(()) => return Ok(()),
                Err(e) if e.is_timeout() && start.elapsed() < timeout => {}
                Err(e) => return Err(e.into()),
            }
            let out = self.core.out.as_ref().ok_or(Error::Closed)?;
            while let Ok(msg) = out.try_recv() {
                match msg {
                    WorkerMessage::Batch { worker, batch } => {
                        self.core.backlog.release(worker);
                        self.core.stash.push_back((worker, batch));
                    }
                    WorkerMessage::Failed { worker, error } => {
                        return Err(Error::Worker {
                            worker,
                            source: Box::new(error),
                        });
                    }
                }
            }
        }
    }

    /// The next batch from whichever worker delivers first; `Ok(None)` once the frame
    /// budget is spent.
    ///
    /// # Errors
    /// A worker's failure ([`Error::Worker`]) or death ([`Error::WorkerGone`]);
    /// [`refit_runtime::Error::Timeout`] when no live worker delivers within
    /// [`MultiConfig::batch_timeout`].
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        if self.core.closed {
            return Err(Error::Closed);
        }
        if self.core.budget_spent() {
            return Ok(None);
        }
        self.core.pull_upstream(false)?;
        let n = self.core.handles.len();
        let (_, batch) = self.core.recv(&|| format!("any of the {n} workers"))?;
        self.core.frames += batch.frames as u64;
        Ok(Some(batch))
    }
}

common_methods!(MultiSyncCollector);
common_methods!(MultiAsyncCollector);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_waits_only_for_its_own_queued_batches() {
        let backlog = Arc::new(Backlog::new(2, 1));
        let stop = Arc::new(AtomicBool::new(false));
        assert!(backlog.reserve(0, &stop));
        // worker 0 is full; worker 1 still has room
        assert!(backlog.reserve(1, &stop));
        let (b, s) = (Arc::clone(&backlog), Arc::clone(&stop));
        let (tx, rx) = mpsc::channel();
        let waiter = std::thread::spawn(move || tx.send(b.reserve(0, &s)));
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "held");
        backlog.release(1); // another worker's batch taken: worker 0 still waits
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "held");
        backlog.release(0);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true));
        waiter.join().unwrap().unwrap();
    }

    #[test]
    fn a_waiting_worker_is_let_go_at_shutdown() {
        let backlog = Arc::new(Backlog::new(1, 2));
        let stop = Arc::new(AtomicBool::new(false));
        assert!(backlog.reserve(0, &stop));
        assert!(backlog.reserve(0, &stop));
        let (b, s) = (Arc::clone(&backlog), Arc::clone(&stop));
        let waiter = std::thread::spawn(move || b.reserve(0, &s));
        std::thread::sleep(Duration::from_millis(100));
        stop.store(true, Ordering::Release);
        backlog.wake_all();
        assert!(!waiter.join().unwrap(), "nothing counted after stop");
        // a worker index the counts do not know is never held
        assert!(Backlog::new(1, 1).reserve(7, &AtomicBool::new(false)));
    }
}
