//! PPO + [`MlpPolicy`] + [`CartPole`]: one implementation of the role traits
//! ([`Roles`], [`Learner`], [`Policy`](crate::policy::Policy),
//! [`Env`](crate::env::Env)), used by the examples and the tests.
//!
//! A model's [`ModelSpec::params`] may set the PPO hyper-parameters and the network:
//!
//! | key | type | default |
//! |---|---|---|
//! | `hidden` | array of positive integers | `[64, 64]` |
//! | `lr` | float | `1e-3` |
//! | `gamma`, `gae_lambda`, `clip`, `vf_coef`, `ent_coef` | float | [`PpoConfig::default`] |
//! | `epochs` | positive integer | `8` |
//! | `minibatch` | positive integer | `512` |
//! | `max_grad_norm` | float, or `false` for none | `0.5` |
//! | `normalize_advantages` | boolean | `true` |
//! | `threads` | positive integer | `1` |
//! | `max_episode_steps` | positive integer (the environment's time limit) | `500` |
//!
//! Any other key is refused, named.

use crate::env::CartPole;
use crate::error::{Error, Result};
use crate::learner::Learner;
use crate::policy::MlpPolicy;
use crate::ppo::{PpoConfig, PpoTrainer};
use crate::roles::{ModelSpec, Params, Roles};

/// The CartPole role factory: a [`PpoTrainer`] learner, an [`MlpPolicy`] engine policy and
/// [`CartPole`] environments, with PPO settings per model from [`ModelSpec::params`] over a
/// base configuration.
#[derive(Debug, Clone)]
pub struct CartPolePpo {
    base: PpoConfig,
}

impl Default for CartPolePpo {
    fn default() -> Self {
        Self::new()
    }
}

impl CartPolePpo {
    /// The keys a model's params may hold.
    pub const KEYS: [&'static str; 13] = [
        "hidden",
        "lr",
        "gamma",
        "gae_lambda",
        "clip",
        "vf_coef",
        "ent_coef",
        "epochs",
        "minibatch",
        "max_grad_norm",
        "normalize_advantages",
        "threads",
        "max_episode_steps",
    ];

    /// CartPole-sized defaults: `[4, 64, 64, 2]`, lr `1e-3`, 8 epochs, minibatches of 512.
    pub fn new() -> Self {
        Self::with_base(PpoConfig {
            lr: 1e-3,
            epochs: 8,
            minibatch: 512,
            ..PpoConfig::default()
        })
    }

    /// `base` for every model (its hidden layer sizes included; its observation and action
    /// sizes are CartPole's whatever they say, its seed and policy id are the model's).
    pub fn with_base(base: PpoConfig) -> Self {
        Self { base }
    }

    /// A model spec with the framework defaults of [`ModelSpec::new`].
    pub fn spec(id: refit_runtime::ModelId, seed: u64) -> ModelSpec {
        ModelSpec::new(id, seed)
    }

    /// The PPO configuration of `model`: the base, then its params.
    ///
    /// # Errors
    /// [`Error::Config`] naming the model and the key that is unknown or of the wrong type.
    pub fn ppo_config(&self, model: &ModelSpec) -> Result<PpoConfig> {
        let mut cfg = self.base.clone();
        let hidden_of = |sizes: &[usize]| -> Vec<usize> {
            sizes
                .get(1..sizes.len().saturating_sub(1))
                .map(<[usize]>::to_vec)
                .unwrap_or_default()
        };
        let mut hidden = hidden_of(&cfg.sizes);
        let p = Params(model);
        for (key, value) in &model.params {
            match key.as_str() {
                "hidden" => {
                    hidden = value
                        .as_array()
                        .ok_or_else(|| p.bad(key, "an array of positive integers"))?
                        .iter()
                        .map(|v| p.positive(key, v))
                        .collect::<Result<_>>()?;
                }
                "lr" => cfg.lr = p.float(key, value)?,
                "gamma" => cfg.gamma = p.float(key, value)? as f32,
                "gae_lambda" => cfg.gae_lambda = p.float(key, value)? as f32,
                "clip" => cfg.clip = p.float(key, value)? as f32,
                "vf_coef" => cfg.vf_coef = p.float(key, value)? as f32,
                "ent_coef" => cfg.ent_coef = p.float(key, value)? as f32,
                "epochs" => cfg.epochs = p.positive(key, value)?,
                "minibatch" => cfg.minibatch = p.positive(key, value)?,
                "threads" => cfg.threads = p.positive(key, value)?,
                "max_grad_norm" => {
                    cfg.max_grad_norm = match value {
                        toml::Value::Boolean(false) => None,
                        v => Some(p.float(key, v)? as f32),
                    }
                }
                "normalize_advantages" => {
                    cfg.normalize_advantages =
                        value.as_bool().ok_or_else(|| p.bad(key, "a boolean"))?;
                }
                "max_episode_steps" => {
                    p.positive(key, value)?;
                }
                other => {
                    return Err(Error::Config(format!(
                        "model `{}`: unknown parameter params.{other} (cartpole-ppo knows {})",
                        model.id,
                        Self::KEYS.join(", ")
                    )));
                }
            }
        }
        cfg.sizes = std::iter::once(4)
            .chain(hidden)
            .chain(std::iter::once(2))
            .collect();
        cfg.seed = model.seed;
        cfg.policy_id = model.id.clone();
        Ok(cfg)
    }
}

impl Roles for CartPolePpo {
    type Env = CartPole;
    type Policy = MlpPolicy;

    fn learner(&self, model: &ModelSpec) -> Result<Box<dyn Learner>> {
        Ok(Box::new(PpoTrainer::new(self.ppo_config(model)?)?))
    }

    fn policy(&self, model: &ModelSpec) -> Result<MlpPolicy> {
        Ok(MlpPolicy::new(&self.ppo_config(model)?.sizes)?)
    }

    fn env(&self, model: &ModelSpec, seed: u64) -> Result<CartPole> {
        let env = CartPole::new(seed);
        match model.params.get("max_episode_steps") {
            None => Ok(env),
            Some(v) => {
                let steps = Params(model).positive("max_episode_steps", v)?;
                let steps = u32::try_from(steps)
                    .map_err(|_| Params(model).bad("max_episode_steps", "at most 4294967295"))?;
                Ok(env.with_max_episode_steps(steps))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::Env;
    use crate::policy::Policy;
    use crate::roles::spec_with as spec;

    #[test]
    fn params_set_the_network_and_the_hyper_parameters() {
        let r = CartPolePpo::new();
        let c = r
            .ppo_config(&spec(
                "hidden = [32]\nlr = 0.01\nepochs = 2\nmax_grad_norm = false",
            ))
            .unwrap();
        assert_eq!(c.sizes, vec![4, 32, 2]);
        assert_eq!(
            (c.lr, c.epochs, c.max_grad_norm, c.seed),
            (0.01, 2, None, 5)
        );
        assert_eq!(c.policy_id.as_str(), "pi");
        let s = spec("hidden = [32]\nmax_episode_steps = 50");
        let mut learner = r.learner(&s).unwrap();
        let policy = r.policy(&s).unwrap();
        assert_eq!((policy.obs_dim(), policy.num_actions()), (4, 2));
        let ws = learner.export().unwrap();
        assert_eq!(ws.model().as_str(), "pi");
        assert_eq!(learner.version().get(), 1);
        let mut env = r.env(&s, 1).unwrap();
        env.reset(None).unwrap();
        let mut steps = 0;
        while !env.step(steps % 2).unwrap().done() {
            steps += 1;
        }
        assert!(steps < 50);
    }

    #[test]
    fn an_unknown_or_mistyped_param_is_named() {
        let r = CartPolePpo::new();
        let e = r.learner(&spec("lrr = 0.1")).err().unwrap().to_string();
        assert!(e.contains("params.lrr") && e.contains("`pi`"), "{e}");
        let e = r.policy(&spec("hidden = [0]")).unwrap_err().to_string();
        assert!(e.contains("params.hidden"), "{e}");
        let e = r
            .policy(&spec("epochs = \"many\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("params.epochs"), "{e}");
    }
}
