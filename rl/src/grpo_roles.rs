//! GRPO + [`Transformer`](crate::transformer::Transformer) + [`ReverseDigits`]: one
//! implementation of [`GenRoles`], as [`CartPolePpo`](crate::CartPolePpo) is of
//! [`Roles`](crate::Roles).
//!
//! A model's [`ModelSpec::params`] may set:
//!
//! | key | type | default |
//! |---|---|---|
//! | `arch` | `"transformer"` or `"llama"` | `"transformer"` |
//! | `d_model`, `layers`, `heads`, `mlp_ratio` | positive integer | see [`GrpoRoles::new`] |
//! | `kv_heads` (`arch = "llama"`) | positive integer dividing `heads` | `heads` |
//! | `rope_theta` (`arch = "llama"`) | number > 0 (the rotary base) | `10000.0` |
//! | `lr`, `beta2`, `weight_decay`, `clip`, `clip_high`, `kl_coef` | float | [`GrpoRoles::new`] |
//! | `correction` | `"behaviour"`, `"truncated"` or `"ignore"` | `"behaviour"` |
//! | `is_cap` | float >= 1 (the cap of `"truncated"`) | `2.0` |
//! | `scale_by_std`, `token_credit` | boolean | `false`, `true` |
//! | `epochs` | positive integer | `1` |
//! | `minibatch` | integer >= 0 (0: the whole batch) | `0` |
//! | `max_grad_norm` | float, or `false` for none | `1.0` |
//! | `threads`, `generator_threads` | positive integer | `1`, `1` |
//! | `task` | `"reverse"` | `"reverse"` |
//! | `min_len`, `max_len`, `heldout`, `heldout_every` | positive integer | [`ReverseConfig::default`] |
//! | `temperature` | float (sampling temperature of rollouts) | `1.0` |
//!
//! `arch = "transformer"` is Refit's [`Transformer`](crate::transformer::Transformer),
//! trained and served in Rust (or by any learner and engine of its layout). `arch = "llama"`
//! is Hugging Face's `LlamaForCausalLM` of the same sizes (its MLP `mlp_ratio * d_model`
//! wide), in the layout [`LlamaShape`] gives: a Python learner trains it and Python
//! engines serve it, so Refit's own learner and generator refuse it by name.
//!
//! The vocabulary and the context come from the task. Any other key is refused, named. The
//! framework's keys of a model ([`ModelSpec::FRAMEWORK_KEYS`]) are read by the framework:
//! `group_size` (completions per prompt, default 8), `prompts_per_fragment`,
//! `batch_frames`, which counts completions (a batch holds `batch_frames / group_size`
//! prompts), and `reference_every`: the engines serve a reference model beside the policy,
//! refreshed every that many versions, and the KL term (`kl_coef > 0`) is taken to it
//! instead of to the learner's frozen copy of the first weights.

use refit_runtime::Want;

use crate::error::{Error, Result};
use crate::grpo::{Correction, GrpoConfig, GrpoLearner, ServedReference};
use crate::learner::Learner;
use crate::llama::LlamaShape;
use crate::roles::{EngineShape, GenRoles, ModelSpec, Params};
use crate::tasks::vocab::VOCAB;
use crate::tasks::{ReverseConfig, ReverseDigits};
use crate::transformer::{TransformerConfig, TransformerGenerator};

/// Everything [`GrpoRoles`] reads from a model's params.
#[derive(Clone, Debug)]
pub struct GrpoSettings {
    /// The learner's configuration (its `model` is the policy's shape).
    pub grpo: GrpoConfig,
    /// The task's configuration.
    pub task: ReverseConfig,
    /// Threads of each generator's pool.
    pub generator_threads: usize,
    /// The architecture the model is trained and served in.
    pub arch: Arch,
    /// Key and value heads of a Llama (`None`: as many as `heads`).
    pub kv_heads: Option<usize>,
    /// The rotary base of a Llama (`None`: Hugging Face's default, 10000), which the
    /// Python learner and engines read from the same params.
    pub rope_theta: Option<f64>,
}

/// The architecture of a GRPO model (`params.arch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Refit's transformer: Refit's learner and generator, or any of its layout.
    Transformer,
    /// Hugging Face's `LlamaForCausalLM`: a Python learner and Python engines.
    Llama,
}

impl GrpoSettings {
    /// The Llama of these settings ([`Arch::Llama`]): the transformer's sizes, the MLP
    /// `mlp_ratio * d_model` wide.
    pub fn llama(&self) -> LlamaShape {
        let m = &self.grpo.model;
        LlamaShape {
            vocab: m.vocab,
            context: m.context,
            d_model: m.d_model,
            layers: m.layers,
            heads: m.heads,
            kv_heads: self.kv_heads.unwrap_or(m.heads),
            intermediate: m.mlp_ratio * m.d_model,
        }
    }

    /// The layout a learner of these settings exports: the trainer layout of Refit's
    /// transformer (converted on the way to the engines), or the Llama's (served as it is).
    ///
    /// # Errors
    /// As [`TransformerConfig::trainer_manifest`] and [`LlamaShape::manifest`].
    pub fn learner_manifest(&self) -> Result<refit_runtime::Manifest> {
        match self.arch {
            Arch::Transformer => self.grpo.model.trainer_manifest(),
            Arch::Llama => self.llama().manifest(),
        }
    }
}

/// The role factory: a [`GrpoLearner`], a [`TransformerGenerator`] and [`ReverseDigits`],
/// settings per model from [`ModelSpec::params`] over a base.
#[derive(Clone, Debug)]
pub struct GrpoRoles {
    base: GrpoSettings,
}

impl Default for GrpoRoles {
    fn default() -> Self {
        Self::new()
    }
}

impl GrpoRoles {
    /// The keys a model's params may hold.
    pub const KEYS: [&'static str; 28] = [
        "arch",
        "d_model",
        "kv_heads",
        "rope_theta",
        "layers",
        "heads",
        "mlp_ratio",
        "lr",
        "beta2",
        "weight_decay",
        "clip",
        "clip_high",
        "kl_coef",
        "correction",
        "is_cap",
        "scale_by_std",
        "token_credit",
        "epochs",
        "minibatch",
        "max_grad_norm",
        "threads",
        "generator_threads",
        "task",
        "min_len",
        "max_len",
        "heldout",
        "heldout_every",
        "temperature",
    ];

    /// The defaults that learn digit reversal from scratch in minutes on two cores: a
    /// transformer of `d_model` 64, 2 layers, 4 heads, MLP ratio 4, lr `1e-3`, groups of 8,
    /// strings of 5 digits.
    pub fn new() -> Self {
        let task = ReverseConfig::default();
        let model = TransformerConfig {
            vocab: VOCAB,
            context: 2 * task.max_len + 2,
            d_model: 64,
            layers: 2,
            heads: 4,
            mlp_ratio: 4,
        };
        Self::with_base(GrpoSettings {
            grpo: GrpoConfig::new(model),
            task,
            generator_threads: 1,
            arch: Arch::Transformer,
            kv_heads: None,
            rope_theta: None,
        })
    }

    /// `base` for every model (its seed and policy id are the model's).
    pub fn with_base(base: GrpoSettings) -> Self {
        Self { base }
    }

    /// Whether `model`'s KL term reads a reference the engines serve (`reference_every`),
    /// which any learner of these roles, Rust or Python, takes only with `kl_coef > 0`.
    ///
    /// # Errors
    /// [`Error::Config`] naming both settings when `reference_every` is set and `kl_coef`
    /// is not above 0.
    pub fn served_reference(model: &ModelSpec, kl_coef: f32) -> Result<bool> {
        let served = model.reference_every.is_some();
        if served && kl_coef <= 0.0 {
            return Err(Error::Config(format!(
                "model `{}`: params.reference_every asks the engines to serve a reference for \
                 the KL term, and params.kl_coef is {kl_coef} (set it above 0, or drop \
                 reference_every)",
                model.id
            )));
        }
        Ok(served)
    }

    /// The settings of `model`: the base, then its params.
    ///
    /// # Errors
    /// [`Error::Config`] naming the model and the key that is unknown or of the wrong type,
    /// or the setting that cannot work.
    pub fn settings(&self, model: &ModelSpec) -> Result<GrpoSettings> {
        let mut s = self.base.clone();
        let p = Params(model);
        let mut cap: Option<f32> = None;
        let mut correction: Option<String> = None;
        let g = &mut s.grpo;
        for (key, value) in &model.params {
            match key.as_str() {
                "arch" => {
                    s.arch = match value.as_str() {
                        Some("transformer") => Arch::Transformer,
                        Some("llama") => Arch::Llama,
                        _ => return Err(p.bad(key, "\"transformer\" or \"llama\"")),
                    };
                }
                "kv_heads" => s.kv_heads = Some(p.positive(key, value)?),
                "rope_theta" => {
                    let theta = p.float(key, value)?;
                    if theta <= 0.0 {
                        return Err(p.bad(key, "a number above 0 (the Llama's rotary base)"));
                    }
                    s.rope_theta = Some(theta);
                }
                "d_model" => g.model.d_model = p.positive(key, value)?,
                "layers" => g.model.layers = p.positive(key, value)?,
                "heads" => g.model.heads = p.positive(key, value)?,
                "mlp_ratio" => g.model.mlp_ratio = p.positive(key, value)?,
                "lr" => g.lr = p.float(key, value)?,
                "beta2" => g.beta2 = p.float(key, value)?,
                "weight_decay" => g.weight_decay = p.float(key, value)?,
                "clip" => g.clip = p.float(key, value)? as f32,
                "clip_high" => g.clip_high = p.float(key, value)? as f32,
                "kl_coef" => g.kl_coef = p.float(key, value)? as f32,
                "correction" => {
                    correction = Some(
                        value
                            .as_str()
                            .ok_or_else(|| p.bad(key, "a string: behaviour, truncated or ignore"))?
                            .to_string(),
                    );
                }
                "is_cap" => cap = Some(p.float(key, value)? as f32),
                "scale_by_std" => g.scale_by_std = p.boolean(key, value)?,
                "token_credit" => g.token_credit = p.boolean(key, value)?,
                "epochs" => g.epochs = p.positive(key, value)?,
                "minibatch" => {
                    g.minibatch = value
                        .as_integer()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| p.bad(key, "an integer >= 0"))?;
                }
                "max_grad_norm" => {
                    g.max_grad_norm = match value {
                        toml::Value::Boolean(false) => None,
                        v => Some(p.float(key, v)? as f32),
                    }
                }
                "threads" => g.threads = p.positive(key, value)?,
                "generator_threads" => s.generator_threads = p.positive(key, value)?,
                "task" => {
                    if value.as_str() != Some("reverse") {
                        return Err(p.bad(key, "\"reverse\" (the one task this factory knows)"));
                    }
                }
                "min_len" => s.task.min_len = p.positive(key, value)?,
                "max_len" => s.task.max_len = p.positive(key, value)?,
                "heldout" => s.task.heldout = p.positive(key, value)?,
                "heldout_every" => s.task.heldout_every = p.positive(key, value)? as u64,
                "temperature" => s.task.temperature = p.float(key, value)? as f32,
                other => {
                    return Err(Error::Config(format!(
                        "model `{}`: unknown parameter params.{other} (grpo-reverse knows {})",
                        model.id,
                        Self::KEYS.join(", ")
                    )));
                }
            }
        }
        let g = &mut s.grpo;
        g.correction = match correction.as_deref() {
            None => match (g.correction, cap) {
                (Correction::Truncated { .. }, Some(cap)) => Correction::Truncated { cap },
                (c, _) => c,
            },
            Some("behaviour") => Correction::Behaviour,
            Some("ignore") => Correction::Ignore,
            Some("truncated") => Correction::Truncated {
                cap: cap.unwrap_or(2.0),
            },
            Some(other) => {
                return Err(p.bad(
                    "correction",
                    &format!("behaviour, truncated or ignore, not `{other}`"),
                ));
            }
        };
        // The task checks its own settings (lengths, held-out split, temperature).
        let task = ReverseDigits::new(s.task)
            .map_err(|e| Error::Config(format!("model `{}`: {e}", model.id)))?;
        g.model.vocab = VOCAB;
        g.model.context = task.context();
        g.temperature = s.task.temperature;
        g.seed = model.seed;
        g.policy_id = model.id.clone();
        g.check()
            .map_err(|e| Error::Config(format!("model `{}`: {e}", model.id)))?;
        match s.arch {
            Arch::Llama => {
                s.llama()
                    .check()
                    .map_err(|e| Error::Config(format!("model `{}`: {e}", model.id)))?;
            }
            Arch::Transformer if s.rope_theta.is_some() => {
                return Err(p.bad(
                    "rope_theta",
                    "unset: it is the rotary base of arch = \"llama\" (Refit's transformer \
                     learns its positions)",
                ));
            }
            Arch::Transformer if s.kv_heads.is_some_and(|k| k != s.grpo.model.heads) => {
                return Err(p.bad(
                    "kv_heads",
                    "unset or equal to heads (Refit's transformer has one key and value \
                     head per query head; grouped heads are arch = \"llama\"'s)",
                ));
            }
            Arch::Transformer => {}
        }
        Ok(s)
    }

    /// The layout a learner of `model` exports: the trainer layout of Refit's transformer
    /// (converted on the way to the engines), or the Llama's (served as it is).
    ///
    /// # Errors
    /// As [`GrpoRoles::settings`].
    pub fn learner_manifest(&self, model: &ModelSpec) -> Result<refit_runtime::Manifest> {
        self.settings(model)?.learner_manifest()
    }

    /// The settings of `model`, refused naming `what` (Refit's learner or generator) when
    /// its architecture is one Refit does not run.
    fn rust_settings(&self, model: &ModelSpec, what: &str) -> Result<GrpoSettings> {
        let s = self.settings(model)?;
        if s.arch == Arch::Llama {
            return Err(Error::Config(format!(
                "model `{}`: params.arch = \"llama\" is trained by a Python learner \
                 (refit.trainer) and served by Python engines (refit.engine), not by {what}",
                model.id
            )));
        }
        Ok(s)
    }

    /// What the generator wants of the learner's exports (fused `qkv`, `bf16`): the link
    /// between them converts with it.
    pub fn conversion(&self) -> Want {
        TransformerConfig::want()
    }
}

impl GenRoles for GrpoRoles {
    type Task = ReverseDigits;
    type Generator = TransformerGenerator;

    /// With `reference_every` set (a reference served by the engines), the KL term reads
    /// the sequences' reference log-probabilities ([`ServedReference`]), which needs
    /// `kl_coef > 0`.
    fn learner(&self, model: &ModelSpec) -> Result<Box<dyn Learner>> {
        let grpo = self.rust_settings(model, "Refit's GRPO learner")?.grpo;
        let served = Self::served_reference(model, grpo.kl_coef)?;
        let mut learner = GrpoLearner::new(grpo)?;
        if served {
            learner.set_reference(Box::new(ServedReference));
        }
        Ok(Box::new(learner))
    }

    fn generator(&self, model: &ModelSpec) -> Result<TransformerGenerator> {
        let s = self.rust_settings(model, "Refit's generating engine")?;
        TransformerGenerator::new(s.grpo.model, s.generator_threads)
    }

    /// The task (it draws prompts from the generator a rollout worker passes; `seed` is not
    /// needed).
    fn task(&self, model: &ModelSpec, _seed: u64) -> Result<ReverseDigits> {
        ReverseDigits::new(self.settings(model)?.task)
    }

    /// A Llama's engines hold the layout [`LlamaShape`] gives, a transformer's the
    /// generator's; both the task's vocabulary and context.
    fn engine_shape(&self, model: &ModelSpec) -> Result<EngineShape> {
        let s = self.settings(model)?;
        let (manifest, vocab, context) = match s.arch {
            Arch::Transformer => {
                let m = &s.grpo.model;
                (m.generator_manifest()?, m.vocab, m.context)
            }
            Arch::Llama => {
                let llama = s.llama();
                (
                    std::sync::Arc::new(llama.manifest()?),
                    llama.vocab,
                    llama.context,
                )
            }
        };
        Ok(EngineShape {
            manifest,
            vocab,
            context,
        })
    }

    /// A transformer's exports are fused and cast on the way ([`GrpoRoles::conversion`]);
    /// a Llama is served in the layout it is trained in.
    fn want(&self, model: &ModelSpec) -> Result<Option<Want>> {
        Ok(match self.settings(model)?.arch {
            Arch::Transformer => Some(self.conversion()),
            Arch::Llama => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::Generator;
    use crate::roles::spec_with as spec;
    use crate::task::Task;

    #[test]
    fn params_set_the_model_the_learner_and_the_task() {
        let r = GrpoRoles::new();
        let s = r
            .settings(&spec(
                "d_model = 32\nlayers = 1\nlr = 0.01\ncorrection = \"truncated\"\nis_cap = 3.0\n\
                 max_len = 4\nmin_len = 2\nmax_grad_norm = false\nminibatch = 0",
            ))
            .unwrap();
        assert_eq!((s.grpo.model.d_model, s.grpo.model.layers), (32, 1));
        assert_eq!(s.grpo.correction, Correction::Truncated { cap: 3.0 });
        assert_eq!((s.grpo.lr, s.grpo.max_grad_norm), (0.01, None));
        assert_eq!((s.grpo.seed, s.grpo.policy_id.as_str()), (5, "pi"));
        let m = spec("max_len = 4\nmin_len = 2\nd_model = 32");
        let task = r.task(&m, 0).unwrap();
        let generator = r.generator(&m).unwrap();
        let mut learner = r.learner(&m).unwrap();
        assert!(generator.max_context() >= task.context());
        assert_eq!(generator.vocab_size(), task.vocab_size());
        // The learner's exports convert into what the generator stages.
        let ws = learner.export().unwrap();
        assert_eq!(learner.version().get(), 1);
        let conv = refit_runtime::Conversion::new(&learner.manifest(), &r.conversion()).unwrap();
        assert_eq!(conv.target(), &generator.manifest());
        generator.stage(&conv.apply(&ws).unwrap()).unwrap();
    }

    #[test]
    fn a_llama_is_served_in_its_own_layout_and_refused_by_the_rust_roles() {
        let r = GrpoRoles::new();
        let m = spec("arch = \"llama\"\nheads = 2\nkv_heads = 1\nrope_theta = 2.0");
        assert_eq!(r.settings(&m).unwrap().rope_theta, Some(2.0));
        let shape = r.engine_shape(&m).unwrap();
        // the learner's layout is the engines': nothing converts it on the way
        assert_eq!(*shape.manifest, r.learner_manifest(&m).unwrap());
        assert!(r.want(&m).unwrap().is_none());
        let k = shape.manifest.tensors().iter();
        let k = k.filter(|t| t.name == "model.layers.1.self_attn.k_proj.weight");
        assert_eq!(
            k.map(|t| t.shape.clone()).collect::<Vec<_>>(),
            [vec![32, 64]]
        );
        let task = r.task(&m, 0).unwrap();
        assert_eq!(shape.vocab, task.vocab_size());
        assert!(shape.context >= task.context());
        for e in [
            r.learner(&m).err().unwrap().to_string(),
            r.generator(&m).err().unwrap().to_string(),
        ] {
            assert!(
                e.contains("arch = \"llama\"") && e.contains("Python"),
                "{e}"
            );
        }
        // a transformer is what it was: converted on the way, its generator's layout
        let t = spec("");
        assert!(r.want(&t).unwrap().is_some());
        let (shape, g) = (r.engine_shape(&t).unwrap(), r.generator(&t).unwrap());
        assert_eq!(shape.manifest, g.manifest());
        assert_eq!(
            (shape.vocab, shape.context),
            (g.vocab_size(), g.max_context())
        );
    }

    #[test]
    fn an_unknown_or_mistyped_param_is_named() {
        let r = GrpoRoles::new();
        for (params, key) in [
            ("lrr = 0.1", "params.lrr"),
            ("heads = 0", "params.heads"),
            ("correction = \"sometimes\"", "params.correction"),
            ("token_credit = 1", "params.token_credit"),
            ("task = \"sort\"", "params.task"),
            ("lr = \"fast\"", "params.lr"),
            ("arch = \"mamba\"", "params.arch"),
            ("kv_heads = 2", "params.kv_heads"),
            ("arch = \"llama\"\nkv_heads = 3", "kv_heads (3)"),
            ("rope_theta = 2.0", "params.rope_theta must be unset"),
            ("arch = \"llama\"\nrope_theta = 0.0", "params.rope_theta"),
            (
                "arch = \"llama\"\nrope_theta = \"low\"",
                "params.rope_theta",
            ),
        ] {
            let e = r.learner(&spec(params)).err().unwrap().to_string();
            assert!(e.contains(key) && e.contains("`pi`"), "{params}: {e}");
        }
        let e = r.settings(&spec("heads = 5")).unwrap_err().to_string();
        assert!(e.contains("heads") && e.contains("`pi`"), "{e}");
        let e = r.settings(&spec("min_len = 6")).unwrap_err().to_string();
        assert!(e.contains("min_len"), "{e}");
        let e = r
            .settings(&spec("correction = \"truncated\"\nis_cap = 0.5"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("is_cap"), "{e}");
    }
}
