//! A shard's learner on a thread of its own (shard 0's holds the model's outlet too).

use std::sync::Arc;

use actix::prelude::*;
use refit_runtime::{Version, WeightSet};

use crate::error::{Error, Result};
use crate::learner::{LearnStats, Learner};
use crate::link::WeightOutlet;
use crate::protocol::trainer::Train;

/// Publishes an assembled version through the outlet (on shard 0's learner thread).
#[derive(Debug, Message)]
#[rtype(result = "Result<Version>")]
pub(super) struct Publish(pub(super) Arc<WeightSet>);

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
