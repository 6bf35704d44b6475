//! A plain batched sampling loop over any [`Generator`]: every request starts at once, each
//! step feeds every unfinished sequence (its prompt first, then its last token) and samples
//! the next token at the request's temperature. What a generating engine does with a
//! scheduler, here in one call for local runs, evaluation and tests.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use refit_runtime::Version;

use crate::error::{Error, Result};
use crate::generation::{Completion, Finish, Generator, SamplingParams, StepInput, Token};
use crate::scheduler::request;
use crate::scheduler::sample::{Sampled, sample};

/// Generates one completion per request with `generator` under `weights` (stamped `version`),
/// all requests batched in every step.
///
/// # Errors
/// [`Error::BadRequest`] naming the field, as a generating engine refuses the request (an
/// empty prompt, a token outside the vocabulary, bad sampling parameters, a prompt plus
/// `max_tokens` longer than the context); the generator's errors, and a logit that is not
/// finite.
pub fn generate<G: Generator>(
    generator: &mut G,
    weights: &G::Weights,
    version: Version,
    requests: &[(Vec<Token>, SamplingParams)],
) -> Result<Vec<Completion>> {
    let vocab = generator.vocab_size();
    for (prompt, params) in requests {
        request::check(prompt, params, vocab, generator.max_context())?;
    }
    let mut caches: Vec<G::Cache> = requests.iter().map(|_| generator.new_cache()).collect();
    let mut rngs: Vec<SmallRng> = requests
        .iter()
        .map(|(_, p)| SmallRng::seed_from_u64(p.seed))
        .collect();
    let mut out: Vec<Completion> = requests
        .iter()
        .map(|(_, p)| Completion {
            tokens: Vec::with_capacity(p.max_tokens as usize),
            logprobs: Vec::with_capacity(p.max_tokens as usize),
            versions: Vec::with_capacity(p.max_tokens as usize),
            finish: Finish::Length,
        })
        .collect();
    let mut active: Vec<usize> = (0..requests.len()).collect();
    let mut logits = Vec::new();
    while !active.is_empty() {
        {
            // `active` is in increasing order: walk the caches once, taking its members.
            let mut inputs = Vec::with_capacity(active.len());
            let mut next = active.iter().peekable();
            for (i, cache) in caches.iter_mut().enumerate() {
                if next.next_if_eq(&&i).is_none() {
                    continue;
                }
                let tokens: &[Token] = match out[i].tokens.last() {
                    None => &requests[i].0,
                    Some(t) => std::slice::from_ref(t),
                };
                inputs.push(StepInput { cache, tokens });
            }
            generator.forward(weights, &mut inputs, &mut logits)?;
        }
        if logits.len() != active.len() * vocab {
            return Err(Error::Generator {
                model: "(sampling loop)".into(),
                reason: format!(
                    "the generator wrote {} logits for {} sequences of a vocabulary of {vocab}",
                    logits.len(),
                    active.len()
                ),
            });
        }
        let mut still = Vec::with_capacity(active.len());
        for (row, &i) in logits.chunks_exact(vocab).zip(&active) {
            let params = &requests[i].1;
            let Sampled {
                token: tok,
                logprob,
            } = sample(row, params.temperature, &mut rngs[i], None).map_err(|b| {
                Error::Generator {
                    model: "(sampling loop)".into(),
                    reason: format!("logit {} of token {} is not finite", b.value, b.index),
                }
            })?;
            let c = &mut out[i];
            c.tokens.push(tok);
            c.logprobs.push(logprob);
            c.versions.push(version);
            if params.stop == Some(tok) {
                c.finish = Finish::Stop;
            } else if c.tokens.len() < params.max_tokens as usize {
                still.push(i);
            }
        }
        active = still;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use refit_runtime::{Manifest, WeightSet};

    use super::*;

    /// A generator whose next token is the last fed one plus 1 (mod 5), certain to 90%; its
    /// cache counts the tokens fed.
    struct Count;

    impl Generator for Count {
        type Weights = ();
        type Cache = usize;
        fn manifest(&self) -> Arc<Manifest> {
            Arc::new(Manifest::builder().build().unwrap())
        }
        fn vocab_size(&self) -> usize {
            5
        }
        fn max_context(&self) -> usize {
            8
        }
        fn stage(&self, _: &WeightSet) -> Result<()> {
            Ok(())
        }
        fn new_cache(&self) -> usize {
            0
        }
        fn forward(
            &mut self,
            _: &(),
            inputs: &mut [StepInput<'_, usize>],
            logits: &mut Vec<f32>,
        ) -> Result<()> {
            logits.clear();
            for inp in inputs.iter_mut() {
                *inp.cache += inp.tokens.len();
                let next = (inp.tokens[inp.tokens.len() - 1] + 1) % 5;
                logits.extend((0..5).map(|t| if t == next { 4.0 } else { 0.0 }));
            }
            Ok(())
        }
    }

    #[test]
    fn generate_batches_requests_of_different_lengths_and_stops() {
        let stop = SamplingParams {
            stop: Some(4),
            ..SamplingParams::greedy(5)
        };
        let requests = vec![
            (vec![0, 1], SamplingParams::greedy(3)),
            (vec![1], stop),
            (vec![2, 3, 0], SamplingParams::new(4, 7)),
        ];
        let out = generate(&mut Count, &(), Version(3), &requests).unwrap();
        assert_eq!(out[0].tokens, vec![2, 3, 4]);
        assert_eq!(out[0].finish, Finish::Length);
        assert_eq!(out[1].tokens, vec![2, 3, 4]);
        assert_eq!(out[1].finish, Finish::Stop);
        assert_eq!(out[2].tokens.len(), 4);
        assert!(
            out.iter()
                .all(|c| c.versions.iter().all(|v| *v == Version(3)))
        );
        assert!(out.iter().all(|c| c.logprobs.len() == c.tokens.len()));
        // Greedy log-probabilities are those of the chosen token: 4 against four zeros.
        let p = 4f32.exp() / (4f32.exp() + 4.0);
        assert!((out[0].logprobs[0] - p.ln()).abs() < 1e-5);
        // Sampled ones come from the request's seed: the same seed, the same completion.
        let again = generate(&mut Count, &(), Version(3), &requests[2..]).unwrap();
        assert_eq!(again[0], out[2]);
    }

    #[test]
    fn generate_refuses_what_cannot_fit() {
        let e = generate(
            &mut Count,
            &(),
            Version(1),
            &[(vec![0; 4], SamplingParams::greedy(5))],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("max_tokens") && e.contains("context of 8"),
            "{e}"
        );
        let e = generate(
            &mut Count,
            &(),
            Version(1),
            &[(vec![], SamplingParams::greedy(1))],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("prompt"), "{e}");
    }
}
