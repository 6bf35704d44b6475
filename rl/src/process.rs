//! Collector workers as separate processes.
//!
//! The parent spawns one process per worker (usually its own program, re-run with
//! arguments that say "worker"), hands each a receiver description for the weight scheme
//! (shared memory on one host, TCP across hosts) and drives them over their standard input
//! and output: one byte per command on stdin, one length-prefixed msgpack [`Batch`] per
//! collected batch on stdout. Weights never travel on these pipes.
//!
//! - [`serve_worker`] is the child's loop: connect the receiver (initial weights applied),
//!   then collect a batch for every `collect` command, or continuously after a `run`
//!   command until `stop`, polling for new weights before each batch.
//! - [`ProcessSyncCollector`] is the parent: every worker delivers one batch, the batch is
//!   their concatenation, workers wait for the next command. A worker that dies or stays
//!   silent past the deadline is reported ([`Error::WorkerGone`]), never waited on forever.
//! - [`ProcessAsyncCollector`] is the asynchronous parent (TorchRL's
//!   `MultiaSyncDataCollector` with processes): workers collect continuously and stream
//!   their batches; the parent yields whichever arrives first, with the worker's index and
//!   the policy version that produced it ([`WorkerBatch`]). A worker that dies is reported
//!   once, with its exit status, and the others go on.
//!
//! Both parents take weights from an upstream [`WeightSource`] when one is attached and
//! forward each update to their workers' scheme (the cascade).
//!
//! Trajectory ids stay unique without shared state: worker `w` draws from the block
//! starting at `w * TRAJ_ID_BLOCK`.

use std::collections::VecDeque;
use std::io::{BufWriter, ErrorKind, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use refit_node::{ClusterToken, TOKEN_ENV, TOKEN_FILE_ENV};
use refit_runtime::{
    Manifests, ModelId, PendingSend, ReceiverInit, ReceiverTransport, Sender, SenderInit,
    SenderTransport, Version, WeightSet, wire,
};
use refit_transports::link::{self, LinkOptions, Reach, ReceiverSpec};

use crate::batch::{Batch, TrajPool};
use crate::collector::{Collector, UpdatePolicyWeights, WeightSource, policy_model_id};
use crate::env::Env;
use crate::error::{Error, Result};
use crate::multi::cascade;
use crate::policy::Policy;

/// Written once by a worker before its first batch: whatever the process printed before it
/// (a banner, a test harness's header) is skipped by the parent, up to [`MAX_PREAMBLE`] bytes.
const MAGIC: &[u8; 8] = b"REFIT-W1";
/// Most bytes a parent skips looking for [`MAGIC`].
const MAX_PREAMBLE: usize = 64 * 1024;
const COLLECT: u8 = 1;
const STOP: u8 = 0;
const RUN: u8 = 2;
/// Largest batch frame a parent accepts from a worker.
pub const MAX_BATCH_FRAME: usize = 256 << 20;
/// Width of each worker process's block of trajectory ids.
pub const TRAJ_ID_BLOCK: u64 = 1 << 40;

fn io(context: &str, e: std::io::Error) -> Error {
    Error::Runtime(refit_runtime::Error::io(context, e))
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

/// The child's loop: serves `collector` as worker `worker` until stdin closes or says stop.
///
/// Nothing else may write to this process's standard output: it carries the batches.
///
/// # Errors
/// Connect failures (the scheme's deadline), collection errors, a broken pipe.
pub fn serve_worker<E, P, T>(
    mut collector: Collector<E, P>,
    worker: usize,
    receiver: ReceiverInit<T>,
    connect_timeout: Duration,
) -> Result<()>
where
    E: Env,
    P: Policy + 'static,
    T: ReceiverTransport + 'static,
{
    collector.set_worker(worker);
    collector.set_traj_pool(TrajPool::starting_at(worker as u64 * TRAJ_ID_BLOCK))?;
    collector.set_total_frames(None);
    let receiver = receiver.connect(connect_timeout)?;
    collector.attach_weight_source(Box::new(receiver))?;
    let mut out = BufWriter::new(std::io::stdout().lock());
    out.write_all(MAGIC)
        .and_then(|()| out.flush())
        .map_err(|e| io("greeting the collector", e))?;
    // Commands arrive on their own thread, so that a free-running worker sees `stop`
    // between batches without blocking on its input.
    let (tx, commands) = mpsc::channel();
    std::thread::Builder::new()
        .name("refit-worker-stdin".into())
        .spawn(move || {
            let mut stdin = std::io::stdin().lock();
            loop {
                let mut cmd = [0u8; 1];
                let cmd = match stdin.read_exact(&mut cmd) {
                    Ok(()) => Ok(cmd[0]),
                    Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(STOP),
                    Err(e) => Err(io("reading a command from the collector", e)),
                };
                let last = !matches!(cmd, Ok(COLLECT | RUN));
                if tx.send(cmd).is_err() || last {
                    return;
                }
            }
        })
        .map_err(|e| io("starting the command reader", e))?;
    let mut free = false;
    loop {
        let cmd = if free {
            match commands.try_recv() {
                Err(mpsc::TryRecvError::Empty) => Ok(RUN),
                Ok(c) => c,
                Err(mpsc::TryRecvError::Disconnected) => Ok(STOP),
            }
        } else {
            commands.recv().unwrap_or(Ok(STOP))
        };
        match cmd? {
            COLLECT => {}
            RUN => free = true,
            _ => return Ok(()),
        }
        let Some(batch) = collector.next_batch()? else {
            return Ok(());
        };
        let bytes = wire::encode(&batch)?;
        let len = u32::try_from(bytes.len())
            .map_err(|_| Error::Config(format!("a batch of {} bytes is too large", bytes.len())))?;
        let sent = out
            .write_all(&len.to_le_bytes())
            .and_then(|()| out.write_all(&bytes))
            .and_then(|()| out.flush());
        if let Err(e) = sent {
            // A free-running worker whose collector stopped reading is done, not failed.
            if free && matches!(commands.try_recv(), Ok(Ok(STOP)) | Err(_)) {
                return Ok(());
            }
            return Err(io("sending a batch to the collector", e));
        }
    }
}

/// Settings of a [`ProcessSyncCollector`].
#[derive(Clone, Debug)]
pub struct ProcessConfig {
    /// Stop after this many frames, all workers together (`None`: never).
    pub total_frames: Option<u64>,
    /// Deadline of the scheme rendez-vous (workers start and connect).
    pub connect_timeout: Duration,
    /// How long a worker may take to deliver one batch.
    pub batch_timeout: Duration,
    /// How long `send` waits for acknowledgements at connect.
    pub ack_timeout: Duration,
    /// The policy's model id.
    pub policy_id: ModelId,
    /// Asynchronous collector only: batches each worker may have in flight ahead of the
    /// consumer (besides what its output pipe holds).
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

#[derive(Debug)]
struct WorkerProc {
    child: Child,
    stdin: Option<ChildStdin>,
    batches: mpsc::Receiver<Result<Batch>>,
}

/// Every worker process delivers one batch; the concatenation is yielded; workers wait.
#[derive(Debug)]
pub struct ProcessSyncCollector<T: SenderTransport> {
    sender: Option<Sender<T>>,
    workers: Vec<WorkerProc>,
    config: ProcessConfig,
    pending: Option<PendingSend>,
    frames: u64,
    upstream: Upstream,
}

fn gone(worker: usize, reason: impl Into<String>) -> Error {
    Error::WorkerGone {
        worker,
        reason: reason.into(),
    }
}

/// Reads length-prefixed batches from a worker's stdout until it closes or `to` answers
/// false (its consumer is gone).
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

/// Starts worker `worker` with its stdin and stdout piped (stderr inherited) and a thread
/// that hands each batch it writes to `deliver` (until `deliver` says stop).
fn start_worker(
    worker: usize,
    mut cmd: Command,
    deliver: impl Fn(Result<Batch>) -> bool + Send + 'static,
) -> Result<(Child, Option<ChildStdin>)> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| gone(worker, format!("could not start: {e}")))?;
    let stdin = child.stdin.take();
    let reader = match child.stdout.take() {
        Some(stdout) => std::thread::Builder::new()
            .name(format!("refit-worker-{worker}-out"))
            .spawn(move || read_batches(worker, stdout, deliver))
            .map_err(|e| gone(worker, format!("reader thread could not start: {e}"))),
        None => Err(gone(worker, "no stdout pipe")),
    };
    if let Err(e) = reader {
        // not handed to a collector yet, so nothing else would stop it
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    Ok((child, stdin))
}

/// Connects the workers' scheme: `initial` delivered and acknowledged by every worker.
fn connect_workers<T: SenderTransport>(
    sender: T,
    manifests: Manifests,
    initial: Vec<WeightSet>,
    config: &ProcessConfig,
) -> Result<Sender<T>> {
    Ok(SenderInit::new(sender, manifests)
        .with_ack_timeout(config.ack_timeout)
        .connect(initial, config.connect_timeout)?)
}

fn read_batches(worker: usize, mut from: impl Read, to: impl Fn(Result<Batch>) -> bool) {
    if let Err(reason) = skip_to_magic(&mut from) {
        to(Err(gone(worker, reason)));
        return;
    }
    loop {
        let mut len = [0u8; 4];
        if let Err(e) = from.read_exact(&mut len) {
            to(Err(gone(worker, format!("its output closed ({e})"))));
            return;
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_BATCH_FRAME {
            to(Err(gone(
                worker,
                format!("sent a {len}-byte frame (limit {MAX_BATCH_FRAME})"),
            )));
            return;
        }
        let mut buf = vec![0u8; len];
        if let Err(e) = from.read_exact(&mut buf) {
            to(Err(gone(
                worker,
                format!("its output closed mid-batch ({e})"),
            )));
            return;
        }
        let batch = wire::decode::<Batch>(&buf, MAX_BATCH_FRAME).map_err(Error::Runtime);
        let failed = batch.is_err();
        if !to(batch) || failed {
            return;
        }
    }
}

/// Reads until the worker's greeting; what came before it is discarded.
fn skip_to_magic(from: &mut impl Read) -> std::result::Result<(), String> {
    let mut window = [0u8; 8];
    let mut seen = 0usize;
    loop {
        let mut b = [0u8; 1];
        from.read_exact(&mut b)
            .map_err(|e| format!("its output closed before it greeted ({e})"))?;
        window.rotate_left(1);
        window[7] = b[0];
        seen += 1;
        if seen >= MAGIC.len() && &window == MAGIC {
            return Ok(());
        }
        if seen > MAX_PREAMBLE {
            return Err(format!(
                "printed {MAX_PREAMBLE} bytes without greeting: not a refit worker"
            ));
        }
    }
}

impl<T: SenderTransport> ProcessSyncCollector<T> {
    /// Spawns one process per command (stdin and stdout are taken over; stderr is
    /// inherited), connects the scheme (`sender` delivers `initial`) and returns once every
    /// worker applied the initial weights.
    ///
    /// # Errors
    /// [`Error::Config`] without workers; [`Error::WorkerGone`] if a process cannot start;
    /// the rendez-vous timeout.
    pub fn spawn(
        sender: T,
        commands: Vec<Command>,
        initial: Vec<WeightSet>,
        config: ProcessConfig,
    ) -> Result<Self> {
        let manifests = worker_manifests(&commands, &initial, &config.policy_id)?;
        let mut me = Self {
            sender: None,
            workers: Vec::with_capacity(commands.len()),
            config,
            pending: None,
            frames: 0,
            upstream: Upstream(None),
        };
        for (worker, cmd) in commands.into_iter().enumerate() {
            let (tx, rx) = mpsc::channel();
            let (child, stdin) = start_worker(worker, cmd, move |b| tx.send(b).is_ok())?;
            me.workers.push(WorkerProc {
                stdin,
                child,
                batches: rx,
            });
        }
        me.sender = Some(connect_workers(sender, manifests, initial, &me.config)?);
        Ok(me)
    }

    /// Process ids of the workers, in worker order.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.child.id()).collect()
    }

    /// Asks every worker for a batch and yields their concatenation (worker order);
    /// `Ok(None)` once the frame budget is spent.
    ///
    /// # Errors
    /// [`Error::WorkerGone`] for a worker that died, closed its pipe or missed the deadline;
    /// a worker's own collection error.
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        if self.config.total_frames.is_some_and(|t| self.frames >= t) {
            return Ok(None);
        }
        self.pull_upstream(false)?;
        for (i, w) in self.workers.iter_mut().enumerate() {
            let stdin = w.stdin.as_mut().ok_or_else(|| gone(i, "already stopped"))?;
            stdin
                .write_all(&[COLLECT])
                .and_then(|()| stdin.flush())
                .map_err(|e| gone(i, format!("its input closed ({e})")))?;
        }
        let deadline = Instant::now() + self.config.batch_timeout;
        let mut batches = Vec::with_capacity(self.workers.len());
        for (i, w) in self.workers.iter_mut().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            match w.batches.recv_timeout(left) {
                Ok(Ok(b)) => batches.push(b),
                Ok(Err(e)) => return Err(e),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(gone(
                        i,
                        format!("no batch within {:?}", self.config.batch_timeout),
                    ));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(gone(i, "its reader stopped"));
                }
            }
        }
        let batch = Batch::concat(batches);
        self.frames += batch.frames as u64;
        Ok(Some(batch))
    }

    fn stop_workers(&mut self) {
        for w in &mut self.workers {
            if let Some(mut stdin) = w.stdin.take() {
                let _ = stdin.write_all(&[STOP]);
            }
        }
        for w in &mut self.workers {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match w.child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    _ => {
                        let _ = w.child.kill();
                        let _ = w.child.wait();
                        break;
                    }
                }
            }
        }
    }
}

/// The parts both process collectors share: their counters and sender, the upstream weight
/// source (the cascade), stopping the workers when dropped, publishing
/// through their sender (without waiting: `$publish` says when the workers apply), and
/// iterating over batches.
macro_rules! process_collector_common {
    ($ty:ident, $publish:literal) => {
        impl<T: SenderTransport> $ty<T> {
            /// Frames delivered so far.
            pub fn frames(&self) -> u64 {
                self.frames
            }

            /// Stops every worker (waiting up to 5 s each, then killing it) and shuts the
            /// sender down.
            ///
            /// # Errors
            /// Sender shutdown errors.
            pub fn shutdown(mut self) -> Result<()> {
                self.stop_workers();
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

        impl<T: SenderTransport> Drop for $ty<T> {
            fn drop(&mut self) {
                self.stop_workers();
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
     `collect` command starts after the publication, so that batch uses the new weights."
);

/// An upstream weight source, if attached.
struct Upstream(Option<Box<dyn WeightSource>>);

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "attached" } else { "none" })
    }
}

/// Waits up to `grace` for `child` to exit; its status, for an error message.
fn exit_note(child: &mut Child, grace: Duration) -> String {
    let deadline = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return format!("; exit status: {status}"),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => return "; still running, killed".into(),
            Err(e) => return format!("; exit status unknown ({e})"),
        }
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

#[derive(Debug)]
struct AsyncProc {
    child: Child,
    stdin: Option<ChildStdin>,
    alive: bool,
}

/// Worker processes collect continuously and stream their batches; the next batch is
/// whichever arrives first (TorchRL's `MultiaSyncDataCollector`, with processes). Weights
/// reach the workers through the scheme `sender` drives, each worker polling its own
/// receiver before every batch.
#[derive(Debug)]
pub struct ProcessAsyncCollector<T: SenderTransport> {
    sender: Option<Sender<T>>,
    workers: Vec<AsyncProc>,
    batches: Option<mpsc::Receiver<(usize, Result<Batch>)>>,
    stash: VecDeque<WorkerBatch>,
    config: ProcessConfig,
    pending: Option<PendingSend>,
    frames: u64,
    upstream: Upstream,
}

impl<T: SenderTransport> ProcessAsyncCollector<T> {
    /// Spawns one process per command (stdin and stdout are taken over; stderr is
    /// inherited), connects the scheme (`sender` delivers `initial`), then sets every
    /// worker collecting.
    ///
    /// # Errors
    /// [`Error::Config`] without workers; [`Error::WorkerGone`] if a process cannot start;
    /// the rendez-vous timeout.
    pub fn spawn(
        sender: T,
        commands: Vec<Command>,
        initial: Vec<WeightSet>,
        config: ProcessConfig,
    ) -> Result<Self> {
        let manifests = worker_manifests(&commands, &initial, &config.policy_id)?;
        let n = commands.len();
        let (tx, rx) = mpsc::sync_channel(n * config.queue_depth.max(1));
        let mut me = Self {
            sender: None,
            workers: Vec::with_capacity(n),
            batches: Some(rx),
            stash: VecDeque::new(),
            config,
            pending: None,
            frames: 0,
            upstream: Upstream(None),
        };
        for (worker, cmd) in commands.into_iter().enumerate() {
            let tx = tx.clone();
            let (child, stdin) = start_worker(worker, cmd, move |b| tx.send((worker, b)).is_ok())?;
            me.workers.push(AsyncProc {
                stdin,
                child,
                alive: true,
            });
        }
        drop(tx);
        me.sender = Some(connect_workers(sender, manifests, initial, &me.config)?);
        for (i, w) in me.workers.iter_mut().enumerate() {
            let stdin = w.stdin.as_mut().ok_or_else(|| gone(i, "no stdin pipe"))?;
            stdin
                .write_all(&[RUN])
                .and_then(|()| stdin.flush())
                .map_err(|e| gone(i, format!("its input closed ({e})")))?;
        }
        Ok(me)
    }

    /// Process ids of the workers, in worker order.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.child.id()).collect()
    }

    /// Indices of the workers not reported dead.
    pub fn live_workers(&self) -> Vec<usize> {
        (0..self.workers.len())
            .filter(|w| self.workers[*w].alive)
            .collect()
    }

    /// Takes one message from the workers within `timeout`: `Ok(None)` on timeout.
    fn recv(&mut self, timeout: Duration) -> Result<Option<WorkerBatch>> {
        let rx = self.batches.as_ref().ok_or(Error::Closed)?;
        let (worker, got) = match rx.recv_timeout(timeout) {
            Ok(m) => m,
            Err(mpsc::RecvTimeoutError::Timeout) => return Ok(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(gone(
                    self.workers.len().saturating_sub(1),
                    "every worker ended",
                ));
            }
        };
        match got {
            Ok(batch) => {
                let version = batch.version_range().map_or(Version::ZERO, |(_, hi)| hi);
                Ok(Some(WorkerBatch {
                    worker,
                    version,
                    batch,
                }))
            }
            Err(e) => {
                // Reported once: the worker is dead (or talking nonsense: then stopped).
                let note = match self.workers.get_mut(worker) {
                    Some(w) => {
                        w.alive = false;
                        w.stdin = None;
                        let note = exit_note(&mut w.child, Duration::from_secs(2));
                        let _ = w.child.kill();
                        let _ = w.child.wait();
                        note
                    }
                    None => String::new(),
                };
                Err(match e {
                    Error::WorkerGone { worker, reason } => gone(worker, format!("{reason}{note}")),
                    other => Error::Worker {
                        worker,
                        source: Box::new(other),
                    },
                })
            }
        }
    }

    /// The next batch from whichever worker delivers first, with its worker index and
    /// policy version; `Ok(None)` once the frame budget is spent.
    ///
    /// # Errors
    /// [`Error::WorkerGone`] for a worker that died (once, with its exit status; the
    /// others keep collecting and later calls yield their batches);
    /// [`refit_runtime::Error::Timeout`] when no live worker delivers within
    /// [`ProcessConfig::batch_timeout`]; [`Error::Closed`].
    pub fn next_worker_batch(&mut self) -> Result<Option<WorkerBatch>> {
        if self.config.total_frames.is_some_and(|t| self.frames >= t) {
            return Ok(None);
        }
        self.pull_upstream(false)?;
        let b = match self.stash.pop_front() {
            Some(b) => b,
            None => match self.recv(self.config.batch_timeout)? {
                Some(b) => b,
                None => {
                    return Err(Error::Runtime(refit_runtime::Error::Timeout {
                        what: format!(
                            "a batch from any of the live workers {:?}",
                            self.live_workers()
                        ),
                        after: self.config.batch_timeout,
                    }));
                }
            },
        };
        self.frames += b.batch.frames as u64;
        Ok(Some(b))
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

    fn stop_workers(&mut self) {
        for w in &mut self.workers {
            if let Some(mut stdin) = w.stdin.take() {
                let _ = stdin.write_all(&[STOP]);
            }
        }
        // Keep reading (and dropping) what workers send, so that one blocked on a full pipe
        // finishes its batch, sees `stop` and ends cleanly; kill whoever is left at the
        // deadline.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(rx) = &self.batches {
                while rx.try_recv().is_ok() {}
            }
            let mut running = 0;
            for w in &mut self.workers {
                if matches!(w.child.try_wait(), Ok(None)) {
                    running += 1;
                }
            }
            if running == 0 || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(self.batches.take());
        for w in &mut self.workers {
            if !matches!(w.child.try_wait(), Ok(Some(_))) {
                let _ = w.child.kill();
            }
            let _ = w.child.wait();
        }
    }
}

process_collector_common!(
    ProcessAsyncCollector,
    "Publishes without waiting: each worker applies it before its next batch \
     ([`ProcessAsyncCollector::wait_for_workers`] waits for that)."
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_before_the_greeting_is_skipped_and_frames_decode() {
        let batch = Batch {
            frames: 3,
            ..Batch::default()
        };
        let bytes = wire::encode(&batch).unwrap();
        let mut stream = b"running 1 test\nREFIT".to_vec();
        stream.extend_from_slice(MAGIC);
        stream.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        stream.extend_from_slice(&bytes);
        let (tx, rx) = mpsc::channel();
        read_batches(0, &stream[..], move |b| tx.send(b).is_ok());
        assert_eq!(rx.recv().unwrap().unwrap().frames, 3);
        // then the stream ends: reported as the worker being gone
        assert!(matches!(
            rx.recv().unwrap(),
            Err(Error::WorkerGone { worker: 0, .. })
        ));
    }

    #[test]
    fn no_greeting_and_oversized_frames_are_refused() {
        let (tx, rx) = mpsc::channel();
        read_batches(1, &vec![b'x'; MAX_PREAMBLE + 10][..], move |b| {
            tx.send(b).is_ok()
        });
        let e = rx.recv().unwrap().unwrap_err().to_string();
        assert!(e.contains("not a refit worker"), "{e}");
        let mut stream = MAGIC.to_vec();
        stream.extend_from_slice(&u32::MAX.to_le_bytes());
        let (tx, rx) = mpsc::channel();
        read_batches(2, &stream[..], move |b| tx.send(b).is_ok());
        let e = rx.recv().unwrap().unwrap_err().to_string();
        assert!(e.contains("frame"), "{e}");
    }
}
