//! What collectors produce: transitions, batches, trajectory ids, replay buffers.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::Rng;
use rand::rngs::SmallRng;
use refit_runtime::Version;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::generation::{Finish, Token, check_logprobs, check_per_token};

/// An observation as a transition holds it: up to [`Observation::INLINE`] values live in
/// the transition itself, so that collecting a step of a small environment (CartPole's
/// four values) allocates nothing beyond what the environment's step did; longer ones live
/// on the heap. It reads as a `[f32]` and crosses the wire as a sequence, as a `Vec<f32>`
/// does.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Observation(smallvec::SmallVec<[f32; Observation::INLINE]>);

impl Observation {
    /// Values kept inline, without a heap allocation.
    pub const INLINE: usize = 8;

    /// A copy of `values`.
    pub fn from_slice(values: &[f32]) -> Self {
        Self(smallvec::SmallVec::from_slice(values))
    }
}

impl std::ops::Deref for Observation {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl std::fmt::Debug for Observation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl From<Vec<f32>> for Observation {
    /// Takes the values of `values` (inline when they fit, freeing the vector).
    fn from(values: Vec<f32>) -> Self {
        Self(smallvec::SmallVec::from_vec(values))
    }
}

impl From<&[f32]> for Observation {
    fn from(values: &[f32]) -> Self {
        Self::from_slice(values)
    }
}

impl PartialEq<Vec<f32>> for Observation {
    fn eq(&self, other: &Vec<f32>) -> bool {
        **self == **other
    }
}

impl PartialEq<[f32]> for Observation {
    fn eq(&self, other: &[f32]) -> bool {
        **self == *other
    }
}

/// One environment step, with the collector's bookkeeping.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    /// Observation the policy acted on.
    pub obs: Observation,
    /// The action taken.
    pub action: usize,
    /// Log-probability of `action` under the policy that acted (version `version`).
    pub log_prob: f32,
    /// Reward of the step.
    pub reward: f32,
    /// Observation after the step (terminal observation when the episode ended; the env
    /// was then reset and the reset observation went to the carrier, not here).
    pub next_obs: Observation,
    /// The episode reached a terminal state.
    pub terminated: bool,
    /// The episode was cut by a time limit.
    pub truncated: bool,
    /// Trajectory id (`None` when `track_traj_ids` is off).
    pub traj_id: Option<u64>,
    /// Version of the policy weights that chose `action`.
    pub version: Version,
    /// Index of the worker that collected it (0 for a single collector).
    pub worker: usize,
    /// Index of the environment inside its worker.
    pub env: usize,
    /// Step index inside its episode (0 for the first step after a reset).
    pub step: u32,
}

impl Transition {
    /// True when the episode ended here.
    pub fn done(&self) -> bool {
        self.terminated || self.truncated
    }
}

/// An episode that ended during a batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpisodeStats {
    /// Its trajectory id, when tracked.
    pub traj_id: Option<u64>,
    /// Undiscounted return.
    pub ret: f64,
    /// Number of steps.
    pub len: u32,
    /// Worker that ran it.
    pub worker: usize,
    /// Environment index inside the worker.
    pub env: usize,
    /// Policy version of its last step.
    pub version: Version,
}

/// One generated completion as a training sample: the prompt, what the engine generated,
/// under which versions, and what the task's reward function made of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    /// The prompt tokens.
    pub prompt: Vec<Token>,
    /// The generated tokens.
    pub tokens: Vec<Token>,
    /// Log-probability of each token under the behaviour policy (the engine's weights that
    /// produced it).
    pub logprobs: Vec<f32>,
    /// The weight version that produced each token.
    pub versions: Vec<Version>,
    /// The completion's reward.
    pub reward: f32,
    /// Per-token credit, when the task gives one (one value per generated token).
    pub token_rewards: Option<Vec<f32>>,
    /// Completions of one prompt share a group id (GRPO's advantages are relative within a
    /// group).
    pub group: u64,
    /// Why the completion ended.
    pub finish: Finish,
    /// Index of the rollout worker that collected it.
    pub worker: usize,
    /// Log-probability of each token under the reference model the engines serve beside
    /// the policy (`None` when the run serves none): what a KL term to that reference reads.
    #[serde(default)]
    pub ref_logprobs: Option<Vec<f32>>,
}

impl Sequence {
    /// The oldest version among its tokens (`None` when it has no token).
    pub fn oldest_version(&self) -> Option<Version> {
        self.versions.iter().copied().min()
    }

    /// True when its tokens came from more than one version (an update landed inside it).
    pub fn spans_versions(&self) -> bool {
        self.versions.windows(2).any(|w| w[0] != w[1])
    }

    /// What any learner needs of a sequence, its fault named by field: a prompt; one
    /// behaviour log-probability, one version (and one token reward, when given) per
    /// token; log-probabilities finite and at most 0 (an engine's rounding above 0 was
    /// taken to 0 when it answered); a finite reward.
    ///
    /// # Errors
    /// The field at fault and what it holds, as a message.
    pub fn check_fields(&self) -> std::result::Result<(), String> {
        if self.prompt.is_empty() {
            return Err("empty prompt".into());
        }
        check_per_token(
            self.tokens.len(),
            &[
                ("logprobs", Some(self.logprobs.len())),
                ("versions", Some(self.versions.len())),
                ("token_rewards", self.token_rewards.as_ref().map(Vec::len)),
                ("ref_logprobs", self.ref_logprobs.as_ref().map(Vec::len)),
            ],
        )?;
        check_logprobs(&self.logprobs, 0.0)?;
        if !self.reward.is_finite() {
            return Err(format!("reward {} is not finite", self.reward));
        }
        Ok(())
    }
}

/// One trajectory's place in a batch whose transitions were grouped by `split_trajs`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrajSpan {
    /// The trajectory id.
    pub traj_id: u64,
    /// Its transitions, in time order: `batch.transitions[range]`.
    pub range: Range<usize>,
}

/// What a collector yields per iteration.
///
/// Transitions are in step order, environments side by side (`t0 env0, t0 env1, .., t1
/// env0, ..`); with `split_trajs` they are regrouped so each trajectory is contiguous and
/// `trajectories` lists the spans. With direct replay-buffer writes `transitions` is empty
/// and `frames` still counts what was written.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Batch {
    /// The transitions (empty with direct replay-buffer writes).
    pub transitions: Vec<Transition>,
    /// Trajectory spans when `split_trajs` is on.
    pub trajectories: Option<Vec<TrajSpan>>,
    /// Episodes that ended in this batch.
    pub episodes: Vec<EpisodeStats>,
    /// Generated completions (a generating engine's samples; empty for environment steps).
    #[serde(default)]
    pub sequences: Vec<Sequence>,
    /// Frames collected: environment steps, or completions for generated samples.
    pub frames: usize,
    /// Time spent before the batch polling for and applying new weights (the longest of
    /// the workers' for a concatenated batch).
    pub weight_sync: Duration,
}

impl Batch {
    /// Lowest and highest policy versions of the transitions and of every generated token
    /// (`None` when empty).
    pub fn version_range(&self) -> Option<(Version, Version)> {
        let mut it = self.transitions.iter().map(|t| t.version).chain(
            self.sequences
                .iter()
                .flat_map(|s| s.versions.iter().copied()),
        );
        let first = it.next()?;
        Some(it.fold((first, first), |(lo, hi), v| (lo.min(v), hi.max(v))))
    }

    /// Mean return of the episodes that ended in this batch.
    pub fn mean_episode_return(&self) -> Option<f64> {
        if self.episodes.is_empty() {
            return None;
        }
        Some(self.episodes.iter().map(|e| e.ret).sum::<f64>() / self.episodes.len() as f64)
    }

    /// Regroups transitions so that each trajectory is contiguous and in time order, and
    /// fills [`Batch::trajectories`].
    ///
    /// # Errors
    /// [`Error::SplitTrajsWithoutTrajIds`] when a transition carries no trajectory id.
    pub fn split_trajs(&mut self) -> Result<()> {
        if self.transitions.iter().any(|t| t.traj_id.is_none()) {
            return Err(Error::SplitTrajsWithoutTrajIds);
        }
        // Stable: a trajectory's steps keep their time order.
        self.transitions.sort_by_key(|t| t.traj_id);
        let mut spans: Vec<TrajSpan> = Vec::new();
        for (i, t) in self.transitions.iter().enumerate() {
            let id = t.traj_id.unwrap_or_default();
            match spans.last_mut() {
                Some(s) if s.traj_id == id => s.range.end = i + 1,
                _ => spans.push(TrajSpan {
                    traj_id: id,
                    range: i..i + 1,
                }),
            }
        }
        self.trajectories = Some(spans);
        Ok(())
    }

    /// Concatenates batches (e.g. one per worker), keeping trajectory spans valid.
    pub fn concat(batches: impl IntoIterator<Item = Batch>) -> Batch {
        let mut out = Batch::default();
        let mut any_spans = false;
        let mut spans = Vec::new();
        for b in batches {
            let offset = out.transitions.len();
            if let Some(s) = b.trajectories {
                any_spans = true;
                spans.extend(s.into_iter().map(|s| TrajSpan {
                    traj_id: s.traj_id,
                    range: s.range.start + offset..s.range.end + offset,
                }));
            }
            out.transitions.extend(b.transitions);
            out.sequences.extend(b.sequences);
            out.episodes.extend(b.episodes);
            out.frames += b.frames;
            out.weight_sync = out.weight_sync.max(b.weight_sync);
        }
        if any_spans {
            out.trajectories = Some(spans);
        }
        out
    }
}

/// Hands out trajectory ids; clones share one counter, so ids never collide across the
/// workers (threads) that share a pool.
#[derive(Clone, Debug, Default)]
pub struct TrajPool(Arc<AtomicU64>);

impl TrajPool {
    /// A pool whose first id is 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// A pool whose first id is `start` (worker processes each draw from their own block).
    pub fn starting_at(start: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start)))
    }

    /// A fresh id.
    pub fn next_id(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }

    /// `n` fresh consecutive ids.
    pub fn take(&self, n: u64) -> Range<u64> {
        let start = self.0.fetch_add(n, Ordering::Relaxed);
        start..start + n
    }

    /// How many ids were handed out.
    pub fn issued(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Storage collectors write transitions into directly (instead of yielding them).
///
/// Shared between workers, hence `&self` methods.
pub trait ReplayBuffer: Send + Sync {
    /// Stores one transition.
    ///
    /// # Errors
    /// Whatever the storage reports.
    fn add(&self, transition: Transition) -> Result<()>;
    /// Number of transitions held.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `n` transitions drawn uniformly with replacement (empty when the buffer is).
    fn sample(&self, n: usize, rng: &mut SmallRng) -> Vec<Transition>;
}

/// A fixed-capacity ring buffer: once full, each new transition replaces the oldest.
#[derive(Debug)]
pub struct RingBuffer {
    capacity: usize,
    inner: Mutex<Ring>,
}

#[derive(Debug, Default)]
struct Ring {
    items: Vec<Transition>,
    next: usize,
    added: u64,
}

impl RingBuffer {
    /// A ring of `capacity` transitions.
    ///
    /// # Errors
    /// [`Error::Config`] when `capacity` is zero.
    pub fn new(capacity: usize) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::Config(
                "ring buffer capacity must be positive".into(),
            ));
        }
        Ok(Self {
            capacity,
            inner: Mutex::new(Ring::default()),
        })
    }

    /// Capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Transitions ever added (including overwritten ones).
    pub fn total_added(&self) -> u64 {
        self.lock().added
    }

    /// A copy of the contents, oldest first.
    pub fn snapshot(&self) -> Vec<Transition> {
        let r = self.lock();
        let (newer, older) = r.items.split_at(r.next.min(r.items.len()));
        if r.items.len() < self.capacity {
            r.items.clone()
        } else {
            older.iter().chain(newer).cloned().collect()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        // A panic in another writer leaves the ring consistent (writes are single pushes).
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ReplayBuffer for RingBuffer {
    fn add(&self, transition: Transition) -> Result<()> {
        let mut r = self.lock();
        if r.items.len() < self.capacity {
            r.items.push(transition);
        } else {
            let i = r.next;
            r.items[i] = transition;
        }
        r.next = (r.next + 1) % self.capacity;
        r.added += 1;
        Ok(())
    }

    fn len(&self) -> usize {
        self.lock().items.len()
    }

    fn sample(&self, n: usize, rng: &mut SmallRng) -> Vec<Transition> {
        let r = self.lock();
        if r.items.is_empty() {
            return Vec::new();
        }
        (0..n)
            .map(|_| r.items[rng.random_range(0..r.items.len())].clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{Observation, Sequence};
    use crate::generation::Finish;
    use refit_runtime::{Version, wire};

    #[test]
    fn a_sequence_a_learner_cannot_train_on_is_named_by_field() {
        let good = Sequence {
            prompt: vec![1, 2],
            tokens: vec![3, 4],
            logprobs: vec![-0.5, -1.0],
            versions: vec![Version(1), Version(2)],
            reward: 1.0,
            token_rewards: None,
            group: 0,
            finish: Finish::Stop,
            worker: 0,
            ref_logprobs: None,
        };
        assert_eq!(good.check_fields(), Ok(()));
        assert!(good.spans_versions());
        let one = Sequence {
            versions: vec![Version(2); 2],
            ..good.clone()
        };
        assert!(!one.spans_versions());
        let cases = [
            (
                Sequence {
                    logprobs: vec![],
                    ..good.clone()
                },
                "0 logprobs for 2 tokens",
            ),
            (
                Sequence {
                    versions: vec![Version(1)],
                    ..good.clone()
                },
                "1 versions for 2 tokens",
            ),
            (
                Sequence {
                    token_rewards: Some(vec![1.0]),
                    ..good.clone()
                },
                "1 token_rewards",
            ),
            (
                Sequence {
                    ref_logprobs: Some(vec![]),
                    ..good.clone()
                },
                "0 ref_logprobs",
            ),
            (
                Sequence {
                    logprobs: vec![-0.5, f32::NAN],
                    ..good.clone()
                },
                "logprobs[1] = NaN",
            ),
            (
                Sequence {
                    logprobs: vec![0.5, -1.0],
                    ..good.clone()
                },
                "logprobs[0] = 0.5",
            ),
            (
                Sequence {
                    reward: f32::INFINITY,
                    ..good.clone()
                },
                "reward inf",
            ),
            (
                Sequence {
                    prompt: vec![],
                    ..good.clone()
                },
                "empty prompt",
            ),
        ];
        // a learner takes no value above 0 (an engine's rounding was clamped before)
        let above = Sequence {
            logprobs: vec![5e-5, -1.0],
            ..good.clone()
        };
        assert!(above.check_fields().unwrap_err().contains("logprobs[0]"));
        for (s, says) in cases {
            let e = s.check_fields().unwrap_err();
            assert!(e.contains(says), "{says}: {e}");
        }
    }

    #[test]
    fn an_observation_reads_and_crosses_the_wire_as_a_vector() {
        for len in [0, 4, Observation::INLINE, Observation::INLINE + 1, 100] {
            let values: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
            let obs = Observation::from(values.clone());
            assert_eq!(&*obs, values.as_slice());
            assert_eq!(obs, values);
            assert_eq!(Observation::from_slice(&values), obs);
            // inline up to INLINE values, on the heap beyond
            assert_eq!(obs.0.spilled(), len > Observation::INLINE, "{len}");
            // the same bytes as a Vec<f32> on the wire, both ways
            let bytes = wire::encode(&obs).unwrap();
            assert_eq!(bytes, wire::encode(&values).unwrap());
            let back: Observation = wire::decode(&bytes, 1 << 20).unwrap();
            assert_eq!(back, obs);
            let as_vec: Vec<f32> = wire::decode(&bytes, 1 << 20).unwrap();
            assert_eq!(as_vec, values);
            assert_eq!(format!("{obs:?}"), format!("{values:?}"));
        }
    }
}
