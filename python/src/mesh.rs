//! `refit.MeshSender` and `refit.MeshReceiver`: trainer shards publish the parts they hold,
//! engines pull the parts they serve from every shard at once (see
//! `refit_transports::mesh`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use refit_node::{ClusterToken, Node, NodeConfig};
use refit_runtime::{DType, Manifest, ModelId, Version, wire};
use refit_transports::mesh::{self, MeshEndpoint, Part, Parts};

use crate::errors::{config, refused, to_py};
use crate::receiver::lock;
use crate::wait::seconds;

/// A part as Python gives it: `"whole"`, `("slice", dim, rank, world)` or
/// `("flat", start, end)`.
fn part_of(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Part> {
    if let Ok(s) = obj.extract::<String>() {
        if s == "whole" {
            return Ok(Part::Whole);
        }
    } else if let Ok((kind, a, b, c)) = obj.extract::<(String, usize, usize, usize)>() {
        if kind == "slice" {
            return Ok(Part::Slice {
                dim: a,
                rank: b,
                world: c,
            });
        }
    } else if let Ok((kind, start, end)) = obj.extract::<(String, usize, usize)>()
        && kind == "flat"
    {
        return Ok(Part::Flat { start, end });
    }
    Err(config(format!(
        "tensor `{name}`: a part is \"whole\", (\"slice\", dim, rank, world) or (\"flat\", \
         start, end), not {obj}"
    )))
}

fn parts_of(parts: Vec<(String, Bound<'_, PyAny>)>) -> PyResult<Parts> {
    parts
        .into_iter()
        .map(|(name, p)| part_of(&name, &p).map(|p| (name, p)))
        .collect()
}

/// A manifest of `(name, dtype, shape)` tensors; `of` follows a tensor's name in errors
/// (`" of `policy`"`, or empty).
pub(crate) fn manifest_of(
    tensors: Vec<(String, String, Vec<usize>)>,
    of: &str,
) -> PyResult<Manifest> {
    let mut b = Manifest::builder();
    for (name, dtype, shape) in tensors {
        let d = DType::from_name(&dtype)
            .ok_or_else(|| config(format!("tensor `{name}`{of}: unknown dtype `{dtype}`")))?;
        b = b.tensor(name, d, &shape);
    }
    b.build().map_err(to_py)
}

/// A trainer shard's end (see `refit.MeshSender`).
#[pyclass(module = "refit._native", frozen)]
pub(crate) struct MeshSender {
    sender: mesh::MeshSender,
    card: String,
}

#[pymethods]
impl MeshSender {
    /// A sender of `parts` of the tensors of `manifest` (`(name, dtype, shape)` each) on a
    /// node of its own, bound to `bind` (default loopback, any port).
    #[new]
    #[pyo3(signature = (manifest, parts, token = None, bind = None, model = "policy"))]
    fn new(
        manifest: Vec<(String, String, Vec<usize>)>,
        parts: Vec<(String, Bound<'_, PyAny>)>,
        token: Option<&str>,
        bind: Option<&str>,
        model: &str,
    ) -> PyResult<Self> {
        let model = ModelId::new(model).map_err(to_py)?;
        let m = manifest_of(manifest, "")?;
        let parts = parts_of(parts)?;
        let token = match token {
            Some(t) => ClusterToken::new(t).map_err(|e| config(e.to_string()))?,
            None => ClusterToken::from_env_or_random().map_err(|e| to_py(e.into()))?,
        };
        let mut cfg = NodeConfig::loopback(token);
        if let Some(b) = bind {
            let addr: SocketAddr = b
                .parse()
                .map_err(|e| config(format!("bind address `{b}`: {e}")))?;
            cfg = cfg.with_bind(addr);
        }
        let node = Node::start(cfg).map_err(|e| to_py(e.into()))?;
        let sender = mesh::MeshSender::on_node(&node, model, &m, parts).map_err(to_py)?;
        let card = wire::to_token(&(sender.endpoint(), sender.parts().clone())).map_err(to_py)?;
        // the sender keeps its node (a handle of it) serving for as long as it lives
        Ok(Self { sender, card })
    }

    /// What receivers are given to find this sender and know what it holds (no secret).
    #[getter]
    fn card(&self) -> &str {
        &self.card
    }

    /// Publishes `version`: one contiguous byte buffer per part, in the order of the parts.
    fn publish(
        &self,
        py: Python<'_>,
        version: u64,
        buffers: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let mut data: Vec<Arc<[u8]>> = Vec::with_capacity(buffers.len());
        for (i, obj) in buffers.iter().enumerate() {
            let buf = PyBuffer::<u8>::get(obj)
                .map_err(|e| refused(format!("part {i}: not a contiguous byte buffer ({e})")))?;
            // made in place (an `Arc` of a `Vec` would copy the part once more)
            let mut part: Arc<[u8]> = std::iter::repeat_n(0u8, buf.len_bytes()).collect();
            let dst = Arc::get_mut(&mut part)
                .ok_or_else(|| refused(format!("part {i}: its buffer is shared")))?;
            buf.copy_to_slice(py, dst)
                .map_err(|e| refused(format!("part {i}: {e}")))?;
            data.push(part);
        }
        py.detach(|| self.sender.publish(Version(version), data))
            .map_err(to_py)
    }
}

/// An engine's end (see `refit.MeshReceiver`).
#[pyclass(module = "refit._native", frozen)]
pub(crate) struct MeshReceiver {
    receiver: Mutex<mesh::MeshReceiver>,
}

#[pymethods]
impl MeshReceiver {
    /// A receiver of `wants` (parts of the tensors of `manifest`) from the senders whose
    /// cards are given; plans its pieces once.
    #[new]
    #[pyo3(signature = (manifest, senders, wants, token = None))]
    fn new(
        manifest: Vec<(String, String, Vec<usize>)>,
        senders: Vec<String>,
        wants: Vec<(String, Bound<'_, PyAny>)>,
        token: Option<&str>,
    ) -> PyResult<Self> {
        let m = manifest_of(manifest, "")?;
        let wants = parts_of(wants)?;
        let book = senders
            .iter()
            .map(|c| wire::from_token::<(MeshEndpoint, Parts)>(c.trim()))
            .collect::<refit_runtime::Result<Vec<_>>>()
            .map_err(|e| config(format!("not a mesh sender's card: {e}")))?;
        let token = match token {
            Some(t) => ClusterToken::new(t).map_err(|e| config(e.to_string()))?,
            None => ClusterToken::from_env()
                .map_err(|e| to_py(e.into()))?
                .ok_or_else(|| config("no cluster token: pass token= or set REFIT_TOKEN"))?,
        };
        let receiver = mesh::MeshReceiver::new(&m, book, wants, token).map_err(to_py)?;
        Ok(Self {
            receiver: Mutex::new(receiver),
        })
    }

    /// Pulls `version` of the wanted parts (waiting up to `timeout` seconds for every
    /// sender to publish it): one `bytes` per wanted part, in the order of the wants.
    #[pyo3(signature = (version, timeout = 30.0))]
    fn pull<'py>(
        &self,
        py: Python<'py>,
        version: u64,
        timeout: f64,
    ) -> PyResult<Vec<Bound<'py, pyo3::types::PyBytes>>> {
        let timeout = seconds("timeout", timeout)?;
        let mut guard = lock(py, &self.receiver);
        let receiver: &mut mesh::MeshReceiver = &mut guard;
        let pulled = py
            .detach(|| receiver.pull(Version(version), timeout))
            .map_err(to_py)?;
        let out = pulled
            .parts
            .iter()
            .map(|p| pyo3::types::PyBytes::new(py, p))
            .collect();
        // copied into Python's bytes: the next pull lands in these buffers, not new memory
        // (the bytes objects themselves are new each pull)
        receiver.recycle(pulled);
        Ok(out)
    }

    /// Pulls `version` of the wanted parts straight into `buffers` (one writable,
    /// C-contiguous buffer per wanted part, in the order of the wants, each the part's
    /// size, none overlapping another), waiting up to `timeout` seconds.
    #[pyo3(signature = (version, buffers, timeout = 30.0))]
    fn pull_into(
        &self,
        py: Python<'_>,
        version: u64,
        buffers: Vec<Bound<'_, PyAny>>,
        timeout: f64,
    ) -> PyResult<()> {
        let timeout = seconds("timeout", timeout)?;
        let held = buffers
            .iter()
            .enumerate()
            .map(|(i, obj)| {
                let buf = PyBuffer::<u8>::get(obj)
                    .map_err(|e| refused(format!("buffer {i}: not a byte buffer ({e})")))?;
                if buf.readonly() || !buf.is_c_contiguous() {
                    return Err(refused(format!(
                        "buffer {i}: not writable and C-contiguous"
                    )));
                }
                Ok(buf)
            })
            .collect::<PyResult<Vec<_>>>()?;
        let mut spans: Vec<(usize, usize, usize)> = held
            .iter()
            .enumerate()
            .map(|(i, b)| (b.buf_ptr() as usize, b.len_bytes(), i))
            .collect();
        // an empty buffer aliases nothing, but sorted among the others it would hide an
        // overlap of its neighbours from the pairwise check
        spans.retain(|&(_, len, _)| len > 0);
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(refused(format!(
                    "buffers {} and {} overlap",
                    w[0].2.min(w[1].2),
                    w[0].2.max(w[1].2)
                )));
            }
        }
        let mut views: Vec<&mut [u8]> = held
            .iter()
            .map(|b| {
                if b.len_bytes() == 0 {
                    return &mut [][..];
                }
                // SAFETY: `b` is a writable, C-contiguous buffer of `len_bytes()` bytes that
                // its exporter keeps valid and in place while `b` lives (`held` outlives every
                // use of `views`, both dropped at the end of this function); no two buffers
                // overlap (checked above), so the slices alias nothing; `u8` has no alignment
                // or validity requirement. A Python thread touching the buffer while the pull
                // runs (the GIL is released) sees bytes of either version, as with any
                // extension that writes a buffer without the GIL.
                unsafe { std::slice::from_raw_parts_mut(b.buf_ptr().cast::<u8>(), b.len_bytes()) }
            })
            .collect();
        let mut guard = lock(py, &self.receiver);
        let receiver: &mut mesh::MeshReceiver = &mut guard;
        py.detach(|| receiver.pull_to(&mut views, Version(version), timeout))
            .map_err(to_py)
    }

    /// Bytes of each wanted part, in the order of the wants.
    #[getter]
    fn part_bytes(&self, py: Python<'_>) -> Vec<usize> {
        lock(py, &self.receiver).part_lens().to_vec()
    }

    /// Bytes each pull reads: the wanted parts, plus 8 bytes of checksum per sender.
    #[getter]
    fn bytes_per_pull(&self, py: Python<'_>) -> u64 {
        lock(py, &self.receiver).bytes_per_pull()
    }
}
