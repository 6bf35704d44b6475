//! A bigram language model: the smallest [`Generator`]. The next-token logits are one row of
//! a `[vocab, vocab]` table, picked by the last token fed; the table is the model's only
//! weight tensor (`bigram.logits`, f32).
//!
//! It makes an engine's behaviour visible without a transformer: two versions with different
//! tables generate different greedy completions, deterministically, so tests and examples can
//! tell which version produced each token.

use std::sync::Arc;

use refit_runtime::{DType, Manifest, ModelId, Version, WeightSet};

use crate::error::{Error, Result};
use crate::generation::{Generator, StepInput, Token};

/// The name of the bigram table in the weight set.
pub const TABLE: &str = "bigram.logits";

/// A bigram model over `vocab` tokens with a context of `max_context` positions.
#[derive(Debug, Clone)]
pub struct Bigram {
    vocab: usize,
    max_context: usize,
    manifest: Arc<Manifest>,
}

/// A staged version: the table, row-major (`table[prev * vocab + next]`).
#[derive(Debug, Clone, PartialEq)]
pub struct BigramWeights {
    table: Vec<f32>,
}

impl BigramWeights {
    /// The table, row-major.
    pub fn table(&self) -> &[f32] {
        &self.table
    }
}

/// One sequence's state: the last token fed and how many positions are used.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BigramCache {
    /// The last token fed.
    pub last: Option<Token>,
    /// Positions used (prompt plus generated tokens fed so far).
    pub len: usize,
}

impl Bigram {
    /// A model of `vocab` tokens and `max_context` positions.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty vocabulary, one larger than the token type holds, or a
    /// manifest that cannot be built.
    pub fn new(vocab: usize, max_context: usize) -> Result<Self> {
        if vocab == 0 || u32::try_from(vocab).is_err() {
            return Err(Error::Config(format!(
                "a bigram model needs a vocabulary of 1 to {} tokens, not {vocab}",
                u32::MAX
            )));
        }
        let manifest = Manifest::builder()
            .tensor(TABLE, DType::F32, &[vocab, vocab])
            .build()?;
        Ok(Self {
            vocab,
            max_context,
            manifest: Arc::new(manifest),
        })
    }

    /// A weight set of this layout for `model` at `version`, with `logit(prev, next)` in
    /// each cell of the table.
    ///
    /// # Errors
    /// None in practice (the layout is this model's own); typed for the weight-set calls.
    pub fn weight_set(
        &self,
        model: ModelId,
        version: Version,
        logit: impl Fn(Token, Token) -> f32,
    ) -> Result<WeightSet> {
        let mut ws = WeightSet::zeroed(model, Arc::clone(&self.manifest));
        let table = ws.view_mut::<f32>(TABLE)?;
        for (i, cell) in table.iter_mut().enumerate() {
            let (prev, next) = (i / self.vocab, i % self.vocab);
            *cell = logit(prev as Token, next as Token);
        }
        ws.set_version(version);
        Ok(ws)
    }
}

impl Generator for Bigram {
    type Weights = BigramWeights;
    type Cache = BigramCache;

    fn manifest(&self) -> Arc<Manifest> {
        Arc::clone(&self.manifest)
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn stage(&self, weights: &WeightSet) -> Result<BigramWeights> {
        let model = weights.model();
        self.manifest.check_same_schema(model, weights.manifest())?;
        let table = weights.view::<f32>(TABLE)?;
        if let Some((i, v)) = table.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::Generator {
                model: model.to_string(),
                reason: format!(
                    "version {}: tensor `{TABLE}` holds {v} at [{}, {}] (not a finite number)",
                    weights.version(),
                    i / self.vocab,
                    i % self.vocab
                ),
            });
        }
        Ok(BigramWeights {
            table: table.to_vec(),
        })
    }

    fn export(&self, weights: &BigramWeights, out: &mut WeightSet) -> Result<()> {
        self.manifest
            .check_same_schema(out.model(), out.manifest())?;
        let table = out.view_mut::<f32>(TABLE)?;
        if table.len() != weights.table.len() {
            return Err(Error::Config(format!(
                "tensor `{TABLE}`: {} values served, {} in the layout",
                weights.table.len(),
                table.len()
            )));
        }
        table.copy_from_slice(&weights.table);
        Ok(())
    }

    fn new_cache(&self) -> BigramCache {
        BigramCache::default()
    }

    fn forward(
        &mut self,
        weights: &BigramWeights,
        inputs: &mut [StepInput<'_, BigramCache>],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        logits.clear();
        let v = self.vocab;
        for (i, input) in inputs.iter_mut().enumerate() {
            let fail = |reason: String| Error::Generator {
                model: "bigram".into(),
                reason: format!("input {i}: {reason}"),
            };
            let Some(&last) = input.tokens.last() else {
                return Err(fail("no token fed".into()));
            };
            if last as usize >= v {
                return Err(fail(format!(
                    "token {last} is outside the vocabulary of {v}"
                )));
            }
            let len = input.cache.len + input.tokens.len();
            if len > self.max_context {
                return Err(fail(format!(
                    "{len} positions exceed the context of {}",
                    self.max_context
                )));
            }
            input.cache.len = len;
            input.cache.last = Some(last);
            let row = last as usize * v;
            logits.extend_from_slice(&weights.table[row..row + v]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::StepInput;

    #[test]
    fn logits_are_the_row_of_the_last_token() {
        let mut g = Bigram::new(4, 8).unwrap();
        let m = ModelId::new("m").unwrap();
        let ws = g
            .weight_set(m, Version(1), |p, n| (p * 10 + n) as f32)
            .unwrap();
        let w = g.stage(&ws).unwrap();
        let (mut a, mut b) = (g.new_cache(), g.new_cache());
        let mut logits = Vec::new();
        let mut inputs = [
            StepInput {
                cache: &mut a,
                tokens: &[0, 2],
            },
            StepInput {
                cache: &mut b,
                tokens: &[3],
            },
        ];
        g.forward(&w, &mut inputs, &mut logits).unwrap();
        assert_eq!(
            logits,
            [20.0, 21.0, 22.0, 23.0, 30.0, 31.0, 32.0, 33.0].to_vec()
        );
        assert_eq!((a.len, a.last, b.len), (2, Some(2), 1));
    }

    #[test]
    fn stage_refuses_another_layout_and_non_finite_values_naming_them() {
        let g = Bigram::new(4, 8).unwrap();
        let m = ModelId::new("m").unwrap();
        let other = Bigram::new(5, 8).unwrap();
        let wrong = other.weight_set(m.clone(), Version(2), |_, _| 0.0).unwrap();
        let e = g.stage(&wrong).unwrap_err().to_string();
        assert!(e.contains(TABLE) && e.contains("shape"), "{e}");
        let nan = g
            .weight_set(
                m,
                Version(3),
                |p, n| if (p, n) == (1, 2) { f32::NAN } else { 0.0 },
            )
            .unwrap();
        let e = g.stage(&nan).unwrap_err().to_string();
        assert!(
            e.contains(TABLE) && e.contains("[1, 2]") && e.contains("version 3"),
            "{e}"
        );
    }

    #[test]
    fn forward_refuses_a_context_overflow() {
        let mut g = Bigram::new(3, 2).unwrap();
        let ws = g
            .weight_set(ModelId::new("m").unwrap(), Version(1), |_, _| 0.0)
            .unwrap();
        let w = g.stage(&ws).unwrap();
        let mut c = g.new_cache();
        let mut logits = Vec::new();
        let mut inputs = [StepInput {
            cache: &mut c,
            tokens: &[0, 1, 2],
        }];
        let e = g.forward(&w, &mut inputs, &mut logits).unwrap_err();
        assert!(e.to_string().contains("context"), "{e}");
    }
}
