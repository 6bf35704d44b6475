//! A generating engine's verification of what it serves (a model's `verify`): the stager's
//! serving form seen as weights ([`Generator::export`]), so that the engine's
//! [`ServedHashes`] runs on it as on an acting engine's policy. Staging is the apply: a
//! corrupted copy is staged and read back at the first update, then the version; with
//! `verify = "hashes"` the weights served are read back again at the next update.

use std::sync::Arc;

use refit_runtime::{HasWeights, Manifest, Version, WeightSet};

use crate::actor::verify::{Damage, ServedHashes, Unverified};
use crate::error::{Error, Result};
use crate::generation::Generator;

/// A generator's serving form as [`HasWeights`]: reading stages, writing exports.
struct Serving<'g, G: Generator> {
    generator: &'g G,
    weights: Option<Arc<G::Weights>>,
}

impl<G: Generator> HasWeights for Serving<'_, G> {
    fn weight_manifest(&self) -> refit_runtime::Result<Manifest> {
        Ok((*self.generator.manifest()).clone())
    }

    fn write_weights(&self, out: &mut WeightSet) -> refit_runtime::Result<()> {
        let weights = self.weights.as_ref().ok_or_else(|| {
            refit_runtime::Error::Strategy("no weights staged to read back".into())
        })?;
        self.generator.export(weights, out).map_err(runtime)
    }

    fn read_weights(&mut self, weights: &WeightSet) -> refit_runtime::Result<()> {
        let staged = self.generator.stage(weights).map_err(runtime)?;
        self.weights = Some(Arc::new(staged));
        Ok(())
    }
}

fn runtime(e: refit_rl::Error) -> refit_runtime::Error {
    match e {
        refit_rl::Error::Runtime(e) => e,
        e => refit_runtime::Error::Strategy(e.to_string()),
    }
}

/// What the weights served now hash to against the version they were staged from
/// (`verify = "hashes"`; nothing before the first version, nor at lower levels, nor when
/// the version last staged is not the one served: its commit was aborted or superseded).
pub(super) fn check_served<G: Generator>(
    verify: &mut ServedHashes,
    generator: &G,
    served: Option<&(Arc<G::Weights>, Version)>,
) -> Option<Damage> {
    let (weights, version) = served?;
    if verify.recorded() != Some(*version) {
        return None;
    }
    let served = Serving {
        generator,
        weights: Some(Arc::clone(weights)),
    };
    verify.check(&served).err()
}

/// Stages `weights` with `generator`, verified (the self-test at the first version; the
/// staged form read back against the version at `verify = "hashes"`).
///
/// # Errors
/// The staging error; the self-test's or the read-back's finding, naming the tensor.
pub(super) fn stage_verified<G: Generator>(
    verify: &mut ServedHashes,
    generator: &G,
    weights: &WeightSet,
) -> Result<Arc<G::Weights>> {
    let mut serving = Serving {
        generator,
        weights: None,
    };
    verify
        .apply(weights, &mut serving, |w, s| s.read_weights(w))
        .map_err(|e| match e {
            Unverified::Apply(e) => Error::Runtime(e),
            e => Error::Actor(e.to_string()),
        })?;
    serving
        .weights
        .ok_or_else(|| Error::Actor("a verified staging left nothing staged".into()))
}
