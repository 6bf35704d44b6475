//! The worker's side: its connection to the collector's node and its loop.

use std::net::SocketAddr;
use std::time::Duration;

use refit_node::{ClusterToken, Node, NodeConfig, Peer};
use refit_runtime::{ReceiverInit, ReceiverTransport};

use super::protocol::{
    COLLECTOR_TARGET, DELIVER, Deliver, Grant, HELLO, Hello, POLL, Poll, Report,
};
use super::{COLLECTOR_ENV, TRAJ_ID_BLOCK};
use crate::batch::TrajPool;
use crate::collector::Collector;
use crate::env::Env;
use crate::error::{Error, Result};
use crate::policy::Policy;

/// Deadline of one poll (the collector answers within half of it).
const POLL_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline of one delivery (the collector answers at once).
const DELIVER_TIMEOUT: Duration = Duration::from_secs(30);

/// A node error of a call to the collector at `addr`, a vanished connection named as the
/// collector's.
fn from_collector(addr: SocketAddr, e: refit_node::Error) -> Error {
    match e {
        refit_node::Error::Core(refit_runtime::Error::PeerGone { reason, .. }) => {
            Error::Runtime(refit_runtime::Error::PeerGone {
                peer: format!("collector at {addr}"),
                reason,
            })
        }
        e => e.into(),
    }
}

/// A worker's connection to its collector.
struct ToCollector {
    peer: Peer,
    worker: usize,
    addr: SocketAddr,
    /// Runs the connection; dropped last.
    node: Node,
}

/// A delivery on its way: its answer (the worker's grant) comes on `answer`.
struct InFlight {
    answer: std::sync::mpsc::Receiver<Result<Grant>>,
}

impl InFlight {
    /// Waits for the answer (the call has its own deadline, so this wait ends).
    fn grant(self) -> Result<Grant> {
        self.answer.recv().unwrap_or_else(|_| {
            Err(Error::Runtime(refit_runtime::Error::State(
                "the worker's node stopped before a delivery was answered",
            )))
        })
    }
}

impl ToCollector {
    /// Connects to the node [`COLLECTOR_ENV`] names with the token of `REFIT_TOKEN` and
    /// introduces this process as worker `worker`.
    fn connect(worker: usize, timeout: Duration) -> Result<Self> {
        let addr = std::env::var(COLLECTOR_ENV).map_err(|e| {
            Error::Config(format!(
                "{COLLECTOR_ENV} does not name the collector's node ({e}): a process \
                 collector starts its workers with it"
            ))
        })?;
        let addr: SocketAddr = addr.parse().map_err(|e| {
            Error::Config(format!("{COLLECTOR_ENV}={addr:?} is not an address: {e}"))
        })?;
        let token = ClusterToken::from_env()?.ok_or_else(|| {
            Error::Config(format!(
                "{} is not set: a process collector starts its workers with the cluster \
                     token",
                refit_node::TOKEN_ENV
            ))
        })?;
        let node = Node::start(NodeConfig {
            threads: 1,
            ..NodeConfig::loopback(token)
        })?;
        let peer = node
            .connect(addr, timeout)
            .map_err(|e| from_collector(addr, e))?;
        peer.call::<_, ()>(COLLECTOR_TARGET, HELLO, &Hello { worker }, timeout)
            .map_err(|e| from_collector(addr, e))?;
        Ok(Self {
            peer,
            worker,
            addr,
            node,
        })
    }

    /// Waits for a grant beyond `done` batches (or stop). Polls again while the collector
    /// answers that nothing changed or a poll times out; fails once the connection is gone.
    fn poll(&self, done: u64) -> Result<Grant> {
        let poll = Poll {
            worker: self.worker,
            done,
        };
        loop {
            match self
                .peer
                .call::<_, Grant>(COLLECTOR_TARGET, POLL, &poll, POLL_TIMEOUT)
            {
                Ok(g) if g.stop || g.granted > done => return Ok(g),
                Ok(_) => {}
                Err(e) if e.is_timeout() && !self.peer.is_closed() => {
                    tracing::debug!(
                        worker = self.worker,
                        "a poll of the collector timed out; polling again"
                    );
                }
                Err(e) => return Err(from_collector(self.addr, e)),
            }
        }
    }

    fn deliver(&self, seq: u64, report: Report) -> Result<Grant> {
        self.start_delivery(seq, report).grant()
    }

    /// Sends delivery `seq` without waiting for its answer: the worker makes its next batch
    /// meanwhile. Deliveries stay in order because a worker starts the next one only after
    /// the answer to this one.
    fn start_delivery(&self, seq: u64, report: Report) -> InFlight {
        let d = Deliver {
            worker: self.worker,
            seq,
            report,
        };
        let (tx, answer) = std::sync::mpsc::sync_channel(1);
        let (peer, addr) = (self.peer.clone(), self.addr);
        self.node.handle().spawn(async move {
            let r = peer
                .call_async(COLLECTOR_TARGET, DELIVER, &d, DELIVER_TIMEOUT)
                .await
                .map_err(|e| from_collector(addr, e));
            let _ = tx.send(r);
        });
        InFlight { answer }
    }

    /// Reports `error` as this worker's failure (best effort: the worker stops either way).
    fn fail(&self, seq: u64, error: &Error) {
        if let Err(e) = self.deliver(seq, Report::Failed(error.to_string())) {
            tracing::warn!(worker = self.worker, error = %e, "could not report a failure to the collector");
        }
    }
}

/// The worker process's loop: serves `collector` as worker `worker` of the process collector
/// that started this process, until it says stop or its connection closes.
///
/// It connects to the collector's node (named by [`COLLECTOR_ENV`], with the cluster token
/// of `REFIT_TOKEN`, both set by the collector), connects `receiver` (the initial weights
/// applied), then makes as many batches as the collector asks for, each preceded by a poll
/// for new weights, and delivers each as a node call. A failure is reported to the
/// collector before it is returned. Standard input and output are left alone (free for
/// the worker's logs).
///
/// # Errors
/// [`Error::Config`] when the environment does not name a collector; the node's refusal
/// or deadline when the collector cannot be reached; the scheme's rendezvous (its
/// deadline is `connect_timeout`); collection errors; the collector's connection closing
/// before it said stop (its process died: the worker then ends at once, or after the batch
/// it is making).
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
    let parent = ToCollector::connect(worker, connect_timeout)?;
    let attached = receiver
        .connect(connect_timeout)
        .map_err(Error::from)
        .and_then(|r| collector.attach_weight_source(Box::new(r)));
    if let Err(e) = attached {
        parent.fail(1, &e);
        return Err(e);
    }
    let mut done = 0u64;
    let mut grant = Grant::default();
    // the last delivery, answered while the next batch is made
    let mut in_flight: Option<InFlight> = None;
    loop {
        if grant.stop {
            return in_flight.map_or(Ok(()), |d| d.grant().map(drop));
        }
        if done >= grant.granted {
            grant = match in_flight.take() {
                Some(d) => d.grant()?,
                None => parent.poll(done)?,
            };
            continue;
        }
        let made = collector.next_batch();
        // the previous delivery is answered before the next one (or a failure) is sent
        if let Some(d) = in_flight.take() {
            grant = d.grant()?;
            if grant.stop {
                return Ok(());
            }
        }
        match made {
            Ok(Some(batch)) => {
                done += 1;
                let bytes = refit_runtime::wire::encode(&batch).map_err(Error::Runtime)?;
                in_flight = Some(parent.start_delivery(done, Report::Batch(bytes)));
            }
            Ok(None) => return Ok(()),
            Err(e) => {
                parent.fail(done + 1, &e);
                return Err(e);
            }
        }
    }
}
