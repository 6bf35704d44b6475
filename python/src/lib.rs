//! `refit._native`: the Rust half of Refit's Python package.
//!
//! Python code imports `refit`, whose modules wrap these classes: `receiver::Receiver`
//! (connect from a spec, `receive` updates, `ack` them), `update::Update` and
//! `update::Tensor` (zero-copy views of a received version, through numpy's
//! `__array_interface__`), `sender::Sender` (publish a trainer's arrays), and
//! `engine::join_engine` (this process as an engine rank of a topology). Errors are
//! raised as the classes of `refit.errors`, chosen by `errors::to_py`.
#![warn(missing_docs, unreachable_pub)]

use pyo3::prelude::*;

mod conformance;
mod engine;
mod engine_stream;
mod errors;
mod lane;
mod mesh;
mod receiver;
mod sender;
mod spec;
mod trainer;
mod update;
mod verify;
mod wait;

/// The module `refit._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<receiver::Receiver>()?;
    m.add_class::<update::Update>()?;
    m.add_class::<update::Tensor>()?;
    m.add_class::<engine_stream::PyTensorStream>()?;
    m.add_class::<sender::Sender>()?;
    m.add_class::<mesh::MeshSender>()?;
    m.add_class::<mesh::MeshReceiver>()?;
    m.add_function(wrap_pyfunction!(spec::transports, m)?)?;
    m.add_function(wrap_pyfunction!(engine::join_engine, m)?)?;
    m.add_function(wrap_pyfunction!(conformance::engine_conformance, m)?)?;
    m.add_function(wrap_pyfunction!(engine::check_started, m)?)?;
    m.add_function(wrap_pyfunction!(trainer::join_trainer, m)?)?;
    m.add_function(wrap_pyfunction!(verify::checksums, m)?)?;
    m.add(
        "CONFORMANCE_CHECKS",
        refit_actors::conformance::CHECKS.to_vec(),
    )?;
    m.add("UNSOLVED", refit_actors::run::UNSOLVED)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
