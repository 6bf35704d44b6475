//! The weight-sync controller actor: carries out the decisions of
//! [`SyncPolicy`] and the [`VersionBarrier`].
//!
//! Trainers tell it when they finish a version ([`NotifyVersion`], best through a
//! [`VersionNotifier`], which lets a trainer run one step ahead while keeping its
//! notifications in order); the trajectory pool tells it when a batch is ready
//! ([`BatchReady`]); rollout workers ask it before each fragment ([`AwaitRollout`]) and say
//! when the fragment is over ([`RolloutDone`]). It orders loads on every engine
//! ([`UpdateModel`]) and, on eval steps, the barrier's leader pauses data acquisition,
//! cancels in-flight episodes, loads every model in sorted order, runs the evaluator,
//! checks that every model was evaluated at the round's version, resumes and wakes the
//! other trainers.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_runtime::metrics;
use refit_runtime::sync_policy::{
    BlockReason, Decision, LeaderStep, SyncConfig, SyncOrder, SyncPolicy, VersionBarrier,
    leader_sequence,
};
use refit_runtime::{ModelId, Version};
use tokio::sync::oneshot;

use crate::error::{Error, RemoteFailure, Result};
use crate::protocol::controller::{
    AddEngine, Admission, AwaitDrained, AwaitRollout, AwaitSynced, BatchReady, CheckRollout,
    ControllerStatus, DropEngine, EndValidate, GetStatus, ModelStatus, NotifyOutcome,
    NotifyVersion, RolloutDone, SyncEvent, SyncEventKind,
};
use crate::protocol::engine::{CancelInFlight, EngineRef, ServedVersions, UpdateModel};
use crate::protocol::eval::{EvalReport, RunEval};

type NotifyTx = oneshot::Sender<Result<NotifyOutcome>>;

/// Awaits an answer the controller sends later.
async fn answer<T>(rx: oneshot::Receiver<Result<T>>) -> Result<T> {
    rx.await
        .map_err(|_| Error::Actor("weight-sync controller stopped".into()))?
}

struct Blocked {
    id: u64,
    model: ModelId,
    since: Instant,
    reason: BlockReason,
    tx: oneshot::Sender<Result<Admission>>,
}

#[derive(Default, Clone)]
struct Counters {
    admissions: u64,
    blocked: u64,
    waited: Duration,
    max_staleness: u64,
    loads: u64,
    failed_loads: u64,
    damaged: u64,
    last_error: Option<String>,
    in_flight: u64,
}

const MAX_EVENTS: usize = 100_000;

/// Decides when weights move, and carries it out.
pub struct WeightSyncController {
    policy: SyncPolicy,
    barrier: VersionBarrier<NotifyTx>,
    engines: Vec<EngineRef>,
    /// The id of each engine: its position in the list the controller was made with, or
    /// the id it was added under.
    engine_ids: Vec<usize>,
    evaluator: Option<Recipient<RunEval>>,
    blocked: Vec<Blocked>,
    drains: Vec<(u64, ModelId, oneshot::Sender<Result<()>>)>,
    synced: Vec<(u64, ModelId, Version, oneshot::Sender<Result<Version>>)>,
    counters: BTreeMap<ModelId, Counters>,
    events: std::collections::VecDeque<SyncEvent>,
    seq: u64,
    next_id: u64,
    evals: u64,
    started: Instant,
}

impl std::fmt::Debug for WeightSyncController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightSyncController")
            .field("mode", &self.policy.config().sync_mode)
            .field("engines", &self.engines.len())
            .field("seq", &self.seq)
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
        let models = if cfg.models.is_empty() {
            models
        } else {
            cfg.models.clone()
        };
        let policy = SyncPolicy::new(cfg, models.iter().cloned())?;
        let barrier = VersionBarrier::new(models.iter().cloned())?;
        let counters = models
            .iter()
            .map(|m| (m.clone(), Counters::default()))
            .collect();
        for m in &models {
            if let Ok(s) = policy.model(m) {
                metrics::sync_state(m.as_str(), s.train_version.0, s.rollout_version.0);
            }
        }
        Ok(Self {
            policy,
            barrier,
            engine_ids: (0..engines.len()).collect(),
            engines,
            evaluator,
            blocked: Vec::new(),
            drains: Vec::new(),
            synced: Vec::new(),
            counters,
            events: std::collections::VecDeque::new(),
            seq: 0,
            next_id: 0,
            evals: 0,
            started: Instant::now(),
        })
    }

    fn event(&mut self, model: Option<&ModelId>, kind: SyncEventKind) -> u64 {
        // every change of a model's versions comes with an event: the gauges follow it
        if let Some(m) = model.and_then(|m| self.policy.model(m).ok()) {
            metrics::sync_state(
                model.map_or("", ModelId::as_str),
                m.train_version.0,
                m.rollout_version.0,
            );
        }
        self.seq += 1;
        if self.events.len() == MAX_EVENTS {
            self.events.pop_front();
        }
        self.events.push_back(SyncEvent {
            seq: self.seq,
            at: self.started.elapsed(),
            model: model.cloned(),
            kind,
        });
        self.seq
    }

    fn counters(&mut self, model: &ModelId) -> &mut Counters {
        self.counters.entry(model.clone()).or_default()
    }

    fn admit(&mut self, model: &ModelId, waited: Duration) -> Result<Admission> {
        let m = self.policy.model(model)?;
        let (train_version, rollout_version) = (m.train_version, m.rollout_version);
        let staleness = train_version.0.saturating_sub(rollout_version.0);
        let mut admission = Admission {
            seq: 0,
            train_version,
            rollout_version,
            staleness,
            waited,
        };
        admission.seq = self.event(Some(model), SyncEventKind::Admitted(admission));
        let c = self.counters(model);
        c.admissions += 1;
        c.in_flight += 1;
        c.waited += waited;
        c.blocked += u64::from(!waited.is_zero());
        c.max_staleness = c.max_staleness.max(staleness);
        Ok(admission)
    }

    /// Lets through every blocked rollout the policy now allows.
    fn wake(&mut self) {
        let blocked = std::mem::take(&mut self.blocked);
        for b in blocked {
            match self.policy.check_rollout(&b.model) {
                Ok(Decision::Continue { .. }) => {
                    let waited = b.since.elapsed().max(Duration::from_nanos(1));
                    let r = self.admit(&b.model, waited);
                    if let Err(Ok(_)) = b.tx.send(r) {
                        // the worker is gone: its admission will never finish
                        self.rollout_done(&b.model);
                    }
                }
                Ok(Decision::Block(_)) => self.blocked.push(b),
                Err(e) => {
                    let _ = b.tx.send(Err(e.into()));
                }
            }
        }
    }

    fn rollout_done(&mut self, model: &ModelId) {
        let c = self.counters(model);
        c.in_flight = c.in_flight.saturating_sub(1);
        if c.in_flight == 0 {
            for (_, _, tx) in self.drains.extract_if(.., |(_, m, _)| m == model) {
                let _ = tx.send(Ok(()));
            }
        }
    }

    fn start_load(&mut self, order: SyncOrder, ctx: &mut Context<Self>) {
        self.event(
            Some(&order.model),
            SyncEventKind::LoadStarted(order.version),
        );
        let load = load_everywhere(
            self.fleet(),
            order.clone(),
            self.policy.config().timeouts.load(),
        );
        ctx.spawn(load.into_actor(self).map(move |result, act, ctx| {
            act.load_finished(&order, result, ctx);
        }));
    }

    /// Every engine, with the id it is named by.
    fn fleet(&self) -> Vec<(usize, EngineRef)> {
        self.engine_ids
            .iter()
            .copied()
            .zip(self.engines.iter().cloned())
            .collect()
    }

    fn load_finished(
        &mut self,
        order: &SyncOrder,
        result: Result<Landed>,
        ctx: &mut Context<Self>,
    ) {
        let next = match result {
            Ok(landed) => {
                for d in landed.damaged {
                    tracing::error!(model = %order.model, version = %order.version, "{d}");
                    self.event(Some(&order.model), SyncEventKind::Damaged(d.clone()));
                    let c = self.counters(&order.model);
                    c.damaged += 1;
                    c.last_error = Some(d);
                }
                self.event(Some(&order.model), SyncEventKind::Landed(landed.served));
                self.counters(&order.model).loads += 1;
                self.policy
                    .sync_done(&order.model, order.version, landed.served)
            }
            Err(e) => {
                let msg = e.to_string();
                tracing::error!(model = %order.model, version = %order.version, "load failed: {msg}");
                self.event(
                    Some(&order.model),
                    SyncEventKind::LoadFailed(order.version, msg.clone()),
                );
                let c = self.counters(&order.model);
                c.failed_loads += 1;
                c.last_error = Some(msg);
                self.policy.sync_failed(&order.model, order.version)
            }
        };
        match next {
            Ok(Some(next)) => self.start_load(next, ctx),
            Ok(None) => {}
            Err(e) => self.policy_error(&order.model, e.to_string()),
        }
        self.wake();
        self.wake_synced();
    }

    fn wake_synced(&mut self) {
        let policy = &self.policy;
        let landed =
            |m: &ModelId, v: Version| policy.model(m).map_or(true, |s| s.rollout_version >= v);
        for (_, m, _, tx) in self.synced.extract_if(.., |(_, m, v, _)| landed(m, *v)) {
            let _ = tx.send(
                policy
                    .model(&m)
                    .map(|s| s.rollout_version)
                    .map_err(Into::into),
            );
        }
    }

    fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// A policy error with no caller to answer: logged, put on the timeline and kept as the
    /// model's `last_error`, so a run's report shows it (not only the log).
    fn policy_error(&mut self, model: &ModelId, msg: String) {
        tracing::error!(model = %model, "sync policy: {msg}");
        self.event(Some(model), SyncEventKind::PolicyError(msg.clone()));
        self.counters(model).last_error = Some(msg);
    }

    /// `"; last load error: .."` for a model whose last load failed, else empty.
    fn last_error_note(&self, model: &ModelId) -> String {
        self.counters
            .get(model)
            .and_then(|c| c.last_error.as_ref())
            .map(|e| format!("; last load error: {e}"))
            .unwrap_or_default()
    }

    fn expire_blocked(&mut self, id: u64, timeout: Duration) {
        if let Some(i) = self.blocked.iter().position(|b| b.id == id) {
            let b = self.blocked.swap_remove(i);
            let last = self.last_error_note(&b.model);
            let _ = b.tx.send(Err(Error::Runtime(refit_runtime::Error::Timeout {
                what: format!(
                    "a rollout of model `{}` to be let through (blocked: {:?}){last}",
                    b.model, b.reason
                ),
                after: timeout,
            })));
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
        let fleet = self.fleet();
        let engines = self.engines.clone();
        let evaluator = self.evaluator.clone();
        let steps = leader_sequence(self.policy.models(), true);
        let timeouts = self.policy.config().timeouts.clone();
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
                        if let Some(order) = order {
                            let r = load_everywhere(fleet.clone(), order.clone(), timeouts.load())
                                .await;
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

/// What a load across the fleet found.
#[derive(Debug)]
struct Landed {
    /// The lowest version served.
    served: Version,
    /// Engines that served weights changed since they were applied (`verify = "hashes"`),
    /// each named with what differed.
    damaged: Vec<String>,
}

/// Sends one load to every engine at once and waits for all (latency is the slowest
/// engine's, not the sum); answers the lowest version served, and the engines whose served
/// weights had changed since they were applied.
async fn load_everywhere(
    engines: Vec<(usize, EngineRef)>,
    order: SyncOrder,
    timeout: Duration,
) -> Result<Landed> {
    let requests: Vec<_> = engines
        .iter()
        .map(|(_, e)| {
            e.update
                .send(UpdateModel {
                    model: order.model.clone(),
                    version: order.version,
                    timeout,
                })
                .timeout(timeout + Duration::from_secs(1))
        })
        .collect();
    let mut served: Option<Version> = None;
    let mut gone = Vec::new();
    let mut damaged = Vec::new();
    for ((i, _), r) in engines.iter().zip(requests) {
        let report = match r.await {
            // an engine in a process that died: it is dropped (see `DropEngine`), the load
            // lands on the others
            Ok(Err(e)) if matches!(e.remote_failure(), Some(RemoteFailure::PeerGone { .. })) => {
                tracing::warn!(engine = i, model = %order.model, version = %order.version, "engine gone: {e}");
                gone.push(e.to_string());
                continue;
            }
            r => r.map_err(|e| {
                Error::Actor(format!(
                    "engine {i} did not load model `{}` v{}: {e}",
                    order.model, order.version
                ))
            })??,
        };
        if let Some(d) = report.damaged {
            damaged.push(format!(
                "engine {i} served weights that changed after it applied them: {d} (v{} replaced them whole)",
                report.version
            ));
        }
        served = Some(served.map_or(report.version, |s| s.min(report.version)));
    }
    let served = served.ok_or_else(|| match gone.first() {
        Some(e) => Error::Actor(format!("every engine is gone: {e}")),
        None => Error::Config("no engine to load on".into()),
    })?;
    Ok(Landed { served, damaged })
}

#[derive(Debug, Message)]
#[rtype(result = "Result<Option<SyncOrder>>")]
enum Internal {
    Step(LeaderStep),
    TakeDeferred(ModelId),
    Loaded(SyncOrder, Result<Landed>),
}

impl Actor for WeightSyncController {
    type Context = Context<Self>;
}

impl Handler<Internal> for WeightSyncController {
    type Result = Result<Option<SyncOrder>>;
    fn handle(&mut self, msg: Internal, ctx: &mut Context<Self>) -> Self::Result {
        match msg {
            Internal::Step(step) => {
                self.event(None, SyncEventKind::Step(step.clone()));
                match step {
                    LeaderStep::PauseAcquisition => self.policy.pause_acquisition(),
                    LeaderStep::ResumeAcquisition if self.evaluator.is_some() => {
                        self.policy.end_validate();
                        self.wake();
                    }
                    _ => {}
                }
                Ok(None)
            }
            Internal::TakeDeferred(model) => {
                let order = self.policy.take_deferred(&model)?;
                if let Some(o) = &order {
                    self.event(Some(&o.model), SyncEventKind::LoadStarted(o.version));
                }
                Ok(order)
            }
            Internal::Loaded(order, result) => {
                self.load_finished(&order, result, ctx);
                Ok(None)
            }
        }
    }
}

impl Handler<CheckRollout> for WeightSyncController {
    type Result = Result<Decision>;
    fn handle(&mut self, msg: CheckRollout, _: &mut Context<Self>) -> Self::Result {
        Ok(self.policy.check_rollout(&msg.model)?)
    }
}

impl Handler<AwaitRollout> for WeightSyncController {
    type Result = ResponseFuture<Result<Admission>>;
    fn handle(&mut self, msg: AwaitRollout, ctx: &mut Context<Self>) -> Self::Result {
        let decision = match self.policy.check_rollout(&msg.model) {
            Ok(d) => d,
            Err(e) => return Box::pin(async move { Err(e.into()) }),
        };
        match decision {
            Decision::Continue { .. } => {
                let r = self.admit(&msg.model, Duration::ZERO);
                Box::pin(async move { r })
            }
            Decision::Block(reason) => {
                self.event(Some(&msg.model), SyncEventKind::Blocked(reason));
                let (tx, rx) = oneshot::channel();
                let id = self.next_id();
                self.blocked.push(Blocked {
                    id,
                    model: msg.model,
                    since: Instant::now(),
                    reason,
                    tx,
                });
                let timeout = self.policy.config().timeouts.rollout_wait();
                ctx.run_later(timeout, move |act, _| act.expire_blocked(id, timeout));
                Box::pin(answer(rx))
            }
        }
    }
}

impl Handler<RolloutDone> for WeightSyncController {
    type Result = ();
    fn handle(&mut self, msg: RolloutDone, _: &mut Context<Self>) {
        self.rollout_done(&msg.model);
    }
}

impl Handler<AwaitDrained> for WeightSyncController {
    type Result = ResponseFuture<Result<()>>;
    fn handle(&mut self, msg: AwaitDrained, ctx: &mut Context<Self>) -> Self::Result {
        if self.counters(&msg.model).in_flight == 0 {
            return Box::pin(async { Ok(()) });
        }
        let (tx, rx) = oneshot::channel();
        let id = self.next_id();
        self.drains.push((id, msg.model, tx));
        let timeout = self.policy.config().timeouts.rollout_wait();
        ctx.run_later(timeout, move |act, _| {
            for (_, m, tx) in act.drains.extract_if(.., |w| w.0 == id) {
                let _ = tx.send(Err(Error::Runtime(refit_runtime::Error::Timeout {
                    what: format!("the rollouts of model `{m}` in flight to finish"),
                    after: timeout,
                })));
            }
        });
        Box::pin(answer(rx))
    }
}

impl Handler<AwaitSynced> for WeightSyncController {
    type Result = ResponseFuture<Result<Version>>;
    fn handle(&mut self, msg: AwaitSynced, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        let id = self.next_id();
        self.synced.push((id, msg.model, msg.version, tx));
        self.wake_synced();
        let timeout = self.policy.config().timeouts.load() * 2;
        ctx.run_later(timeout, move |act, _| {
            let expired: Vec<_> = act.synced.extract_if(.., |w| w.0 == id).collect();
            for (_, m, v, tx) in expired {
                let last = act.last_error_note(&m);
                let _ = tx.send(Err(Error::Runtime(refit_runtime::Error::Timeout {
                    what: format!("model `{m}` v{v} to land on every engine{last}"),
                    after: timeout,
                })));
            }
        });
        Box::pin(answer(rx))
    }
}

impl Handler<BatchReady> for WeightSyncController {
    type Result = ();
    fn handle(&mut self, msg: BatchReady, _: &mut Context<Self>) {
        self.event(Some(&msg.model), SyncEventKind::BatchReady);
        if let Err(e) = self.policy.batch_ready(&msg.model) {
            self.policy_error(&msg.model, format!("batch ready: {e}"));
        }
    }
}

impl Handler<NotifyVersion> for WeightSyncController {
    type Result = ResponseFuture<Result<NotifyOutcome>>;
    fn handle(&mut self, msg: NotifyVersion, ctx: &mut Context<Self>) -> Self::Result {
        let NotifyVersion { model, version } = msg;
        // Phase 1: the trainer finished; non-eval steps load now, eval steps defer.
        match self.policy.trainer_finished(&model, version) {
            Ok(order) => {
                self.event(Some(&model), SyncEventKind::TrainerFinished(version));
                if let Some(order) = order {
                    self.start_load(order, ctx);
                }
                self.wake();
            }
            Err(e) => return Box::pin(async move { Err(e.into()) }),
        }
        // Phase 2: the version barrier.
        let (tx, rx) = oneshot::channel();
        self.event(Some(&model), SyncEventKind::Arrived(version));
        match self.barrier.arrive(&model, version, tx) {
            Ok(Some(round)) => self.release(round, ctx),
            Ok(None) => {
                let timeout = self.policy.config().timeouts.barrier();
                let waiting = model.clone();
                ctx.run_later(timeout, move |act, _| {
                    if let Some((v, tx)) = act.barrier.withdraw(&waiting, version) {
                        let (missing, _) = act.barrier.waiting_for();
                        let names: Vec<String> = missing.iter().map(ToString::to_string).collect();
                        let _ = tx.send(Err(Error::Runtime(refit_runtime::Error::Timeout {
                            what: format!(
                                "the version barrier at v{v} (model `{waiting}` arrived; still missing: {})",
                                names.join(", ")
                            ),
                            after: timeout,
                        })));
                    }
                });
            }
            Err(e) => {
                // A broken round: fail every waiter, naming what was wrong.
                let msg = e.to_string();
                for (_, _, tx) in self.barrier.abort() {
                    let _ = tx.send(Err(Error::Actor(msg.clone())));
                }
                return Box::pin(async move { Err(e.into()) });
            }
        }
        Box::pin(answer(rx))
    }
}

impl WeightSyncController {
    fn release(
        &mut self,
        round: refit_runtime::sync_policy::Round<NotifyTx>,
        ctx: &mut Context<Self>,
    ) {
        let eval = self.policy.config().is_eval_step(round.version);
        self.event(
            Some(&round.leader),
            SyncEventKind::Leader {
                version: round.version,
                eval,
            },
        );
        let version = round.version;
        let leader = round.leader.clone();
        let waiters = round.waiters;
        let finish = move |act: &mut Self, result: Result<Option<EvalReport>>| {
            act.event(None, SyncEventKind::Released(version));
            match result {
                Ok(report) => {
                    if report.is_some() {
                        act.evals += 1;
                        act.event(None, SyncEventKind::Evaluated(version));
                    }
                    for (m, tx) in waiters {
                        let _ = tx.send(Ok(NotifyOutcome {
                            version,
                            leader: m == leader,
                            eval: report.clone(),
                        }));
                    }
                }
                Err(e) => {
                    // Never leave acquisition paused behind a failed eval step.
                    if act.evaluator.is_some() {
                        act.policy.end_validate();
                        act.wake();
                    }
                    let msg = e.to_string();
                    for (_, tx) in waiters {
                        let _ = tx.send(Err(Error::Actor(msg.clone())));
                    }
                }
            }
        };
        if eval {
            let lead = self.lead_eval(version, ctx);
            ctx.spawn(lead.map(move |result, act, _| finish(act, result)));
        } else {
            finish(self, Ok(None));
        }
    }
}

impl Handler<DropEngine> for WeightSyncController {
    type Result = Result<()>;
    fn handle(&mut self, msg: DropEngine, _: &mut Context<Self>) -> Result<()> {
        let Some(at) = self.engine_ids.iter().position(|i| *i == msg.index) else {
            return Ok(());
        };
        self.engines.remove(at);
        self.engine_ids.remove(at);
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
        let targets: Vec<(ModelId, Version)> = self
            .policy
            .models()
            .filter_map(|m| {
                let v = self.policy.model(m).ok()?.rollout_version;
                (v > Version::ZERO).then(|| (m.clone(), v))
            })
            .collect();
        let timeout = self.policy.config().timeouts.load();
        let engine = msg.engine.clone();
        let index = msg.index;
        let bring_up = async move {
            for (model, version) in targets {
                let order = SyncOrder { model, version };
                let landed = load_everywhere(vec![(index, engine.clone())], order, timeout).await?;
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
        Box::pin(bring_up.into_actor(self).map(move |r, act, _| {
            let served = r?;
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
    fn handle(&mut self, _: EndValidate, _: &mut Context<Self>) {
        self.event(None, SyncEventKind::Step(LeaderStep::ResumeAcquisition));
        self.policy.end_validate();
        self.wake();
    }
}

impl Handler<GetStatus> for WeightSyncController {
    type Result = MessageResult<GetStatus>;
    fn handle(&mut self, _: GetStatus, _: &mut Context<Self>) -> Self::Result {
        let models = self
            .policy
            .models()
            .cloned()
            .collect::<Vec<_>>()
            .into_iter()
            .filter_map(|m| {
                let s = self.policy.model(&m).ok()?.clone();
                let c = self.counters.get(&m).cloned().unwrap_or_default();
                Some((
                    m,
                    ModelStatus {
                        train_version: s.train_version,
                        rollout_version: s.rollout_version,
                        state: s.state,
                        admissions: c.admissions,
                        blocked: c.blocked,
                        waited: c.waited,
                        max_staleness: c.max_staleness,
                        loads: c.loads,
                        failed_loads: c.failed_loads,
                        damaged: c.damaged,
                        last_error: c.last_error,
                    },
                ))
            })
            .collect();
        MessageResult(ControllerStatus {
            models,
            acquisition_paused: self.policy.acquisition_paused(),
            evals: self.evals,
            events: self.events.iter().cloned().collect(),
        })
    }
}

/// A trainer's handle on the controller: notifications go out in order, and a trainer may
/// run one step ahead — [`VersionNotifier::notify`] returns at once on non-eval steps after
/// the previous notification completed, and waits for the round (and its validation) on
/// eval steps.
pub struct VersionNotifier {
    controller: Recipient<NotifyVersion>,
    model: ModelId,
    cfg: SyncConfig,
    deadline: Duration,
    pending: Option<actix::dev::RecipientRequest<NotifyVersion>>,
}

impl std::fmt::Debug for VersionNotifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VersionNotifier")
            .field("model", &self.model)
            .field("pending", &self.pending.is_some())
            .finish()
    }
}

impl VersionNotifier {
    /// A notifier for `model`'s trainer, to a controller in this process or another
    /// (`Addr<WeightSyncController>` or [`ControllerRef::notify`](crate::protocol::ControllerRef)).
    /// Each notification waits at most the longest round the configuration allows (the
    /// barrier's deadline plus, on eval steps, the loads and the validation).
    pub fn new(
        controller: impl Into<Recipient<NotifyVersion>>,
        model: ModelId,
        cfg: SyncConfig,
    ) -> Self {
        let t = &cfg.timeouts;
        let deadline = t.barrier() + t.load() * 2 + t.eval() + Duration::from_secs(5);
        Self {
            controller: controller.into(),
            model,
            cfg,
            deadline,
            pending: None,
        }
    }

    fn late(&self) -> Error {
        Error::Runtime(refit_runtime::Error::Timeout {
            what: format!("the controller's round for model `{}`", self.model),
            after: self.deadline,
        })
    }

    /// Waits for the previous notification's round, if one is pending.
    ///
    /// # Errors
    /// The previous round's failure; the controller gone.
    pub async fn flush(&mut self) -> Result<Option<NotifyOutcome>> {
        match self.pending.take() {
            None => Ok(None),
            Some(req) => Ok(Some(
                tokio::time::timeout(self.deadline, req)
                    .await
                    .map_err(|_| self.late())?
                    .map_err(|e| Error::Actor(format!("weight-sync controller: {e}")))??,
            )),
        }
    }

    /// Notifies `version`: waits for the previous notification first (notifications are
    /// serialised), then returns at once on a non-eval step, or waits for the round and
    /// answers its outcome (with the validation) on an eval step.
    ///
    /// # Errors
    /// The previous or this round's failure (a stale version, a barrier deadline, a failed
    /// eval-step load or validation).
    pub async fn notify(&mut self, version: Version) -> Result<Option<NotifyOutcome>> {
        self.flush().await?;
        let req = self.controller.send(NotifyVersion {
            model: self.model.clone(),
            version,
        });
        if self.cfg.is_eval_step(version) {
            Ok(Some(
                tokio::time::timeout(self.deadline, req)
                    .await
                    .map_err(|_| self.late())?
                    .map_err(|e| Error::Actor(format!("weight-sync controller: {e}")))??,
            ))
        } else {
            self.pending = Some(req);
            Ok(None)
        }
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
