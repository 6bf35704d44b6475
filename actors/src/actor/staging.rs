//! The stage-then-commit life-cycle both engine families share: a version staged for a
//! fleet-wide commit is held (with its model's load lock) until the controller commits or
//! aborts it, or its hold runs out; a commit applies the version held, finds it served
//! already, or is refused naming both versions. What differs between the families is how a
//! version is staged and applied, not this bookkeeping.

use std::collections::BTreeMap;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::{ModelId, Version};

use crate::error::{Error, Result};
use crate::protocol::engine::{LoadReport, StageReport};

/// A version staged and held for its commit.
pub(crate) trait StagedVersion {
    /// The version staged.
    fn version(&self) -> Version;
}

/// The versions an engine holds for their commits, one per model, each with what drops it
/// when no commit comes in time.
pub(crate) struct Holds<H> {
    held: BTreeMap<ModelId, (H, SpawnHandle)>,
}

impl<H> Default for Holds<H> {
    fn default() -> Self {
        Self {
            held: BTreeMap::new(),
        }
    }
}

/// What staging found.
pub(crate) enum Stage<H> {
    /// A version newer than the one served, to hold for its commit.
    New(H),
    /// This version (or a newer one) is served already.
    Served(Version),
}

/// What a commit does.
pub(crate) enum Committing<H> {
    /// Applies the version held.
    Apply(H),
    /// Nothing: the version (or a newer one) is served already.
    Served(LoadReport),
}

impl<H: StagedVersion + 'static> Holds<H> {
    /// Holds `staged` for `model` until its commit, its abort, or `hold` passes (then it is
    /// dropped, with a warning, unless another version took its place); `holds` finds these
    /// holds in the actor when the time comes. A version held before is dropped.
    pub(crate) fn hold<A>(
        &mut self,
        model: ModelId,
        staged: H,
        hold: Duration,
        ctx: &mut Context<A>,
        holds: fn(&mut A) -> &mut Self,
    ) where
        A: Actor<Context = Context<A>>,
    {
        let v = staged.version();
        let m = model.clone();
        let expiry = ctx.run_later(hold, move |act, _| {
            let held = &mut holds(act).held;
            if held.get(&m).is_some_and(|(h, _)| h.version() == v) {
                held.remove(&m);
                tracing::warn!(model = %m, "v{v} was staged but neither committed nor aborted within {hold:?}: dropped");
            }
        });
        if let Some((_, old)) = self.held.insert(model, (staged, expiry)) {
            ctx.cancel_future(old);
        }
    }

    /// Holds what staging found for `model` ([`Holds::hold`]) and answers the stage's
    /// report (`staged`: how long the lock wait, fetch and staging took).
    pub(crate) fn staged<A>(
        &mut self,
        model: ModelId,
        stage: Stage<H>,
        staged: Duration,
        hold: Duration,
        ctx: &mut Context<A>,
        holds: fn(&mut A) -> &mut Self,
    ) -> StageReport
    where
        A: Actor<Context = Context<A>>,
    {
        let (version, fresh) = match stage {
            Stage::Served(current) => (current, false),
            Stage::New(h) => {
                let v = h.version();
                self.hold(model.clone(), h, hold, ctx, holds);
                (v, true)
            }
        };
        StageReport {
            model,
            version,
            fresh,
            staged,
        }
    }

    /// Answers a [`StageModel`](crate::protocol::engine::StageModel) once `staging` (what
    /// staging found, and how long it took) ends: the time counted in `staged_total`, a new
    /// version held for its commit ([`Holds::staged`]).
    pub(crate) fn answer_stage<A>(
        staging: impl std::future::Future<Output = (Result<Stage<H>>, Duration)> + 'static,
        model: ModelId,
        hold: Duration,
        act: &A,
        holds: fn(&mut A) -> &mut Self,
        staged_total: fn(&mut A) -> &mut Duration,
    ) -> ResponseActFuture<A, Result<StageReport>>
    where
        A: Actor<Context = Context<A>>,
    {
        Box::pin(staging.into_actor(act).map(move |(r, staged), act, ctx| {
            *staged_total(act) += staged;
            let stage = r?;
            Ok(holds(act).staged(model, stage, staged, hold, ctx, holds))
        }))
    }

    /// Takes what is held for `model` (its expiry disarmed): for its commit, or to drop it
    /// (an abort), or to give its lock to a load that does not wait for a commit.
    pub(crate) fn take<A>(&mut self, model: &ModelId, ctx: &mut Context<A>) -> Option<H>
    where
        A: Actor<Context = Context<A>>,
    {
        let (staged, expiry) = self.held.remove(model)?;
        ctx.cancel_future(expiry);
        Some(staged)
    }

    /// The commit of `version` of `model`, whose engine serves `served`: the version held
    /// is applied; with nothing held, a version served already answers at once.
    ///
    /// # Errors
    /// A commit of another version than the one held (which is dropped), or of a version
    /// neither held nor served, naming both.
    pub(crate) fn commit<A>(
        &mut self,
        model: &ModelId,
        version: Version,
        served: Version,
        ctx: &mut Context<A>,
    ) -> Result<Committing<H>>
    where
        A: Actor<Context = Context<A>>,
    {
        match self.take(model, ctx) {
            Some(h) if h.version() == version => Ok(Committing::Apply(h)),
            None if served >= version => Ok(Committing::Served(LoadReport::already_served(
                model.clone(),
                served,
                Duration::ZERO,
            ))),
            held => Err(commit_refused(
                model,
                version,
                held.map(|h| h.version()),
                served,
            )),
        }
    }
}

/// A commit of `version` of `model` refused: `staged` is what was staged (now dropped), if
/// anything, and `served` the version served.
fn commit_refused(
    model: &ModelId,
    version: Version,
    staged: Option<Version>,
    served: Version,
) -> Error {
    let staged = staged.map_or_else(
        || "nothing is staged".to_string(),
        |v| format!("v{v} is staged (now dropped)"),
    );
    Error::Actor(format!(
        "model `{model}`: commit of v{version} refused: {staged} and v{served} is served"
    ))
}
