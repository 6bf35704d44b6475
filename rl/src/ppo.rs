//! PPO on CPU with candle: GAE, clipped objective, value loss, entropy bonus, Adam.
//!
//! The actor has the [`MlpPolicy`] layout (`pi.0.weight` ...), so [`PpoTrainer::export`]
//! produces a [`WeightSet`] collectors load as is. The critic is a separate MLP with one
//! output, private to the trainer (it computes values for GAE itself).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::optim::{AdamW, AdamWParams};
use crate::state::{LearnerState, StateWriter};
use candle_core::{D, DType as CDType, Device as CDevice, Tensor, Var};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use refit_runtime::{HasWeights, Manifest, ModelId, Version, WeightSet};

use crate::batch::Batch;
use crate::collector::policy_model_id;
use crate::error::{Error, Result};
use crate::learner::{LearnStats, Learner};
use crate::policy::MlpPolicy;

/// PPO hyper-parameters.
#[derive(Clone, Debug)]
pub struct PpoConfig {
    /// Layer sizes of the actor (and of the critic, with one output): `[obs, hidden.., actions]`.
    pub sizes: Vec<usize>,
    /// Adam learning rate.
    pub lr: f64,
    /// Discount.
    pub gamma: f32,
    /// GAE lambda.
    pub gae_lambda: f32,
    /// Clip range of the probability ratio.
    pub clip: f32,
    /// Passes over each batch.
    pub epochs: usize,
    /// Minibatch size.
    pub minibatch: usize,
    /// Weight of the value loss.
    pub vf_coef: f32,
    /// Weight of the entropy bonus.
    pub ent_coef: f32,
    /// Global gradient-norm clip (`None`: off).
    pub max_grad_norm: Option<f32>,
    /// Normalise advantages per batch.
    pub normalize_advantages: bool,
    /// Seed of the initialisation and the minibatch shuffles.
    pub seed: u64,
    /// Model id of the exported policy weights.
    pub policy_id: ModelId,
    /// Threads of the trainer's own rayon pool, which candle's CPU kernels run on
    /// (default 1: on small networks rayon's fan-out costs more than it gains, and collector
    /// threads need the other cores).
    pub threads: usize,
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            sizes: vec![4, 64, 64, 2],
            lr: 3e-4,
            gamma: 0.99,
            gae_lambda: 0.95,
            clip: 0.2,
            epochs: 10,
            minibatch: 256,
            vf_coef: 0.5,
            ent_coef: 0.0,
            max_grad_norm: Some(0.5),
            normalize_advantages: true,
            seed: 0,
            policy_id: policy_model_id(),
            threads: 1,
        }
    }
}

/// What one [`PpoTrainer::update`] measured.
#[derive(Clone, Debug, Default)]
pub struct PpoStats {
    /// Clipped policy loss, last epoch mean.
    pub policy_loss: f32,
    /// Value loss, last epoch mean.
    pub value_loss: f32,
    /// Policy entropy, last epoch mean.
    pub entropy: f32,
    /// Approximate KL between the behaviour policy and the updated one, last epoch mean.
    pub approx_kl: f32,
    /// Fraction of samples whose ratio was clipped, last epoch.
    pub clip_fraction: f32,
    /// Samples trained on.
    pub samples: usize,
    /// Gradient steps taken.
    pub steps: usize,
    /// Wall time of the update.
    pub elapsed: Duration,
}

struct Mlp {
    layers: Vec<(Var, Var)>,
}

impl Mlp {
    /// Weights `N(0, (gain_i / sqrt(in))^2)` (the scale of an orthogonal init), biases zero.
    fn new(sizes: &[usize], out_gain: f64, rng: &mut SmallRng, dev: &CDevice) -> Result<Self> {
        let n = sizes.len() - 1;
        let mut layers = Vec::with_capacity(n);
        for (i, w) in sizes.windows(2).enumerate() {
            let (n_in, n_out) = (w[0], w[1]);
            let gain = if i + 1 == n { out_gain } else { 2f64.sqrt() };
            let std = gain / (n_in as f64).sqrt();
            let data: Vec<f32> = (0..n_in * n_out)
                .map(|_| (normal(rng) * std) as f32)
                .collect();
            let wt = Tensor::from_vec(data, (n_out, n_in), dev)?;
            // Bias as a `[1, out]` row, added as `ones[n, 1] x b`: its gradient is then a
            // matmul too, not a strided reduction (which dominated the backward pass).
            let bt = Tensor::zeros((1, n_out), CDType::F32, dev)?;
            layers.push((Var::from_tensor(&wt)?, Var::from_tensor(&bt)?));
        }
        Ok(Self { layers })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let n = self.layers.len();
        let ones = Tensor::ones((x.dim(0)?, 1), CDType::F32, x.device())?;
        let mut h = x.clone();
        for (i, (w, b)) in self.layers.iter().enumerate() {
            h = (h.matmul(&w.as_tensor().t()?)? + ones.matmul(b.as_tensor())?)?;
            if i + 1 < n {
                h = h.apply_op1(FastTanh)?;
            }
        }
        Ok(h)
    }

    fn vars(&self) -> Vec<Var> {
        self.layers
            .iter()
            .flat_map(|(w, b)| [w.clone(), b.clone()])
            .collect()
    }
}

/// `tanh` as a candle op computing [`crate::policy::tanh`], the collector's: candle's
/// built-in goes through glibc's `tanhf`, which was half of the training time.
struct FastTanh;

impl candle_core::CustomOp1 for FastTanh {
    fn name(&self) -> &'static str {
        "refit-fast-tanh"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let candle_core::CpuStorage::F32(data) = storage else {
            return Err(candle_core::Error::Msg("fast tanh takes f32 only".into()));
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::Msg(
                "fast tanh takes contiguous tensors only".into(),
            ));
        };
        let out = data[start..end]
            .iter()
            .map(|&v| crate::policy::tanh(v))
            .collect();
        Ok((candle_core::CpuStorage::F32(out), layout.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        // d tanh(x) / dx = 1 - tanh(x)^2
        Ok(Some(grad.mul(&res.sqr()?.affine(-1.0, 1.0)?)?))
    }
}

fn normal(rng: &mut SmallRng) -> f64 {
    // Box-Muller; u1 in (0, 1] so the log is finite.
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// A PPO learner: an actor with the [`MlpPolicy`] layout, a separate critic, one Adam.
pub struct PpoTrainer {
    cfg: PpoConfig,
    actor: Mlp,
    critic: Mlp,
    opt: AdamW,
    rng: SmallRng,
    dev: CDevice,
    manifest: Arc<Manifest>,
    version: Version,
    pool: Arc<rayon::ThreadPool>,
}

impl fmt::Debug for PpoTrainer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PpoTrainer")
            .field("cfg", &self.cfg)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl PpoTrainer {
    /// A freshly initialised learner (version 0: nothing exported yet).
    ///
    /// # Errors
    /// [`Error::Config`] for unusable sizes or settings; candle errors.
    pub fn new(cfg: PpoConfig) -> Result<Self> {
        if cfg.sizes.len() < 2 || cfg.sizes.contains(&0) {
            return Err(Error::Config(format!(
                "ppo sizes {:?} are unusable",
                cfg.sizes
            )));
        }
        if cfg.minibatch == 0 || cfg.epochs == 0 {
            return Err(Error::Config(
                "ppo minibatch and epochs must be positive".into(),
            ));
        }
        let dev = CDevice::Cpu;
        let mut rng = SmallRng::seed_from_u64(cfg.seed);
        let actor = Mlp::new(&cfg.sizes, 0.01, &mut rng, &dev)?;
        let mut critic_sizes = cfg.sizes.clone();
        if let Some(last) = critic_sizes.last_mut() {
            *last = 1;
        }
        let critic = Mlp::new(&critic_sizes, 1.0, &mut rng, &dev)?;
        let mut vars = actor.vars();
        vars.extend(critic.vars());
        let opt = AdamW::new(
            vars,
            AdamWParams {
                lr: cfg.lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-5,
                weight_decay: 0.0,
            },
        )?;
        let manifest = Arc::new(MlpPolicy::manifest_for(&cfg.sizes)?);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads.max(1))
            .thread_name(|i| format!("refit-ppo-{i}"))
            .build()
            .map_err(|e| Error::Config(format!("ppo thread pool: {e}")))?;
        Ok(Self {
            pool: Arc::new(pool),
            cfg,
            actor,
            critic,
            opt,
            rng,
            dev,
            manifest,
            version: Version::ZERO,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PpoConfig {
        &self.cfg
    }

    /// The version of the last export.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The policy manifest (same as [`MlpPolicy::manifest_for`] of the sizes).
    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.manifest
    }

    /// Changes the learning rate (annealing).
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.opt.set_learning_rate(lr);
    }

    /// Exports the actor as a new version (the previous plus one) of the policy weights.
    ///
    /// # Errors
    /// Candle or layout errors.
    pub fn export(&mut self) -> Result<WeightSet> {
        let mut ws = WeightSet::zeroed(self.cfg.policy_id.clone(), Arc::clone(&self.manifest));
        self.write_weights(&mut ws)?;
        self.version = self.version.next();
        ws.set_version(self.version);
        Ok(ws)
    }

    /// Log-probabilities of every action for one observation under the current actor.
    ///
    /// # Errors
    /// Candle errors (wrong observation length).
    pub fn action_log_probs(&self, obs: &[f32]) -> Result<Vec<f32>> {
        let x = Tensor::from_slice(obs, (1, obs.len()), &self.dev)?;
        let l = candle_nn::ops::log_softmax(&self.actor.forward(&x)?, D::Minus1)?;
        Ok(l.flatten_all()?.to_vec1::<f32>()?)
    }

    /// Advantages and returns by GAE; transitions are grouped by `(worker, env)` stream,
    /// each stream in time order. Terminated steps do not bootstrap; truncated steps and
    /// steps cut by the batch boundary bootstrap from the critic's value of `next_obs`.
    ///
    /// # Errors
    /// Candle errors.
    pub fn gae(&self, batch: &Batch) -> Result<(Vec<f32>, Vec<f32>)> {
        let tr = &batch.transitions;
        let d = self.cfg.sizes[0];
        let obs: Vec<f32> = tr.iter().flat_map(|t| t.obs.iter().copied()).collect();
        let next: Vec<f32> = tr.iter().flat_map(|t| t.next_obs.iter().copied()).collect();
        let v = self.values(&obs, tr.len(), d)?;
        let nv = self.values(&next, tr.len(), d)?;
        let mut streams: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
        for (i, t) in tr.iter().enumerate() {
            streams.entry((t.worker, t.env)).or_default().push(i);
        }
        let (gamma, lambda) = (self.cfg.gamma, self.cfg.gae_lambda);
        let mut adv = vec![0.0f32; tr.len()];
        let mut ret = vec![0.0f32; tr.len()];
        for idx in streams.values() {
            let mut gae = 0.0f32;
            for k in (0..idx.len()).rev() {
                let i = idx[k];
                let t = &tr[i];
                let bootstrap = if t.terminated { 0.0 } else { nv[i] };
                let delta = t.reward + gamma * bootstrap - v[i];
                let continues = k + 1 < idx.len() && !t.done();
                gae = delta + if continues { gamma * lambda * gae } else { 0.0 };
                adv[i] = gae;
                ret[i] = gae + v[i];
            }
        }
        Ok((adv, ret))
    }

    fn values(&self, obs: &[f32], n: usize, d: usize) -> Result<Vec<f32>> {
        let x = Tensor::from_slice(obs, (n, d), &self.dev)?;
        Ok(self
            .critic
            .forward(&x)?
            .detach()
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// One PPO update on a batch: GAE, then `epochs` passes of shuffled minibatches.
    ///
    /// # Errors
    /// [`Error::Trainer`] for an empty batch or observations of the wrong size; candle errors.
    pub fn update(&mut self, batch: &Batch) -> Result<PpoStats> {
        let pool = Arc::clone(&self.pool);
        pool.install(|| self.update_on_pool(batch))
    }

    fn update_on_pool(&mut self, batch: &Batch) -> Result<PpoStats> {
        let start = Instant::now();
        let tr = &batch.transitions;
        let n = tr.len();
        let d = self.cfg.sizes[0];
        if n == 0 {
            return Err(Error::Trainer("empty batch".into()));
        }
        if let Some(t) = tr
            .iter()
            .find(|t| t.obs.len() != d || t.next_obs.len() != d)
        {
            return Err(Error::Trainer(format!(
                "observation of length {} where the network takes {d}",
                t.obs.len()
            )));
        }
        let (mut adv, ret) = self.gae(batch)?;
        if self.cfg.normalize_advantages && n > 1 {
            let mean = adv.iter().sum::<f32>() / n as f32;
            let var = adv.iter().map(|a| (a - mean) * (a - mean)).sum::<f32>() / (n - 1) as f32;
            let std = var.sqrt() + 1e-8;
            adv.iter_mut().for_each(|a| *a = (*a - mean) / std);
        }
        let obs: Vec<f32> = tr.iter().flat_map(|t| t.obs.iter().copied()).collect();
        let acts: Vec<u32> = tr.iter().map(|t| t.action as u32).collect();
        let old: Vec<f32> = tr.iter().map(|t| t.log_prob).collect();
        let obs_t = Tensor::from_vec(obs, (n, d), &self.dev)?;
        let act_t = Tensor::from_vec(acts, (n, 1), &self.dev)?;
        let old_t = Tensor::from_vec(old, n, &self.dev)?;
        let adv_t = Tensor::from_vec(adv, n, &self.dev)?;
        let ret_t = Tensor::from_vec(ret, n, &self.dev)?;
        let mut order: Vec<u32> = (0..n as u32).collect();
        let mb = self.cfg.minibatch.min(n);
        let mut stats = PpoStats {
            samples: n,
            ..PpoStats::default()
        };
        for epoch in 0..self.cfg.epochs {
            order.shuffle(&mut self.rng);
            let last = epoch + 1 == self.cfg.epochs;
            let mut acc = [0.0f32; 5];
            let mut count = 0usize;
            for chunk in order.chunks(mb) {
                if chunk.len() < mb / 2 {
                    continue; // a tiny tail adds noise, not signal
                }
                let idx = Tensor::from_slice(chunk, chunk.len(), &self.dev)?;
                let o = obs_t.index_select(&idx, 0)?;
                let a = act_t.index_select(&idx, 0)?;
                let old_lp = old_t.index_select(&idx, 0)?;
                let ad = adv_t.index_select(&idx, 0)?;
                let rt = ret_t.index_select(&idx, 0)?;

                let logits = self.actor.forward(&o)?;
                let logp_all = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
                let logp = logp_all.gather(&a, 1)?.squeeze(1)?;
                let entropy = (logp_all.exp()? * &logp_all)?.sum(1)?.neg()?.mean_all()?;
                let log_ratio = (&logp - &old_lp)?;
                let ratio = log_ratio.exp()?;
                let clip = f64::from(self.cfg.clip);
                let surr1 = (&ratio * &ad)?;
                let surr2 = (ratio.clamp(1.0 - clip, 1.0 + clip)? * &ad)?;
                let pg = surr1.minimum(&surr2)?.mean_all()?.neg()?;
                let v = self.critic.forward(&o)?.squeeze(1)?;
                let vloss = ((v - &rt)?.sqr()?.mean_all()? * 0.5)?;
                let loss = ((&pg + (&vloss * f64::from(self.cfg.vf_coef))?)?
                    - (&entropy * f64::from(self.cfg.ent_coef))?)?;
                let mut grads = loss.backward()?;
                if self.cfg.max_grad_norm.is_some() {
                    let vars: Vec<Var> = self
                        .actor
                        .vars()
                        .into_iter()
                        .chain(self.critic.vars())
                        .collect();
                    clip_gradients(&mut grads, &vars, self.cfg.max_grad_norm)?;
                }
                self.opt.step(&grads)?;
                stats.steps += 1;
                if last {
                    let kl = ((&ratio - 1.0)? - &log_ratio)?.mean_all()?;
                    let clipped = ((&ratio - 1.0)?.abs()?.gt(clip)?)
                        .to_dtype(CDType::F32)?
                        .mean_all()?;
                    for (slot, t) in acc.iter_mut().zip([&pg, &vloss, &entropy, &kl, &clipped]) {
                        *slot += t.to_scalar::<f32>()?;
                    }
                    count += 1;
                }
            }
            if last && count > 0 {
                let c = count as f32;
                stats.policy_loss = acc[0] / c;
                stats.value_loss = acc[1] / c;
                stats.entropy = acc[2] / c;
                stats.approx_kl = acc[3] / c;
                stats.clip_fraction = acc[4] / c;
            }
        }
        stats.elapsed = start.elapsed();
        Ok(stats)
    }
}

/// The trainer's actor as a refit model: the [`MlpPolicy`] layout.
impl PpoStats {
    /// The stats as generic [`LearnStats`] (`policy_loss`, `value_loss`, `entropy`,
    /// `approx_kl`, `clip_fraction`, `samples`, `steps`, `elapsed_s`).
    pub fn to_learn_stats(&self) -> LearnStats {
        LearnStats::new()
            .with("policy_loss", f64::from(self.policy_loss))
            .with("value_loss", f64::from(self.value_loss))
            .with("entropy", f64::from(self.entropy))
            .with("approx_kl", f64::from(self.approx_kl))
            .with("clip_fraction", f64::from(self.clip_fraction))
            .with("samples", self.samples as f64)
            .with("steps", self.steps as f64)
            .with("elapsed_s", self.elapsed.as_secs_f64())
    }
}

impl Learner for PpoTrainer {
    fn update(&mut self, batch: &Batch) -> Result<LearnStats> {
        Ok(PpoTrainer::update(self, batch)?.to_learn_stats())
    }
    fn export(&mut self) -> Result<WeightSet> {
        PpoTrainer::export(self)
    }
    fn manifest(&self) -> Arc<Manifest> {
        Arc::clone(PpoTrainer::manifest(self))
    }
    fn version(&self) -> Version {
        PpoTrainer::version(self)
    }
    fn save(&self) -> Result<WeightSet> {
        let mut out = StateWriter::new();
        for (net, mlp) in [("actor", &self.actor), ("critic", &self.critic)] {
            for (i, (w, b)) in mlp.layers.iter().enumerate() {
                out.tensor(format!("{net}.{i}.weight"), w.as_tensor())?;
                out.tensor(format!("{net}.{i}.bias"), b.as_tensor())?;
            }
        }
        self.opt.save("adam", &mut out)?;
        out.finish(self.cfg.policy_id.clone(), self.version)
    }
    fn restore(&mut self, state: &WeightSet, source: &str) -> Result<()> {
        let st = LearnerState::open(state, source, &self.cfg.policy_id)?;
        let mut vars = Vec::new();
        for (net, mlp) in [("actor", &self.actor), ("critic", &self.critic)] {
            for (i, (w, b)) in mlp.layers.iter().enumerate() {
                vars.push((format!("{net}.{i}.weight"), w));
                vars.push((format!("{net}.{i}.bias"), b));
            }
        }
        st.restore_vars(vars)?;
        self.opt.restore("adam", &st)?;
        self.version = st.version();
        // the shuffles go on from a seed of their own, not the run's first ones again
        self.rng = SmallRng::seed_from_u64(self.cfg.seed ^ st.version().0.rotate_left(32));
        Ok(())
    }
}

impl HasWeights for PpoTrainer {
    fn weight_manifest(&self) -> refit_runtime::Result<Manifest> {
        Ok((*self.manifest).clone())
    }

    fn write_weights(&self, out: &mut WeightSet) -> refit_runtime::Result<()> {
        for (i, (w, b)) in self.actor.layers.iter().enumerate() {
            let wv = flat(w.as_tensor())?;
            let bv = flat(b.as_tensor())?;
            copy_into(out.view_mut::<f32>(&MlpPolicy::weight_name(i))?, &wv, i)?;
            copy_into(out.view_mut::<f32>(&MlpPolicy::bias_name(i))?, &bv, i)?;
        }
        Ok(())
    }

    fn read_weights(&mut self, weights: &WeightSet) -> refit_runtime::Result<()> {
        // Build every tensor first, then set: never half-updated.
        let mut staged = Vec::with_capacity(self.actor.layers.len());
        for (i, (w, b)) in self.actor.layers.iter().enumerate() {
            let wv: &[f32] = weights.view(&MlpPolicy::weight_name(i))?;
            let bv: &[f32] = weights.view(&MlpPolicy::bias_name(i))?;
            let wt = Tensor::from_slice(wv, w.as_tensor().shape(), &self.dev).map_err(strat)?;
            let bt = Tensor::from_slice(bv, b.as_tensor().shape(), &self.dev).map_err(strat)?;
            staged.push((wt, bt));
        }
        for ((w, b), (wt, bt)) in self.actor.layers.iter().zip(staged) {
            w.set(&wt).map_err(strat)?;
            b.set(&bt).map_err(strat)?;
        }
        Ok(())
    }
}

fn strat(e: candle_core::Error) -> refit_runtime::Error {
    refit_runtime::Error::Strategy(format!("candle: {e}"))
}

fn flat(t: &Tensor) -> refit_runtime::Result<Vec<f32>> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(strat)
}

fn copy_into(dst: &mut [f32], src: &[f32], layer: usize) -> refit_runtime::Result<()> {
    if dst.len() != src.len() {
        return Err(refit_runtime::Error::Strategy(format!(
            "layer {layer}: {} values for a tensor of {}",
            src.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// Scales `grads` so their global norm is at most `max` (none: left as they are); answers
/// the norm before.
///
/// # Errors
/// A candle error reading or scaling a gradient.
pub(crate) fn clip_gradients(
    grads: &mut candle_core::backprop::GradStore,
    vars: &[Var],
    max: Option<f32>,
) -> Result<f32> {
    let mut sq = 0.0f32;
    for var in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            // A copy-out and a plain loop beats candle's reduction here.
            let v = g.flatten_all()?.to_vec1::<f32>()?;
            sq += v.iter().map(|x| x * x).sum::<f32>();
        }
    }
    let norm = sq.sqrt();
    if let Some(max) = max
        && norm > max
    {
        let scale = f64::from(max / (norm + 1e-6));
        for var in vars {
            if let Some(g) = grads.get(var.as_tensor()) {
                let scaled = (g * scale)?;
                grads.insert(var.as_tensor(), scaled);
            }
        }
    }
    Ok(norm)
}
