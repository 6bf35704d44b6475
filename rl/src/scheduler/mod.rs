//! Continuous batching for a generating engine, in plain code: requests join and leave the
//! running batch between decoding steps, and new weight versions are swapped in at step
//! boundaries as the run's [`PauseMode`] says.
//!
//! A [`Scheduler`] owns a [`Generator`], the version it serves (staged weights behind an
//! `Arc`), the running sequences (each with its KV cache, sampling state and the tokens,
//! log-probabilities and versions so far) and a queue of waiting requests. Its owner (the
//! generating engine's decoding thread) calls:
//!
//! - [`Scheduler::submit`]: checks a request (a bad one is refused with
//!   [`Error::BadRequest`] naming the field; nothing else changes) and queues it;
//! - [`Scheduler::step`]: ONE decoding step — a pending version is swapped in if the pause
//!   mode allows it now, waiting requests join (up to the batch size), one
//!   [`Generator::forward`] runs over every running sequence (a sequence's first step feeds
//!   its whole prompt: the prefill), each sequence samples its next token at its own
//!   temperature with its own seeded generator, the token is stamped with the served
//!   version, and the sequences that reached `max_tokens` or their stop token leave with
//!   their [`Completion`];
//! - [`Scheduler::offer`]: a staged version to swap in at the next boundary it may
//!   ([`PauseMode::Keep`]: at once, sequences continue with their caches; `Abort`: running
//!   sequences end with [`Finish::Aborted`]; `Wait`: no sequence joins until the running
//!   ones finished under the old version);
//! - [`Scheduler::cancel`]: requests of older cancellation epochs end with
//!   [`Finish::Cancelled`].
//!
//! A step computes every token under one weight version (the forward takes one `&Weights`),
//! so no sequence mixes layers of two versions; only the version between two tokens of a
//! sequence may change (keep mode). A swap replaces an `Arc`; the old one goes to a reaper
//! thread once the step's tokens are out, so freeing a large version never lands in the
//! pause (nor, in abort mode, freeing the KV caches of the sequences the swap ends); every
//! swap's pause and drain are recorded ([`Swap`]).

mod reaper;
pub(crate) mod request;
pub(crate) mod sample;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit_runtime::{ModelId, Version};

use crate::error::{Error, Result};
use crate::generation::{Completion, Finish, Generator, PauseMode, SamplingParams, Token};

use reaper::Reaper;
use request::{Running, Waiting};

/// Names one request inside a scheduler (handed out by [`Scheduler::submit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// How a scheduler runs.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// The model it serves (named in errors).
    pub model: ModelId,
    /// Most sequences decoded in one step.
    pub max_batch: usize,
    /// What happens to sequences in flight when a new version is ready.
    pub mode: PauseMode,
}

impl SchedulerConfig {
    /// `model` with batches of at most `max_batch` sequences, swapping as `mode` says.
    pub fn new(model: ModelId, max_batch: usize, mode: PauseMode) -> Self {
        Self {
            model,
            max_batch,
            mode,
        }
    }
}

/// One version swap.
#[derive(Clone, Debug, PartialEq)]
pub struct Swap {
    /// The version served before (`None` for the first weights).
    pub from: Option<Version>,
    /// The version served from now on.
    pub to: Version,
    /// The pause mode it was made under.
    pub mode: PauseMode,
    /// Time the loop produced no token because of the update: the swap itself (an `Arc`
    /// replaced), plus ending the aborted sequences in abort mode.
    pub paused: Duration,
    /// Time between the offer and the swap while the loop went on decoding under the old
    /// version: wait mode's drain (in keep and abort modes the rest of the step in
    /// progress, if any). Not a pause: tokens were produced meanwhile.
    pub drained: Duration,
    /// Sequences ended with [`Finish::Aborted`] by this swap.
    pub aborted: usize,
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepReport {
    /// Requests that ended (finished, aborted by a swap, or failed), with their answers.
    pub finished: Vec<(RequestId, Result<Completion>)>,
    /// The swap made at this step's boundary, if one was.
    pub swap: Option<Swap>,
    /// Tokens generated.
    pub tokens: usize,
}

/// What a scheduler did so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SchedulerStats {
    /// Decoding steps run (forward passes).
    pub steps: u64,
    /// Tokens generated.
    pub tokens: u64,
    /// Requests that ran to their end (`max_tokens` or the stop token).
    pub completed: u64,
    /// Versions swapped in.
    pub swaps: u64,
    /// Total pause of the swaps.
    pub paused_total: Duration,
    /// Longest pause of one swap.
    pub paused_max: Duration,
    /// Total drain (see [`Swap::drained`]).
    pub drained_total: Duration,
    /// Sequences ended by abort-mode swaps or by [`Scheduler::abort`].
    pub aborted: u64,
    /// Requests ended by [`Scheduler::cancel`].
    pub cancelled: u64,
}

/// A staged version waiting for its boundary.
struct Pending<W> {
    weights: Arc<W>,
    version: Version,
    since: Instant,
}

/// Continuous batching over one [`Generator`]; see the [module documentation](self).
pub struct Scheduler<G: Generator> {
    generator: G,
    cfg: SchedulerConfig,
    vocab: usize,
    max_context: usize,
    served: Option<(Arc<G::Weights>, Version)>,
    pending: Option<Pending<G::Weights>>,
    running: Vec<Running<G::Cache>>,
    waiting: VecDeque<Waiting>,
    next_id: u64,
    logits: Vec<f32>,
    /// Versions swapped out during this step, handed to the reaper at its end.
    retired: Vec<Arc<G::Weights>>,
    /// Caches of the sequences an abort-mode swap ended during this step, handed to the
    /// reaper at its end (freeing them inside the swap made the pause grow with the layers).
    aborted_caches: Vec<G::Cache>,
    reaper: Reaper,
    stats: SchedulerStats,
}

impl<G: Generator> std::fmt::Debug for Scheduler<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("model", &self.cfg.model)
            .field("mode", &self.cfg.mode)
            .field("served", &self.served_version())
            .field("pending", &self.pending_version())
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

impl<G: Generator> Scheduler<G> {
    /// A scheduler over `generator`, serving nothing until a version is offered (requests
    /// queue meanwhile).
    ///
    /// # Errors
    /// [`Error::Config`] naming the model: a batch size of zero, a generator with no
    /// vocabulary or no context, the reaper thread failing to start.
    pub fn new(generator: G, cfg: SchedulerConfig) -> Result<Self> {
        let (vocab, max_context) = (generator.vocab_size(), generator.max_context());
        let problem = if cfg.max_batch == 0 {
            Some("max_batch must be at least 1".to_string())
        } else if vocab == 0 {
            Some("the generator has an empty vocabulary".to_string())
        } else if max_context < 2 {
            Some(format!(
                "the generator's context of {max_context} holds no prompt and answer"
            ))
        } else {
            None
        };
        if let Some(p) = problem {
            return Err(Error::Config(format!("model `{}`: {p}", cfg.model)));
        }
        let reaper = Reaper::start(format!("refit-reap-{}", cfg.model))?;
        Ok(Self {
            generator,
            vocab,
            max_context,
            served: None,
            pending: None,
            running: Vec::new(),
            waiting: VecDeque::new(),
            next_id: 0,
            logits: Vec::new(),
            retired: Vec::with_capacity(2),
            aborted_caches: Vec::with_capacity(cfg.max_batch),
            reaper,
            stats: SchedulerStats::default(),
            cfg,
        })
    }

    /// Serves `weights` as `version` from the start (no swap is recorded).
    #[must_use]
    pub fn with_weights(mut self, weights: Arc<G::Weights>, version: Version) -> Self {
        if let Some((old, _)) = self.served.replace((weights, version)) {
            self.reaper.reap(old);
        }
        self
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The generator.
    pub fn generator(&self) -> &G {
        &self.generator
    }

    /// The version served (`None` before the first weights).
    pub fn served_version(&self) -> Option<Version> {
        self.served.as_ref().map(|(_, v)| *v)
    }

    /// The version offered and not swapped in yet.
    pub fn pending_version(&self) -> Option<Version> {
        self.pending.as_ref().map(|p| p.version)
    }

    /// Sequences in the running batch.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting to join.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// What it did so far.
    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    /// True when [`Scheduler::step`] has something to do: a version to swap in, or
    /// sequences to decode under a served version.
    pub fn has_work(&self) -> bool {
        self.pending.is_some()
            || (self.served.is_some() && !(self.running.is_empty() && self.waiting.is_empty()))
    }

    /// Queues a request; `epoch` is its cancellation epoch (`None`: not
    /// cancellable, see [`Scheduler::cancel`]).
    ///
    /// # Errors
    /// [`Error::BadRequest`] naming the field (`prompt`: empty, a token outside the
    /// vocabulary, longer than the context; `max_tokens`: zero or past the context;
    /// `temperature`; `stop`). A refused request changes nothing.
    pub fn submit(
        &mut self,
        prompt: Vec<Token>,
        params: SamplingParams,
        epoch: Option<u64>,
    ) -> Result<RequestId> {
        request::check(&prompt, &params, self.vocab, self.max_context)?;
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.waiting.push_back(Waiting {
            id,
            prompt,
            params,
            epoch,
            forced: None,
        });
        Ok(id)
    }

    /// Queues a scoring request: `tokens` are fed after `prompt` one per step instead of
    /// sampled (teacher forcing), and the answer carries each one's log-probability under
    /// the version that scored it, at `temperature` (`0`: the model's own distribution).
    /// It joins the running batch like any request (it is decoded beside them, takes the
    /// same swaps and cancellations) and ends with [`Finish::Length`].
    ///
    /// # Errors
    /// [`Error::BadRequest`] naming the field (`prompt` as [`Scheduler::submit`]; `tokens`:
    /// empty, outside the vocabulary, past the context; `temperature`).
    pub fn score(
        &mut self,
        prompt: Vec<Token>,
        tokens: Vec<Token>,
        temperature: f32,
        epoch: Option<u64>,
    ) -> Result<RequestId> {
        request::check_forced(&tokens, self.vocab)?;
        let params = SamplingParams {
            max_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            temperature,
            seed: 0,
            stop: None,
        };
        request::check(&prompt, &params, self.vocab, self.max_context).map_err(|e| match e {
            Error::BadRequest {
                field: "max_tokens",
                reason,
            } => Error::bad_request(
                "tokens",
                reason.replacen("do not fit", "tokens do not fit", 1),
            ),
            e => e,
        })?;
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.waiting.push_back(Waiting {
            id,
            prompt,
            params,
            epoch,
            forced: Some(tokens),
        });
        Ok(id)
    }

    /// Offers a staged version, swapped in at the next step boundary its pause mode allows;
    /// answers the version it supersedes, if one was pending (that one is never swapped in).
    ///
    /// # Errors
    /// [`refit_runtime::Error::StaleVersion`] naming the model when `version` is not newer
    /// than the one served or pending; both stay as they are.
    pub fn offer(&mut self, weights: Arc<G::Weights>, version: Version) -> Result<Option<Version>> {
        let newest = self.pending_version().max(self.served_version());
        if let Some(current) = newest
            && version <= current
        {
            return Err(Error::Runtime(refit_runtime::Error::StaleVersion {
                model: self.cfg.model.clone(),
                offered: version,
                current,
            }));
        }
        let since = self.pending.as_ref().map_or_else(Instant::now, |p| p.since);
        let old = self.pending.replace(Pending {
            weights,
            version,
            since,
        });
        Ok(old.map(|p| {
            self.reaper.reap(p.weights);
            p.version
        }))
    }

    /// Withdraws the pending version if it is `version` (a load that gave up waiting for
    /// its boundary); true when it was pending.
    pub fn withdraw(&mut self, version: Version) -> bool {
        if self.pending_version() != Some(version) {
            return false;
        }
        if let Some(p) = self.pending.take() {
            self.reaper.reap(p.weights);
        }
        true
    }

    /// Ends every running and waiting request whose cancellation epoch is older than
    /// `below` with [`Finish::Cancelled`] (running ones keep their tokens so far).
    pub fn cancel(&mut self, below: u64) -> Vec<(RequestId, Completion)> {
        let out = self.end_where(|g| g.is_some_and(|g| g < below), Finish::Cancelled);
        self.stats.cancelled += out.len() as u64;
        out
    }

    /// Ends every running and waiting request with [`Finish::Aborted`] by `by`, the tokens
    /// made so far kept, as an abort-mode swap to `by` ends the running ones: for an owner
    /// that swaps versions in itself (a backend's commit) under `pause_mode = "abort"`.
    pub fn abort(&mut self, by: Version) -> Vec<(RequestId, Completion)> {
        let out = self.end_where(|_| true, Finish::Aborted { by });
        self.stats.aborted += out.len() as u64;
        out
    }

    /// Ends the running and waiting requests whose cancellation epoch `hit` says, with
    /// `finish`.
    fn end_where(
        &mut self,
        hit: impl Fn(Option<u64>) -> bool,
        finish: Finish,
    ) -> Vec<(RequestId, Completion)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if hit(self.running[i].epoch) {
                let s = self.running.swap_remove(i);
                out.push((s.id, s.finish(finish)));
            } else {
                i += 1;
            }
        }
        let (ended, kept): (Vec<_>, Vec<_>) = self.waiting.drain(..).partition(|w| hit(w.epoch));
        self.waiting = kept.into();
        out.extend(ended.into_iter().map(|w| (w.id, w.finish(finish))));
        out
    }

    /// Runs one decoding step (see the [module documentation](self)).
    pub fn step(&mut self) -> StepReport {
        let mut report = StepReport::default();
        self.boundary(&mut report);
        let Some((weights, version)) = self.served.clone() else {
            return report;
        };
        if !self.draining() {
            while self.running.len() < self.cfg.max_batch {
                let Some(w) = self.waiting.pop_front() else {
                    break;
                };
                let cache = self.generator.new_cache();
                self.running.push(Running::start(w, cache));
            }
        }
        if !self.running.is_empty() {
            self.decode(&weights, version, &mut report);
        }
        drop(weights);
        // wait mode: the last sequence of the old version just left; swap at this boundary
        if report.swap.is_none() {
            self.boundary(&mut report);
        }
        for old in self.retired.drain(..) {
            self.reaper.reap(old);
        }
        if !self.aborted_caches.is_empty() {
            let fresh = Vec::with_capacity(self.cfg.max_batch);
            self.reaper
                .reap(std::mem::replace(&mut self.aborted_caches, fresh));
        }
        report
    }

    /// Wait mode with a version pending: the running sequences finish under the old
    /// version and nothing joins.
    fn draining(&self) -> bool {
        self.cfg.mode == PauseMode::Wait && self.pending.is_some() && self.served.is_some()
    }

    /// Swaps the pending version in if the pause mode allows it now.
    fn boundary(&mut self, report: &mut StepReport) {
        if self.pending.is_none() || (self.draining() && !self.running.is_empty()) {
            return;
        }
        let Some(p) = self.pending.take() else {
            return;
        };
        let started = Instant::now();
        let drained = started.duration_since(p.since);
        let mut aborted = 0;
        if self.cfg.mode == PauseMode::Abort {
            let by = p.version;
            aborted = self.running.len();
            report.finished.reserve(aborted);
            for s in self.running.drain(..) {
                let id = s.id;
                let (completion, cache) = s.finish_apart(Finish::Aborted { by });
                // freed by the reaper once the step's tokens are out, as the old version
                self.aborted_caches.push(cache);
                report.finished.push((id, Ok(completion)));
            }
        }
        let from = self.served.replace((p.weights, p.version));
        let from = from.map(|(old, v)| {
            // dropping the old version (maybe the last reference to gigabytes) is the
            // reaper's job, handed over once this step's tokens are out: waking the reaper
            // here could put its work (on a busy machine) inside the pause
            self.retired.push(old);
            v
        });
        let paused = started.elapsed();
        let s = &mut self.stats;
        s.swaps += 1;
        s.paused_total += paused;
        s.paused_max = s.paused_max.max(paused);
        s.drained_total += drained;
        s.aborted += aborted as u64;
        report.swap = Some(Swap {
            from,
            to: p.version,
            mode: self.cfg.mode,
            paused,
            drained,
            aborted,
        });
    }

    /// One forward over the running batch, one sampled token per sequence.
    fn decode(&mut self, weights: &G::Weights, version: Version, report: &mut StepReport) {
        let Self {
            generator,
            running,
            logits,
            vocab,
            cfg,
            stats,
            ..
        } = self;
        let vocab = *vocab;
        let n = running.len();
        let mut inputs: Vec<_> = running.iter_mut().map(Running::input).collect();
        let forward = generator.forward(weights, &mut inputs, logits);
        drop(inputs);
        stats.steps += 1;
        let failed = match forward {
            Err(e) => Some(e.to_string()),
            Ok(()) if logits.len() != n * vocab => Some(format!(
                "forward wrote {} logits for {n} sequences of a vocabulary of {vocab} ({} expected)",
                logits.len(),
                n * vocab
            )),
            Ok(()) => None,
        };
        if let Some(reason) = failed {
            // every sequence of the step ends with the failure; the next requests are served
            report.finished.extend(running.drain(..).map(|s| {
                let e = Error::Generator {
                    model: cfg.model.to_string(),
                    reason: format!("decoding step failed: {reason}"),
                };
                (s.id, Err(e))
            }));
            return;
        }
        let mut ended: Vec<(usize, Result<Finish>)> = Vec::new();
        for (i, (s, row)) in running
            .iter_mut()
            .zip(logits.chunks_exact(vocab))
            .enumerate()
        {
            let forced = s.forced_next();
            match sample::sample(row, s.params.temperature, &mut s.rng, forced) {
                Ok(t) => {
                    report.tokens += 1;
                    if let Some(f) = s.push(t.token, t.logprob, version) {
                        ended.push((i, Ok(f)));
                    }
                }
                Err(bad) => ended.push((
                    i,
                    Err(Error::Generator {
                        model: cfg.model.to_string(),
                        reason: format!(
                            "logit {} of request {} is {} (not a finite number)",
                            bad.index, s.id.0, bad.value
                        ),
                    }),
                )),
            }
        }
        stats.tokens += report.tokens as u64;
        // highest index first, so that swap_remove leaves the lower ones in place
        for (i, r) in ended.into_iter().rev() {
            let s = running.swap_remove(i);
            let id = s.id;
            match r {
                Ok(f) => {
                    stats.completed += 1;
                    report.finished.push((id, Ok(s.finish(f))));
                }
                Err(e) => report.finished.push((id, Err(e))),
            }
        }
    }
}
