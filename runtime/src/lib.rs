//! Refit runtime: the foundation every other crate stands on.
//!
//! - [`WeightSet`]: one version of one model, every tensor in one aligned arena, with
//!   by-name typed views; [`Manifest`] describes its layout and carries a schema hash.
//! - [`Strategy`] / [`HasWeights`]: how weights leave a model and go back in.
//! - [`scheme`]: the lifecycle `init → connect → send/receive → shutdown`, generic over
//!   transports.
//! - [`protocol`]: the sync rules as plain code (versions only grow, whole-group
//!   validation, acknowledgements), tested with no I/O.
//! - [`node`]: processes that host handlers on TCP: remote calls with deadlines, streams,
//!   a rendezvous store, launch variables, the cluster token.
//! - [`wire`]: msgpack encoding with size limits, and tokens to ship descriptions.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod arena;
pub mod dtype;
pub mod error;
pub mod ids;
pub mod manifest;
pub mod node;
pub mod protocol;
mod safetensors_io;
pub mod scheme;
pub mod strategy;
pub mod weights;
pub mod wire;

pub use arena::AlignedBuf;
pub use dtype::{DType, Element};
pub use error::{Error, Mismatch, Result};
pub use ids::{ModelId, Version};
pub use manifest::{ALIGN, Manifest, ManifestBuilder, TensorSpec};
pub use protocol::{Ack, AckBook, Group, Manifests, VersionGate};
pub use safetensors_io::write_atomically;
pub use scheme::{
    PendingSend, Receiver, ReceiverInit, ReceiverLoop, ReceiverTransport, Sender, SenderInit,
    SenderTransport, Served, Snapshot, Update,
};
pub use strategy::{ArenaStrategy, HasWeights, Strategy, extract_new};
pub use weights::{SharedBytes, TensorView, WeightSet};
