//! The run's lead, on rank 0 beside the controller: the common stop decision of the model
//! drivers, their reports, what happens when an engine rank dies or comes back, the
//! statistics of every rank (kept for ranks that died), and the run's report.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_node::Node;
use refit_runtime::sync_policy::StalenessStats;
use refit_runtime::topology::{OnFailure, Role, Topology};
use refit_runtime::{ModelId, Version};
use tokio::sync::oneshot;

use crate::actor::controller::WeightSyncController;
use crate::error::{Error, Result};
use crate::protocol::controller::{AddEngine, DropEngine, GetStatus};
use crate::protocol::engine::{
    EngineHandle, EngineRef, EngineStats, Family, GetEngineStats, ServedVersions,
};
use crate::protocol::lead::{ModelDone, Progress, Rejoin};
use crate::protocol::rollout::{GetRolloutStats, RolloutRef, RolloutStats, StopRollouts};
use crate::remote::RemoteAddr;

use super::gate::{EngineRoute, RankBack, RankGate, RankLost};
use super::ids::{Served, actor_id};
use super::rendezvous::{RankDeath, WatchGuard, watch};
use super::{ModelReport, RankEvent, RankEventKind, RankReport, RunReport};

/// The common stop decision of a run's model drivers.
///
/// Every model must stop at the same version, so that the last barrier round completes. A
/// driver posts each version right after publishing it, and goes on training the next one
/// when the answer is "no stop yet": so once a model posted `v` and was told to go on, it
/// may publish `v + 1` before its next post (before its first post, version 2). The stop
/// version is the highest version any model may reach: no model ever has to go back, and
/// a model that is not there yet trains up to it.
#[derive(Debug)]
pub(crate) struct StopBoard {
    /// Per model: the highest version it may have published.
    may_reach: BTreeMap<ModelId, Version>,
    solved: BTreeMap<ModelId, bool>,
    stop_at: Option<Version>,
    /// True when the stop came from every model reaching its target.
    all_solved: bool,
}

impl StopBoard {
    /// A board for `models`, none posted yet.
    pub(crate) fn new(models: &[ModelId]) -> Self {
        Self {
            may_reach: models.iter().map(|m| (m.clone(), Version(2))).collect(),
            solved: BTreeMap::new(),
            stop_at: None,
            all_solved: false,
        }
    }

    /// Records `model` at `version`; decides the common last version once a rule fires:
    /// every model solved, or one out of budget.
    pub(crate) fn post(
        &mut self,
        model: &ModelId,
        version: Version,
        solved: bool,
        out_of_budget: bool,
    ) -> Option<Version> {
        self.solved.insert(model.clone(), solved);
        let all_solved =
            self.solved.len() == self.may_reach.len() && self.solved.values().all(|s| *s);
        if self.stop_at.is_none() && (out_of_budget || all_solved) {
            // this model stops here; the others may have gone one past their last post
            self.may_reach.insert(model.clone(), version);
            let max = self.may_reach.values().copied().max().unwrap_or(version);
            self.stop_at = Some(max);
            self.all_solved = all_solved;
        } else if self.stop_at.is_none() {
            self.may_reach.insert(model.clone(), Version(version.0 + 1));
        }
        self.stop_at
    }

    /// True when the run stopped because every model reached its target.
    pub(crate) fn solved(&self) -> bool {
        self.all_solved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stop_version_is_the_highest_any_model_may_have_published() {
        let p = ModelId::new("p").unwrap();
        let v = ModelId::new("v").unwrap();
        let mut one = StopBoard::new(std::slice::from_ref(&p));
        assert_eq!(one.post(&p, Version(3), false, false), None);
        assert_eq!(one.post(&p, Version(4), true, false), Some(Version(4)));
        assert!(one.solved());
        // `v` posted 11 and was told to go on: it may already have published 12
        let mut two = StopBoard::new(&[p.clone(), v.clone()]);
        assert_eq!(two.post(&p, Version(10), false, false), None);
        assert_eq!(two.post(&v, Version(11), true, false), None);
        assert_eq!(two.post(&p, Version(11), true, false), Some(Version(12)));
        assert_eq!(two.post(&v, Version(12), false, false), Some(Version(12)));
        assert!(two.solved());
        // both out of budget at the same version: no extra update
        let mut budget = StopBoard::new(&[p.clone(), v.clone()]);
        assert_eq!(budget.post(&p, Version(4), false, false), None);
        assert_eq!(budget.post(&v, Version(5), false, true), Some(Version(5)));
        assert_eq!(budget.post(&p, Version(5), false, true), Some(Version(5)));
        assert!(!budget.solved());
    }
}

/// One engine rank as the lead sees it.
struct Slot {
    incarnation: u32,
    alive: bool,
    /// Its id in the controller's engine set.
    engine_id: usize,
    engine: EngineRef,
    gate: Addr<RankGate>,
    rollouts: Vec<(ModelId, RolloutRef)>,
    /// The statistics last seen (polled every couple of seconds).
    last: RankReport,
    /// Keepalive of a rank that rejoined.
    watch: Option<WatchGuard>,
}

/// An engine rank serves: the controller loads on its engine from now on (after bringing
/// it to the versions the others serve), the evaluator may ask it, its rollouts are counted
/// at its gate. Answers once that is so.
#[derive(Debug, Message)]
#[rtype(result = "Result<()>")]
pub(crate) struct AddRank {
    pub(crate) rank: u32,
    pub(crate) incarnation: u32,
    pub(crate) engine: EngineHandle,
    pub(crate) rollouts: Vec<(ModelId, RolloutRef)>,
    /// Keepalive of a rank that rejoined (the first ones are watched together).
    pub(crate) watch: Option<std::net::SocketAddr>,
}

/// A rank died (the keepalive told).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct RankDown(pub(crate) RankDeath);

/// Every driver is done (or one failed): stop the rollouts and gather the report.
#[derive(Debug, Message)]
#[rtype(result = "Result<RunReport>")]
pub(crate) struct Finish;

/// Which ranks died and did not come back (asked at the end of a run that failed, so
/// rank 0 does not wait for their goodbyes).
#[derive(Debug, Message)]
#[rtype(result = "std::collections::BTreeSet<u32>")]
pub(crate) struct GoneRanks;

impl Handler<GoneRanks> for Lead {
    type Result = MessageResult<GoneRanks>;
    fn handle(&mut self, _: GoneRanks, _: &mut Context<Self>) -> Self::Result {
        MessageResult(super::report::gone_ranks(&self.events))
    }
}

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct Poll;

/// A polled rank's statistics.
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct Polled {
    rank: u32,
    incarnation: u32,
    engine: Option<EngineStats>,
    workers: Vec<(ModelId, RolloutStats)>,
}

/// A live engine rank at the end: rank, incarnation, engine, rollout workers, last stats.
type LiveRank = (u32, u32, EngineRef, Vec<(ModelId, RolloutRef)>, RankReport);

/// What the lead is made with.
pub(crate) struct LeadSetup {
    pub(crate) topo: Arc<Topology>,
    pub(crate) node: Node,
    pub(crate) call: Duration,
    pub(crate) controller: Addr<WeightSyncController>,
    pub(crate) route: Option<Addr<EngineRoute>>,
    /// Every engine rank's gate (its way to the controller), served by this rank.
    pub(crate) gates: BTreeMap<u32, Addr<RankGate>>,
    /// Answered once every driver is done, or the run must end.
    pub(crate) done: oneshot::Sender<Result<()>>,
    pub(crate) started: Instant,
    /// Which requests the run's engines serve (how a rejoining rank's engine is reached).
    pub(crate) family: Family,
}

/// The run's lead.
pub(crate) struct Lead {
    topo: Arc<Topology>,
    node: Node,
    call: Duration,
    controller: Addr<WeightSyncController>,
    route: Option<Addr<EngineRoute>>,
    gates: BTreeMap<u32, Addr<RankGate>>,
    family: Family,
    slots: BTreeMap<u32, Slot>,
    retired: Vec<RankReport>,
    board: StopBoard,
    models: Vec<ModelId>,
    reports: BTreeMap<ModelId, ModelReport>,
    done: Option<oneshot::Sender<Result<()>>>,
    events: Vec<RankEvent>,
    started: Instant,
    /// Tokens generated by every engine at the last progress line, and when.
    tokens_seen: Option<(u64, Instant)>,
    /// Answered once the last update line is printed: each line waits for the one before
    /// (they are written once the engines said what they serve), and the report for the
    /// last.
    last_line: Option<oneshot::Receiver<()>>,
    /// Where each model stands (its last update line's summary), printed if a signal ends
    /// the run (Ctrl-C on the launcher, SIGTERM from a scheduler).
    so_far: Arc<std::sync::Mutex<BTreeMap<ModelId, String>>>,
    /// Keeps the print of `so_far` registered while the lead lives.
    _on_signal: refit_runtime::cleanup::ExitGuard,
}

impl std::fmt::Debug for Lead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lead")
            .field("engines", &self.slots.keys().collect::<Vec<_>>())
            .field("reports", &self.reports.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Lead {
    pub(crate) fn new(setup: LeadSetup) -> Self {
        let models = setup.topo.model_ids();
        let so_far = Arc::new(std::sync::Mutex::new(BTreeMap::new()));
        let on_signal = {
            let (so_far, started) = (Arc::clone(&so_far), setup.started);
            refit_runtime::cleanup::on_exit_signal(move || {
                let so_far = so_far
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                println!(
                    "interrupted after {}: {}",
                    refit_runtime::units::duration(started.elapsed()),
                    if so_far.is_empty() {
                        "no update yet".to_string()
                    } else {
                        so_far.values().cloned().collect::<Vec<_>>().join("; ")
                    }
                );
            })
        };
        Self {
            so_far,
            _on_signal: on_signal,
            board: StopBoard::new(&models),
            models,
            family: setup.family,
            topo: setup.topo,
            node: setup.node,
            call: setup.call,
            controller: setup.controller,
            route: setup.route,
            gates: setup.gates,
            slots: BTreeMap::new(),
            retired: Vec::new(),
            reports: BTreeMap::new(),
            done: Some(setup.done),
            events: Vec::new(),
            started: setup.started,
            tokens_seen: None,
            last_line: None,
        }
    }

    fn event(&mut self, rank: u32, incarnation: u32, kind: RankEventKind) {
        self.events.push(RankEvent {
            at: self.started.elapsed(),
            rank,
            incarnation,
            kind,
        });
    }

    /// Ends the run with `result` (the first call wins).
    fn end(&mut self, result: Result<()>) {
        if let Some(tx) = self.done.take() {
            let _ = tx.send(result);
        }
    }

    fn who(&self, rank: u32) -> String {
        self.topo
            .rank(rank)
            .map_or_else(|_| format!("rank {rank}"), |p| super::describe(&p))
    }

    /// True when the rank's process may come back (the launcher restarts it), or the run
    /// goes on without it (`on_failure = "continue"`).
    fn survivable(&self, rank: u32) -> bool {
        let Ok(plan) = self.topo.rank(rank) else {
            return false;
        };
        let only_engine =
            !plan.has(Role::Trainer) && !plan.has(Role::Controller) && !plan.has(Role::Evaluator);
        only_engine && (self.topo.run.on_failure == OnFailure::Continue || plan.restarts())
    }
}

impl Actor for Lead {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(Duration::from_secs(2), |_, ctx| ctx.notify(Poll));
    }
}

impl Lead {
    /// One line per update, in the words of the model's role: completions, reward and
    /// tokens per second for a generating model; frames and return for an acting one; the
    /// versions the batch was sampled under and its staleness, the update's time, the
    /// held-out score when validation ran, and the version each engine serves of the model
    /// (asked of it now) with its pause per load.
    fn progress_line(&mut self, p: &Progress, ctx: &mut Context<Self>) {
        let tokens: u64 = self
            .slots
            .values()
            .filter(|s| s.alive)
            .map(|s| s.last.engine.tokens)
            .sum();
        let now = Instant::now();
        let rate = match self.tokens_seen {
            Some((before, at)) if now > at && tokens >= before => {
                Some((tokens - before) as f64 / now.duration_since(at).as_secs_f64())
            }
            _ => None,
        };
        self.tokens_seen = Some((tokens, now));
        let serving = self.topo.engine_ranks_of(&p.model);
        let wait = self.call.min(Duration::from_secs(1));
        // every engine rank of the model asked at once, each within `wait`
        let asked: Vec<_> = self
            .slots
            .iter()
            .filter(|(r, s)| s.alive && serving.contains(r))
            .map(|(r, s)| {
                let e = &s.last.engine;
                let pause = (e.loads > 0).then(|| e.paused_total / e.loads.max(1) as u32);
                let query = s.engine.versions.send(ServedVersions).timeout(wait);
                (*r, pause, actix_rt::spawn(query))
            })
            .collect();
        let (progress, before) = (p.clone(), self.last_line.take());
        let (printed, next) = oneshot::channel();
        self.last_line = Some(next);
        ctx.spawn(
            async move {
                let mut engines = Vec::new();
                for (rank, pause, query) in asked {
                    let served = match query.await {
                        Ok(Ok(v)) => v.get(&progress.model).copied(),
                        _ => None,
                    };
                    engines.push(EngineLine {
                        rank,
                        served,
                        pause,
                    });
                }
                if let Some(before) = before {
                    let _ = before.await;
                }
                tracing::info!("{}", update_line(&progress, rate, &engines));
                let _ = printed.send(());
            }
            .into_actor(self),
        );
        let what = if p.update.generated {
            format!("mean reward {:.3} (last batch)", p.mean_return)
        } else {
            format!("mean return {:.1} (last 20 episodes)", p.mean_return)
        };
        self.so_far
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(
                p.model.clone(),
                format!("{} at v{}, {what}", p.model, p.version),
            );
    }
}

/// One engine rank in an update's line: the version it serves of the model (`None`: it did
/// not answer in time) and its mean pause per load (`None`: no load yet).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EngineLine {
    pub(crate) rank: u32,
    pub(crate) served: Option<Version>,
    pub(crate) pause: Option<Duration>,
}

impl std::fmt::Display for EngineLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.served {
            Some(v) => write!(f, "rank {} v{v}", self.rank)?,
            None => write!(f, "rank {} v? (no answer)", self.rank)?,
        }
        if let Some(pause) = self.pause {
            write!(
                f,
                " (pause {} per load)",
                refit_runtime::units::duration(pause)
            )?;
        }
        Ok(())
    }
}

/// The log line of one update (see [`Lead::progress_line`]): `rate` is the engines' tokens
/// per second since the last line (`None` before the second), `engines` what each engine
/// rank serves of the model and its pause per load.
pub(crate) fn update_line(p: &Progress, rate: Option<f64>, engines: &[EngineLine]) -> String {
    let u = &p.update;
    let (from, to) = p.sample_versions;
    let sampled = if from == to {
        format!("v{from}")
    } else {
        format!("v{from}..v{to}")
    };
    let mut line = if u.generated {
        let rate = rate.map_or_else(String::new, |r| format!(", {r:.0} tokens/s"));
        format!(
            "{} v{}: {} completions, mean reward {:.3}{rate}",
            p.model, p.version, u.samples, p.mean_return
        )
    } else {
        format!(
            "{} v{}: {} frames, mean return {:.1} (last 20 episodes)",
            p.model, p.version, u.samples, p.mean_return
        )
    };
    line.push_str(&format!(
        "; sampled under {sampled}, staleness up to {}",
        u.max_staleness
    ));
    if u.dropped > 0 {
        line.push_str(", ");
        line.push_str(&StalenessStats::dropped_words(
            u.dropped,
            u.allowed_staleness,
        ));
    }
    line.push_str(&format!("; trained in {} ms", u.train_ms));
    if let Some(ms) = u.publish_ms {
        line.push_str(&format!(", published in {ms:.1} ms"));
    }
    if let Some(score) = u.held_out {
        let what = if u.generated { "reward" } else { "return" };
        line.push_str(&format!("; held-out {what} (greedy) {score:.3}"));
    }
    if !engines.is_empty() {
        let each: Vec<String> = engines.iter().map(ToString::to_string).collect();
        line.push_str(&format!("; engines serve {}", each.join(", ")));
    }
    line
}

#[cfg(test)]
mod line_tests {
    use super::*;
    use crate::protocol::lead::UpdateLine;

    fn progress(generated: bool, dropped: u64, held_out: Option<f64>) -> Progress {
        Progress {
            model: ModelId::new("policy").unwrap(),
            version: Version(7),
            solved: false,
            out_of_budget: false,
            mean_return: 0.25,
            sample_versions: (Version(5), Version(6)),
            update: UpdateLine {
                generated,
                samples: 128,
                max_staleness: 2,
                dropped,
                allowed_staleness: Some(2),
                train_ms: 70,
                publish_ms: Some(0.2),
                held_out,
            },
        }
    }

    #[test]
    fn an_update_is_one_line_in_the_words_of_its_role() {
        let engines = [
            EngineLine {
                rank: 1,
                served: Some(Version(7)),
                pause: Some(Duration::from_micros(300)),
            },
            EngineLine {
                rank: 2,
                served: Some(Version(6)),
                pause: None,
            },
            EngineLine {
                rank: 3,
                served: None,
                pause: None,
            },
        ];
        assert_eq!(
            update_line(&progress(true, 0, Some(0.9)), Some(41_000.0), &engines),
            "policy v7: 128 completions, mean reward 0.250, 41000 tokens/s; sampled under \
             v5..v6, staleness up to 2; trained in 70 ms, published in 0.2 ms; held-out reward \
             (greedy) 0.900; engines serve rank 1 v7 (pause 300.0 us per load), rank 2 v6, \
             rank 3 v? (no answer)"
        );
        assert_eq!(
            update_line(&progress(false, 3, None), None, &[]),
            "policy v7: 128 frames, mean return 0.2 (last 20 episodes); sampled under v5..v6, \
             staleness up to 2, 3 dropped as staler than 2 versions (sync.max_staleness, by \
             default the mode's: 0 in sync, staleness_threshold in batch-async); trained in 70 \
             ms, published in 0.2 ms"
        );
    }
}

impl Handler<Progress> for Lead {
    type Result = MessageResult<Progress>;
    fn handle(&mut self, p: Progress, ctx: &mut Context<Self>) -> Self::Result {
        self.progress_line(&p, ctx);
        ctx.notify(Poll);
        MessageResult(
            self.board
                .post(&p.model, p.version, p.solved, p.out_of_budget),
        )
    }
}

impl Handler<ModelDone> for Lead {
    type Result = ();
    fn handle(&mut self, msg: ModelDone, _: &mut Context<Self>) {
        match msg.report {
            Ok(r) => {
                self.reports.insert(msg.model, r);
                if self.reports.len() == self.models.len() {
                    self.end(Ok(()));
                }
            }
            Err(e) => {
                self.end(Err(Error::Actor(format!(
                    "trainer of model `{}`: {e}",
                    msg.model
                ))));
            }
        }
    }
}

impl Handler<RankDown> for Lead {
    type Result = ();
    fn handle(&mut self, RankDown(death): RankDown, _: &mut Context<Self>) {
        self.rank_down(death);
    }
}

impl Lead {
    /// A rank died: drop its engine and give up its rollouts, keep its last statistics,
    /// and end the run unless it can go on without it (or the rank comes back).
    fn rank_down(&mut self, death: RankDeath) {
        let rank = death.rank;
        let who = self.who(rank);
        let Some(slot) = self.slots.get_mut(&rank) else {
            // a trainer, evaluator or rollout-less rank: the run cannot go on without it
            refit_runtime::unless_stopping!(warn, "rank 0: {who} is gone: {}", death.reason);
            self.event(
                rank,
                death.incarnation,
                RankEventKind::Died(death.reason.clone()),
            );
            self.end(Err(Error::Actor(format!(
                "{who} is gone ({}); the run cannot go on without it",
                death.reason
            ))));
            return;
        };
        if !slot.alive || slot.incarnation != death.incarnation {
            // already dropped, or the verdict is about an incarnation that was replaced
            return;
        }
        refit_runtime::unless_stopping!(warn, "rank 0: {who} is gone: {}", death.reason);
        slot.alive = false;
        slot.watch = None;
        let incarnation = slot.incarnation;
        let mut retired = slot.last.clone();
        retired.fate = Some(death.reason.clone());
        self.controller.do_send(DropEngine {
            index: slot.engine_id,
        });
        slot.gate.do_send(RankLost { rank });
        if let Some(route) = &self.route {
            route.do_send(RankLost { rank });
        }
        self.retired.push(retired);
        self.event(rank, incarnation, RankEventKind::Died(death.reason.clone()));
        let alive = self.slots.values().filter(|s| s.alive).count();
        if !self.survivable(rank) {
            self.end(Err(Error::Actor(format!(
                "{who} is gone ({}); on_failure = \"abort\" ends the run (set on_failure = \
                 \"continue\", or restart = \"on-failure\" on its process, to go on)",
                death.reason
            ))));
        } else if alive == 0 && !self.topo.rank(rank).is_ok_and(|p| p.restarts()) {
            self.end(Err(Error::Actor(format!(
                "{who} is gone ({}) and no engine is left",
                death.reason
            ))));
        } else {
            refit_runtime::unless_stopping!(warn, "rank 0: the run goes on with {alive} engines");
        }
    }
}

impl Handler<AddRank> for Lead {
    type Result = ResponseActFuture<Self, Result<()>>;
    fn handle(&mut self, msg: AddRank, _: &mut Context<Self>) -> Self::Result {
        if let Some(slot) = self.slots.get(&msg.rank)
            && slot.alive
        {
            if slot.incarnation >= msg.incarnation {
                let e = Error::Config(format!(
                    "{} joins as incarnation {}, but incarnation {} is alive",
                    self.who(msg.rank),
                    msg.incarnation,
                    slot.incarnation
                ));
                return Box::pin(fut::ready(Err(e)));
            }
            // a newer start of the rank proves the old one gone, whether or not the
            // keepalive has told yet (a launcher restarts a killed rank within ~100 ms)
            let old = slot.incarnation;
            self.rank_down(RankDeath {
                rank: msg.rank,
                incarnation: old,
                reason: format!("incarnation {} took its place", msg.incarnation),
            });
        }
        // an engine keeps its id in the controller's set across incarnations
        let engine_id = msg.rank as usize;
        let add = self.controller.send(AddEngine {
            index: engine_id,
            engine: msg.engine.weights.clone(),
        });
        let call = self.call;
        Box::pin(
            async move {
                add.timeout(call)
                    .await
                    .map_err(|e| Error::Actor(format!("controller: {e}")))?
            }
            .into_actor(self)
            .map(move |r, act, ctx| {
                r?;
                let AddRank {
                    rank,
                    incarnation,
                    engine,
                    rollouts,
                    watch: addr,
                } = msg;
                let gate = match act.gates.get(&rank) {
                    Some(g) if incarnation == 0 => g.clone(),
                    _ => {
                        // a fresh gate: the old one gave up its rank's rollouts
                        let g = RankGate::new(
                            rank,
                            act.controller.clone().recipient(),
                            act.controller.clone().recipient(),
                        )
                        .start();
                        crate::protocol::ControllerLink {
                            await_rollout: g.clone().recipient(),
                            done: g.clone().recipient(),
                        }
                        .serve(&act.node, actor_id(Served::Gate, rank, 0, 0));
                        act.gates.insert(rank, g.clone());
                        g
                    }
                };
                if let Some(route) = &act.route {
                    route.do_send(RankBack {
                        rank,
                        engine: engine.clone(),
                    });
                }
                let me = ctx.address();
                let guard = addr.map(|a| {
                    watch(
                        &act.node,
                        vec![(rank, incarnation, a)],
                        act.topo.keepalive(),
                        act.topo.dead_after(),
                        move |d| me.do_send(RankDown(d)),
                    )
                });
                act.slots.insert(
                    rank,
                    Slot {
                        incarnation,
                        alive: true,
                        engine_id,
                        engine: engine.weights,
                        gate,
                        rollouts,
                        last: RankReport::empty(rank, incarnation),
                        watch: guard,
                    },
                );
                if incarnation > 0 {
                    act.event(rank, incarnation, RankEventKind::Rejoined);
                    tracing::info!(
                        "rank 0: {} rejoined (incarnation {incarnation})",
                        act.who(rank)
                    );
                }
                Ok(())
            }),
        )
    }
}

impl Handler<Rejoin> for Lead {
    type Result = ResponseActFuture<Self, Result<()>>;
    fn handle(&mut self, msg: Rejoin, ctx: &mut Context<Self>) -> Self::Result {
        let serves_engine = self.topo.rank(msg.rank).is_ok_and(|p| {
            p.has(Role::Engine) && !p.has(Role::Trainer) && !p.has(Role::Controller)
        });
        if !serves_engine {
            let e = Error::Config(format!(
                "{} cannot rejoin: only ranks that hold an engine (and rollouts), no trainer, can",
                self.who(msg.rank)
            ));
            return Box::pin(fut::ready(Err(e)));
        }
        if let Err(e) = super::ids::check_contract(msg.rank, msg.contract) {
            return Box::pin(fut::ready(Err(e)));
        }
        let node = self.node.clone();
        let call = self.call;
        let topo = Arc::clone(&self.topo);
        let me = ctx.address();
        let who = self.who(msg.rank);
        let family = self.family;
        let join = async move {
            let Rejoin {
                rank,
                incarnation,
                node: addr,
                ..
            } = msg;
            let remote = RemoteAddr::connect(
                &node,
                addr,
                actor_id(Served::Engine, rank, 0, 0),
                format!("engine of {who}"),
                call,
            )
            .await?;
            let engine = EngineHandle::remote(&remote, family);
            let rollouts = super::peers::rollout_refs(&topo, rank, &remote);
            me.send(AddRank {
                rank,
                incarnation,
                engine,
                rollouts,
                watch: Some(addr),
            })
            .timeout(call * 2)
            .await
            .map_err(|e| Error::Actor(format!("the run's lead: {e}")))?
        };
        Box::pin(join.into_actor(self))
    }
}

impl Handler<Poll> for Lead {
    type Result = ();
    fn handle(&mut self, _: Poll, ctx: &mut Context<Self>) {
        let call = self.call.min(Duration::from_secs(5));
        for (rank, slot) in &self.slots {
            if !slot.alive {
                continue;
            }
            let (rank, incarnation) = (*rank, slot.incarnation);
            let engine = slot.engine.stats.clone();
            let rollouts = slot.rollouts.clone();
            let me = ctx.address();
            ctx.spawn(
                async move {
                    let engine = engine.send(GetEngineStats).timeout(call).await.ok();
                    let mut workers = Vec::new();
                    for (m, r) in rollouts {
                        if let Ok(s) = r.stats.send(GetRolloutStats).timeout(call).await {
                            workers.push((m, s));
                        }
                    }
                    me.do_send(Polled {
                        rank,
                        incarnation,
                        engine,
                        workers,
                    });
                }
                .into_actor(self),
            );
        }
    }
}

impl Handler<Polled> for Lead {
    type Result = ();
    fn handle(&mut self, p: Polled, _: &mut Context<Self>) {
        let Some(slot) = self.slots.get_mut(&p.rank) else {
            return;
        };
        if slot.incarnation != p.incarnation || !slot.alive {
            return;
        }
        if let Some(e) = p.engine {
            slot.last.engine = e;
        }
        if !p.workers.is_empty() {
            slot.last.workers = group(p.workers);
        }
    }
}

fn group(workers: Vec<(ModelId, RolloutStats)>) -> BTreeMap<ModelId, Vec<RolloutStats>> {
    let mut out: BTreeMap<ModelId, Vec<RolloutStats>> = BTreeMap::new();
    for (m, s) in workers {
        out.entry(m).or_default().push(s);
    }
    out
}

impl Handler<Finish> for Lead {
    type Result = ResponseActFuture<Self, Result<RunReport>>;
    fn handle(&mut self, _: Finish, _: &mut Context<Self>) -> Self::Result {
        let call = self.call;
        let live: Vec<LiveRank> = self
            .slots
            .iter()
            .filter(|(_, s)| s.alive)
            .map(|(r, s)| {
                (
                    *r,
                    s.incarnation,
                    s.engine.clone(),
                    s.rollouts.clone(),
                    s.last.clone(),
                )
            })
            .collect();
        let controller = self.controller.clone();
        let last_line = self.last_line.take();
        let gather = async move {
            // the last update's line comes before the report
            if let Some(printed) = last_line {
                let _ = actix_rt::time::timeout(call, printed).await;
            }
            let mut ranks = Vec::new();
            for (rank, incarnation, engine, rollouts, last) in live {
                let mut report = RankReport::empty(rank, incarnation);
                let mut workers = Vec::new();
                for (m, r) in rollouts {
                    match r.stop.send(StopRollouts).timeout(call).await {
                        Ok(s) => workers.push((m, s)),
                        Err(e) => tracing::warn!(rank, "a rollout worker did not stop: {e}"),
                    }
                }
                report.workers = if workers.is_empty() {
                    last.workers.clone()
                } else {
                    group(workers)
                };
                report.engine = match engine.stats.send(GetEngineStats).timeout(call).await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(rank, "no statistics from the engine: {e}");
                        last.engine.clone()
                    }
                };
                ranks.push(report);
            }
            let status = controller
                .send(GetStatus)
                .timeout(call)
                .await
                .map_err(|e| Error::Actor(format!("controller: {e}")))?;
            Ok::<_, Error>((ranks, status))
        };
        Box::pin(gather.into_actor(self).map(|r, act, _| {
            let (mut ranks, controller) = r?;
            ranks.append(&mut act.retired.clone());
            ranks.sort_by_key(|r| (r.rank, r.incarnation));
            let mut models = std::mem::take(&mut act.reports);
            let mut engine = EngineStats::default();
            for r in &ranks {
                engine.loads += r.engine.loads;
                engine.paused_total += r.engine.paused_total;
                engine.paused_max = engine.paused_max.max(r.engine.paused_max);
                engine.staged_total += r.engine.staged_total;
                engine.cancelled += r.engine.cancelled;
                engine.tokens += r.engine.tokens;
                engine.drained_total += r.engine.drained_total;
                engine.aborted += r.engine.aborted;
                for (m, ws) in &r.workers {
                    if let Some(rep) = models.get_mut(m) {
                        rep.workers.extend(ws.iter().cloned());
                    }
                }
            }
            Ok(RunReport {
                models,
                controller,
                engine,
                ranks,
                events: act.events.clone(),
                elapsed: act.started.elapsed(),
                solved: act.board.solved(),
            })
        }))
    }
}
