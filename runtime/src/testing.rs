//! Fixtures for tests (feature `test-util`, and this crate's own tests): the small
//! manifests and filled weight sets that test code across the workspace builds again and
//! again. Never for a program: every helper panics on bad input instead of returning an
//! error.
//!
//! ```
//! use refit_runtime::DType;
//! use refit_runtime::testing::{filled, id, manifest};
//!
//! let m = manifest(&[("w", DType::F32, &[2, 3]), ("b", DType::F32, &[3])]);
//! let ws = filled(&id("policy"), &m, 4, 0.5);
//! assert_eq!(ws.version().get(), 4);
//! assert!(ws.view::<f32>("w").unwrap().iter().all(|&x| x == 0.5));
//! ```

use std::sync::Arc;

use crate::{DType, Manifest, Manifests, ModelId, Version, WeightSet};

/// The model id `name`.
///
/// # Panics
/// If `name` is not a valid model id.
pub fn id(name: &str) -> ModelId {
    ModelId::new(name).expect("a valid model id")
}

/// A manifest of `tensors`, `(name, dtype, shape)` laid out in this order (as
/// [`Manifest::builder`] lays them out).
///
/// # Panics
/// If the manifest is invalid (a duplicate or empty name).
pub fn manifest(tensors: &[(&str, DType, &[usize])]) -> Arc<Manifest> {
    let mut b = Manifest::builder();
    for &(name, dtype, shape) in tensors {
        b.push(name, dtype, shape);
    }
    Arc::new(b.build().expect("a valid manifest"))
}

/// The manifests of a scheme: each `(model, manifest)` pair.
///
/// # Panics
/// If a model id is invalid or appears twice.
pub fn manifests(models: &[(&str, &Arc<Manifest>)]) -> Manifests {
    Manifests::new(models.iter().map(|&(name, m)| (id(name), Arc::clone(m))))
        .expect("distinct model ids")
}

/// `model` laid out by `manifest` at `version`, every element of every f32 tensor equal to
/// `fill`; tensors of other dtypes (and the padding between tensors) stay zero.
pub fn filled(model: &ModelId, manifest: &Arc<Manifest>, version: u64, fill: f32) -> WeightSet {
    let mut ws = WeightSet::zeroed(model.clone(), Arc::clone(manifest));
    for t in manifest.tensors() {
        if t.dtype == DType::F32 {
            ws.view_mut::<f32>(&t.name)
                .expect("an f32 tensor of the manifest")
                .fill(fill);
        }
    }
    ws.set_version(Version(version));
    ws
}
