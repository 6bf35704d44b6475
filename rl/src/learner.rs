//! The learner role: turns batches into new versions of a model's weights.
//!
//! A [`Learner`] is the user code a trainer hosts (the `Trainer` actor holds a
//! `Box<dyn Learner>`): it trains on a [`Batch`], answers what it measured as [`LearnStats`]
//! (named numbers, so the framework never needs to know the algorithm), and exports its
//! policy as a versioned [`WeightSet`] whose layout is its [`manifest`](Learner::manifest).
//! `PpoTrainer` (feature `candle`) is one implementation.

use std::collections::BTreeMap;
use std::sync::Arc;

use refit_runtime::{Manifest, Version, WeightSet};
use serde::{Deserialize, Serialize};

use crate::batch::Batch;
use crate::error::{Error, Result};

/// What one [`Learner::update`] measured: named values (losses, entropy, samples, seconds),
/// in name order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LearnStats {
    /// The values, by name.
    pub values: BTreeMap<String, f64>,
}

impl LearnStats {
    /// No values.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) `name`, builder style.
    #[must_use]
    pub fn with(mut self, name: impl Into<String>, value: f64) -> Self {
        self.values.insert(name.into(), value);
        self
    }

    /// Sets `name` to `value`.
    pub fn insert(&mut self, name: impl Into<String>, value: f64) {
        self.values.insert(name.into(), value);
    }

    /// The value named `name`, if the learner reported it.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.values.get(name).copied()
    }

    /// Added by the trainer actor after the learner's own values: seconds the learner's
    /// [`export`](Learner::export) took (its weights into a weight set).
    pub const EXPORT_S: &'static str = "refit.export_s";
    /// Added by the trainer actor: seconds the version took to go out through the trainer's
    /// outlet (the link's publish: a shared-memory slot written and committed, a TCP
    /// version made available), the engines' loads not included.
    pub const PUBLISH_S: &'static str = "refit.publish_s";
    /// Added by the trainer actor: bytes of the exported version.
    pub const BYTES: &'static str = "refit.bytes";
}

// ANCHOR: learner
/// A learner: the trainer role's user code. It owns its model, optimiser and version count;
/// the framework hands it batches and publishes what it exports.
pub trait Learner: Send {
    /// Trains on one batch.
    ///
    /// # Errors
    /// A batch the learner cannot train on, or a failure of its numerics; the learner keeps
    /// its previous weights.
    fn update(&mut self, batch: &Batch) -> Result<LearnStats>;

    /// Exports the current policy weights as a new version (the previous plus one).
    ///
    /// # Errors
    /// A failure to write the weights into the manifest's layout.
    fn export(&mut self) -> Result<WeightSet>;

    /// The layout of the weights [`export`](Learner::export) produces (what engines and
    /// collectors must be able to load).
    fn manifest(&self) -> Arc<Manifest>;

    /// The version of the last export (zero before the first).
    fn version(&self) -> Version;

    /// The learner's whole state for a checkpoint, as a weight set of its model at its
    /// [`version`](Learner::version): every tensor it trains or keeps (the policy, a critic,
    /// the optimiser's moments and step), under names of its choosing. A learner that
    /// cannot be checkpointed refuses (the default).
    ///
    /// # Errors
    /// [`Error::Config`] for a learner without checkpoints; a failure reading its tensors.
    fn save(&self) -> Result<WeightSet> {
        Err(Error::Config(
            "this learner cannot be checkpointed (its Learner::save is not implemented)".into(),
        ))
    }

    /// Takes back a state [`save`](Learner::save) made, read from `source` (a file, named
    /// in errors): afterwards [`version`](Learner::version) is the state's version, and the
    /// next export is the version after it, holding the saved policy.
    ///
    /// # Errors
    /// A state of another model or configuration (a tensor missing or of another shape,
    /// named); a learner without checkpoints (the default). The learner is unusable after a
    /// failed restore: make a fresh one.
    fn restore(&mut self, state: &WeightSet, source: &str) -> Result<()> {
        let _ = (state, source);
        Err(Error::Config(
            "this learner cannot be restored from a checkpoint (its Learner::restore is not \
             implemented)"
                .into(),
        ))
    }
}
// ANCHOR_END: learner

impl<L: Learner + ?Sized> Learner for Box<L> {
    fn update(&mut self, batch: &Batch) -> Result<LearnStats> {
        (**self).update(batch)
    }
    fn export(&mut self) -> Result<WeightSet> {
        (**self).export()
    }
    fn manifest(&self) -> Arc<Manifest> {
        (**self).manifest()
    }
    fn version(&self) -> Version {
        (**self).version()
    }
    fn save(&self) -> Result<WeightSet> {
        (**self).save()
    }
    fn restore(&mut self, state: &WeightSet, source: &str) -> Result<()> {
        (**self).restore(state, source)
    }
}
