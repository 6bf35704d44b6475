//! A model with `apply = "streaming"`: its stage only takes the model's load lock, and its
//! commit pulls the version inside the pause, handing the backend each tensor as its bytes
//! are verified ([`EngineBackend::commit_streamed`]), so that the engine never holds a
//! second copy of the model.

use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::time::Instant;

use refit_runtime::{ModelId, Version, WeightSet};
use tokio::sync::OwnedMutexGuard;

use super::{EngineBackend, Held, Job, Slot, served_of};
use crate::actor::staging::Stage;
use crate::error::{Error, Result};

/// The pull of one streaming commit, handed to [`EngineBackend::commit_streamed`]: call
/// [`TensorStream::run`] once, inside the commit. A clone is the same stream; once the
/// commit returned, every clone answers that the stream is over.
#[derive(Clone)]
pub struct TensorStream {
    state: Arc<Mutex<Option<State>>>,
}

struct State {
    guard: OwnedMutexGuard<Slot>,
    model: ModelId,
    at_least: Version,
    deadline: Instant,
    streamed: Option<Version>,
}

impl std::fmt::Debug for TensorStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorStream").finish_non_exhaustive()
    }
}

impl TensorStream {
    /// The stream of `model` at `at_least` or newer through the inlet `guard` holds, by
    /// `deadline`.
    pub(super) fn new(
        guard: OwnedMutexGuard<Slot>,
        model: ModelId,
        at_least: Version,
        deadline: Instant,
    ) -> Self {
        let state = State {
            guard,
            model,
            at_least,
            deadline,
            streamed: None,
        };
        Self {
            state: Arc::new(Mutex::new(Some(state))),
        }
    }

    /// Pulls the version (the one the commit names, or a newer one; an older one that comes
    /// first goes through whole as well) and calls `apply` with each of its tensors, a
    /// weight set of one tensor, once that tensor's bytes are verified; answers the version
    /// that went through last. `apply` puts the tensor where the model is served.
    ///
    /// A call after a failed one pulls again; a version answered ends the stream.
    ///
    /// # Errors
    /// A call after one that answered a version, a call from inside `apply`, or one after
    /// the commit returned; a timeout at the commit's deadline when no version went through
    /// whole (when an older one did, it is answered, and the commit then fails naming it,
    /// with that version served); once a tensor was applied,
    /// [`refit_runtime::Error::PartlyApplied`] (the backend's model is mixed); before, the
    /// failure itself (the sender gone, a damaged transfer, `apply`'s error).
    pub fn run(&self, apply: &mut dyn FnMut(WeightSet) -> Result<()>) -> Result<Version> {
        let mut state = match self.state.try_lock() {
            Ok(s) => s,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return Err(Error::Actor(
                    "the version is streaming already (a stream called from its own apply?)".into(),
                ));
            }
        };
        let Some(st) = state.as_mut() else {
            return Err(Error::Actor(
                "the stream ended with its commit: a later call pulls nothing".into(),
            ));
        };
        if let Some(v) = st.streamed {
            return Err(Error::Actor(format!(
                "model `{}`: v{v} streamed already (one stream per commit)",
                st.model
            )));
        }
        let left = st.deadline.saturating_duration_since(Instant::now());
        // the apply's errors travel through the runtime's stream as its failure; the first
        // is kept, to come back as it was when nothing had been applied
        let mut failed: Option<Error> = None;
        let mut pass = |one: WeightSet| {
            let tensor = one.first_name().to_owned();
            apply(one).map_err(|e| {
                let reason = e.to_string();
                failed = Some(e);
                refit_runtime::Error::Bridge {
                    library: "engine",
                    tensor,
                    reason,
                }
            })
        };
        let streamed = st
            .guard
            .inlet
            .stream(&st.model, st.at_least, left, &mut pass);
        match streamed {
            Ok(v) => {
                st.streamed = Some(v);
                Ok(v)
            }
            Err(e) => Err(apply_error(e, failed)),
        }
    }

    /// Takes the inlet back once the commit returned, with the version streamed (`None`
    /// when the backend never ran the stream).
    fn finish(self) -> Result<(OwnedMutexGuard<Slot>, Option<Version>)> {
        let state = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let st = state.ok_or_else(|| Error::Actor("a stream finished twice".into()))?;
        Ok((st.guard, st.streamed))
    }
}

/// The blocking part of a streaming commit: the backend's call, with the stream of
/// `version` (or newer) of `model` through the inlet `guard` holds. Answers the inlet and
/// the version served.
///
/// # Errors
/// The backend's; a backend that answered without running the stream.
pub(super) fn commit<B: EngineBackend>(
    backend: &B,
    model: &ModelId,
    version: Version,
    guard: OwnedMutexGuard<Slot>,
    deadline: Instant,
) -> Result<(OwnedMutexGuard<Slot>, Version)> {
    let stream = TensorStream::new(guard, model.clone(), version, deadline);
    let committed = backend.commit_streamed(model, version, &stream);
    let (guard, streamed) = stream.finish()?;
    committed?;
    let served = streamed.ok_or_else(|| Error::Generator {
        model: model.to_string(),
        reason: format!(
            "the {} backend's streaming commit of v{version} answered without streaming it",
            backend.name()
        ),
    })?;
    Ok((guard, served))
}

impl<B: EngineBackend> Job<B> {
    /// The stage of a streaming model: the load lock, held for the commit that pulls
    /// `version`, unless a version as new is served already.
    pub(super) fn hold_for_stream(
        &self,
        guard: OwnedMutexGuard<Slot>,
        version: Version,
        started: Instant,
    ) -> Stage<Held> {
        let current = served_of(&self.served, &self.model);
        if current >= version {
            return Stage::Served(current);
        }
        let (backend, model) = (Arc::clone(&self.backend), self.model.clone());
        Stage::New(Held {
            guard: Some(guard),
            version,
            staged: started.elapsed(),
            abort: Some(Box::new(move || backend.abort(&model))),
        })
    }
}

/// A stream's failure: the apply's own error when it failed with nothing applied, else
/// the runtime's (a [`refit_runtime::Error::PartlyApplied`] carries the apply's message as
/// its cause).
fn apply_error(e: refit_runtime::Error, failed: Option<Error>) -> Error {
    match (e, failed) {
        (refit_runtime::Error::Bridge { .. }, Some(apply)) => apply,
        (e, _) => Error::Runtime(e),
    }
}
