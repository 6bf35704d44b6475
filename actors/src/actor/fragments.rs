//! The rollout fragment life-cycle every rollout worker shares: started and stopped by
//! the run, one fragment at a time (admitted by the controller, collected, handed to the
//! pool, then reported done), its outcome counted, an error stopping the worker. What
//! differs between the acting and the generating worker is the fragment itself
//! ([`Fragments::run`]); [`RolloutWorker`](super::RolloutWorker) and
//! [`GenRolloutWorker`](super::GenRolloutWorker) are this actor over their fragments.

use std::future::Future;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::ModelId;

use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::protocol::controller::{Admission, ControllerLink, RolloutDone};
use crate::protocol::pool::PushFragment;
use crate::protocol::rollout::{GetRolloutStats, RolloutStats, StartRollouts, StopRollouts};

/// What one kind of rollout worker collects per fragment.
pub trait Fragments: Clone + Unpin + 'static {
    /// The worker's own state, lent to each fragment (environments, a task and its rng).
    type State: Unpin + 'static;
    /// The worker's name in logs and `Debug`.
    const KIND: &'static str;

    /// The model it collects for.
    fn model(&self) -> &ModelId;

    /// Its index among the model's workers.
    fn worker(&self) -> usize;

    /// One fragment: admitted through `controller`, collected, pushed to `pool` (or
    /// dropped when its episodes were cancelled).
    ///
    /// # Errors
    /// What stops the worker: an unreachable controller, engine or pool, a deadline, a
    /// failure of the environment or task.
    fn run(
        &self,
        state: &mut Self::State,
        controller: &ControllerLink,
        pool: &Recipient<PushFragment>,
    ) -> impl Future<Output = Result<Outcome>>;
}

/// A rollout worker: [`Fragments`] collected one after the other while it runs.
pub struct FragmentLoop<F: Fragments> {
    fragments: F,
    state: Option<F::State>,
    controller: ControllerLink,
    pool: Recipient<PushFragment>,
    running: bool,
    stats: RolloutStats,
}

impl<F: Fragments> std::fmt::Debug for FragmentLoop<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(F::KIND)
            .field("model", self.fragments.model())
            .field("worker", &self.fragments.worker())
            .field("stats", &self.stats)
            .finish()
    }
}

impl<F: Fragments> FragmentLoop<F> {
    /// A worker collecting `fragments` from `state`, admitted through `controller`, pushing
    /// to `pool`; it waits for [`StartRollouts`].
    pub(crate) fn with(
        fragments: F,
        state: F::State,
        controller: ControllerLink,
        pool: Recipient<PushFragment>,
    ) -> Self {
        Self {
            fragments,
            state: Some(state),
            controller,
            pool,
            running: false,
            stats: RolloutStats::default(),
        }
    }

    /// What it collects.
    pub(crate) fn fragments_mut(&mut self) -> &mut F {
        &mut self.fragments
    }

    fn next_fragment(&mut self, ctx: &mut Context<Self>) {
        if !self.running {
            return;
        }
        let Some(mut state) = self.state.take() else {
            return;
        };
        let fragments = self.fragments.clone();
        let controller = self.controller.clone();
        let pool = self.pool.clone();
        let work = async move {
            let r = fragments.run(&mut state, &controller, &pool).await;
            // only once the pool has it (or it failed): the controller never counts a
            // fragment done that is still coming
            controller.done.do_send(RolloutDone {
                model: fragments.model().clone(),
            });
            (state, r)
        };
        ctx.spawn(work.into_actor(self).map(|(state, r), act, ctx| {
            act.state = Some(state);
            if act.settle(r) {
                ctx.notify(NextFragment);
            }
        }));
    }

    /// Records how a fragment ended; answers whether the worker goes on (an error stops
    /// it, kept in its statistics and logged).
    fn settle(&mut self, r: Result<Outcome>) -> bool {
        match r {
            Ok(outcome) => {
                self.stats.blocked += outcome.waited;
                self.stats.blocked_checks += u64::from(!outcome.waited.is_zero());
                if outcome.cancelled {
                    self.stats.cancelled += 1;
                } else {
                    self.stats.fragments += 1;
                }
                self.running
            }
            Err(e) => {
                let (model, worker) = (self.fragments.model(), self.fragments.worker());
                refit_runtime::unless_stopping!(error, worker, model = %model, "rollout worker stops: {e}");
                self.stats.error = Some(e.to_string());
                self.running = false;
                false
            }
        }
    }
}

/// How one rollout fragment ended (any rollout worker's).
#[derive(Debug)]
pub struct Outcome {
    /// How long its admission waited.
    pub(crate) waited: Duration,
    /// Its episodes were cancelled; nothing went to the pool.
    pub(crate) cancelled: bool,
}

/// Hands a collected fragment to the model's trajectory pool, within `timeout`.
pub(crate) async fn deliver(
    pool: &Recipient<PushFragment>,
    fragment: Batch,
    admission: Admission,
    timeout: Duration,
    model: &ModelId,
) -> Result<()> {
    pool.send(PushFragment {
        fragment,
        admission,
    })
    .timeout(timeout)
    .await
    .map_err(|e| {
        Error::unanswered(
            e,
            timeout,
            format!("the trajectory pool of model `{model}`"),
        )
    })
}

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct NextFragment;

impl<F: Fragments> Actor for FragmentLoop<F> {
    type Context = Context<Self>;
}

impl<F: Fragments> Handler<NextFragment> for FragmentLoop<F> {
    type Result = ();
    fn handle(&mut self, _: NextFragment, ctx: &mut Context<Self>) {
        self.next_fragment(ctx);
    }
}

impl<F: Fragments> Handler<StartRollouts> for FragmentLoop<F> {
    type Result = ();
    fn handle(&mut self, _: StartRollouts, ctx: &mut Context<Self>) {
        if !self.running {
            self.running = true;
            self.next_fragment(ctx);
        }
    }
}

impl<F: Fragments> Handler<GetRolloutStats> for FragmentLoop<F> {
    type Result = MessageResult<GetRolloutStats>;
    fn handle(&mut self, _: GetRolloutStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.stats.clone())
    }
}

impl<F: Fragments> Handler<StopRollouts> for FragmentLoop<F> {
    type Result = MessageResult<StopRollouts>;
    fn handle(&mut self, _: StopRollouts, _: &mut Context<Self>) -> Self::Result {
        self.running = false;
        MessageResult(self.stats.clone())
    }
}
