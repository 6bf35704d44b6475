//! Shard 0 of a sharded trainer: the driver's trainer, and the assembly the other shards
//! write their parts into.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::{Version, WeightSet};

use crate::error::{Error, RemoteFailure, Result};
use crate::learner::LearnStats;
use crate::protocol::trainer::{
    ShardRef, ShardWritten, Train, TrainAndPublish, TrainShard, WriteShard,
};

use super::assembly::{Assembly, Chunk};
use crate::actor::Trainer;
use crate::protocol::trainer::PublishWeights;

/// Shard 0 of a sharded trainer: the driver's trainer (it answers [`TrainAndPublish`]) and
/// the assembly the other shards write their parts into ([`WriteShard`]).
pub(crate) struct ShardLead {
    assembly: Assembly,
    learner: Addr<Trainer>,
    /// Shards 1.. (shard `i + 1` at `i`).
    members: Vec<ShardRef>,
    deadline: Duration,
    busy: bool,
    /// Every shard publishes its own part (`links.sharded = "mesh"`): nothing is written
    /// into the assembly, which only keeps count.
    mesh: bool,
}

impl std::fmt::Debug for ShardLead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardLead")
            .field("model", self.assembly.model())
            .field("world", &self.assembly.world())
            .field("published", &self.assembly.closed())
            .finish_non_exhaustive()
    }
}

impl ShardLead {
    /// Shard 0 of `assembly`'s model: its learner (with the outlet), the other shards in
    /// order, the deadline of one update's shards.
    pub(crate) fn new(
        assembly: Assembly,
        learner: Addr<Trainer>,
        members: Vec<ShardRef>,
        (deadline, mesh): (Duration, bool),
    ) -> Self {
        Self {
            assembly,
            learner,
            members,
            deadline,
            busy: false,
            mesh,
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
        let mut own = None;
        let stats = match local {
            Ok(Ok((stats, export))) if self.mesh => {
                // shard 0's part goes out through its outlet once the version closes
                self.assembly.published(0, export.version());
                own = Some(export);
                Some(stats)
            }
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
                Ok(Ok(w)) if self.mesh => self.assembly.published(shard, w.version),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => self.assembly.fail(shard, remote_failed(&e)),
                Err(e) => self.assembly.fail(shard, unanswered(e, deadline)),
            }
        }
        let closed = match own {
            Some(export) => {
                self.assembly.close_published()?;
                export
            }
            None if self.mesh => {
                // shard 0 failed (recorded above): the check names the first shard at fault
                let named = self.assembly.check_whole().err();
                return Err(named.unwrap_or_else(|| {
                    self.assembly
                        .blame(version, 0, "has no export of its update")
                }));
            }
            None => self.assembly.close()?,
        };
        let world = self.assembly.world();
        // under a mesh nothing was written here: the shards said what they published
        if !self.mesh {
            for s in 0..world {
                let r = self.assembly.range(s);
                tracing::debug!(
                    "model `{}` v{version}: shard {s} of {world} (rank {}) wrote bytes {}..{}",
                    self.assembly.model(),
                    self.assembly.rank(s),
                    r.start,
                    r.end
                );
            }
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
                self.assembly.model()
            )))));
        }
        let version = self.assembly.closed().next();
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
                        model: self.assembly.model().clone(),
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
                let model = act.assembly.model().clone();
                async move {
                    let (stats, weights) = settled?;
                    let published = learner
                        .send(PublishWeights(weights))
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
                if let Err(e) = &res {
                    tracing::warn!(
                        "{e}; v{} stays the last version published",
                        act.assembly.closed()
                    );
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
        if &w.model != self.assembly.model() {
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
