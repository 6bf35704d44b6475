//! The controller's plain core: the [`SyncPolicy`] and the [`VersionBarrier`], the waiters
//! (blocked admissions, drains, `synced` waiters, barrier arrivals) with their deadlines,
//! the counters and the event timeline. No actix and no tokio: each input is a method call
//! with the time passed in (`now`), each answer either comes back from the call or is
//! queued as an [`Action`] for [`SyncCore::poll_action`]; the actor owns the reply
//! channels, the engines and the timers, and arms one timer per deadline the core names.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use refit_runtime::metrics;
use refit_runtime::sync_policy::{
    BlockReason, Decision, LeaderStep, Round, SyncConfig, SyncOrder, SyncPolicy, VersionBarrier,
    leader_sequence,
};
use refit_runtime::{ModelId, Version};

pub(crate) use super::commit::EngineId;
use crate::error::{Error, Result};
use crate::protocol::controller::{
    Admission, ControllerStatus, ModelStatus, NotifyOutcome, SyncEvent, SyncEventKind,
};
use crate::protocol::eval::EvalReport;

/// Names one waiter; the actor keeps its reply channel under this id.
pub(crate) type WaiterId = u64;

/// What a load across the fleet found.
#[derive(Debug, Default)]
pub(crate) struct Landed {
    /// The version the fleet serves now (committed on `committed`).
    pub(crate) served: Version,
    /// Engines that served weights changed since they were applied (`verify = "hashes"`),
    /// each named with what differed.
    pub(crate) damaged: Vec<String>,
    /// The engines that serve `served` now.
    pub(crate) committed: Vec<EngineId>,
    /// The engines that could not stage or commit it, with why: they are fenced.
    pub(crate) fenced: Vec<(EngineId, String)>,
}

/// An engine fenced from rollouts: since when, and why.
#[derive(Debug, Clone)]
struct Fence {
    since: Instant,
    reason: String,
}

/// The answer to a rollout asking to start.
#[derive(Debug)]
pub(crate) enum Admit {
    /// Let through now.
    Now(Admission),
    /// Blocked: answered later through [`Action::Admitted`], at the latest at the deadline.
    Wait(WaiterId, Instant),
}

/// What the core asks of the actor.
#[derive(Debug)]
pub(crate) enum Action {
    /// Answer a blocked admission. Should the worker be gone with an `Ok`, the actor calls
    /// [`SyncCore::rollout_done`] for `model` (that admission will never finish).
    Admitted {
        id: WaiterId,
        model: ModelId,
        result: Result<Admission>,
    },
    /// Answer a drain waiter.
    Drained(WaiterId, Result<()>),
    /// Answer a `synced` waiter.
    Synced(WaiterId, Result<Version>),
    /// Answer a trainer's notification (its round).
    Notified(WaiterId, Result<NotifyOutcome>),
    /// Load this order on every engine, then call [`SyncCore::load_finished`].
    Load(SyncOrder),
    /// Run the leader's eval-step sequence ([`SyncCore::eval_steps`]) for this round, then
    /// call [`SyncCore::round_finished`].
    LeadEval(Version),
    /// Bring the fenced `engines` to `version` of `model` (a full load on each), then call
    /// [`SyncCore::repaired`] for each.
    Repair {
        model: ModelId,
        version: Version,
        engines: Vec<EngineId>,
    },
}

struct Blocked {
    id: WaiterId,
    model: ModelId,
    /// The engine the rollout acts through, when the caller said.
    engine: Option<EngineId>,
    since: Instant,
    deadline: Instant,
    reason: BlockReason,
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
    fences: u64,
    fenced_for: Duration,
    last_error: Option<String>,
    in_flight: u64,
}

/// A round released on an eval step, waiting for its leader's sequence.
struct Lead {
    leader: ModelId,
    waiters: Vec<(ModelId, WaiterId)>,
}

const MAX_EVENTS: usize = 100_000;

/// The controller's decisions and waiters, without IO.
pub(crate) struct SyncCore {
    policy: SyncPolicy,
    barrier: VersionBarrier<WaiterId>,
    /// Whether the run has an evaluator (eval steps pause and resume acquisition).
    evaluator: bool,
    blocked: Vec<Blocked>,
    drains: Vec<(WaiterId, ModelId, Instant)>,
    synced: Vec<(WaiterId, ModelId, Version, Instant)>,
    /// Barrier arrivals still waiting, with their deadlines.
    arrivals: Vec<(ModelId, Version, Instant)>,
    leads: BTreeMap<Version, Lead>,
    /// Per model, the engines fenced from its rollouts.
    fences: BTreeMap<ModelId, BTreeMap<EngineId, Fence>>,
    counters: BTreeMap<ModelId, Counters>,
    events: VecDeque<SyncEvent>,
    actions: VecDeque<Action>,
    seq: u64,
    next_id: WaiterId,
    evals: u64,
    started: Instant,
}

impl std::fmt::Debug for SyncCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncCore")
            .field("mode", &self.policy.config().sync_mode)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl SyncCore {
    /// A core for the models of `cfg` (or `models` when the configuration lists none);
    /// `evaluator` says whether eval steps run one. `now` starts the timeline.
    ///
    /// # Errors
    /// [`Error::Config`] for no model, or a configuration that fails its checks.
    pub(crate) fn new(
        cfg: &SyncConfig,
        models: Vec<ModelId>,
        evaluator: bool,
        now: Instant,
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
            evaluator,
            blocked: Vec::new(),
            drains: Vec::new(),
            synced: Vec::new(),
            arrivals: Vec::new(),
            leads: BTreeMap::new(),
            fences: BTreeMap::new(),
            counters,
            events: VecDeque::new(),
            actions: VecDeque::new(),
            seq: 0,
            next_id: 0,
            evals: 0,
            started: now,
        })
    }

    /// Carries `model`'s counters over from a run this one resumes (its `status` at the
    /// checkpoint, and the eval steps it had run): later counts add to them. The versions
    /// and the timeline are not carried: the versions come from the checkpoint itself, the
    /// timeline starts with this run.
    pub(crate) fn carry(&mut self, model: &ModelId, status: &ModelStatus, evals: u64) {
        let c = self.counters.entry(model.clone()).or_default();
        c.admissions += status.admissions;
        c.blocked += status.blocked;
        c.waited += status.waited;
        c.max_staleness = c.max_staleness.max(status.max_staleness);
        c.loads += status.loads;
        c.failed_loads += status.failed_loads;
        c.damaged += status.damaged;
        c.fences += status.fences;
        c.fenced_for += status.fenced_for;
        if c.last_error.is_none() {
            c.last_error.clone_from(&status.last_error);
        }
        self.evals = self.evals.max(evals);
    }

    /// The configuration.
    pub(crate) fn config(&self) -> &SyncConfig {
        self.policy.config()
    }

    /// The last event's sequence number.
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// The next thing to do, in order; `None` when nothing is queued.
    pub(crate) fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The leader's eval-step sequence.
    pub(crate) fn eval_steps(&self) -> Vec<LeaderStep> {
        leader_sequence(self.policy.models(), true)
    }

    /// The version each model serves everywhere, for the models past v0 (what an engine
    /// that joins loads first).
    pub(crate) fn served(&self) -> Vec<(ModelId, Version)> {
        self.policy
            .models()
            .filter_map(|m| {
                let v = self.policy.model(m).ok()?.rollout_version;
                (v > Version::ZERO).then(|| (m.clone(), v))
            })
            .collect()
    }

    fn event(&mut self, model: Option<&ModelId>, kind: SyncEventKind, now: Instant) -> u64 {
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
            at: now.saturating_duration_since(self.started),
            model: model.cloned(),
            kind,
        });
        self.seq
    }

    fn counters(&mut self, model: &ModelId) -> &mut Counters {
        self.counters.entry(model.clone()).or_default()
    }

    fn next_id(&mut self) -> WaiterId {
        self.next_id += 1;
        self.next_id
    }

    /// The policy's decision for a rollout of `model`, without admitting it.
    ///
    /// # Errors
    /// An unknown model.
    pub(crate) fn check_rollout(&self, model: &ModelId) -> Result<Decision> {
        Ok(self.policy.check_rollout(model)?)
    }

    /// A rollout of `model` asks to start: admitted now, or blocked until the policy lets it
    /// through ([`Action::Admitted`]) or its deadline passes ([`SyncCore::expire`]).
    ///
    /// # Errors
    /// An unknown model.
    pub(crate) fn admit(
        &mut self,
        model: &ModelId,
        engine: Option<EngineId>,
        now: Instant,
    ) -> Result<Admit> {
        match self.check_engine(model, engine)? {
            Decision::Continue { .. } => {
                Ok(Admit::Now(self.admitted(model, Duration::ZERO, now)?))
            }
            Decision::Block(reason) => {
                self.event(Some(model), SyncEventKind::Blocked(reason), now);
                let id = self.next_id();
                let deadline = now + self.config().timeouts.rollout_wait();
                self.blocked.push(Blocked {
                    id,
                    model: model.clone(),
                    engine,
                    since: now,
                    deadline,
                    reason,
                });
                Ok(Admit::Wait(id, deadline))
            }
        }
    }

    fn admitted(&mut self, model: &ModelId, waited: Duration, now: Instant) -> Result<Admission> {
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
        admission.seq = self.event(Some(model), SyncEventKind::Admitted(admission), now);
        let c = self.counters(model);
        c.admissions += 1;
        c.in_flight += 1;
        c.waited += waited;
        c.blocked += u64::from(!waited.is_zero());
        c.max_staleness = c.max_staleness.max(staleness);
        Ok(admission)
    }

    /// Lets through every blocked rollout the policy now allows.
    fn wake(&mut self, now: Instant) {
        let blocked = std::mem::take(&mut self.blocked);
        for b in blocked {
            match self.check_engine(&b.model, b.engine) {
                Ok(Decision::Continue { .. }) => {
                    let waited = now
                        .saturating_duration_since(b.since)
                        .max(Duration::from_nanos(1));
                    let result = self.admitted(&b.model, waited, now);
                    self.actions.push_back(Action::Admitted {
                        id: b.id,
                        model: b.model,
                        result,
                    });
                }
                Ok(Decision::Block(_)) => self.blocked.push(b),
                Err(e) => self.actions.push_back(Action::Admitted {
                    id: b.id,
                    model: b.model,
                    result: Err(e),
                }),
            }
        }
    }

    /// The policy's decision for a rollout of `model` through `engine`: blocked while that
    /// engine is fenced.
    fn check_engine(&self, model: &ModelId, engine: Option<EngineId>) -> Result<Decision> {
        if let Some(e) = engine
            && self.fences.get(model).is_some_and(|f| f.contains_key(&e))
        {
            return Ok(Decision::Block(BlockReason::Fenced));
        }
        Ok(self.policy.check_rollout(model)?)
    }

    /// The engines fenced from `model`'s rollouts.
    pub(crate) fn fenced(&self, model: &ModelId) -> BTreeSet<EngineId> {
        self.fences
            .get(model)
            .map(|f| f.keys().copied().collect())
            .unwrap_or_default()
    }

    fn fence(&mut self, model: &ModelId, engine: EngineId, reason: String, now: Instant) {
        let fences = self.fences.entry(model.clone()).or_default();
        if fences.contains_key(&engine) {
            return;
        }
        tracing::warn!(model = %model, engine, "engine fenced: no rollouts from it until it serves the fleet's version: {reason}");
        fences.insert(
            engine,
            Fence {
                since: now,
                reason: reason.clone(),
            },
        );
        self.event(Some(model), SyncEventKind::Fenced { engine, reason }, now);
        self.counters(model).fences += 1;
    }

    fn unfence(&mut self, model: &ModelId, engine: EngineId, now: Instant) {
        let Some(fence) = self.fences.get_mut(model).and_then(|f| f.remove(&engine)) else {
            return;
        };
        let after = now.saturating_duration_since(fence.since);
        tracing::info!(model = %model, engine, "engine back in the fleet after {after:?} fenced ({})", fence.reason);
        self.event(Some(model), SyncEventKind::Unfenced { engine, after }, now);
        self.counters(model).fenced_for += after;
        self.wake(now);
    }

    /// A repair ordered through [`Action::Repair`] finished on `engine`: the engine serves
    /// `result`'s version. Serving the fleet's version, it is back; otherwise it stays fenced
    /// (the next load of the model stages on it again).
    pub(crate) fn repaired(
        &mut self,
        model: &ModelId,
        engine: EngineId,
        result: Result<Version>,
        now: Instant,
    ) {
        let fleet = self
            .policy
            .model(model)
            .map(|s| s.rollout_version)
            .map_err(Error::from);
        match (result, fleet) {
            (Ok(v), Ok(fleet)) if v == fleet => self.unfence(model, engine, now),
            (Ok(v), Ok(fleet)) => {
                tracing::warn!(model = %model, engine, "repair brought v{v}, the fleet serves v{fleet}: still fenced")
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(model = %model, engine, "repair failed, still fenced: {e}")
            }
        }
    }

    /// `engine` left the fleet (its process died) or rejoined it at the fleet's versions:
    /// it is fenced no more.
    pub(crate) fn engine_replaced(&mut self, engine: EngineId, now: Instant) {
        let models: Vec<ModelId> = self.fences.keys().cloned().collect();
        for m in models {
            self.unfence(&m, engine, now);
        }
    }

    /// A rollout of `model` finished; the last one in flight answers the drain waiters.
    pub(crate) fn rollout_done(&mut self, model: &ModelId) {
        let c = self.counters(model);
        c.in_flight = c.in_flight.saturating_sub(1);
        if c.in_flight == 0 {
            for (id, _, _) in self.drains.extract_if(.., |(_, m, _)| m == model) {
                self.actions.push_back(Action::Drained(id, Ok(())));
            }
        }
    }

    /// Waits for `model`'s rollouts in flight to finish: `None` when none is, else the
    /// waiter and its deadline ([`Action::Drained`]).
    pub(crate) fn await_drained(
        &mut self,
        model: &ModelId,
        now: Instant,
    ) -> Option<(WaiterId, Instant)> {
        if self.counters(model).in_flight == 0 {
            return None;
        }
        let id = self.next_id();
        let deadline = now + self.config().timeouts.rollout_wait();
        self.drains.push((id, model.clone(), deadline));
        Some((id, deadline))
    }

    /// Waits for `model` to serve at least `version` everywhere ([`Action::Synced`], queued
    /// at once when it already does); answers the waiter and its deadline.
    pub(crate) fn await_synced(
        &mut self,
        model: &ModelId,
        version: Version,
        now: Instant,
    ) -> (WaiterId, Instant) {
        let id = self.next_id();
        let deadline = now + self.config().timeouts.load() * 2;
        self.synced.push((id, model.clone(), version, deadline));
        self.wake_synced();
        (id, deadline)
    }

    fn wake_synced(&mut self) {
        let policy = &self.policy;
        let landed =
            |m: &ModelId, v: Version| policy.model(m).map_or(true, |s| s.rollout_version >= v);
        for (id, m, _, _) in self.synced.extract_if(.., |(_, m, v, _)| landed(m, *v)) {
            let r = policy
                .model(&m)
                .map(|s| s.rollout_version)
                .map_err(Into::into);
            self.actions.push_back(Action::Synced(id, r));
        }
    }

    /// The trajectory pool has a batch ready for `model`.
    pub(crate) fn batch_ready(&mut self, model: &ModelId, now: Instant) {
        self.event(Some(model), SyncEventKind::BatchReady, now);
        if let Err(e) = self.policy.batch_ready(model) {
            self.policy_error(model, format!("batch ready: {e}"), now);
        }
    }

    /// Orders a load: on the timeline, and to the actor.
    fn start_load(&mut self, order: SyncOrder, now: Instant) {
        self.event(
            Some(&order.model),
            SyncEventKind::LoadStarted(order.version),
            now,
        );
        self.actions.push_back(Action::Load(order));
    }

    /// A load ordered through [`Action::Load`] (or taken by the leader) finished: the
    /// served version moves on, or (failed) the previous one stays served; damage reports
    /// go on the timeline. Starts a queued load, lets through what the policy now allows.
    pub(crate) fn load_finished(
        &mut self,
        order: &SyncOrder,
        result: Result<Landed>,
        now: Instant,
    ) {
        let next = match result {
            Ok(landed) => {
                for d in landed.damaged {
                    tracing::error!(model = %order.model, version = %order.version, "{d}");
                    self.event(Some(&order.model), SyncEventKind::Damaged(d.clone()), now);
                    let c = self.counters(&order.model);
                    c.damaged += 1;
                    c.last_error = Some(d);
                }
                self.event(
                    Some(&order.model),
                    SyncEventKind::Landed(landed.served),
                    now,
                );
                self.counters(&order.model).loads += 1;
                for (engine, why) in landed.fenced {
                    self.fence(&order.model, engine, why, now);
                }
                let done = self
                    .policy
                    .sync_done(&order.model, order.version, landed.served);
                for engine in landed.committed {
                    self.unfence(&order.model, engine, now);
                }
                done
            }
            Err(e) => {
                let msg = e.to_string();
                tracing::error!(model = %order.model, version = %order.version, "load failed: {msg}");
                self.event(
                    Some(&order.model),
                    SyncEventKind::LoadFailed(order.version, msg.clone()),
                    now,
                );
                let c = self.counters(&order.model);
                c.failed_loads += 1;
                c.last_error = Some(msg);
                self.policy.sync_failed(&order.model, order.version)
            }
        };
        match next {
            Ok(Some(next)) => self.start_load(next, now),
            // no load follows to stage on the fenced engines: repair them now
            Ok(None) => self.order_repair(&order.model),
            Err(e) => self.policy_error(&order.model, e.to_string(), now),
        }
        self.wake(now);
        self.wake_synced();
    }

    fn order_repair(&mut self, model: &ModelId) {
        let engines: Vec<EngineId> = self.fenced(model).into_iter().collect();
        let Ok(s) = self.policy.model(model) else {
            return;
        };
        if !engines.is_empty() && s.rollout_version > Version::ZERO {
            self.actions.push_back(Action::Repair {
                model: model.clone(),
                version: s.rollout_version,
                engines,
            });
        }
    }

    /// A policy error with no caller to answer: logged, put on the timeline and kept as the
    /// model's `last_error`, so a run's report shows it (not only the log).
    fn policy_error(&mut self, model: &ModelId, msg: String, now: Instant) {
        tracing::error!(model = %model, "sync policy: {msg}");
        self.event(Some(model), SyncEventKind::PolicyError(msg.clone()), now);
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

    /// `model`'s trainer finished `version`: a non-eval step's load starts now (an eval
    /// step's waits for the leader), and the notification arrives at the version barrier.
    /// Answers the waiter ([`Action::Notified`], maybe queued already) and, while the round
    /// waits for other models, its deadline.
    ///
    /// # Errors
    /// A stale version or an unknown model; a broken round (every waiter of the round is
    /// failed with it).
    pub(crate) fn notify(
        &mut self,
        model: &ModelId,
        version: Version,
        now: Instant,
    ) -> Result<(WaiterId, Option<Instant>)> {
        // Phase 1: the trainer finished; non-eval steps load now, eval steps defer.
        let order = self.policy.trainer_finished(model, version)?;
        self.event(Some(model), SyncEventKind::TrainerFinished(version), now);
        if let Some(order) = order {
            self.start_load(order, now);
        }
        self.wake(now);
        // Phase 2: the version barrier.
        let id = self.next_id();
        self.event(Some(model), SyncEventKind::Arrived(version), now);
        match self.barrier.arrive(model, version, id) {
            Ok(Some(round)) => {
                self.release(round, now);
                Ok((id, None))
            }
            Ok(None) => {
                let deadline = now + self.config().timeouts.barrier();
                self.arrivals.push((model.clone(), version, deadline));
                Ok((id, Some(deadline)))
            }
            Err(e) => {
                // A broken round: fail every waiter, naming what was wrong.
                let msg = e.to_string();
                for (_, _, w) in self.barrier.abort() {
                    self.actions
                        .push_back(Action::Notified(w, Err(Error::Actor(msg.clone()))));
                }
                Err(e.into())
            }
        }
    }

    fn release(&mut self, round: Round<WaiterId>, now: Instant) {
        let eval = self.config().is_eval_step(round.version);
        self.event(
            Some(&round.leader),
            SyncEventKind::Leader {
                version: round.version,
                eval,
            },
            now,
        );
        let lead = Lead {
            leader: round.leader,
            waiters: round.waiters,
        };
        if eval {
            self.leads.insert(round.version, lead);
            self.actions.push_back(Action::LeadEval(round.version));
        } else {
            self.finish_round(round.version, lead, Ok(None), now);
        }
    }

    /// One step of the leader's eval-step sequence begins.
    pub(crate) fn step(&mut self, step: &LeaderStep, now: Instant) {
        self.event(None, SyncEventKind::Step(step.clone()), now);
        match step {
            LeaderStep::PauseAcquisition => self.policy.pause_acquisition(),
            LeaderStep::ResumeAcquisition if self.evaluator => {
                self.policy.end_validate();
                self.wake(now);
            }
            _ => {}
        }
    }

    /// The leader takes `model`'s deferred eval-step load (to load it itself, then call
    /// [`SyncCore::load_finished`]).
    ///
    /// # Errors
    /// An unknown model.
    pub(crate) fn take_deferred(
        &mut self,
        model: &ModelId,
        now: Instant,
    ) -> Result<Option<SyncOrder>> {
        let order = self.policy.take_deferred(model)?;
        if let Some(o) = &order {
            self.event(Some(&o.model), SyncEventKind::LoadStarted(o.version), now);
        }
        Ok(order)
    }

    /// The leader's sequence of the round at `version` ended: every waiter of the round is
    /// answered.
    pub(crate) fn round_finished(
        &mut self,
        version: Version,
        result: Result<Option<EvalReport>>,
        now: Instant,
    ) {
        if let Some(lead) = self.leads.remove(&version) {
            self.finish_round(version, lead, result, now);
        }
    }

    fn finish_round(
        &mut self,
        version: Version,
        lead: Lead,
        result: Result<Option<EvalReport>>,
        now: Instant,
    ) {
        self.event(None, SyncEventKind::Released(version), now);
        match result {
            Ok(report) => {
                if report.is_some() {
                    self.evals += 1;
                    self.event(None, SyncEventKind::Evaluated(version), now);
                }
                for (m, w) in lead.waiters {
                    let outcome = NotifyOutcome {
                        version,
                        leader: m == lead.leader,
                        eval: report.clone(),
                    };
                    self.actions.push_back(Action::Notified(w, Ok(outcome)));
                }
            }
            Err(e) => {
                // Never leave acquisition paused behind a failed eval step.
                if self.evaluator {
                    self.policy.end_validate();
                    self.wake(now);
                }
                let msg = e.to_string();
                for (_, w) in lead.waiters {
                    self.actions
                        .push_back(Action::Notified(w, Err(Error::Actor(msg.clone()))));
                }
            }
        }
    }

    /// Validation ended: acquisition resumes.
    pub(crate) fn end_validate(&mut self, now: Instant) {
        self.event(
            None,
            SyncEventKind::Step(LeaderStep::ResumeAcquisition),
            now,
        );
        self.policy.end_validate();
        self.wake(now);
    }

    /// Fails every waiter whose deadline is at or before `now` with a timeout naming what
    /// it waited for.
    pub(crate) fn expire(&mut self, now: Instant) {
        let rollout_wait = self.config().timeouts.rollout_wait();
        let load_wait = self.config().timeouts.load() * 2;
        let barrier_wait = self.config().timeouts.barrier();
        let timeout = |what: String, after: Duration| {
            Error::Runtime(refit_runtime::Error::Timeout { what, after })
        };
        for b in self
            .blocked
            .extract_if(.., |b| b.deadline <= now)
            .collect::<Vec<_>>()
        {
            let last = self.last_error_note(&b.model);
            let what = format!(
                "a rollout of model `{}` to be let through (blocked: {:?}){last}",
                b.model, b.reason
            );
            self.actions.push_back(Action::Admitted {
                id: b.id,
                model: b.model,
                result: Err(timeout(what, rollout_wait)),
            });
        }
        for (id, m, _) in self.drains.extract_if(.., |w| w.2 <= now) {
            let what = format!("the rollouts of model `{m}` in flight to finish");
            self.actions
                .push_back(Action::Drained(id, Err(timeout(what, rollout_wait))));
        }
        for (id, m, v, _) in self
            .synced
            .extract_if(.., |w| w.3 <= now)
            .collect::<Vec<_>>()
        {
            let last = self.last_error_note(&m);
            let what = format!("model `{m}` v{v} to land on every engine{last}");
            self.actions
                .push_back(Action::Synced(id, Err(timeout(what, load_wait))));
        }
        for (waiting, version, _) in self
            .arrivals
            .extract_if(.., |a| a.2 <= now)
            .collect::<Vec<_>>()
        {
            if let Some((v, id)) = self.barrier.withdraw(&waiting, version) {
                let (missing, _) = self.barrier.waiting_for();
                let names: Vec<String> = missing.iter().map(ToString::to_string).collect();
                let what = format!(
                    "the version barrier at v{v} (model `{waiting}` arrived; still missing: {})",
                    names.join(", ")
                );
                self.actions
                    .push_back(Action::Notified(id, Err(timeout(what, barrier_wait))));
            }
        }
    }

    /// Every model's versions, state and counters, without the timeline.
    pub(crate) fn counts(&self) -> ControllerStatus {
        let models = self
            .policy
            .models()
            .filter_map(|m| {
                let s = self.policy.model(m).ok()?.clone();
                let c = self.counters.get(m).cloned().unwrap_or_default();
                Some((
                    m.clone(),
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
                        fences: c.fences,
                        fenced_for: c.fenced_for,
                        fenced: self
                            .fences
                            .get(m)
                            .map(|f| f.keys().copied().collect())
                            .unwrap_or_default(),
                        last_error: c.last_error,
                    },
                ))
            })
            .collect();
        ControllerStatus {
            models,
            acquisition_paused: self.policy.acquisition_paused(),
            evals: self.evals,
            events: Vec::new(),
        }
    }

    /// Every model's versions, state and counters, and the timeline.
    pub(crate) fn status(&self) -> ControllerStatus {
        ControllerStatus {
            events: self.events.iter().cloned().collect(),
            ..self.counts()
        }
    }
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
