//! A learner's whole state as a weight set, for checkpoints ([`Learner::save`] and
//! [`Learner::restore`](crate::learner::Learner::restore)): every tensor it trains or keeps
//! (the policy, a critic, the optimiser's moments) as `f32`, and its counters as `f64`
//! scalars (shape `[1]`), under names of the learner's choosing. A weight set travels and
//! lands whole: written as safetensors, it is checksummed tensor by tensor.
//!
//! [`Learner::save`]: crate::learner::Learner::save

use std::sync::Arc;

use candle_core::Tensor;
use refit_runtime::{DType, Manifest, ModelId, Version, WeightSet};

use crate::error::{Error, Result};

/// Gathers a learner's tensors and scalars, then makes the weight set.
#[derive(Debug, Default)]
pub struct StateWriter {
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    scalars: Vec<(String, f64)>,
}

impl StateWriter {
    /// An empty state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds tensor `name` (its values as `f32`).
    ///
    /// # Errors
    /// Candle errors reading it.
    pub fn tensor(&mut self, name: impl Into<String>, t: &Tensor) -> Result<()> {
        let values = t
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?;
        self.tensors.push((name.into(), t.dims().to_vec(), values));
        Ok(())
    }

    /// Adds scalar `name`.
    pub fn scalar(&mut self, name: impl Into<String>, value: f64) {
        self.scalars.push((name.into(), value));
    }

    /// The state as a weight set of `model` at `version`, tensors first, in the order added.
    ///
    /// # Errors
    /// Two entries of one name.
    pub fn finish(self, model: ModelId, version: Version) -> Result<WeightSet> {
        let mut b = Manifest::builder();
        for (name, shape, _) in &self.tensors {
            b.push(name.clone(), DType::F32, shape);
        }
        for (name, _) in &self.scalars {
            b.push(name.clone(), DType::F64, &[1]);
        }
        let mut ws = WeightSet::zeroed(model, Arc::new(b.build()?));
        ws.set_version(version);
        for (name, _, values) in &self.tensors {
            ws.view_mut::<f32>(name)?.copy_from_slice(values);
        }
        for (name, value) in &self.scalars {
            ws.view_mut::<f64>(name)?[0] = *value;
        }
        Ok(ws)
    }
}

/// A saved state being restored: its tensors by name, checked against what the learner
/// holds, errors naming `source` (the checkpoint's file).
#[derive(Debug, Clone, Copy)]
pub struct LearnerState<'a> {
    state: &'a WeightSet,
    source: &'a str,
}

impl<'a> LearnerState<'a> {
    /// `state`, read from `source`, for a learner of `model`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the source when the state is another model's.
    pub fn open(state: &'a WeightSet, source: &'a str, model: &ModelId) -> Result<Self> {
        if state.model() != model {
            return Err(Error::Config(format!(
                "{source}: a checkpoint of model `{}`, not `{model}`",
                state.model()
            )));
        }
        Ok(Self { state, source })
    }

    /// Sets every variable of `vars` (by the name it was saved under) from the state, all
    /// or none: each is read and checked before any is set.
    ///
    /// # Errors
    /// As [`LearnerState::tensor`], naming the first that does not fit; candle errors.
    pub fn restore_vars<'v>(
        &self,
        vars: impl IntoIterator<Item = (String, &'v candle_core::Var)>,
    ) -> Result<()> {
        let staged = vars
            .into_iter()
            .map(|(name, var)| Ok((var, self.tensor(&name, var.as_tensor())?)))
            .collect::<Result<Vec<_>>>()?;
        for (var, t) in staged {
            var.set(&t)?;
        }
        Ok(())
    }

    /// Where the state came from.
    pub fn source(&self) -> &str {
        self.source
    }

    /// The version the state was saved at.
    pub fn version(&self) -> Version {
        self.state.version()
    }

    /// Tensor `name`, shaped and placed as `like` (what the learner holds under that name).
    ///
    /// # Errors
    /// [`Error::Config`] naming the source and the tensor when it is missing, not `f32`, or
    /// of another shape.
    pub fn tensor(&self, name: &str, like: &Tensor) -> Result<Tensor> {
        let spec = self.spec(name)?;
        if spec.dtype != DType::F32 || spec.shape != like.dims() {
            return Err(Error::Config(format!(
                "{}: tensor `{name}` is {} {:?} in the checkpoint, {:?} {:?} in this learner \
                 (a checkpoint of another model or configuration)",
                self.source,
                spec.dtype,
                spec.shape,
                like.dtype(),
                like.dims()
            )));
        }
        let values = self.state.view::<f32>(name)?.to_vec();
        Ok(Tensor::from_vec(values, like.dims(), like.device())?.to_dtype(like.dtype())?)
    }

    /// Scalar `name`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the source and the scalar when it is missing.
    pub fn scalar(&self, name: &str) -> Result<f64> {
        self.spec(name)?;
        let v = self.state.view::<f64>(name).map_err(|_| {
            Error::Config(format!("{}: scalar `{name}` is not an f64", self.source))
        })?;
        v.first().copied().ok_or_else(|| {
            Error::Config(format!("{}: scalar `{name}` holds no value", self.source))
        })
    }

    fn spec(&self, name: &str) -> Result<&refit_runtime::TensorSpec> {
        self.state.manifest().get(name).ok_or_else(|| {
            Error::Config(format!(
                "{}: no tensor `{name}` in the checkpoint (a checkpoint of another model or \
                 configuration)",
                self.source
            ))
        })
    }
}
