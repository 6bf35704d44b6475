//! The collector's side: the node its workers call, their processes, and what they
//! delivered, in the order it arrived.

use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use refit_node::{CallInfo, ClusterToken, ConnId, Node, NodeConfig, TOKEN_ENV, TOKEN_FILE_ENV};
use refit_runtime::wire;

use super::protocol::{
    Board, COLLECTOR_TARGET, DELIVER, Deliver, Grant, HELLO, Hello, POLL, Poll, Refusal, Report,
};
use super::{COLLECTOR_ENV, MAX_BATCH_FRAME, gone};
use crate::batch::Batch;
use crate::error::{Error, Result};

/// What the collector hears from a worker.
#[derive(Debug)]
pub(super) enum Event {
    /// It introduced itself.
    Hello,
    /// Its batch number `seq`.
    Batch { seq: u64, batch: Batch },
    /// It failed (its error, as text) and stops.
    Failed(String),
    /// Its connection closed.
    Gone,
}

/// The state the node's handlers share with the collector.
struct Hub {
    board: Mutex<Board>,
    /// Woken whenever the board changes (a poll waits on it on the node's runtime: no
    /// thread of its own, no hop between threads when a grant comes).
    changed: tokio::sync::Notify,
    events: mpsc::Sender<(usize, Event)>,
}

fn refused(info: &CallInfo, why: Refusal) -> refit_node::Error {
    match why {
        Refusal::Identity(reason) => {
            tracing::warn!(caller = %info.peer, %reason, "a process collector refused a call");
            refit_node::Error::Unauthorized {
                peer: info.peer.to_string(),
                reason,
            }
        }
        Refusal::Protocol(reason) => {
            tracing::warn!(caller = %info.peer, %reason, "a process collector refused a call");
            refit_node::Error::Core(refit_runtime::Error::Wire(reason))
        }
    }
}

impl Hub {
    fn board(&self) -> MutexGuard<'_, Board> {
        // plain counters; a panic elsewhere leaves them consistent
        self.board.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hello(&self, info: &CallInfo, h: &Hello) -> refit_node::Result<()> {
        self.board()
            .hello(info.conn, h.worker)
            .map_err(|e| refused(info, e))?;
        let _ = self.events.send((h.worker, Event::Hello));
        Ok(())
    }

    /// Answers once the worker may make another batch or must stop, or after half the
    /// caller's deadline with the grant as it stands.
    async fn poll(self: Arc<Self>, info: CallInfo, p: Poll) -> refit_node::Result<Grant> {
        self.grant_after(&info, p.worker, p.done).await
    }

    /// Records a delivery, then answers as a poll after it would: a worker granted more
    /// goes on at once, and one that must wait for its next grant gets it in this reply,
    /// without a poll of its own (one round trip per batch, not two).
    async fn deliver_and_wait(
        self: Arc<Self>,
        info: CallInfo,
        d: Deliver,
    ) -> refit_node::Result<Grant> {
        let (worker, seq, failed) = (d.worker, d.seq, matches!(d.report, Report::Failed(_)));
        let grant = self.deliver(&info, d)?;
        if failed {
            return Ok(grant);
        }
        self.grant_after(&info, worker, seq).await
    }

    /// The worker's grant once it allows more than `done` batches or says stop, or after
    /// half the caller's deadline as it stands.
    async fn grant_after(
        &self,
        info: &CallInfo,
        worker: usize,
        done: u64,
    ) -> refit_node::Result<Grant> {
        let now = Instant::now();
        let until = now + info.deadline.saturating_duration_since(now) / 2;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            // registered before the board is read, so a change in between is not missed
            notified.as_mut().enable();
            {
                let board = self.board();
                if board
                    .poll_ready(info.conn, worker, done)
                    .map_err(|e| refused(info, e))?
                {
                    return Ok(board.grant(worker));
                }
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
                return Ok(self.board().grant(worker));
            }
        }
    }

    /// Records a delivery and hands its batch to the collector. A worker granted more goes
    /// on while its batch is decoded on a blocking thread (its answer does not wait for the
    /// decode); one that must wait for its next grant has its batch decoded here, with no
    /// hop to another thread before the collector sees it.
    fn deliver(&self, info: &CallInfo, d: Deliver) -> refit_node::Result<Grant> {
        let batch = matches!(d.report, Report::Batch(_));
        let grant = self
            .board()
            .deliver(info.conn, d.worker, d.seq, batch)
            .map_err(|e| refused(info, e))?;
        let (worker, seq) = (d.worker, d.seq);
        match d.report {
            Report::Batch(bytes) => {
                let events = self.events.clone();
                let hand_over = move || {
                    let event = match wire::decode::<Batch>(&bytes, MAX_BATCH_FRAME) {
                        Ok(batch) => Event::Batch { seq, batch },
                        Err(e) => Event::Failed(format!("its batch {seq} did not decode: {e}")),
                    };
                    let _ = events.send((worker, event));
                };
                if grant.granted > seq {
                    tokio::task::spawn_blocking(hand_over);
                } else {
                    hand_over();
                }
            }
            Report::Failed(error) => {
                let _ = self.events.send((worker, Event::Failed(error)));
            }
        }
        Ok(grant)
    }

    fn disconnected(&self, conn: ConnId) {
        let mut board = self.board();
        if let Some(w) = board.disconnected(conn)
            && !board.stopping()
        {
            let _ = self.events.send((w, Event::Gone));
        }
    }

    fn update(&self, f: impl FnOnce(&mut Board)) {
        f(&mut self.board());
        self.changed.notify_waiters();
    }
}

/// The cluster token the workers present: the one their commands already carry (a
/// [`WorkerLink`](super::WorkerLink) sets it), else this process's (`REFIT_TOKEN`,
/// `REFIT_TOKEN_FILE`), else a fresh random one.
fn worker_token(commands: &[Command]) -> Result<ClusterToken> {
    let mut found: Option<(usize, String)> = None;
    for (w, cmd) in commands.iter().enumerate() {
        let set = cmd
            .get_envs()
            .find(|(k, _)| *k == TOKEN_ENV)
            .and_then(|(_, v)| v);
        let Some(v) = set else { continue };
        let v = v
            .to_str()
            .ok_or_else(|| Error::Config(format!("worker {w}'s {TOKEN_ENV} is not UTF-8")))?;
        match &found {
            Some((first, t)) if t != v => {
                return Err(Error::Config(format!(
                    "workers {first} and {w} carry different cluster tokens ({TOKEN_ENV})"
                )));
            }
            Some(_) => {}
            None => found = Some((w, v.to_owned())),
        }
    }
    let token = match found {
        Some((_, t)) => ClusterToken::new(t),
        None => ClusterToken::from_env_or_random(),
    };
    token.map_err(Error::from)
}

/// A worker process and what became of it.
#[derive(Debug)]
struct Proc {
    child: Child,
    /// Reported dead (gone or failed).
    dead: bool,
}

/// The worker processes of one collector and the node they call.
pub(super) struct Workers {
    node: Node,
    hub: Arc<Hub>,
    events: mpsc::Receiver<(usize, Event)>,
    procs: Vec<Proc>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("node", &self.node)
            .field("procs", &self.procs)
            .finish_non_exhaustive()
    }
}

impl Workers {
    /// Starts the node (loopback; the workers' token) and one process per command, each
    /// told where the node is ([`COLLECTOR_ENV`]) and the token (`REFIT_TOKEN`, in its
    /// environment only).
    pub(super) fn spawn(commands: Vec<Command>) -> Result<Self> {
        let token = worker_token(&commands)?;
        let config = NodeConfig {
            max_frame: MAX_BATCH_FRAME,
            ..NodeConfig::loopback(token.clone())
        };
        let node = Node::start(config)?;
        let (tx, events) = mpsc::channel();
        let hub = Arc::new(Hub {
            board: Mutex::new(Board::new(commands.len())),
            changed: tokio::sync::Notify::new(),
            events: tx,
        });
        let h = Arc::clone(&hub);
        node.register(COLLECTOR_TARGET, HELLO, move |info, hello: Hello| {
            std::future::ready(h.hello(&info, &hello))
        });
        let h = Arc::clone(&hub);
        node.register(COLLECTOR_TARGET, POLL, move |info, poll: Poll| {
            Arc::clone(&h).poll(info, poll)
        });
        let h = Arc::clone(&hub);
        node.register(COLLECTOR_TARGET, DELIVER, move |info, d: Deliver| {
            Arc::clone(&h).deliver_and_wait(info, d)
        });
        let h = Arc::clone(&hub);
        node.on_disconnect(move |conn| h.disconnected(conn));
        let mut me = Self {
            node,
            hub,
            events,
            procs: Vec::with_capacity(commands.len()),
        };
        for (w, mut cmd) in commands.into_iter().enumerate() {
            cmd.env(COLLECTOR_ENV, me.node.addr().to_string())
                .env(TOKEN_ENV, token.expose())
                .env_remove(TOKEN_FILE_ENV);
            // on error, dropping `me` stops the workers started so far
            let child = cmd
                .spawn()
                .map_err(|e| gone(w, format!("could not start: {e}")))?;
            me.procs.push(Proc { child, dead: false });
        }
        Ok(me)
    }

    /// Waits until every worker introduced itself, until `deadline`.
    ///
    /// # Errors
    /// A worker that failed, exited or stayed silent, named.
    pub(super) fn await_hellos(&mut self, deadline: Instant) -> Result<()> {
        loop {
            let missing = (0..self.procs.len()).find(|w| !self.hub.board().connected(*w));
            let Some(missing) = missing else {
                return Ok(());
            };
            if let Some(e) = self.exited() {
                return Err(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(gone(
                    missing,
                    "did not connect to its collector's node in time",
                ));
            }
            match self.next_event(left.min(Duration::from_millis(20)))? {
                Some((w, Event::Failed(e))) => return Err(self.failed(w, e)),
                Some((w, Event::Gone)) => return Err(self.gone(w)),
                _ => {}
            }
        }
    }

    /// The first failure a worker reported or the first worker that exited, if any (for a
    /// rendezvous that went wrong).
    pub(super) fn first_failure(&mut self) -> Option<Error> {
        while let Ok(Some((w, e))) = self.next_event(Duration::ZERO) {
            match e {
                Event::Failed(e) => return Some(self.failed(w, e)),
                Event::Gone => return Some(self.gone(w)),
                Event::Hello | Event::Batch { .. } => {}
            }
        }
        self.exited()
    }

    /// A worker process that exited, reported as gone.
    fn exited(&mut self) -> Option<Error> {
        let w = self
            .procs
            .iter_mut()
            .position(|p| !p.dead && matches!(p.child.try_wait(), Ok(Some(_))))?;
        Some(self.gone(w))
    }

    /// Grants `worker` `more` batches.
    pub(super) fn ask(&self, worker: usize, more: u64) -> u64 {
        let mut total = 0;
        self.hub.update(|b| total = b.ask(worker, more));
        total
    }

    /// The next event, waiting up to `timeout`.
    ///
    /// # Errors
    /// [`Error::Closed`] after [`Workers::stop`].
    pub(super) fn next_event(&self, timeout: Duration) -> Result<Option<(usize, Event)>> {
        match self.events.recv_timeout(timeout) {
            Ok(e) => Ok(Some(e)),
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Error::Closed),
        }
    }

    /// True once `worker` was reported dead.
    pub(super) fn is_dead(&self, worker: usize) -> bool {
        self.procs.get(worker).is_none_or(|p| p.dead)
    }

    /// Reports `worker`'s connection as closed: its exit status (waiting up to 2 s for it),
    /// the process killed if it still runs.
    pub(super) fn gone(&mut self, worker: usize) -> Error {
        let note = match self.procs.get_mut(worker) {
            Some(p) => {
                p.dead = true;
                let note = exit_note(&mut p.child, Duration::from_secs(2));
                let _ = p.child.kill();
                let _ = p.child.wait();
                note
            }
            None => String::new(),
        };
        gone(
            worker,
            format!("its connection to the collector closed{note}"),
        )
    }

    /// Reports `worker`'s own failure (it stops by itself).
    pub(super) fn failed(&mut self, worker: usize, error: String) -> Error {
        let pid = match self.procs.get_mut(worker) {
            Some(p) => {
                p.dead = true;
                p.child.id()
            }
            None => 0,
        };
        Error::Worker {
            worker,
            source: Box::new(Error::from(refit_node::Error::Remote {
                peer: format!("worker process {pid}"),
                method: "collect".into(),
                message: error,
            })),
        }
    }

    /// Process ids, in worker order.
    pub(super) fn pids(&self) -> Vec<u32> {
        self.procs.iter().map(|p| p.child.id()).collect()
    }

    /// Workers not reported dead.
    pub(super) fn live(&self) -> Vec<usize> {
        (0..self.procs.len())
            .filter(|w| !self.is_dead(*w))
            .collect()
    }

    /// How many workers.
    pub(super) fn len(&self) -> usize {
        self.procs.len()
    }

    /// The node's address.
    pub(super) fn addr(&self) -> std::net::SocketAddr {
        self.node.addr()
    }

    /// Tells every worker to stop, waits up to 5 s for them all to exit (killing whoever is
    /// left), then stops the node. Idempotent.
    pub(super) fn stop(&mut self) {
        if self.hub.board().stopping() {
            return;
        }
        self.hub.update(Board::stop);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut running = 0;
            for p in &mut self.procs {
                if matches!(p.child.try_wait(), Ok(None)) {
                    running += 1;
                }
            }
            if running == 0 || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        for p in &mut self.procs {
            if !matches!(p.child.try_wait(), Ok(Some(_))) {
                let _ = p.child.kill();
            }
            let _ = p.child.wait();
        }
        self.node.shutdown();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Batch;

    fn hub(workers: usize) -> (Hub, mpsc::Receiver<(usize, Event)>) {
        let (events, rx) = mpsc::channel();
        let hub = Hub {
            board: Mutex::new(Board::new(workers)),
            changed: tokio::sync::Notify::new(),
            events,
        };
        (hub, rx)
    }

    fn call(conn: u64) -> CallInfo {
        CallInfo {
            conn: ConnId(conn),
            peer: "127.0.0.1:1".parse().unwrap(),
            node: uuid::Uuid::nil(),
            deadline: Instant::now() + Duration::from_secs(2),
        }
    }

    #[test]
    fn a_delivered_batch_reaches_the_collector_and_one_that_does_not_decode_is_the_workers_failure()
    {
        let (hub, events) = hub(1);
        hub.hello(&call(7), &Hello { worker: 0 }).unwrap();
        assert!(matches!(events.recv().unwrap(), (0, Event::Hello)));
        hub.update(|b| {
            b.ask(0, 2);
        });
        // granted 2: the first is decoded off this thread, the second (the last granted) here
        let bytes = wire::encode(&Batch::default()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let d = Deliver {
            worker: 0,
            seq: 1,
            report: Report::Batch(bytes),
        };
        let grant = rt.block_on(async { hub.deliver(&call(7), d) }).unwrap();
        assert_eq!(grant.granted, 2);
        let (w, e) = events.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(matches!((w, e), (0, Event::Batch { seq: 1, .. })));
        let d = Deliver {
            worker: 0,
            seq: 2,
            report: Report::Batch(vec![0xc1, 0xff, 0x00]),
        };
        hub.deliver(&call(7), d).unwrap();
        match events.recv_timeout(Duration::from_secs(5)).unwrap() {
            (0, Event::Failed(why)) => assert!(why.contains("batch 2 did not decode"), "{why}"),
            (w, other) => panic!("worker {w}: {other:?}"),
        }
        // a delivery on another connection speaks for nobody
        let d = Deliver {
            worker: 0,
            seq: 3,
            report: Report::Batch(vec![]),
        };
        assert!(hub.deliver(&call(8), d).is_err());
    }
}
