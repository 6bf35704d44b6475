//! Verification of what an engine serves (`verify = "hashes"` on a model): after each apply
//! the engine hashes the weights its policy serves and compares them, tensor by tensor, with
//! the version it applied (the bytes that arrived, which the transport verified against the
//! trainer's checksums); at the next update it hashes them again, so weights changed while
//! served (a stray write, a bad page, a bug in a layer's in-place update) are reported within
//! one update, naming the model, the version and the tensor.
//!
//! Plain code, no actor: the engine runs it on the thread that applies the weights.

use std::sync::Arc;

use refit_runtime::topology::Verify;
use refit_runtime::{DType, HasWeights, Manifest, ModelId, Version, WeightSet};

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
    /// Hash after every apply and before the next (`verify = "hashes"`), not only at the
    /// self-test (`verify = "startup"`).
    every_update: bool,
    /// The self-test ran (at the first apply).
    tested: bool,
}

impl ServedHashes {
    /// Verification of `model`, whose policy's weights have `manifest`, at `level`
    /// ([`Verify::Startup`]: the self-test at the first apply; [`Verify::Hashes`]: that, and
    /// every update's hashes). `None` for the levels that need nothing of the engine.
    pub fn new(model: ModelId, manifest: Arc<Manifest>, level: Verify) -> Option<Self> {
        (level >= Verify::Startup).then(|| Self {
            scratch: WeightSet::zeroed(model, manifest),
            served: None,
            every_update: level >= Verify::Hashes,
            tested: false,
        })
    }

    /// Hashes what `policy` serves and compares it with the version last recorded by
    /// [`ServedHashes::applied`] (nothing to compare before the first one, nor past the
    /// self-test at `verify = "startup"`).
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

    /// The version whose hashes later checks compare with (the last applied, with `verify =
    /// "hashes"`).
    pub fn recorded(&self) -> Option<Version> {
        self.served.as_ref().map(|(v, _)| *v)
    }

    /// Applies `weights` to `policy` with `apply`, verified: the self-test first when this is
    /// the first apply (see [`ServedHashes::self_test`]), then the version, whose hashes as
    /// served must be its own when every update is hashed (or this was the self-test).
    ///
    /// # Errors
    /// What `apply` reports; [`Unverified`] when the self-test or the hashes after the apply
    /// find a tensor that did not land.
    pub fn apply<P: HasWeights, E>(
        &mut self,
        weights: &WeightSet,
        policy: &mut P,
        mut apply: impl FnMut(&WeightSet, &mut P) -> Result<(), E>,
    ) -> Result<(), Unverified<E>> {
        let first = !self.tested;
        if first {
            self.tested = true;
            self.self_test(weights, policy, &mut apply)?;
        }
        apply(weights, policy).map_err(Unverified::Apply)?;
        if self.every_update || first {
            self.applied(weights, policy).map_err(Unverified::Landed)?;
        }
        Ok(())
    }

    /// The corrupt-then-restore self-test: a copy of `weights` with every element changed
    /// (its sign bit flipped, so floats stay finite and every value, zero included, differs
    /// in its bytes) is applied and read back; each tensor must come back as the copy holds
    /// it. A tensor the update path does not write (or writes from elsewhere) fails here even
    /// when the policy's weights and the version were equal before. On a failure the
    /// weights served before are applied back.
    ///
    /// # Errors
    /// [`Unverified::SelfTest`] naming the first tensor that did not come back;
    /// [`Unverified::Apply`] when `apply` fails.
    pub fn self_test<P: HasWeights, E>(
        &mut self,
        weights: &WeightSet,
        policy: &mut P,
        apply: &mut impl FnMut(&WeightSet, &mut P) -> Result<(), E>,
    ) -> Result<(), Unverified<E>> {
        let mut before = self.scratch.to_owned_copy();
        let exported = policy.write_weights(&mut before).is_ok();
        let mut corrupted = weights.to_owned_copy();
        flip_signs(&mut corrupted);
        apply(&corrupted, policy).map_err(Unverified::Apply)?;
        let found = hash(&mut self.scratch, policy);
        let r = compare(
            &self.scratch,
            weights.version(),
            &corrupted.tensor_checksums(),
            &found,
        );
        if let Err(damage) = r {
            if exported {
                before.set_version(weights.version());
                // best effort: the tensors the path does not carry were never changed
                let _ = apply(&before, policy);
            }
            return Err(Unverified::SelfTest(damage));
        }
        Ok(())
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
        if self.every_update {
            self.served = Some((weights.version(), expected));
        }
        r
    }
}

/// A verified apply that failed.
#[derive(Debug)]
pub enum Unverified<E> {
    /// The apply itself failed.
    Apply(E),
    /// The self-test found a tensor the update path does not carry.
    SelfTest(Damage),
    /// The version applied is not what the policy serves.
    Landed(Damage),
}

impl<E: std::fmt::Display> std::fmt::Display for Unverified<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Apply(e) => e.fmt(f),
            Self::SelfTest(d) => write!(
                f,
                "the self-test at the first update (verify = \"startup\") found a tensor the \
                 update path does not carry: loaded with every element changed, {d}"
            ),
            Self::Landed(d) => write!(f, "the apply did not land whole: {d}"),
        }
    }
}

/// Flips the sign bit of every element (the top bit of each little-endian element; a
/// boolean's low bit).
fn flip_signs(weights: &mut WeightSet) {
    let specs: Vec<_> = weights
        .manifest()
        .tensors()
        .iter()
        .map(|t| (t.range(), t.dtype))
        .collect();
    let Ok(bytes) = weights.bytes_mut() else {
        return;
    };
    for (range, dtype) in specs {
        let (size, bit) = match dtype {
            DType::Bool => (1, 0x01),
            d => (d.size(), 0x80),
        };
        for element in bytes[range].chunks_exact_mut(size) {
            if let Some(top) = element.last_mut() {
                *top ^= bit;
            }
        }
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

    use refit_runtime::testing;

    use super::*;

    fn manifest() -> Arc<Manifest> {
        testing::manifest(&[("a", DType::F32, &[4]), ("b", DType::F32, &[2, 2])])
    }

    fn hashes() -> ServedHashes {
        ServedHashes::new(ModelId::new("policy").unwrap(), manifest(), Verify::Hashes).unwrap()
    }

    fn version(v: u64, fill: f32) -> WeightSet {
        testing::filled(&testing::id("policy"), &manifest(), v, fill)
    }

    #[test]
    fn whole_weights_pass_and_a_flipped_byte_names_its_tensor() {
        let mut check = hashes();
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
        let mut check = hashes();
        let damage = check
            .applied(&version(3, 1.0), &version(3, 2.0))
            .unwrap_err();
        assert_eq!((damage.tensor.as_str(), damage.tensors), ("a", 2));
        assert_eq!(damage.version, Version(3));
    }

    /// A policy whose update path drops one tensor (as a loader that skips a name would).
    struct Skips(WeightSet, &'static str);

    impl HasWeights for Skips {
        fn weight_manifest(&self) -> refit_runtime::Result<Manifest> {
            self.0.weight_manifest()
        }
        fn write_weights(&self, out: &mut WeightSet) -> refit_runtime::Result<()> {
            self.0.write_weights(out)
        }
        fn read_weights(&mut self, weights: &WeightSet) -> refit_runtime::Result<()> {
            let kept = self.0.view::<f32>(self.1)?.to_vec();
            self.0.copy_from(weights)?;
            self.0.view_mut::<f32>(self.1)?.copy_from_slice(&kept);
            Ok(())
        }
    }

    fn load(w: &WeightSet, p: &mut impl HasWeights) -> refit_runtime::Result<()> {
        p.read_weights(w)
    }

    /// The self-test catches a tensor the update path does not write even when the engine's
    /// initial weights equal the version (the hashes after the apply alone cannot), puts
    /// the weights served before back, and passes a path that writes everything.
    #[test]
    fn the_startup_self_test_names_a_tensor_the_update_path_skips() {
        let m = ModelId::new("policy").unwrap();
        let v1 = version(1, 0.5);
        // without the self-test the skipped tensor goes unseen: it already held v1's values
        let mut skips = Skips(version(0, 0.5), "b");
        let mut plain = hashes();
        plain.tested = true;
        plain.apply(&v1, &mut skips, load).unwrap();
        // with it, the first update fails naming the tensor
        for level in [Verify::Startup, Verify::Hashes] {
            let mut skips = Skips(version(0, 0.5), "b");
            let mut check = ServedHashes::new(m.clone(), manifest(), level).unwrap();
            let e = check.apply(&v1, &mut skips, load).unwrap_err();
            let Unverified::SelfTest(d) = &e else {
                panic!("{e}")
            };
            assert_eq!((d.tensor.as_str(), d.tensors), ("b", 1));
            assert!(e.to_string().contains("tensor `b`"), "{e}");
            // what was served before is back
            assert_eq!(skips.0.view::<f32>("a").unwrap(), &[0.5; 4]);
        }
        // a path that writes every tensor passes, and serves the version
        let mut whole = version(0, 0.5);
        let mut check = ServedHashes::new(m.clone(), manifest(), Verify::Startup).unwrap();
        check.apply(&v1, &mut whole, load).unwrap();
        assert_eq!(whole.tensor_checksums(), v1.tensor_checksums());
        // past the first update `startup` hashes nothing: damage goes unseen
        whole.view_mut::<f32>("a").unwrap()[0] = 9.0;
        check.check(&whole).unwrap();
        check.apply(&version(2, 0.25), &mut whole, load).unwrap();
        assert!(ServedHashes::new(m, manifest(), Verify::Names).is_none());
    }

    /// The corruption changes every element's bytes, zeros included, and keeps floats
    /// finite.
    #[test]
    fn flipping_signs_changes_every_element_and_keeps_floats_finite() {
        let mut w = version(1, 0.0);
        w.view_mut::<f32>("a").unwrap()[1] = -3.5;
        let before = w.to_owned_copy();
        flip_signs(&mut w);
        for (x, y) in before.tensors().zip(w.tensors()) {
            let (x, y) = (x.as_slice::<f32>().unwrap(), y.as_slice::<f32>().unwrap());
            for (a, b) in x.iter().zip(y) {
                assert_ne!(a.to_bits(), b.to_bits());
                assert!(b.is_finite());
                assert_eq!(a.abs().to_bits(), b.abs().to_bits());
            }
        }
    }
}
