//! What a run reports: per model ([`ModelReport`], one [`UpdateRecord`] per update), per
//! engine rank ([`RankReport`]), the ranks' deaths and rejoins ([`RankEvent`]), and the
//! whole run ([`RunReport`]).

use std::collections::BTreeMap;
use std::time::Duration;

use refit_runtime::sync_policy::StalenessStats;
use refit_runtime::{ModelId, Version};
use serde::{Deserialize, Serialize};

use crate::learner::LearnStats;
use crate::protocol::controller::ControllerStatus;
use crate::protocol::engine::EngineStats;
use crate::protocol::eval::EvalReport;
use crate::protocol::pool::FragmentInfo;
use crate::protocol::rollout::RolloutStats;

/// One training update of one model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UpdateRecord {
    /// The version the trainer was at when it took the batch (trained on it).
    pub train_version: Version,
    /// The version it published.
    pub published: Version,
    /// Frames trained on.
    pub frames: usize,
    /// Lowest and highest sample version in the batch.
    pub sample_versions: (Version, Version),
    /// Largest staleness in the batch.
    pub max_staleness: u64,
    /// Samples dropped as too stale while gathering it.
    pub dropped: u64,
    /// Samples evicted from a full pool while gathering it.
    pub evicted: u64,
    /// The batch's fragments: admissions and sample versions.
    pub fragments: Vec<FragmentInfo>,
    /// Mean return over the model's last 20 episodes (or its last batch of completions)
    /// after this batch.
    pub mean_return: f64,
    /// Time since the run started, when the version was published.
    pub elapsed: Duration,
    /// Training and publishing took this long.
    pub train: Duration,
    /// What the learner measured.
    pub learn: LearnStats,
    /// Completions of the batch whose tokens came from more than one version (an update
    /// landed inside them: `pause_mode = "keep"`).
    #[serde(default)]
    pub mixed: usize,
}

/// One model's run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelReport {
    /// Updates.
    pub updates: Vec<UpdateRecord>,
    /// Frames trained on.
    pub frames: u64,
    /// Episodes (or completions) finished.
    pub episodes: u64,
    /// Mean return over the last 20 episodes (or the last batch of completions).
    pub mean_return: f64,
    /// What the staleness filter kept and dropped.
    pub staleness: StalenessStats,
    /// Samples evicted from a full pool.
    pub evicted: u64,
    /// Validation results of the eval steps this trainer waited for.
    pub evals: Vec<EvalReport>,
    /// The rollout workers' statistics (of every rank, dead ones included).
    pub workers: Vec<RolloutStats>,
}

/// What one incarnation of an engine rank did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankReport {
    /// The rank.
    pub rank: u32,
    /// Which start of it (0, then one more per restart).
    pub incarnation: u32,
    /// Its engine's statistics (the last ones seen, for a rank that died).
    pub engine: EngineStats,
    /// Its rollout workers' statistics, per model.
    pub workers: BTreeMap<ModelId, Vec<RolloutStats>>,
    /// How it ended, when it died during the run.
    pub fate: Option<String>,
}

impl RankReport {
    /// A rank that did nothing yet.
    pub(super) fn empty(rank: u32, incarnation: u32) -> Self {
        Self {
            rank,
            incarnation,
            engine: EngineStats::default(),
            workers: BTreeMap::new(),
            fate: None,
        }
    }
}

/// Something that happened to a rank during the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankEvent {
    /// Time since the run started.
    pub at: Duration,
    /// The rank.
    pub rank: u32,
    /// Its incarnation.
    pub incarnation: u32,
    /// What happened.
    pub kind: RankEventKind,
}

/// What happened to a rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RankEventKind {
    /// It died (its connection closed, or it answered no ping for `dead_after_s`): why.
    Died(String),
    /// A new incarnation rejoined the run.
    Rejoined,
}

/// The ranks whose last event is a death (they did not come back).
pub(crate) fn gone_ranks(events: &[RankEvent]) -> std::collections::BTreeSet<u32> {
    let mut gone = std::collections::BTreeSet::new();
    for e in events {
        match e.kind {
            RankEventKind::Died(_) => gone.insert(e.rank),
            RankEventKind::Rejoined => gone.remove(&e.rank),
        };
    }
    gone
}

/// What rank 0's program says (as `error: ...` on stderr, which `refit launch` repeats as
/// the rank's cause) before it exits with status 1 because its run ended unsolved
/// ([`RunReport::solved`] false).
pub const UNSOLVED: &str = "the run ended unsolved: not every model reached its stop target \
                            within the update and time budget";

/// Ends rank 0's program because its run ended unsolved: [`UNSOLVED`] as one `error: ...`
/// line on stderr (what `refit launch` repeats as the rank's cause), then status 1.
pub fn exit_unsolved() -> ! {
    eprintln!("error: {UNSOLVED}");
    std::process::exit(1)
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// Per model.
    pub models: BTreeMap<ModelId, ModelReport>,
    /// The controller's final state and timeline.
    pub controller: ControllerStatus,
    /// The engines' load statistics, summed over every rank and incarnation.
    pub engine: EngineStats,
    /// Every engine rank's incarnations.
    pub ranks: Vec<RankReport>,
    /// Deaths and rejoins, in order.
    pub events: Vec<RankEvent>,
    /// Wall time.
    pub elapsed: Duration,
    /// True when the run stopped because every model reached a target (the stop rule's
    /// `target_return` or `target_eval`), not for its budget.
    pub solved: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(rank: u32, kind: RankEventKind) -> RankEvent {
        RankEvent {
            at: Duration::ZERO,
            rank,
            incarnation: 0,
            kind,
        }
    }

    #[test]
    fn a_rank_is_gone_when_its_last_event_is_a_death() {
        let died = || RankEventKind::Died("it answered no ping for 5s".into());
        let events = [
            event(1, died()),
            event(2, died()),
            event(1, RankEventKind::Rejoined),
            event(3, RankEventKind::Rejoined),
        ];
        assert_eq!(gone_ranks(&events).into_iter().collect::<Vec<_>>(), [2]);
        assert!(gone_ranks(&[]).is_empty());
    }
}
