//! `refit.engine.conformance`: the engine contract's conformance suite
//! (`refit_actors::conformance`) run on a Python engine, through the same backend a rank
//! of `refit launch` puts it behind.

use pyo3::prelude::*;
use refit_actors::{ModelSpec, conformance};
use refit_runtime::ModelId;
use refit_runtime::topology::Apply;

use crate::engine::{PyBackend, rank_error};
use crate::errors::config;

/// Runs the suite on model `model` of `adapter`'s engine (`refit.engine._Adapter`), the
/// model's params `params` (JSON: the `[model.params]` of a topology, as the `"grpo"` roles
/// read them), taken in as `apply` (`"staged"` or `"streaming"`, as the topology key).
/// Answers the checks passed, in order (all of them).
///
/// # Errors
/// `ConfigError` for a model id, params or apply that do not fit (an engine without
/// `load_streamed` under `"streaming"`); `RefitError` naming the first check that fails, or
/// what the engine raised.
#[pyfunction]
pub(crate) fn engine_conformance(
    py: Python<'_>,
    adapter: Py<PyAny>,
    model: &str,
    params: &str,
    apply: &str,
) -> PyResult<Vec<String>> {
    let apply: Apply = serde_json::from_value(serde_json::Value::from(apply)).map_err(|_| {
        let known = [Apply::Staged, Apply::Streaming].map(Apply::as_str);
        config(format!("apply = `{apply}`: one of {known:?}"))
    })?;
    let id = ModelId::new(model).map_err(|e| config(format!("model `{model}`: {e}")))?;
    let table: toml::Table = serde_json::from_str(params)
        .map_err(|e| config(format!("model `{model}`: params: {e}")))?;
    let spec = ModelSpec::from_params(id.clone(), 0, &table).map_err(rank_error)?;
    spec.check().map_err(rank_error)?;
    let (backend, lanes) = PyBackend::start(py, adapter, std::slice::from_ref(&spec))?;
    let passed = py.detach(|| {
        let passed = conformance::backend_applied(backend, &id, apply);
        lanes.iter().for_each(|l| l.close());
        passed
    });
    Ok(passed
        .map_err(rank_error)?
        .into_iter()
        .map(String::from)
        .collect())
}
