//! GRPO on CPU with candle: group-relative advantages, a clipped objective against the
//! behaviour policy's log-probabilities, truncated importance weights, an optional KL term
//! to a reference model, AdamW with gradient clipping.
//!
//! A batch holds generated [`Sequence`]s; the completions of one prompt share a `group`.
//!
//! **Advantages** ([`group_advantages`]): without per-token credit, every token of a
//! completion gets `R - mean(R of its group)` (divided by the group's standard deviation when
//! [`GrpoConfig::scale_by_std`]). With per-token credit (`token_rewards`, and
//! [`GrpoConfig::token_credit`]), position `t` of a completion gets `r_t - mean(r_t of the
//! group's completions that reach t)`, likewise scaled: per-position group-relative
//! advantages. A group whose members do not all carry per-token credit falls back to the
//! totals.
//!
//! **Objective**, per generated token, averaged over the minibatch's tokens:
//! `-w · min(ρ A, clip(ρ, 1 - ε, 1 + ε_high) A) + β · KL`, where the ratio `ρ` and the weight
//! `w` depend on [`Correction`]:
//! - [`Correction::Behaviour`]: `ρ = π_θ / π_behaviour` (the engine's log-probabilities: a
//!   stale or bf16-served sample is corrected by the ratio itself), `w = 1`;
//! - [`Correction::Truncated`]: `ρ = π_θ / π_prox` where `π_prox` is the learner's own policy
//!   when the update starts, and `w = min(π_prox / π_behaviour, cap)`, a truncated importance
//!   weight (no gradient) that corrects for the behaviour policy without letting one stale
//!   token dominate (decoupled PPO; verl's "TIS");
//! - [`Correction::Ignore`]: `ρ = π_θ / π_prox`, `w = 1` (the uncorrected baseline).
//!
//! The KL term is the `k3` estimator `exp(r - l) - (r - l) - 1` of `KL(π_θ ‖ π_ref)` with `l`
//! and `r` the token's log-probabilities under the policy and the reference; the reference
//! is any [`Reference`] ([`FrozenReference`] of the initial weights by default when
//! `kl_coef > 0`).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use crate::optim::{AdamW, AdamWParams};
use crate::state::{LearnerState, StateWriter};
use candle_core::{DType as CDType, Tensor};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use refit_runtime::{Manifest, ModelId, Version, WeightSet};

use crate::batch::{Batch, Sequence};
use crate::collector::policy_model_id;
use crate::error::{Error, Result};
use crate::learner::{LearnStats, Learner};
use crate::ppo::clip_gradients;
use crate::transformer::{Grad, Transformer, TransformerConfig};

mod advantages;
mod reference;
#[cfg(test)]
mod tests;

pub use advantages::group_advantages;
use reference::TokenRows;
pub use reference::{FrozenReference, Reference, ServedReference};

/// How the objective accounts for samples the learner's current policy did not generate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Correction {
    /// The ratio is taken against the behaviour log-probabilities, clipped (PPO with the
    /// engine's log-probabilities as the old policy).
    Behaviour,
    /// The ratio is taken against the learner's policy at the start of the update, clipped,
    /// and each token is weighted by `min(π_prox / π_behaviour, cap)`.
    Truncated {
        /// The cap `c` of the importance weight (at least 1).
        cap: f32,
    },
    /// The ratio is taken against the learner's policy at the start of the update; the
    /// behaviour log-probabilities are only reported.
    Ignore,
}

impl Correction {
    /// The name used in configuration files: `behaviour`, `truncated`, `ignore`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Behaviour => "behaviour",
            Self::Truncated { .. } => "truncated",
            Self::Ignore => "ignore",
        }
    }
}

/// GRPO hyper-parameters.
#[derive(Clone, Debug)]
pub struct GrpoConfig {
    /// The policy's shape.
    pub model: TransformerConfig,
    /// AdamW learning rate.
    pub lr: f64,
    /// AdamW's second-moment decay.
    pub beta2: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Lower clip range `ε` of the ratio.
    pub clip: f32,
    /// Upper clip range `ε_high` (equal to `clip` for the symmetric PPO clip).
    pub clip_high: f32,
    /// Stale-sample correction.
    pub correction: Correction,
    /// Divide advantages by the group's (or position's) standard deviation.
    pub scale_by_std: bool,
    /// Use per-token credit when the sequences carry it.
    pub token_credit: bool,
    /// Weight `β` of the KL term to the reference (0: no reference is consulted).
    pub kl_coef: f32,
    /// Passes over each batch.
    pub epochs: usize,
    /// Sequences per gradient step (0: the whole batch, one step per epoch).
    pub minibatch: usize,
    /// Global gradient-norm clip (`None`: off).
    pub max_grad_norm: Option<f32>,
    /// Temperature the behaviour policy sampled at (log-probabilities are compared at it).
    pub temperature: f32,
    /// Seed of the initialisation and the minibatch shuffles.
    pub seed: u64,
    /// Model id of the exported weights.
    pub policy_id: ModelId,
    /// Threads of the learner's own rayon pool, which candle's matrix products run on.
    ///
    /// candle's element-wise ops on tensors of 64K elements or more run on a process-wide
    /// pool of its own, sized by `CANDLE_NUM_THREADS` (by default the physical cores), whose
    /// idle workers spin: on a small machine shared with other processes set
    /// `CANDLE_NUM_THREADS=1` in the learner's environment (training took a third of the
    /// time on two shared cores).
    pub threads: usize,
}

impl GrpoConfig {
    /// Defaults for `model`: lr `1e-3`, `ε = ε_high = 0.2`, [`Correction::Behaviour`],
    /// advantages not scaled by the standard deviation, per-token credit used, no KL, one
    /// epoch of one step, gradient norm clipped at 1, temperature 1, one thread.
    pub fn new(model: TransformerConfig) -> Self {
        Self {
            model,
            lr: 1e-3,
            beta2: 0.99,
            weight_decay: 0.0,
            clip: 0.2,
            clip_high: 0.2,
            correction: Correction::Behaviour,
            scale_by_std: false,
            token_credit: true,
            kl_coef: 0.0,
            epochs: 1,
            minibatch: 0,
            max_grad_norm: Some(1.0),
            temperature: 1.0,
            seed: 0,
            policy_id: policy_model_id(),
            threads: 1,
        }
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting that cannot work.
    pub fn check(&self) -> Result<()> {
        self.model.check()?;
        let bad = |name: &str, why: String| Err(Error::Config(format!("grpo {name}: {why}")));
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", format!("{} is not a positive number", self.lr));
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("beta2", format!("{} is not in [0, 1)", self.beta2));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", format!("{} is negative", self.weight_decay));
        }
        for (name, v) in [("clip", self.clip), ("clip_high", self.clip_high)] {
            if !(v.is_finite() && v > 0.0) {
                return bad(name, format!("{v} is not a positive number"));
            }
        }
        if let Correction::Truncated { cap } = self.correction
            && !(cap.is_finite() && cap >= 1.0)
        {
            return bad("is_cap", format!("{cap} is not a number of at least 1"));
        }
        if !(self.kl_coef.is_finite() && self.kl_coef >= 0.0) {
            return bad("kl_coef", format!("{} is negative", self.kl_coef));
        }
        if self.epochs == 0 {
            return bad("epochs", "must be positive".into());
        }
        if let Some(g) = self.max_grad_norm
            && !(g.is_finite() && g > 0.0)
        {
            return bad("max_grad_norm", format!("{g} is not a positive number"));
        }
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return bad(
                "temperature",
                format!(
                    "{} is not positive (greedy rollouts cannot be trained on)",
                    self.temperature
                ),
            );
        }
        Ok(())
    }
}

/// A GRPO learner over a [`Transformer`] policy.
pub struct GrpoLearner {
    cfg: GrpoConfig,
    model: Transformer,
    opt: AdamW,
    rng: SmallRng,
    reference: Option<Box<dyn Reference>>,
    version: Version,
    pool: Arc<rayon::ThreadPool>,
}

impl fmt::Debug for GrpoLearner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrpoLearner")
            .field("cfg", &self.cfg)
            .field("version", &self.version)
            .field("reference", &self.reference.is_some())
            .finish_non_exhaustive()
    }
}

impl GrpoLearner {
    /// A freshly initialised learner (version 0: nothing exported yet). With `kl_coef > 0`
    /// its reference is a frozen copy of the initial weights until
    /// [`GrpoLearner::set_reference`] replaces it.
    ///
    /// # Errors
    /// [`Error::Config`] for unusable settings; candle errors.
    pub fn new(cfg: GrpoConfig) -> Result<Self> {
        cfg.check()?;
        let init = cfg.model.init_weights(cfg.policy_id.clone(), cfg.seed)?;
        Self::from_weights(cfg, &init)
    }

    /// A learner starting from `weights` (trainer layout of `cfg.model`).
    ///
    /// # Errors
    /// As [`GrpoLearner::new`]; a weight set of another layout, naming the tensor.
    pub fn from_weights(cfg: GrpoConfig, weights: &WeightSet) -> Result<Self> {
        cfg.check()?;
        let model = Transformer::from_weights(cfg.model, weights)?;
        let opt = AdamW::new(
            model.vars().to_vec(),
            AdamWParams {
                lr: cfg.lr,
                beta1: 0.9,
                beta2: cfg.beta2,
                eps: 1e-8,
                weight_decay: cfg.weight_decay,
            },
        )?;
        let reference: Option<Box<dyn Reference>> = if cfg.kl_coef > 0.0 {
            Some(Box::new(FrozenReference::new(cfg.model, weights)?))
        } else {
            None
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads.max(1))
            .thread_name(|i| format!("refit-grpo-{i}"))
            .build()
            .map_err(|e| Error::Config(format!("grpo thread pool: {e}")))?;
        Ok(Self {
            rng: SmallRng::seed_from_u64(cfg.seed ^ 0x6770_6f00),
            pool: Arc::new(pool),
            cfg,
            model,
            opt,
            reference,
            version: Version::ZERO,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GrpoConfig {
        &self.cfg
    }

    /// The policy being trained.
    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// Replaces the reference the KL term is computed against.
    pub fn set_reference(&mut self, reference: Box<dyn Reference>) {
        self.reference = Some(reference);
    }

    /// Changes the learning rate.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.opt.set_learning_rate(lr);
    }

    fn check_batch(&self, seqs: &[Sequence]) -> Result<()> {
        let m = &self.cfg.model;
        for (i, s) in seqs.iter().enumerate() {
            let bad = |why: String| {
                Err(Error::Trainer(format!(
                    "sequence {i} (group {}): {why}",
                    s.group
                )))
            };
            s.check_fields().or_else(bad)?;
            let fed = s.prompt.len() + s.tokens.len().saturating_sub(1);
            if fed > m.context {
                return bad(format!(
                    "{fed} tokens to feed exceed the context of {}",
                    m.context
                ));
            }
            if let Some(t) = s
                .prompt
                .iter()
                .chain(&s.tokens)
                .find(|&&t| t as usize >= m.vocab)
            {
                return bad(format!(
                    "token {t} is outside the vocabulary of {}",
                    m.vocab
                ));
            }
        }
        Ok(())
    }

    /// One GRPO update on the batch's sequences.
    ///
    /// Reports (token-weighted means over the last epoch's steps unless said): `loss`,
    /// `pg_loss`, `kl` (to the reference, with `kl_coef > 0`), `approx_kl` (of the ratio the
    /// objective clips), `clip_fraction` (tokens whose ratio is outside the clip range),
    /// `entropy`, `behaviour_ratio_mean` and `behaviour_ratio_max` (`π_prox / π_behaviour`:
    /// how far the learner is from what generated the tokens, stale versions and bf16
    /// serving included), `truncated_fraction` (tokens whose weight hit the cap),
    /// `grad_norm` (before clipping), `zero_advantage_fraction`, `tokens`, and per batch
    /// `mean_reward`, `sequences`, `groups`, `steps`, `staleness_max` (the learner's last
    /// export minus the oldest token's version), `elapsed_s`.
    ///
    /// # Errors
    /// [`Error::Trainer`] naming the sequence for a malformed one, or when no sequence has a
    /// generated token; candle errors. The weights are unchanged on error only when the
    /// first step fails.
    pub fn update(&mut self, batch: &Batch) -> Result<LearnStats> {
        let pool = Arc::clone(&self.pool);
        pool.install(|| self.update_on_pool(batch))
    }

    fn update_on_pool(&mut self, batch: &Batch) -> Result<LearnStats> {
        let start = Instant::now();
        self.check_batch(&batch.sequences)?;
        let seqs: Vec<&Sequence> = batch
            .sequences
            .iter()
            .filter(|s| !s.tokens.is_empty())
            .collect();
        if seqs.is_empty() {
            return Err(Error::Trainer("the batch has no generated token".into()));
        }
        let adv_all = group_advantages(
            &batch.sequences,
            self.cfg.scale_by_std,
            self.cfg.token_credit,
        );
        let adv: Vec<&Vec<f32>> = batch
            .sequences
            .iter()
            .zip(&adv_all)
            .filter(|(s, _)| !s.tokens.is_empty())
            .map(|(_, a)| a)
            .collect();
        let temp = self.cfg.temperature;
        let n = seqs.len();
        let mb = if self.cfg.minibatch == 0 {
            n
        } else {
            self.cfg.minibatch.min(n)
        };
        let single_step = self.cfg.epochs == 1 && mb == n;
        // The learner's own log-probabilities before any step (the proximal policy).
        let prox: Option<Vec<Vec<f32>>> = if single_step {
            None // the step's own forward, detached, is the proximal policy
        } else {
            let rows = TokenRows::new(&self.model, &seqs)?;
            let lp = rows.logprobs(&self.model, Grad::Detached, temp)?.0;
            Some(rows.split(&lp.to_vec1::<f32>()?))
        };
        let reference = match (&mut self.reference, self.cfg.kl_coef > 0.0) {
            (Some(r), true) => Some(r.logprobs(&seqs, temp)?),
            _ => None,
        };
        let mut order: Vec<usize> = (0..n).collect();
        let mut acc = Acc::default();
        let mut steps = 0usize;
        for epoch in 0..self.cfg.epochs {
            if mb < n {
                order.shuffle(&mut self.rng);
            }
            let last_epoch = epoch + 1 == self.cfg.epochs;
            for chunk in order.chunks(mb) {
                let part: Vec<&Sequence> = chunk.iter().map(|&i| seqs[i]).collect();
                let a = gather(chunk, |i| adv[i].as_slice());
                let behav = gather(chunk, |i| seqs[i].logprobs.as_slice());
                let prox_flat = prox.as_ref().map(|p| gather(chunk, |i| p[i].as_slice()));
                let ref_flat = reference
                    .as_ref()
                    .map(|r| gather(chunk, |i| r[i].as_slice()));
                let s = self.step(&part, &a, &behav, prox_flat, ref_flat)?;
                steps += 1;
                if last_epoch {
                    acc.add(&s);
                }
            }
        }
        let mut stats = acc.finish();
        let rewards: Vec<f32> = batch.sequences.iter().map(|s| s.reward).collect();
        let mean_r = rewards.iter().sum::<f32>() / rewards.len().max(1) as f32;
        let groups: BTreeMap<u64, ()> = batch.sequences.iter().map(|s| (s.group, ())).collect();
        let oldest = batch
            .sequences
            .iter()
            .filter_map(Sequence::oldest_version)
            .min();
        stats.insert("mean_reward", f64::from(mean_r));
        stats.insert("sequences", batch.sequences.len() as f64);
        stats.insert("groups", groups.len() as f64);
        stats.insert("steps", steps as f64);
        if let Some(o) = oldest {
            stats.insert(
                "staleness_max",
                self.version.get().saturating_sub(o.get()) as f64,
            );
        }
        stats.insert("elapsed_s", start.elapsed().as_secs_f64());
        Ok(stats)
    }

    /// One gradient step on `seqs`; the flat vectors run over their generated tokens.
    fn step(
        &mut self,
        seqs: &[&Sequence],
        adv: &[f32],
        behav: &[f32],
        prox: Option<Vec<f32>>,
        reference: Option<Vec<f32>>,
    ) -> Result<StepStats> {
        let cfg = &self.cfg;
        let dev = self.model.device().clone();
        let rows = TokenRows::new(&self.model, seqs)?;
        let (logp, all) = rows.logprobs(&self.model, Grad::Track, cfg.temperature)?;
        let n = adv.len();
        let prox_t = match prox {
            Some(p) => Tensor::from_vec(p, n, &dev)?,
            None => logp.detach(),
        };
        let behav_t = Tensor::from_slice(behav, n, &dev)?;
        let adv_t = Tensor::from_slice(adv, n, &dev)?;
        // ANCHOR: objective
        // ρ_b = π_prox / π_behaviour: how far the learner is from what generated the tokens.
        let behaviour_ratio = (&prox_t - &behav_t)?.exp()?;
        let (base, weight) = match cfg.correction {
            Correction::Behaviour => (behav_t.clone(), None),
            Correction::Truncated { cap } => {
                (prox_t.clone(), Some(behaviour_ratio.clamp(0f32, cap)?))
            }
            Correction::Ignore => (prox_t.clone(), None),
        };
        let log_ratio = (&logp - &base)?;
        let ratio = log_ratio.exp()?;
        let surr1 = (&ratio * &adv_t)?;
        let clipped = ratio.clamp(1.0 - cfg.clip, 1.0 + cfg.clip_high)?;
        let surr2 = (&clipped * &adv_t)?;
        let mut per_token = surr1.minimum(&surr2)?.neg()?;
        if let Some(w) = &weight {
            per_token = (per_token * w)?;
        }
        let pg = per_token.mean_all()?;
        let (loss, kl) = match reference {
            Some(r) => {
                let d = (Tensor::from_vec(r, n, &dev)? - &logp)?;
                let k3 = ((d.exp()? - &d)? - 1.0)?.mean_all()?;
                ((&pg + (&k3 * f64::from(cfg.kl_coef))?)?, Some(k3))
            }
            None => (pg.clone(), None),
        };
        // ANCHOR_END: objective
        let mut grads = loss.backward()?;
        let grad_norm = clip_gradients(&mut grads, self.model.vars(), cfg.max_grad_norm)?;
        self.opt.step(&grads)?;

        let clip_frac = ((&ratio - &clipped)?.abs()?.gt(1e-6)?)
            .to_dtype(CDType::F32)?
            .mean_all()?
            .to_scalar::<f32>()?;
        let approx_kl = ((&ratio - 1.0)? - &log_ratio)?
            .mean_all()?
            .to_scalar::<f32>()?;
        let entropy = (all.exp()? * &all)?
            .sum(1)?
            .neg()?
            .mean_all()?
            .to_scalar::<f32>()?;
        let br = behaviour_ratio.to_vec1::<f32>()?;
        let truncated = match cfg.correction {
            Correction::Truncated { cap } => {
                br.iter().filter(|&&v| v > cap).count() as f32 / n as f32
            }
            _ => 0.0,
        };
        Ok(StepStats {
            loss: loss.to_scalar::<f32>()?,
            pg_loss: pg.to_scalar::<f32>()?,
            kl: kl.map(|k| k.to_scalar::<f32>()).transpose()?,
            approx_kl,
            clip_fraction: clip_frac,
            entropy,
            ratio_mean: br.iter().sum::<f32>() / n as f32,
            ratio_max: br.iter().copied().fold(0.0, f32::max),
            truncated,
            grad_norm,
            tokens: n,
            zero_adv: adv.iter().filter(|a| **a == 0.0).count() as f32 / n as f32,
        })
    }

    /// Exports the policy as a new version (the previous plus one).
    ///
    /// # Errors
    /// Candle or layout errors.
    pub fn export(&mut self) -> Result<WeightSet> {
        let mut ws = self.model.export(self.cfg.policy_id.clone())?;
        self.version = self.version.next();
        ws.set_version(self.version);
        Ok(ws)
    }
}

/// The values of the sequences `chunk` names, one after the other.
fn gather<'a>(chunk: &[usize], src: impl Fn(usize) -> &'a [f32]) -> Vec<f32> {
    chunk.iter().flat_map(|&i| src(i).iter().copied()).collect()
}

struct StepStats {
    loss: f32,
    pg_loss: f32,
    kl: Option<f32>,
    approx_kl: f32,
    clip_fraction: f32,
    entropy: f32,
    ratio_mean: f32,
    ratio_max: f32,
    truncated: f32,
    grad_norm: f32,
    tokens: usize,
    zero_adv: f32,
}

/// Token-weighted means of the last epoch's steps.
#[derive(Default)]
struct Acc {
    sums: BTreeMap<&'static str, f64>,
    tokens: usize,
    ratio_max: f32,
    kl: bool,
}

impl Acc {
    fn add(&mut self, s: &StepStats) {
        let w = s.tokens as f64;
        for (k, v) in [
            ("loss", s.loss),
            ("pg_loss", s.pg_loss),
            ("kl", s.kl.unwrap_or(0.0)),
            ("approx_kl", s.approx_kl),
            ("clip_fraction", s.clip_fraction),
            ("entropy", s.entropy),
            ("behaviour_ratio_mean", s.ratio_mean),
            ("truncated_fraction", s.truncated),
            ("grad_norm", s.grad_norm),
            ("zero_advantage_fraction", s.zero_adv),
        ] {
            *self.sums.entry(k).or_default() += f64::from(v) * w;
        }
        self.tokens += s.tokens;
        self.ratio_max = self.ratio_max.max(s.ratio_max);
        self.kl |= s.kl.is_some();
    }

    fn finish(self) -> LearnStats {
        let mut out = LearnStats::new();
        let n = self.tokens.max(1) as f64;
        for (k, v) in self.sums {
            if k == "kl" && !self.kl {
                continue;
            }
            out.insert(k, v / n);
        }
        out.insert("behaviour_ratio_max", f64::from(self.ratio_max));
        out.insert("tokens", self.tokens as f64);
        out
    }
}

impl Learner for GrpoLearner {
    fn update(&mut self, batch: &Batch) -> Result<LearnStats> {
        GrpoLearner::update(self, batch)
    }
    fn export(&mut self) -> Result<WeightSet> {
        GrpoLearner::export(self)
    }
    fn manifest(&self) -> Arc<Manifest> {
        Arc::clone(self.model.manifest())
    }
    fn version(&self) -> Version {
        self.version
    }
    /// The policy's parameters (`policy.NAME`) and the optimiser's state; the KL reference
    /// is not saved: a frozen one is the initial weights, made again from the seed.
    fn save(&self) -> Result<WeightSet> {
        let mut out = StateWriter::new();
        for (spec, var) in self
            .model
            .manifest()
            .tensors()
            .iter()
            .zip(self.model.vars())
        {
            out.tensor(format!("policy.{}", spec.name), var.as_tensor())?;
        }
        self.opt.save("adam", &mut out)?;
        out.finish(self.cfg.policy_id.clone(), self.version)
    }
    fn restore(&mut self, state: &WeightSet, source: &str) -> Result<()> {
        let st = LearnerState::open(state, source, &self.cfg.policy_id)?;
        let names = self.model.manifest().tensors().iter();
        st.restore_vars(
            names
                .zip(self.model.vars())
                .map(|(spec, var)| (format!("policy.{}", spec.name), var)),
        )?;
        self.opt.restore("adam", &st)?;
        self.version = st.version();
        // the shuffles go on from a seed of their own, not the run's first ones again
        self.rng =
            SmallRng::seed_from_u64(self.cfg.seed ^ 0x6770_6f00 ^ st.version().0.rotate_left(32));
        Ok(())
    }
}
