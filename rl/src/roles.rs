//! Roles as traits: what a user brings to a topology.
//!
//! A topology (`actor::topology::run`) is generic over a [`Roles`] factory: per model it asks
//! the factory for a [`Learner`] (the trainer's code), a [`Policy`] (what the inference engine
//! serves, loading the learner's exports) and environments ([`Env`], what rollout workers and
//! the evaluator step). The framework's settings of a model — rollout workers, environments
//! per worker, fragment length, batch size — live in [`ModelSpec`]; everything else about a
//! model is the factory's, handed over as the free-form [`ModelSpec::params`] table (a
//! topology file's `[model.params]`).
//!
//! `cartpole_ppo::CartPolePpo` (feature `candle`) is one implementation: PPO, `MlpPolicy`
//! and `CartPole`.

use refit_runtime::ModelId;

use crate::env::Env;
use crate::error::{Error, Result};
use crate::generation::Generator;
use crate::learner::Learner;
use crate::policy::Policy;
use crate::task::Task;

/// One model of a run: the framework's settings, and the factory's free-form parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// The model's id (its trainer publishes under it).
    pub id: ModelId,
    /// Rollout workers for this model (each on its own thread).
    pub workers: usize,
    /// Environments per worker.
    pub envs_per_worker: usize,
    /// Steps per rollout fragment.
    pub fragment_steps: usize,
    /// Frames per training batch (at least): environment steps, or completions.
    pub batch_frames: usize,
    /// Generated completions per prompt (a generating model's GRPO group).
    pub group_size: usize,
    /// Prompts per rollout fragment (a generating model).
    pub prompts_per_fragment: usize,
    /// Every how many versions the engines of a generating model refresh the reference model
    /// they serve beside it (`None`: they serve none). The reference is its own model,
    /// [`ModelSpec::reference_id`], holding the policy's version 1, then every
    /// `reference_every`-th version after; the rollout workers score each completion under
    /// it, for a KL term that needs no second model in the learner.
    pub reference_every: Option<usize>,
    /// What its engines verify of the weights they serve (a topology's `verify`).
    pub verify: refit_runtime::topology::Verify,
    /// How its engines take a version in (a topology's `apply`).
    pub apply: refit_runtime::topology::Apply,
    /// Seed of this model's learner.
    pub seed: u64,
    /// Parameters for the role factory (a topology file's `[model.params]`, less the keys
    /// [`ModelSpec::from_params`] takes for itself).
    pub params: toml::Table,
}

impl ModelSpec {
    /// The keys of a params table that [`ModelSpec::from_params`] reads into the spec.
    pub const FRAMEWORK_KEYS: [&'static str; 7] = [
        "workers",
        "envs_per_worker",
        "fragment_steps",
        "batch_frames",
        "group_size",
        "prompts_per_fragment",
        "reference_every",
    ];

    /// `id` with the defaults: 2 workers x 4 environments, fragments of 32 steps, batches of
    /// 2048 frames (generating: fragments of 4 prompts x 8 completions), no params.
    pub fn new(id: ModelId, seed: u64) -> Self {
        Self {
            id,
            workers: 2,
            envs_per_worker: 4,
            fragment_steps: 32,
            batch_frames: 2048,
            group_size: 8,
            prompts_per_fragment: 4,
            reference_every: None,
            verify: refit_runtime::topology::Verify::Off,
            apply: refit_runtime::topology::Apply::Staged,
            seed,
            params: toml::Table::new(),
        }
    }

    /// `id` with the framework settings found in `params` (`workers`, `envs_per_worker`,
    /// `fragment_steps`, `batch_frames`: positive integers; the defaults of
    /// [`ModelSpec::new`] otherwise); the other keys stay in [`ModelSpec::params`] for the
    /// factory.
    ///
    /// # Errors
    /// [`Error::Config`] naming the model and the key whose value is not a positive integer.
    pub fn from_params(id: ModelId, seed: u64, params: &toml::Table) -> Result<Self> {
        let mut spec = Self::new(id, seed);
        let mut rest = params.clone();
        for key in Self::FRAMEWORK_KEYS {
            let Some(v) = rest.remove(key) else { continue };
            let n = v
                .as_integer()
                .filter(|n| *n > 0)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    let found = match v.as_integer() {
                        Some(n) => n.to_string(),
                        None => format!("a {}", v.type_str()),
                    };
                    Error::Config(format!(
                        "model `{}`: params.{key} must be a positive integer, not {found}",
                        spec.id
                    ))
                })?;
            match key {
                "workers" => spec.workers = n,
                "envs_per_worker" => spec.envs_per_worker = n,
                "fragment_steps" => spec.fragment_steps = n,
                "group_size" => spec.group_size = n,
                "prompts_per_fragment" => spec.prompts_per_fragment = n,
                "reference_every" => spec.reference_every = Some(n),
                _ => spec.batch_frames = n,
            }
        }
        spec.params = rest;
        Ok(spec)
    }

    /// The id of the reference model the engines serve beside this one
    /// (`<id>.reference`), whether or not [`ModelSpec::reference_every`] asks for it.
    ///
    /// # Errors
    /// An id too long to take the suffix.
    pub fn reference_id(&self) -> Result<ModelId> {
        Ok(ModelId::new(format!("{}.reference", self.id))?)
    }

    /// Sets the factory parameter `key`, builder style.
    #[must_use]
    pub fn with_param(mut self, key: &str, value: impl Into<toml::Value>) -> Self {
        self.params.insert(key.to_string(), value.into());
        self
    }

    /// Checks the framework settings.
    ///
    /// # Errors
    /// [`Error::Config`] naming the model and the setting that cannot work.
    pub fn check(&self) -> Result<()> {
        Error::check_positive(
            &format!("model `{}`:", self.id),
            &[
                ("workers", self.workers),
                ("envs_per_worker", self.envs_per_worker),
                ("fragment_steps", self.fragment_steps),
                ("batch_frames", self.batch_frames),
                ("group_size", self.group_size),
                ("prompts_per_fragment", self.prompts_per_fragment),
            ],
        )
    }
}

/// Reads a role factory's parameters of one model, naming the model and the key in every
/// refusal (`model `policy`: params.lr must be a finite number`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Params<'a>(pub(crate) &'a ModelSpec);

// Without candle no role factory reads its params; the readers stay for the ones that do.
#[cfg_attr(not(feature = "candle"), allow(dead_code))]
impl Params<'_> {
    /// The error for `key`, whose value must be `want`.
    pub(crate) fn bad(&self, key: &str, want: &str) -> Error {
        Error::Config(format!(
            "model `{}`: params.{key} must be {want}",
            self.0.id
        ))
    }

    /// A finite number (an integer is taken as one).
    pub(crate) fn float(&self, key: &str, v: &toml::Value) -> Result<f64> {
        match v {
            toml::Value::Float(f) if f.is_finite() => Ok(*f),
            toml::Value::Integer(i) => Ok(*i as f64),
            _ => Err(self.bad(key, "a finite number")),
        }
    }

    /// A positive integer.
    pub(crate) fn positive(&self, key: &str, v: &toml::Value) -> Result<usize> {
        v.as_integer()
            .filter(|n| *n > 0)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| self.bad(key, "a positive integer"))
    }

    /// A boolean.
    pub(crate) fn boolean(&self, key: &str, v: &toml::Value) -> Result<bool> {
        v.as_bool().ok_or_else(|| self.bad(key, "a boolean"))
    }
}

// ANCHOR: roles
/// The role factory a topology takes: the user's learner, policy and environment for each
/// model. It is shared by every actor of a process (hence `Send + Sync`); each method is
/// called on the thread that will own what it returns.
pub trait Roles: Send + Sync + 'static {
    /// The environment rollout workers and the evaluator step.
    type Env: Env + Unpin + 'static;
    /// The policy inference engines serve; it loads the weights the learner exports.
    type Policy: Policy + Unpin + 'static;

    /// A fresh learner for `model` (seeded with `model.seed`); its exports must have the
    /// layout of [`Roles::policy`]'s weights.
    ///
    /// # Errors
    /// Bad parameters (naming the model and the key) or a learner that cannot start.
    fn learner(&self, model: &ModelSpec) -> Result<Box<dyn Learner>>;

    /// The policy an engine serves for `model` (its weights are loaded before it acts).
    ///
    /// # Errors
    /// Bad parameters (naming the model and the key).
    fn policy(&self, model: &ModelSpec) -> Result<Self::Policy>;

    /// One environment for `model`, seeded with `seed`.
    ///
    /// # Errors
    /// An environment that cannot be built.
    fn env(&self, model: &ModelSpec, seed: u64) -> Result<Self::Env>;
}
// ANCHOR_END: roles

// ANCHOR: gen_roles
/// The role factory of a generating topology: per model a learner, the generator its
/// engines serve, and the task its rollout workers draw prompts from and reward with.
pub trait GenRoles: Send + Sync + 'static {
    /// The task rollout workers and the evaluator use.
    type Task: Task + Unpin + 'static;
    /// The backend generating engines serve; it stages the weights the learner exports
    /// (converted to its layout on the way).
    type Generator: Generator + Unpin + 'static;

    /// A fresh learner for `model` (seeded with `model.seed`).
    ///
    /// # Errors
    /// Bad parameters (naming the model and the key) or a learner that cannot start.
    fn learner(&self, model: &ModelSpec) -> Result<Box<dyn Learner>>;

    /// The backend an engine serves `model` with.
    ///
    /// # Errors
    /// Bad parameters (naming the model and the key).
    fn generator(&self, model: &ModelSpec) -> Result<Self::Generator>;

    /// The task of `model`, seeded with `seed`.
    ///
    /// # Errors
    /// A task that cannot be built.
    fn task(&self, model: &ModelSpec, seed: u64) -> Result<Self::Task>;

    /// What the engines of `model` load and hold: by default the generator's layout,
    /// vocabulary and context. Roles whose models Refit's generating engine does not serve
    /// (a model trained and served in Python) answer it without a generator.
    ///
    /// # Errors
    /// Bad parameters (naming the model and the key).
    fn engine_shape(&self, model: &ModelSpec) -> Result<EngineShape> {
        let g = self.generator(model)?;
        Ok(EngineShape {
            manifest: g.manifest(),
            vocab: g.vocab_size(),
            context: g.max_context(),
        })
    }

    /// The conversion from the learner's layout to the generator's (rename, fuse, cast),
    /// applied on the send path; `None` (the default) when they are the same. A topology
    /// file's `[model.convert]` takes its place when given.
    ///
    /// # Errors
    /// Bad parameters (naming the model and the key).
    fn want(&self, model: &ModelSpec) -> Result<Option<refit_runtime::convert::Want>> {
        let _ = model;
        Ok(None)
    }
}
// ANCHOR_END: gen_roles

/// What the engines of a generating model load and hold ([`GenRoles::engine_shape`]).
#[derive(Clone, Debug)]
pub struct EngineShape {
    /// The layout they load (what the learner's exports are converted to).
    pub manifest: std::sync::Arc<refit_runtime::Manifest>,
    /// Tokens they know.
    pub vocab: usize,
    /// The longest sequence (prompt and completion) they hold.
    pub context: usize,
}

/// Checks that `policy` can act on `env`'s observations and that its actions are `env`'s.
///
/// # Errors
/// [`Error::Config`] naming the model and both sizes.
pub fn check_fit<E: Env + ?Sized, P: Policy + ?Sized>(
    model: &ModelId,
    env: &E,
    policy: &P,
) -> Result<()> {
    if env.obs_dim() != policy.obs_dim() || env.num_actions() != policy.num_actions() {
        return Err(Error::Config(format!(
            "model `{model}`: the policy takes observations of {} values and has {} actions, \
             the environment gives {} values and has {} actions",
            policy.obs_dim(),
            policy.num_actions(),
            env.obs_dim(),
            env.num_actions()
        )));
    }
    Ok(())
}

/// A spec of model `pi`, seed 5, whose roles' parameters are `params` (TOML): what the
/// role factories' tests read their settings from.
#[cfg(all(test, feature = "candle"))]
#[allow(clippy::unwrap_used)]
pub(crate) fn spec_with(params: &str) -> ModelSpec {
    let mut s = ModelSpec::new(ModelId::new("pi").unwrap(), 5);
    s.params = toml::from_str(params).unwrap();
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_params_takes_the_framework_keys_and_leaves_the_rest() {
        let t: toml::Table =
            toml::from_str("batch_frames = 512\nworkers = 3\nlr = 0.001\n").unwrap();
        let s = ModelSpec::from_params(ModelId::new("m").unwrap(), 7, &t).unwrap();
        assert_eq!((s.workers, s.batch_frames, s.envs_per_worker), (3, 512, 4));
        assert_eq!(s.params.len(), 1);
        assert_eq!(s.params["lr"].as_float(), Some(0.001));
        assert_eq!(s.seed, 7);
    }

    #[test]
    fn from_params_names_a_bad_value() {
        let t: toml::Table = toml::from_str("workers = 0").unwrap();
        let e = ModelSpec::from_params(ModelId::new("m").unwrap(), 0, &t)
            .unwrap_err()
            .to_string();
        assert!(e.contains("params.workers") && e.contains("`m`"), "{e}");
        let t: toml::Table = toml::from_str("batch_frames = \"big\"").unwrap();
        let e = ModelSpec::from_params(ModelId::new("m").unwrap(), 0, &t)
            .unwrap_err()
            .to_string();
        assert!(e.contains("params.batch_frames"), "{e}");
    }

    #[test]
    fn check_names_the_model_and_the_size_that_is_zero() {
        let mut s = ModelSpec::new(ModelId::new("m").unwrap(), 0);
        assert!(s.check().is_ok());
        s.group_size = 0;
        let e = s.check().unwrap_err().to_string();
        assert!(e.ends_with("model `m`: group_size must be positive"), "{e}");
    }
}
