//! The reference of the KL term, and the generated tokens of a batch as rows of one forward.

use candle_core::{D, Tensor};
use refit_runtime::WeightSet;

use crate::batch::Sequence;
use crate::error::{Error, Result};
use crate::transformer::{Grad, Transformer, TransformerConfig};

// ANCHOR: reference
/// Where the KL term's reference log-probabilities come from: a frozen copy of the policy
/// ([`FrozenReference`]), or a reference model served elsewhere.
pub trait Reference: Send {
    /// The log-probability of every generated token of every sequence (one vector per
    /// sequence, one value per token), of `softmax(logits / temperature)`.
    ///
    /// # Errors
    /// A reference that cannot score the sequences.
    fn logprobs(&mut self, seqs: &[&Sequence], temperature: f32) -> Result<Vec<Vec<f32>>>;
}
// ANCHOR_END: reference

/// A reference model held by the learner: a transformer whose weights never train.
#[derive(Debug)]
pub struct FrozenReference {
    model: Transformer,
}

impl FrozenReference {
    /// A reference with `weights` (trainer layout of `cfg`).
    ///
    /// # Errors
    /// A weight set of another layout, naming the tensor.
    pub fn new(cfg: TransformerConfig, weights: &WeightSet) -> Result<Self> {
        Ok(Self {
            model: Transformer::from_weights(cfg, weights)?,
        })
    }
}

impl Reference for FrozenReference {
    fn logprobs(&mut self, seqs: &[&Sequence], temperature: f32) -> Result<Vec<Vec<f32>>> {
        let rows = TokenRows::new(&self.model, seqs)?;
        let lp = rows.logprobs(&self.model, Grad::Detached, temperature)?.0;
        Ok(rows.split(&lp.to_vec1::<f32>()?))
    }
}

// ANCHOR: served
/// A reference model the engines serve beside the policy: its log-probabilities arrive on
/// the sequences ([`Sequence::ref_logprobs`]), scored by the engine when the completion was
/// generated, so the learner holds no second model and runs no second forward.
#[derive(Clone, Copy, Debug, Default)]
pub struct ServedReference;

impl Reference for ServedReference {
    /// The sequences' own reference log-probabilities (scored at the sampling temperature,
    /// which is the learner's: `temperature` is not used).
    ///
    /// # Errors
    /// [`Error::Trainer`] naming the sequence that carries none, or not one per token.
    fn logprobs(&mut self, seqs: &[&Sequence], _temperature: f32) -> Result<Vec<Vec<f32>>> {
        seqs.iter()
            .enumerate()
            .map(|(i, s)| match &s.ref_logprobs {
                Some(lp) if lp.len() == s.tokens.len() => Ok(lp.clone()),
                Some(lp) => Err(Error::Trainer(format!(
                    "sequence {i} (group {}) carries {} reference log-probabilities for {} \
                     tokens",
                    s.group,
                    lp.len(),
                    s.tokens.len()
                ))),
                None => Err(Error::Trainer(format!(
                    "sequence {i} (group {}) carries no reference log-probabilities: the KL \
                     term reads a served reference, and the rollout workers did not score \
                     under one",
                    s.group
                ))),
            })
            .collect()
    }
}
// ANCHOR_END: served

/// The generated tokens of a set of sequences as rows of one padded forward.
pub(super) struct TokenRows {
    ids: Tensor,
    /// Row of the logits predicting each generated token, flattened over the sequences.
    rows: Tensor,
    /// The generated tokens, flattened.
    targets: Tensor,
    /// Tokens per sequence.
    lens: Vec<usize>,
}

impl TokenRows {
    pub(super) fn new(model: &Transformer, seqs: &[&Sequence]) -> Result<Self> {
        if let Some(i) = seqs.iter().position(|s| s.prompt.is_empty()) {
            return Err(Error::Trainer(format!("sequence {i} has an empty prompt")));
        }
        // Each sequence runs on its prompt and all its tokens but the last (nothing is
        // predicted after it).
        let inputs: Vec<Vec<u32>> = seqs
            .iter()
            .map(|s| {
                let mut v = s.prompt.clone();
                v.extend_from_slice(&s.tokens[..s.tokens.len().saturating_sub(1)]);
                v
            })
            .collect();
        let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
        let ids = model.pad(&refs)?;
        let t = ids.dim(1)?;
        let mut rows = Vec::new();
        let mut targets = Vec::new();
        for (b, s) in seqs.iter().enumerate() {
            for (k, &tok) in s.tokens.iter().enumerate() {
                rows.push((b * t + s.prompt.len() - 1 + k) as u32);
                targets.push(tok);
            }
        }
        let dev = model.device();
        let n = rows.len();
        Ok(Self {
            ids,
            rows: Tensor::from_vec(rows, n, dev)?,
            targets: Tensor::from_vec(targets, (n, 1), dev)?,
            lens: seqs.iter().map(|s| s.tokens.len()).collect(),
        })
    }

    /// Log-probabilities of the generated tokens `[n]` and the log-softmax rows `[n, vocab]`.
    pub(super) fn logprobs(
        &self,
        model: &Transformer,
        grad: Grad,
        temperature: f32,
    ) -> Result<(Tensor, Tensor)> {
        let logits = model
            .forward(&self.ids, grad)?
            .index_select(&self.rows, 0)?;
        let logits = if temperature == 1.0 {
            logits
        } else {
            (logits / f64::from(temperature))?
        };
        let all = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let lp = all.gather(&self.targets, 1)?.squeeze(1)?;
        Ok((lp, all))
    }

    pub(super) fn split(&self, flat: &[f32]) -> Vec<Vec<f32>> {
        let mut out = Vec::with_capacity(self.lens.len());
        let mut at = 0;
        for &n in &self.lens {
            out.push(flat[at..at + n].to_vec());
            at += n;
        }
        out
    }
}
