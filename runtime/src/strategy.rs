//! Strategies: how weights are taken out of a model and put back in.

use crate::error::Result;
use crate::manifest::Manifest;
use crate::weights::WeightSet;

/// A model type whose parameters can be written to and read from a [`WeightSet`].
///
/// Implement this for your own model types; [`ArenaStrategy`] then moves their weights as
/// they are. `read_weights` is only called with a weight set whose manifest equals
/// [`HasWeights::weight_manifest`] (the scheme checks it first), so it can copy without
/// re-validating and never leaves the model half-updated.
pub trait HasWeights {
    /// The layout of this model's parameters.
    ///
    /// # Errors
    /// Whatever building the manifest reports.
    fn weight_manifest(&self) -> Result<Manifest>;
    /// Copies the model's parameters into `out` (same manifest).
    ///
    /// # Errors
    /// [`Error::Strategy`](crate::Error::Strategy) or a tensor error if the model cannot be read.
    fn write_weights(&self, out: &mut WeightSet) -> Result<()>;
    /// Loads parameters from `weights` (same manifest).
    ///
    /// # Errors
    /// [`Error::Strategy`](crate::Error::Strategy) or a tensor error if the model cannot be written.
    fn read_weights(&mut self, weights: &WeightSet) -> Result<()>;
}

impl HasWeights for WeightSet {
    fn weight_manifest(&self) -> Result<Manifest> {
        Ok((**self.manifest()).clone())
    }
    fn write_weights(&self, out: &mut WeightSet) -> Result<()> {
        out.copy_from(self)
    }
    fn read_weights(&mut self, weights: &WeightSet) -> Result<()> {
        self.copy_from(weights)
    }
}

/// How weights are extracted from a model of type `M` and applied back to it.
pub trait Strategy<M: ?Sized>: Send + Sync {
    /// The manifest of what [`Strategy::extract`] produces for `model`.
    ///
    /// # Errors
    /// If the model's layout cannot be described.
    fn manifest(&self, model: &M) -> Result<Manifest>;
    /// Writes the model's current weights into `out`.
    ///
    /// # Errors
    /// If the model cannot be read or `out` has another layout.
    fn extract(&self, model: &M, out: &mut WeightSet) -> Result<()>;
    /// Applies `weights` to the model, all or nothing.
    ///
    /// # Errors
    /// A tensor error naming the culprit; the model is left unchanged.
    fn apply(&self, weights: &WeightSet, model: &mut M) -> Result<()>;
}

/// The default strategy: the arena moves as it is, names, dtypes and layout unchanged.
#[derive(Debug, Default, Clone, Copy)]
pub struct ArenaStrategy;

impl<M: HasWeights + ?Sized> Strategy<M> for ArenaStrategy {
    fn manifest(&self, model: &M) -> Result<Manifest> {
        model.weight_manifest()
    }
    fn extract(&self, model: &M, out: &mut WeightSet) -> Result<()> {
        let m = model.weight_manifest()?;
        out.manifest().check_same_schema(out.model(), &m)?;
        model.write_weights(out)
    }
    fn apply(&self, weights: &WeightSet, model: &mut M) -> Result<()> {
        let m = model.weight_manifest()?;
        m.check_same_schema(weights.model(), weights.manifest())?;
        model.read_weights(weights)
    }
}

/// Extracts a fresh weight set from `model` with `strategy`.
///
/// # Errors
/// As [`Strategy::manifest`] and [`Strategy::extract`].
pub fn extract_new<M: ?Sized, S: Strategy<M> + ?Sized>(
    strategy: &S,
    model: &M,
    id: crate::ids::ModelId,
) -> Result<WeightSet> {
    let manifest = strategy.manifest(model)?;
    let mut ws = WeightSet::zeroed(id, std::sync::Arc::new(manifest));
    strategy.extract(model, &mut ws)?;
    Ok(ws)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, ModelId, Version};
    use std::sync::Arc;

    struct Linear {
        w: Vec<f32>,
        b: Vec<f32>,
    }

    impl HasWeights for Linear {
        fn weight_manifest(&self) -> Result<Manifest> {
            Manifest::builder()
                .tensor(
                    "w",
                    DType::F32,
                    &[self.b.len(), self.w.len() / self.b.len()],
                )
                .tensor("b", DType::F32, &[self.b.len()])
                .build()
        }
        fn write_weights(&self, out: &mut WeightSet) -> Result<()> {
            out.view_mut::<f32>("w")?.copy_from_slice(&self.w);
            out.view_mut::<f32>("b")?.copy_from_slice(&self.b);
            Ok(())
        }
        fn read_weights(&mut self, weights: &WeightSet) -> Result<()> {
            self.w.copy_from_slice(weights.view("w")?);
            self.b.copy_from_slice(weights.view("b")?);
            Ok(())
        }
    }

    #[test]
    fn arena_strategy_moves_weights_and_refuses_other_layouts() {
        let src = Linear {
            w: vec![1., 2., 3., 4., 5., 6.],
            b: vec![7., 8.],
        };
        let id = ModelId::new("lin").unwrap();
        let mut ws = extract_new(&ArenaStrategy, &src, id.clone()).unwrap();
        ws.set_version(Version(3));
        let mut dst = Linear {
            w: vec![0.; 6],
            b: vec![0.; 2],
        };
        ArenaStrategy.apply(&ws, &mut dst).unwrap();
        assert_eq!(dst.w, src.w);
        assert_eq!(dst.b, src.b);
        let mut wrong = Linear {
            w: vec![0.; 9],
            b: vec![0.; 3],
        };
        let err = ArenaStrategy
            .apply(&ws, &mut wrong)
            .unwrap_err()
            .to_string();
        assert!(err.contains("tensor `w`"), "{err}");
        assert_eq!(wrong.w, vec![0.; 9]);
        let mut copy = WeightSet::zeroed(id, Arc::clone(ws.manifest()));
        ArenaStrategy.apply(&ws, &mut copy).unwrap();
        assert_eq!(copy.bytes(), ws.bytes());
    }
}
