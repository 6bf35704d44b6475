//! GRPO in one process, without actors: sample groups of completions with a [`Generator`]
//! (the plain batched loop of [`sampling`](crate::sampling)), reward them with a [`Task`],
//! train a [`Learner`], move its exports to the generator through a [`Conversion`] (the
//! engine's layout), and measure the held-out reward with greedy decoding every few updates.
//!
//! This is the yardstick the distributed runs are compared with, and what a test or an
//! example runs to find settings that learn.

use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use refit_runtime::{Conversion, Version};
use serde::{Deserialize, Serialize};

use crate::batch::{Batch, Sequence};
use crate::error::{Error, Result};
use crate::generation::{Generator, SamplingParams, Token};
use crate::learner::{LearnStats, Learner};
use crate::sampling::generate;
use crate::task::Task;

/// Settings of a local run.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalConfig {
    /// Prompts per batch.
    pub prompts_per_batch: usize,
    /// Completions per prompt (a GRPO group).
    pub group_size: usize,
    /// Updates at most.
    pub max_updates: usize,
    /// Wall time at most (checked after each update).
    pub max_time: Duration,
    /// Held-out evaluation every this many updates (and before the first).
    pub eval_every: usize,
    /// Stop once the held-out reward reaches this.
    pub stop_at: Option<f32>,
    /// Seed of the prompts and of the sampling.
    pub seed: u64,
}

impl Default for LocalConfig {
    /// 16 prompts of 8 completions, at most 1000 updates or 4 minutes, evaluation every 10
    /// updates, stop at a held-out reward of 0.9.
    fn default() -> Self {
        Self {
            prompts_per_batch: 16,
            group_size: 8,
            max_updates: 1000,
            max_time: Duration::from_secs(240),
            eval_every: 10,
            stop_at: Some(0.9),
            seed: 0,
        }
    }
}

/// One point of a learning curve.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CurvePoint {
    /// Updates done.
    pub update: usize,
    /// Seconds since the run started.
    pub seconds: f64,
    /// Mean reward of greedy completions of the held-out prompts.
    pub heldout_reward: f32,
    /// Mean reward of the last training batch (sampled), `None` before the first.
    pub train_reward: Option<f32>,
    /// Where the seconds went so far.
    pub split: TimeSplit,
}

/// Seconds spent so far in each phase of a local run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TimeSplit {
    /// Sampling training batches (generation and rewards).
    pub sample: f64,
    /// Learner updates.
    pub train: f64,
    /// Exports, conversions to the engine's layout and staging.
    pub publish: f64,
    /// Held-out evaluations.
    pub eval: f64,
}

/// Mean reward of greedy completions of the task's held-out prompts.
///
/// # Errors
/// The generator's and the task's errors.
pub fn evaluate<G: Generator, T: Task>(
    generator: &mut G,
    weights: &G::Weights,
    version: Version,
    task: &T,
) -> Result<f32> {
    let prompts = task.heldout();
    if prompts.is_empty() {
        return Err(Error::Config("the task has no held-out prompt".into()));
    }
    let params = SamplingParams {
        temperature: 0.0,
        ..task.sampling()
    };
    let requests: Vec<(Vec<Token>, SamplingParams)> =
        prompts.into_iter().map(|p| (p, params)).collect();
    let done = generate(generator, weights, version, &requests)?;
    let mut sum = 0.0;
    for ((prompt, _), c) in requests.iter().zip(&done) {
        sum += task.reward(prompt, &c.tokens)?.total;
    }
    Ok(sum / requests.len() as f32)
}

/// Samples one batch: `prompts_per_batch` prompts, `group_size` completions each, rewarded.
///
/// # Errors
/// The generator's and the task's errors.
pub fn sample_batch<G: Generator, T: Task>(
    generator: &mut G,
    weights: &G::Weights,
    version: Version,
    task: &mut T,
    cfg: &LocalConfig,
    first_group: u64,
    rng: &mut SmallRng,
) -> Result<Batch> {
    let base = task.sampling();
    let mut requests = Vec::with_capacity(cfg.prompts_per_batch * cfg.group_size);
    let mut groups = Vec::with_capacity(requests.capacity());
    for p in 0..cfg.prompts_per_batch {
        let prompt = task.prompt(rng);
        for _ in 0..cfg.group_size {
            let params = SamplingParams {
                seed: rng.random(),
                ..base
            };
            requests.push((prompt.clone(), params));
            groups.push(first_group + p as u64);
        }
    }
    let done = generate(generator, weights, version, &requests)?;
    let mut sequences = Vec::with_capacity(done.len());
    for (((prompt, _), c), group) in requests.into_iter().zip(done).zip(groups) {
        let r = task.reward(&prompt, &c.tokens)?;
        sequences.push(Sequence {
            prompt,
            tokens: c.tokens,
            logprobs: c.logprobs,
            versions: c.versions,
            reward: r.total,
            token_rewards: r.per_token,
            group,
            finish: c.finish,
            worker: 0,
            ref_logprobs: None,
        });
    }
    Ok(Batch {
        frames: sequences.len(),
        sequences,
        ..Batch::default()
    })
}

/// Runs GRPO locally until `cfg.max_updates`, `cfg.max_time` or `cfg.stop_at`; calls
/// `on_point` with each curve point (and the stats of the update before it) as it is
/// measured, and answers the curve.
///
/// # Errors
/// [`Error::Config`] for a zero batch, group or evaluation period; the learner's, the
/// conversion's, the generator's and the task's errors.
pub fn run<G: Generator, T: Task>(
    learner: &mut dyn Learner,
    conversion: &Conversion,
    generator: &mut G,
    task: &mut T,
    cfg: &LocalConfig,
    mut on_point: impl FnMut(&CurvePoint, Option<&LearnStats>),
) -> Result<Vec<CurvePoint>> {
    if cfg.prompts_per_batch == 0 || cfg.group_size == 0 || cfg.eval_every == 0 {
        return Err(Error::Config(
            "local run: prompts_per_batch, group_size and eval_every must be positive".into(),
        ));
    }
    let start = Instant::now();
    let mut rng = SmallRng::seed_from_u64(cfg.seed);
    let publish = |learner: &mut dyn Learner, generator: &G| -> Result<(G::Weights, Version)> {
        let ws = learner.export()?;
        let engine = conversion.apply(&ws)?;
        Ok((generator.stage(&engine)?, ws.version()))
    };
    let mut split = TimeSplit::default();
    let timed = |slot: &mut f64, t: Instant| *slot += t.elapsed().as_secs_f64();
    let t = Instant::now();
    let (mut weights, mut version) = publish(learner, generator)?;
    timed(&mut split.publish, t);
    let t = Instant::now();
    let heldout_reward = evaluate(generator, &weights, version, task)?;
    timed(&mut split.eval, t);
    let mut curve = Vec::new();
    let mut point = CurvePoint {
        update: 0,
        seconds: start.elapsed().as_secs_f64(),
        heldout_reward,
        train_reward: None,
        split,
    };
    on_point(&point, None);
    curve.push(point);
    for update in 1..=cfg.max_updates {
        let first_group = (update * cfg.prompts_per_batch) as u64;
        let t = Instant::now();
        let batch = sample_batch(
            generator,
            &weights,
            version,
            task,
            cfg,
            first_group,
            &mut rng,
        )?;
        timed(&mut split.sample, t);
        let t = Instant::now();
        let stats = learner.update(&batch)?;
        timed(&mut split.train, t);
        let t = Instant::now();
        (weights, version) = publish(learner, generator)?;
        timed(&mut split.publish, t);
        let out_of_time = start.elapsed() >= cfg.max_time;
        if update % cfg.eval_every == 0 || out_of_time || update == cfg.max_updates {
            let train = batch.sequences.iter().map(|s| s.reward).sum::<f32>()
                / batch.sequences.len() as f32;
            let t = Instant::now();
            let heldout_reward = evaluate(generator, &weights, version, task)?;
            timed(&mut split.eval, t);
            point = CurvePoint {
                update,
                seconds: start.elapsed().as_secs_f64(),
                heldout_reward,
                train_reward: Some(train),
                split,
            };
            on_point(&point, Some(&stats));
            let reached = cfg.stop_at.is_some_and(|s| point.heldout_reward >= s);
            curve.push(point);
            if reached || out_of_time {
                break;
            }
        }
    }
    Ok(curve)
}
