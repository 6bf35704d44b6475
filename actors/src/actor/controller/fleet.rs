//! Stage-then-commit across a model's engines: the messages. Every engine stages the
//! version ([`StageModel`]: fetched and validated, nothing served), the decision
//! ([`super::commit::decide`]) says whether it commits ([`CommitModel`]) on the engines that
//! staged it, and which engines are fenced, or aborts it everywhere ([`AbortStage`]): the
//! fleet never serves a version some of its engines could not take while others serve it,
//! except the engines fenced from rollouts.

use std::collections::BTreeSet;
use std::time::Duration;

use refit_runtime::sync_policy::SyncOrder;
use refit_runtime::topology::Commit;
use refit_runtime::{ModelId, Version};

use super::commit::{EngineId, RESTAGE_ROUNDS, Staged, Verdict, decide};
use super::core::Landed;
use crate::error::{Error, RemoteFailure, Result};
use crate::protocol::engine::{
    AbortStage, CommitModel, EngineRef, LoadReport, StageModel, UpdateModel,
};

/// Slack on each message's deadline over the engine's own (its answer's way back).
const REPLY_SLACK: Duration = Duration::from_secs(1);

/// The engines of one load, how it commits, and which of them are fenced.
#[derive(Debug, Clone)]
pub(super) struct Fleet {
    /// The model.
    pub(super) model: ModelId,
    /// Every engine, with its id.
    pub(super) engines: Vec<(EngineId, EngineRef)>,
    /// The model's commit rule.
    pub(super) rule: Commit,
    /// The engines fenced from the model's rollouts now.
    pub(super) fenced: BTreeSet<EngineId>,
    /// Deadline of each stage and each commit.
    pub(super) timeout: Duration,
}

impl Fleet {
    /// Stages `order` everywhere, then commits it or aborts it everywhere (see the module
    /// documentation); answers the version the fleet serves now, the engines that serve it,
    /// the engines to fence, and damage reports.
    ///
    /// # Errors
    /// Committed nowhere: the decision's reason (the fleet keeps its version, whole); every
    /// engine gone.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped between stage and commit, the staged versions are dropped
    /// by the engines only when their hold passes.
    pub(super) async fn load(self, order: SyncOrder) -> Result<Landed> {
        let mut staged = self.stage(&self.engines, order.version).await;
        let mut rounds = RESTAGE_ROUNDS;
        let (version, commit, fence) = loop {
            match decide(self.rule, &staged, &self.fenced, rounds) {
                Verdict::Restage { version, engines } => {
                    rounds -= 1;
                    let again: Vec<(EngineId, EngineRef)> = self
                        .engines
                        .iter()
                        .filter(|(e, _)| engines.contains(e))
                        .cloned()
                        .collect();
                    for (e, s) in self.stage(&again, version).await {
                        if let Some(slot) = staged.iter_mut().find(|(id, _)| *id == e) {
                            slot.1 = s;
                        }
                    }
                }
                Verdict::Commit {
                    version,
                    commit,
                    fence,
                } => break (version, commit, fence),
                Verdict::Abort(why) => {
                    self.abort(&staged, &[]);
                    return Err(Error::Actor(format!(
                        "model `{}` v{} was committed on no engine: {why}; the fleet keeps \
                         serving its version",
                        order.model, order.version
                    )));
                }
            }
        };
        // the engines fenced with a version staged drop it
        self.abort(&staged, &commit);
        self.commit(&order, version, &commit, fence).await
    }

    /// Asks `engines` to stage `version`, all at once; answers each one's outcome.
    async fn stage(
        &self,
        engines: &[(EngineId, EngineRef)],
        version: Version,
    ) -> Vec<(EngineId, Staged)> {
        let model = &self.model;
        let requests: Vec<_> = engines
            .iter()
            .map(|(_, e)| {
                e.stage
                    .send(StageModel {
                        model: model.clone(),
                        version,
                        timeout: self.timeout,
                        // time for the slowest stage of the fleet and the commits after it
                        hold: self.timeout * 3,
                    })
                    .timeout(self.timeout + REPLY_SLACK)
            })
            .collect();
        let mut out = Vec::with_capacity(engines.len());
        for ((i, _), r) in engines.iter().zip(requests) {
            let s = match r.await {
                Ok(Ok(report)) => Staged::Ready {
                    version: report.version,
                    fresh: report.fresh,
                },
                Ok(Err(e)) if gone(&e) => {
                    tracing::warn!(engine = i, model = %model, "engine gone: {e}");
                    Staged::Gone
                }
                Ok(Err(e)) => Staged::Failed(e.to_string()),
                Err(e) => Staged::Failed(format!("no answer to the stage: {e}")),
            };
            out.push((*i, s));
        }
        out
    }

    /// Commits `version` on `commit`, all at once; an engine whose commit fails is fenced
    /// with the others in `fence`.
    async fn commit(
        &self,
        order: &SyncOrder,
        version: Version,
        commit: &[EngineId],
        mut fence: Vec<(EngineId, String)>,
    ) -> Result<Landed> {
        let requests: Vec<_> = self
            .engines
            .iter()
            .filter(|(e, _)| commit.contains(e))
            .map(|(i, e)| {
                let req = e
                    .commit
                    .send(CommitModel {
                        model: order.model.clone(),
                        version,
                        timeout: self.timeout,
                    })
                    .timeout(self.timeout + REPLY_SLACK);
                (*i, req)
            })
            .collect();
        let mut landed = Landed {
            served: version,
            ..Landed::default()
        };
        for (i, r) in requests {
            match r.await {
                Ok(Ok(report)) => {
                    damage(&mut landed, i, &report);
                    landed.committed.push(i);
                }
                Ok(Err(e)) if gone(&e) => {
                    tracing::warn!(engine = i, model = %order.model, "engine gone: {e}");
                }
                Ok(Err(e)) => fence.push((i, format!("commit of v{version} failed: {e}"))),
                Err(e) => fence.push((i, format!("no answer to the commit of v{version}: {e}"))),
            }
        }
        if landed.committed.is_empty() {
            let why: Vec<String> = fence
                .iter()
                .map(|(e, w)| format!("engine {e}: {w}"))
                .collect();
            return Err(Error::Actor(format!(
                "model `{}` v{version} was committed on no engine: {}",
                order.model,
                if why.is_empty() {
                    "every engine is gone".to_string()
                } else {
                    why.join("; ")
                }
            )));
        }
        landed.fenced = fence;
        Ok(landed)
    }

    /// Tells every engine that staged a new version, except `keep`, to drop it.
    fn abort(&self, staged: &[(EngineId, Staged)], keep: &[EngineId]) {
        let model = &self.model;
        for (i, e) in &self.engines {
            let held = staged
                .iter()
                .any(|(id, s)| id == i && matches!(s, Staged::Ready { fresh: true, .. }));
            if held && !keep.contains(i) {
                e.abort.do_send(AbortStage {
                    model: model.clone(),
                });
            }
        }
    }
}

/// Loads `order` on one engine (a rejoined engine, or a fenced one brought back): stage and
/// commit in one call.
///
/// # Errors
/// The engine's refusal; no answer within `timeout`.
///
/// # Cancel safety
/// Not cancel safe: dropped, the load may still land.
pub(super) async fn load_one(
    engine: &EngineRef,
    order: &SyncOrder,
    timeout: Duration,
) -> Result<LoadReport> {
    engine
        .update
        .send(UpdateModel {
            model: order.model.clone(),
            version: order.version,
            timeout,
        })
        .timeout(timeout + REPLY_SLACK)
        .await
        .map_err(|e| {
            Error::Actor(format!(
                "no answer to the load of model `{}` v{}: {e}",
                order.model, order.version
            ))
        })?
}

/// Whether `e` says the engine's process is gone.
fn gone(e: &Error) -> bool {
    matches!(e.remote_failure(), Some(RemoteFailure::PeerGone { .. }))
}

/// Records the damage `report` found on engine `i`.
pub(super) fn damage(landed: &mut Landed, i: EngineId, report: &LoadReport) {
    if let Some(d) = &report.damaged {
        landed.damaged.push(format!(
            "engine {i} served weights that changed after it applied them: {d} (v{} replaced them whole)",
            report.version
        ));
    }
}
