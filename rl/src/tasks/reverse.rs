//! Reverse a string of digits: a token task with a verifiable reward and per-position credit.
//!
//! A prompt is `<s> d1 d2 .. dn =`; the answer is `dn .. d2 d1`, followed by `</s>` when the
//! task draws strings of several lengths (so the model must also say where it ends). The
//! reward is the fraction of answer positions right; each generated token gets credit 1
//! when it is right at its position, 0 otherwise. A string is held out when a hash of its
//! digits falls in one residue class; training prompts are never held out.

use std::collections::HashSet;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::vocab::{BOS, DIGITS, EOS, SEP, VOCAB, digit, token_digit};
use crate::error::{Error, Result};
use crate::generation::{SamplingParams, Token};
use crate::task::{Reward, Task};

/// Settings of [`ReverseDigits`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReverseConfig {
    /// Shortest string.
    pub min_len: usize,
    /// Longest string.
    pub max_len: usize,
    /// One string in `heldout_every` is held out (by hash), never a training prompt.
    pub heldout_every: u64,
    /// Held-out prompts validation runs on.
    pub heldout: usize,
    /// Sampling temperature of training rollouts.
    pub temperature: f32,
}

impl Default for ReverseConfig {
    /// Strings of 5 digits, one in 8 held out, 256 held-out prompts, temperature 1.
    fn default() -> Self {
        Self {
            min_len: 5,
            max_len: 5,
            heldout_every: 8,
            heldout: 256,
            temperature: 1.0,
        }
    }
}

/// The digit-reversal task.
#[derive(Clone, Debug)]
pub struct ReverseDigits {
    cfg: ReverseConfig,
    heldout: Vec<Vec<Token>>,
}

impl ReverseDigits {
    /// The task; draws its held-out prompts (the same for every seed).
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting: lengths of zero or `min_len > max_len`,
    /// `heldout_every` below 2, a temperature that is not in `0.0..=100.0`, no held-out
    /// prompt to be found.
    pub fn new(cfg: ReverseConfig) -> Result<Self> {
        if cfg.min_len == 0 || cfg.min_len > cfg.max_len {
            return Err(Error::Config(format!(
                "reverse task: min_len {} and max_len {} must satisfy 1 <= min_len <= max_len",
                cfg.min_len, cfg.max_len
            )));
        }
        if cfg.heldout_every < 2 {
            return Err(Error::Config(format!(
                "reverse task: heldout_every is {}; at least 2 (one string in that many held out)",
                cfg.heldout_every
            )));
        }
        if !cfg.temperature.is_finite() || !(0.0..=100.0).contains(&cfg.temperature) {
            return Err(Error::Config(format!(
                "reverse task: temperature {} is not in 0.0..=100.0",
                cfg.temperature
            )));
        }
        let mut task = Self {
            cfg,
            heldout: Vec::new(),
        };
        task.heldout = task.draw_heldout();
        if task.heldout.is_empty() {
            return Err(Error::Config(
                "reverse task: heldout must be positive and the strings must leave some held out"
                    .into(),
            ));
        }
        Ok(task)
    }

    /// The settings.
    pub fn config(&self) -> &ReverseConfig {
        &self.cfg
    }

    /// True when the answer ends with `</s>` (strings of several lengths).
    pub fn uses_eos(&self) -> bool {
        self.cfg.min_len != self.cfg.max_len
    }

    /// Longest prompt plus answer: the context a model needs.
    pub fn context(&self) -> usize {
        self.cfg.max_len + 2 + self.answer_max()
    }

    fn answer_max(&self) -> usize {
        self.cfg.max_len + usize::from(self.uses_eos())
    }

    /// True when the digit string is held out.
    pub fn is_heldout(&self, digits: &[u8]) -> bool {
        hash_digits(digits).is_multiple_of(self.cfg.heldout_every)
    }

    /// The prompt of a digit string.
    pub fn prompt_of(digits: &[u8]) -> Vec<Token> {
        let mut p = Vec::with_capacity(digits.len() + 2);
        p.push(BOS);
        p.extend(digits.iter().map(|&d| digit(d)));
        p.push(SEP);
        p
    }

    /// The right answer to `prompt`.
    ///
    /// # Errors
    /// [`Error::BadRequest`] (`prompt`) when it is not `<s> digits =` of an allowed length.
    pub fn answer(&self, prompt: &[Token]) -> Result<Vec<Token>> {
        let digits = self.digits_of(prompt)?;
        let mut a: Vec<Token> = digits.iter().rev().map(|&d| digit(d)).collect();
        if self.uses_eos() {
            a.push(EOS);
        }
        Ok(a)
    }

    fn digits_of(&self, prompt: &[Token]) -> Result<Vec<u8>> {
        let bad = || {
            Error::bad_request(
                "prompt",
                format!(
                    "{prompt:?} is not `<s> digits =` with {}..={} digits",
                    self.cfg.min_len, self.cfg.max_len
                ),
            )
        };
        let [first, body @ .., last] = prompt else {
            return Err(bad());
        };
        if *first != BOS
            || *last != SEP
            || !(self.cfg.min_len..=self.cfg.max_len).contains(&body.len())
        {
            return Err(bad());
        }
        body.iter()
            .map(|&t| token_digit(t).ok_or_else(bad))
            .collect()
    }

    fn draw_digits(&self, rng: &mut SmallRng) -> Vec<u8> {
        let n = rng.random_range(self.cfg.min_len..=self.cfg.max_len);
        (0..n).map(|_| rng.random_range(0..DIGITS)).collect()
    }

    fn draw_heldout(&self) -> Vec<Vec<Token>> {
        let mut rng = SmallRng::seed_from_u64(0x000e_d5e7_u64);
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        let tries = self
            .cfg
            .heldout
            .saturating_mul(self.cfg.heldout_every as usize)
            * 64;
        for _ in 0..tries {
            if out.len() == self.cfg.heldout {
                break;
            }
            let d = self.draw_digits(&mut rng);
            if self.is_heldout(&d) && seen.insert(d.clone()) {
                out.push(Self::prompt_of(&d));
            }
        }
        out
    }
}

/// FNV-1a over the digits, then a 64-bit finaliser (so residues mod small numbers mix).
fn hash_digits(digits: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &d in digits {
        h ^= u64::from(d) + 1;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h
}

impl Task for ReverseDigits {
    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn prompt(&mut self, rng: &mut SmallRng) -> Vec<Token> {
        loop {
            let d = self.draw_digits(rng);
            if !self.is_heldout(&d) {
                return Self::prompt_of(&d);
            }
        }
    }

    fn heldout(&self) -> Vec<Vec<Token>> {
        self.heldout.clone()
    }

    fn sampling(&self) -> SamplingParams {
        SamplingParams {
            max_tokens: self.answer_max() as u32,
            temperature: self.cfg.temperature,
            seed: 0,
            stop: self.uses_eos().then_some(EOS),
        }
    }

    fn reward(&self, prompt: &[Token], completion: &[Token]) -> Result<Reward> {
        let answer = self.answer(prompt)?;
        let per_token: Vec<f32> = completion
            .iter()
            .enumerate()
            .map(|(i, t)| f32::from(u8::from(answer.get(i) == Some(t))))
            .collect();
        let right: f32 = per_token.iter().take(answer.len()).sum();
        Ok(Reward {
            total: right / answer.len() as f32,
            per_token: Some(per_token),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reward_counts_right_positions() {
        let t = ReverseDigits::new(ReverseConfig::default()).unwrap();
        let p = ReverseDigits::prompt_of(&[1, 2, 3, 4, 5]);
        let a = t.answer(&p).unwrap();
        assert_eq!(a, [5, 4, 3, 2, 1].map(digit));
        let r = t.reward(&p, &a).unwrap();
        assert_eq!(r.total, 1.0);
        assert_eq!(r.per_token.unwrap(), vec![1.0; 5]);
        let half = [digit(5), digit(0), digit(3), EOS];
        let r = t.reward(&p, &half).unwrap();
        assert!((r.total - 0.4).abs() < 1e-6);
        assert_eq!(r.per_token.unwrap(), vec![1.0, 0.0, 1.0, 0.0]);
        assert_eq!(t.reward(&p, &[]).unwrap().total, 0.0);
        let e = t.reward(&[BOS, digit(1), SEP], &a).unwrap_err();
        assert!(e.to_string().contains("prompt"), "{e}");
    }

    #[test]
    fn variable_lengths_end_with_eos() {
        let t = ReverseDigits::new(ReverseConfig {
            min_len: 2,
            max_len: 4,
            ..ReverseConfig::default()
        })
        .unwrap();
        let p = ReverseDigits::prompt_of(&[7, 8]);
        assert_eq!(t.answer(&p).unwrap(), vec![digit(8), digit(7), EOS]);
        assert_eq!(t.sampling().stop, Some(EOS));
        assert_eq!(t.sampling().max_tokens, 5);
        assert_eq!(t.context(), 4 + 2 + 5);
        let r = t.reward(&p, &[digit(8), digit(7), EOS]).unwrap();
        assert_eq!(r.total, 1.0);
    }

    #[test]
    fn heldout_prompts_are_never_drawn_for_training() {
        let mut t = ReverseDigits::new(ReverseConfig {
            min_len: 3,
            max_len: 3,
            heldout: 50,
            ..ReverseConfig::default()
        })
        .unwrap();
        let held: HashSet<Vec<Token>> = t.heldout().into_iter().collect();
        assert_eq!(held.len(), 50);
        let mut rng = SmallRng::seed_from_u64(9);
        let mut seen = HashSet::new();
        for _ in 0..20_000 {
            let p = t.prompt(&mut rng);
            assert!(!held.contains(&p));
            seen.insert(p);
        }
        // About 7/8 of the 1000 strings are for training, and they are all reached.
        assert!((800..=950).contains(&seen.len()), "{}", seen.len());
        // Held-out prompts are the same for every task built alike.
        let again = ReverseDigits::new(*t.config()).unwrap();
        assert_eq!(again.heldout(), t.heldout());
    }

    #[test]
    fn a_random_policy_scores_low() {
        let mut t = ReverseDigits::new(ReverseConfig::default()).unwrap();
        let mut rng = SmallRng::seed_from_u64(1);
        let n = 2000;
        let mut sum = 0.0;
        for _ in 0..n {
            let p = t.prompt(&mut rng);
            let c: Vec<Token> = (0..5)
                .map(|_| rng.random_range(0..VOCAB as Token))
                .collect();
            sum += t.reward(&p, &c).unwrap().total;
        }
        let mean = sum / n as f32;
        assert!(mean <= 0.2, "{mean}");
        assert!(mean > 0.03, "{mean}");
    }

    #[test]
    fn bad_settings_are_named() {
        let e = ReverseDigits::new(ReverseConfig {
            min_len: 4,
            max_len: 3,
            ..ReverseConfig::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("min_len"), "{e}");
        let e = ReverseDigits::new(ReverseConfig {
            heldout_every: 1,
            ..ReverseConfig::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("heldout_every"), "{e}");
    }
}
