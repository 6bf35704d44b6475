//! `refit.Update` and its tensors: a received version held in place, read by numpy through
//! `__array_interface__` without a copy.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use refit_runtime::{DType, ModelId, Version, WeightSet};

use crate::errors::{config, to_py};
use crate::receiver::Receiver;

/// One applied version of one or several models (the group a sender published together).
/// Holding it keeps its memory (a pinned shared-memory slot, a mapped file, an arena) alive.
#[pyclass(module = "refit._native", frozen)]
pub(crate) struct Update {
    group: Vec<Arc<WeightSet>>,
    /// The receiver that acknowledges it (`None`: one handed to a Python engine, which the
    /// engine acknowledges once it serves it).
    receiver: Option<Py<Receiver>>,
    acked: std::sync::atomic::AtomicBool,
}

impl Update {
    pub(crate) fn new(group: Vec<Arc<WeightSet>>, receiver: Py<Receiver>, acked: bool) -> Self {
        Self {
            group,
            receiver: Some(receiver),
            acked: std::sync::atomic::AtomicBool::new(acked),
        }
    }

    /// A version a Python engine stages (the engine acknowledges it after its commit:
    /// `ack` does nothing).
    pub(crate) fn held(weights: Arc<WeightSet>) -> Self {
        Self {
            group: vec![weights],
            receiver: None,
            acked: std::sync::atomic::AtomicBool::new(true),
        }
    }

    fn model(&self, model: Option<&str>) -> PyResult<&Arc<WeightSet>> {
        match model {
            None if self.group.len() == 1 => Ok(&self.group[0]),
            None => Err(config(format!(
                "this update holds {} models ({}): name one",
                self.group.len(),
                self.names().join(", ")
            ))),
            Some(name) => {
                let id = ModelId::new(name).map_err(to_py)?;
                self.group
                    .iter()
                    .find(|w| *w.model() == id)
                    .ok_or_else(|| to_py(refit_runtime::Error::UnknownModel(id)))
            }
        }
    }

    fn names(&self) -> Vec<String> {
        self.group.iter().map(|w| w.model().to_string()).collect()
    }
}

#[pymethods]
impl Update {
    /// `(model, version)` of each model in the update.
    #[getter]
    fn entries(&self) -> Vec<(String, u64)> {
        self.group
            .iter()
            .map(|w| (w.model().to_string(), w.version().get()))
            .collect()
    }

    /// The models in the update.
    #[getter]
    fn models(&self) -> Vec<String> {
        self.names()
    }

    /// The version of `model` (default: the only one).
    #[pyo3(signature = (model = None))]
    fn version(&self, model: Option<&str>) -> PyResult<u64> {
        Ok(self.model(model)?.version().get())
    }

    /// The tensors of `model` (default: the only one), in manifest order.
    #[pyo3(signature = (model = None))]
    fn tensors(&self, model: Option<&str>) -> PyResult<Vec<Tensor>> {
        let ws = self.model(model)?;
        Ok(ws
            .manifest()
            .tensors()
            .iter()
            .map(|t| Tensor {
                weights: Arc::clone(ws),
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                offset: t.offset,
                len: t.len,
            })
            .collect())
    }

    /// `(address, length)` of the bytes holding `model`'s version (its arena, slot or map),
    /// for checks that an array lies inside it.
    #[pyo3(signature = (model = None))]
    fn memory(&self, model: Option<&str>) -> PyResult<(usize, usize)> {
        let bytes = self.model(model)?.bytes();
        Ok((bytes.as_ptr() as usize, bytes.len()))
    }

    /// xxh3 of each tensor of `model`, in manifest order (what the transports verify).
    #[pyo3(signature = (model = None))]
    fn checksums(&self, py: Python<'_>, model: Option<&str>) -> PyResult<Vec<u64>> {
        let ws = Arc::clone(self.model(model)?);
        Ok(py.detach(|| ws.tensor_checksums()))
    }

    /// Tells the sender this update is applied. A second call does nothing.
    fn ack(&self, py: Python<'_>) -> PyResult<()> {
        if self.acked.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        let entries: Vec<(ModelId, Version)> = self
            .group
            .iter()
            .map(|w| (w.model().clone(), w.version()))
            .collect();
        if let Some(r) = &self.receiver {
            r.get().ack_entries(py, &entries)?;
        }
        self.acked.store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// True once acknowledged (an update from `Receiver.current()` always is).
    #[getter]
    fn acked(&self) -> bool {
        self.acked.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// One tensor of an update: numpy reads it in place through `__array_interface__` (the
/// array's base keeps this object, and so the update's memory, alive).
#[pyclass(module = "refit._native", frozen)]
pub(crate) struct Tensor {
    weights: Arc<WeightSet>,
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

impl Tensor {
    /// The one tensor of `weights` (a weight set of a single tensor, as a streaming receive
    /// hands over).
    pub(crate) fn only(weights: Arc<WeightSet>) -> Option<Self> {
        let t = weights.manifest().tensors().first()?.clone();
        Some(Self {
            weights,
            name: t.name,
            dtype: t.dtype,
            shape: t.shape,
            offset: t.offset,
            len: t.len,
        })
    }
}

/// numpy's type string of the storage of `dtype`: its own for the types numpy has; the
/// unsigned integer of the same width for bf16 and the fp8 types (the Python side views
/// those as torch's types, or refuses them for numpy).
fn storage_typestr(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Bool => "|b1",
        DType::U8 | DType::F8E4M3 | DType::F8E5M2 => "|u1",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::U16 | DType::BF16 => "<u2",
        DType::I32 => "<i4",
        DType::U32 => "<u4",
        DType::I64 => "<i8",
        DType::U64 => "<u8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        _ => return None,
    })
}

#[pymethods]
impl Tensor {
    /// The tensor's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Refit's dtype name (`"f32"`, `"bf16"`, `"f8_e4m3"`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.shape.clone()
    }

    /// Bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// The model it belongs to.
    #[getter]
    fn model(&self) -> String {
        self.weights.model().to_string()
    }

    /// The version it belongs to.
    #[getter]
    fn version(&self) -> u64 {
        self.weights.version().get()
    }

    /// numpy's array interface (version 3): the tensor's bytes in place, read-only.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let bytes = self
            .weights
            .bytes()
            .get(self.offset..self.offset + self.len)
            .ok_or_else(|| {
                crate::errors::refused(format!(
                    "tensor `{}` lies outside its weight set",
                    self.name
                ))
            })?;
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        let typestr = storage_typestr(self.dtype).ok_or_else(|| {
            crate::errors::refused(format!(
                "tensor `{}`: dtype {} has no numpy storage type",
                self.name,
                self.dtype.name()
            ))
        })?;
        d.set_item("typestr", typestr)?;
        d.set_item("data", (bytes.as_ptr() as usize, true))?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "Tensor({:?}, dtype={}, shape={:?}, model={}, version={})",
            self.name,
            self.dtype.name(),
            self.shape,
            self.weights.model(),
            self.weights.version()
        )
    }
}
