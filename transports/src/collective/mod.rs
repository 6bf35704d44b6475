//! Collectives: a communicator over a fixed set of ranks, created once per membership
//! generation, that broadcasts (and sends/receives) buffers with a deadline on every call.
//!
//! The interface is what a GPU data plane needs (NCCL's broadcast/send/recv on device
//! buffers) and what a CPU-only cluster can run for real (the same calls on host bytes over
//! the node runtime's TCP streams). Everything above it — prepare messages per bucket,
//! double buffers, checksums, atomic apply, acks, generations — is written once, over
//! [`Communicator`], and tested on CPU.
//!
//! Rules every backend keeps:
//! - A communicator belongs to one [`Membership`] (group name, generation, rank, world size).
//!   Ranks joining or leaving means a new generation and a new communicator; the old one is
//!   dropped (its resources released exactly once, in `Drop`).
//! - Every call takes a deadline. A call that cannot finish by then fails with
//!   [`Error::Timeout`]; a peer that is gone fails it with [`Error::PeerGone`] or
//!   [`Error::Collective`]. No call waits forever.
//! - After any failed call the communicator is aborted ([`Communicator::abort`]): later calls
//!   fail at once, and the backend makes the other ranks' pending calls fail too (closing its
//!   links, `ncclCommAbort`), so one rank's failure is every rank's error, not a hang.
//! - Rendezvous (addresses, the NCCL unique id) goes through a [`Rendezvous`] store, keyed by
//!   [`Membership::key`].

use std::time::{Duration, Instant};

use refit_runtime::{Error, Result};

pub mod cpu;
mod local;
#[cfg(feature = "cuda")]
pub mod nccl;

pub use cpu::{CpuComm, CpuConfig};
pub use local::LocalRendezvous;

/// Who this rank is in which group, and since when.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Membership {
    /// Name of the group (e.g. `weights/policy`); groups are independent.
    pub group: String,
    /// Membership generation: bumped whenever a rank joins or leaves.
    pub generation: u64,
    /// This rank, `0..world`. Rank 0 is the trainer (the broadcast root) by convention.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
}

impl Membership {
    /// Checks `rank < world` and `world >= 1`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the group when the numbers are impossible.
    pub fn new(
        group: impl Into<String>,
        generation: u64,
        rank: usize,
        world: usize,
    ) -> Result<Self> {
        let group = group.into();
        if world == 0 || rank >= world {
            return Err(Error::Config(format!(
                "collective group `{group}`: rank {rank} is not in a world of {world}"
            )));
        }
        Ok(Self {
            group,
            generation,
            rank,
            world,
        })
    }

    /// The store key for `what` in this group and generation:
    /// `refit/coll/{group}/{generation}/{what}`.
    pub fn key(&self, what: &str) -> String {
        format!("refit/coll/{}/{}/{what}", self.group, self.generation)
    }

    /// Builds an [`Error::Collective`] for this rank.
    pub fn error(&self, backend: &'static str, reason: impl Into<String>) -> Error {
        Error::Collective {
            backend,
            group: self.group.clone(),
            generation: self.generation,
            rank: self.rank,
            reason: reason.into(),
        }
    }
}

/// A key-value store every rank of a group reaches (the node runtime's rendezvous store in
/// a cluster; a map in tests).
pub trait Rendezvous: Send + Sync {
    /// Sets `key` to `value`.
    ///
    /// # Errors
    /// The store is unreachable.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Waits until `key` is set and returns its value.
    ///
    /// # Errors
    /// [`Error::Timeout`] after `timeout`; the store is unreachable.
    fn wait_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
}

impl Rendezvous for refit_node::StoreClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        Ok(refit_node::StoreClient::set(self, key, value)?)
    }

    fn wait_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        Ok(refit_node::StoreClient::wait_get(self, key, timeout)?)
    }
}

/// A communicator: one rank's handle on a group for one membership generation.
///
/// `Buf` is the buffer the backend moves: host bytes (`Vec<u8>`) for the CPU backend,
/// device memory for NCCL. [`Communicator::alloc`], [`Communicator::upload`] and
/// [`Communicator::download`] move bytes between host memory and `Buf` (pinned staging on a
/// GPU); [`Communicator::broadcast_host`] broadcasts host bytes through them, and a backend
/// whose `Buf` is host memory overrides it to move the caller's bytes without a copy.
pub trait Communicator: Send + std::fmt::Debug {
    /// The buffer type the collective calls move.
    type Buf: Send;

    /// Name of the backend (`cpu`, `nccl`), for errors and metrics.
    fn backend(&self) -> &'static str;

    /// The membership this communicator was created for.
    fn membership(&self) -> &Membership;

    /// Allocates a buffer of `len` bytes.
    ///
    /// # Errors
    /// Out of memory; the communicator was aborted.
    fn alloc(&mut self, len: usize) -> Result<Self::Buf>;

    /// Copies `src` into the start of `dst`.
    ///
    /// # Errors
    /// `dst` is too small; the copy failed or missed `deadline`.
    fn upload(&mut self, src: &[u8], dst: &mut Self::Buf, deadline: Instant) -> Result<()>;

    /// Copies the first `dst.len()` bytes of `src` into `dst`.
    ///
    /// # Errors
    /// `src` is too small; the copy failed or missed `deadline`.
    fn download(&mut self, src: &Self::Buf, dst: &mut [u8], deadline: Instant) -> Result<()>;

    /// Broadcasts the first `len` bytes of `buf` from `root` to every rank: on `root` they
    /// are read, on the others written.
    ///
    /// # Errors
    /// [`Error::Timeout`] past `deadline`; [`Error::Collective`]/[`Error::PeerGone`] when a
    /// rank failed or left; the communicator is aborted afterwards.
    fn broadcast(
        &mut self,
        buf: &mut Self::Buf,
        len: usize,
        root: usize,
        deadline: Instant,
    ) -> Result<()>;

    /// Sends the first `len` bytes of `buf` to rank `peer`.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    fn send(&mut self, buf: &Self::Buf, len: usize, peer: usize, deadline: Instant) -> Result<()>;

    /// Receives `len` bytes from rank `peer` into the start of `buf`.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    fn recv(
        &mut self,
        buf: &mut Self::Buf,
        len: usize,
        peer: usize,
        deadline: Instant,
    ) -> Result<()>;

    /// Broadcasts host bytes: `bytes` is read on `root` and overwritten on the other ranks
    /// (every rank passes the same length). The default stages through a buffer from
    /// [`Communicator::alloc`].
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    fn broadcast_host(&mut self, bytes: &mut [u8], root: usize, deadline: Instant) -> Result<()> {
        let mut buf = self.alloc(bytes.len())?;
        let me = self.membership().rank;
        if me == root {
            self.upload(bytes, &mut buf, deadline)?;
        }
        self.broadcast(&mut buf, bytes.len(), root, deadline)?;
        if me != root {
            self.download(&buf, bytes, deadline)?;
        }
        Ok(())
    }

    /// The root's side of [`Communicator::broadcast_host`] for bytes it may only read (a
    /// published weight set shared with readers): this rank is the root. The default stages
    /// through a buffer from [`Communicator::alloc`]; a host-memory backend overrides it to
    /// send the caller's bytes without a copy.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    fn broadcast_send(&mut self, bytes: &[u8], deadline: Instant) -> Result<()> {
        let mut buf = self.alloc(bytes.len())?;
        self.upload(bytes, &mut buf, deadline)?;
        let root = self.membership().rank;
        self.broadcast(&mut buf, bytes.len(), root, deadline)
    }

    /// Aborts: every later call fails at once, and the other ranks' pending calls fail
    /// instead of waiting for this rank. Idempotent.
    fn abort(&mut self, reason: &str);

    /// True once [`Communicator::abort`] ran (or a call failed).
    fn is_aborted(&self) -> bool;
}
