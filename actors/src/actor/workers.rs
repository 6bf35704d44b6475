//! Actors that wrap the plain-Rust collector and a [`Learner`] on their own threads.

use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use refit_runtime::{Version, WeightSet};

use crate::batch::Batch;
use crate::collector::{Collector, UpdatePolicyWeights};
use crate::env::Env;
use crate::error::{Error, Result};
use crate::learner::{LearnStats, Learner};
use crate::link::WeightOutlet;
use crate::policy::Policy;

use crate::protocol::engine::LoadWeights;
use crate::protocol::trainer::{PublishWeights, SaveState, Train, TrainAndPublish};

/// Asks a worker for one batch.
#[derive(Debug, Message)]
#[rtype(result = "Result<Option<Batch>>")]
pub struct CollectBatch;

/// Collects batches with a [`Collector`] on its own thread.
pub struct CollectorWorker<E: Env, P: Policy> {
    collector: Collector<E, P>,
}

impl<E: Env, P: Policy> std::fmt::Debug for CollectorWorker<E, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollectorWorker")
            .field("frames", &self.collector.frames())
            .finish()
    }
}

impl<E: Env + Unpin + 'static, P: Policy + Unpin + 'static> CollectorWorker<E, P> {
    /// Starts a worker on its own thread; `make` builds the collector there.
    pub fn start(make: impl Fn() -> Collector<E, P> + Send + Sync + 'static) -> Addr<Self> {
        SyncArbiter::start(1, move || Self { collector: make() })
    }
}

impl<E: Env + Unpin + 'static, P: Policy + Unpin + 'static> Actor for CollectorWorker<E, P> {
    type Context = SyncContext<Self>;
}

impl<E: Env + Unpin + 'static, P: Policy + Unpin + 'static> Handler<CollectBatch>
    for CollectorWorker<E, P>
{
    type Result = Result<Option<Batch>>;
    fn handle(&mut self, _: CollectBatch, _: &mut SyncContext<Self>) -> Self::Result {
        Ok(self.collector.next_batch()?)
    }
}

impl<E: Env + Unpin + 'static, P: Policy + Unpin + 'static> Handler<LoadWeights>
    for CollectorWorker<E, P>
{
    type Result = Result<Version>;
    fn handle(&mut self, msg: LoadWeights, _: &mut SyncContext<Self>) -> Result<Version> {
        self.collector.update_weights((*msg.weights).clone())?;
        Ok(self.collector.policy_version())
    }
}

/// The trainer actor: hosts a [`Learner`] on its own thread, optionally publishing through
/// a [`WeightOutlet`].
pub struct Trainer {
    learner: Option<Box<dyn Learner>>,
    outlet: Option<Box<dyn WeightOutlet>>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("version", &self.learner.as_ref().map(|l| l.version()))
            .finish()
    }
}

impl Trainer {
    /// Starts a trainer on its own thread; `make` builds its learner there.
    pub fn start<L: Learner + 'static>(make: impl Fn() -> L + Send + Sync + 'static) -> Addr<Self> {
        SyncArbiter::start(1, move || Self {
            learner: Some(Box::new(make())),
            outlet: None,
        })
    }

    /// Starts a trainer that publishes every version of `learner` through `outlet`.
    pub fn start_with_outlet(
        learner: Box<dyn Learner>,
        outlet: Box<dyn WeightOutlet>,
    ) -> Addr<Self> {
        Self::hosting(learner, Some(outlet))
    }

    /// Starts `learner` (and `outlet`, if any) on a thread of its own.
    pub(crate) fn hosting(
        learner: Box<dyn Learner>,
        outlet: Option<Box<dyn WeightOutlet>>,
    ) -> Addr<Self> {
        let slot = std::sync::Mutex::new(Some((learner, outlet)));
        SyncArbiter::start(1, move || {
            let taken = slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            // A sync arbiter builds its actor again only if it stopped; the state is gone
            // then, and every request says so.
            let (learner, outlet) = taken.map_or((None, None), |(l, o)| (Some(l), o));
            Self { learner, outlet }
        })
    }

    fn learner(&mut self) -> Result<&mut Box<dyn Learner>> {
        self.learner.as_mut().ok_or_else(|| {
            Error::Actor("the trainer actor was restarted and its learner state is lost".into())
        })
    }

    fn publish_weights(&mut self, weights: Arc<WeightSet>) -> Result<Version> {
        match &mut self.outlet {
            Some(o) => Ok(o.publish(weights)?),
            None => Err(Error::Config(
                "this trainer has no outlet (start it with start_with_outlet)".into(),
            )),
        }
    }
}

impl Handler<TrainAndPublish> for Trainer {
    type Result = Result<(LearnStats, Version)>;
    /// Trains, exports and publishes; the stats carry the learner's values plus the export
    /// and publish times and the version's size ([`LearnStats::PUBLISH_S`] and the others).
    fn handle(&mut self, msg: TrainAndPublish, _: &mut SyncContext<Self>) -> Self::Result {
        let mut stats = self.learner()?.update(&msg.batch)?;
        let started = Instant::now();
        let weights = Arc::new(self.learner()?.export()?);
        let exported = started.elapsed();
        let bytes = weights.bytes().len();
        // held until the publish is timed: giving a large export's memory back to the system
        // (an munmap, tens of milliseconds per GiB) is the trainer's housekeeping, not part
        // of delivering the version
        let export = Arc::clone(&weights);
        let version = self.publish_weights(weights)?;
        let published = started.elapsed() - exported;
        drop(export);
        stats.insert(LearnStats::EXPORT_S, exported.as_secs_f64());
        stats.insert(LearnStats::PUBLISH_S, published.as_secs_f64());
        stats.insert(LearnStats::BYTES, bytes as f64);
        Ok((stats, version))
    }
}

impl Actor for Trainer {
    type Context = SyncContext<Self>;
}

impl Handler<PublishWeights> for Trainer {
    type Result = Result<Version>;
    fn handle(&mut self, msg: PublishWeights, _: &mut SyncContext<Self>) -> Result<Version> {
        self.publish_weights(msg.0)
    }
}

impl Handler<Train> for Trainer {
    type Result = Result<(LearnStats, Arc<WeightSet>)>;
    fn handle(&mut self, msg: Train, _: &mut SyncContext<Self>) -> Self::Result {
        let learner = self.learner()?;
        let stats = learner.update(&msg.batch)?;
        Ok((stats, Arc::new(learner.export()?)))
    }
}

impl Handler<SaveState> for Trainer {
    type Result = Result<WeightSet>;
    fn handle(&mut self, _: SaveState, _: &mut SyncContext<Self>) -> Self::Result {
        Ok(self.learner()?.save()?)
    }
}
