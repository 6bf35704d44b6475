//! `refit.Receiver`: one receiver end of any transport, driven from Python.

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use refit_runtime::{ReceiverInit, ReceiverTransport, WeightSet};

use crate::errors::{Closed, to_py};
use crate::update::{Tensor, Update};
use crate::wait::{Stash, collect, in_background, seconds};

type Inner = refit_runtime::Receiver<Box<dyn ReceiverTransport>>;

/// A connected receiver (see `refit.Receiver` for the Python-facing documentation).
#[pyclass(module = "refit._native", frozen)]
pub(crate) struct Receiver {
    inner: Arc<Mutex<Option<Inner>>>,
    /// What the transfers landed and read off the wire, where the transport counts it.
    meter: Option<Arc<dyn refit_runtime::WireMeter>>,
    transport: String,
    /// A `receive` that Ctrl-C interrupted: its result, for the next `receive`.
    stash: Stash<Staged>,
    /// The thread running a `stream` now: its `apply` must not call back into the
    /// receiver, whose lock that thread holds.
    streaming_on: Mutex<Option<std::thread::ThreadId>>,
}

/// What one `stage` on the receive thread gave.
type Staged = PyResult<Option<refit_runtime::Update>>;

/// Locks `m` with the GIL released, so a thread waiting for it never holds the GIL that the
/// holder needs to check signals between two slices of its wait.
pub(crate) fn lock<'a, T>(py: Python<'_>, m: &'a Mutex<T>) -> MutexGuard<'a, T> {
    m.lock_py_attached(py)
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Marks the current thread as streaming into a receiver for as long as it lives.
struct StreamingOn<'a>(&'a Mutex<Option<std::thread::ThreadId>>);

impl<'a> StreamingOn<'a> {
    fn new(slot: &'a Mutex<Option<std::thread::ThreadId>>) -> Self {
        *slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(std::thread::current().id());
        Self(slot)
    }
}

impl Drop for StreamingOn<'_> {
    fn drop(&mut self) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

fn closed(transport: &str) -> PyErr {
    Closed::new_err(format!("the {transport} receiver is closed"))
}

impl Drop for Receiver {
    /// A receiver Python lets go of without `close()` lets go of its transport with the GIL
    /// released (without locking it: a receive that Ctrl-C interrupted may still hold it,
    /// until its own deadline), so that no other Python thread waits for its shutdown.
    fn drop(&mut self) {
        let inner = std::mem::take(&mut self.inner);
        Python::attach(|py| py.detach(move || drop(inner)));
    }
}

impl Receiver {
    /// Refuses a call from inside a `stream`'s `apply` (its thread holds the receiver).
    fn not_streaming_here(&self) -> PyResult<()> {
        let on = *self
            .streaming_on
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if on == Some(std::thread::current().id()) {
            return Err(Closed::new_err(
                "the receiver is streaming a version into this apply: call it after stream returns",
            ));
        }
        Ok(())
    }

    fn with<T>(&self, py: Python<'_>, f: impl FnOnce(&mut Inner) -> PyResult<T>) -> PyResult<T> {
        self.not_streaming_here()?;
        let mut guard = lock(py, &self.inner);
        match guard.as_mut() {
            Some(inner) => f(inner),
            None => Err(closed(&self.transport)),
        }
    }

    /// Acknowledges `entries` (called by `Update.ack`).
    pub(crate) fn ack_entries(
        &self,
        py: Python<'_>,
        entries: &[(refit_runtime::ModelId, refit_runtime::Version)],
    ) -> PyResult<()> {
        self.with(py, |r| py.detach(|| r.ack(entries)).map_err(to_py))
    }
}

#[pymethods]
impl Receiver {
    /// Connects to the sender `spec` describes (text), waiting up to `timeout` seconds for
    /// its manifests and first version (which is acknowledged here; with `stream`, the first
    /// `stream` hands it over instead).
    #[new]
    #[pyo3(signature = (spec, timeout = 30.0, token = None, copy = false, delta = "buckets", stream = false))]
    fn new(
        py: Python<'_>,
        spec: &str,
        timeout: f64,
        token: Option<&str>,
        copy: bool,
        delta: &str,
        stream: bool,
    ) -> PyResult<Self> {
        let timeout = seconds("timeout", timeout)?;
        let (transport, name) = crate::spec::open(spec, token, copy, delta, stream)?;
        let meter = transport.meter();
        let init = ReceiverInit::new(transport, None);
        let inner = py
            .detach(|| {
                if stream {
                    init.connect_streaming(timeout)
                } else {
                    init.connect(timeout)
                }
            })
            .map_err(to_py)?;
        Ok(Self {
            inner: Arc::new(Mutex::new(Some(inner))),
            meter,
            transport: name,
            stash: Mutex::new(None),
            streaming_on: Mutex::new(None),
        })
    }

    /// `(landed, on_wire)`: the weight bytes the transfers landed and the bytes they read
    /// off the wire, where the transport counts them (TCP); `None` elsewhere.
    #[getter]
    fn wire(&self) -> Option<(u64, u64)> {
        self.meter.as_ref().map(|m| (m.landed(), m.on_wire()))
    }

    /// The transport's name (`"shm"`, `"tcp"`, `"file"`, `"broadcast"`).
    #[getter]
    fn transport(&self) -> &str {
        &self.transport
    }

    /// The models the sender publishes, in order.
    #[getter]
    fn models(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.with(py, |r| {
            Ok(r.manifests().iter().map(|(id, _)| id.to_string()).collect())
        })
    }

    /// Each model's tensors as `(name, dtype, shape)`, in order.
    fn manifest(
        &self,
        py: Python<'_>,
        model: &str,
    ) -> PyResult<Vec<(String, &'static str, Vec<usize>)>> {
        self.with(py, |r| {
            let id = refit_runtime::ModelId::new(model).map_err(to_py)?;
            let m = r.manifests().get(&id).map_err(to_py)?;
            Ok(m.tensors()
                .iter()
                .map(|t| (t.name.clone(), t.dtype.name(), t.shape.clone()))
                .collect())
        })
    }

    /// The version in force for `model`.
    fn version(&self, py: Python<'_>, model: &str) -> PyResult<u64> {
        self.with(py, |r| {
            let id = refit_runtime::ModelId::new(model).map_err(to_py)?;
            Ok(r.version(&id).get())
        })
    }

    /// The weights in force for every model (already acknowledged).
    fn current(slf: &Bound<'_, Self>) -> PyResult<Update> {
        let py = slf.py();
        let group: Vec<Arc<WeightSet>> = slf.get().with(py, |r| {
            Ok(r.served()
                .load()
                .iter()
                .map(|(_, w)| Arc::clone(w))
                .collect())
        })?;
        Ok(Update::new(group, slf.clone().unbind(), true))
    }

    /// Waits up to `timeout` seconds for the next version; `None` if none came. The update
    /// is applied to this receiver but not acknowledged: call its `ack()` once the engine
    /// serves it.
    #[pyo3(signature = (timeout = 1.0))]
    fn receive(slf: &Bound<'_, Self>, timeout: f64) -> PyResult<Option<Update>> {
        let py = slf.py();
        let timeout = seconds("timeout", timeout)?;
        let me = slf.get();
        me.not_streaming_here()?;
        let staged = match collect(py, &me.stash)? {
            Some(earlier) => earlier,
            None => {
                let inner = Arc::clone(&me.inner);
                let transport = me.transport.clone();
                in_background(py, &me.stash, move || {
                    let mut guard = inner
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    match guard.as_mut() {
                        Some(r) => r.stage(timeout).map_err(to_py),
                        None => Err(closed(&transport)),
                    }
                })?
            }
        };
        Ok(staged?.map(|u| Update::new(u.group, slf.clone().unbind(), false)))
    }

    /// Waits up to `timeout` seconds for the next version and streams it: `apply` is called
    /// with each tensor (a `Tensor`) as soon as its bytes are in and verified, on this
    /// thread. Once every tensor is applied the versions are acknowledged (unless `ack` is
    /// false: then `ack(entries)` does it) and returned as `(model, version)` pairs; `None`
    /// if none came. An exception of `apply` stops the
    /// transfer: it is raised as it is when nothing was applied, else as `NeedsFullResend`
    /// (the caller's model is mixed) with it as the cause.
    #[pyo3(signature = (apply, timeout = 1.0, ack = true))]
    fn stream(
        &self,
        py: Python<'_>,
        apply: Py<PyAny>,
        timeout: f64,
        ack: bool,
    ) -> PyResult<Option<Vec<(String, u64)>>> {
        let timeout = seconds("timeout", timeout)?;
        let mut raised: Option<PyErr> = None;
        let streamed = self.with(py, |r| {
            let on = StreamingOn::new(&self.streaming_on);
            let streamed = py.detach(|| {
                let mut apply_one = |one: refit_runtime::WeightSet| {
                    Python::attach(|py| {
                        let tensor = one.first_name().to_owned();
                        let t = Tensor::only(Arc::new(one)).ok_or(refit_runtime::Error::State(
                            "a streamed weight set without a tensor",
                        ))?;
                        // Ctrl-C is taken between two tensors, before the next is applied
                        let called = py.check_signals().and_then(|()| apply.call1(py, (t,)));
                        called.map(|_| ()).map_err(|e| {
                            let reason = format!("apply raised {e}");
                            raised = Some(e);
                            refit_runtime::Error::Bridge {
                                library: "python",
                                tensor,
                                reason,
                            }
                        })
                    })
                };
                if ack {
                    r.stream(timeout, &mut apply_one)
                } else {
                    r.stream_staged(timeout, &mut apply_one)
                }
            });
            drop(on);
            Ok(streamed)
        })?;
        match streamed {
            Ok(entries) => Ok(entries.map(|es| {
                es.into_iter()
                    .map(|(m, v)| (m.to_string(), v.get()))
                    .collect()
            })),
            Err(e) => {
                let partly = matches!(e, refit_runtime::Error::PartlyApplied { .. });
                let err = match raised {
                    Some(_) => to_py(e),
                    None => crate::errors::to_py_chained(py, e),
                };
                Err(crate::errors::stream_failure(py, err, partly, raised))
            }
        }
    }

    /// Acknowledges `(model, version)` pairs (what `stream(..., ack=False)` returned).
    fn ack(&self, py: Python<'_>, entries: Vec<(String, u64)>) -> PyResult<()> {
        let entries = entries
            .into_iter()
            .map(|(m, v)| {
                let m = refit_runtime::ModelId::new(&m).map_err(to_py)?;
                Ok((m, refit_runtime::Version(v)))
            })
            .collect::<PyResult<Vec<_>>>()?;
        self.ack_entries(py, &entries)
    }

    /// Releases the transport (slots, connections, locks). Updates still held keep their
    /// memory; acknowledging them fails.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.not_streaming_here()?;
        let taken = lock(py, &self.inner).take();
        match taken {
            Some(inner) => py.detach(|| inner.shutdown()).map_err(to_py),
            None => Ok(()),
        }
    }

    /// True once closed.
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        // inside a `stream`'s apply the receiver is open (and locked by this thread)
        if self.not_streaming_here().is_err() {
            return false;
        }
        lock(py, &self.inner).is_none()
    }
}
