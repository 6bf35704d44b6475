//! The weight-sync controller actor: carries out the decisions of
//! [`SyncPolicy`](refit_runtime::sync_policy::SyncPolicy) and the
//! [`VersionBarrier`](refit_runtime::sync_policy::VersionBarrier).
//!
//! Trainers tell it when they finish a version ([`NotifyVersion`], best through a
//! [`VersionNotifier`](crate::actor::VersionNotifier), which lets a trainer run one step ahead while keeping its
//! notifications in order); the trajectory pool tells it when a batch is ready
//! ([`BatchReady`]); rollout workers ask it before each fragment ([`AwaitRollout`]) and say
//! when the fragment is over ([`RolloutDone`]). It loads each version on every engine in
//! two rounds, stage then commit ([`StageModel`](crate::protocol::engine::StageModel),
//! [`CommitModel`](crate::protocol::engine::CommitModel); `fleet` sends them, `commit`
//! decides, by the model's `commit` rule), and, on eval steps, the barrier's leader pauses
//! data acquisition, cancels in-flight episodes, loads every model in sorted order, runs the evaluator,
//! checks that every model was evaluated at the round's version, resumes and wakes the
//! other trainers.
//!
//! The decisions, the waiters and their deadlines, the counters and the timeline are a
//! plain core (`core`: no actix, no tokio, time passed in); this actor does the IO:
//! receives messages, sends loads, runs the leader's sequence and arms the timers the
//! core asks for. The trainer's client of the controller, `VersionNotifier`, lives on the
//! trainer's side (`actor::notifier`).

use std::collections::BTreeMap;
use std::time::Instant;

use actix::prelude::*;
use refit_runtime::sync_policy::{Decision, LeaderStep, SyncConfig, SyncOrder};
use refit_runtime::{ModelId, Version};
use tokio::sync::oneshot;

use self::core::{Action, Admit, Landed, SyncCore, WaiterId};
use self::fleet::{Fleet, load_one};
use crate::error::{Error, Result};
use crate::protocol::controller::{
    AddEngine, Admission, AwaitDrained, AwaitRollout, AwaitSynced, BatchReady, CheckRollout,
    DropEngine, EndValidate, GetCounts, GetStatus, ModelStatus, NotifyOutcome, NotifyVersion,
    RolloutDone,
};
use crate::protocol::engine::{CancelInFlight, EngineRef, ServedVersions};
use crate::protocol::eval::{EvalReport, RunEval};
use refit_runtime::topology::Commit;

mod commit;
mod core;
mod fleet;

/// Awaits an answer the controller sends later.
async fn answer<T>(rx: oneshot::Receiver<Result<T>>) -> Result<T> {
    rx.await
        .map_err(|_| Error::Actor("weight-sync controller stopped".into()))?
}

/// The channel a waiter is answered on.
enum Reply {
    Admit(oneshot::Sender<Result<Admission>>),
    Drained(oneshot::Sender<Result<()>>),
    Synced(oneshot::Sender<Result<Version>>),
    Notified(oneshot::Sender<Result<NotifyOutcome>>),
}

/// Decides when weights move, and carries it out: the decisions and the waiters are the
/// plain core's (`core`); this actor receives the messages, keeps the reply channels, sends
/// the loads and arms a timer for each deadline the core names.
pub struct WeightSyncController {
    core: SyncCore,
    engines: Vec<EngineRef>,
    /// The id of each engine: its position in the list the controller was made with, or
    /// the id it was added under.
    engine_ids: Vec<usize>,
    evaluator: Option<Recipient<RunEval>>,
    replies: BTreeMap<WaiterId, Reply>,
    /// How each model's versions are committed across the engines (`all` unless set).
    commit: BTreeMap<ModelId, Commit>,
}

impl std::fmt::Debug for WeightSyncController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightSyncController")
            .field("mode", &self.core.config().sync_mode)
            .field("engines", &self.engines.len())
            .field("seq", &self.core.seq())
            .finish()
    }
}

impl WeightSyncController {
    /// A controller for the models of `cfg` (or `models` when the configuration lists
    /// none), loading on `engines` (more join with [`AddEngine`], as the ranks of a run
    /// do), validating with `evaluator` on eval steps.
    ///
    /// # Errors
    /// [`Error::Config`] for no model, or a configuration that fails its checks.
    pub fn new(
        cfg: &SyncConfig,
        models: Vec<ModelId>,
        engines: Vec<EngineRef>,
        evaluator: Option<Recipient<RunEval>>,
    ) -> Result<Self> {
        let core = SyncCore::new(cfg, models, evaluator.is_some(), Instant::now())?;
        Ok(Self {
            core,
            engine_ids: (0..engines.len()).collect(),
            engines,
            evaluator,
            replies: BTreeMap::new(),
            commit: BTreeMap::new(),
        })
    }

    /// Commits `model`'s versions by `rule` (a topology's `[[model]] commit`): every engine
    /// stages a version first, then it is committed on the engines that staged it when the
    /// rule is met (the others are fenced from rollouts until they serve it), or nowhere.
    #[must_use]
    pub fn with_commit(mut self, model: ModelId, rule: Commit) -> Self {
        self.commit.insert(model, rule);
        self
    }

    /// Carries `model`'s counters over from the run this one resumes: `status` is what the
    /// controller said of it at the checkpoint, `evals` the eval steps run by then; the
    /// counts of this run add to them.
    #[must_use]
    pub fn carrying(mut self, model: &ModelId, status: &ModelStatus, evals: u64) -> Self {
        self.core.carry(model, status, evals);
        self
    }

    /// The engines of a load of `model`, its commit rule and fences.
    fn fleet(&self, model: &ModelId) -> Fleet {
        Fleet {
            model: model.clone(),
            engines: self
                .engine_ids
                .iter()
                .copied()
                .zip(self.engines.iter().cloned())
                .collect(),
            rule: self.commit.get(model).copied().unwrap_or_default(),
            fenced: self.core.fenced(model),
            timeout: self.core.config().timeouts.load(),
        }
    }

    /// Carries out what the core asks: answers waiters, starts loads and eval steps.
    fn apply(&mut self, ctx: &mut Context<Self>) {
        while let Some(action) = self.core.poll_action() {
            match action {
                Action::Admitted { id, model, result } => {
                    if let Some(Reply::Admit(tx)) = self.replies.remove(&id)
                        && let Err(Ok(_)) = tx.send(result)
                    {
                        // the worker is gone: its admission will never finish
                        self.core.rollout_done(&model);
                    }
                }
                Action::Drained(id, r) => {
                    if let Some(Reply::Drained(tx)) = self.replies.remove(&id) {
                        let _ = tx.send(r);
                    }
                }
                Action::Synced(id, r) => {
                    if let Some(Reply::Synced(tx)) = self.replies.remove(&id) {
                        let _ = tx.send(r);
                    }
                }
                Action::Notified(id, r) => {
                    if let Some(Reply::Notified(tx)) = self.replies.remove(&id) {
                        let _ = tx.send(r);
                    }
                }
                Action::Load(order) => self.start_load(order, ctx),
                Action::Repair {
                    model,
                    version,
                    engines,
                } => self.repair(SyncOrder { model, version }, &engines, ctx),
                Action::LeadEval(version) => {
                    let lead = self.lead_eval(version, ctx);
                    ctx.spawn(lead.map(move |result, act, ctx| {
                        act.core.round_finished(version, result, Instant::now());
                        act.apply(ctx);
                    }));
                }
            }
        }
    }

    /// Registers `reply` under `id`, arms a timer for `deadline`, and carries out what the
    /// core queued.
    fn wait(
        &mut self,
        id: WaiterId,
        reply: Reply,
        deadline: Option<Instant>,
        ctx: &mut Context<Self>,
    ) {
        self.replies.insert(id, reply);
        if let Some(deadline) = deadline {
            ctx.run_later(
                deadline.saturating_duration_since(Instant::now()),
                move |act, ctx| {
                    // the timer fired for `deadline`: the core sees at least that instant
                    act.core.expire(Instant::now().max(deadline));
                    act.apply(ctx);
                },
            );
        }
        self.apply(ctx);
    }

    fn start_load(&mut self, order: SyncOrder, ctx: &mut Context<Self>) {
        let load = self.fleet(&order.model).load(order.clone());
        ctx.spawn(load.into_actor(self).map(move |result, act, ctx| {
            act.core.load_finished(&order, result, Instant::now());
            act.apply(ctx);
        }));
    }

    /// Loads `order` on each of the fenced `engines`, one at a time.
    fn repair(&mut self, order: SyncOrder, engines: &[usize], ctx: &mut Context<Self>) {
        let timeout = self.core.config().timeouts.load();
        for (i, engine) in self.fleet(&order.model).engines {
            if !engines.contains(&i) {
                continue;
            }
            let model = order.model.clone();
            let order = order.clone();
            let load = async move { load_one(&engine, &order, timeout).await.map(|r| r.version) };
            ctx.spawn(load.into_actor(self).map(move |result, act, ctx| {
                act.core.repaired(&model, i, result, Instant::now());
                act.apply(ctx);
            }));
        }
    }

    /// The leader's eval-step sequence, run as a future that drives this actor through
    /// messages to itself.
    fn lead_eval(
        &mut self,
        version: Version,
        ctx: &mut Context<Self>,
    ) -> ResponseActFuture<Self, Result<Option<EvalReport>>> {
        let me = ctx.address();
        let engines = self.engines.clone();
        let evaluator = self.evaluator.clone();
        let steps = self.core.eval_steps();
        let timeouts = self.core.config().timeouts.clone();
        let run = async move {
            let mut report = None;
            for step in steps {
                me.send(Internal::Step(step.clone()))
                    .await
                    .map_err(|e| Error::Actor(format!("controller: {e}")))??;
                match step {
                    LeaderStep::CancelInFlight => {
                        for (i, e) in engines.iter().enumerate() {
                            match e.cancel.send(CancelInFlight).timeout(timeouts.load()).await {
                                Ok(_) => {}
                                // a stopped engine, or one whose process is gone, has nothing
                                // in flight
                                Err(MailboxError::Closed) => {
                                    tracing::warn!(engine = i, "engine gone: nothing to cancel");
                                }
                                Err(e) => {
                                    return Err(Error::Actor(format!(
                                        "engine {i} did not cancel: {e}"
                                    )));
                                }
                            }
                        }
                    }
                    LeaderStep::Load(model) => {
                        let order = me
                            .send(Internal::TakeDeferred(model.clone()))
                            .await
                            .map_err(|e| Error::Actor(format!("controller: {e}")))??;
                        if let Some((order, fleet)) = order {
                            let r = fleet.load(order.clone()).await;
                            let failed = r.as_ref().err().map(ToString::to_string);
                            me.send(Internal::Loaded(order.clone(), r))
                                .await
                                .map_err(|e| Error::Actor(format!("controller: {e}")))??;
                            if let Some(e) = failed {
                                return Err(Error::Actor(format!(
                                    "eval step v{version}: loading model `{}` failed: {e}",
                                    order.model
                                )));
                            }
                        }
                    }
                    LeaderStep::Eval => {
                        let Some(ev) = &evaluator else { continue };
                        let r = ev
                            .send(RunEval { step: version })
                            .timeout(timeouts.eval())
                            .await
                            .map_err(|e| Error::Actor(format!("evaluator: {e}")))??;
                        r.check_versions(version)?;
                        report = Some(r);
                    }
                    LeaderStep::ResumeAcquisition
                    | LeaderStep::PauseAcquisition
                    | LeaderStep::WakeAll => {}
                }
            }
            Ok(report)
        };
        Box::pin(run.into_actor(self))
    }
}

#[derive(Debug, Message)]
#[rtype(result = "Result<Option<(SyncOrder, Fleet)>>")]
enum Internal {
    Step(LeaderStep),
    TakeDeferred(ModelId),
    Loaded(SyncOrder, Result<Landed>),
}

impl Actor for WeightSyncController {
    type Context = Context<Self>;
}

impl Handler<Internal> for WeightSyncController {
    type Result = Result<Option<(SyncOrder, Fleet)>>;
    fn handle(&mut self, msg: Internal, ctx: &mut Context<Self>) -> Self::Result {
        let now = Instant::now();
        let r = match msg {
            Internal::Step(step) => {
                self.core.step(&step, now);
                Ok(None)
            }
            Internal::TakeDeferred(model) => self
                .core
                .take_deferred(&model, now)
                .map(|o| o.map(|o| (o, self.fleet(&model)))),
            Internal::Loaded(order, result) => {
                self.core.load_finished(&order, result, now);
                Ok(None)
            }
        };
        self.apply(ctx);
        r
    }
}

impl Handler<CheckRollout> for WeightSyncController {
    type Result = Result<Decision>;
    fn handle(&mut self, msg: CheckRollout, _: &mut Context<Self>) -> Self::Result {
        self.core.check_rollout(&msg.model)
    }
}

impl Handler<AwaitRollout> for WeightSyncController {
    type Result = ResponseFuture<Result<Admission>>;
    fn handle(&mut self, msg: AwaitRollout, ctx: &mut Context<Self>) -> Self::Result {
        match self.core.admit(&msg.model, msg.engine, Instant::now()) {
            Err(e) => Box::pin(async move { Err(e) }),
            Ok(Admit::Now(admission)) => Box::pin(async move { Ok(admission) }),
            Ok(Admit::Wait(id, deadline)) => {
                let (tx, rx) = oneshot::channel();
                self.wait(id, Reply::Admit(tx), Some(deadline), ctx);
                Box::pin(answer(rx))
            }
        }
    }
}

impl Handler<RolloutDone> for WeightSyncController {
    type Result = ();
    fn handle(&mut self, msg: RolloutDone, ctx: &mut Context<Self>) {
        self.core.rollout_done(&msg.model);
        self.apply(ctx);
    }
}

impl Handler<AwaitDrained> for WeightSyncController {
    type Result = ResponseFuture<Result<()>>;
    fn handle(&mut self, msg: AwaitDrained, ctx: &mut Context<Self>) -> Self::Result {
        let Some((id, deadline)) = self.core.await_drained(&msg.model, Instant::now()) else {
            return Box::pin(async { Ok(()) });
        };
        let (tx, rx) = oneshot::channel();
        self.wait(id, Reply::Drained(tx), Some(deadline), ctx);
        Box::pin(answer(rx))
    }
}

impl Handler<AwaitSynced> for WeightSyncController {
    type Result = ResponseFuture<Result<Version>>;
    fn handle(&mut self, msg: AwaitSynced, ctx: &mut Context<Self>) -> Self::Result {
        let (id, deadline) = self
            .core
            .await_synced(&msg.model, msg.version, Instant::now());
        let (tx, rx) = oneshot::channel();
        self.wait(id, Reply::Synced(tx), Some(deadline), ctx);
        Box::pin(answer(rx))
    }
}

impl Handler<BatchReady> for WeightSyncController {
    type Result = ();
    fn handle(&mut self, msg: BatchReady, _: &mut Context<Self>) {
        self.core.batch_ready(&msg.model, Instant::now());
    }
}

impl Handler<NotifyVersion> for WeightSyncController {
    type Result = ResponseFuture<Result<NotifyOutcome>>;
    fn handle(&mut self, msg: NotifyVersion, ctx: &mut Context<Self>) -> Self::Result {
        match self.core.notify(&msg.model, msg.version, Instant::now()) {
            Ok((id, deadline)) => {
                let (tx, rx) = oneshot::channel();
                self.wait(id, Reply::Notified(tx), deadline, ctx);
                Box::pin(answer(rx))
            }
            Err(e) => {
                self.apply(ctx);
                Box::pin(async move { Err(e) })
            }
        }
    }
}

impl Handler<DropEngine> for WeightSyncController {
    type Result = Result<()>;
    fn handle(&mut self, msg: DropEngine, ctx: &mut Context<Self>) -> Result<()> {
        let Some(at) = self.engine_ids.iter().position(|i| *i == msg.index) else {
            return Ok(());
        };
        self.engines.remove(at);
        self.engine_ids.remove(at);
        self.core.engine_replaced(msg.index, Instant::now());
        self.apply(ctx);
        refit_runtime::unless_stopping!(
            warn,
            engine = msg.index,
            left = self.engines.len(),
            "engine dropped"
        );
        Ok(())
    }
}

impl Handler<AddEngine> for WeightSyncController {
    type Result = ResponseActFuture<Self, Result<BTreeMap<ModelId, Version>>>;
    fn handle(&mut self, msg: AddEngine, _: &mut Context<Self>) -> Self::Result {
        // the versions every other engine serves; models still at v0 load nothing
        let targets = self.core.served();
        let timeout = self.core.config().timeouts.load();
        let engine = msg.engine.clone();
        let index = msg.index;
        let bring_up = async move {
            for (model, version) in targets {
                let order = SyncOrder { model, version };
                let report = load_one(&engine, &order, timeout).await?;
                let mut landed = Landed::default();
                fleet::damage(&mut landed, index, &report);
                if let Some(d) = landed.damaged.first() {
                    tracing::error!("{d}");
                }
            }
            engine
                .versions
                .send(ServedVersions)
                .timeout(timeout)
                .await
                .map_err(|e| Error::Actor(format!("the added engine: {e}")))
        };
        Box::pin(bring_up.into_actor(self).map(move |r, act, ctx| {
            let served = r?;
            act.core.engine_replaced(msg.index, Instant::now());
            act.apply(ctx);
            if let Some(at) = act.engine_ids.iter().position(|i| *i == msg.index) {
                act.engines.remove(at);
                act.engine_ids.remove(at);
            }
            act.engines.push(msg.engine);
            act.engine_ids.push(msg.index);
            tracing::info!(
                engine = msg.index,
                engines = act.engines.len(),
                "engine added"
            );
            Ok(served)
        }))
    }
}

impl Handler<EndValidate> for WeightSyncController {
    type Result = ();
    fn handle(&mut self, _: EndValidate, ctx: &mut Context<Self>) {
        self.core.end_validate(Instant::now());
        self.apply(ctx);
    }
}

impl Handler<GetStatus> for WeightSyncController {
    type Result = MessageResult<GetStatus>;
    fn handle(&mut self, _: GetStatus, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.core.status())
    }
}

impl Handler<GetCounts> for WeightSyncController {
    type Result = MessageResult<GetCounts>;
    fn handle(&mut self, _: GetCounts, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.core.counts())
    }
}

impl From<Addr<WeightSyncController>> for crate::protocol::ControllerLink {
    fn from(controller: Addr<WeightSyncController>) -> Self {
        Self::of(&controller)
    }
}

impl From<&Addr<WeightSyncController>> for crate::protocol::ControllerLink {
    fn from(controller: &Addr<WeightSyncController>) -> Self {
        Self::of(controller)
    }
}
