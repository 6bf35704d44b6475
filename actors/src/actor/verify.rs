//! Verification of what an engine serves (`verify = "hashes"` on a model): after each apply
//! the engine hashes the weights its policy serves and compares them, tensor by tensor, with
//! the version it applied (the bytes that arrived, which the transport verified against the
//! trainer's checksums); at the next update it hashes them again, so weights changed while
//! served (a stray write, a bad page, a bug in a layer's in-place update) are reported within
//! one update, naming the model, the version and the tensor.
//!
//! Plain code, no actor: the engine runs it on the thread that applies the weights.

use std::sync::Arc;

use refit_runtime::{HasWeights, Manifest, ModelId, Version, WeightSet};

/// A tensor whose served bytes differ from the version applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    /// The model.
    pub model: ModelId,
    /// The version the engine believes it serves.
    pub version: Version,
    /// The first tensor that differs, in manifest order.
    pub tensor: String,
    /// The hash of the tensor as applied.
    pub applied: u64,
    /// The hash of the tensor as served.
    pub served: u64,
    /// How many tensors differ.
    pub tensors: usize,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "model `{}` v{}: tensor `{}` as served hashes to {:#018x}, as applied to {:#018x}",
            self.model, self.version, self.tensor, self.served, self.applied
        )?;
        if self.tensors > 1 {
            write!(f, " ({} tensors differ)", self.tensors)?;
        }
        Ok(())
    }
}

/// The hashes of the version a model serves, and a buffer its policy's weights are exported
/// into to hash them again.
#[derive(Debug)]
pub struct ServedHashes {
    scratch: WeightSet,
    served: Option<(Version, Vec<u64>)>,
}

impl ServedHashes {
    /// Verification of `model`, whose policy's weights have `manifest`.
    pub fn new(model: ModelId, manifest: Arc<Manifest>) -> Self {
        Self {
            scratch: WeightSet::zeroed(model, manifest),
            served: None,
        }
    }

    /// Hashes what `policy` serves and compares it with the version last recorded by
    /// [`ServedHashes::applied`] (nothing to compare before the first one).
    ///
    /// # Errors
    /// The [`Damage`] found; a policy that cannot export its weights is reported as damage
    /// of its first tensor.
    pub fn check(&mut self, policy: &impl HasWeights) -> Result<(), Damage> {
        let Some((version, expected)) = &self.served else {
            return Ok(());
        };
        let found = hash(&mut self.scratch, policy);
        compare(&self.scratch, *version, expected, &found)
    }

    /// After `weights` were applied to `policy`: the policy must serve exactly them. Their
    /// hashes become what later checks compare with, whether or not they match (a mismatch
    /// here is an apply that did not land whole).
    ///
    /// # Errors
    /// The [`Damage`] found.
    pub fn applied(&mut self, weights: &WeightSet, policy: &impl HasWeights) -> Result<(), Damage> {
        let expected = weights.tensor_checksums();
        let found = hash(&mut self.scratch, policy);
        let r = compare(&self.scratch, weights.version(), &expected, &found);
        self.served = Some((weights.version(), expected));
        r
    }
}

/// The per-tensor hashes of what `policy` serves, exported into `scratch` (empty when it
/// cannot export: every comparison then fails, naming the first tensor). A free function, so
/// that [`ServedHashes::check`] can hold its recorded hashes while the scratch is written.
fn hash(scratch: &mut WeightSet, policy: &impl HasWeights) -> Vec<u64> {
    match policy.write_weights(scratch) {
        Ok(()) => scratch.tensor_checksums(),
        Err(e) => {
            tracing::error!(model = %scratch.model(), "cannot export the served weights to verify them: {e}");
            Vec::new()
        }
    }
}

fn compare(
    layout: &WeightSet,
    version: Version,
    expected: &[u64],
    found: &[u64],
) -> Result<(), Damage> {
    let names = layout.manifest().tensors();
    let mut differing = names
        .iter()
        .enumerate()
        .filter(|(i, _)| expected.get(*i) != found.get(*i));
    let Some((first, entry)) = differing.next() else {
        return Ok(());
    };
    Err(Damage {
        model: layout.model().clone(),
        version,
        tensor: entry.name.clone(),
        applied: expected.get(first).copied().unwrap_or_default(),
        served: found.get(first).copied().unwrap_or_default(),
        tensors: 1 + differing.count(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use refit_runtime::{DType, testing};

    use super::*;

    fn manifest() -> Arc<Manifest> {
        testing::manifest(&[("a", DType::F32, &[4]), ("b", DType::F32, &[2, 2])])
    }

    fn version(v: u64, fill: f32) -> WeightSet {
        testing::filled(&testing::id("policy"), &manifest(), v, fill)
    }

    #[test]
    fn whole_weights_pass_and_a_flipped_byte_names_its_tensor() {
        let mut check = ServedHashes::new(ModelId::new("policy").unwrap(), manifest());
        let mut served = version(1, 0.5);
        // nothing applied yet: nothing to compare
        check.check(&served).unwrap();
        check.applied(&version(1, 0.5), &served).unwrap();
        check.check(&served).unwrap();
        served.view_mut::<f32>("b").unwrap()[3] = 0.25;
        let damage = check.check(&served).unwrap_err();
        assert_eq!((damage.tensor.as_str(), damage.version), ("b", Version(1)));
        assert_eq!(damage.tensors, 1);
        let msg = damage.to_string();
        assert!(
            msg.contains("model `policy` v1: tensor `b` as served"),
            "{msg}"
        );
        // the next version applied whole clears it
        let next = version(2, 0.75);
        check.applied(&next, &next).unwrap();
        check.check(&next).unwrap();
    }

    #[test]
    fn an_apply_that_did_not_land_whole_is_damage_of_the_new_version() {
        let mut check = ServedHashes::new(ModelId::new("policy").unwrap(), manifest());
        let damage = check
            .applied(&version(3, 1.0), &version(3, 2.0))
            .unwrap_err();
        assert_eq!((damage.tensor.as_str(), damage.tensors), ("a", 2));
        assert_eq!(damage.version, Version(3));
    }
}
