//! The trainer's protocol: a model's driver hands it batches (the trainer runs on a thread
//! of its own, beside the driver, in the process that holds the model's trainer role).

use std::sync::Arc;

use actix::prelude::*;
use refit_runtime::{Version, WeightSet};

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

/// One update, then the new version goes out through the trainer's outlet; answers the
/// learner's stats and the published version.
#[derive(Debug, Message)]
#[rtype(result = "Result<(LearnStats, Version)>")]
pub struct TrainAndPublish {
    /// The batch.
    pub batch: Batch,
}
