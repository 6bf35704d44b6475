//! The broadcast transport: the trainer (rank 0) broadcasts every version to its receivers
//! through a [`Communicator`] — the CPU chain over TCP ([`CpuConfig`]) or NCCL — one bucket
//! at a time.
//!
//! Rank 0 opens every generation with a hello carrying its [`PROTOCOL_VERSION`] (a
//! receiver of another version leaves the generation with
//! [`Error::Protocol`](refit_runtime::Error::Protocol), naming both), then every model's
//! manifest. Per version, per bucket of the sender's [`BucketPlan`](refit_runtime::BucketPlan), rank 0
//! broadcasts a **prepare** message ([`Prepare`]: model, version, the bucket's tensors with
//! their names, dtypes, shapes and offsets, its index and the bucket count, its checksum),
//! then the bucket's bytes. Every receiver checks the prepare against the agreed manifest
//! before the bytes land, receives them straight into the version it is assembling, verifies
//! the bucket's xxh3 checksum, and hands the whole group to the scheme only once every bucket
//! of every model of it arrived — the scheme's admission then applies it atomically. A
//! refused version (unknown model, wrong names, dtypes, shapes, a bad checksum) is consumed
//! and dropped: the previous version stays served. Acks go through the rendezvous store
//! (`refit/coll/{group}/ack/{member}/{publish}/{model}/{version}`), so the data plane stays one
//! broadcast.
//!
//! Membership is by generation: the sender names its receivers ([`BroadcastSender::new`]);
//! generation `g`'s member list sits under `refit/coll/{group}/{g}/members`, and each
//! receiver joins the newest generation that lists it. When a rank fails, every rank's call
//! fails (the communicator aborts and closes its links); the sender starts the next
//! generation with [`BroadcastSender::regroup`] and the receivers still listed rejoin on their
//! own, keeping their last version until the newest one arrives.
//!
//! Receivers run the collective on a thread of their own, so a broadcast never waits for the
//! application to call `receive`; while idle, rank 0 broadcasts a heartbeat every
//! [`BroadcastConfig::heartbeat`], and a receiver that hears nothing for
//! [`BroadcastConfig::idle_timeout`] reports the sender as gone. A sender that shuts down
//! broadcasts a goodbye first, so its receivers report it gone at once (NCCL ranks do not
//! see a peer leave; the CPU chain's closed sockets would tell them anyway).

mod link;
mod messages;
mod receiver;
mod sender;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use refit_runtime::{ModelId, Result, Version};

use crate::collective::{Communicator, CpuComm, CpuConfig, Membership, Rendezvous};

pub use link::{BroadcastLink, GroupEnd, join_group, open_group};
pub use messages::{PROTOCOL_VERSION, Prepare};
pub use receiver::{BroadcastReceiver, PrepareHook};
pub use sender::BroadcastSender;

/// What both ends of a broadcast scheme agree on.
#[derive(Clone, Debug)]
pub struct BroadcastConfig {
    /// The group name (unique per scheme); store keys live under `refit/coll/{group}/`.
    pub group: String,
    /// Largest bucket, in bytes (a multiple of 64; default 4 MiB).
    pub bucket_size: usize,
    /// How often an idle rank 0 proves it is alive (default 1 s).
    pub heartbeat: Duration,
    /// How long a receiver waits for the next message before calling the sender gone
    /// (default 30 s; keep it several heartbeats).
    pub idle_timeout: Duration,
    /// Deadline of one bucket's bytes on a receiver, and of joining a generation
    /// (default 60 s).
    pub transfer_timeout: Duration,
}

impl BroadcastConfig {
    /// Defaults for group `group`.
    pub fn new(group: impl Into<String>) -> Self {
        Self {
            group: group.into(),
            bucket_size: 4 << 20,
            heartbeat: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(30),
            transfer_timeout: Duration::from_secs(60),
        }
    }

    fn current_key(&self) -> String {
        format!("refit/coll/{}/current", self.group)
    }

    fn members_key(&self, generation: u64) -> String {
        format!("refit/coll/{}/{generation}/members", self.group)
    }

    /// The ack of `model` at `version` by `member` for publish number `seq` (a version sent
    /// again after a refusal is acked afresh).
    fn ack_key(&self, member: &str, seq: u64, model: &ModelId, version: Version) -> String {
        format!(
            "refit/coll/{}/ack/{member}/{seq}/{model}/{}",
            self.group,
            version.get()
        )
    }
}

/// Makes the communicator of one generation (the backend's setup).
pub trait Connector: Send + 'static {
    /// The communicator it makes.
    type Comm: Communicator + 'static;

    /// Joins `membership`'s group through `store` before `deadline`.
    ///
    /// # Errors
    /// The backend's setup errors ([`refit_runtime::Error::Timeout`] when a rank is missing).
    fn connect(
        &mut self,
        membership: Membership,
        store: &dyn Rendezvous,
        deadline: Instant,
    ) -> Result<Self::Comm>;
}

impl Connector for CpuConfig {
    type Comm = CpuComm;

    fn connect(
        &mut self,
        membership: Membership,
        store: &dyn Rendezvous,
        deadline: Instant,
    ) -> Result<CpuComm> {
        CpuComm::connect(membership, store, self, deadline)
    }
}

/// Counters of one end, readable while it runs (e.g. to count prepare messages).
#[derive(Debug, Default)]
pub struct BroadcastStats {
    prepares: AtomicU64,
    bytes: AtomicU64,
    generation: AtomicU64,
    refused: AtomicU64,
}

impl BroadcastStats {
    /// Prepare messages sent (rank 0) or received (a receiver).
    pub fn prepares(&self) -> u64 {
        self.prepares.load(Ordering::Relaxed)
    }

    /// Bucket bytes sent or received.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The membership generation joined last (0 before the first).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Versions refused by this receiver.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for dyn Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Rendezvous")
    }
}

#[cfg(test)]
mod tests;

/// Checks a member name: non-empty, no `/` (it is part of store keys).
fn check_member(name: &str) -> Result<()> {
    if name.is_empty() || name.contains('/') || name.len() > 128 {
        return Err(refit_runtime::Error::Config(format!(
            "broadcast member name {name:?} must be 1..=128 bytes without `/`"
        )));
    }
    Ok(())
}
