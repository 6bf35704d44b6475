//! `refit.trainer.join`: a Python process as the trainer rank of a topology. The rank is
//! Refit's own (`refit_actors::run::join_generating`: the rendezvous, the weight-sync
//! controller, the trajectory pool, the evaluator, the links to every engine, supervision,
//! the report); only the learner is Python: a [`PyLearner`] per model calls the object
//! `refit.trainer` wraps around the user's learner (`_Adapter`), on one thread of the
//! process's life ([`Lane`]), with the GIL held for each call and released everywhere else.

use std::collections::BTreeMap;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use refit_actors::generation::Finish;
use refit_actors::{
    Batch, EngineShape, GenRoles, GrpoRoles, LearnStats, Learner, ModelSpec, Sequence, run,
};
// the learner's and the roles' traits are the RL layer's, and answer its error
use refit_rl::{Error, Result};
use refit_runtime::{Manifest, ModelId, Version, WeightSet};

use crate::engine::{layout_of, rank_error, rank_setup, report_dict};
use crate::errors::{config, log_raised, to_py};
use crate::lane::Lane;
use crate::sender::fill;

/// The roles of a trainer rank whose learner is Python: GRPO on digit reversal
/// ([`GrpoRoles`]: the task, the engines' generator and the conversion to their layout),
/// the learner of each model a [`PyLearner`] exporting the layout GRPO's own learner does
/// (Refit's transformer), or Hugging Face's `LlamaForCausalLM` (`params.arch = "llama"`,
/// served as it is).
struct PyRoles {
    grpo: GrpoRoles,
    adapter: Arc<Py<PyAny>>,
    lane: Arc<Lane>,
}

/// A Python learner behind Refit's [`Learner`]: `update` and `export` go to the adapter's
/// methods of the same name, on the rank's [`Lane`].
struct PyLearner {
    model: ModelId,
    manifest: Arc<Manifest>,
    version: Version,
    adapter: Arc<Py<PyAny>>,
    lane: Arc<Lane>,
}

impl GenRoles for PyRoles {
    type Task = <GrpoRoles as GenRoles>::Task;
    type Generator = <GrpoRoles as GenRoles>::Generator;

    /// Asks the Python learner to start `model` in GRPO's learner layout (its params and
    /// seed given), the layout every export must have. The params are the model's own,
    /// with `reference_every` when it is set: the engines then serve a reference, and each
    /// sequence carries its log-probabilities under it (`ref_logprobs`); it needs
    /// `kl_coef > 0`, as for GRPO's own learner.
    fn learner(&self, model: &ModelSpec) -> Result<Box<dyn Learner>> {
        let settings = self.grpo.settings(model)?;
        GrpoRoles::served_reference(model, settings.grpo.kl_coef)?;
        let manifest = Arc::new(settings.learner_manifest()?);
        let mut params = model.params.clone();
        if let Some(every) = model.reference_every {
            let every = i64::try_from(every).map_err(|_| {
                Error::Config(format!(
                    "model `{}`: params.reference_every = {every} is too large",
                    model.id
                ))
            })?;
            params.insert("reference_every".into(), toml::Value::Integer(every));
        }
        let params = serde_json::to_string(&params)
            .map_err(|e| Error::Config(format!("model `{}`: params: {e}", model.id)))?;
        let (id, layout, seed) = (model.id.to_string(), layout_of(&manifest), model.seed);
        let adapter = Arc::clone(&self.adapter);
        let started = self.lane.run(move || {
            Python::attach(|py| {
                adapter
                    .bind(py)
                    .call_method1("start", (id, layout, params, seed))
                    .map(drop)
                    .map_err(|e| failed("start", &e))
            })
        });
        // what the learner refuses at the start is the topology's fault: a configuration error
        started
            .unwrap_or_else(|| Err(lane_gone("start")))
            .map_err(|e| Error::Config(format!("model `{}`: {e}", model.id)))?;
        Ok(Box::new(PyLearner {
            model: model.id.clone(),
            manifest,
            version: Version::ZERO,
            adapter: Arc::clone(&self.adapter),
            lane: Arc::clone(&self.lane),
        }))
    }

    fn generator(&self, model: &ModelSpec) -> Result<Self::Generator> {
        self.grpo.generator(model)
    }

    fn task(&self, model: &ModelSpec, seed: u64) -> Result<Self::Task> {
        self.grpo.task(model, seed)
    }

    fn engine_shape(&self, model: &ModelSpec) -> Result<EngineShape> {
        self.grpo.engine_shape(model)
    }

    fn want(&self, model: &ModelSpec) -> Result<Option<refit_runtime::convert::Want>> {
        self.grpo.want(model)
    }
}

/// A Python exception as the learner's error, its traceback logged.
fn failed(call: &str, e: &PyErr) -> Error {
    log_raised(&format!("the Python learner's {call}"), e);
    Error::Trainer(format!("the Python learner's {call} raised {e}"))
}

fn lane_gone(call: &str) -> Error {
    Error::Trainer(format!("the thread of the Python learner's {call} is gone"))
}

/// A sequence as the adapter takes it: `(prompt, tokens, logprobs, versions, reward,
/// token_rewards, group, finish, ref_logprobs)`.
type PySequence = (
    Vec<u32>,
    Vec<u32>,
    Vec<f32>,
    Vec<u64>,
    f32,
    Option<Vec<f32>>,
    u64,
    &'static str,
    Option<Vec<f32>>,
);

fn py_sequence(s: &Sequence) -> PySequence {
    let finish = match s.finish {
        Finish::Length => "length",
        Finish::Stop => "stop",
        Finish::Aborted { .. } => "aborted",
        Finish::Cancelled => "cancelled",
    };
    (
        s.prompt.clone(),
        s.tokens.clone(),
        s.logprobs.clone(),
        s.versions.iter().map(|v| v.get()).collect(),
        s.reward,
        s.token_rewards.clone(),
        s.group,
        finish,
        s.ref_logprobs.clone(),
    )
}

impl Learner for PyLearner {
    /// Refuses a sequence no learner can train on (a behaviour log-probability or a
    /// version missing per token, naming the field) before Python sees the batch.
    fn update(&mut self, batch: &Batch) -> Result<LearnStats> {
        for (i, s) in batch.sequences.iter().enumerate() {
            s.check_fields().map_err(|why| {
                Error::Trainer(format!(
                    "model `{}`: sequence {i} (group {}) of the batch: {why}",
                    self.model, s.group
                ))
            })?;
        }
        let seqs: Vec<PySequence> = batch.sequences.iter().map(py_sequence).collect();
        let (model, adapter) = (self.model.to_string(), Arc::clone(&self.adapter));
        let answer = self.lane.run(move || {
            Python::attach(|py| {
                adapter
                    .bind(py)
                    .call_method1("update", (model, seqs))
                    .and_then(|d| d.extract::<BTreeMap<String, f64>>())
                    .map_err(|e| failed("update", &e))
            })
        });
        let values = answer.unwrap_or_else(|| Err(lane_gone("update")))?;
        Ok(LearnStats { values })
    }

    /// The Python learner's tensors, copied into a version of the manifest's layout
    /// (every tensor, of its dtype and size, nothing else).
    fn export(&mut self) -> Result<WeightSet> {
        let (model, manifest) = (self.model.clone(), Arc::clone(&self.manifest));
        let adapter = Arc::clone(&self.adapter);
        let exported = self.lane.run(move || {
            Python::attach(|py| {
                let mut ws = WeightSet::zeroed(model.clone(), manifest);
                adapter
                    .bind(py)
                    .call_method1("export", (model.as_str(),))
                    .and_then(|d| d.extract::<BTreeMap<String, Bound<'_, PyAny>>>())
                    .and_then(|arrays| fill(py, &mut ws, &arrays))
                    .map(|()| ws)
                    .map_err(|e| failed("export", &e))
            })
        });
        let mut ws = exported.unwrap_or_else(|| Err(lane_gone("export")))?;
        self.version = self.version.next();
        ws.set_version(self.version);
        Ok(ws)
    }

    fn manifest(&self) -> Arc<Manifest> {
        Arc::clone(&self.manifest)
    }

    fn version(&self) -> Version {
        self.version
    }
}

/// Runs this process as its rank of the topology `refit launch` started, its learner being
/// `adapter` (`refit.trainer._Adapter`) and its other roles `roles`' (`"grpo"`). Answers the
/// run's report as a dict on rank 0, `None` on the others and in a check.
#[pyfunction]
pub(crate) fn join_trainer(
    py: Python<'_>,
    adapter: Py<PyAny>,
    roles: &str,
) -> PyResult<Option<Py<PyDict>>> {
    let (topo, launch) = rank_setup(roles)?;
    if topo.checkpoint.is_some() {
        return Err(config(
            "the topology has a [checkpoint] section: a Python learner is not checkpointed \
             (its state is Python's); drop the section or train with a Rust learner",
        ));
    }
    let lane = Arc::new(Lane::start("refit-py-learner")?);
    let roles = PyRoles {
        grpo: GrpoRoles::new(),
        adapter: Arc::new(adapter),
        lane: Arc::clone(&lane),
    };
    refit_node::signals::install_signal_handlers().map_err(|e| to_py(e.into()))?;
    let report = py
        .detach(|| {
            let report = run::join_generating(&topo, &launch, roles);
            lane.close();
            report
        })
        .map_err(rank_error)?;
    let Some(report) = report else {
        return Ok(None);
    };
    // what the Rust trainer prints at the end of its run, on rank 0's standard output
    print!("{}", report.summary(topo.sync.allowed_staleness()));
    report_dict(py, &report).map(Some)
}
