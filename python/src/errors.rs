//! Refit's errors as Python exceptions: each variant of the runtime's error picks a class of
//! `refit.errors` (defined in Python, so that each also derives from the built-in exception
//! callers already catch: `TimeoutError`, `ConnectionError`, `ValueError`); the message is
//! the Rust error's, naming the tensor, version, peer or file.

use pyo3::PyErr;
use pyo3::types::PyTracebackMethods;
use refit_runtime::Error;

pyo3::import_exception!(refit.errors, RefitError);
pyo3::import_exception!(refit.errors, Timeout);
pyo3::import_exception!(refit.errors, PeerGone);
pyo3::import_exception!(refit.errors, Refused);
pyo3::import_exception!(refit.errors, ConfigError);
pyo3::import_exception!(refit.errors, TransportError);
pyo3::import_exception!(refit.errors, Closed);
pyo3::import_exception!(refit.errors, Unauthorized);
pyo3::import_exception!(refit.errors, NeedsFullResend);

/// The Python exception for `e`.
pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match refit_node::Error::find(&e) {
        Some(refit_node::Error::Unauthorized { .. }) => return Unauthorized::new_err(msg),
        // a token of this process's own configuration (its length, both variables set)
        Some(refit_node::Error::BadToken { .. }) => return ConfigError::new_err(msg),
        Some(n) if n.is_timeout() => return Timeout::new_err(msg),
        _ => {}
    }
    match e {
        Error::Timeout { .. } => Timeout::new_err(msg),
        Error::PeerGone { .. } => PeerGone::new_err(msg),
        Error::Tensor { .. }
        | Error::Schema { .. }
        | Error::StaleVersion { .. }
        | Error::UnknownModel(_)
        | Error::WrongElement { .. }
        | Error::NoSuchTensor(_)
        | Error::Bucket { .. }
        | Error::Layout { .. }
        | Error::Cast { .. }
        | Error::DeltaBase { .. }
        | Error::Damaged { .. }
        | Error::Shard { .. }
        | Error::Safetensors { .. }
        | Error::InvalidManifest(_)
        | Error::Protocol { .. }
        | Error::Wire(_) => Refused::new_err(msg),
        Error::Config(_)
        | Error::Topology { .. }
        | Error::InvalidModelId(..)
        | Error::DuplicateModel(_)
        | Error::Strategy(_)
        | Error::Mesh { .. }
        | Error::Sync(_) => ConfigError::new_err(msg),
        Error::State(_) | Error::ReadOnly(_) => Closed::new_err(msg),
        Error::PartlyApplied { .. } => NeedsFullResend::new_err(msg),
        Error::Io { .. }
        | Error::Path { .. }
        | Error::Collective { .. }
        | Error::Node(_)
        | Error::Transport { .. } => TransportError::new_err(msg),
        _ => RefitError::new_err(msg),
    }
}

/// As [`to_py`], with the error a [`Error::PartlyApplied`] carries chained as the
/// exception's cause (in its own class: `PeerGone`, `Timeout`, `Refused`...).
pub(crate) fn to_py_chained(py: pyo3::Python<'_>, e: Error) -> PyErr {
    if !matches!(e, Error::PartlyApplied { .. }) {
        return to_py(e);
    }
    let outer = NeedsFullResend::new_err(e.to_string());
    if let Error::PartlyApplied { source, .. } = e {
        outer.set_cause(py, Some(to_py(*source)));
    }
    outer
}

/// A streamed update's failure as Python raises it, where `err` is the failure as the
/// package maps it and `raised` what the caller's `apply` raised, if it did: an exception
/// that is no `Exception` (KeyboardInterrupt, SystemExit) as itself, so that no
/// `except Exception` swallows it; after part of the update was applied (`partly`), `err`
/// (`NeedsFullResend`) with the exception as its cause; before, the exception itself.
pub(crate) fn stream_failure(
    py: pyo3::Python<'_>,
    err: PyErr,
    partly: bool,
    raised: Option<PyErr>,
) -> PyErr {
    match raised {
        Some(cause) if !cause.is_instance_of::<pyo3::exceptions::PyException>(py) => cause,
        Some(cause) if partly => {
            err.set_cause(py, Some(cause));
            err
        }
        Some(cause) => cause,
        None => err,
    }
}

/// Logs `e`, which a user's Python code raised in `what` ("the Python engine's commit"),
/// with its traceback: the message alone rarely says where it failed. Takes the GIL.
pub(crate) fn log_raised(what: &str, e: &PyErr) {
    let trace = pyo3::Python::attach(|py| e.traceback(py).and_then(|t| t.format().ok()));
    if let Some(t) = trace {
        tracing::warn!("{what} raised {e}\n{t}");
    }
}

/// A configuration error raised from this crate's own checks.
pub(crate) fn config(msg: impl Into<String>) -> PyErr {
    ConfigError::new_err(msg.into())
}

/// An update refused by this crate's own checks.
pub(crate) fn refused(msg: impl Into<String>) -> PyErr {
    Refused::new_err(msg.into())
}
