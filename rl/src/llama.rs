//! The weight layout of a Llama decoder as Hugging Face's `LlamaForCausalLM` names it: what
//! a model of `arch = "llama"` is trained and served in. Refit holds no Llama of its own:
//! a Python learner (`refit.trainer`, on `transformers`) trains it and Python engines (vLLM)
//! serve it; this layout is what they agree on before the run, derived from the model's
//! params on every rank, so that no rank has to ask another what it holds.

use refit_runtime::{DType, Manifest};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The shape of a Llama decoder: token embeddings, `layers` pre-norm blocks (RMSNorm,
/// grouped-query attention with rotary positions, a SwiGLU MLP), a final RMSNorm and an
/// untied head; no biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LlamaShape {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence the task needs (prompt and answer); the engines' config may allow
    /// longer ones (rotary positions need no table).
    pub context: usize,
    /// Width of the residual stream (`hidden_size`).
    pub d_model: usize,
    /// Number of blocks.
    pub layers: usize,
    /// Query heads per block (`d_model` must be a multiple).
    pub heads: usize,
    /// Key and value heads per block (`heads` must be a multiple).
    pub kv_heads: usize,
    /// Width of the MLP's hidden layer (`intermediate_size`).
    pub intermediate: usize,
}

impl LlamaShape {
    /// Checks the sizes.
    ///
    /// # Errors
    /// [`Error::Config`] naming the size that is zero, or the heads that do not divide.
    pub fn check(&self) -> Result<()> {
        Error::check_positive(
            "llama",
            &[
                ("vocab", self.vocab),
                ("context", self.context),
                ("d_model", self.d_model),
                ("layers", self.layers),
                ("heads", self.heads),
                ("kv_heads", self.kv_heads),
                ("intermediate", self.intermediate),
            ],
        )?;
        Error::check_divides("llama", ("heads", self.heads), ("d_model", self.d_model))?;
        Error::check_divides("llama", ("kv_heads", self.kv_heads), ("heads", self.heads))?;
        Ok(())
    }

    /// The `f32` state dict of `LlamaForCausalLM` of this shape, in its order: what the
    /// learner exports and the engines load, under the names both use.
    ///
    /// # Errors
    /// As [`LlamaShape::check`].
    pub fn manifest(&self) -> Result<Manifest> {
        self.check()?;
        let (d, v, m) = (self.d_model, self.vocab, self.intermediate);
        let kv = d / self.heads * self.kv_heads;
        let mut b = Manifest::builder();
        b.push("model.embed_tokens.weight", DType::F32, &[v, d]);
        for i in 0..self.layers {
            let at = format!("model.layers.{i}");
            for (name, shape) in [
                ("self_attn.q_proj.weight", [d, d]),
                ("self_attn.k_proj.weight", [kv, d]),
                ("self_attn.v_proj.weight", [kv, d]),
                ("self_attn.o_proj.weight", [d, d]),
                ("mlp.gate_proj.weight", [m, d]),
                ("mlp.up_proj.weight", [m, d]),
                ("mlp.down_proj.weight", [d, m]),
            ] {
                b.push(format!("{at}.{name}"), DType::F32, &shape);
            }
            b.push(format!("{at}.input_layernorm.weight"), DType::F32, &[d]);
            b.push(
                format!("{at}.post_attention_layernorm.weight"),
                DType::F32,
                &[d],
            );
        }
        b.push("model.norm.weight", DType::F32, &[d]);
        b.push("lm_head.weight", DType::F32, &[v, d]);
        Ok(b.build()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> LlamaShape {
        LlamaShape {
            vocab: 14,
            context: 12,
            d_model: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate: 128,
        }
    }

    #[test]
    fn the_manifest_is_the_state_dict_of_llama_for_causal_lm() {
        let m = shape().manifest().unwrap();
        // 1 embedding, 9 tensors per block, the final norm and the head
        assert_eq!(m.tensors().len(), 1 + 2 * 9 + 2);
        let of = |name: &str| {
            m.tensors()
                .iter()
                .find(|t| t.name == name)
                .unwrap()
                .shape
                .clone()
        };
        assert_eq!(of("model.embed_tokens.weight"), vec![14, 64]);
        assert_eq!(of("model.layers.1.self_attn.k_proj.weight"), vec![32, 64]);
        assert_eq!(of("model.layers.0.mlp.down_proj.weight"), vec![64, 128]);
        assert_eq!(of("lm_head.weight"), vec![14, 64]);
        assert!(m.tensors().iter().all(|t| t.dtype == DType::F32));
    }

    #[test]
    fn sizes_that_do_not_divide_are_named() {
        let e = LlamaShape {
            heads: 5,
            ..shape()
        }
        .check()
        .unwrap_err();
        assert!(e.to_string().contains("heads (5)"), "{e}");
        let e = LlamaShape {
            kv_heads: 3,
            ..shape()
        }
        .check()
        .unwrap_err();
        assert!(e.to_string().contains("kv_heads (3)"), "{e}");
        let e = LlamaShape {
            layers: 0,
            ..shape()
        }
        .check()
        .unwrap_err();
        assert!(e.to_string().contains("layers"), "{e}");
    }
}
