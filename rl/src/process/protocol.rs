//! What a worker process and its collector say to each other, and the collector's record of
//! it: plain state, tested without sockets.
//!
//! Every message is a node call from the worker to the collector's node (the worker is the
//! only caller, on one connection):
//!
//! - [`HELLO`] `Hello { worker }` once: this connection is worker `worker`'s from now on.
//! - [`POLL`] `Poll { worker, done }` (a long poll): answered with the worker's [`Grant`] once
//!   it allows more than the `done` batches the worker delivered (or says stop), else after
//!   half the call's deadline with the grant as it stands; the worker polls again.
//! - [`DELIVER`] `Deliver { worker, seq, report }`: the worker's batch number `seq` (or its
//!   failure), answered as a poll after it would be: at once when the worker may make more,
//!   else when its next grant comes (or after half the call's deadline), so that each batch
//!   costs one round trip.
//!
//! A grant is a count, not a queue of commands: a reply lost to a deadline is answered again
//! by the next poll, and a batch is never asked for twice. The synchronous collector grants
//! one batch per worker per `next_batch`; the asynchronous one keeps each worker a few batches
//! ahead of its consumer.

use refit_node::ConnId;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The id the handlers of a process collector's node are registered under.
///
/// A worker is their only caller, on one connection, every call with a deadline:
/// - [`HELLO`] once: the connection speaks for worker `w` from now on (refused for a worker
///   that does not exist or is already connected);
/// - [`POLL`] (a long poll): answered once the worker may make more batches than it
///   delivered, or must stop, else after half the call's deadline as things stand;
/// - [`DELIVER`]: the worker's next batch (numbered from 1), or its failure; answered, as a
///   poll is, once the worker may make another batch or must stop (at once after a failure).
///
/// Calls that speak for a worker other than the connection's, deliver out of order or
/// deliver batches not asked for are refused and logged; the workers do not notice.
pub const COLLECTOR_TARGET: Uuid = Uuid::from_u128(0x7265_6669_742d_636f_6c6c_6563_746f_7231);
/// A worker introduces its connection.
pub const HELLO: &str = "collector.hello";
/// A worker waits for its next grant.
pub const POLL: &str = "collector.poll";
/// A worker delivers a batch or its failure.
pub const DELIVER: &str = "collector.deliver";

/// The first call of a worker.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Hello {
    pub(super) worker: usize,
}

/// A worker asks for work, having delivered `done` batches.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Poll {
    pub(super) worker: usize,
    pub(super) done: u64,
}

/// A worker's batch number `seq` (counted from 1), or its failure.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Deliver {
    pub(super) worker: usize,
    pub(super) seq: u64,
    pub(super) report: Report,
}

/// What a worker delivers.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Report {
    /// A collected batch, encoded on its own ([`wire`](refit_runtime::wire) msgpack of a
    /// [`Batch`](crate::batch::Batch)): the collector's node answers the call without decoding it.
    Batch(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The worker failed (its error, as text) and stops.
    Failed(String),
}

/// What a worker may do: make batches until it delivered `granted` of them; stop when `stop`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Grant {
    pub(super) granted: u64,
    pub(super) stop: bool,
}

#[derive(Debug, Default)]
struct Slot {
    conn: Option<ConnId>,
    granted: u64,
    delivered: u64,
    closed: bool,
}

/// The collector's record of its workers: whose connection is whose, how many batches each
/// was granted and delivered, and whether they are told to stop.
#[derive(Debug)]
pub(super) struct Board {
    slots: Vec<Slot>,
    stop: bool,
}

/// Why a call was refused: the connection does not belong to the worker it names (or the
/// worker does not exist), or the call breaks the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Not this worker's connection.
    Identity(String),
    /// Out of order or not asked for.
    Protocol(String),
}

impl Board {
    pub(super) fn new(workers: usize) -> Self {
        Self {
            slots: (0..workers).map(|_| Slot::default()).collect(),
            stop: false,
        }
    }

    /// Binds `conn` to `worker`.
    pub(super) fn hello(&mut self, conn: ConnId, worker: usize) -> Result<(), Refusal> {
        let n = self.slots.len();
        let slot = self.slots.get_mut(worker).ok_or_else(|| {
            Refusal::Identity(format!(
                "there is no worker {worker} (this collector has {n})"
            ))
        })?;
        if slot.conn.is_some() {
            return Err(Refusal::Identity(format!(
                "worker {worker} is already connected"
            )));
        }
        slot.conn = Some(conn);
        Ok(())
    }

    fn slot(&self, conn: ConnId, worker: usize) -> Result<&Slot, Refusal> {
        match self.slots.get(worker) {
            Some(s) if s.conn == Some(conn) => Ok(s),
            _ => Err(Refusal::Identity(format!(
                "this connection is not worker {worker}'s"
            ))),
        }
    }

    /// `worker`'s grant as it stands.
    pub(super) fn grant(&self, worker: usize) -> Grant {
        Grant {
            granted: self.slots.get(worker).map_or(0, |s| s.granted),
            stop: self.stop,
        }
    }

    /// Whether a poll of `worker` (on `conn`, `done` batches delivered) can be answered now.
    pub(super) fn poll_ready(
        &self,
        conn: ConnId,
        worker: usize,
        done: u64,
    ) -> Result<bool, Refusal> {
        let slot = self.slot(conn, worker)?;
        Ok(self.stop || slot.granted > done)
    }

    /// Records `worker`'s delivery `seq` (a batch when `batch`, else its failure).
    pub(super) fn deliver(
        &mut self,
        conn: ConnId,
        worker: usize,
        seq: u64,
        batch: bool,
    ) -> Result<Grant, Refusal> {
        let slot = self.slot(conn, worker)?;
        if seq != slot.delivered + 1 {
            return Err(Refusal::Protocol(format!(
                "worker {worker} delivered number {seq} after {}",
                slot.delivered
            )));
        }
        if batch && seq > slot.granted {
            return Err(Refusal::Protocol(format!(
                "worker {worker} delivered batch {seq} but was asked for {}",
                slot.granted
            )));
        }
        if let Some(s) = self.slots.get_mut(worker) {
            s.delivered = seq;
        }
        Ok(self.grant(worker))
    }

    /// The worker whose connection `conn` was, once (later calls and strangers' connections
    /// answer `None`).
    pub(super) fn disconnected(&mut self, conn: ConnId) -> Option<usize> {
        let w = self
            .slots
            .iter()
            .position(|s| s.conn == Some(conn) && !s.closed)?;
        self.slots[w].closed = true;
        Some(w)
    }

    /// Grants `worker` `more` batches; its total.
    pub(super) fn ask(&mut self, worker: usize, more: u64) -> u64 {
        match self.slots.get_mut(worker) {
            Some(s) => {
                s.granted += more;
                s.granted
            }
            None => 0,
        }
    }

    /// Tells every worker to stop.
    pub(super) fn stop(&mut self) {
        self.stop = true;
    }

    /// True once [`Board::stop`] was called.
    pub(super) fn stopping(&self) -> bool {
        self.stop
    }

    /// True once `worker` introduced itself.
    pub(super) fn connected(&self, worker: usize) -> bool {
        self.slots.get(worker).is_some_and(|s| s.conn.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_speaks_for_the_worker_it_introduced_only() {
        let mut b = Board::new(2);
        b.hello(ConnId(7), 0).unwrap();
        // a second hello for the same worker, or one for a worker that does not exist
        assert!(
            matches!(b.hello(ConnId(8), 0), Err(Refusal::Identity(m)) if m.contains("already"))
        );
        assert!(
            matches!(b.hello(ConnId(8), 2), Err(Refusal::Identity(m)) if m.contains("no worker 2"))
        );
        b.ask(0, 1);
        // another connection cannot poll or deliver as worker 0, nor as worker 1 unintroduced
        assert!(matches!(
            b.poll_ready(ConnId(8), 0, 0),
            Err(Refusal::Identity(_))
        ));
        assert!(matches!(
            b.deliver(ConnId(8), 0, 1, true),
            Err(Refusal::Identity(_))
        ));
        assert!(matches!(
            b.deliver(ConnId(7), 1, 1, true),
            Err(Refusal::Identity(_))
        ));
        assert_eq!(b.poll_ready(ConnId(7), 0, 0), Ok(true));
        assert_eq!(
            b.deliver(ConnId(7), 0, 1, true),
            Ok(Grant {
                granted: 1,
                stop: false
            })
        );
    }

    #[test]
    fn batches_come_in_order_and_only_when_asked_for() {
        let mut b = Board::new(1);
        b.hello(ConnId(1), 0).unwrap();
        // nothing granted: a poll waits, a batch is refused, a failure is taken
        assert_eq!(b.poll_ready(ConnId(1), 0, 0), Ok(false));
        assert!(
            matches!(b.deliver(ConnId(1), 0, 1, true), Err(Refusal::Protocol(m)) if m.contains("asked for 0"))
        );
        assert_eq!(b.ask(0, 2), 2);
        assert_eq!(b.poll_ready(ConnId(1), 0, 0), Ok(true));
        // skipping a number, or repeating one, is refused
        assert!(
            matches!(b.deliver(ConnId(1), 0, 2, true), Err(Refusal::Protocol(m)) if m.contains("number 2 after 0"))
        );
        b.deliver(ConnId(1), 0, 1, true).unwrap();
        assert!(b.deliver(ConnId(1), 0, 1, true).is_err());
        assert_eq!(b.deliver(ConnId(1), 0, 2, true).unwrap().granted, 2);
        // done with its grant: the next poll waits
        assert_eq!(b.poll_ready(ConnId(1), 0, 2), Ok(false));
        assert!(b.deliver(ConnId(1), 0, 3, true).is_err());
        b.deliver(ConnId(1), 0, 3, false).unwrap();
        // stop answers every poll
        b.stop();
        assert!(b.stopping());
        assert_eq!(b.poll_ready(ConnId(1), 0, 3), Ok(true));
        assert!(b.grant(0).stop);
    }

    #[test]
    fn a_closed_connection_names_its_worker_once() {
        let mut b = Board::new(2);
        b.hello(ConnId(3), 1).unwrap();
        assert!(b.connected(1) && !b.connected(0));
        assert_eq!(b.disconnected(ConnId(9)), None);
        assert_eq!(b.disconnected(ConnId(3)), Some(1));
        assert_eq!(b.disconnected(ConnId(3)), None);
    }
}
