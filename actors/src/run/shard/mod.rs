//! A sharded trainer: a trainer process with `replicas = N` is N ranks (shards) training one
//! model, whose versions are assembled from the parts the N processes write.
//!
//! Every shard builds the model's learner (same seed: the same first weights). Shard 0 (the
//! first of the model's trainer ranks) keeps what a trainer of one rank has: the pool, the
//! driver, the weight links and their outlet. For each update the driver's batch goes to
//! every shard (shard 0's [`ShardLead`] sends [`TrainShard`] to each other shard's
//! [`ShardMember`]); each trains on it, exports, and writes its byte range of the export
//! into shard 0's [`Assembly`] (a `ShardedBuffer` of N writers): shard 0 from memory, the
//! others in [`WriteShard`] chunks over their node connection to shard 0. Once all N parts
//! are in, shard 0 closes the version and publishes it through the outlet: one version,
//! assembled from N processes.
//!
//! Bounded failures: a shard that is gone, misses the deadline (`run.wait_s` from the start
//! of the update), or writes a part of another version, layout or size fails the update
//! with [`Error::Shard`] naming it (its index and rank) and the version; nothing is
//! published and the previous version stays served.

mod assembly;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_node::Node;
use refit_runtime::topology::Topology;
use refit_runtime::wire::MAX_CONTROL_MESSAGE;
use refit_runtime::{ModelId, Version, WeightSet};
use uuid::Uuid;

use crate::error::{Error, RemoteFailure, Result};
use crate::learner::{LearnStats, Learner};
use crate::link::WeightOutlet;
use crate::protocol::trainer::{
    AssemblyRef, ShardRef, ShardWritten, Train, TrainAndPublish, TrainShard, WriteShard,
};
use crate::remote::RemoteAddr;
use crate::roles::ModelSpec;

pub(crate) use assembly::{Assembly, Chunk};

use super::ids::{Served, actor_id};
use super::rendezvous::Rendezvous;
use super::workload::Workload;

/// The most bytes of a part one [`WriteShard`] carries: well under the node's frame limit
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

// ---------------------------------------------------------------------------------------
// The learner's thread

/// Publishes an assembled version through the outlet (on shard 0's learner thread).
#[derive(Debug, Message)]
#[rtype(result = "Result<Version>")]
struct Publish(Arc<WeightSet>);

/// A shard's learner on a thread of its own; shard 0's holds the model's outlet too.
pub(crate) struct ShardLearner {
    learner: Option<Box<dyn Learner>>,
    outlet: Option<Box<dyn WeightOutlet>>,
}

impl std::fmt::Debug for ShardLearner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardLearner")
            .field("version", &self.learner.as_ref().map(|l| l.version()))
            .field("outlet", &self.outlet.is_some())
            .finish()
    }
}

impl ShardLearner {
    /// Starts `learner` (and `outlet`) on a thread of its own.
    pub(crate) fn start(
        learner: Box<dyn Learner>,
        outlet: Option<Box<dyn WeightOutlet>>,
    ) -> Addr<Self> {
        let slot = std::sync::Mutex::new(Some((learner, outlet)));
        SyncArbiter::start(1, move || {
            // a sync arbiter builds its actor again only if it stopped: the state is gone
            // then, and every request says so
            let taken = slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            let (learner, outlet) = taken.map_or((None, None), |(l, o)| (Some(l), o));
            Self { learner, outlet }
        })
    }

    fn learner(&mut self) -> Result<&mut Box<dyn Learner>> {
        self.learner.as_mut().ok_or_else(|| {
            Error::Actor("a shard's learner thread was restarted and its state is lost".into())
        })
    }
}

impl Actor for ShardLearner {
    type Context = SyncContext<Self>;
}

impl Handler<Train> for ShardLearner {
    type Result = Result<(LearnStats, Arc<WeightSet>)>;
    fn handle(&mut self, msg: Train, _: &mut SyncContext<Self>) -> Self::Result {
        let learner = self.learner()?;
        let stats = learner.update(&msg.batch)?;
        Ok((stats, Arc::new(learner.export()?)))
    }
}

impl Handler<Publish> for ShardLearner {
    type Result = Result<Version>;
    fn handle(&mut self, Publish(weights): Publish, _: &mut SyncContext<Self>) -> Result<Version> {
        match &mut self.outlet {
            Some(o) => o.publish(weights),
            None => Err(Error::Config(
                "this shard has no outlet (shard 0 publishes)".into(),
            )),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Shard 0

/// Shard 0 of a sharded trainer: the driver's trainer (it answers [`TrainAndPublish`]) and
/// the assembly the other shards write their parts into ([`WriteShard`]).
pub(crate) struct ShardLead {
    model: ModelId,
    assembly: Assembly,
    learner: Addr<ShardLearner>,
    /// Shards 1.. (shard `i + 1` at `i`).
    members: Vec<ShardRef>,
    published: Version,
    deadline: Duration,
    busy: bool,
}

impl std::fmt::Debug for ShardLead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardLead")
            .field("model", &self.model)
            .field("world", &self.assembly.world())
            .field("published", &self.published)
            .finish_non_exhaustive()
    }
}

impl ShardLead {
    /// Shard 0 of `assembly`'s model: its learner (with the outlet), the other shards in
    /// order, the deadline of one update's shards.
    pub(crate) fn new(
        assembly: Assembly,
        learner: Addr<ShardLearner>,
        members: Vec<ShardRef>,
        published: Version,
        deadline: Duration,
    ) -> Self {
        Self {
            model: assembly.model().clone(),
            assembly,
            learner,
            members,
            published,
            deadline,
            busy: false,
        }
    }

    /// Takes what every shard answered for `version` and closes it: shard 0's export is
    /// written here; a shard that failed is named (the first one, in shard order).
    fn settle(
        &mut self,
        version: Version,
        local: std::result::Result<Result<(LearnStats, Arc<WeightSet>)>, MailboxError>,
        remote: Vec<(
            usize,
            std::result::Result<Result<ShardWritten>, MailboxError>,
        )>,
    ) -> Result<(LearnStats, Arc<WeightSet>)> {
        let deadline = self.deadline;
        let stats = match local {
            Ok(Ok((stats, export))) => {
                // a refusal is kept in the assembly, which names it at the close
                let _ = self.assembly.write_export(0, &export);
                Some(stats)
            }
            Ok(Err(e)) => {
                self.assembly.fail(0, format!("failed: {e}"));
                None
            }
            Err(e) => {
                self.assembly.fail(0, unanswered(e, deadline));
                None
            }
        };
        for (shard, answer) in remote {
            match answer {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => self.assembly.fail(shard, remote_failed(&e)),
                Err(e) => self.assembly.fail(shard, unanswered(e, deadline)),
            }
        }
        let closed = self.assembly.close()?;
        let world = self.assembly.world();
        for s in 0..world {
            let r = self.assembly.range(s);
            tracing::debug!(
                "model `{}` v{version}: shard {s} of {world} (rank {}) wrote bytes {}..{}",
                self.model,
                self.assembly.rank(s),
                r.start,
                r.end
            );
        }
        let stats = stats.ok_or_else(|| {
            self.assembly
                .blame(version, 0, "has no statistics of its update")
        })?;
        Ok((stats, closed))
    }
}

/// Why a shard's request got no answer.
fn unanswered(e: MailboxError, deadline: Duration) -> String {
    match e {
        MailboxError::Timeout => format!("missed the deadline: no answer within {deadline:?}"),
        MailboxError::Closed => "is gone: its shard actor stopped".into(),
    }
}

/// What a shard's failed request says.
fn remote_failed(e: &Error) -> String {
    match e.remote_failure() {
        Some(RemoteFailure::Timeout { after }) => {
            format!("missed the deadline: no answer within {after:?}")
        }
        Some(RemoteFailure::PeerGone { reason }) => format!("is gone: {reason}"),
        Some(RemoteFailure::ActorStopped { reason }) => {
            format!("is gone: its shard actor stopped ({reason})")
        }
        Some(RemoteFailure::Failed { error }) => format!("failed: {error}"),
        _ => format!("failed: {e}"),
    }
}

impl Actor for ShardLead {
    type Context = Context<Self>;
}

impl Handler<TrainAndPublish> for ShardLead {
    type Result = ResponseActFuture<Self, Result<(LearnStats, Version)>>;

    fn handle(&mut self, msg: TrainAndPublish, _: &mut Context<Self>) -> Self::Result {
        if self.busy {
            return Box::pin(fut::ready(Err(Error::Actor(format!(
                "model `{}`: the sharded trainer is already in an update",
                self.model
            )))));
        }
        let version = self.published.next();
        if let Err(e) = self.assembly.open(version) {
            return Box::pin(fut::ready(Err(e)));
        }
        self.busy = true;
        let deadline = self.deadline;
        // every shard gets the batch now; they train side by side
        let calls: Vec<_> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let shard = i + 1;
                let r = self.assembly.range(shard);
                let call = m
                    .train
                    .send(TrainShard {
                        model: self.model.clone(),
                        version,
                        shard,
                        offset: r.start as u64,
                        len: r.len() as u64,
                        batch: msg.batch.clone(),
                    })
                    .timeout(deadline);
                (shard, call)
            })
            .collect();
        let local = self
            .learner
            .send(Train { batch: msg.batch })
            .timeout(deadline);
        let learner = self.learner.clone();
        Box::pin(
            async move {
                let local = local.await;
                let mut remote = Vec::with_capacity(calls.len());
                for (shard, call) in calls {
                    remote.push((shard, call.await));
                }
                (local, remote)
            }
            .into_actor(self)
            .then(move |(local, remote), act, _| {
                let settled = act.settle(version, local, remote);
                let model = act.model.clone();
                async move {
                    let (stats, weights) = settled?;
                    let published = learner
                        .send(Publish(weights))
                        .timeout(deadline)
                        .await
                        .map_err(|e| {
                            Error::Actor(format!(
                                "model `{model}` v{version}: publishing the assembled version: {e}"
                            ))
                        })??;
                    Ok::<_, Error>((stats, published))
                }
                .into_actor(act)
            })
            .map(|res: Result<(LearnStats, Version)>, act, _| {
                act.busy = false;
                if let Ok((_, v)) = &res {
                    act.published = *v;
                }
                res
            }),
        )
    }
}

impl Handler<WriteShard> for ShardLead {
    type Result = Result<()>;

    fn handle(&mut self, w: WriteShard, _: &mut Context<Self>) -> Result<()> {
        let version = self.assembly.open_version().unwrap_or(w.version);
        if w.model != self.model {
            return Err(self.assembly.blame(
                version,
                w.shard,
                format!("wrote a part of model `{}`", w.model),
            ));
        }
        let offset = usize::try_from(w.offset).map_err(|_| {
            self.assembly
                .blame(version, w.shard, format!("wrote at offset {}", w.offset))
        })?;
        self.assembly.write(Chunk {
            version: w.version,
            shard: w.shard,
            schema: w.schema,
            offset,
            bytes: &w.bytes,
        })
    }
}

// ---------------------------------------------------------------------------------------
// The other shards

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
    async fn resolve(self) -> Result<AssemblyRef> {
        match self {
            Self::Ready(r) => Ok(r),
            Self::Find {
                rv,
                node,
                rank,
                target,
                name,
                wait,
            } => {
                let peer =
                    super::rank::peer_of(&rv, &node, &mut BTreeMap::new(), rank, wait).await?;
                Ok(AssemblyRef::remote(&RemoteAddr::new(
                    peer, target, name, wait,
                )))
            }
        }
    }
}

/// A shard other than shard 0: trains on each batch shard 0 hands it and writes its part
/// of the export into shard 0's assembly.
pub(crate) struct ShardMember {
    model: ModelId,
    shard: usize,
    world: usize,
    rank: u32,
    learner: Addr<ShardLearner>,
    link: Option<LeadLink>,
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
        learner: Addr<ShardLearner>,
        link: LeadLink,
        deadline: Duration,
    ) -> Self {
        Self {
            model,
            shard,
            world,
            rank,
            learner,
            link: Some(link),
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
        let link = self.link.take();
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
                    return (link, Err(blame(why)));
                }
                let lead = match link {
                    Some(l) => l.resolve().await,
                    None => Err(blame("lost its way to shard 0".into())),
                };
                let lead = match lead {
                    Ok(l) => l,
                    Err(e) => return (None, Err(blame(format!("cannot reach shard 0: {e}")))),
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
                (Some(LeadLink::Ready(lead)), written)
            }
            .into_actor(self)
            .map(|(link, written), act, _| {
                if link.is_some() {
                    act.link = link;
                }
                written
            }),
        ))
    }
}

/// One update of a shard: train, export, write the part `msg` names in chunks.
async fn train_and_write(
    learner: &Addr<ShardLearner>,
    lead: &AssemblyRef,
    msg: TrainShard,
    deadline: Duration,
    blame: &impl Fn(String) -> Error,
) -> Result<ShardWritten> {
    let (_, export) = learner
        .send(Train { batch: msg.batch })
        .timeout(deadline)
        .await
        .map_err(|e| blame(format!("its learner did not answer: {e}")))?
        .map_err(|e| blame(format!("its learner failed: {e}")))?;
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

// ---------------------------------------------------------------------------------------
// Setting up

/// The models `site`'s rank holds a shard other than 0 of: a learner each (exporting its
/// first version, as shard 0 does), served as `Served::Shard` for shard 0 to call. Keep
/// the answer alive for the rank's life.
///
/// # Errors
/// A rank that restarted (a shard's learner state cannot be rebuilt); the roles' learner
/// failing, or exporting anything but version 1 of its model.
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
        let first = learner.export()?;
        if first.model() != &spec.id || first.version() != Version(1) {
            return Err(Error::Config(format!(
                "the learner of model `{}` exported its first weights as model `{}` v{} \
                 (a fresh learner exports v1 of its own model)",
                spec.id,
                first.model(),
                first.version()
            )));
        }
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
        let member = ShardMember::new(
            spec.id.clone(),
            (shard, ranks.len(), site.me),
            ShardLearner::start(learner, None),
            link,
            site.wait,
        )
        .start();
        ShardRef::local(&member).serve(site.node, actor_id(Served::Shard, site.me, mi, 0));
        tracing::info!(
            "{}: pid {}, shard {shard} of {} of model `{}`'s trainer (rank {lead} assembles and \
             publishes)",
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
/// `Served::Shard`, and answers the trainer its driver calls.
///
/// # Errors
/// A shard's rank that does not join in time or cannot be reached; a learner whose layout
/// cannot be cut into shards.
pub(crate) async fn start_lead(
    site: &ShardSite<'_>,
    spec: &ModelSpec,
    learner: Box<dyn Learner>,
    outlet: Box<dyn WeightOutlet>,
) -> Result<Recipient<TrainAndPublish>> {
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
        let peer = super::rank::peer_of(site.rv, site.node, &mut peers, *r, site.wait).await?;
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
    let published = learner.version();
    let lead = ShardLead::new(
        assembly,
        ShardLearner::start(learner, Some(outlet)),
        members,
        published,
        site.wait,
    )
    .start();
    AssemblyRef::local(&lead).serve(site.node, actor_id(Served::Shard, site.me, mi, 0));
    tracing::info!(
        "{}: model `{}` is trained by {} shards, each version assembled here from {}",
        site.who,
        spec.id,
        ranks.len(),
        parts.join(", ")
    );
    Ok(lead.recipient())
}

#[cfg(test)]
mod tests;
