//! Policies: map an observation to an action and its log-probability.
//!
//! A [`Policy`] is also a [`HasWeights`] model, so collectors load new weights into it
//! through a refit [`Strategy`](refit_runtime::Strategy) ([`ArenaStrategy`](refit_runtime::ArenaStrategy)
//! by default). [`MlpPolicy`] is a tanh MLP with a categorical head whose single-observation
//! forward is plain Rust (no thread pool, no allocation).

use std::sync::Arc;

use rand::Rng;
use rand::rngs::SmallRng;
use refit_runtime::{DType, HasWeights, Manifest, WeightSet};
use serde::{Deserialize, Serialize};

/// What a policy returns for one observation.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActionOut {
    /// The chosen discrete action.
    pub action: usize,
    /// Log-probability of that action under the policy that chose it.
    pub log_prob: f32,
}

// ANCHOR: policy
/// A stochastic policy over discrete actions whose weights refit can move.
pub trait Policy: HasWeights + Send {
    /// Samples an action for one observation.
    fn act(&mut self, obs: &[f32], rng: &mut SmallRng) -> ActionOut;

    /// Length of the observations it acts on (an engine splits a request's flat
    /// observations by it).
    fn obs_dim(&self) -> usize;

    /// Number of discrete actions it chooses from.
    fn num_actions(&self) -> usize;

    /// The most likely action (evaluation); by default a sample.
    fn act_greedy(&mut self, obs: &[f32], rng: &mut SmallRng) -> usize {
        self.act(obs, rng).action
    }
}
// ANCHOR_END: policy

#[derive(Clone, Debug)]
struct Layer {
    n_in: usize,
    n_out: usize,
    /// Transposed weight, `[n_in, n_out]` row-major, so the forward is a sum of axpys that
    /// vectorises without reassociating floats.
    w_t: Vec<f32>,
    b: Vec<f32>,
}

impl Layer {
    fn forward(&self, x: &[f32], out: &mut [f32]) {
        out.copy_from_slice(&self.b);
        for (&xj, row) in x.iter().zip(self.w_t.chunks_exact(self.n_out)) {
            for (o, &w) in out.iter_mut().zip(row) {
                *o += w * xj;
            }
        }
    }
}

/// A tanh MLP policy with a categorical head: `sizes = [obs, hidden.., actions]`,
/// e.g. `[4, 64, 64, 2]` for CartPole.
///
/// Its [`WeightSet`] layout follows PyTorch's `nn.Sequential(Linear, Tanh, Linear, Tanh,
/// Linear)` naming under the prefix `pi`: `pi.0.weight` `[64, 4]`, `pi.0.bias` `[64]`,
/// `pi.2.weight`, `pi.2.bias`, `pi.4.weight` `[2, 64]`, `pi.4.bias`, all `f32`, weights
/// `[out, in]` row-major. The PPO trainer exports exactly this manifest.
#[derive(Clone, Debug)]
pub struct MlpPolicy {
    sizes: Vec<usize>,
    layers: Vec<Layer>,
    manifest: Arc<Manifest>,
    buf_a: Vec<f32>,
    buf_b: Vec<f32>,
}

impl MlpPolicy {
    /// The tensor prefix of the policy's parameters.
    pub const PREFIX: &'static str = "pi";

    /// A zero-initialised policy (uniform action distribution) with the given layer sizes.
    ///
    /// # Errors
    /// [`refit_runtime::Error::InvalidManifest`] with fewer than two sizes or a zero size.
    pub fn new(sizes: &[usize]) -> refit_runtime::Result<Self> {
        let manifest = Arc::new(Self::manifest_for(sizes)?);
        let layers = sizes
            .windows(2)
            .map(|w| Layer {
                n_in: w[0],
                n_out: w[1],
                w_t: vec![0.0; w[0] * w[1]],
                b: vec![0.0; w[1]],
            })
            .collect();
        let widest = sizes.iter().copied().max().unwrap_or(0);
        Ok(Self {
            sizes: sizes.to_vec(),
            layers,
            manifest,
            buf_a: vec![0.0; widest],
            buf_b: vec![0.0; widest],
        })
    }

    /// The CartPole policy, `[4, 64, 64, 2]`.
    ///
    /// # Errors
    /// None in practice (the sizes are valid); kept for symmetry with [`MlpPolicy::new`].
    pub fn cartpole() -> refit_runtime::Result<Self> {
        Self::new(&[4, 64, 64, 2])
    }

    /// The manifest of an MLP with these sizes (`pi.{2i}.weight` `[out, in]`, `pi.{2i}.bias`).
    ///
    /// # Errors
    /// [`refit_runtime::Error::InvalidManifest`] with fewer than two sizes or a zero size.
    pub fn manifest_for(sizes: &[usize]) -> refit_runtime::Result<Manifest> {
        if sizes.len() < 2 || sizes.contains(&0) {
            return Err(refit_runtime::Error::InvalidManifest(format!(
                "an mlp needs at least two non-zero sizes, got {sizes:?}"
            )));
        }
        let mut b = Manifest::builder();
        for (i, w) in sizes.windows(2).enumerate() {
            b.push(Self::weight_name(i), DType::F32, &[w[1], w[0]]);
            b.push(Self::bias_name(i), DType::F32, &[w[1]]);
        }
        b.build()
    }

    /// Name of layer `i`'s weight (`pi.0.weight`, `pi.2.weight`, ...).
    pub fn weight_name(i: usize) -> String {
        format!("{}.{}.weight", Self::PREFIX, 2 * i)
    }

    /// Name of layer `i`'s bias.
    pub fn bias_name(i: usize) -> String {
        format!("{}.{}.bias", Self::PREFIX, 2 * i)
    }

    /// The layer sizes.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// The manifest (shared).
    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.manifest
    }

    /// Writes the action logits for one observation into `logits`.
    ///
    /// An observation of the wrong length is read as far as it goes (missing entries count
    /// as zero); collectors check lengths against the environment before acting.
    pub fn logits(&mut self, obs: &[f32], logits: &mut [f32]) {
        let n = self.layers.len();
        let mut width = self.sizes[0];
        self.buf_a[..width].fill(0.0);
        for (d, &s) in self.buf_a[..width].iter_mut().zip(obs) {
            *d = s;
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let out = &mut self.buf_b[..layer.n_out];
            layer.forward(&self.buf_a[..width], out);
            if i + 1 == n {
                logits.fill(0.0);
                for (l, &o) in logits.iter_mut().zip(out.iter()) {
                    *l = o;
                }
                return;
            }
            for v in out.iter_mut() {
                *v = tanh(*v);
            }
            std::mem::swap(&mut self.buf_a, &mut self.buf_b);
            width = layer.n_out;
        }
    }

    /// Log-probabilities of every action for one observation.
    pub fn log_probs(&mut self, obs: &[f32]) -> Vec<f32> {
        let mut l = vec![0.0; self.num_actions()];
        self.logits(obs, &mut l);
        log_softmax_in_place(&mut l);
        l
    }

    /// Number of actions.
    pub fn num_actions(&self) -> usize {
        self.sizes[self.sizes.len() - 1]
    }

    /// Sets every parameter from a flat `[out, in]`-layout weight set (same manifest).
    fn load(&mut self, ws: &WeightSet) -> refit_runtime::Result<()> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for (i, old) in self.layers.iter().enumerate() {
            let w: &[f32] = ws.view(&Self::weight_name(i))?;
            let b: &[f32] = ws.view(&Self::bias_name(i))?;
            if w.len() != old.n_in * old.n_out || b.len() != old.n_out {
                return Err(refit_runtime::Error::Strategy(format!(
                    "layer {i}: {} weights and {} biases, expected {} and {}",
                    w.len(),
                    b.len(),
                    old.n_in * old.n_out,
                    old.n_out
                )));
            }
            let mut w_t = vec![0.0; w.len()];
            for o in 0..old.n_out {
                for j in 0..old.n_in {
                    w_t[j * old.n_out + o] = w[o * old.n_in + j];
                }
            }
            layers.push(Layer {
                n_in: old.n_in,
                n_out: old.n_out,
                w_t,
                b: b.to_vec(),
            });
        }
        // All layers read: swap in at once, never half-updated.
        self.layers = layers;
        Ok(())
    }
}

/// `tanh` as a rational function (Eigen's fast float tanh): absolute error below 1e-6
/// everywhere, pure arithmetic, so loops over it vectorise. glibc's `tanhf` (through
/// `expm1f`) costs several times more and was half of a forward pass. The trainer uses the
/// same function, so collector and trainer agree on log-probabilities.
#[inline]
pub fn tanh(x: f32) -> f32 {
    const CLAMP: f32 = 7.905_311;
    const A: [f32; 7] = [
        4.893_524_6e-3,
        6.372_619_3e-4,
        1.485_722_4e-5,
        5.122_297e-8,
        -8.604_672e-11,
        2.000_188e-13,
        -2.760_768_5e-16,
    ];
    const B: [f32; 4] = [4.893_525e-3, 2.268_434_6e-3, 1.185_347e-4, 1.198_258_4e-6];
    let x = x.clamp(-CLAMP, CLAMP);
    let x2 = x * x;
    let mut p = A[6];
    for a in A[..6].iter().rev() {
        p = p * x2 + a;
    }
    p *= x;
    let mut q = B[3];
    for b in B[..3].iter().rev() {
        q = q * x2 + b;
    }
    p / q
}

/// Replaces logits by their log-softmax (numerically stable).
pub fn log_softmax_in_place(l: &mut [f32]) {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = l.iter().map(|&v| (v - max).exp()).sum();
    let lse = max + sum.ln();
    for v in l.iter_mut() {
        *v -= lse;
    }
}

impl HasWeights for MlpPolicy {
    fn weight_manifest(&self) -> refit_runtime::Result<Manifest> {
        Ok((*self.manifest).clone())
    }

    fn write_weights(&self, out: &mut WeightSet) -> refit_runtime::Result<()> {
        for (i, layer) in self.layers.iter().enumerate() {
            let w = out.view_mut::<f32>(&Self::weight_name(i))?;
            for o in 0..layer.n_out {
                for j in 0..layer.n_in {
                    w[o * layer.n_in + j] = layer.w_t[j * layer.n_out + o];
                }
            }
            out.view_mut::<f32>(&Self::bias_name(i))?
                .copy_from_slice(&layer.b);
        }
        Ok(())
    }

    fn read_weights(&mut self, weights: &WeightSet) -> refit_runtime::Result<()> {
        self.load(weights)
    }
}

impl Policy for MlpPolicy {
    fn obs_dim(&self) -> usize {
        self.sizes.first().copied().unwrap_or(0)
    }

    fn num_actions(&self) -> usize {
        MlpPolicy::num_actions(self)
    }

    fn act(&mut self, obs: &[f32], rng: &mut SmallRng) -> ActionOut {
        let n = self.num_actions();
        let mut small = [0.0f32; 16];
        let mut big = Vec::new();
        let l: &mut [f32] = if n <= small.len() {
            &mut small[..n]
        } else {
            big.resize(n, 0.0);
            &mut big
        };
        self.logits(obs, l);
        log_softmax_in_place(l);
        let u: f32 = rng.random();
        let mut acc = 0.0;
        let mut action = n - 1;
        for (a, &lp) in l.iter().enumerate() {
            acc += lp.exp();
            if u < acc {
                action = a;
                break;
            }
        }
        ActionOut {
            action,
            log_prob: l[action],
        }
    }

    fn act_greedy(&mut self, obs: &[f32], _rng: &mut SmallRng) -> usize {
        let mut l = vec![0.0; self.num_actions()];
        self.logits(obs, &mut l);
        l.iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 { (i, v) } else { best }
            })
            .0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use refit_runtime::{ArenaStrategy, ModelId, Strategy, extract_new};

    fn reference_logits(ws: &WeightSet, sizes: &[usize], obs: &[f32]) -> Vec<f32> {
        let mut x: Vec<f32> = obs.to_vec();
        let n = sizes.len() - 1;
        for i in 0..n {
            let w: &[f32] = ws.view(&MlpPolicy::weight_name(i)).unwrap();
            let b: &[f32] = ws.view(&MlpPolicy::bias_name(i)).unwrap();
            let mut y = b.to_vec();
            for o in 0..sizes[i + 1] {
                for j in 0..sizes[i] {
                    y[o] += w[o * sizes[i] + j] * x[j];
                }
            }
            if i + 1 < n {
                y.iter_mut().for_each(|v| *v = tanh(*v));
            }
            x = y;
        }
        x
    }

    #[test]
    fn names_shapes_and_forward_match_a_naive_mlp() {
        let sizes = [4, 64, 64, 2];
        let m = MlpPolicy::manifest_for(&sizes).unwrap();
        let names: Vec<_> = m.tensors().iter().map(|t| t.name.clone()).collect();
        assert_eq!(
            names,
            [
                "pi.0.weight",
                "pi.0.bias",
                "pi.2.weight",
                "pi.2.bias",
                "pi.4.weight",
                "pi.4.bias"
            ]
        );
        assert_eq!(m.get("pi.0.weight").unwrap().shape, vec![64, 4]);
        let id = ModelId::new("policy").unwrap();
        let mut ws = WeightSet::zeroed(id.clone(), Arc::new(m));
        let mut rng = SmallRng::seed_from_u64(1);
        for t in [
            "pi.0.weight",
            "pi.0.bias",
            "pi.2.weight",
            "pi.2.bias",
            "pi.4.weight",
            "pi.4.bias",
        ] {
            for v in ws.view_mut::<f32>(t).unwrap() {
                *v = rng.random_range(-0.5..0.5);
            }
        }
        let mut p = MlpPolicy::cartpole().unwrap();
        ArenaStrategy.apply(&ws, &mut p).unwrap();
        let obs = [0.01, -0.3, 0.05, 0.2];
        let mut l = [0.0; 2];
        p.logits(&obs, &mut l);
        let r = reference_logits(&ws, &sizes, &obs);
        for (a, b) in l.iter().zip(&r) {
            assert!((a - b).abs() < 1e-5, "{l:?} vs {r:?}");
        }
        let back = extract_new(&ArenaStrategy, &p, id).unwrap();
        assert_eq!(back.bytes(), ws.bytes());
        let out = p.act(&obs, &mut rng);
        let lp = p.log_probs(&obs);
        assert!((out.log_prob - lp[out.action]).abs() < 1e-6);
        // a wrong layout is refused and the policy is unchanged
        let other = WeightSet::zeroed(
            ModelId::new("policy").unwrap(),
            Arc::new(MlpPolicy::manifest_for(&[4, 32, 2]).unwrap()),
        );
        assert!(ArenaStrategy.apply(&other, &mut p).is_err());
        p.logits(&obs, &mut l);
        assert!((l[0] - r[0]).abs() < 1e-5);
    }

    #[test]
    fn fast_tanh_is_accurate() {
        let mut worst = 0.0f64;
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4;
            worst = worst.max((f64::from(tanh(x)) - f64::from(x).tanh()).abs());
        }
        assert!(worst < 1e-6, "{worst}");
        assert_eq!(tanh(0.0), 0.0);
        assert!(tanh(1e6) <= 1.0 && tanh(-1e6) >= -1.0);
        assert!(tanh(f32::NAN).is_nan());
    }

    #[test]
    fn zero_policy_samples_uniformly() {
        let mut p = MlpPolicy::cartpole().unwrap();
        let mut rng = SmallRng::seed_from_u64(5);
        let ones: usize = (0..4000).map(|_| p.act(&[0.0; 4], &mut rng).action).sum();
        assert!((1800..2200).contains(&ones), "{ones}");
        assert!((p.act(&[0.0; 4], &mut rng).log_prob - 0.5f32.ln()).abs() < 1e-6);
    }
}
