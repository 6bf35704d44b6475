//! A shard other than shard 0: trains on each batch shard 0 hands it and writes its part
//! of the export into shard 0's assembly, in chunks.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_node::Node;
use refit_runtime::ModelId;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::protocol::trainer::{AssemblyRef, ShardWritten, Train, TrainShard, WriteShard};
use crate::remote::RemoteAddr;

use super::CHUNK_BYTES;
use crate::actor::Trainer;
use crate::run::mesh::MeshPart;
use crate::run::rendezvous::Rendezvous;

/// How a shard reaches shard 0's assembly.
pub(crate) enum LeadLink {
    /// Known.
    Ready(AssemblyRef),
    /// Found (on the first update) from shard 0's card in the store: its rank and the
    /// assembly's id there.
    Find {
        rv: Rendezvous,
        node: Node,
        rank: u32,
        target: Uuid,
        name: String,
        wait: Duration,
    },
}

impl LeadLink {
    async fn resolve(&self) -> Result<AssemblyRef> {
        match self {
            Self::Ready(r) => Ok(r.clone()),
            Self::Find {
                rv,
                node,
                rank,
                target,
                name,
                wait,
            } => {
                let peer = crate::run::peers::peer_of(rv, node, &mut BTreeMap::new(), *rank, *wait)
                    .await?;
                Ok(AssemblyRef::remote(&RemoteAddr::new(
                    peer,
                    *target,
                    name.clone(),
                    *wait,
                )))
            }
        }
    }
}

/// Where a shard's part of each version goes.
pub(crate) enum Publish {
    /// Into shard 0's assembly (`links.sharded = "gather"`).
    Lead(LeadLink),
    /// Out of this rank's own mesh sender, for the engines to pull (`"mesh"`).
    Mesh(Arc<MeshPart>),
}

/// A shard other than shard 0: trains on each batch shard 0 hands it and writes its part
/// of the export into shard 0's assembly, or publishes it over the mesh.
pub(crate) struct ShardMember {
    model: ModelId,
    shard: usize,
    world: usize,
    rank: u32,
    learner: Addr<Trainer>,
    publish: Option<Publish>,
    deadline: Duration,
}

impl std::fmt::Debug for ShardMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardMember")
            .field("model", &self.model)
            .field("shard", &self.shard)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl ShardMember {
    /// Shard `shard` of `world` of `model`'s trainer, on rank `rank`.
    pub(crate) fn new(
        model: ModelId,
        (shard, world, rank): (usize, usize, u32),
        learner: Addr<Trainer>,
        publish: Publish,
        deadline: Duration,
    ) -> Self {
        Self {
            model,
            shard,
            world,
            rank,
            learner,
            publish: Some(publish),
            deadline,
        }
    }
}

impl Actor for ShardMember {
    type Context = Context<Self>;
}

impl Handler<TrainShard> for ShardMember {
    type Result = AtomicResponse<Self, Result<ShardWritten>>;

    fn handle(&mut self, msg: TrainShard, _: &mut Context<Self>) -> Self::Result {
        let publish = self.publish.take();
        let learner = self.learner.clone();
        let deadline = self.deadline;
        let (model, shard, world, rank) = (self.model.clone(), self.shard, self.world, self.rank);
        AtomicResponse::new(Box::pin(
            async move {
                let version = msg.version;
                let blame = |reason: String| Error::Shard {
                    model: model.clone(),
                    version,
                    shard,
                    rank,
                    reason,
                };
                if msg.model != model || msg.shard != shard {
                    let why = format!("was asked for shard {} of model `{}`", msg.shard, msg.model);
                    return (publish, Err(blame(why)));
                }
                let link = match publish {
                    Some(Publish::Mesh(part)) => {
                        let published =
                            train_and_publish(&learner, &part, msg, deadline, &blame).await;
                        if let Ok(w) = &published {
                            tracing::debug!(
                                "model `{model}` v{}: shard {shard} of {world} (rank {rank}) \
                                 trained and published its {} bytes over the mesh",
                                w.version,
                                w.bytes
                            );
                        }
                        return (Some(Publish::Mesh(part)), published);
                    }
                    Some(Publish::Lead(link)) => Some(link),
                    None => None,
                };
                let lead = match &link {
                    Some(l) => l.resolve().await,
                    None => Err(Error::Actor("no way to shard 0 is known".into())),
                };
                let lead = match lead {
                    Ok(l) => l,
                    Err(e) => {
                        let why = format!("cannot reach shard 0: {e}");
                        return (link.map(Publish::Lead), Err(blame(why)));
                    }
                };
                let written = train_and_write(&learner, &lead, msg, deadline, &blame).await;
                if let Ok(w) = &written {
                    tracing::debug!(
                        "model `{model}` v{}: shard {shard} of {world} (rank {rank}) trained and \
                         sent its {} bytes ({} chunk{})",
                        w.version,
                        w.bytes,
                        w.chunks,
                        if w.chunks == 1 { "" } else { "s" }
                    );
                }
                (Some(Publish::Lead(LeadLink::Ready(lead))), written)
            }
            .into_actor(self)
            .map(|(publish, written), act, _| {
                act.publish = publish;
                written
            }),
        ))
    }
}

/// Trains this shard's learner on `batch` and answers its export, or why not (blamed).
async fn train(
    learner: &Addr<Trainer>,
    batch: crate::batch::Batch,
    deadline: Duration,
    blame: &impl Fn(String) -> Error,
) -> Result<Arc<refit_runtime::WeightSet>> {
    let (_, export) = learner
        .send(Train { batch })
        .timeout(deadline)
        .await
        .map_err(|e| blame(format!("its learner did not answer: {e}")))?
        .map_err(|e| blame(format!("its learner failed: {e}")))?;
    Ok(export)
}

/// One update of a shard under a mesh: train, export, publish this shard's part.
async fn train_and_publish(
    learner: &Addr<Trainer>,
    part: &MeshPart,
    msg: TrainShard,
    deadline: Duration,
    blame: &impl Fn(String) -> Error,
) -> Result<ShardWritten> {
    let export = train(learner, msg.batch, deadline, blame).await?;
    let bytes = part
        .publish(&export)
        .map_err(|e| blame(format!("could not publish its part: {e}")))?;
    Ok(ShardWritten {
        version: export.version(),
        bytes,
        chunks: 0,
    })
}

/// One update of a shard: train, export, write the part `msg` names in chunks.
async fn train_and_write(
    learner: &Addr<Trainer>,
    lead: &AssemblyRef,
    msg: TrainShard,
    deadline: Duration,
    blame: &impl Fn(String) -> Error,
) -> Result<ShardWritten> {
    let export = train(learner, msg.batch, deadline, blame).await?;
    let start = usize::try_from(msg.offset).unwrap_or(usize::MAX);
    let len = usize::try_from(msg.len).unwrap_or(usize::MAX);
    let bytes = start
        .checked_add(len)
        .and_then(|end| export.bytes().get(start..end))
        .ok_or_else(|| {
            blame(format!(
                "exported {} bytes, which do not hold its part {}..+{}",
                export.bytes().len(),
                msg.offset,
                msg.len
            ))
        })?;
    let schema = export.manifest().schema_hash();
    // an empty part still sends one (empty) chunk: its version and layout are checked
    let chunks: Vec<&[u8]> = if bytes.is_empty() {
        vec![bytes]
    } else {
        bytes.chunks(CHUNK_BYTES).collect()
    };
    let mut offset = start;
    for c in &chunks {
        lead.write
            .send(WriteShard {
                model: msg.model.clone(),
                version: export.version(),
                shard: msg.shard,
                schema,
                offset: offset as u64,
                bytes: c.to_vec(),
            })
            .timeout(deadline)
            .await
            .map_err(|e| blame(format!("shard 0 did not take its part: {e}")))??;
        offset += c.len();
    }
    Ok(ShardWritten {
        version: export.version(),
        bytes: bytes.len() as u64,
        chunks: u32::try_from(chunks.len()).unwrap_or(u32::MAX),
    })
}
