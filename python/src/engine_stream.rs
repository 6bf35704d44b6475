//! The pull of a streaming commit (`apply = "streaming"`) as the Python engine's
//! `load_streamed` gets it: [`PyTensorStream::run`] pulls the version inside the call and
//! hands each tensor to the engine's `apply` once its bytes are verified.

use std::sync::Arc;

use pyo3::prelude::*;
use refit_actors::actor::TensorStream;
use refit_runtime::WeightSet;

use crate::engine::rank_error;
use crate::errors::stream_failure;
use crate::update::Tensor;

/// One streaming commit's pull (`refit.engine` wraps it in the `stream` the engine's
/// `load_streamed` gets).
#[pyclass(module = "refit._native", frozen, name = "TensorStream")]
pub(crate) struct PyTensorStream {
    inner: TensorStream,
    model: String,
}

impl PyTensorStream {
    pub(crate) fn new(inner: TensorStream, model: String) -> Self {
        Self { inner, model }
    }
}

#[pymethods]
impl PyTensorStream {
    /// Pulls the version and calls `apply(tensor)` with each of its tensors (a
    /// `refit._native.Tensor`) as soon as its bytes are verified, on this thread; answers
    /// the version streamed. Once: a second call, or one after the commit returned, raises.
    /// An exception of `apply` raises as itself when nothing was applied yet, else as
    /// `NeedsFullResend` with it as its cause; Ctrl-C is taken between two tensors.
    fn run(&self, py: Python<'_>, apply: Py<PyAny>) -> PyResult<u64> {
        let mut raised: Option<PyErr> = None;
        let model = self.model.as_str();
        let streamed = py.detach(|| {
            let mut apply_one = |one: WeightSet| {
                Python::attach(|py| {
                    let t = Tensor::only(Arc::new(one)).ok_or_else(|| {
                        refit_actors::Error::Actor("a streamed weight set without a tensor".into())
                    })?;
                    // Ctrl-C is taken between two tensors, before the next is applied
                    let called = py.check_signals().and_then(|()| apply.call1(py, (t,)));
                    called.map(drop).map_err(|e| {
                        let reason = format!("the Python engine's apply raised {e}");
                        raised = Some(e);
                        refit_actors::Error::Generator {
                            model: model.to_owned(),
                            reason,
                        }
                    })
                })
            };
            self.inner.run(&mut apply_one)
        });
        streamed.map(|v| v.get()).map_err(|e| {
            let partly = matches!(
                e,
                refit_actors::Error::Runtime(refit_runtime::Error::PartlyApplied { .. })
            );
            let err = match e {
                refit_actors::Error::Runtime(r) if raised.is_none() => {
                    crate::errors::to_py_chained(py, r)
                }
                e => rank_error(e),
            };
            stream_failure(py, err, partly, raised)
        })
    }
}
