//! Generation: what a generating engine is asked, what it answers, and the backend trait a
//! model implements to be served by one.
//!
//! A request carries prompt tokens and [`SamplingParams`]; the answer, a [`Completion`],
//! carries the generated tokens, their log-probabilities under the behaviour policy and the
//! weight version under which each token was produced (so a learner can tell how stale every
//! token is, and a sequence that crossed an update shows it).
//!
//! A [`Generator`] is the model side of an engine: it *stages* a weight set into its own
//! serving form ([`Generator::stage`], off the decoding loop: verify, convert, lay out) and
//! computes next-token logits for a batch of sequences, each with its own KV cache
//! ([`Generator::forward`]). Sampling, batching, versions and pauses belong to the engine,
//! not to the backend.

use std::sync::Arc;

use refit_runtime::{Manifest, Version, WeightSet};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A token id.
pub type Token = u32;

/// How one request samples.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Tokens to generate at most (at least 1).
    pub max_tokens: u32,
    /// Softmax temperature; `0.0` is greedy (the most likely token, log-probability still
    /// reported). Finite, in `0.0..=100.0`.
    pub temperature: f32,
    /// Seed of this request's sampling (a request is reproducible given the versions it
    /// ran under).
    pub seed: u64,
    /// A token that ends the completion when sampled (it is kept as the last token).
    pub stop: Option<Token>,
}

impl SamplingParams {
    /// `max_tokens` tokens sampled at temperature 1 with `seed`, no stop token.
    pub fn new(max_tokens: u32, seed: u64) -> Self {
        Self {
            max_tokens,
            temperature: 1.0,
            seed,
            stop: None,
        }
    }

    /// Greedy decoding of `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        Self {
            max_tokens,
            temperature: 0.0,
            seed: 0,
            stop: None,
        }
    }

    /// Checks the parameters against a model of `vocab` tokens.
    ///
    /// # Errors
    /// [`Error::BadRequest`] naming the field: `max_tokens` zero, a temperature that is not
    /// finite or outside `0.0..=100.0`, a stop token outside the vocabulary.
    pub fn check(&self, vocab: usize) -> Result<()> {
        if self.max_tokens == 0 {
            return Err(Error::bad_request("max_tokens", "must be at least 1"));
        }
        if !self.temperature.is_finite() || !(0.0..=100.0).contains(&self.temperature) {
            return Err(Error::bad_request(
                "temperature",
                format!("{} is not a number in 0.0..=100.0", self.temperature),
            ));
        }
        if let Some(s) = self.stop
            && s as usize >= vocab
        {
            return Err(Error::bad_request(
                "stop",
                format!("token {s} is outside the vocabulary of {vocab} tokens"),
            ));
        }
        Ok(())
    }
}

/// Why a completion ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Finish {
    /// `max_tokens` were generated.
    Length,
    /// The stop token was sampled.
    Stop,
    /// A weight update in `abort` mode ended it; the tokens so far are kept.
    Aborted {
        /// The version the engine swapped to.
        by: Version,
    },
    /// An eval step's leader cancelled in-flight episodes.
    Cancelled,
}

// ANCHOR: completion
/// What a generating engine answers for one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// The generated tokens (the prompt not included).
    pub tokens: Vec<Token>,
    /// Log-probability of each token under the weights that produced it (at the request's
    /// temperature: the behaviour policy).
    pub logprobs: Vec<f32>,
    /// The weight version that produced each token.
    pub versions: Vec<Version>,
    /// Why it ended.
    pub finish: Finish,
}
// ANCHOR_END: completion

/// How far above 0 a behaviour log-probability may lie and still be taken as 0: a
/// probability of 1 rounded in `f32` by an engine's softmax.
pub const LOGPROB_ROUNDING: f32 = 1e-4;

/// Checks the fields that hold one value per generated token: each `(field, len)` whose
/// length is given must be `tokens`.
///
/// # Errors
/// The first field of another length, named, as a message.
pub fn check_per_token(
    tokens: usize,
    fields: &[(&str, Option<usize>)],
) -> std::result::Result<(), String> {
    match fields
        .iter()
        .find(|(_, len)| len.is_some_and(|len| len != tokens))
    {
        Some((field, Some(len))) => {
            Err(format!("{len} {field} for {tokens} tokens (one per token)"))
        }
        _ => Ok(()),
    }
}

/// Checks behaviour log-probabilities: each finite and at most `above_zero` (0 for what a
/// learner takes; [`LOGPROB_ROUNDING`] for an engine's answer, whose rounding
/// [`clamp_logprobs`] then takes to 0).
///
/// # Errors
/// The first that is not a log-probability, by index and value, as a message.
pub fn check_logprobs(logprobs: &[f32], above_zero: f32) -> std::result::Result<(), String> {
    match logprobs
        .iter()
        .position(|p| !(p.is_finite() && *p <= above_zero))
    {
        Some(i) => Err(format!(
            "logprobs[{i}] = {}, not a log-probability",
            logprobs[i]
        )),
        None => Ok(()),
    }
}

/// Takes checked log-probabilities' rounding above 0 to 0, as every learner wants them.
pub fn clamp_logprobs(logprobs: &mut [f32]) {
    logprobs.iter_mut().for_each(|p| *p = p.min(0.0));
}

impl Completion {
    /// The oldest version among its tokens (`None` when it has no token).
    pub fn oldest_version(&self) -> Option<Version> {
        self.versions.iter().copied().min()
    }

    /// The newest version among its tokens.
    pub fn newest_version(&self) -> Option<Version> {
        self.versions.iter().copied().max()
    }
}

pub use refit_runtime::sync_policy::PauseMode;

/// One sequence's input to a decoding step: its cache and the tokens to feed (the whole
/// prompt on its first step, then the last sampled token).
#[derive(Debug)]
pub struct StepInput<'a, C> {
    /// The sequence's KV cache (it grows by `tokens.len()` positions).
    pub cache: &'a mut C,
    /// The tokens fed this step.
    pub tokens: &'a [Token],
}

// ANCHOR: generator
/// The model side of a generating engine.
///
/// The engine calls [`Generator::stage`] on a thread beside the decoding loop for every new
/// version (the pull, checks and conversion happen there, never inside a pause), swaps the
/// staged weights in at a step boundary, and calls [`Generator::forward`] once per decoding
/// step for every running sequence at once (continuous batching: sequences join and leave
/// between steps).
pub trait Generator: Send + 'static {
    /// A staged version in the backend's serving form (shared: sequences in flight may hold
    /// the version they run under).
    type Weights: Send + Sync + 'static;
    /// One sequence's KV cache.
    type Cache: Send + 'static;

    /// The layout of the weight sets [`Generator::stage`] takes (the engine's layout, which
    /// may differ from the trainer's: the link converts on the way).
    fn manifest(&self) -> Arc<Manifest>;

    /// Size of the vocabulary (tokens are `0..vocab_size`).
    fn vocab_size(&self) -> usize;

    /// Longest sequence (prompt plus generated tokens) the model handles.
    fn max_context(&self) -> usize;

    /// Turns a received weight set into the serving form.
    ///
    /// # Errors
    /// A weight set of another layout, or values the backend refuses (non-finite, say),
    /// naming the tensor; the engine keeps serving the version it has.
    fn stage(&self, weights: &WeightSet) -> Result<Self::Weights>;

    /// Writes what `weights` serve back into `out` (a weight set of
    /// [`Generator::manifest`]'s layout), so that an engine can verify them (a topology's
    /// `verify = "startup"` or `"hashes"`): staged from a version, they must export as its
    /// bytes. The default cannot.
    ///
    /// # Errors
    /// A backend that cannot read its serving form back (the default), or `out` of another
    /// layout.
    fn export(&self, weights: &Self::Weights, out: &mut WeightSet) -> Result<()> {
        let _ = (weights, out);
        Err(Error::Config(
            "this generator cannot read its serving weights back (Generator::export), so its \
             engine cannot verify them"
                .into(),
        ))
    }

    /// An empty cache for a new sequence.
    fn new_cache(&self) -> Self::Cache;

    /// One decoding step: feeds each input's tokens into its cache under `weights` and
    /// writes the next-token logits of every input, one after the other (`inputs.len() *
    /// vocab_size` values), into `logits` (cleared first).
    ///
    /// # Errors
    /// A failure of the backend's numerics; the engine ends the step's sequences with the
    /// error and keeps serving.
    fn forward(
        &mut self,
        weights: &Self::Weights,
        inputs: &mut [StepInput<'_, Self::Cache>],
        logits: &mut Vec<f32>,
    ) -> Result<()>;
}
// ANCHOR_END: generator

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_params_name_the_bad_field() {
        let ok = SamplingParams::new(4, 1);
        assert!(ok.check(10).is_ok());
        let e = SamplingParams {
            max_tokens: 0,
            ..ok
        }
        .check(10)
        .unwrap_err();
        assert!(e.to_string().contains("max_tokens"), "{e}");
        for t in [f32::NAN, -0.5, 1e9] {
            let e = SamplingParams {
                temperature: t,
                ..ok
            }
            .check(10)
            .unwrap_err();
            assert!(e.to_string().contains("temperature"), "{e}");
        }
        let e = SamplingParams {
            stop: Some(10),
            ..ok
        }
        .check(10)
        .unwrap_err();
        assert!(e.to_string().contains("stop"), "{e}");
    }

    #[test]
    fn pause_modes_parse_and_refuse() {
        for m in [PauseMode::Abort, PauseMode::Wait, PauseMode::Keep] {
            assert_eq!(PauseMode::parse(m.as_str()).unwrap(), m);
        }
        assert!(PauseMode::parse("stop").is_err());
    }
}
