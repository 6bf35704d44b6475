//! `refit.engine.join`: a Python process as an engine rank of a topology. The rank is Refit's
//! own (`refit_actors::run::join_backend`: the rendezvous with rank 0's store, keepalive
//! both ways, orphan exit, restart and rejoin, the rollout workers of its models, the report);
//! only the engine's model is Python: a [`PyBackend`] calls the object `refit.engine` wraps
//! around the user's engine (`_Adapter`), with the GIL held for each call and released
//! everywhere else.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use refit_actors::actor::{EngineBackend, TensorStream};
use refit_actors::generation::{Completion, Finish};
use refit_actors::protocol::engine::{Generate, Score};
use refit_actors::{GenRoles, GrpoRoles, run};
use refit_runtime::{Manifest, ModelId, Version, WeightSet};

use crate::engine_stream::PyTensorStream;
use crate::errors::{RefitError, config, log_raised, to_py};
use crate::lane::Lane;
use crate::mesh::manifest_of;
use crate::update::Update;

/// The roles a Python engine rank can host beside its engine (the rollout workers' tasks,
/// the evaluator's), by the name `join` takes.
const ROLES: [&str; 1] = ["grpo"];

/// What every Python rank starts from: `roles` checked (the package's, named when not),
/// the topology `refit launch` gave (with its `--set` overrides) and the launch variables,
/// the rank's log lines set up.
pub(crate) fn rank_setup(
    roles: &str,
) -> PyResult<(refit_runtime::topology::Topology, refit_node::LaunchEnv)> {
    if !ROLES.contains(&roles) {
        return Err(config(format!(
            "roles `{roles}` are not known to the refit package (known: {})",
            ROLES.join(", ")
        )));
    }
    let topo = refit_node::launch::load_topology().map_err(launch_error)?;
    let launch = refit_node::LaunchEnv::from_env().map_err(launch_error)?;
    // the same log lines as a Rust rank's (`RUST_LOG`, `REFIT_LOG_FORMAT`)
    refit_node::logging::init_logging();
    Ok((topo, launch))
}

/// A Python engine behind the backend contract: every call goes to the adapter's method of
/// the same name ([`Calls`]), on one of two threads of the process's life ([`Lane`]): one
/// for the weights (stage, commit, abort), one for the requests, so a stage runs beside a
/// batch as the contract wants.
pub(crate) struct PyBackend {
    calls: Arc<Calls>,
    weights: Arc<Lane>,
    requests: Arc<Lane>,
    name: String,
    manifests: BTreeMap<ModelId, Arc<Manifest>>,
    /// The engine's `commits_in_flight`.
    in_flight: bool,
    /// The engine has a `load_streamed` of its own (`apply = "streaming"`).
    streams: bool,
    /// The version the last interrupt of each model named: what an answer `aborted` was
    /// aborted by.
    interrupted: Interrupted,
}

/// The version the last interrupt of each model named.
type Interrupted = Arc<std::sync::Mutex<BTreeMap<ModelId, Version>>>;

/// The adapter's methods, called with the GIL held.
struct Calls {
    adapter: Py<PyAny>,
}

/// The error of a call whose lane is gone.
fn lane_gone(model: &str, call: &str) -> refit_actors::Error {
    refit_actors::Error::Generator {
        model: model.to_owned(),
        reason: format!("the thread of the Python engine's {call} is gone"),
    }
}

/// A Python exception as the engine's error, naming the model and the call.
/// Its traceback is logged: the message alone rarely says where a user's engine failed.
fn failed(model: &str, call: &str, e: &PyErr) -> refit_actors::Error {
    log_raised(&format!("the Python engine's {call} (model `{model}`)"), e);
    refit_actors::Error::Generator {
        model: model.to_owned(),
        reason: format!("the Python engine's {call} raised {e}"),
    }
}

/// A launch variable or topology that does not fit: the runtime's error, as `ConfigError`
/// when it is the launch's own (a variable missing or bad, the file).
fn launch_error(e: refit_node::Error) -> PyErr {
    match e {
        refit_node::Error::Launch { .. } => config(e.to_string()),
        e => to_py(e.into()),
    }
}

/// Says `refit-check: started` when `refit launch` runs this program as a check, so that
/// a Python program that imports heavy modules (torch) before `join` still answers the
/// check in time (`refit.engine` calls it when imported).
#[pyfunction]
pub(crate) fn check_started() {
    if refit_node::launch::checking() {
        refit_node::launch::announce_check();
    }
}

/// A layout as Python sees it: `(name, dtype, shape)` per tensor.
pub(crate) fn layout_of(m: &Manifest) -> Vec<(String, &'static str, Vec<usize>)> {
    m.tensors()
        .iter()
        .map(|t| (t.name.clone(), t.dtype.name(), t.shape.clone()))
        .collect()
}

impl Calls {
    /// Calls `method` with `args`; an exception becomes the engine's error for `model`.
    fn call<'py, A>(
        &self,
        py: Python<'py>,
        model: &str,
        method: &str,
        args: A,
    ) -> refit_actors::Result<Bound<'py, PyAny>>
    where
        A: pyo3::call::PyCallArgs<'py>,
    {
        self.adapter
            .bind(py)
            .call_method1(method, args)
            .map_err(|e| failed(model, method, &e))
    }

    /// One batch call of `method` (`generate`, `score`): the requests as `request` makes
    /// them, then one answer each (a call that fails whole fails every request, naming
    /// what it raised; an answer `aborted` was aborted by the model's last interrupt).
    fn batch<R>(
        &self,
        method: &str,
        batch: &[R],
        model_of: fn(&R) -> &ModelId,
        request: impl for<'py> Fn(Python<'py>, &R) -> PyResult<Bound<'py, PyAny>>,
        served: &BTreeMap<ModelId, Version>,
        interrupted: &Interrupted,
    ) -> Vec<refit_actors::Result<Completion>> {
        Python::attach(|py| {
            let all_failed = |e: PyErr| -> Vec<refit_actors::Result<Completion>> {
                batch
                    .iter()
                    .map(|r| Err(failed(model_of(r).as_str(), method, &e)))
                    .collect()
            };
            let requests: PyResult<Vec<Bound<'_, PyAny>>> =
                batch.iter().map(|r| request(py, r)).collect();
            let requests = match requests {
                Ok(r) => r,
                Err(e) => return all_failed(e),
            };
            let served: BTreeMap<String, u64> = served
                .iter()
                .map(|(m, v)| (m.to_string(), v.get()))
                .collect();
            let answers = self
                .adapter
                .bind(py)
                .call_method1(method, (requests, served))
                .and_then(|out| out.extract::<Vec<Bound<'_, PyAny>>>());
            // read once the call returned: the interrupts that ended its sequences
            let by = interrupted
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            match answers {
                Ok(list) => list
                    .iter()
                    .zip(batch)
                    .map(|(a, r)| {
                        let model = model_of(r);
                        completion(model.as_str(), method, a, by.get(model).copied())
                    })
                    .collect(),
                Err(e) => all_failed(e),
            }
        })
    }
}

/// One answer of the adapter: a completion `(tokens, logprobs, versions, finish)`, or the
/// message of what the request raised. A completion `aborted` was aborted by the version
/// `interrupted_by` (the model's last interrupt; refused when there was none).
fn completion(
    model: &str,
    method: &str,
    a: &Bound<'_, PyAny>,
    interrupted_by: Option<Version>,
) -> refit_actors::Result<Completion> {
    let refused = |reason: String| refit_actors::Error::Generator {
        model: model.to_owned(),
        reason,
    };
    if let Ok(message) = a.extract::<String>() {
        return Err(refused(format!(
            "the Python engine's {method} raised {message}"
        )));
    }
    type Answer = (Vec<u32>, Vec<f32>, Option<Vec<u64>>, String);
    let (tokens, logprobs, versions, finish): Answer = a.extract().map_err(|e| {
        refused(format!(
            "the Python engine's {method} answered something that is not a completion: {e}"
        ))
    })?;
    let finish = match (finish.as_str(), interrupted_by) {
        ("length", _) => Finish::Length,
        ("stop", _) => Finish::Stop,
        ("aborted", Some(by)) => Finish::Aborted { by },
        ("aborted", None) => {
            return Err(refused(format!(
                "the Python engine's {method} answered finish `aborted`, but no update \
                 interrupted model `{model}`"
            )));
        }
        (other, _) => {
            return Err(refused(format!(
                "the Python engine's {method} answered finish `{other}` (length, stop or \
                 aborted)"
            )));
        }
    };
    let versions = versions
        .unwrap_or_default()
        .into_iter()
        .map(Version)
        .collect();
    Ok(Completion {
        tokens,
        logprobs,
        versions,
        finish,
    })
}

impl Calls {
    fn stage(&self, weights: Arc<WeightSet>) -> refit_actors::Result<()> {
        let model = weights.model().to_string();
        Python::attach(|py| {
            let update =
                Py::new(py, Update::held(weights)).map_err(|e| failed(&model, "stage", &e))?;
            self.call(py, &model, "stage", (update,)).map(drop)
        })
    }

    /// The Python engine's `commit` may answer the seconds it stopped generation (a float
    /// at least 0), or `None`.
    fn commit(&self, model: &ModelId, version: Version) -> refit_actors::Result<Option<Duration>> {
        Python::attach(|py| {
            let answer = self.call(
                py,
                model.as_str(),
                "commit",
                (model.as_str(), version.get()),
            )?;
            let refused = || refit_actors::Error::Generator {
                model: model.to_string(),
                reason: format!(
                    "the Python engine's commit answered {answer}: the seconds it stopped \
                     generation (a number at least 0) or None"
                ),
            };
            let seconds: Option<f64> = answer.extract().map_err(|_| refused())?;
            seconds
                .map(|s| Duration::try_from_secs_f64(s).map_err(|_| refused()))
                .transpose()
        })
    }

    /// The Python engine's `load_streamed`, with the commit's stream.
    fn load_streamed(
        &self,
        model: &ModelId,
        version: Version,
        stream: TensorStream,
    ) -> refit_actors::Result<()> {
        Python::attach(|py| {
            let native = PyTensorStream::new(stream, model.to_string());
            let native =
                Py::new(py, native).map_err(|e| failed(model.as_str(), "load_streamed", &e))?;
            let args = (model.as_str(), version.get(), native);
            self.call(py, model.as_str(), "load_streamed", args)
                .map(drop)
        })
    }

    fn abort(&self, model: &ModelId) {
        Python::attach(|py| {
            if let Err(e) = self.call(py, model.as_str(), "abort", (model.as_str(),)) {
                tracing::warn!(model = %model, "{e}");
            }
        });
    }

    fn interrupt(&self, model: &ModelId, version: Version) {
        Python::attach(|py| {
            let args = (model.as_str(), version.get());
            if let Err(e) = self.call(py, model.as_str(), "interrupt", args) {
                tracing::warn!(model = %model, "{e}");
            }
        });
    }
}

impl EngineBackend for PyBackend {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn commits_in_flight(&self) -> bool {
        self.in_flight
    }

    fn streams(&self) -> bool {
        self.streams
    }

    fn manifest(&self, model: &ModelId) -> refit_actors::Result<Arc<Manifest>> {
        self.manifests.get(model).cloned().ok_or_else(|| {
            refit_actors::Error::Config(format!("model `{model}` is not served by {}", self.name))
        })
    }

    fn stage(&self, weights: Arc<WeightSet>) -> refit_actors::Result<()> {
        let (calls, model) = (Arc::clone(&self.calls), weights.model().to_string());
        let done = self.weights.run(move || calls.stage(weights));
        done.unwrap_or_else(|| Err(lane_gone(&model, "stage")))
    }

    /// Ends the model's interrupt here too: no batch runs (under `abort` a commit waits for
    /// the batch, whose answers were read), so a later `aborted` answer is refused.
    fn commit(&self, model: &ModelId, version: Version) -> refit_actors::Result<Option<Duration>> {
        self.interrupted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(model);
        let (calls, m) = (Arc::clone(&self.calls), model.clone());
        let done = self.weights.run(move || calls.commit(&m, version));
        done.unwrap_or_else(|| Err(lane_gone(model.as_str(), "commit")))
    }

    /// On the weights' thread, as a commit; it ends the model's interrupt too.
    fn commit_streamed(
        &self,
        model: &ModelId,
        version: Version,
        stream: &TensorStream,
    ) -> refit_actors::Result<()> {
        self.interrupted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(model);
        let (calls, m, s) = (Arc::clone(&self.calls), model.clone(), stream.clone());
        let done = self
            .weights
            .run(move || calls.load_streamed(&m, version, s));
        done.unwrap_or_else(|| Err(lane_gone(model.as_str(), "load_streamed")))
    }

    /// Queued on the weights' thread, not waited for (the engine's thread calls it):
    /// later stages and commits run after it.
    fn abort(&self, model: &ModelId) {
        let (calls, m) = (Arc::clone(&self.calls), model.clone());
        if !self.weights.post(Box::new(move || calls.abort(&m))) {
            tracing::warn!(model = %model, "{}", lane_gone(model.as_str(), "abort"));
        }
    }

    /// Recorded (what the answers `aborted` were aborted by), then queued on the weights'
    /// thread, not waited for (the engine's thread calls it): the commit that follows runs
    /// after it.
    fn interrupt(&self, model: &ModelId, version: Version) {
        self.interrupted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(model.clone(), version);
        let (calls, m) = (Arc::clone(&self.calls), model.clone());
        if !self
            .weights
            .post(Box::new(move || calls.interrupt(&m, version)))
        {
            tracing::warn!(model = %model, "{}", lane_gone(model.as_str(), "interrupt"));
        }
    }

    fn generate(
        &self,
        batch: &[Generate],
        served: &BTreeMap<ModelId, Version>,
    ) -> Vec<refit_actors::Result<Completion>> {
        self.on_requests("generate", batch, served, |g| &g.model, generate_request)
    }

    fn score(
        &self,
        batch: &[Score],
        served: &BTreeMap<ModelId, Version>,
    ) -> Vec<refit_actors::Result<Completion>> {
        self.on_requests("score", batch, served, |s| &s.model, score_request)
    }
}

impl PyBackend {
    /// The backend of `adapter` (`refit.engine._Adapter`) serving `specs`: each model's
    /// layout is the one the engine answers for the roles' (`"grpo"`) engine layout, and
    /// its calls run on two lanes of their own (answered beside it, to be closed when the
    /// backend is done).
    ///
    /// # Errors
    /// What the engine raised (its name, `commits_in_flight`, `manifest`), a layout that
    /// is not one, or a lane that cannot start.
    pub(crate) fn start(
        py: Python<'_>,
        adapter: Py<PyAny>,
        specs: &[refit_actors::ModelSpec],
    ) -> PyResult<(Self, [Arc<Lane>; 2])> {
        let grpo = GrpoRoles::new();
        let name: String = adapter.bind(py).call_method0("name")?.extract()?;
        let in_flight: bool = adapter
            .bind(py)
            .call_method0("commits_in_flight")?
            .extract()?;
        let streams: bool = adapter.bind(py).call_method0("streams")?.extract()?;
        let mut manifests = BTreeMap::new();
        for spec in specs {
            let theirs = grpo.engine_shape(spec).map_err(rank_error)?.manifest;
            let params = serde_json::to_string(&spec.params)
                .map_err(|e| config(format!("model `{}`: params: {e}", spec.id)))?;
            let layout: Vec<(String, String, Vec<usize>)> = adapter
                .bind(py)
                .call_method1("manifest", (spec.id.as_str(), layout_of(&theirs), params))?
                .extract()?;
            let of = format!(" of the engine's layout of `{}`", spec.id);
            manifests.insert(spec.id.clone(), Arc::new(manifest_of(layout, &of)?));
        }
        let lanes = [
            Arc::new(Lane::start("refit-py-weights")?),
            Arc::new(Lane::start("refit-py-requests")?),
        ];
        let backend = Self {
            calls: Arc::new(Calls { adapter }),
            weights: Arc::clone(&lanes[0]),
            requests: Arc::clone(&lanes[1]),
            name,
            manifests,
            in_flight,
            streams,
            interrupted: Interrupted::default(),
        };
        Ok((backend, lanes))
    }

    /// The adapter's `method` on `batch` (each request made by `request`), on the
    /// requests' thread; every request fails naming `method` when that thread is gone.
    fn on_requests<R: Clone + Send + 'static>(
        &self,
        method: &'static str,
        batch: &[R],
        served: &BTreeMap<ModelId, Version>,
        model_of: fn(&R) -> &ModelId,
        request: for<'py> fn(Python<'py>, &R) -> PyResult<Bound<'py, PyAny>>,
    ) -> Vec<refit_actors::Result<Completion>> {
        let (calls, asked, at) = (Arc::clone(&self.calls), batch.to_vec(), served.clone());
        let interrupted = Arc::clone(&self.interrupted);
        let done = self
            .requests
            .run(move || calls.batch(method, &asked, model_of, request, &at, &interrupted));
        done.unwrap_or_else(|| {
            batch
                .iter()
                .map(|r| Err(lane_gone(model_of(r).as_str(), method)))
                .collect()
        })
    }
}

/// A completion request as the adapter takes it: `(model, prompt, max_tokens, temperature,
/// seed, stop)`.
fn generate_request<'py>(py: Python<'py>, g: &Generate) -> PyResult<Bound<'py, PyAny>> {
    let p = &g.params;
    let r = (
        g.model.as_str(),
        g.prompt.clone(),
        p.max_tokens,
        p.temperature,
        p.seed,
        p.stop,
    );
    r.into_pyobject(py).map(Bound::into_any)
}

/// A score request as the adapter takes it: `(model, prompt, tokens, temperature)`.
fn score_request<'py>(py: Python<'py>, s: &Score) -> PyResult<Bound<'py, PyAny>> {
    let r = (
        s.model.as_str(),
        s.prompt.clone(),
        s.tokens.clone(),
        s.temperature,
    );
    r.into_pyobject(py).map(Bound::into_any)
}

/// A rank's failure as a Python exception: the runtime's as `to_py` maps them, a
/// configuration error as `ConfigError`, anything else as `RefitError`.
pub(crate) fn rank_error(e: impl Into<refit_actors::Error>) -> PyErr {
    match e.into() {
        refit_actors::Error::Runtime(r) => to_py(r),
        refit_actors::Error::Config(m) => config(m),
        other => RefitError::new_err(other.to_string()),
    }
}

/// Runs this process as its rank of the topology `refit launch` started (the launch
/// variables, `REFIT_TOPOLOGY`, the cluster token from the environment), its engine being
/// `adapter` (`refit.engine._Adapter`) and its other roles `roles`' (`"grpo"`). Answers
/// the run's report as a dict on rank 0, `None` on the others and in a check.
#[pyfunction]
pub(crate) fn join_engine(
    py: Python<'_>,
    adapter: Py<PyAny>,
    roles: &str,
) -> PyResult<Option<Py<PyDict>>> {
    let (topo, launch) = rank_setup(roles)?;
    let specs = run::model_specs(&topo).map_err(rank_error)?;
    let (backend, lanes) = PyBackend::start(py, adapter, &specs)?;
    // a rank from here on: SIGINT and SIGTERM release what it holds and end the process
    // (for good: Python's own handling of them does not come back after the run)
    refit_node::signals::install_signal_handlers().map_err(|e| to_py(e.into()))?;
    let report = py
        .detach(|| {
            let report = run::join_backend(&topo, &launch, GrpoRoles::new(), backend);
            // a batch may still run in Python for a request nobody waits for any more
            lanes.iter().for_each(|l| l.close());
            report
        })
        .map_err(rank_error)?;
    report.map(|r| report_dict(py, &r)).transpose()
}

/// The run's report as rank 0's `join` answers it: `solved`, `elapsed_s`.
pub(crate) fn report_dict(py: Python<'_>, report: &run::RunReport) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("solved", report.solved)?;
    d.set_item("elapsed_s", report.elapsed.as_secs_f64())?;
    Ok(d.unbind())
}
