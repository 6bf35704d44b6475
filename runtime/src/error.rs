//! The one error type of the runtime crate.

use std::path::PathBuf;
use std::time::Duration;

use crate::dtype::DType;
use crate::ids::{ModelId, Version};

/// Result alias used across the runtime.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What is wrong with one tensor, compared to the manifest that was agreed at connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// The tensor is in the manifest but not in the incoming weights.
    Missing,
    /// The incoming weights carry a tensor the manifest does not know.
    Unexpected,
    /// Element types differ.
    DType {
        /// What the manifest says.
        expected: DType,
        /// What arrived.
        found: DType,
    },
    /// Shapes differ.
    Shape {
        /// What the manifest says.
        expected: Vec<usize>,
        /// What arrived.
        found: Vec<usize>,
    },
    /// Byte sizes or offsets differ.
    Size {
        /// What the manifest says.
        expected: usize,
        /// What arrived.
        found: usize,
    },
    /// Content checksum differs.
    Checksum {
        /// What the sender declared.
        expected: u64,
        /// What the bytes hash to.
        found: u64,
    },
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing => write!(f, "missing from the incoming weights"),
            Self::Unexpected => write!(f, "not in the manifest"),
            Self::DType { expected, found } => {
                write!(f, "dtype {expected} expected, found {found}")
            }
            Self::Shape { expected, found } => {
                write!(f, "shape {expected:?} expected, found {found:?}")
            }
            Self::Size { expected, found } => {
                write!(f, "{expected} bytes expected, found {found}")
            }
            Self::Checksum { expected, found } => {
                write!(f, "checksum {expected:#018x} expected, found {found:#018x}")
            }
        }
    }
}

/// Every error the runtime reports. Messages are lowercase and keep their cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// One tensor does not match the agreed manifest; the whole version is refused.
    #[error("model `{model}`, tensor `{name}`: {problem}")]
    Tensor {
        /// The model the tensor belongs to.
        model: ModelId,
        /// The tensor's name.
        name: String,
        /// What is wrong with it.
        problem: Mismatch,
    },
    /// Two manifests describe different models (different schema hashes) without a tensor to blame.
    #[error("model `{model}`: schema hash {expected:#018x} expected, found {found:#018x}")]
    Schema {
        /// The model.
        model: ModelId,
        /// The hash agreed at connect.
        expected: u64,
        /// The hash that arrived.
        found: u64,
    },
    /// A manifest that cannot describe a weight set (overlaps, bad sizes, duplicate names).
    #[error("invalid manifest: {0}")]
    InvalidManifest(String),
    /// A model id that cannot be used.
    #[error("invalid model id {0:?}: {1}")]
    InvalidModelId(String, &'static str),
    /// A version that is not newer than the one already applied.
    #[error(
        "model `{model}`: version {offered} refused, version {current} already applied (versions only grow)"
    )]
    StaleVersion {
        /// The model.
        model: ModelId,
        /// The version that was offered.
        offered: Version,
        /// The version in force.
        current: Version,
    },
    /// A model the scheme was not set up with.
    #[error("unknown model `{0}`")]
    UnknownModel(ModelId),
    /// The same model appears twice in one atomic group.
    #[error("model `{0}` appears twice in one update")]
    DuplicateModel(ModelId),
    /// A typed view asked for an element type the tensor does not have.
    #[error("tensor `{name}` is {actual}, not {requested}")]
    WrongElement {
        /// The tensor.
        name: String,
        /// Its dtype.
        actual: DType,
        /// The dtype asked for.
        requested: DType,
    },
    /// A tensor name that is not in the weight set.
    #[error("no tensor named `{0}`")]
    NoSuchTensor(String),
    /// A weight set whose storage is read-only was asked for mutable bytes.
    #[error("weight set of model `{0}` is read-only (shared storage)")]
    ReadOnly(ModelId),
    /// A safetensors file or buffer was refused.
    #[error("safetensors {source_name}: {reason}")]
    Safetensors {
        /// File path or `<buffer>`.
        source_name: String,
        /// Why it was refused.
        reason: String,
    },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A path-specific I/O failure.
    #[error("{context} `{}`: {source}", path.display())]
    Path {
        /// What was being done.
        context: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A deadline passed.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long.
        after: Duration,
    },
    /// The other end is gone (process died, socket closed, segment removed).
    #[error("peer {peer} is gone: {reason}")]
    PeerGone {
        /// Who.
        peer: String,
        /// Why we believe so.
        reason: String,
    },
    /// A message or description that could not be encoded or decoded.
    #[error("wire: {0}")]
    Wire(String),
    /// A peer speaks another version of one of Refit's wire protocols (or another layout of
    /// a shared-memory board): the handshake is refused before anything else is read.
    #[error(
        "{peer} speaks {protocol} protocol version {theirs}, this process speaks version {ours}: \
         run the same Refit release at both ends"
    )]
    Protocol {
        /// Who (an address, a rank, a segment).
        peer: String,
        /// Which protocol (`node`, `tcp transport`, `cpu collective`, `broadcast`,
        /// `shm board layout`).
        protocol: &'static str,
        /// The version this process speaks.
        ours: u32,
        /// The version the peer speaks (0: a peer from before protocol versions).
        theirs: u32,
    },
    /// Something was used after `shutdown` or before `connect`.
    #[error("{0}")]
    State(&'static str),
    /// A strategy could not extract from or apply to a model.
    #[error("strategy: {0}")]
    Strategy(String),
    /// A bucket plan or one bucket of it was refused (see `bucket`).
    #[error("bucket {index}: {reason}")]
    Bucket {
        /// Which bucket (its index in the plan).
        index: usize,
        /// What is wrong with it, naming the tensor where there is one.
        reason: String,
    },
    /// A layout rule or plan was refused at plan time (see `layout`).
    #[error("layout: {culprit}: {reason}")]
    Layout {
        /// The rule (`rule \`fuse [..] -> ..\``) or tensor (`tensor \`x\``) to blame.
        culprit: String,
        /// What is wrong.
        reason: String,
    },
    /// A transfer plan of many senders and receivers was refused (see `mesh`).
    #[error("transfer plan, tensor `{tensor}`: {reason}")]
    Mesh {
        /// The tensor to blame.
        tensor: String,
        /// What is wrong: the element range and the senders where there are some.
        reason: String,
    },
    /// A dtype conversion was refused (see `cast`).
    #[error("cast of tensor `{tensor}`: {reason}")]
    Cast {
        /// The tensor (or rule pattern) to blame.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A version whose bytes do not hash to the checksum its sender computed (damaged in
    /// flight or where it was stored): refused whole, the previous version stays served.
    #[error("version {version} of model `{model}` refused: {reason}")]
    Damaged {
        /// The model.
        model: ModelId,
        /// The version refused.
        version: Version,
        /// What differs, and where the damage happened.
        reason: String,
    },
    /// A version applied as it streamed in ([`ReceiverTransport::stream_next`]) that failed
    /// part-way: some of its tensors reached the caller's model, so the model holds a mix of
    /// two versions until a later one streams in whole. A failure before the first tensor is
    /// reported as itself (nothing was applied).
    ///
    /// [`ReceiverTransport::stream_next`]: crate::ReceiverTransport::stream_next
    #[error(
        "version {version} of model `{model}` failed part-way through a streaming apply \
         ({applied} of the update's {tensors} tensors applied; the weights are mixed until a \
         version streams in whole): {source}"
    )]
    PartlyApplied {
        /// The model.
        model: ModelId,
        /// The version that failed.
        version: Version,
        /// Tensors of the update (every model streamed with this one) handed to the caller
        /// before the failure.
        applied: usize,
        /// Tensors of the update.
        tensors: usize,
        /// What failed.
        source: Box<Error>,
    },
    /// A delta update whose base version this receiver does not hold.
    #[error(
        "model `{model}`: delta from base version {base} to {version} refused, this receiver holds {}",
        held.map_or_else(|| "no version".to_string(), |v| format!("version {v}"))
    )]
    DeltaBase {
        /// The model.
        model: ModelId,
        /// The base the delta was computed against.
        base: Version,
        /// The version the delta produces.
        version: Version,
        /// The version the receiver holds, if any.
        held: Option<Version>,
    },
    /// A sharded writer broke the shard protocol (wrong rank, write outside its shard, barrier
    /// closed early).
    #[error("shard of rank {rank}: {reason}")]
    Shard {
        /// The rank to blame.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
    /// A topology file that cannot be used (see `topology`): malformed, an unknown key, a
    /// bad value or an impossible placement.
    #[error("topology: `{key}`: {reason}")]
    Topology {
        /// The key to blame, with its table (`process[actor].roles`, `links.weights`).
        key: String,
        /// What is wrong, naming the value and the process.
        reason: String,
    },
    /// A configuration that cannot be used (unknown key, bad value), naming the key.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A model library's variable could not become a tensor of a weight set, or the
    /// reverse (see `candle`).
    #[error("{library} tensor `{tensor}`: {reason}")]
    Bridge {
        /// The library (`candle`).
        library: &'static str,
        /// The tensor or variable to blame.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A sync-policy rule was broken (barrier rounds, notification order).
    #[error("sync policy: {0}")]
    Sync(String),
    /// A collective call failed (a rank left, the group was aborted, a backend error).
    #[error("{backend} collective `{group}` (generation {generation}, rank {rank}): {reason}")]
    Collective {
        /// The backend (`cpu`, `nccl`).
        backend: &'static str,
        /// The group.
        group: String,
        /// The membership generation.
        generation: u64,
        /// The rank that reports it.
        rank: usize,
        /// What happened.
        reason: String,
    },
    /// An error of the node layer (crate `refit-node`: a refused peer, a remote handler's
    /// error, a bad launch variable), boxed so that the core does not depend on that layer;
    /// `refit_node::Error::find` gives it back typed.
    #[error(transparent)]
    Node(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// A transport-specific failure.
    #[error("{transport} transport: {message}")]
    Transport {
        /// Which transport.
        transport: &'static str,
        /// What happened.
        message: String,
    },
}

impl Error {
    /// Builds an [`Error::Io`] with the given context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    /// Builds an [`Error::Tensor`].
    pub fn tensor(model: &ModelId, name: impl Into<String>, problem: Mismatch) -> Self {
        Self::Tensor {
            model: model.clone(),
            name: name.into(),
            problem,
        }
    }

    /// Builds an [`Error::Transport`].
    pub fn transport(transport: &'static str, message: impl Into<String>) -> Self {
        Self::Transport {
            transport,
            message: message.into(),
        }
    }

    /// Checks the `theirs` protocol version a peer announced against `ours`.
    ///
    /// # Errors
    /// [`Error::Protocol`] naming both versions when they differ.
    pub fn check_protocol(
        peer: impl std::fmt::Display,
        protocol: &'static str,
        ours: u32,
        theirs: u32,
    ) -> Result<()> {
        if ours == theirs {
            return Ok(());
        }
        Err(Self::Protocol {
            peer: peer.to_string(),
            protocol,
            ours,
            theirs,
        })
    }

    /// True when this error says a deadline passed.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Timeout { .. })
    }
}
