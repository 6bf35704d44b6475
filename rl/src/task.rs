//! The task role of a generating topology: where prompts come from and how completions are
//! rewarded. A reward function is user code, as an [`Env`](crate::env::Env) is for
//! environment steps; the framework names no task.

use rand::rngs::SmallRng;

use crate::error::Result;
use crate::generation::{SamplingParams, Token};

/// What a completion earned.
#[derive(Clone, Debug, PartialEq)]
pub struct Reward {
    /// The completion's reward (what a run reports as its mean reward).
    pub total: f32,
    /// Per-token credit, when the task can give one (one value per generated token).
    pub per_token: Option<Vec<f32>>,
}

impl Reward {
    /// A reward with no per-token credit.
    pub fn total(total: f32) -> Self {
        Self {
            total,
            per_token: None,
        }
    }
}

// ANCHOR: task
/// Prompts and a verifiable reward for a generating engine's rollouts.
pub trait Task: Send + 'static {
    /// Size of the vocabulary its prompts and answers are written in (the generator's must
    /// be at least as large).
    fn vocab_size(&self) -> usize;

    /// A training prompt, drawn with `rng` (never one of [`Task::heldout`]).
    fn prompt(&mut self, rng: &mut SmallRng) -> Vec<Token>;

    /// The held-out prompts validation runs on.
    fn heldout(&self) -> Vec<Vec<Token>>;

    /// How completions are sampled during training (the seed is replaced per request).
    fn sampling(&self) -> SamplingParams;

    /// The reward of `completion` for `prompt`.
    ///
    /// # Errors
    /// A completion the task cannot score (the rollout worker reports it and stops).
    fn reward(&self, prompt: &[Token], completion: &[Token]) -> Result<Reward>;
}
// ANCHOR_END: task
