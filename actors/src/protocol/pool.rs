//! The trajectory pool's protocol (served by the
//! [`TrajectoryPool`](crate::actor::TrajectoryPool)): rollout workers push fragments, the model's driver
//! waits for and takes batches; [`PoolRef`] reaches a pool in this process or another.

use std::time::Duration;

use actix::prelude::*;
use refit_runtime::Version;
use refit_runtime::sync_policy::StalenessStats;
use serde::{Deserialize, Serialize};

use crate::batch::Batch;
use crate::error::Result;
use crate::protocol::controller::Admission;

/// A fragment for the pool, with the admission that let it run.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "()")]
pub struct PushFragment {
    /// The fragment's transitions and ended episodes.
    pub fragment: Batch,
    /// The controller's answer to the status check that started it.
    pub admission: Admission,
}

/// Waits until the pool holds a batch for a trainer at `train_version`, without taking it.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<usize>")]
pub struct AwaitBatch {
    /// The trainer's version (staleness is counted against it).
    pub train_version: Version,
    /// Deadline.
    pub timeout: Duration,
}

/// Takes fragments, oldest first, once at least a batch is there: whole fragments until
/// the batch size is reached, or every fragment with `all`.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<PoolBatch>")]
pub struct TakeBatch {
    /// The trainer's version (staleness is counted against it).
    pub train_version: Version,
    /// Take every fragment (`sync` mode, after draining: all of them are on-policy).
    pub all: bool,
    /// Deadline.
    pub timeout: Duration,
}

/// A batch out of the pool.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolBatch {
    /// The transitions; each fragment is its own stream (`worker` holds the fragment's
    /// number in the pool, so advantage estimation never runs across a dropped or
    /// cancelled fragment).
    pub batch: Batch,
    /// Samples dropped as too stale while this batch was gathered.
    pub dropped: u64,
    /// Samples evicted because the pool was full while this batch was gathered.
    pub evicted: u64,
    /// Largest staleness in this batch.
    pub max_staleness: u64,
    /// The fragments of this batch: their admissions and sample versions.
    pub fragments: Vec<FragmentInfo>,
    /// Everything the filter saw so far.
    pub totals: StalenessStats,
}

/// One fragment of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FragmentInfo {
    /// The controller's admission that started it.
    pub admission: Admission,
    /// Lowest and highest version that acted in it.
    pub versions: (Version, Version),
    /// Frames it holds.
    pub frames: usize,
}

crate::remote::wire_names! {
    PushFragment => "pool.push_fragment",
    AwaitBatch => "pool.await_batch",
    TakeBatch => "pool.take_batch",
}

crate::protocol::role_ref! {
    /// One model's trajectory pool, in this process or another.
    pub struct PoolRef {
        /// Fragments in.
        push: PushFragment,
        /// Waits for a batch.
        await_batch: AwaitBatch,
        /// Takes a batch.
        take: TakeBatch,
    }
    /// The reference of a pool of this process.
    pub fn local(pool);
    /// The reference of a pool another process serves ([`PoolRef::serve`]).
    ///
    /// # Panics
    /// Outside a running actix system.
    pub fn remote(pool);
    /// Serves the pool's protocol on `node` under `target`.
    pub fn serve;
}
