//! The shared-memory transport, for processes of one host.
//!
//! One *board* segment per scheme holds the commit record (which slot holds which version of
//! each model, under a seqlock), the receivers' table (pins, acknowledgements, pids) and a
//! directory of manifests; one *data* segment per model holds `slots` copies of its arena.
//!
//! - The sender writes a new version once, into a slot no reader has pinned, whatever the
//!   number of receivers; then it flips the board in one seqlock step, so models published
//!   together are seen together. Readers serve the version from the slot where it lies
//!   ([`ShmReadMode::ZeroCopy`], the default): N receivers cost one copy, the sender's. A
//!   reader that holds a version too long is the sender's business, never the other
//!   readers' (see [`ShmSender`]'s slot policy).
//! - A reader pins the slots it reads (a per-reader counter the writer checks, Dekker-style
//!   with sequentially consistent atomics), checks the slot header (even sequence, expected
//!   version) before and after, and so proves it saw one whole version.
//! - Receivers sleep on a futex in the board and are woken by each commit; no busy-spinning.
//! - A sender that crashes mid-write leaves its slot odd and the board on the old version:
//!   readers keep the old weights and learn the sender's death from its lease (see below).
//! - Liveness does not trust bare pids: every party keeps an owner record in the board (pid,
//!   start time, pid namespace, heartbeat). In the owner's pid namespace the start time
//!   unmasks a reused pid at once; across namespaces (containers sharing `/dev/shm`) a
//!   heartbeat older than the lease ([`ShmConfig::lease`]) declares the owner dead.
//! - Shutdown removes every segment file; mappings that readers still hold stay valid. So
//!   do SIGINT and SIGTERM once the program installed
//!   [`refit_node::signals::install_signal_handlers`]. A sender that dies without
//!   cleaning up (SIGKILL, the OOM killer) leaves its files; the next sender created in the
//!   same directory removes them ([`ShmSender::collected`]).
//! - The slots' bytes may live outside the data segments, in memory exported by handle
//!   ([`ShmSender::create_exported`], [`ShmReceiver::with_imports`]): the `cuda-ipc` link
//!   ([`crate::cuda_ipc`]) keeps them on the GPU. The board, the headers, pins and leases
//!   stay here, and so does everything above.
//!
//! # Why there are no bucket control messages here
//!
//! TCP moves bytes by a [`BucketPlan`](refit_runtime::BucketPlan), one header per bucket,
//! because its bytes cross a wire in pieces that can arrive late, damaged, from a relay, or
//! not at all. Shared memory has none of that: the sender writes the arena once into a slot
//! and commits the whole slot with one seqlock step; a reader either serves the slot in place
//! (`ShmReadMode::ZeroCopy`) or copies it whole in one `memcpy` (`ShmReadMode::Copy`) and
//! proves, by the slot's sequence before and after, that it saw one whole version. There is
//! no channel on which a per-bucket message could travel, and cutting the copy into buckets
//! would only add bookkeeping to a copy that runs at memory bandwidth. What the seqlock
//! cannot prove is that the bytes were not damaged after the write: that is the optional
//! per-version checksum ([`ShmConfig::checksum`]), one per slot, checked whole. The manifest (the layout a plan would
//! describe) is read once at attach from the board's manifest directory and checked by the
//! scheme against the manifests the receiver expects. So the
//! unit of control here is the version, not the bucket; the same holds for the in-process
//! transport, which moves no bytes at all.
//!
//! The board's layout is versioned ([`LAYOUT`]): a receiver refuses a board of another
//! layout with [`Error::Protocol`](refit_runtime::Error::Protocol), naming both versions.

mod board;
mod checksum;
mod collect;
mod futex;
mod layout;
pub(crate) mod lease;
pub(crate) mod link;
mod receiver;
mod segment;
mod sender;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use layout::{LAYOUT, MAX_MODELS, MAX_SLOTS};
pub use link::ShmLink;
pub use receiver::{ShmReadMode, ShmReceiver};
#[cfg(feature = "test-util")]
pub use sender::overwrite_sender_pid;
pub use sender::{DepartedReceiver, ShmSender};

const NAME: &str = "shm";
/// How often a waiting party checks the other side's liveness.
const LIVENESS_EVERY: Duration = Duration::from_millis(100);
/// Dead receivers [`ShmSender::departed`] remembers (the newest).
const MAX_DEPARTED: usize = 256;

/// Where and how the segments are made.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// Directory of the segment files (default `/dev/shm`, memory-backed on Linux).
    pub dir: PathBuf,
    /// Slots per model reserved (and mapped into the sender) when the sender is created:
    /// at least 2; default 3, the version in force, the one before it (which receivers read
    /// until they take the newest) and one to write the next version into.
    pub slots: usize,
    /// Most slots per model (at most [`MAX_SLOTS`]; default 5; below `slots` it is taken
    /// as `slots`). While readers hold old versions, the sender adds slots up to this many
    /// instead of waiting for them (see [`ShmSender`]'s slot policy); each costs one more
    /// copy of the model in `dir`. Equal to `slots`, the segments never grow and a publish
    /// waits for a pinned slot to be released.
    pub max_slots: usize,
    /// A checksum per version (xxh3-64 over 1 MiB pieces), computed once by the sender as it
    /// writes the slot and verified by every receiver before it admits the version: memory
    /// damaged after the write (a stray writer, a bad DIMM) is refused, naming the model and
    /// version, and the previous version stays served. Off by default: verifying reads every
    /// byte once more in each receiver (`refit bench` prints what it costs).
    pub checksum: bool,
    /// Most receivers that can attach at once (default 64).
    pub max_receivers: usize,
    /// Receivers `connect` waits for before returning (default 0: whoever attaches).
    pub expected_receivers: usize,
    /// How long a party's heartbeat may stay silent before the other side declares it
    /// dead, where the exact check cannot be made (another pid namespace, no `/proc`).
    /// Each party beats 8 times per lease. Default 3 s; 10 ms..=1 h.
    pub lease: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("/dev/shm"),
            slots: 3,
            max_slots: 5,
            checksum: false,
            max_receivers: 64,
            expected_receivers: 0,
            lease: Duration::from_secs(3),
        }
    }
}

/// What a receiver needs to attach: serialisable, shipped to another process (see
/// [`refit_runtime::wire::to_token`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmReceiverSpec {
    /// Path of the board segment.
    pub board: PathBuf,
}
