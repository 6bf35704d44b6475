//! The trainer's side of the transformer: `f32` candle variables in the trainer's layout
//! (separate `q`, `k`, `v`), a full causal forward over padded batches with autograd, and
//! export into / load from a [`WeightSet`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use candle_core::{Device as CDevice, Tensor, Var};
use refit_runtime::{Manifest, ModelId, WeightSet};

use super::config::{LN_EPS, TransformerConfig};
use super::ops::{FastGelu, SoftmaxLast};
use crate::error::{Error, Result};
use crate::generation::Token;

struct Block {
    ln1: (Var, Var),
    q: Var,
    k: Var,
    v: Var,
    o: Var,
    ln2: (Var, Var),
    fc: Var,
    proj: Var,
}

/// A GPT-style transformer as candle variables (`f32`, CPU), in the layout of
/// [`TransformerConfig::trainer_manifest`].
pub struct Transformer {
    cfg: TransformerConfig,
    manifest: Arc<Manifest>,
    /// Every parameter, in manifest order.
    vars: Vec<Var>,
    tok_emb: Var,
    pos_emb: Var,
    blocks: Vec<Block>,
    ln_f: (Var, Var),
    head: Var,
    dev: CDevice,
}

impl fmt::Debug for Transformer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transformer")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// Which weights a forward reads: the variables (gradients flow to them) or detached copies
/// of them (no graph is built: proximal and reference log-probabilities).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grad {
    /// Gradients flow to the variables.
    Track,
    /// No graph.
    Detached,
}

impl Transformer {
    /// A freshly initialised model ([`TransformerConfig::init_weights`] with `seed`).
    ///
    /// # Errors
    /// Bad sizes ([`Error::Config`]); candle errors.
    pub fn new(cfg: TransformerConfig, seed: u64) -> Result<Self> {
        let model = ModelId::new("init")?;
        Self::from_weights(cfg, &cfg.init_weights(model, seed)?)
    }

    /// A model holding `weights` (of the trainer's layout).
    ///
    /// # Errors
    /// A weight set of another layout (naming the tensor); candle errors.
    pub fn from_weights(cfg: TransformerConfig, weights: &WeightSet) -> Result<Self> {
        let manifest = Arc::new(cfg.trainer_manifest()?);
        manifest.check_same_schema(weights.model(), weights.manifest())?;
        let dev = CDevice::Cpu;
        let mut vars = Vec::with_capacity(manifest.len());
        let mut by_name = HashMap::with_capacity(manifest.len());
        for spec in manifest.tensors() {
            let t = Tensor::from_slice(
                weights.view::<f32>(&spec.name)?,
                spec.shape.as_slice(),
                &dev,
            )?;
            let var = Var::from_tensor(&t)?;
            by_name.insert(spec.name.clone(), var.clone());
            vars.push(var);
        }
        let get = |name: &str| -> Result<Var> {
            by_name
                .get(name)
                .cloned()
                .ok_or_else(|| Error::Trainer(format!("transformer has no tensor `{name}`")))
        };
        let blocks = (0..cfg.layers)
            .map(|i| {
                let n = |s: &str| get(&format!("blocks.{i}.{s}"));
                Ok(Block {
                    ln1: (n("ln1.weight")?, n("ln1.bias")?),
                    q: n("attn.q.weight")?,
                    k: n("attn.k.weight")?,
                    v: n("attn.v.weight")?,
                    o: n("attn.o.weight")?,
                    ln2: (n("ln2.weight")?, n("ln2.bias")?),
                    fc: n("mlp.fc.weight")?,
                    proj: n("mlp.proj.weight")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            tok_emb: get("tok_emb.weight")?,
            pos_emb: get("pos_emb.weight")?,
            ln_f: (get("ln_f.weight")?, get("ln_f.bias")?),
            head: get("head.weight")?,
            blocks,
            vars,
            manifest,
            cfg,
            dev,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &TransformerConfig {
        &self.cfg
    }

    /// The trainer's layout.
    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.manifest
    }

    /// Every parameter, in manifest order (what an optimiser steps).
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The candle device (CPU).
    pub fn device(&self) -> &CDevice {
        &self.dev
    }

    /// Next-token logits at every position of a `[batch, time]` tensor of token ids
    /// (`u32`), as `[batch * time, vocab]` (row `b * time + t` predicts token `t + 1` of
    /// sequence `b`). Attention is causal, so right padding changes no earlier row.
    ///
    /// # Errors
    /// [`Error::Trainer`] when `time` exceeds the context; candle errors (a token outside
    /// the vocabulary among them).
    pub fn forward(&self, ids: &Tensor, grad: Grad) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        if t > self.cfg.context {
            return Err(Error::Trainer(format!(
                "sequences of {t} tokens exceed the context of {}",
                self.cfg.context
            )));
        }
        let w = |v: &Var| match grad {
            Grad::Track => v.as_tensor().clone(),
            Grad::Detached => v.as_tensor().detach(),
        };
        let (d, h, dh) = (self.cfg.d_model, self.cfg.heads, self.cfg.head_dim());
        let x = w(&self.tok_emb).index_select(&ids.flatten_all()?, 0)?;
        let pos = w(&self.pos_emb).narrow(0, 0, t)?;
        let mut x = x
            .reshape((b, t, d))?
            .broadcast_add(&pos)?
            .reshape((b * t, d))?;
        let mask = causal_mask(t, &self.dev)?;
        let scale = 1.0 / (dh as f64).sqrt();
        let heads = |m: Tensor| -> Result<Tensor> {
            Ok(m.reshape((b, t, h, dh))?.transpose(1, 2)?.contiguous()?)
        };
        for blk in &self.blocks {
            let y = layer_norm(&x, &w(&blk.ln1.0), &w(&blk.ln1.1))?;
            let q = heads(linear(&y, &w(&blk.q))?)?;
            let k = heads(linear(&y, &w(&blk.k))?)?;
            let v = heads(linear(&y, &w(&blk.v))?)?;
            let att = (q.matmul(&k.t()?.contiguous()?)? * scale)?.broadcast_add(&mask)?;
            let att = att.apply_op1(SoftmaxLast)?;
            let y = att
                .matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b * t, d))?;
            x = (x + linear(&y, &w(&blk.o))?)?;
            let y = layer_norm(&x, &w(&blk.ln2.0), &w(&blk.ln2.1))?;
            let y = linear(
                &linear(&y, &w(&blk.fc))?.apply_op1(FastGelu)?,
                &w(&blk.proj),
            )?;
            x = (x + y)?;
        }
        let y = layer_norm(&x, &w(&self.ln_f.0), &w(&self.ln_f.1))?;
        linear(&y, &w(&self.head))
    }

    /// The `[batch, time]` ids of `seqs`, right-padded with token 0 to the longest.
    ///
    /// # Errors
    /// [`Error::Trainer`] for an empty batch; candle errors.
    pub fn pad(&self, seqs: &[&[Token]]) -> Result<Tensor> {
        let t = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        if t == 0 {
            return Err(Error::Trainer("no tokens to run the transformer on".into()));
        }
        let mut ids = vec![0u32; seqs.len() * t];
        for (row, s) in ids.chunks_exact_mut(t).zip(seqs) {
            row[..s.len()].copy_from_slice(s);
        }
        Ok(Tensor::from_vec(ids, (seqs.len(), t), &self.dev)?)
    }

    /// Next-token logits of one sequence at each of its positions (`len * vocab` values),
    /// without a graph (tests and evaluation).
    ///
    /// # Errors
    /// As [`Transformer::forward`].
    pub fn logits(&self, tokens: &[Token]) -> Result<Vec<f32>> {
        let ids = self.pad(&[tokens])?;
        Ok(self
            .forward(&ids, Grad::Detached)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// Writes every parameter into `out` (a weight set of the trainer's layout).
    ///
    /// # Errors
    /// A weight set of another layout, naming the tensor; a read-only one.
    pub fn write_weights(&self, out: &mut WeightSet) -> Result<()> {
        self.manifest
            .check_same_schema(out.model(), out.manifest())?;
        for (spec, var) in self.manifest.tensors().iter().zip(&self.vars) {
            let values = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            out.view_mut::<f32>(&spec.name)?.copy_from_slice(&values);
        }
        Ok(())
    }

    /// Exports the parameters as a weight set of `model` (version 0; the caller stamps it).
    ///
    /// # Errors
    /// As [`Transformer::write_weights`].
    pub fn export(&self, model: ModelId) -> Result<WeightSet> {
        let mut ws = WeightSet::zeroed(model, Arc::clone(&self.manifest));
        self.write_weights(&mut ws)?;
        Ok(ws)
    }

    /// Replaces every parameter with `weights` (trainer layout), all or nothing.
    ///
    /// # Errors
    /// A weight set of another layout, naming the tensor; candle errors.
    pub fn load(&mut self, weights: &WeightSet) -> Result<()> {
        self.manifest
            .check_same_schema(weights.model(), weights.manifest())?;
        let staged = self
            .manifest
            .tensors()
            .iter()
            .map(|spec| {
                Ok(Tensor::from_slice(
                    weights.view::<f32>(&spec.name)?,
                    spec.shape.as_slice(),
                    &self.dev,
                )?)
            })
            .collect::<Result<Vec<_>>>()?;
        for (var, t) in self.vars.iter().zip(staged) {
            var.set(&t)?;
        }
        Ok(())
    }
}

/// `x [n, in] · wᵀ` for a weight `[out, in]`.
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&w.t()?)?)
}

/// Layer norm over the last axis of `x [n, d]`.
fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let mean = x.mean_keepdim(1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(1)?;
    let xn = xc.broadcast_div(&(var + f64::from(LN_EPS))?.sqrt()?)?;
    Ok(xn.broadcast_mul(weight)?.broadcast_add(bias)?)
}

/// `[t, t]`: 0 on and below the diagonal, -inf above.
fn causal_mask(t: usize, dev: &CDevice) -> Result<Tensor> {
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(m, (t, t), dev)?)
}
