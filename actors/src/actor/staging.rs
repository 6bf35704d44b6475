//! The weight plane every engine shares: a load ([`UpdateModel`]) stages a version and
//! serves it; a fleet-wide update stages it ([`StageModel`]) and holds it (with its model's
//! load lock) until the controller commits ([`CommitModel`]) or aborts ([`AbortStage`]) it,
//! or its hold runs out; a commit applies the version held, finds it served already, or is
//! refused naming both versions.
//!
//! An engine says only how it stages a version and how it serves one it staged
//! ([`StagedEngine`]); the four handlers are written once, here, and
//! [`weight_plane_handlers!`] implements them for an engine actor.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_runtime::metrics::{self, Side};
use refit_runtime::{ModelId, Version};
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::error::{Error, Result};
use crate::protocol::engine::{
    AbortStage, CommitModel, LoadReport, StageModel, StageReport, UpdateModel,
};

/// An engine's side of the weight plane: how it stages a version, and how it serves one it
/// staged. The handlers of [`UpdateModel`], [`StageModel`], [`CommitModel`] and
/// [`AbortStage`] are the functions of this module over it ([`weight_plane_handlers!`]).
pub(crate) trait StagedEngine: Actor<Context = Context<Self>> {
    /// A version staged and held for its commit, with its model's load lock.
    type Held: StagedVersion + 'static;

    /// The versions held for their commits.
    fn holds(&mut self) -> &mut Holds<Self::Held>;

    /// Where the engine counts the time its stages took (its statistics).
    fn staged_total(&mut self) -> &mut Duration;

    /// The version of `model` served now.
    ///
    /// # Errors
    /// A model the engine does not load (unknown, or one that loads nothing itself).
    fn served(&self, model: &ModelId) -> Result<Version>;

    /// Takes `model`'s load lock (that of `held`, a version staged before and never
    /// committed, whose staged bytes are dropped; otherwise waited for by `deadline`), then
    /// fetches and stages `version` or a newer one beside what the engine serves. Answers
    /// what staging found and how long the lock wait, fetch and stage took (counted by the
    /// caller, also when staging failed).
    fn stage(
        &mut self,
        model: &ModelId,
        version: Version,
        deadline: Instant,
        held: Option<Self::Held>,
    ) -> StagingFuture<Self>;

    /// Serves `held`, a version of `model` staged newer than the one served, then
    /// acknowledges it to its sender (an ack means served); `deadline` bounds the waits the
    /// engine makes for a running batch or a step boundary (an engine that applies at once
    /// has none). The engine counts its failures in the metrics itself.
    fn commit(
        &mut self,
        model: ModelId,
        held: Self::Held,
        deadline: Instant,
    ) -> ResponseActFuture<Self, Result<LoadReport>>;
}

/// `model`'s load lock for a stage: `held` (the lock of a version staged before, given up
/// to this stage), else `lock` once an earlier load lets it go, by `deadline`.
///
/// # Errors
/// A timeout naming the model when no earlier load let the lock go by `deadline`.
///
/// # Cancel safety
/// Cancel safe: dropped while it waits, it takes nothing.
pub(crate) async fn load_lock<T>(
    held: Option<OwnedMutexGuard<T>>,
    lock: &Arc<Mutex<T>>,
    model: &ModelId,
    deadline: Instant,
) -> Result<OwnedMutexGuard<T>> {
    if let Some(guard) = held {
        return Ok(guard);
    }
    let wait = deadline.saturating_duration_since(Instant::now());
    let lock = Arc::clone(lock).lock_owned();
    actix_rt::time::timeout(wait, lock)
        .await
        .map_err(|_| timed_out(model, "waiting for an earlier load of the model", wait))
}

/// A wait of a load of `model` (`what`) that ran out after `after`.
pub(crate) fn timed_out(model: &ModelId, what: &str, after: Duration) -> Error {
    Error::Runtime(refit_runtime::Error::Timeout {
        what: format!("model `{model}`: {what}"),
        after,
    })
}

/// What an engine's stage answers: what staging found, and how long it took.
pub(crate) type StagingFuture<A> =
    ResponseActFuture<A, (Result<Stage<<A as StagedEngine>::Held>>, Duration)>;

/// A load: stages the version (taking the lock of one staged for a commit that never came)
/// and serves it, all by the message's deadline.
pub(crate) fn update_model<A: StagedEngine>(
    act: &mut A,
    msg: UpdateModel,
    ctx: &mut Context<A>,
) -> ResponseActFuture<A, Result<LoadReport>> {
    let UpdateModel {
        model,
        version,
        timeout,
    } = msg;
    // a model the engine does not load is refused before anything is counted
    if let Err(e) = act.served(&model) {
        return Box::pin(fut::ready(Err(e)));
    }
    let held = act.holds().take(&model, ctx);
    let deadline = Instant::now() + timeout;
    Box::pin(
        act.stage(&model, version, deadline, held)
            .then(move |(r, staged), act, _| {
                *act.staged_total() += staged;
                match r {
                    Ok(Stage::New(h)) => act.commit(model, h, deadline),
                    Ok(Stage::Served(current)) => Box::pin(fut::ready(Ok(
                        LoadReport::already_served(model, current, staged),
                    ))),
                    Err(e) => {
                        metrics::failed(Side::Engine, "engine");
                        Box::pin(fut::ready(Err(e)))
                    }
                }
            }),
    )
}

/// A fleet-wide update's stage: what staging found is held for its commit ([`Holds::staged`]).
pub(crate) fn stage_model<A: StagedEngine>(
    act: &mut A,
    msg: StageModel,
    ctx: &mut Context<A>,
) -> ResponseActFuture<A, Result<StageReport>> {
    let StageModel {
        model,
        version,
        timeout,
        hold,
    } = msg;
    let held = act.holds().take(&model, ctx);
    let deadline = Instant::now() + timeout;
    Box::pin(
        act.stage(&model, version, deadline, held)
            .map(move |(r, staged), act, ctx| {
                *act.staged_total() += staged;
                let stage = r?;
                Ok(act
                    .holds()
                    .staged(model, stage, staged, hold, ctx, A::holds))
            }),
    )
}

/// A fleet-wide update's commit ([`Holds::commit`]): serves the version held, by the
/// message's deadline.
pub(crate) fn commit_model<A: StagedEngine>(
    act: &mut A,
    msg: CommitModel,
    ctx: &mut Context<A>,
) -> ResponseActFuture<A, Result<LoadReport>> {
    let CommitModel {
        model,
        version,
        timeout,
    } = msg;
    let served = match act.served(&model) {
        Ok(v) => v,
        Err(e) => return Box::pin(fut::ready(Err(e))),
    };
    match act.holds().commit(&model, version, served, ctx) {
        Ok(Committing::Apply(h)) => act.commit(model, h, Instant::now() + timeout),
        Ok(Committing::Served(report)) => Box::pin(fut::ready(Ok(report))),
        // what was staged is dropped with its hold
        Err(e) => Box::pin(fut::ready(Err(e))),
    }
}

/// A fleet-wide update's abort: what was staged is dropped with its hold.
pub(crate) fn abort_stage<A: StagedEngine>(act: &mut A, msg: &AbortStage, ctx: &mut Context<A>) {
    drop(act.holds().take(&msg.model, ctx));
}

/// Implements the weight plane's four handlers for an engine actor that is a
/// [`StagedEngine`]: `weight_plane_handlers!(impl[P: Policy] InferenceEngine<P>);`.
macro_rules! weight_plane_handlers {
    (impl[$($generics:tt)*] $engine:ty) => {
        impl<$($generics)*> ::actix::Handler<$crate::protocol::engine::UpdateModel> for $engine {
            type Result = ::actix::ResponseActFuture<
                Self,
                $crate::error::Result<$crate::protocol::engine::LoadReport>,
            >;

            fn handle(
                &mut self,
                msg: $crate::protocol::engine::UpdateModel,
                ctx: &mut ::actix::Context<Self>,
            ) -> Self::Result {
                $crate::actor::staging::update_model(self, msg, ctx)
            }
        }

        impl<$($generics)*> ::actix::Handler<$crate::protocol::engine::StageModel> for $engine {
            type Result = ::actix::ResponseActFuture<
                Self,
                $crate::error::Result<$crate::protocol::engine::StageReport>,
            >;

            fn handle(
                &mut self,
                msg: $crate::protocol::engine::StageModel,
                ctx: &mut ::actix::Context<Self>,
            ) -> Self::Result {
                $crate::actor::staging::stage_model(self, msg, ctx)
            }
        }

        impl<$($generics)*> ::actix::Handler<$crate::protocol::engine::CommitModel> for $engine {
            type Result = ::actix::ResponseActFuture<
                Self,
                $crate::error::Result<$crate::protocol::engine::LoadReport>,
            >;

            fn handle(
                &mut self,
                msg: $crate::protocol::engine::CommitModel,
                ctx: &mut ::actix::Context<Self>,
            ) -> Self::Result {
                $crate::actor::staging::commit_model(self, msg, ctx)
            }
        }

        impl<$($generics)*> ::actix::Handler<$crate::protocol::engine::AbortStage> for $engine {
            type Result = ();

            fn handle(
                &mut self,
                msg: $crate::protocol::engine::AbortStage,
                ctx: &mut ::actix::Context<Self>,
            ) {
                $crate::actor::staging::abort_stage(self, &msg, ctx);
            }
        }
    };
}
pub(crate) use weight_plane_handlers;

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
