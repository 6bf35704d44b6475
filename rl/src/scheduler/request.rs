//! One request: checked on arrival, queued, then decoded as a running sequence.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use refit_runtime::Version;

use crate::error::{Error, Result};
use crate::generation::{Completion, Finish, SamplingParams, StepInput, Token};

use super::RequestId;

/// A request waiting to join the running batch.
#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) id: RequestId,
    pub(super) prompt: Vec<Token>,
    pub(super) params: SamplingParams,
    pub(super) epoch: Option<u64>,
    /// The tokens to feed instead of sampling (a scoring request), one per step.
    pub(super) forced: Option<Vec<Token>>,
}

/// Checks the tokens of a scoring request: at least one, each inside the vocabulary.
///
/// # Errors
/// [`Error::BadRequest`] naming `tokens`.
pub(super) fn check_forced(tokens: &[Token], vocab: usize) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::bad_request("tokens", "is empty (nothing to score)"));
    }
    if let Some((at, t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, t)| **t as usize >= vocab)
    {
        return Err(Error::bad_request(
            "tokens",
            format!("token {t} at position {at} is outside the vocabulary of {vocab} tokens"),
        ));
    }
    Ok(())
}

/// Checks a request against a model of `vocab` tokens and `max_context` positions.
///
/// # Errors
/// [`Error::BadRequest`] naming the field: an empty prompt, a prompt token outside the
/// vocabulary, a prompt (or prompt plus `max_tokens`) longer than the context, bad sampling
/// parameters.
pub(crate) fn check(
    prompt: &[Token],
    params: &SamplingParams,
    vocab: usize,
    max_context: usize,
) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::bad_request("prompt", "is empty"));
    }
    if let Some((at, t)) = prompt
        .iter()
        .enumerate()
        .find(|(_, t)| **t as usize >= vocab)
    {
        return Err(Error::bad_request(
            "prompt",
            format!("token {t} at position {at} is outside the vocabulary of {vocab} tokens"),
        ));
    }
    if prompt.len() >= max_context {
        return Err(Error::bad_request(
            "prompt",
            format!(
                "of {} tokens leaves no room in the context of {max_context}",
                prompt.len()
            ),
        ));
    }
    params.check(vocab)?;
    let room = max_context - prompt.len();
    if params.max_tokens as usize > room {
        return Err(Error::bad_request(
            "max_tokens",
            format!(
                "{} do not fit: the prompt of {} tokens leaves {room} of the context of {max_context}",
                params.max_tokens,
                prompt.len()
            ),
        ));
    }
    Ok(())
}

/// A sequence in the running batch, with its KV cache.
#[derive(Debug)]
pub(super) struct Running<C> {
    pub(super) id: RequestId,
    pub(super) prompt: Vec<Token>,
    pub(super) params: SamplingParams,
    pub(super) epoch: Option<u64>,
    pub(super) rng: SmallRng,
    pub(super) cache: C,
    pub(super) tokens: Vec<Token>,
    pub(super) logprobs: Vec<f32>,
    pub(super) versions: Vec<Version>,
    pub(super) forced: Option<Vec<Token>>,
}

impl<C> Running<C> {
    /// A waiting request joins with an empty cache; its sampling is seeded from its params.
    pub(super) fn start(w: Waiting, cache: C) -> Self {
        Self {
            id: w.id,
            rng: SmallRng::seed_from_u64(w.params.seed),
            prompt: w.prompt,
            params: w.params,
            epoch: w.epoch,
            cache,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            versions: Vec::new(),
            forced: w.forced,
        }
    }

    /// The token a scoring request takes next (`None`: sample one).
    pub(super) fn forced_next(&self) -> Option<Token> {
        self.forced
            .as_ref()
            .and_then(|f| f.get(self.tokens.len()).copied())
    }

    /// What this step feeds: the whole prompt first (the prefill), then the last token.
    pub(super) fn input(&mut self) -> StepInput<'_, C> {
        let tokens = match self.tokens.len() {
            0 => &self.prompt[..],
            n => &self.tokens[n - 1..],
        };
        StepInput {
            cache: &mut self.cache,
            tokens,
        }
    }

    /// Appends one sampled token; answers how the sequence ends, if it does.
    pub(super) fn push(&mut self, token: Token, logprob: f32, version: Version) -> Option<Finish> {
        self.tokens.push(token);
        self.logprobs.push(logprob);
        self.versions.push(version);
        if self.params.stop == Some(token) {
            Some(Finish::Stop)
        } else if self.tokens.len() >= self.params.max_tokens as usize {
            Some(Finish::Length)
        } else {
            None
        }
    }

    /// The answer, with the tokens so far.
    pub(super) fn finish(self, finish: Finish) -> Completion {
        self.finish_apart(finish).0
    }

    /// The answer, and the cache for the caller to drop where it likes (a large model's
    /// cache is many buffers: freeing them is work).
    pub(super) fn finish_apart(self, finish: Finish) -> (Completion, C) {
        let completion = Completion {
            tokens: self.tokens,
            logprobs: self.logprobs,
            versions: self.versions,
            finish,
        };
        (completion, self.cache)
    }
}

impl Waiting {
    /// The answer of a request that never ran.
    pub(super) fn finish(self, finish: Finish) -> Completion {
        Completion {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            versions: Vec::new(),
            finish,
        }
    }
}
