//! The lead's stand-ins for the engine ranks: every engine rank reaches the controller
//! through its own [`RankGate`], which counts that rank's admitted rollouts, so that a rank
//! that dies mid-fragment does not leave the controller waiting for fragments that will
//! never come; the evaluator asks for actions and completions through an [`EngineRoute`],
//! which skips engines of dead ranks and takes rejoined ones back.

use std::collections::BTreeMap;

use actix::prelude::*;
use refit_runtime::ModelId;

use crate::error::{Error, Result};
use crate::generation::Completion;
use crate::protocol::controller::{Admission, AwaitRollout, RolloutDone};
use crate::protocol::engine::{ActBatch, ActedBatch, EngineHandle, Generate};

/// The rank behind a gate or route died: forget it.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub(crate) struct RankLost {
    /// The rank.
    pub(crate) rank: u32,
}

/// One engine rank's way to the controller.
pub(crate) struct RankGate {
    rank: u32,
    await_rollout: Recipient<AwaitRollout>,
    done: Recipient<RolloutDone>,
    in_flight: BTreeMap<ModelId, u64>,
    lost: bool,
}

impl std::fmt::Debug for RankGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankGate")
            .field("rank", &self.rank)
            .field("in_flight", &self.in_flight)
            .field("lost", &self.lost)
            .finish()
    }
}

impl RankGate {
    pub(crate) fn new(
        rank: u32,
        await_rollout: Recipient<AwaitRollout>,
        done: Recipient<RolloutDone>,
    ) -> Self {
        Self {
            rank,
            await_rollout,
            done,
            in_flight: BTreeMap::new(),
            lost: false,
        }
    }

    fn finish(&mut self, model: &ModelId) {
        let n = self.in_flight.entry(model.clone()).or_default();
        *n = n.saturating_sub(1);
        self.done.do_send(RolloutDone {
            model: model.clone(),
        });
    }
}

impl Actor for RankGate {
    type Context = Context<Self>;
}

impl Handler<AwaitRollout> for RankGate {
    type Result = ResponseActFuture<Self, Result<Admission>>;
    fn handle(&mut self, msg: AwaitRollout, _: &mut Context<Self>) -> Self::Result {
        if self.lost {
            let e = Error::Actor(format!("rank {} left the run", self.rank));
            return Box::pin(fut::ready(Err(e)));
        }
        let model = msg.model.clone();
        // the rank's engine is named by its rank in the controller's set: a fenced engine's
        // rollouts wait
        let ask = self.await_rollout.send(AwaitRollout {
            engine: Some(self.rank as usize),
            ..msg
        });
        Box::pin(ask.into_actor(self).map(move |r, act, _| {
            let admission = r.map_err(|e| Error::Actor(format!("controller: {e}")))??;
            *act.in_flight.entry(model.clone()).or_default() += 1;
            if act.lost {
                // admitted after its rank died: the fragment never comes
                act.finish(&model);
                return Err(Error::Actor(format!("rank {} left the run", act.rank)));
            }
            Ok(admission)
        }))
    }
}

impl Handler<RolloutDone> for RankGate {
    type Result = ();
    fn handle(&mut self, msg: RolloutDone, _: &mut Context<Self>) {
        if !self.lost {
            self.finish(&msg.model);
        }
    }
}

impl Handler<RankLost> for RankGate {
    type Result = ();
    fn handle(&mut self, _: RankLost, _: &mut Context<Self>) {
        self.lost = true;
        let in_flight = std::mem::take(&mut self.in_flight);
        for (model, n) in in_flight {
            if n > 0 {
                refit_runtime::unless_stopping!(warn, rank = self.rank, %model, "{n} rollouts of a lost rank are given up");
            }
            for _ in 0..n {
                self.done.do_send(RolloutDone {
                    model: model.clone(),
                });
            }
        }
    }
}

/// A rank's engine is back (it restarted and rejoined).
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub(crate) struct RankBack {
    /// The rank.
    pub(crate) rank: u32,
    /// Its engine.
    pub(crate) engine: EngineHandle,
}

/// Sends act and generate requests to the first engine whose rank is alive.
pub(crate) struct EngineRoute {
    engines: Vec<(u32, EngineHandle)>,
}

impl std::fmt::Debug for EngineRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranks: Vec<u32> = self.engines.iter().map(|e| e.0).collect();
        f.debug_struct("EngineRoute")
            .field("ranks", &ranks)
            .finish()
    }
}

impl EngineRoute {
    pub(crate) fn new(engines: Vec<(u32, EngineHandle)>) -> Self {
        Self { engines }
    }

    fn first(&self) -> Result<(u32, EngineHandle)> {
        self.engines
            .first()
            .cloned()
            .ok_or_else(|| Error::Actor("no engine is left to serve the evaluator".into()))
    }
}

impl Actor for EngineRoute {
    type Context = Context<Self>;
}

impl Handler<ActBatch> for EngineRoute {
    type Result = ResponseFuture<Result<ActedBatch>>;
    fn handle(&mut self, msg: ActBatch, _: &mut Context<Self>) -> Self::Result {
        let first = self.first();
        Box::pin(async move {
            let (rank, engine) = first?;
            engine
                .act()?
                .act
                .send(msg)
                .await
                .map_err(|e| Error::Actor(format!("the engine of rank {rank}: {e}")))?
        })
    }
}

impl Handler<Generate> for EngineRoute {
    type Result = ResponseFuture<Result<Completion>>;
    fn handle(&mut self, msg: Generate, _: &mut Context<Self>) -> Self::Result {
        let first = self.first();
        Box::pin(async move {
            let (rank, engine) = first?;
            engine
                .generate()?
                .generate
                .send(msg)
                .await
                .map_err(|e| Error::Actor(format!("the engine of rank {rank}: {e}")))?
        })
    }
}

impl Handler<RankLost> for EngineRoute {
    type Result = ();
    fn handle(&mut self, msg: RankLost, _: &mut Context<Self>) {
        self.engines.retain(|(r, _)| *r != msg.rank);
    }
}

impl Handler<RankBack> for EngineRoute {
    type Result = ();
    fn handle(&mut self, msg: RankBack, _: &mut Context<Self>) {
        self.engines.retain(|(r, _)| *r != msg.rank);
        self.engines.push((msg.rank, msg.engine));
    }
}
