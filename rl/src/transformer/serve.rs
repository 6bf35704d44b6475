//! The generator's side of the transformer: a [`Generator`] serving the engine's layout
//! (fused `qkv`, `bf16`), with one KV cache per sequence and continuous batching.
//!
//! [`TransformerGenerator::stage`] verifies a weight set of the engine's layout and upcasts
//! it to `f32` (off the decoding loop). [`TransformerGenerator::forward`] stacks the new
//! tokens of every sequence of the step into one `[rows, d]` matrix for the per-token
//! matmuls (`qkv`, `o`, the MLP and the head, on candle's CPU GEMM), and runs attention per
//! sequence against its own cache, so sequences of different lengths, prefills and single
//! decode tokens share one step.

use std::fmt;
use std::sync::Arc;

use candle_core::{Device as CDevice, Tensor};
use half::bf16;
use rayon::prelude::*;
use refit_runtime::{Manifest, WeightSet};

use super::config::{LN_EPS, TransformerConfig};
use super::ops::gelu;
use crate::error::{Error, Result};
use crate::generation::{Generator, StepInput};

/// One block in serving form.
struct ServingBlock {
    ln1: (Vec<f32>, Vec<f32>),
    /// `[3d, d]`.
    qkv: Tensor,
    /// `[d, d]`.
    o: Tensor,
    ln2: (Vec<f32>, Vec<f32>),
    /// `[mlp, d]`.
    fc: Tensor,
    /// `[d, mlp]`.
    proj: Tensor,
}

/// A staged version: `f32` values upcast from the engine's `bf16`, matrices as candle tensors
/// `[out, in]`.
pub struct ServingWeights {
    tok_emb: Vec<f32>,
    pos_emb: Vec<f32>,
    blocks: Vec<ServingBlock>,
    ln_f: (Vec<f32>, Vec<f32>),
    head: Tensor,
}

impl fmt::Debug for ServingWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServingWeights")
            .field("layers", &self.blocks.len())
            .finish_non_exhaustive()
    }
}

/// One sequence's keys and values: per layer `[len, d]` row-major.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    len: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    /// Positions held (tokens fed so far).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before the first token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn truncate(&mut self, len: usize, d: usize) {
        self.len = len;
        for layer in self.k.iter_mut().chain(self.v.iter_mut()) {
            layer.truncate(len * d);
        }
    }
}

/// A GPT-style transformer served from the engine's layout ([`TransformerConfig::want`] of
/// the trainer's). Clones share the thread pool (an engine may stage on a clone beside the
/// one that decodes).
#[derive(Clone)]
pub struct TransformerGenerator {
    cfg: TransformerConfig,
    manifest: Arc<Manifest>,
    pool: Arc<rayon::ThreadPool>,
}

impl fmt::Debug for TransformerGenerator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransformerGenerator")
            .field("cfg", &self.cfg)
            .field("threads", &self.pool.current_num_threads())
            .finish_non_exhaustive()
    }
}

impl TransformerGenerator {
    /// A generator of `cfg` whose numerics run on its own pool of `threads` threads.
    ///
    /// # Errors
    /// [`Error::Config`] for bad sizes or a pool that cannot start.
    pub fn new(cfg: TransformerConfig, threads: usize) -> Result<Self> {
        let manifest = cfg.generator_manifest()?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("refit-gen-{i}"))
            .build()
            .map_err(|e| Error::Config(format!("generator thread pool: {e}")))?;
        Ok(Self {
            cfg,
            manifest,
            pool: Arc::new(pool),
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &TransformerConfig {
        &self.cfg
    }

    fn forward_on_pool(
        &self,
        w: &ServingWeights,
        inputs: &mut [StepInput<'_, KvCache>],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let (d, dh, heads) = (cfg.d_model, cfg.head_dim(), cfg.heads);
        // Check everything before touching a cache.
        for inp in inputs.iter() {
            if inp.tokens.is_empty() {
                return Err(Error::bad_request("tokens", "a step fed no token"));
            }
            if let Some(&t) = inp.tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
                return Err(Error::bad_request(
                    "tokens",
                    format!("token {t} is outside the vocabulary of {}", cfg.vocab),
                ));
            }
            let end = inp.cache.len + inp.tokens.len();
            if end > cfg.context {
                return Err(Error::bad_request(
                    "tokens",
                    format!(
                        "the sequence would reach {end} tokens, past the context of {}",
                        cfg.context
                    ),
                ));
            }
        }
        // Row offsets of each input in the stacked matrix.
        let mut starts = Vec::with_capacity(inputs.len() + 1);
        let mut rows = 0;
        for inp in inputs.iter() {
            starts.push(rows);
            rows += inp.tokens.len();
        }
        starts.push(rows);
        let mut x = vec![0.0f32; rows * d];
        for (i, inp) in inputs.iter().enumerate() {
            for (j, &tok) in inp.tokens.iter().enumerate() {
                let r = starts[i] + j;
                let p = inp.cache.len + j;
                let row = &mut x[r * d..(r + 1) * d];
                let te = &w.tok_emb[tok as usize * d..][..d];
                let pe = &w.pos_emb[p * d..][..d];
                for ((o, a), b) in row.iter_mut().zip(te).zip(pe) {
                    *o = a + b;
                }
            }
        }
        let before: Vec<usize> = inputs.iter().map(|i| i.cache.len).collect();
        for inp in inputs.iter_mut() {
            if inp.cache.k.len() != cfg.layers {
                inp.cache.k.resize_with(cfg.layers, Vec::new);
                inp.cache.v.resize_with(cfg.layers, Vec::new);
            }
        }
        let result = (|| -> Result<()> {
            let scale = 1.0 / (dh as f32).sqrt();
            let mut y = vec![0.0f32; rows * d];
            // every head of every row is written by `attend`: one buffer serves each layer
            let mut att = vec![0.0f32; rows * d];
            for (l, blk) in w.blocks.iter().enumerate() {
                layer_norm_rows(&x, &mut y, d, &blk.ln1.0, &blk.ln1.1);
                let qkv = matmul(&y, rows, &blk.qkv)?;
                // Attention, one sequence at a time against its own cache.
                let chunks = split_rows(&mut att, &starts, d);
                inputs
                    .par_iter_mut()
                    .zip(chunks.into_par_iter())
                    .enumerate()
                    .for_each(|(i, (inp, out))| {
                        let qkv_i = &qkv[starts[i] * 3 * d..starts[i + 1] * 3 * d];
                        attend(inp.cache, l, qkv_i, out, d, dh, heads, scale);
                    });
                let o = matmul(&att, rows, &blk.o)?;
                add_in_place(&mut x, &o);
                layer_norm_rows(&x, &mut y, d, &blk.ln2.0, &blk.ln2.1);
                let mut hidden = matmul(&y, rows, &blk.fc)?;
                hidden.iter_mut().for_each(|v| *v = gelu(*v));
                let out = matmul(&hidden, rows, &blk.proj)?;
                add_in_place(&mut x, &out);
            }
            // The head only for each input's last row.
            let n = inputs.len();
            let mut last = vec![0.0f32; n * d];
            for i in 0..n {
                let r = starts[i + 1] - 1;
                layer_norm_rows(
                    &x[r * d..(r + 1) * d],
                    &mut last[i * d..(i + 1) * d],
                    d,
                    &w.ln_f.0,
                    &w.ln_f.1,
                );
            }
            let out = matmul(&last, n, &w.head)?;
            *logits = out;
            Ok(())
        })();
        // All or nothing: a failed step leaves every cache as it was.
        for (inp, &len) in inputs.iter_mut().zip(&before) {
            if result.is_ok() {
                inp.cache.len = len + inp.tokens.len();
            } else {
                inp.cache.truncate(len, d);
            }
        }
        result
    }
}

/// Splits `buf` (rows of `d`) at the row offsets `starts` (increasing, last = total rows).
fn split_rows<'a>(buf: &'a mut [f32], starts: &[usize], d: usize) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(starts.len().saturating_sub(1));
    let mut rest = buf;
    for w in starts.windows(2) {
        let (a, b) = std::mem::take(&mut rest).split_at_mut((w[1] - w[0]) * d);
        out.push(a);
        rest = b;
    }
    out
}

/// Appends the keys and values of one sequence's new rows (`qkv`: `[n, 3d]`) to layer `l`
/// of its cache and writes each row's attention output (`out`: `[n, d]`), causally.
#[allow(clippy::too_many_arguments)]
fn attend(
    cache: &mut KvCache,
    l: usize,
    qkv: &[f32],
    out: &mut [f32],
    d: usize,
    dh: usize,
    heads: usize,
    scale: f32,
) {
    let base = cache.len;
    let (kc, vc) = (&mut cache.k[l], &mut cache.v[l]);
    kc.truncate(base * d);
    vc.truncate(base * d);
    for row in qkv.chunks_exact(3 * d) {
        kc.extend_from_slice(&row[d..2 * d]);
        vc.extend_from_slice(&row[2 * d..]);
    }
    let mut scores = Vec::with_capacity(base + out.len() / d);
    for (j, (row, o)) in qkv
        .chunks_exact(3 * d)
        .zip(out.chunks_exact_mut(d))
        .enumerate()
    {
        let upto = base + j + 1;
        for h in 0..heads {
            let q = &row[h * dh..(h + 1) * dh];
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for u in 0..upto {
                let s = dot(q, &kc[u * d + h * dh..][..dh]) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let oh = &mut o[h * dh..(h + 1) * dh];
            oh.fill(0.0);
            for (u, &s) in scores.iter().enumerate() {
                let a = s / sum;
                for (ov, &vv) in oh.iter_mut().zip(&vc[u * d + h * dh..][..dh]) {
                    *ov += a * vv;
                }
            }
        }
    }
}

/// `x [n, in] · wᵀ` for `w [out, in]`, on candle's GEMM.
fn matmul(x: &[f32], n: usize, w: &Tensor) -> Result<Vec<f32>> {
    let k = w.dim(1)?;
    let xt = Tensor::from_slice(x, (n, k), &CDevice::Cpu)?;
    Ok(xt.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()?)
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// A dot product with eight independent accumulators (vectorises without reassociating a
/// single sum).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Layer norm of each row of `x` (rows of `d`) into `y`.
fn layer_norm_rows(x: &[f32], y: &mut [f32], d: usize, weight: &[f32], bias: &[f32]) {
    for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let mean = xr.iter().sum::<f32>() / d as f32;
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + LN_EPS).sqrt();
        for (((o, &v), &g), &b) in yr.iter_mut().zip(xr).zip(weight).zip(bias) {
            *o = (v - mean) * inv * g + b;
        }
    }
}

/// The `f32` values of a `bf16` tensor, refused (named) when one is not finite.
fn upcast(weights: &WeightSet, name: &str) -> Result<Vec<f32>> {
    let src = weights.view::<bf16>(name)?;
    let mut out = Vec::with_capacity(src.len());
    for (i, v) in src.iter().enumerate() {
        let f = v.to_f32();
        if !f.is_finite() {
            return Err(Error::Runtime(refit_runtime::Error::Strategy(format!(
                "tensor `{name}` of model `{}` version {}: element {i} is {f}, not finite",
                weights.model(),
                weights.version()
            ))));
        }
        out.push(f);
    }
    Ok(out)
}

fn matrix(weights: &WeightSet, name: &str) -> Result<Tensor> {
    let spec = weights
        .manifest()
        .get(name)
        .ok_or_else(|| refit_runtime::Error::NoSuchTensor(name.into()))?;
    let shape = spec.shape.clone();
    Ok(Tensor::from_vec(
        upcast(weights, name)?,
        shape.as_slice(),
        &CDevice::Cpu,
    )?)
}

impl Generator for TransformerGenerator {
    type Weights = ServingWeights;
    type Cache = KvCache;

    fn manifest(&self) -> Arc<Manifest> {
        Arc::clone(&self.manifest)
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }

    fn max_context(&self) -> usize {
        self.cfg.context
    }

    fn stage(&self, weights: &WeightSet) -> Result<ServingWeights> {
        self.manifest
            .check_same_schema(weights.model(), weights.manifest())?;
        let pool = Arc::clone(&self.pool);
        pool.install(|| {
            let vec = |n: &str| upcast(weights, n);
            let blocks = (0..self.cfg.layers)
                .into_par_iter()
                .map(|i| {
                    let n = |s: &str| format!("blocks.{i}.{s}");
                    Ok(ServingBlock {
                        ln1: (vec(&n("ln1.weight"))?, vec(&n("ln1.bias"))?),
                        qkv: matrix(weights, &n("attn.qkv.weight"))?,
                        o: matrix(weights, &n("attn.o.weight"))?,
                        ln2: (vec(&n("ln2.weight"))?, vec(&n("ln2.bias"))?),
                        fc: matrix(weights, &n("mlp.fc.weight"))?,
                        proj: matrix(weights, &n("mlp.proj.weight"))?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(ServingWeights {
                tok_emb: vec("tok_emb.weight")?,
                pos_emb: vec("pos_emb.weight")?,
                blocks,
                ln_f: (vec("ln_f.weight")?, vec("ln_f.bias")?),
                head: matrix(weights, "head.weight")?,
            })
        })
    }

    fn export(&self, weights: &ServingWeights, out: &mut WeightSet) -> Result<()> {
        self.manifest
            .check_same_schema(out.model(), out.manifest())?;
        let mut put = |name: &str, values: &[f32]| -> Result<()> {
            let dst = out.view_mut::<bf16>(name)?;
            if dst.len() != values.len() {
                return Err(Error::Config(format!(
                    "tensor `{name}`: {} values served, {} in the layout",
                    values.len(),
                    dst.len()
                )));
            }
            for (d, v) in dst.iter_mut().zip(values) {
                *d = bf16::from_f32(*v);
            }
            Ok(())
        };
        let flat = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
        put("tok_emb.weight", &weights.tok_emb)?;
        put("pos_emb.weight", &weights.pos_emb)?;
        for (i, b) in weights.blocks.iter().enumerate() {
            let n = |s: &str| format!("blocks.{i}.{s}");
            put(&n("ln1.weight"), &b.ln1.0)?;
            put(&n("ln1.bias"), &b.ln1.1)?;
            put(&n("attn.qkv.weight"), &flat(&b.qkv)?)?;
            put(&n("attn.o.weight"), &flat(&b.o)?)?;
            put(&n("ln2.weight"), &b.ln2.0)?;
            put(&n("ln2.bias"), &b.ln2.1)?;
            put(&n("mlp.fc.weight"), &flat(&b.fc)?)?;
            put(&n("mlp.proj.weight"), &flat(&b.proj)?)?;
        }
        put("ln_f.weight", &weights.ln_f.0)?;
        put("ln_f.bias", &weights.ln_f.1)?;
        put("head.weight", &flat(&weights.head)?)
    }

    fn new_cache(&self) -> KvCache {
        KvCache::default()
    }

    fn forward(
        &mut self,
        weights: &ServingWeights,
        inputs: &mut [StepInput<'_, KvCache>],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        logits.clear();
        if inputs.is_empty() {
            return Ok(());
        }
        let pool = Arc::clone(&self.pool);
        pool.install(|| self.forward_on_pool(weights, inputs, logits))
    }
}
