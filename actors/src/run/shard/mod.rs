//! A sharded trainer: a trainer process with `replicas = N` is N ranks (shards) training one
//! model, whose versions are assembled from the parts the N processes write.
//!
//! Every shard builds the model's learner (same seed: the same first weights). Shard 0 (the
//! first of the model's trainer ranks) keeps what a trainer of one rank has: the pool, the
//! driver, the weight links and their outlet. For each update the driver's batch goes to
//! every shard (shard 0's [`ShardLead`] sends
//! [`TrainShard`](crate::protocol::trainer::TrainShard) to each other shard's [`ShardMember`]); each trains on it, exports, and writes its byte range of the export
//! into shard 0's [`Assembly`] (a `ShardedBuffer` of N writers): shard 0 from memory, the
//! others in [`WriteShard`](crate::protocol::trainer::WriteShard) chunks over their node connection to shard 0. Once all N parts
//! are in, shard 0 closes the version and publishes it through the outlet: one version,
//! assembled from N processes.
//!
//! Bounded failures: a shard that is gone, misses the deadline (`run.wait_s` from the start
//! of the update), or writes a part of another version, layout or size fails the update
//! with [`Error::Shard`](crate::Error::Shard) naming it (its index and rank) and the version; nothing is
//! published and the previous version stays served.

mod assembly;
mod lead;
mod member;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_node::Node;
use refit_runtime::topology::Topology;
use refit_runtime::wire::MAX_CONTROL_MESSAGE;

use crate::error::{Error, Result};
use crate::learner::Learner;
use crate::link::WeightOutlet;
use crate::protocol::trainer::{AssemblyRef, SaveState, ShardRef, TrainAndPublish};
use crate::remote::RemoteAddr;
use crate::roles::ModelSpec;
use crate::run::mesh::MeshPart;

use crate::actor::Trainer;
use assembly::Assembly;
use lead::ShardLead;
use member::{LeadLink, Publish, ShardMember};

use super::checkpoint;
use super::ids::{Served, actor_id};
use super::rendezvous::Rendezvous;
use super::workload::Workload;

/// The most bytes of a part one [`WriteShard`](crate::protocol::trainer::WriteShard) carries: well under the node's frame limit
/// (the message's own fields and msgpack framing fit in the rest).
pub(crate) const CHUNK_BYTES: usize = 4 << 20;
const _: () = assert!(CHUNK_BYTES * 2 <= MAX_CONTROL_MESSAGE);

/// What a rank sets its shards up with.
pub(crate) struct ShardSite<'a> {
    pub(crate) topo: &'a Topology,
    /// This rank.
    pub(crate) me: u32,
    /// This rank, for messages.
    pub(crate) who: &'a str,
    pub(crate) node: &'a Node,
    pub(crate) rv: &'a Rendezvous,
    /// The deadline of one update's shards (`run.wait_s`).
    pub(crate) wait: Duration,
}

/// The models `site`'s rank holds a shard other than 0 of: a learner each (exporting its
/// first version, as shard 0 does), served as `Served::Shard` for shard 0 to call. Keep
/// the answer alive for the rank's life.
///
/// # Errors
/// A rank that restarted (a shard's learner state cannot be rebuilt); the roles' learner
/// failing, or exporting anything but the run's first version of its model; with
/// `[checkpoint] resume`, a checkpoint that cannot be restored.
pub(crate) fn start_members(
    site: &ShardSite<'_>,
    specs: &[ModelSpec],
    work: &Arc<dyn Workload>,
    rejoining: bool,
) -> Result<Vec<Addr<ShardMember>>> {
    let mut members = Vec::new();
    for spec in specs {
        let ranks = site.topo.trainer_ranks(&spec.id);
        let Some(shard) = ranks.iter().position(|r| *r == site.me).filter(|s| *s > 0) else {
            continue;
        };
        if rejoining {
            return Err(Error::Config(format!(
                "{} holds shard {shard} of model `{}`'s trainer and cannot rejoin a running run",
                site.who, spec.id
            )));
        }
        let mut learner = work.learner(spec)?;
        let resumed = checkpoint::restore(site.topo, site.who, spec, learner.as_mut())?;
        let first = crate::run::workload::first_export(learner.as_mut(), spec, resumed)?;
        // under a mesh this shard publishes its own part of every version, the first now
        let mesh = if site.topo.publishes_over_mesh(&spec.id) {
            let part = MeshPart::open(
                site.node,
                site.rv,
                &spec.id,
                Arc::clone(first.manifest()),
                (shard, ranks.len()),
            )?;
            part.publish(&first)?;
            Some(Arc::new(part))
        } else {
            None
        };
        let mi = site.topo.model_index(&spec.id).unwrap_or(0);
        let lead = ranks[0];
        let link = LeadLink::Find {
            rv: site.rv.clone(),
            node: site.node.clone(),
            rank: lead,
            target: actor_id(Served::Shard, lead, mi, 0),
            name: format!("assembly of model `{}` on rank {lead}", spec.id),
            wait: site.wait,
        };
        let publishes = match &mesh {
            Some(_) => "publishes its part over the mesh".to_string(),
            None => format!("rank {lead} assembles and publishes"),
        };
        let member = ShardMember::new(
            spec.id.clone(),
            (shard, ranks.len(), site.me),
            Trainer::hosting(learner, None),
            match mesh {
                Some(part) => Publish::Mesh(part),
                None => Publish::Lead(link),
            },
            site.wait,
        )
        .start();
        ShardRef::local(&member).serve(site.node, actor_id(Served::Shard, site.me, mi, 0));
        tracing::info!(
            "{}: pid {}, shard {shard} of {} of model `{}`'s trainer ({publishes})",
            site.who,
            std::process::id(),
            ranks.len(),
            spec.id
        );
        members.push(member);
    }
    Ok(members)
}

/// Shard 0 of `spec`'s sharded trainer on `site`'s rank: connects to the other shards
/// (waiting, until `site.wait`, for their ranks' cards), serves the assembly as
/// `Served::Shard`, and answers the trainer its driver calls and what saves the
/// trainer's state (shard 0's: every shard holds the same).
///
/// # Errors
/// A shard's rank that does not join in time or cannot be reached; a learner whose layout
/// cannot be cut into shards.
pub(crate) async fn start_lead(
    site: &ShardSite<'_>,
    spec: &ModelSpec,
    learner: Box<dyn Learner>,
    outlet: Box<dyn WeightOutlet>,
) -> Result<(Recipient<TrainAndPublish>, Recipient<SaveState>)> {
    let ranks = site.topo.trainer_ranks(&spec.id);
    let mi = site.topo.model_index(&spec.id).unwrap_or(0);
    let assembly = Assembly::new(
        spec.id.clone(),
        learner.manifest(),
        ranks.clone(),
        learner.version(),
    )?;
    let mut peers = BTreeMap::new();
    let mut members = Vec::new();
    for (shard, r) in ranks.iter().enumerate().skip(1) {
        let peer = super::peers::peer_of(site.rv, site.node, &mut peers, *r, site.wait).await?;
        let addr = RemoteAddr::new(
            peer,
            actor_id(Served::Shard, *r, mi, 0),
            format!("shard {shard} of model `{}`'s trainer on rank {r}", spec.id),
            site.wait,
        );
        members.push(ShardRef::remote(&addr));
    }
    let parts: Vec<String> = (0..ranks.len())
        .map(|s| {
            let r = assembly.range(s);
            format!(
                "shard {s} (rank {}) bytes {}..{}",
                assembly.rank(s),
                r.start,
                r.end
            )
        })
        .collect();
    let trainer = Trainer::hosting(learner, Some(outlet));
    let save = trainer.clone().recipient();
    let mesh = site.topo.publishes_over_mesh(&spec.id);
    let lead = ShardLead::new(assembly, trainer, members, (site.wait, mesh)).start();
    AssemblyRef::local(&lead).serve(site.node, actor_id(Served::Shard, site.me, mi, 0));
    if mesh {
        tracing::info!(
            "{}: model `{}` is trained by {} shards, each publishing its own part of every \
             version over the mesh (nothing is gathered here)",
            site.who,
            spec.id,
            ranks.len()
        );
    } else {
        tracing::info!(
            "{}: model `{}` is trained by {} shards, each version assembled here from {}",
            site.who,
            spec.id,
            ranks.len(),
            parts.join(", ")
        );
    }
    Ok((lead.recipient(), save))
}

#[cfg(test)]
mod tests;
