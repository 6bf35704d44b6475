//! `refit.Sender`: a Python trainer publishes its arrays to Rust or Python receivers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use refit_node::ClusterToken;
use refit_runtime::{
    Manifest, Manifests, ModelId, PendingSend, SenderInit, SenderTransport, Version, WeightSet,
};
use refit_transports::link::{self, LinkFactory, LinkOptions};
use refit_transports::shm::{ShmLink, ShmSender};

use crate::errors::{Closed, config, refused, to_py};
use crate::receiver::lock;
use crate::wait::{seconds, sliced};

/// A model's tensors as Python hands them over: name to a C-contiguous byte buffer.
type Arrays<'py> = BTreeMap<String, BTreeMap<String, Bound<'py, PyAny>>>;

/// The sender end, before and after its receivers connect.
enum State {
    /// Opened; receivers may attach; nothing published.
    Opened(Opened),
    /// Connected: versions can be published.
    Shm(Box<refit_runtime::Sender<ShmSender>>),
    /// Connected, any other transport.
    Any(refit_runtime::Sender<Box<dyn SenderTransport>>),
    /// Closed, or consumed by a failed start.
    Closed,
}

enum Opened {
    /// Shared memory: kept typed, to fill lent slots in place.
    Shm(Box<ShmSender>),
    /// Any other transport.
    Any(Box<dyn SenderTransport>),
}

/// A sender end of any transport (see `refit.Sender` for the Python-facing documentation).
#[pyclass(module = "refit._native", frozen)]
pub(crate) struct Sender {
    state: Mutex<(State, Option<PendingSend>)>,
    manifests: Manifests,
    transport: String,
    spec: String,
}

impl Drop for Sender {
    /// A sender Python lets go of without `close()` shuts its transport down with the GIL
    /// released: a shutdown may wait (for a node's threads, say), and other Python threads
    /// must not wait with it.
    fn drop(&mut self) {
        let state = std::mem::replace(
            self.state
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            (State::Closed, None),
        );
        Python::attach(|py| py.detach(move || drop(state)));
    }
}

/// The bytes of `obj` (a C-contiguous buffer of bytes) copied into `dst`, which must have
/// the same length; errors name the tensor. The copy runs with the GIL released, split
/// across threads and with streaming stores for a large tensor
/// ([`refit_runtime::copy::copy_parallel`]): a trainer's publish into a shared-memory slot
/// runs at the memory system's speed, not one core's.
fn copy_in(
    py: Python<'_>,
    model: &ModelId,
    name: &str,
    obj: &Bound<'_, PyAny>,
    dst: &mut [u8],
) -> PyResult<()> {
    let buf = PyBuffer::<u8>::get(obj).map_err(|e| {
        refused(format!(
            "tensor `{name}` of `{model}`: not a contiguous byte buffer ({e})"
        ))
    })?;
    if buf.len_bytes() != dst.len() {
        return Err(refused(format!(
            "tensor `{name}` of `{model}`: {} bytes given, the manifest says {}",
            buf.len_bytes(),
            dst.len()
        )));
    }
    if dst.is_empty() {
        return Ok(());
    }
    if !buf.is_c_contiguous() {
        return buf
            .copy_to_slice(py, dst)
            .map_err(|e| refused(format!("tensor `{name}` of `{model}`: {e}")));
    }
    // SAFETY: `buf` is a C-contiguous buffer of `len_bytes() == dst.len()` bytes (checked
    // above) that the exporter keeps valid and in place while `buf` (held until this function
    // returns, past the copy) lives; `u8` has no alignment or validity requirement. `dst` is
    // memory of ours (a lent slot or a weight set's arena), so the two cannot overlap. A
    // Python thread writing the tensor during the copy (the GIL is released) changes which
    // bytes are published, not the memory safety of the copy: the reads are of plain bytes.
    let src = unsafe { std::slice::from_raw_parts(buf.buf_ptr().cast::<u8>(), dst.len()) };
    let threads = refit_runtime::copy::copy_threads();
    py.detach(|| refit_runtime::copy::copy_parallel(dst, src, threads));
    Ok(())
}

/// Fills `ws` from `arrays` (every tensor of its manifest, and nothing else).
pub(crate) fn fill(
    py: Python<'_>,
    ws: &mut WeightSet,
    arrays: &BTreeMap<String, Bound<'_, PyAny>>,
) -> PyResult<()> {
    let model = ws.model().clone();
    let manifest = Arc::clone(ws.manifest());
    if let Some(unknown) = arrays.keys().find(|n| manifest.get(n).is_none()) {
        return Err(refused(format!(
            "tensor `{unknown}` is not in the manifest of `{model}`"
        )));
    }
    for t in manifest.tensors() {
        let obj = arrays
            .get(&t.name)
            .ok_or_else(|| refused(format!("tensor `{}` of `{model}` is missing", t.name)))?;
        let dst = ws.tensor_bytes_mut(&t.name).map_err(to_py)?;
        copy_in(py, &model, &t.name, obj, dst)?;
    }
    Ok(())
}

impl Sender {
    fn ids(&self, arrays: &Arrays<'_>) -> PyResult<Vec<(ModelId, Arc<Manifest>)>> {
        arrays
            .keys()
            .map(|m| {
                let id = ModelId::new(m).map_err(to_py)?;
                let manifest = Arc::clone(self.manifests.get(&id).map_err(to_py)?);
                Ok((id, manifest))
            })
            .collect()
    }
}

#[pymethods]
impl Sender {
    /// Opens the sender end of `transport` for `manifests` (model → list of
    /// `(name, dtype, shape)`); nothing is published until `start`. `checksum`: a checksum
    /// per version that every receiver verifies (shared memory; TCP checks every bucket).
    #[new]
    #[pyo3(signature = (transport, manifests, receivers = 0, dir = None, token = None, checksum = false))]
    fn new(
        py: Python<'_>,
        transport: &str,
        manifests: BTreeMap<String, Vec<(String, String, Vec<usize>)>>,
        receivers: usize,
        dir: Option<std::path::PathBuf>,
        token: Option<&str>,
        checksum: bool,
    ) -> PyResult<Self> {
        let mut models = Vec::with_capacity(manifests.len());
        for (model, tensors) in manifests {
            let id = ModelId::new(&model).map_err(to_py)?;
            let m = crate::mesh::manifest_of(tensors, &format!(" of `{model}`"))?;
            models.push((id, Arc::new(m)));
        }
        let manifests = Manifests::new(models).map_err(to_py)?;
        let token = match token {
            Some(t) => Some(ClusterToken::new(t).map_err(|e| config(e.to_string()))?),
            None => None,
        };
        let options = LinkOptions {
            expected_receivers: receivers,
            token,
            dir,
            checksum,
            ..LinkOptions::default()
        };
        let factory = link::find(transport).map_err(to_py)?;
        let (opened, spec) = py
            .detach(|| -> refit_runtime::Result<_> {
                if factory.name() == ShmLink.name() {
                    let (s, spec) = ShmLink.open_typed(&manifests, &options)?;
                    Ok((Opened::Shm(Box::new(s)), spec))
                } else {
                    let o = factory.open(&manifests, &options)?;
                    Ok((Opened::Any(o.sender), o.spec))
                }
            })
            .map_err(to_py)?;
        Ok(Self {
            state: Mutex::new((State::Opened(opened), None)),
            manifests,
            transport: factory.name().to_owned(),
            spec: spec.to_token().map_err(to_py)?,
        })
    }

    /// The text receivers connect with (no secret in it).
    #[getter]
    fn spec(&self) -> &str {
        &self.spec
    }

    /// The transport's name.
    #[getter]
    fn transport(&self) -> &str {
        &self.transport
    }

    /// Publishes `arrays` (model → name → bytes) as version 1 and waits up to `timeout`
    /// seconds for the receivers `receivers` asked for.
    fn start(&self, py: Python<'_>, arrays: Arrays<'_>, timeout: f64) -> PyResult<()> {
        let timeout = seconds("timeout", timeout)?;
        let mut initial = Vec::new();
        for (id, manifest) in self.ids(&arrays)? {
            let mut ws = WeightSet::zeroed(id.clone(), manifest);
            ws.set_version(Version(1));
            fill(py, &mut ws, &arrays[id.as_str()])?;
            initial.push(ws);
        }
        let mut guard = lock(py, &self.state);
        let state = std::mem::replace(&mut guard.0, State::Closed);
        let manifests = self.manifests.clone();
        let next = match state {
            State::Opened(Opened::Shm(s)) => py
                .detach(|| SenderInit::new(*s, manifests).connect(initial, timeout))
                .map(|s| State::Shm(Box::new(s))),
            State::Opened(Opened::Any(s)) => py
                .detach(|| SenderInit::new(s, manifests).connect(initial, timeout))
                .map(State::Any),
            other => {
                guard.0 = other;
                return Err(Closed::new_err("this sender is already started or closed"));
            }
        };
        guard.0 = next.map_err(to_py)?;
        Ok(())
    }

    /// Publishes `arrays` as the next version of each model given (all together), without
    /// waiting for acknowledgements (see `wait`). Shared memory is filled in place: the
    /// bytes are copied once, from the arrays into a lent slot.
    #[pyo3(signature = (arrays, timeout = 30.0))]
    fn publish(
        &self,
        py: Python<'_>,
        arrays: Arrays<'_>,
        timeout: f64,
    ) -> PyResult<Vec<(String, u64)>> {
        let deadline = Instant::now() + seconds("timeout", timeout)?;
        let ids = self.ids(&arrays)?;
        let mut guard = lock(py, &self.state);
        let (state, pending) = &mut *guard;
        let sent = match state {
            State::Shm(s) => {
                let mut group = Vec::with_capacity(ids.len());
                for (id, _) in &ids {
                    let v = s.version(id).next();
                    let mut ws = py
                        .detach(|| s.transport_mut().loan(id, v, deadline))
                        .map_err(to_py)?;
                    fill(py, &mut ws, &arrays[id.as_str()])?;
                    group.push(Arc::new(ws));
                }
                py.detach(|| s.publish_shared(group)).map_err(to_py)?
            }
            State::Any(s) => {
                let mut group = Vec::with_capacity(ids.len());
                for (id, manifest) in &ids {
                    let mut ws = WeightSet::zeroed(id.clone(), Arc::clone(manifest));
                    ws.set_version(s.version(id).next());
                    fill(py, &mut ws, &arrays[id.as_str()])?;
                    group.push(Arc::new(ws));
                }
                py.detach(|| s.publish_shared(group)).map_err(to_py)?
            }
            State::Opened(_) => return Err(Closed::new_err("call start() before publishing")),
            State::Closed => return Err(Closed::new_err("this sender is closed")),
        };
        let entries = sent
            .entries()
            .iter()
            .map(|(m, v)| (m.to_string(), v.get()))
            .collect();
        *pending = Some(sent);
        Ok(entries)
    }

    /// Waits up to `timeout` seconds for every receiver to acknowledge the last version
    /// published; raises `refit.Timeout` naming the late receivers.
    #[pyo3(signature = (timeout = 30.0))]
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = seconds("timeout", timeout)?;
        let mut guard = lock(py, &self.state);
        let (state, pending) = &mut *guard;
        let Some(p) = pending.clone() else {
            return Ok(());
        };
        let mut last = None;
        let done = sliced(py, timeout, |slice| {
            let r = match state {
                State::Shm(s) => s.wait(&p, slice),
                State::Any(s) => s.wait(&p, slice),
                _ => return Err(Closed::new_err("this sender is closed")),
            };
            match r {
                Ok(()) => Ok(Some(())),
                Err(e) if e.is_timeout() => {
                    last = Some(e);
                    Ok(None)
                }
                Err(e) => Err(to_py(e)),
            }
        })?;
        match (done, last) {
            (Some(()), _) => {
                *pending = None;
                Ok(())
            }
            (None, Some(e)) => Err(to_py(e)),
            (None, None) => Err(to_py(refit_runtime::Error::Timeout {
                what: "acknowledgements".into(),
                after: timeout,
            })),
        }
    }

    /// The version in force for `model` (0 before `start`).
    fn version(&self, py: Python<'_>, model: &str) -> PyResult<u64> {
        let id = ModelId::new(model).map_err(to_py)?;
        self.manifests.get(&id).map_err(to_py)?;
        let guard = lock(py, &self.state);
        Ok(match &guard.0 {
            State::Shm(s) => s.version(&id).get(),
            State::Any(s) => s.version(&id).get(),
            _ => 0,
        })
    }

    /// Releases the transport: receivers see the sender gone.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let state = std::mem::replace(&mut lock(py, &self.state).0, State::Closed);
        py.detach(|| match state {
            State::Shm(s) => s.shutdown(),
            State::Any(s) => s.shutdown(),
            State::Opened(Opened::Shm(mut s)) => s.shutdown(),
            State::Opened(Opened::Any(mut s)) => s.shutdown(),
            State::Closed => Ok(()),
        })
        .map_err(to_py)
    }
}
