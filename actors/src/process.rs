//! Collector workers as separate processes.
//!
//! The parent spawns one process per worker (usually its own program, re-run with
//! arguments that say "worker"), hands each a receiver description for the weight scheme
//! (shared memory on one host, TCP across hosts) and drives them over their standard input
//! and output: one byte per command on stdin, one length-prefixed msgpack [`Batch`] per
//! collected batch on stdout. Weights never travel on these pipes.
//!
//! - [`serve_worker`] is the child's loop: connect the receiver (initial weights applied),
//!   then collect a batch for every `collect` command, polling for new weights first.
//! - [`ProcessSyncCollector`] is the parent: every worker delivers one batch, the batch is
//!   their concatenation, workers wait for the next command. A worker that dies or stays
//!   silent past the deadline is reported ([`Error::WorkerGone`]), never waited on forever.
//!
//! Trajectory ids stay unique without shared state: worker `w` draws from the block
//! starting at `w * TRAJ_ID_BLOCK`.

use std::io::{BufWriter, ErrorKind, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use refit_runtime::{
    Manifests, ModelId, PendingSend, ReceiverInit, ReceiverTransport, Sender, SenderInit,
    SenderTransport, Version, WeightSet, wire,
};

use crate::batch::{Batch, TrajPool};
use crate::collector::{Collector, UpdatePolicyWeights, policy_model_id};
use crate::env::Env;
use crate::error::{Error, Result};
use crate::policy::Policy;

/// Written once by a worker before its first batch: whatever the process printed before it
/// (a banner, a test harness's header) is skipped by the parent, up to [`MAX_PREAMBLE`] bytes.
const MAGIC: &[u8; 8] = b"REFIT-W1";
/// Most bytes a parent skips looking for [`MAGIC`].
const MAX_PREAMBLE: usize = 64 * 1024;
const COLLECT: u8 = 1;
const STOP: u8 = 0;
/// Largest batch frame a parent accepts from a worker.
pub const MAX_BATCH_FRAME: usize = 256 << 20;
/// Width of each worker process's block of trajectory ids.
pub const TRAJ_ID_BLOCK: u64 = 1 << 40;

fn io(context: &str, e: std::io::Error) -> Error {
    Error::Runtime(refit_runtime::Error::io(context, e))
}

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
    let mut stdin = std::io::stdin().lock();
    let mut out = BufWriter::new(std::io::stdout().lock());
    out.write_all(MAGIC)
        .and_then(|()| out.flush())
        .map_err(|e| io("greeting the collector", e))?;
    loop {
        let mut cmd = [0u8; 1];
        match stdin.read_exact(&mut cmd) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(io("reading a command from the collector", e)),
        }
        if cmd[0] != COLLECT {
            return Ok(());
        }
        let Some(batch) = collector.next_batch()? else {
            return Ok(());
        };
        let bytes = wire::encode(&batch)?;
        let len = u32::try_from(bytes.len())
            .map_err(|_| Error::Config(format!("a batch of {} bytes is too large", bytes.len())))?;
        out.write_all(&len.to_le_bytes())
            .and_then(|()| out.write_all(&bytes))
            .and_then(|()| out.flush())
            .map_err(|e| io("sending a batch to the collector", e))?;
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
}

impl Default for ProcessConfig {
    fn default() -> Self {
        Self {
            total_frames: None,
            connect_timeout: Duration::from_secs(30),
            batch_timeout: Duration::from_secs(60),
            ack_timeout: Duration::from_secs(30),
            policy_id: policy_model_id(),
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
}

fn gone(worker: usize, reason: impl Into<String>) -> Error {
    Error::WorkerGone {
        worker,
        reason: reason.into(),
    }
}

/// Reads length-prefixed batches from a worker's stdout until it closes.
fn read_batches(worker: usize, mut from: impl Read, to: mpsc::Sender<Result<Batch>>) {
    if let Err(reason) = skip_to_magic(&mut from) {
        let _ = to.send(Err(gone(worker, reason)));
        return;
    }
    loop {
        let mut len = [0u8; 4];
        if let Err(e) = from.read_exact(&mut len) {
            let _ = to.send(Err(gone(worker, format!("its output closed ({e})"))));
            return;
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_BATCH_FRAME {
            let _ = to.send(Err(gone(
                worker,
                format!("sent a {len}-byte frame (limit {MAX_BATCH_FRAME})"),
            )));
            return;
        }
        let mut buf = vec![0u8; len];
        if let Err(e) = from.read_exact(&mut buf) {
            let _ = to.send(Err(gone(
                worker,
                format!("its output closed mid-batch ({e})"),
            )));
            return;
        }
        let batch = wire::decode::<Batch>(&buf, MAX_BATCH_FRAME).map_err(Error::Runtime);
        let failed = batch.is_err();
        if to.send(batch).is_err() || failed {
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
        if commands.is_empty() {
            return Err(Error::Config("a process collector needs workers".into()));
        }
        let manifests = Manifests::new(
            initial
                .iter()
                .map(|w| (w.model().clone(), std::sync::Arc::clone(w.manifest()))),
        )?;
        manifests.get(&config.policy_id)?;
        let mut me = Self {
            sender: None,
            workers: Vec::with_capacity(commands.len()),
            config,
            pending: None,
            frames: 0,
        };
        for (worker, mut cmd) in commands.into_iter().enumerate() {
            let mut child = cmd
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| gone(worker, format!("could not start: {e}")))?;
            let stdout = child
                .stdout
                .take()
                .ok_or_else(|| gone(worker, "no stdout pipe"))?;
            let (tx, rx) = mpsc::channel();
            std::thread::Builder::new()
                .name(format!("refit-worker-{worker}-out"))
                .spawn(move || read_batches(worker, stdout, tx))
                .map_err(|e| gone(worker, format!("reader thread could not start: {e}")))?;
            me.workers.push(WorkerProc {
                stdin: child.stdin.take(),
                child,
                batches: rx,
            });
        }
        let connected = SenderInit::new(sender, manifests)
            .with_ack_timeout(me.config.ack_timeout)
            .connect(initial, me.config.connect_timeout)?;
        me.sender = Some(connected);
        Ok(me)
    }

    /// Process ids of the workers, in worker order.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.child.id()).collect()
    }

    /// Frames delivered so far.
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// The scheme's sender.
    pub fn sender(&self) -> Option<&Sender<T>> {
        self.sender.as_ref()
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

    /// Stops every worker (waiting up to 5 s each, then killing it) and shuts the sender down.
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

impl<T: SenderTransport> Drop for ProcessSyncCollector<T> {
    fn drop(&mut self) {
        self.stop_workers();
    }
}

impl<T: SenderTransport> UpdatePolicyWeights for ProcessSyncCollector<T> {
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

    /// Publishes without waiting: workers poll before their next batch, which the next
    /// `collect` command starts after the publication, so that batch uses the new weights.
    fn update_group(&mut self, group: Vec<WeightSet>) -> Result<()> {
        let sender = self.sender.as_mut().ok_or(Error::Closed)?;
        self.pending = Some(sender.send_async(group)?);
        Ok(())
    }
}

impl<T: SenderTransport> Iterator for ProcessSyncCollector<T> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch().transpose()
    }
}

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
        read_batches(0, &stream[..], tx);
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
        read_batches(1, &vec![b'x'; MAX_PREAMBLE + 10][..], tx);
        let e = rx.recv().unwrap().unwrap_err().to_string();
        assert!(e.contains("not a refit worker"), "{e}");
        let mut stream = MAGIC.to_vec();
        stream.extend_from_slice(&u32::MAX.to_le_bytes());
        let (tx, rx) = mpsc::channel();
        read_batches(2, &stream[..], tx);
        let e = rx.recv().unwrap().unwrap_err().to_string();
        assert!(e.contains("frame"), "{e}");
    }
}
