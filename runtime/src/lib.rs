//! Refit runtime: the foundation every other crate stands on.
//!
//! - [`WeightSet`]: one version of one model, every tensor in one aligned arena, with
//!   by-name typed views; [`Manifest`] describes its layout and carries a schema hash.
//! - [`Strategy`] / [`HasWeights`]: how weights leave a model and go back in.
//! - [`scheme`]: the lifecycle `init → connect → send/receive → shutdown`, generic over
//!   transports.
//! - [`protocol`]: the sync rules as plain code (versions only grow, whole-group
//!   validation, acknowledgements), tested with no I/O.
//! - [`wire`]: msgpack encoding with size limits, and tokens to ship descriptions.
//! - Strategies for inference engines: [`bucket`] (bucket plans and an all-or-nothing
//!   assembler), [`layout`] (rename, fuse, split, transpose), [`cast`] (bf16, f16, fp8 with
//!   scales), [`delta`] (changed tensors or blocks only), [`sharded`] (ranks write one
//!   double-buffered arena); [`convert`] applies the layout and dtypes an engine wants on
//!   every update, as an adapter around any sender or receiver transport.
//! - [`sync_policy`]: when weights move — sync modes, the rollout status check, the
//!   staleness filter, validation cadence and the multi-model version barrier, as plain code.
//! - [`topology`]: the topology file (processes, roles, hosts, models, sync policy, stop
//!   rule, transport per link), validated whole, expanded into ranks.
//! - `candle` (feature `candle`): a candle-nn `VarMap` as a weight set and back.
//! - [`metrics`]: per-update phase timings (assemble, wire, verify, apply, engine pause)
//!   through the `metrics` facade and as `tracing` spans.
//! - [`cleanup`]: what SIGINT/SIGTERM release (shared-memory segments, and whatever else a
//!   component registers) before the process exits with 130/143; the signal handling itself
//!   lives in the node crate (`refit-node`), with the remote calls, streams and rendezvous
//!   store: this crate does no network I/O and needs no async runtime.
//! - `testing` (feature `test-util`, for tests only): shared fixtures, small manifests and
//!   filled weight sets.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod arena;
pub mod bucket;
#[cfg(feature = "candle")]
pub mod candle;
pub mod cast;
pub mod cleanup;
pub mod convert;
pub mod copy;
pub mod delta;
pub mod dtype;
pub mod error;
pub mod hash;
pub mod ids;
pub mod inproc;
pub mod layout;
pub mod link;
pub mod manifest;
pub mod mesh;
pub mod metrics;
pub mod plan;
pub mod protocol;
mod safetensors_io;
pub mod scheme;
pub mod sharded;
pub mod strategy;
pub mod sync_policy;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod topology;
pub mod units;
pub mod wait;
pub mod weights;
pub mod wire;

pub use arena::AlignedBuf;
pub use bucket::{BucketAssembler, BucketHeader, BucketPlan};
pub use cast::{CastPlan, CastRules};
pub use convert::{
    Conversion, Conversions, ConvertStats, ConvertingReceiver, ConvertingSender, Want, Wants,
};
pub use delta::{Delta, DeltaEncoder, DeltaPolicy, DeltaReceiver};
pub use dtype::{DType, Element};
pub use error::{Error, Mismatch, Result};
pub use ids::{ModelId, Version};
pub use layout::{LayoutPlan, LayoutRules};
pub use manifest::{ALIGN, Manifest, ManifestBuilder, TensorSpec};
pub use protocol::{Ack, AckBook, Admission, Group, Manifests, VersionGate};
pub use safetensors_io::{
    HF_INDEX, HF_SINGLE, SafetensorsFilePlan, SafetensorsLayout, inspect_safetensors, temp_sibling,
    write_atomically,
};
pub use scheme::{
    PendingSend, Receiver, ReceiverInit, ReceiverLoop, ReceiverTransport, Sender, SenderInit,
    SenderTransport, Served, Snapshot, StreamProgress, Update, WireMeter, stream_group,
};
pub use sharded::ShardedBuffer;
pub use strategy::{ArenaStrategy, HasWeights, Strategy, extract_new};
pub use sync_policy::{
    Decision, StalenessFilter, SyncConfig, SyncMode, SyncOrder, SyncPolicy, VersionBarrier,
};
pub use wait::{Wait, poll_until, wait_until};
pub use weights::{SharedBytes, TensorView, WeightSet, tensor_checksum};
