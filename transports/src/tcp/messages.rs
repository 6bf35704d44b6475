//! Control messages of the TCP transport (named msgpack over node remote calls).

use std::net::SocketAddr;

use refit_runtime::{BucketPlan, Manifest, ModelId, Version};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The remote call a sender makes on each receiver when a version is published (the
/// Ray-like trigger): the receiver then pulls the bytes over its data plane and acknowledges.
pub const RECEIVE_WEIGHTS: &str = "_receive_weights_scheme";
pub(crate) const REGISTER: &str = "register";
pub(crate) const TRANSFER: &str = "request_transfer";
pub(crate) const DONE: &str = "transfer_done";
pub(crate) const ACK: &str = "ack";
pub(crate) const PULL: &str = "pull";

/// How a receiver asks for a version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum TransferMode {
    /// Every byte of the arena.
    Full,
    /// Only the buckets holding a tensor whose checksum changed since the version the
    /// receiver holds, on top of that version (full when it holds none, or the sender no
    /// longer knows that version's checksums).
    #[default]
    Delta,
    /// As [`TransferMode::Delta`], each bucket that moves sent as its element-level
    /// difference against the version the receiver holds
    /// ([`refit_runtime::delta::elements`]: the changed bytes, or the changed byte planes,
    /// else the raw bytes, whichever is smallest), so the bytes on the wire follow what
    /// changed. The sender encodes each bucket once per pair of versions, however many
    /// receivers pull it. Served by the sender only while it keeps the receiver's version
    /// ([`TcpConfig::keep_versions`](super::TcpConfig::keep_versions)); a relay, or a
    /// sender that no longer keeps it, sends the buckets as `Delta` does, and a receiver
    /// writing into sinks asks for `Delta`.
    Elements,
}

/// The version of the tcp transport's protocol (these messages, the bucket frames of the
/// data streams) this build speaks: a receiver registers with it, the sender answers with
/// its own, and each refuses another version naming both. Version 2 added element-level
/// deltas ([`TransferMode::Elements`], an encoded bucket's length in its header, the base a
/// pull names): a version-1 peer could not decode them, so it is refused at registration.
/// Version 3 lets a transfer's terms leave the checksums to each bucket's header (the
/// sender hashes a bucket as it first serves it): a version-2 receiver would refuse such
/// terms mid-update, so it is refused at registration instead.
pub const PROTOCOL_VERSION: u32 = 3;

/// The name of the protocol in errors.
pub(crate) const PROTOCOL_NAME: &str = "tcp transport";

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Register {
    /// The receiver's [`PROTOCOL_VERSION`] (0 from a receiver of before protocol versions).
    #[serde(default)]
    pub(crate) protocol: u32,
    pub(crate) receiver: Uuid,
    /// Where the receiver's node listens (for announcements and relaying).
    pub(crate) node: SocketAddr,
    pub(crate) relay: bool,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Registered {
    /// The sender's [`PROTOCOL_VERSION`] (0 from a sender of before protocol versions).
    #[serde(default)]
    pub(crate) protocol: u32,
    pub(crate) id: u32,
    pub(crate) models: Vec<(ModelId, Manifest)>,
    pub(crate) latest: Vec<(ModelId, Version)>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct TransferReq {
    pub(crate) receiver: u32,
    pub(crate) model: ModelId,
    pub(crate) version: Version,
    pub(crate) have: Option<Version>,
    pub(crate) mode: TransferMode,
    /// Fingerprint of the bucket plan the receiver holds for the model (none before its
    /// first pull): the sender ships its plan only when this differs.
    pub(crate) plan: Option<u64>,
    /// The receiver serves the version to others while it pulls it (as its bytes arrive);
    /// false when it relays only versions it holds whole (e.g. it pulls into a sink).
    #[serde(default)]
    pub(crate) relay_in_flight: bool,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum TransferReply {
    Plan(Plan),
    /// The version is no longer kept; this one is the newest.
    Superseded {
        latest: Version,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Plan {
    pub(crate) lease: u64,
    /// The node to pull from (the sender, or a receiver that holds the version).
    pub(crate) source: SocketAddr,
    pub(crate) target: Uuid,
    pub(crate) from_sender: bool,
    /// Fingerprint of the sender's bucket plan for the model; pulls name it.
    pub(crate) plan_id: u64,
    /// The sender's bucket plan, shipped when the receiver does not hold `plan_id` yet; the
    /// receiver verifies it against its manifest before pulling a byte.
    pub(crate) bucket_plan: Option<BucketPlan>,
    /// Indices of the buckets to pull, ascending (every bucket for a full transfer; for a
    /// delta, those holding a byte of a changed tensor).
    pub(crate) buckets: Vec<u32>,
    /// True for a full transfer (every bucket, into a fresh arena); false for a delta (the
    /// receiver starts from the version it holds).
    pub(crate) full: bool,
    /// xxh3-64 of every piece of the version (plan order), verified before apply, where
    /// the sender has hashed the whole version already (always for a delta). Empty: each
    /// bucket's header declares its pieces' checksums (the sender hashes a bucket as it
    /// first serves it).
    pub(crate) checksums: Vec<u64>,
    /// For [`TransferMode::Elements`]: the version the buckets are encoded against (the
    /// one the receiver holds, which it copies whole into the new arena first); `None`:
    /// every bucket's raw bytes.
    #[serde(default)]
    pub(crate) encoded_base: Option<Version>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Done {
    pub(crate) receiver: u32,
    pub(crate) lease: u64,
    pub(crate) ok: bool,
    pub(crate) reason: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct AckReq {
    pub(crate) receiver: u32,
    pub(crate) applied: Vec<(ModelId, Version)>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Announce {
    pub(crate) entries: Vec<(ModelId, Version)>,
    /// The sender is shutting down.
    pub(crate) closing: bool,
}

/// The request of one data stream. The stream answers a head whose `len` is the payload
/// bytes of the requested buckets, then for each bucket, in the requested order, one framed
/// [`BucketHeader`](refit_runtime::BucketHeader) (index, version, range, pieces, checksum)
/// followed by exactly `len` raw bytes.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct PullReq {
    pub(crate) model: ModelId,
    pub(crate) version: Version,
    /// Fingerprint of the bucket plan the indices refer to; a source holding another plan
    /// refuses the pull.
    pub(crate) plan: u64,
    /// Bucket indices, strictly ascending.
    pub(crate) buckets: Vec<u32>,
    /// Encode each bucket against this version, which the source keeps (the plan's
    /// `encoded_base`); `None`: raw bytes.
    #[serde(default)]
    pub(crate) base: Option<Version>,
}
