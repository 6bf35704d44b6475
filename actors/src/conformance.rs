//! The engine contract's conformance suite: what the controller relies on of an engine's
//! weight plane ([`EngineRef`]), checked through the reference alone, so that it runs the
//! same against an engine of this process, one another process serves over the node
//! layer, or any implementation of the wire contract (a Python engine rank).
//!
//! [`weight_plane`] drives one model of an engine through loads, stage-then-commit, aborts,
//! a hold that runs out, a commit of the wrong version and a fetch that times out, and
//! checks after each what the engine serves. The caller publishes the versions the engine
//! fetches ([`Publish`]). Every check is named: a failure says which, what was asked and
//! what the engine answered.
//!
//! ```text
//! let passed = refit_actors::conformance::weight_plane(&engine, &model, &mut publisher).await?;
//! assert_eq!(passed.len(), refit_actors::conformance::CHECKS.len());
//! ```
//!
//! [`backend`] runs it on an [`EngineBackend`] (a Python engine, vLLM's) in an engine and a
//! system of its own, with the publisher made for it: what `refit.engine.conformance` runs.
//! [`backend_applied`] runs it on a model the backend takes in as a topology's
//! `apply = "streaming"` has it (pulled inside each commit, tensor by tensor): the
//! controller's view of the weight plane is the same, so the checks are too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Actor;
use refit_runtime::link::connect_applied;
use refit_runtime::topology::Apply;
use refit_runtime::{
    Manifest, Manifests, ModelId, PendingSend, ReceiverInit, Sender, SenderInit, Version, WeightSet,
};
use refit_transports::inproc::{InProc, InProcSender};

use crate::actor::{BackendEngine, EngineBackend};
use crate::generation::PauseMode;

use crate::error::{Error, Result};
use crate::protocol::engine::{
    AbortStage, CancelInFlight, CommitModel, EngineRef, GetEngineStats, LoadReport, ServedVersions,
    StageModel, StageReport, UpdateModel,
};

/// Makes versions of the model available to the engine under test (through the sender its
/// inlet pulls from).
pub trait Publish {
    /// Publishes `version` (without waiting for the engine to take it).
    ///
    /// # Errors
    /// A sender that cannot publish.
    fn publish(&mut self, version: Version) -> Result<()>;
}

// ANCHOR: checks
/// The checks [`weight_plane`] runs, in order.
pub const CHECKS: [&str; 8] = [
    "load",
    "load-served",
    "stage-then-commit",
    "abort",
    "hold-expires",
    "commit-mismatch",
    "fetch-timeout",
    "cancel-epochs",
];
// ANCHOR_END: checks

/// How long the in-process sender and receiver of [`backend`] take to connect at most.
const CONNECT: Duration = Duration::from_secs(10);

/// Runs the suite on `model` of `backend`, served by a [`BackendEngine`] of its own in an
/// actix system of its own, its versions published through an in-process sender in the
/// backend's layout ([`EngineBackend::manifest`]), every element zero (the suite checks
/// what is served, not what is computed), under `pause_mode = "keep"` as a topology's
/// default (a backend that commits in flight is committed during its batches). Blocking.
///
/// # Errors
/// A layout the backend does not give, a sender or receiver that does not connect, or the
/// first check that fails, naming it.
///
/// # Panics
/// Called inside an async runtime (an actix system, a tokio runtime): its own system
/// cannot start there.
pub fn backend<B: EngineBackend>(backend: B, model: &ModelId) -> Result<Vec<&'static str>> {
    backend_applied(backend, model, Apply::Staged)
}

/// [`backend`] with the model taken in as `apply` says: under [`Apply::Streaming`], the
/// engine pulls each version inside its commit through a streaming inlet and hands it to
/// [`EngineBackend::commit_streamed`] tensor by tensor (a backend that does not stream is
/// refused before any check, naming it). The checks are [`weight_plane_applied`]'s.
/// Blocking.
///
/// # Errors
/// As [`backend`]; [`Error::Config`] under [`Apply::Streaming`] for a backend that does not
/// stream ([`EngineBackend::streams`]), naming it.
///
/// # Panics
/// As [`backend`].
pub fn backend_applied<B: EngineBackend>(
    backend: B,
    model: &ModelId,
    apply: Apply,
) -> Result<Vec<&'static str>> {
    let manifest = backend.manifest(model)?;
    let first = zeros(model, &manifest, Version(1));
    let manifests = Manifests::new([(model.clone(), Arc::clone(&manifest))])?;
    let hub = InProc::new();
    let receiver = ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
    let receiving = std::thread::spawn(move || connect_applied(receiver, apply, CONNECT));
    let sender = SenderInit::new(hub.sender()?, manifests).connect(vec![first], CONNECT);
    let received = receiving
        .join()
        .map_err(|_| Error::Actor("the suite's receiver thread panicked".into()))?;
    // the sender's error first: a receiver left without one times out
    let sender = sender?;
    let inlet = received?;
    let mut publisher = Zeroed {
        sender,
        manifest,
        model: model.clone(),
        pending: Vec::new(),
    };
    actix_rt::System::new().block_on(async {
        // the topology's default: a backend that commits in flight is committed so
        let mut engine = BackendEngine::new(Arc::new(backend), vec![(model.clone(), inlet)])?
            .pause_mode(PauseMode::Keep);
        if apply == Apply::Streaming {
            engine = engine.streamed(model)?;
        }
        weight_plane_applied(
            &EngineRef::local(&engine.start()),
            model,
            &mut publisher,
            apply,
        )
        .await
    })
}

/// [`backend`]'s publisher: versions of zeros (version 1 went at connect).
struct Zeroed {
    sender: Sender<InProcSender>,
    manifest: Arc<Manifest>,
    model: ModelId,
    /// Kept to the end (dropped, a send still goes; its acknowledgement is not waited for).
    pending: Vec<PendingSend>,
}

impl Publish for Zeroed {
    fn publish(&mut self, version: Version) -> Result<()> {
        if version > Version(1) {
            let ws = zeros(&self.model, &self.manifest, version);
            self.pending.push(self.sender.send_async(vec![ws])?);
        }
        Ok(())
    }
}

/// `version` of `model`, zeros in `manifest`'s layout.
fn zeros(model: &ModelId, manifest: &Arc<Manifest>, version: Version) -> WeightSet {
    let mut ws = WeightSet::zeroed(model.clone(), Arc::clone(manifest));
    ws.set_version(version);
    ws
}

/// How long each call of the suite may take before it counts as unanswered.
const CALL: Duration = Duration::from_secs(30);

/// How long a stage is held in the check that lets its hold run out.
const SHORT_HOLD: Duration = Duration::from_millis(200);

/// How long a fetch of a version never published is given.
const SHORT_FETCH: Duration = Duration::from_millis(300);

/// Runs the suite on `model` of `engine`, which must serve no version of it newer than 0
/// yet and whose inlet is fed by `publish`. Answers the checks passed ([`CHECKS`], all of
/// them).
///
/// # Errors
/// The first check that fails, naming it, what was asked and what the engine answered.
///
/// # Cancel safety
/// Not cancel safe: dropped mid-way, the engine may hold a staged version until its hold
/// runs out.
pub async fn weight_plane(
    engine: &EngineRef,
    model: &ModelId,
    publish: &mut dyn Publish,
) -> Result<Vec<&'static str>> {
    weight_plane_applied(engine, model, publish, Apply::Staged).await
}

/// [`weight_plane`] on a model the engine takes in as `apply` says. The checks and what
/// they expect are the same but at `fetch-timeout`: a staged engine asked for a version
/// never published keeps the one it serves, whatever was published meanwhile; a streaming
/// one takes every version newer than its own in turn, so the one published and never
/// served comes in whole first, and is served when the load fails, naming both.
///
/// # Errors
/// As [`weight_plane`].
///
/// # Cancel safety
/// As [`weight_plane`].
pub async fn weight_plane_applied(
    engine: &EngineRef,
    model: &ModelId,
    publish: &mut dyn Publish,
    apply: Apply,
) -> Result<Vec<&'static str>> {
    let s = Suite { engine, model };
    let mut passed = Vec::new();
    let start = s.served("initial").await?;
    if start > Version::ZERO {
        return Err(fail(
            "initial",
            format!("the engine serves v{start} already; the suite starts from none"),
        ));
    }
    let loads = s.loads("load").await?;
    publish.publish(Version(1))?;
    let r = s.update("load", 1, CALL).await?;
    s.expect("load", r.version == Version(1), &r)?;
    s.serves("load", 1).await?;
    let after = s.loads("load").await?;
    s.expect(
        "load",
        after == loads + 1,
        &format!("{after} loads after {loads}"),
    )?;
    passed.push("load");

    let r = s.update("load-served", 1, CALL).await?;
    s.expect(
        "load-served",
        r.version == Version(1) && r.paused.is_zero(),
        &r,
    )?;
    let again = s.loads("load-served").await?;
    s.expect(
        "load-served",
        again == after,
        &format!("{again} loads after {after}"),
    )?;
    passed.push("load-served");

    publish.publish(Version(2))?;
    let st = s.stage("stage-then-commit", 2, CALL).await?;
    s.expect(
        "stage-then-commit",
        st.fresh && st.version == Version(2),
        &st,
    )?;
    s.serves("stage-then-commit", 1).await?;
    let r = s.commit("stage-then-commit", 2).await?;
    s.expect("stage-then-commit", r.version == Version(2), &r)?;
    s.serves("stage-then-commit", 2).await?;
    passed.push("stage-then-commit");

    publish.publish(Version(3))?;
    let st = s.stage("abort", 3, CALL).await?;
    s.expect("abort", st.fresh && st.version == Version(3), &st)?;
    s.abort("abort").await?;
    s.serves("abort", 2).await?;
    s.refused("abort", s.commit_raw(3).await, &["v3"])?;
    passed.push("abort");

    let st = s.stage("hold-expires", 3, SHORT_HOLD).await?;
    s.expect("hold-expires", st.fresh, &st)?;
    actix_rt::time::sleep(SHORT_HOLD * 3).await;
    s.refused("hold-expires", s.commit_raw(3).await, &["v3"])?;
    // the lock went with it: a load goes through
    let r = s.update("hold-expires", 3, CALL).await?;
    s.expect("hold-expires", r.version == Version(3), &r)?;
    passed.push("hold-expires");

    publish.publish(Version(4))?;
    let st = s.stage("commit-mismatch", 4, CALL).await?;
    s.expect("commit-mismatch", st.version == Version(4), &st)?;
    s.refused("commit-mismatch", s.commit_raw(5).await, &["v5", "v4"])?;
    s.serves("commit-mismatch", 3).await?;
    passed.push("commit-mismatch");

    // v4 is published and not served: a staged engine fetches at least v9 and keeps v3; a
    // streaming one streams v4 whole on its way to v9, serves it, and fails naming both
    // (its transfer is given a few seconds past the running batch, whatever the load's
    // timeout)
    let (served, named, slack): (u64, &[&str], u64) = match apply {
        Apply::Staged => (3, &[], 10),
        Apply::Streaming => (4, &["v9", "v4"], 20),
    };
    let asked = Instant::now();
    let r = s.update_raw(9, SHORT_FETCH).await;
    let took = asked.elapsed();
    s.refused("fetch-timeout", r, named)?;
    s.expect(
        "fetch-timeout",
        took < SHORT_FETCH + Duration::from_secs(slack),
        &format!("answered after {took:?}"),
    )?;
    s.serves("fetch-timeout", served).await?;
    passed.push("fetch-timeout");

    let a = s.cancel("cancel-epochs").await?;
    let b = s.cancel("cancel-epochs").await?;
    s.expect("cancel-epochs", b > a, &format!("epoch {a} then {b}"))?;
    passed.push("cancel-epochs");
    Ok(passed)
}

fn fail(check: &str, what: String) -> Error {
    Error::Actor(format!("engine contract, check `{check}`: {what}"))
}

struct Suite<'a> {
    engine: &'a EngineRef,
    model: &'a ModelId,
}

impl Suite<'_> {
    fn expect(&self, check: &str, ok: bool, got: &dyn std::fmt::Debug) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(fail(check, format!("the engine answered {got:?}")))
        }
    }

    async fn served(&self, check: &str) -> Result<Version> {
        let versions = self
            .engine
            .versions
            .send(ServedVersions)
            .timeout(CALL)
            .await
            .map_err(|e| fail(check, format!("ServedVersions unanswered: {e}")))?;
        versions
            .get(self.model)
            .copied()
            .ok_or_else(|| fail(check, format!("the engine does not serve `{}`", self.model)))
    }

    async fn serves(&self, check: &str, want: u64) -> Result<()> {
        let v = self.served(check).await?;
        self.expect(
            check,
            v == Version(want),
            &format!("serves v{v}, not v{want}"),
        )
    }

    async fn loads(&self, check: &str) -> Result<u64> {
        let stats = self
            .engine
            .stats
            .send(GetEngineStats)
            .timeout(CALL)
            .await
            .map_err(|e| fail(check, format!("GetEngineStats unanswered: {e}")))?;
        Ok(stats.loads)
    }

    async fn update_raw(&self, version: u64, timeout: Duration) -> Result<LoadReport> {
        let msg = UpdateModel {
            model: self.model.clone(),
            version: Version(version),
            timeout,
        };
        self.engine
            .update
            .send(msg)
            .timeout(CALL + timeout)
            .await
            .map_err(|e| Error::Actor(format!("UpdateModel unanswered: {e}")))?
    }

    async fn update(&self, check: &str, version: u64, timeout: Duration) -> Result<LoadReport> {
        self.update_raw(version, timeout)
            .await
            .map_err(|e| fail(check, format!("UpdateModel v{version} failed: {e}")))
    }

    async fn stage(&self, check: &str, version: u64, hold: Duration) -> Result<StageReport> {
        let msg = StageModel {
            model: self.model.clone(),
            version: Version(version),
            timeout: CALL,
            hold,
        };
        self.engine
            .stage
            .send(msg)
            .timeout(CALL * 2)
            .await
            .map_err(|e| fail(check, format!("StageModel unanswered: {e}")))?
            .map_err(|e| fail(check, format!("StageModel v{version} failed: {e}")))
    }

    async fn commit_raw(&self, version: u64) -> Result<LoadReport> {
        let msg = CommitModel {
            model: self.model.clone(),
            version: Version(version),
            timeout: CALL,
        };
        self.engine
            .commit
            .send(msg)
            .timeout(CALL * 2)
            .await
            .map_err(|e| Error::Actor(format!("CommitModel unanswered: {e}")))?
    }

    async fn commit(&self, check: &str, version: u64) -> Result<LoadReport> {
        self.commit_raw(version)
            .await
            .map_err(|e| fail(check, format!("CommitModel v{version} failed: {e}")))
    }

    async fn abort(&self, check: &str) -> Result<()> {
        self.engine
            .abort
            .send(AbortStage {
                model: self.model.clone(),
            })
            .timeout(CALL)
            .await
            .map_err(|e| fail(check, format!("AbortStage unanswered: {e}")))
    }

    async fn cancel(&self, check: &str) -> Result<u64> {
        self.engine
            .cancel
            .send(CancelInFlight)
            .timeout(CALL)
            .await
            .map_err(|e| fail(check, format!("CancelInFlight unanswered: {e}")))
    }

    /// A call that must have been refused, its error naming each of `names`; what the
    /// engine serves must not have changed (checked by the caller).
    fn refused(&self, check: &str, answer: Result<LoadReport>, names: &[&str]) -> Result<()> {
        match answer {
            Ok(r) => Err(fail(check, format!("accepted: {r:?}"))),
            Err(e) => {
                let text = e.to_string();
                let missing: Vec<&&str> = names.iter().filter(|n| !text.contains(*n)).collect();
                self.expect(
                    check,
                    missing.is_empty(),
                    &format!("refused without naming {missing:?}: {text}"),
                )
            }
        }
    }
}
