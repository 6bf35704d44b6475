//! Rollout workers of a generating topology: prompts from a [`Task`], completions from a
//! generating engine, rewards from the task, fragments of [`Sequence`]s for the pool.

use std::future::Future;
use std::time::Duration;

use actix::prelude::*;
use actix_rt::task::JoinHandle;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use refit_runtime::{ModelId, Version};

use crate::batch::{Batch, EpisodeStats, Sequence};
use crate::error::{Error, Result};
use crate::generation::{Completion, Finish, SamplingParams, Token};
use crate::task::Task;

use super::fragments::{FragmentLoop, Fragments, Outcome, deliver};
use crate::protocol::controller::{Admission, AwaitRollout, ControllerLink};
use crate::protocol::engine::{Generate, Score};
use crate::protocol::pool::PushFragment;

/// Settings of a generating rollout worker.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRolloutConfig {
    /// The model it generates with.
    pub model: ModelId,
    /// Its index (stamped on sequences; group ids are unique per worker).
    pub worker: usize,
    /// Prompts drawn per fragment.
    pub prompts_per_fragment: usize,
    /// Completions generated per prompt (one GRPO group).
    pub group_size: usize,
    /// Seed of the prompt draws and of the requests' sampling seeds.
    pub seed: u64,
    /// Deadline of each generation request (a regenerated one gets a fresh one) and of
    /// handing a fragment to the pool: past it the worker stops with
    /// [`refit_runtime::Error::Timeout`] in its
    /// [`RolloutStats::error`](crate::protocol::rollout::RolloutStats::error).
    pub timeout: Duration,
    /// Deadline of the status check before each fragment: above the controller's own
    /// `rollout_wait_s`, which it answers within.
    pub admission_timeout: Duration,
    /// How many times a completion ended by an update (`abort` mode) is generated again
    /// before the worker gives up (a group must be whole).
    pub max_regenerations: u32,
    /// The reference model each completion is scored under (its log-probabilities go to
    /// [`Sequence::ref_logprobs`]); `None`: no scoring.
    pub reference: Option<ModelId>,
}

impl GenRolloutConfig {
    /// Worker `worker` of `model`: 4 prompts of 4 completions per fragment, seed 0, 60 s
    /// per request, 130 s for the status check, 8 regenerations.
    pub fn new(model: ModelId, worker: usize) -> Self {
        Self {
            model,
            worker,
            prompts_per_fragment: 4,
            group_size: 4,
            seed: 0,
            timeout: Duration::from_secs(60),
            admission_timeout: Duration::from_secs(130),
            max_regenerations: 8,
            reference: None,
        }
    }
}

/// A request a generating engine answers with a [`Completion`]: [`Generate`] or [`Score`].
pub(crate) trait CompletionRequest:
    Message<Result = Result<Completion>> + Clone + Send + 'static
{
    /// The model asked.
    fn model(&self) -> &ModelId;
    /// What the engine is asked to do (named in errors).
    const DOING: &'static str;
}

impl CompletionRequest for Generate {
    fn model(&self) -> &ModelId {
        &self.model
    }
    const DOING: &'static str = "generate";
}

impl CompletionRequest for Score {
    fn model(&self) -> &ModelId {
        &self.model
    }
    const DOING: &'static str = "score";
}

/// Sends `request` to `engine`, again while an update aborts it (at most `regenerations`
/// more times); each send has the deadline `timeout`. Answers the completion and how many
/// times it was asked again.
///
/// # Errors
/// The engine's answer ([`Error::Cancelled`] included); a timeout or a stopped engine; a
/// completion still aborted after the last regeneration.
pub(crate) async fn generate_whole<M: CompletionRequest>(
    engine: Recipient<M>,
    request: M,
    timeout: Duration,
    regenerations: u32,
) -> Result<(Completion, u32)> {
    let mut again = 0;
    let model = request.model().clone();
    loop {
        let answer = engine
            .send(request.clone())
            .timeout(timeout)
            .await
            .map_err(|e| {
                Error::unanswered(
                    e,
                    timeout,
                    format!("the engine to {} for model `{model}`", M::DOING),
                )
            })??;
        match answer.finish {
            Finish::Aborted { by } if again < regenerations => {
                tracing::debug!(model = %model, version = %by, "{} aborted by an update: asked again", M::DOING);
                again += 1;
            }
            Finish::Aborted { by } => {
                return Err(Error::Actor(format!(
                    "a completion of model `{model}` was aborted by an update {} times (last \
                     by version {by}) as the engine was asked to {}; its group cannot be \
                     made whole",
                    again + 1,
                    M::DOING
                )));
            }
            _ => return Ok((answer, again)),
        }
    }
}

/// A generating worker's own state, lent to each fragment.
pub struct GenState<T> {
    task: T,
    rng: SmallRng,
    /// The engine's cancellation epoch as last learnt.
    epoch: u64,
    /// Groups made so far.
    groups: u64,
}

/// What a generating rollout worker collects: fragments of sequences. Before each fragment
/// it asks the controller (blocking as the sync mode says), draws `prompts_per_fragment`
/// prompts from its task and sends `group_size` [`Generate`] requests per prompt at once
/// (the engine batches them), rewards each completion with the task and pushes the fragment
/// to the pool. A completion aborted by an update is generated again (a group must be
/// whole); a fragment whose requests are cancelled is dropped.
pub struct GenFragments<T> {
    cfg: GenRolloutConfig,
    engine: Recipient<Generate>,
    scorer: Option<Recipient<Score>>,
    _task: std::marker::PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for GenState<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenState")
            .field("epoch", &self.epoch)
            .field("groups", &self.groups)
            .finish_non_exhaustive()
    }
}

impl<T> std::fmt::Debug for GenFragments<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenFragments")
            .field("cfg", &self.cfg)
            .field("scorer", &self.scorer.is_some())
            .finish_non_exhaustive()
    }
}

impl<T> Clone for GenFragments<T> {
    fn clone(&self) -> Self {
        Self {
            cfg: self.cfg.clone(),
            engine: self.engine.clone(),
            scorer: self.scorer.clone(),
            _task: std::marker::PhantomData,
        }
    }
}

impl<T: Task + Unpin> Fragments for GenFragments<T> {
    type State = GenState<T>;
    const KIND: &'static str = "GenRolloutWorker";

    fn model(&self) -> &ModelId {
        &self.cfg.model
    }

    fn worker(&self) -> usize {
        self.cfg.worker
    }

    fn run(
        &self,
        state: &mut GenState<T>,
        controller: &ControllerLink,
        pool: &Recipient<PushFragment>,
    ) -> impl Future<Output = Result<Outcome>> {
        run_fragment(
            &self.cfg,
            state,
            &self.engine,
            self.scorer.clone(),
            controller,
            pool,
        )
    }
}

/// Generates fragments of sequences through a generating engine ([`GenFragments`]).
pub type GenRolloutWorker<T> = FragmentLoop<GenFragments<T>>;

impl<T: Task + Unpin> FragmentLoop<GenFragments<T>> {
    /// A worker drawing prompts from `task`, generating through `engine`, admitted by
    /// `controller` (an `&Addr<WeightSyncController>` or a [`ControllerLink`]), pushing to
    /// `pool`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the model when a fragment would hold no completion.
    pub fn new(
        cfg: GenRolloutConfig,
        task: T,
        engine: Recipient<Generate>,
        controller: impl Into<ControllerLink>,
        pool: Recipient<PushFragment>,
    ) -> Result<Self> {
        if cfg.prompts_per_fragment == 0 || cfg.group_size == 0 {
            return Err(Error::Config(format!(
                "model `{}`: prompts_per_fragment and group_size must be at least 1",
                cfg.model
            )));
        }
        let state = GenState {
            task,
            rng: SmallRng::seed_from_u64(cfg.seed),
            epoch: 0,
            groups: 0,
        };
        let fragments = GenFragments {
            cfg,
            engine,
            scorer: None,
            _task: std::marker::PhantomData,
        };
        Ok(Self::with(fragments, state, controller.into(), pool))
    }

    /// Scores through `scorer` (the engine's [`Score`]) when the config names a reference.
    #[must_use]
    pub fn scorer(mut self, scorer: Recipient<Score>) -> Self {
        self.fragments_mut().scorer = Some(scorer);
        self
    }
}

/// One generated completion waiting for its reward.
struct Generated {
    prompt: usize,
    group: u64,
    answer: Result<(Completion, u32)>,
}

/// A generation request in flight: the index of its prompt, its group and its task.
type PendingGeneration = (usize, u64, JoinHandle<Result<(Completion, u32)>>);

/// One fragment: admitted by the controller, generated (and scored), dropped when cancelled,
/// else rewarded and pushed to the pool.
async fn run_fragment<T: Task>(
    cfg: &GenRolloutConfig,
    state: &mut GenState<T>,
    engine: &Recipient<Generate>,
    scorer: Option<Recipient<Score>>,
    controller: &ControllerLink,
    pool: &Recipient<PushFragment>,
) -> Result<Outcome> {
    let admission = admit(cfg, controller).await?;
    let waited = admission.waited;
    let prompts: Vec<Vec<Token>> = (0..cfg.prompts_per_fragment)
        .map(|_| state.task.prompt(&mut state.rng))
        .collect();
    let pending = spawn_generations(cfg, state, engine, &prompts);
    let generated = await_generations(cfg, pending).await;
    let scores = match &cfg.reference {
        Some(reference) => Some(score(cfg, reference, scorer, state, &prompts, &generated).await?),
        None => None,
    };
    if let Some(epoch) = cancelled_epoch(state.epoch, &generated, scores.as_deref()) {
        state.epoch = epoch;
        return Ok(Outcome {
            waited,
            cancelled: true,
        });
    }
    let fragment = reward_fragment(
        cfg,
        state,
        &prompts,
        generated,
        scores,
        admission.rollout_version,
    )?;
    deliver(pool, fragment, admission, cfg.timeout, &cfg.model).await?;
    Ok(Outcome {
        waited,
        cancelled: false,
    })
}

/// Asks the controller to admit a rollout of the model (blocking as the sync mode says).
///
/// # Errors
/// The controller's refusal; a timeout or a stopped controller.
async fn admit(cfg: &GenRolloutConfig, controller: &ControllerLink) -> Result<Admission> {
    controller
        .await_rollout
        .send(AwaitRollout {
            model: cfg.model.clone(),
            engine: None,
        })
        .timeout(cfg.admission_timeout)
        .await
        .map_err(|e| {
            Error::unanswered(
                e,
                cfg.admission_timeout,
                format!("the controller to admit a rollout of model `{}`", cfg.model),
            )
        })?
}

/// Spawns `group_size` [`Generate`] requests per prompt, one new group per prompt, each with
/// its own sampling seed. Every request is in the engine's queue before the first answer is
/// awaited: they are decoded together.
fn spawn_generations<T: Task>(
    cfg: &GenRolloutConfig,
    state: &mut GenState<T>,
    engine: &Recipient<Generate>,
    prompts: &[Vec<Token>],
) -> Vec<PendingGeneration> {
    let sampling = state.task.sampling();
    let mut pending = Vec::with_capacity(prompts.len() * cfg.group_size);
    for (i, prompt) in prompts.iter().enumerate() {
        let group = ((cfg.worker as u64) << 40) | state.groups;
        state.groups += 1;
        for _ in 0..cfg.group_size {
            let request = Generate {
                model: cfg.model.clone(),
                prompt: prompt.clone(),
                params: SamplingParams {
                    seed: state.rng.random(),
                    ..sampling
                },
                epoch: Some(state.epoch),
            };
            let job = generate_whole(engine.clone(), request, cfg.timeout, cfg.max_regenerations);
            pending.push((i, group, actix_rt::spawn(job)));
        }
    }
    pending
}

/// The answers of the spawned requests, in order (a request whose task failed answers
/// [`Error::Actor`]).
async fn await_generations(
    cfg: &GenRolloutConfig,
    pending: Vec<PendingGeneration>,
) -> Vec<Generated> {
    let mut generated = Vec::with_capacity(pending.len());
    for (prompt, group, job) in pending {
        let answer = job.await.map_err(|e| {
            Error::Actor(format!(
                "a epoch request of model `{}` failed on its task: {e}",
                cfg.model
            ))
        });
        generated.push(Generated {
            prompt,
            group,
            answer: answer.and_then(|a| a),
        });
    }
    generated
}

/// The engine's cancellation epoch to learn when any generation or scoring was
/// cancelled (the fragment is then dropped); `None` when none was.
///
/// The epoch is learnt from a refusal (which carries it); requests ended in flight
/// only say it moved on from `known`, at least once: the next fragment tries one more, and
/// a refusal corrects it.
fn cancelled_epoch(
    known: u64,
    generated: &[Generated],
    scores: Option<&[Result<(Completion, u32)>]>,
) -> Option<u64> {
    let mut refused_at: Option<u64> = None;
    let mut ended_in_flight = false;
    let answers = generated
        .iter()
        .map(|g| &g.answer)
        .chain(scores.into_iter().flatten());
    for answer in answers {
        match answer {
            Err(Error::Cancelled { epoch }) => {
                refused_at = refused_at.max(Some(*epoch));
            }
            Ok((c, _)) if c.finish == Finish::Cancelled => ended_in_flight = true,
            _ => {}
        }
    }
    if refused_at.is_some() || ended_in_flight {
        Some(refused_at.unwrap_or(known + 1))
    } else {
        None
    }
}

/// The fragment of the generated completions, each rewarded by the task (and given its
/// reference log-probabilities when scored); episodes not tagged by the engine are stamped
/// with `rollout_version`.
///
/// # Errors
/// The first failed generation or scoring; the task's reward error; [`Error::Config`] when
/// the task's per-token rewards do not match a completion's length.
fn reward_fragment<T: Task>(
    cfg: &GenRolloutConfig,
    state: &mut GenState<T>,
    prompts: &[Vec<Token>],
    generated: Vec<Generated>,
    scores: Option<Vec<Result<(Completion, u32)>>>,
    rollout_version: Version,
) -> Result<Batch> {
    let mut scores = scores.map(Vec::into_iter);
    let mut fragment = Batch::default();
    for (index, g) in generated.into_iter().enumerate() {
        let (completion, _) = g.answer?;
        let ref_logprobs = match scores.as_mut().and_then(Iterator::next) {
            Some(scored) => Some(scored?.0.logprobs),
            None => None,
        };
        let prompt = &prompts[g.prompt];
        let reward = state.task.reward(prompt, &completion.tokens)?;
        if let Some(per_token) = &reward.per_token
            && per_token.len() != completion.tokens.len()
        {
            return Err(Error::Config(format!(
                "model `{}`: the task gave {} per-token rewards for a completion of {} tokens",
                cfg.model,
                per_token.len(),
                completion.tokens.len()
            )));
        }
        fragment.episodes.push(EpisodeStats {
            traj_id: None,
            ret: f64::from(reward.total),
            len: u32::try_from(completion.tokens.len()).unwrap_or(u32::MAX),
            worker: cfg.worker,
            env: index,
            version: completion.newest_version().unwrap_or(rollout_version),
        });
        fragment.sequences.push(Sequence {
            prompt: prompt.clone(),
            tokens: completion.tokens,
            logprobs: completion.logprobs,
            versions: completion.versions,
            reward: reward.total,
            token_rewards: reward.per_token,
            group: g.group,
            finish: completion.finish,
            worker: cfg.worker,
            ref_logprobs,
        });
    }
    fragment.frames = fragment.sequences.len();
    Ok(fragment)
}

/// Scores every generated completion under `reference`, all requests in the engine's queue
/// at once; one answer per completion, in order (a failed generation's error is repeated).
///
/// # Errors
/// [`Error::Config`] when the worker has no scorer.
async fn score<T: Task>(
    cfg: &GenRolloutConfig,
    reference: &ModelId,
    scorer: Option<Recipient<Score>>,
    state: &GenState<T>,
    prompts: &[Vec<Token>],
    generated: &[Generated],
) -> Result<Vec<Result<(Completion, u32)>>> {
    let scorer = scorer.ok_or_else(|| {
        Error::Config(format!(
            "model `{}`: the worker scores under `{reference}` and was given no scorer",
            cfg.model
        ))
    })?;
    let temperature = state.task.sampling().temperature;
    let mut jobs = Vec::with_capacity(generated.len());
    for g in generated {
        jobs.push(match &g.answer {
            // an empty completion has nothing to score
            Ok((c, _)) if !c.tokens.is_empty() => {
                let request = Score {
                    model: reference.clone(),
                    prompt: prompts[g.prompt].clone(),
                    tokens: c.tokens.clone(),
                    temperature,
                    epoch: Some(state.epoch),
                };
                let job =
                    generate_whole(scorer.clone(), request, cfg.timeout, cfg.max_regenerations);
                Some(actix_rt::spawn(job))
            }
            _ => None,
        });
    }
    let mut out = Vec::with_capacity(jobs.len());
    for (job, g) in jobs.into_iter().zip(generated) {
        out.push(match (job, &g.answer) {
            (Some(job), _) => job.await.map_err(|e| {
                Error::Actor(format!(
                    "a scoring request of model `{reference}` failed on its task: {e}"
                ))
            })?,
            (None, Ok((c, _))) => Ok((c.clone(), 0)),
            (None, Err(e)) => Err(Error::Actor(format!("not scored: {e}"))),
        });
    }
    Ok(out)
}
