//! The trainer's protocol: a model's driver hands it batches (the trainer runs on a thread
//! of its own, beside the driver, in the process that holds the model's trainer role).
//!
//! A sharded trainer (a trainer process with replicas: one rank per shard) adds two
//! messages: shard 0, beside the driver, hands each batch to the other shards
//! ([`TrainShard`], through a [`ShardRef`]); each trains on it and writes its part of the
//! new version into shard 0's assembly ([`WriteShard`], through an [`AssemblyRef`]), which
//! publishes the version once every shard wrote its part.

use std::sync::Arc;

use actix::prelude::*;
use refit_runtime::{ModelId, Version, WeightSet};
use serde::{Deserialize, Serialize};

use crate::batch::Batch;
use crate::error::Result;
use crate::learner::LearnStats;

/// One update on a batch; answers the learner's stats and the new weights.
#[derive(Debug, Message)]
#[rtype(result = "Result<(LearnStats, Arc<WeightSet>)>")]
pub struct Train {
    /// The batch.
    pub batch: Batch,
}

/// Publishes `weights` (built elsewhere: a version assembled from the shards of a sharded
/// trainer) through the trainer's outlet; answers the published version.
#[derive(Debug, Message)]
#[rtype(result = "Result<Version>")]
pub struct PublishWeights(pub Arc<WeightSet>);

/// The learner's whole state now ([`Learner::save`](crate::learner::Learner::save)), for a
/// checkpoint: a weight set of its model at its version.
#[derive(Debug, Message)]
#[rtype(result = "Result<WeightSet>")]
pub struct SaveState;

/// One update, then the new version goes out through the trainer's outlet; answers the
/// learner's stats and the published version.
#[derive(Debug, Message)]
#[rtype(result = "Result<(LearnStats, Version)>")]
pub struct TrainAndPublish {
    /// The batch.
    pub batch: Batch,
}

// ANCHOR: shard_protocol
/// One update of a sharded trainer, from shard 0 to another shard (a rank of the trainer
/// process): train on `batch`, export, and write the bytes `offset..offset + len` of the
/// export into shard 0's assembly of `version` ([`WriteShard`], in chunks); answers once
/// every chunk was taken.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<ShardWritten>")]
pub struct TrainShard {
    /// The model.
    pub model: ModelId,
    /// The version every shard exports after this update.
    pub version: Version,
    /// This shard's index (`1..world`).
    pub shard: usize,
    /// Where its part of the arena starts.
    pub offset: u64,
    /// How many bytes its part holds.
    pub len: u64,
    /// The batch every shard trains on.
    pub batch: Batch,
}

/// What a shard wrote for one update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardWritten {
    /// The version its export carried.
    pub version: Version,
    /// The bytes it wrote.
    pub bytes: u64,
    /// In how many chunks.
    pub chunks: u32,
}

/// One chunk of a shard's part of a version, to shard 0's assembly (chunks of one shard
/// come in order, each well under the node's frame limit). A chunk of another version,
/// layout (`schema`) or outside the shard's part refuses the shard's whole part.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<()>")]
pub struct WriteShard {
    /// The model.
    pub model: ModelId,
    /// The version of the export the bytes come from.
    pub version: Version,
    /// The writing shard's index.
    pub shard: usize,
    /// The schema hash of the export's manifest.
    pub schema: u64,
    /// Where the bytes go in the arena.
    pub offset: u64,
    /// The bytes.
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}
// ANCHOR_END: shard_protocol

crate::remote_reply!(ShardWritten);

crate::remote::wire_names! {
    TrainShard => "trainer.train_shard",
    WriteShard => "trainer.write_shard",
}

crate::protocol::role_ref! {
    /// A shard of a sharded trainer other than shard 0, in this process or another.
    pub struct ShardRef {
        /// One update.
        train: TrainShard,
    }
    /// The reference of a shard of this process.
    pub fn local(shard);
    /// The reference of a shard another process serves ([`ShardRef::serve`]).
    ///
    /// # Panics
    /// Outside a running actix system.
    pub fn remote(shard);
    /// Serves the shard's protocol on `node` under `target`.
    pub fn serve;
}

crate::protocol::role_ref! {
    /// Shard 0's assembly of a sharded trainer's versions, in this process or another.
    pub struct AssemblyRef {
        /// A chunk of a shard's part.
        write: WriteShard,
    }
    /// The reference of an assembly of this process.
    pub fn local(assembly);
    /// The reference of an assembly another process serves ([`AssemblyRef::serve`]).
    ///
    /// # Panics
    /// Outside a running actix system.
    pub fn remote(assembly);
    /// Serves the assembly's protocol on `node` under `target`.
    pub fn serve;
}
