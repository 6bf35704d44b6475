//! The fleet's commit decision, without IO: after every engine of a model was asked to
//! stage a version, which engines commit it, which restage a newer one first, which are
//! fenced, or whether it is aborted everywhere. The controller's actor sends the messages
//! ([`super::fleet`]); this module only decides.

use std::collections::BTreeSet;

use refit_runtime::Version;
use refit_runtime::topology::Commit;

/// Engines are named by their id in the controller's set (a run's engine rank).
pub(crate) type EngineId = usize;

/// One engine's answer to a stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Staged {
    /// It holds `version` for a commit (`fresh`), or already serves it (the inlet had
    /// nothing newer).
    Ready { version: Version, fresh: bool },
    /// It could not stage: the error, as text.
    Failed(String),
    /// Its process is gone: it leaves the fleet and does not count.
    Gone,
}

/// What to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Some engines staged an older version than the newest staged (an inlet brought a
    /// newer one meanwhile): stage `version` again on `engines`, then decide again.
    Restage {
        version: Version,
        engines: Vec<EngineId>,
    },
    /// Commit `version` on `commit`; `fence` the engines that could not stage it (each with
    /// why): they keep serving their previous version, whole, and get no rollouts.
    Commit {
        version: Version,
        commit: Vec<EngineId>,
        fence: Vec<(EngineId, String)>,
    },
    /// Commit nowhere (drop what is staged): the fleet keeps its version. Says why.
    Abort(String),
}

/// How many rounds of restaging a decision allows before the engines still behind count as
/// failed (each round waits for the newer version on the engines behind).
pub(crate) const RESTAGE_ROUNDS: usize = 3;

/// Decides after a round of staging. `staged` holds every engine's latest answer; `fenced`
/// the engines fenced already (under `all` they do not hold the fleet back: they are
/// repaired when they stage, and stay fenced when they do not); `rounds_left` how many
/// restages are still allowed.
pub(crate) fn decide(
    rule: Commit,
    staged: &[(EngineId, Staged)],
    fenced: &BTreeSet<EngineId>,
    rounds_left: usize,
) -> Verdict {
    let ready = || {
        staged.iter().filter_map(|(e, s)| match s {
            Staged::Ready { version, .. } => Some((*e, *version)),
            _ => None,
        })
    };
    let Some(top) = ready().map(|(_, v)| v).max() else {
        let why = failures(staged, &[]);
        return Verdict::Abort(if why.is_empty() {
            "no engine is left to stage on".into()
        } else {
            format!("no engine staged it: {why}")
        });
    };
    let behind: Vec<EngineId> = ready().filter(|(_, v)| *v < top).map(|(e, _)| e).collect();
    if !behind.is_empty() && rounds_left > 0 {
        return Verdict::Restage {
            version: top,
            engines: behind,
        };
    }
    let commit: Vec<EngineId> = ready().filter(|(_, v)| *v == top).map(|(e, _)| e).collect();
    let mut fence: Vec<(EngineId, String)> = staged
        .iter()
        .filter_map(|(e, s)| match s {
            Staged::Failed(why) => Some((*e, why.clone())),
            Staged::Ready { version, .. } if *version < top => Some((
                *e,
                format!("staged v{version} while the fleet staged v{top}"),
            )),
            _ => None,
        })
        .collect();
    let live = staged.iter().filter(|(_, s)| *s != Staged::Gone).count();
    let enough = match rule {
        // an engine fenced already does not hold the fleet back
        Commit::All => fence.iter().all(|(e, _)| fenced.contains(e)),
        Commit::Quorum(n) => commit.len() >= n as usize,
    };
    if !enough {
        return Verdict::Abort(format!(
            "{} of {live} engines staged v{top}, and `commit = {rule}` needs {}: {}",
            commit.len(),
            match rule {
                Commit::All => live.to_string(),
                Commit::Quorum(n) => n.to_string(),
            },
            failures(staged, &fence)
        ));
    }
    fence.sort_by_key(|(e, _)| *e);
    Verdict::Commit {
        version: top,
        commit,
        fence,
    }
}

/// `engine 1: why; engine 3: why`, from the failed stages (or `fence`, when given).
fn failures(staged: &[(EngineId, Staged)], fence: &[(EngineId, String)]) -> String {
    let list: Vec<String> = if fence.is_empty() {
        staged
            .iter()
            .filter_map(|(e, s)| match s {
                Staged::Failed(why) => Some(format!("engine {e}: {why}")),
                _ => None,
            })
            .collect()
    } else {
        fence
            .iter()
            .map(|(e, why)| format!("engine {e}: {why}"))
            .collect()
    };
    list.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(v: u64) -> Staged {
        Staged::Ready {
            version: Version(v),
            fresh: true,
        }
    }

    fn failed() -> Staged {
        Staged::Failed("fetch timed out".into())
    }

    const NONE: &BTreeSet<EngineId> = &BTreeSet::new();

    #[test]
    fn all_commits_only_when_every_live_engine_staged() {
        let v = decide(Commit::All, &[(0, ready(2)), (1, ready(2))], NONE, 3);
        assert_eq!(
            v,
            Verdict::Commit {
                version: Version(2),
                commit: vec![0, 1],
                fence: vec![]
            }
        );
        // one failure aborts everywhere, naming the engine and why
        let Verdict::Abort(why) = decide(Commit::All, &[(0, ready(2)), (1, failed())], NONE, 3)
        else {
            panic!("not aborted")
        };
        assert!(why.contains("1 of 2 engines staged v2"), "{why}");
        assert!(why.contains("engine 1: fetch timed out"), "{why}");
        // a gone engine does not count
        let v = decide(Commit::All, &[(0, ready(2)), (1, Staged::Gone)], NONE, 3);
        assert!(matches!(v, Verdict::Commit { ref commit, .. } if commit == &[0]));
        // nobody left
        let v = decide(Commit::All, &[(0, Staged::Gone)], NONE, 3);
        assert!(
            matches!(v, Verdict::Abort(ref w) if w.contains("no engine")),
            "{v:?}"
        );
    }

    #[test]
    fn all_is_not_held_back_by_a_fenced_engine() {
        let fenced = BTreeSet::from([1]);
        let v = decide(Commit::All, &[(0, ready(3)), (1, failed())], &fenced, 3);
        assert_eq!(
            v,
            Verdict::Commit {
                version: Version(3),
                commit: vec![0],
                fence: vec![(1, "fetch timed out".into())]
            }
        );
    }

    #[test]
    fn quorum_commits_and_fences_the_stragglers() {
        let staged = [(0, ready(4)), (1, failed()), (2, ready(4))];
        let v = decide(Commit::Quorum(2), &staged, NONE, 3);
        assert_eq!(
            v,
            Verdict::Commit {
                version: Version(4),
                commit: vec![0, 2],
                fence: vec![(1, "fetch timed out".into())]
            }
        );
        let Verdict::Abort(why) = decide(Commit::Quorum(3), &staged, NONE, 3) else {
            panic!("not aborted")
        };
        assert!(why.contains("needs 3"), "{why}");
    }

    #[test]
    fn engines_behind_restage_the_newest_then_count_as_failed() {
        let staged = [(0, ready(5)), (1, ready(4)), (2, ready(5))];
        assert_eq!(
            decide(Commit::All, &staged, NONE, 1),
            Verdict::Restage {
                version: Version(5),
                engines: vec![1]
            }
        );
        // out of rounds: behind is a failure (all aborts, a quorum fences it)
        assert!(matches!(
            decide(Commit::All, &staged, NONE, 0),
            Verdict::Abort(ref w) if w.contains("staged v4 while the fleet staged v5")
        ));
        assert!(matches!(
            decide(Commit::Quorum(2), &staged, NONE, 0),
            Verdict::Commit { ref fence, .. } if fence.len() == 1 && fence[0].0 == 1
        ));
        // an engine that serves the newest already (not fresh) commits as a no-op
        let staged = [
            (0, ready(5)),
            (
                1,
                Staged::Ready {
                    version: Version(5),
                    fresh: false,
                },
            ),
        ];
        assert!(matches!(
            decide(Commit::All, &staged, NONE, 3),
            Verdict::Commit { ref commit, .. } if commit == &[0, 1]
        ));
    }
}
