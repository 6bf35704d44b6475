//! One load of a generating engine's model: fetch and stage beside generation, offer to the
//! decoding thread, wait for the swap at its step boundary, then acknowledge.

use std::sync::Arc;
use std::time::{Duration, Instant};

use refit_runtime::metrics::{self, Side};
use refit_runtime::{ModelId, Version, WeightSet};
use tokio::sync::{OwnedMutexGuard, oneshot};

use crate::actor::staging::{Stage, StagedVersion, load_lock, timed_out};
use crate::error::{Error, Result};
use crate::generation::Generator;
use crate::scheduler::Swap;

use super::decode_loop::{Command, Commands, Shared};
use super::verify;
use super::{Follower, LoadReport, Loader, loop_gone};

/// How long a load that gave up on its swap waits for the decoding thread to confirm the
/// withdrawal (it is taken at the next step boundary: one decoding step).
const WITHDRAW_WAIT: Duration = Duration::from_secs(30);

/// The least time a staged version is given to reach its boundary, even when staging ate
/// the load's deadline (one step in keep or abort mode).
const MIN_SWAP_WAIT: Duration = Duration::from_secs(1);

/// Where the version comes from.
pub(super) enum Source {
    /// Fetched through the model's inlet: this version or a newer one.
    Inlet { version: Version },
    /// Pushed by the caller.
    Pushed(Arc<WeightSet>),
}

/// What a load needs of the engine, so that it runs without borrowing it.
pub(super) struct LoadJob<G: Generator> {
    pub(super) model: ModelId,
    pub(super) commands: Commands<G::Weights>,
    pub(super) shared: Arc<Shared>,
    pub(super) loader: Arc<tokio::sync::Mutex<Loader<G>>>,
    /// The models that follow this one (refreshed after its swaps).
    pub(super) followers: Vec<Follower<G::Weights>>,
}

enum Staged<W> {
    /// A version newer than the one served, in the backend's form.
    New(Arc<W>, Version),
    /// This version (or a newer one) is served already (an earlier load brought it).
    Served(Version),
}

pub(crate) type Guard<G> = OwnedMutexGuard<Loader<G>>;

/// A version staged and held for its swap, with the model's load lock.
pub(crate) struct Held<G: Generator> {
    guard: Guard<G>,
    weights: Arc<G::Weights>,
    pub(super) version: Version,
    /// Lock wait, fetch and stage.
    pub(super) staged: Duration,
    /// Whether the version came through the inlet (it is acknowledged once served).
    inlet: bool,
}

impl<G: Generator> StagedVersion for Held<G> {
    fn version(&self) -> Version {
        self.version
    }
}

impl<G: Generator> Held<G> {
    /// Gives up the version, keeping the lock for another load.
    pub(super) fn into_guard(self) -> Guard<G> {
        self.guard
    }
}

/// What staging found: a new version held for its swap, or the version served already.
pub(super) type Staging<G> = Stage<Held<G>>;

impl<G: Generator> LoadJob<G> {
    /// Runs the load within `timeout` (lock wait, fetch and the wait for the swap; staging
    /// itself is not interrupted); `held` is the lock of a version staged earlier, given up
    /// to this load. Answers the report and the staging time (lock wait, fetch, stage),
    /// which counts even when the load fails.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped after the offer, the version may still be swapped in, and
    /// is then not acknowledged.
    pub(super) async fn run(
        self,
        source: Source,
        timeout: Duration,
        held: Option<Guard<G>>,
    ) -> (Result<LoadReport>, Duration) {
        let deadline = Instant::now() + timeout;
        let (staging, staged) = self.stage(source, deadline, held).await;
        let report = match staging {
            Ok(Stage::New(h)) => self.commit(h, deadline).await,
            Ok(Stage::Served(current)) => {
                Ok(LoadReport::already_served(self.model, current, staged))
            }
            Err(e) => Err(e),
        };
        if report.is_err() {
            metrics::failed(Side::Engine, "engine");
        }
        (report, staged)
    }

    /// Takes the model's load lock (or `held`, the lock a staged version holds) and stages
    /// `source` on a blocking thread, by `deadline` (lock wait and fetch; staging itself is
    /// not interrupted). Answers what was staged and the staging time.
    ///
    /// # Cancel safety
    /// Cancel safe: dropped, the lock and anything staged are let go.
    pub(super) async fn stage(
        &self,
        source: Source,
        deadline: Instant,
        held: Option<Guard<G>>,
    ) -> (Result<Staging<G>>, Duration) {
        let started = Instant::now();
        let model = self.model.clone();
        let guard = match load_lock(held, &self.loader, &model, deadline).await {
            Ok(g) => g,
            Err(e) => return (Err(e), started.elapsed()),
        };
        let inlet = matches!(source, Source::Inlet { .. });
        let shared = Arc::clone(&self.shared);
        let staging = actix_rt::task::spawn_blocking(move || {
            let mut guard = guard;
            let r = stage(&mut guard, &model, source, &shared, deadline);
            (guard, r)
        })
        .await;
        let staged = started.elapsed();
        let r = match staging {
            Ok((guard, Ok(Staged::New(weights, version)))) => Ok(Stage::New(Held {
                guard,
                weights,
                version,
                staged,
                inlet,
            })),
            Ok((_, Ok(Staged::Served(current)))) => Ok(Stage::Served(current)),
            Ok((_, Err(e))) => Err(e),
            Err(e) => Err(Error::Actor(format!(
                "the staging thread of model `{}` failed: {e}",
                self.model
            ))),
        };
        (r, staged)
    }

    /// Offers a staged version to the decoding thread, waits for its swap (by `deadline`,
    /// at least [`MIN_SWAP_WAIT`]), refreshes the followers and acknowledges the version.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped after the offer, the version may still be swapped in, and
    /// is then not acknowledged.
    pub(super) async fn commit(&self, held: Held<G>, deadline: Instant) -> Result<LoadReport> {
        let Held {
            guard,
            weights,
            version,
            staged,
            inlet,
        } = held;
        let mut guard = guard;
        let lead =
            (!self.followers.is_empty() || guard.verify.is_some()).then(|| Arc::clone(&weights));
        let swap = self.swap(weights, version, deadline).await?;
        let damaged = guard.damaged.take().map(|d| d.to_string());
        if let Some(d) = &damaged {
            tracing::error!(model = %self.model, "the weights served before v{version} changed since they were staged: {d}");
        }
        // a swap that went past this version (a newer offer superseded it) refreshes
        // nobody with this one: the newer load does
        if let Some(w) = lead
            && swap.to == version
        {
            for f in &self.followers {
                f.refresh(&w, version);
            }
            if guard.verify.is_some() {
                guard.served = Some((w, version));
            }
        }
        if inlet {
            self.ack(guard, swap.to).await?;
        }
        metrics::engine_loaded(self.model.as_str(), swap.to.0, swap.paused);
        Ok(LoadReport {
            model: self.model.clone(),
            version: swap.to,
            staged,
            paused: swap.paused,
            damaged,
        })
    }

    /// The version served (`None` before the first weights).
    pub(super) fn served(&self) -> Option<Version> {
        self.shared.served()
    }

    /// Offers the staged version and waits for its swap; past the deadline the offer is
    /// withdrawn (unless the swap won the race, which then counts).
    async fn swap(
        &self,
        weights: Arc<G::Weights>,
        version: Version,
        deadline: Instant,
    ) -> Result<Swap> {
        let model = &self.model;
        let (reply, mut swapped) = oneshot::channel();
        self.commands
            .send(Command::Offer {
                weights,
                version,
                reply,
            })
            .map_err(|_| loop_gone(model))?;
        self.shared.offered(version);
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .max(MIN_SWAP_WAIT);
        match actix_rt::time::timeout(wait, &mut swapped).await {
            Ok(r) => return r.map_err(|_| loop_gone(model))?,
            Err(_) => {
                let why = timed_out(
                    model,
                    &format!("version {version} waiting for a step boundary to swap in"),
                    wait,
                );
                // a loop that is gone has nothing pending: the wait below says so
                let _ = self.commands.send(Command::Withdraw { version, why });
            }
        }
        match actix_rt::time::timeout(WITHDRAW_WAIT, swapped).await {
            Ok(r) => r.map_err(|_| loop_gone(model))?,
            Err(_) => Err(timed_out(
                model,
                &format!("the decoding thread to withdraw version {version}"),
                WITHDRAW_WAIT,
            )),
        }
    }

    /// Tells the sender the version is served, on a blocking thread.
    async fn ack(&self, guard: Guard<G>, version: Version) -> Result<()> {
        let model = self.model.clone();
        let acked = actix_rt::task::spawn_blocking(move || {
            let mut guard = guard;
            match guard.inlet.as_mut() {
                Some(inlet) => inlet.applied(&model, version),
                None => Ok(()),
            }
        })
        .await;
        let acked = acked.map_err(|e| {
            Error::Actor(format!(
                "the weight ack thread of model `{}` failed: {e}",
                self.model
            ))
        })?;
        Ok(acked?)
    }
}

/// Fetches (inlet) and stages a version, on a blocking thread.
fn stage<G: Generator>(
    loader: &mut Loader<G>,
    model: &ModelId,
    source: Source,
    shared: &Shared,
    deadline: Instant,
) -> Result<Staged<G::Weights>> {
    let pushed = matches!(source, Source::Pushed(_));
    let weights = match source {
        Source::Inlet { version } => {
            if let Some(current) = shared.served()
                && current >= version
            {
                return Ok(Staged::Served(current));
            }
            let inlet = loader.inlet.as_mut().ok_or_else(|| {
                Error::Config(format!(
                    "model `{model}` has no inlet on this engine (push weights with LoadWeights)"
                ))
            })?;
            let left = deadline.saturating_duration_since(Instant::now());
            inlet.fetch(model, version, left)?
        }
        Source::Pushed(ws) => {
            if ws.model() != model {
                return Err(refit_rl::Error::ModelMismatch {
                    expected: model.to_string(),
                    found: ws.model().to_string(),
                }
                .into());
            }
            ws
        }
    };
    let version = weights.version();
    if let Some(current) = shared.served()
        && current >= version
    {
        if pushed {
            return Err(Error::Runtime(refit_runtime::Error::StaleVersion {
                model: model.clone(),
                offered: version,
                current,
            }));
        }
        // the inlet had nothing newer than what an earlier load brought
        return Ok(Staged::Served(current));
    }
    let stager = loader.stager.as_ref().ok_or_else(|| {
        Error::Config(format!("model `{model}` is a follower and stages nothing"))
    })?;
    let staged = match loader.verify.as_mut() {
        None => Arc::new(stager.stage(&weights)?),
        Some(v) => {
            loader.damaged = verify::check_served(v, stager, loader.served.as_ref());
            verify::stage_verified(v, stager, &weights)?
        }
    };
    Ok(Staged::New(staged, version))
}
