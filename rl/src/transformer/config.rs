//! The shape of a GPT-style transformer, its two weight layouts (the trainer's and the
//! generator's) and the conversion between them, and a cheap seeded initialisation.

use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use refit_runtime::cast::CastTo;
use refit_runtime::{
    CastRules, Conversion, DType, LayoutRules, Manifest, ModelId, Want, WeightSet,
};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Epsilon of every layer norm (trainer and generator).
pub const LN_EPS: f32 = 1e-5;

/// The shape of a GPT-style decoder: learned token and position embeddings, `layers` pre-norm
/// blocks (multi-head causal self-attention, then a GELU MLP), a final layer norm and an
/// untied output head. Linear layers have no bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransformerConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (prompt plus completion): the rows of the position embedding.
    pub context: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of blocks.
    pub layers: usize,
    /// Attention heads per block (`d_model` must be a multiple).
    pub heads: usize,
    /// Width of the MLP's hidden layer, in multiples of `d_model`.
    pub mlp_ratio: usize,
}

impl TransformerConfig {
    /// A small model for `vocab` tokens and sequences of `context`: `d_model` 64, 2 layers, 4
    /// heads, MLP ratio 4 (about 10^5 parameters).
    pub fn small(vocab: usize, context: usize) -> Self {
        Self {
            vocab,
            context,
            d_model: 64,
            layers: 2,
            heads: 4,
            mlp_ratio: 4,
        }
    }

    /// A model of about `bytes` bytes of f32 trainer weights (for weight-sync measurements):
    /// `d_model` 1024 with 16 heads from 64 MiB (2048 from 4 GiB), below that 256 (from
    /// 8 MiB) or 128 with heads of 64, so that small sizes are reached too (one block of
    /// width 1024 alone is 50 MB); MLP ratio 4, as many layers as it takes (at least 1).
    pub fn of_bytes(bytes: usize, vocab: usize, context: usize) -> Self {
        let (d_model, heads) = match bytes {
            b if b >= 4 << 30 => (2048, 16),
            b if b >= 64 << 20 => (1024, 16),
            b if b >= 8 << 20 => (256, 4),
            _ => (128, 2),
        };
        let mut cfg = Self {
            vocab,
            context,
            d_model,
            layers: 1,
            heads,
            mlp_ratio: 4,
        };
        let fixed = cfg.params() - cfg.block_params();
        let want = (bytes / 4).saturating_sub(fixed);
        cfg.layers = want.div_ceil(cfg.block_params()).max(1);
        cfg
    }

    /// Checks the sizes.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field that is zero, or `heads` when it does not divide
    /// `d_model`.
    pub fn check(&self) -> Result<()> {
        Error::check_positive(
            "transformer",
            &[
                ("vocab", self.vocab),
                ("context", self.context),
                ("d_model", self.d_model),
                ("layers", self.layers),
                ("heads", self.heads),
                ("mlp_ratio", self.mlp_ratio),
            ],
        )?;
        Error::check_divides(
            "transformer",
            ("heads", self.heads),
            ("d_model", self.d_model),
        )?;
        if self.vocab > u32::MAX as usize {
            return Err(Error::Config(format!(
                "transformer vocab {} does not fit token ids (u32)",
                self.vocab
            )));
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    /// Width of the MLP's hidden layer.
    pub fn mlp_dim(&self) -> usize {
        self.d_model * self.mlp_ratio
    }

    fn block_params(&self) -> usize {
        let d = self.d_model;
        4 * d + 4 * d * d + 2 * d * self.mlp_dim()
    }

    /// Number of parameters.
    pub fn params(&self) -> usize {
        let d = self.d_model;
        2 * self.vocab * d + self.context * d + 2 * d + self.layers * self.block_params()
    }

    /// The trainer's layout: every tensor `f32`, linear weights `[out, in]`:
    ///
    /// | name | shape |
    /// |---|---|
    /// | `tok_emb.weight` | `[vocab, d]` |
    /// | `pos_emb.weight` | `[context, d]` |
    /// | `blocks.{i}.ln1.weight`, `blocks.{i}.ln1.bias` | `[d]` |
    /// | `blocks.{i}.attn.q.weight`, `.k.`, `.v.`, `.o.` | `[d, d]` |
    /// | `blocks.{i}.ln2.weight`, `blocks.{i}.ln2.bias` | `[d]` |
    /// | `blocks.{i}.mlp.fc.weight` | `[mlp, d]` |
    /// | `blocks.{i}.mlp.proj.weight` | `[d, mlp]` |
    /// | `ln_f.weight`, `ln_f.bias` | `[d]` |
    /// | `head.weight` | `[vocab, d]` |
    ///
    /// # Errors
    /// [`Error::Config`] from [`TransformerConfig::check`]; a manifest that overflows.
    pub fn trainer_manifest(&self) -> Result<Manifest> {
        self.check()?;
        let (d, m, v) = (self.d_model, self.mlp_dim(), self.vocab);
        let mut b = Manifest::builder();
        b.push("tok_emb.weight", DType::F32, &[v, d]);
        b.push("pos_emb.weight", DType::F32, &[self.context, d]);
        for i in 0..self.layers {
            b.push(format!("blocks.{i}.ln1.weight"), DType::F32, &[d]);
            b.push(format!("blocks.{i}.ln1.bias"), DType::F32, &[d]);
            for p in ["q", "k", "v", "o"] {
                b.push(format!("blocks.{i}.attn.{p}.weight"), DType::F32, &[d, d]);
            }
            b.push(format!("blocks.{i}.ln2.weight"), DType::F32, &[d]);
            b.push(format!("blocks.{i}.ln2.bias"), DType::F32, &[d]);
            b.push(format!("blocks.{i}.mlp.fc.weight"), DType::F32, &[m, d]);
            b.push(format!("blocks.{i}.mlp.proj.weight"), DType::F32, &[d, m]);
        }
        b.push("ln_f.weight", DType::F32, &[d]);
        b.push("ln_f.bias", DType::F32, &[d]);
        b.push("head.weight", DType::F32, &[v, d]);
        Ok(b.build()?)
    }

    // ANCHOR: want
    /// What a [`TransformerGenerator`](super::TransformerGenerator) wants of the trainer's
    /// layout: `q`, `k` and `v` of each block fused along the output axis into
    /// `blocks.{i}.attn.qkv.weight` `[3d, d]` (layout rules), then every tensor cast to
    /// `bf16` (cast rules). The other names are kept.
    pub fn want() -> Want {
        Want::new()
            .layout(
                LayoutRules::new()
                    .fuse(
                        [
                            "blocks.{i}.attn.q.weight",
                            "blocks.{i}.attn.k.weight",
                            "blocks.{i}.attn.v.weight",
                        ],
                        "blocks.{i}.attn.qkv.weight",
                        0,
                    )
                    .keep_unmatched(),
            )
            .cast(CastRules::new().dtype(DType::F32, CastTo::BF16))
    }
    // ANCHOR_END: want

    /// The conversion from the trainer's layout to the generator's ([`TransformerConfig::want`]
    /// planned against [`TransformerConfig::trainer_manifest`]).
    ///
    /// # Errors
    /// As [`TransformerConfig::trainer_manifest`]; the layout or cast error of the plan.
    pub fn conversion(&self) -> Result<Conversion> {
        let source = Arc::new(self.trainer_manifest()?);
        Ok(Conversion::new(&source, &Self::want())?)
    }

    /// The generator's layout: the trainer's after [`TransformerConfig::want`] (fused
    /// `blocks.{i}.attn.qkv.weight` `[3d, d]`, everything `bf16`).
    ///
    /// # Errors
    /// As [`TransformerConfig::conversion`].
    pub fn generator_manifest(&self) -> Result<Arc<Manifest>> {
        Ok(Arc::clone(self.conversion()?.target()))
    }

    /// A freshly initialised model in the trainer's layout (version 0), written straight
    /// into the arena: linear weights and embeddings uniform with standard deviation 0.02
    /// (output projections of the blocks scaled by `1 / sqrt(2 layers)`, GPT-2's rule), layer
    /// norms weight 1, bias 0. Cheap enough for models of gigabytes (one pass of a fast
    /// generator per tensor).
    ///
    /// # Errors
    /// As [`TransformerConfig::trainer_manifest`].
    pub fn init_weights(&self, model: ModelId, seed: u64) -> Result<WeightSet> {
        let manifest = Arc::new(self.trainer_manifest()?);
        let mut ws = WeightSet::zeroed(model, Arc::clone(&manifest));
        let resid = 0.02 / ((2 * self.layers) as f32).sqrt();
        for (t, spec) in manifest.tensors().iter().enumerate() {
            let name = spec.name.as_str();
            let out = ws.view_mut::<f32>(name)?;
            if spec.shape.len() == 1 {
                // A layer norm: weight 1, bias 0 (already zeroed).
                if name.ends_with(".weight") {
                    out.fill(1.0);
                }
                continue;
            }
            let std = if name.ends_with("attn.o.weight") || name.ends_with("mlp.proj.weight") {
                resid
            } else {
                0.02
            };
            fill_uniform(
                out,
                std,
                seed ^ (t as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
        }
        Ok(ws)
    }
}

/// Fills `out` with values uniform in `[-a, a)`, `a = std * sqrt(3)` (standard deviation
/// `std`), from a generator seeded with `seed`.
fn fill_uniform(out: &mut [f32], std: f32, seed: u64) {
    let a = std * 3f32.sqrt();
    let scale = 2.0 * a / (1u64 << 24) as f32;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut pairs = out.chunks_exact_mut(2);
    for pair in &mut pairs {
        let r: u64 = rng.random();
        pair[0] = (r >> 40) as f32 * scale - a;
        pair[1] = ((r >> 8) & 0xff_ffff) as f32 * scale - a;
    }
    for v in pairs.into_remainder() {
        let r: u64 = rng.random();
        *v = (r >> 40) as f32 * scale - a;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked_and_named() {
        let ok = TransformerConfig::small(13, 16);
        assert!(ok.check().is_ok());
        let e = TransformerConfig { heads: 5, ..ok }.check().unwrap_err();
        assert!(
            e.to_string()
                .contains("transformer heads (5) must divide d_model"),
            "{e}"
        );
        let e = TransformerConfig { layers: 0, ..ok }.check().unwrap_err();
        assert!(e.to_string().contains("layers"), "{e}");
    }

    #[test]
    fn the_manifest_counts_every_parameter() {
        let c = TransformerConfig::small(13, 16);
        let m = c.trainer_manifest().unwrap();
        let n: usize = m.tensors().iter().map(|t| t.numel()).sum();
        assert_eq!(n, c.params());
        assert!((50_000..200_000).contains(&n), "{n}");
        assert_eq!(m.len(), 2 + c.layers * 10 + 3);
    }

    #[test]
    fn the_generator_layout_fuses_qkv_in_bf16() {
        let c = TransformerConfig::small(13, 16);
        let g = c.generator_manifest().unwrap();
        let qkv = g.get("blocks.1.attn.qkv.weight").unwrap();
        assert_eq!((qkv.dtype, qkv.shape.clone()), (DType::BF16, vec![192, 64]));
        assert!(g.get("blocks.1.attn.q.weight").is_none());
        assert!(g.tensors().iter().all(|t| t.dtype == DType::BF16));
        assert_eq!(g.len(), 2 + c.layers * 8 + 3);
    }

    #[test]
    fn init_is_seeded_and_scaled() {
        let c = TransformerConfig::small(13, 16);
        let id = ModelId::new("m").unwrap();
        let a = c.init_weights(id.clone(), 1).unwrap();
        let b = c.init_weights(id.clone(), 1).unwrap();
        let z = c.init_weights(id, 2).unwrap();
        assert_eq!(a.bytes(), b.bytes());
        assert_ne!(a.bytes(), z.bytes());
        let w = a.view::<f32>("blocks.0.mlp.fc.weight").unwrap();
        let var = w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32;
        assert!((var.sqrt() - 0.02).abs() < 0.002, "{}", var.sqrt());
        assert!(
            a.view::<f32>("ln_f.weight")
                .unwrap()
                .iter()
                .all(|&x| x == 1.0)
        );
        assert!(
            a.view::<f32>("ln_f.bias")
                .unwrap()
                .iter()
                .all(|&x| x == 0.0)
        );
    }

    #[test]
    fn of_bytes_reaches_the_size() {
        let c = TransformerConfig::of_bytes(1 << 30, 32, 64);
        assert!(c.check().is_ok());
        let bytes = c.params() * 4;
        assert!(
            ((1 << 30)..(1 << 30) + (60 << 20)).contains(&bytes),
            "{bytes}"
        );
        // small sizes too: at least the size, within one block of it
        for want in [1 << 20, 2 << 20, 16 << 20, 100 << 20] {
            let c = TransformerConfig::of_bytes(want, 64, 64);
            assert!(c.check().is_ok(), "{want}: {c:?}");
            let bytes = c.params() * 4;
            let block = c.block_params() * 4;
            assert!(
                bytes >= want && bytes < want + block,
                "{want}: {bytes} ({c:?})"
            );
            assert!(bytes < want * 2, "{want}: {bytes} ({c:?})");
        }
    }
}
