//! The run itself and its end: rollouts and drivers run ([`run`]) until rank 0's lead
//! says the run is done; rank 0 gathers the report, says stop and waits (bounded) for
//! the others to acknowledge ([`finish_lead`]); the others stop their rollouts and
//! acknowledge ([`finish_member`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;

use crate::actor::notifier::VersionNotifier;
use crate::error::{Error, Result};
use crate::protocol::engine::{EngineHandle, GetEngineStats};
use crate::protocol::lead::ModelDone;
use crate::protocol::rollout::{RolloutRef, StartRollouts, StopRollouts};
use refit_runtime::ModelId;

use super::drive::{Checkpoints, Driver};
use super::ids::{RANK_LOG, STOP_KEY, bye_key};
use super::keepalive::LeadWatch;
use super::lead::{Finish, GoneRanks, Lead};
use super::peers::blocking;
use super::rendezvous::WatchGuard;
use super::start::pool::Driven;
use super::start::{Heads, Leading, RankCtx};
use super::{RankEventKind, RunReport};

/// Starts this rank's rollout workers and a driver per model it trains (each hands its
/// report to the lead when done).
pub(crate) fn run(
    ctx: &RankCtx,
    heads: &Heads,
    rollouts: &[(ModelId, RolloutRef)],
    drivers: Vec<Driven>,
) {
    for (_, r) in rollouts {
        r.start.do_send(StartRollouts);
    }
    if !rollouts.is_empty() {
        tracing::info!(target: RANK_LOG, "{}: {} rollout workers running", ctx.who, rollouts.len());
    }
    let (sync, call) = (&ctx.sync, ctx.call);
    for d in drivers {
        let model = d.spec.id.clone();
        let checkpoints = ctx
            .setup
            .topo
            .checkpoint
            .clone()
            .zip(d.save)
            .map(|(cfg, save)| Checkpoints { cfg, save });
        let driver = Driver {
            model: model.clone(),
            trainer: d.trainer,
            pool: d.pool,
            first: d.first,
            checkpoints,
            controller: heads.controller.clone(),
            notifier: VersionNotifier::new(
                heads.controller.notify.clone(),
                model.clone(),
                sync.clone(),
            ),
            lead: heads.lead.clone(),
            mode: sync.sync_mode,
            allowed_staleness: sync.allowed_staleness(),
            stop: ctx.setup.stop.clone(),
            wait: ctx.wait,
            call,
            started: ctx.started,
        };
        let done = heads.lead.done.clone();
        actix_rt::spawn(async move {
            let report = driver.run().await.map_err(|e| e.to_string());
            if let Err(e) = done.send(ModelDone { model, report }).timeout(call).await {
                tracing::error!(target: RANK_LOG, "a driver could not hand in its report: {e}");
            }
        });
    }
}

/// Rank 0: waits until the lead says the run is done, gathers the report, tells the other
/// ranks to stop and waits (bounded) for the live ones to acknowledge.
///
/// # Errors
/// The first error of a trainer, pool or controller, or a dead rank the run cannot go on
/// without.
pub(crate) async fn finish_lead(
    ctx: &RankCtx,
    l: Leading,
    watching: Option<WatchGuard>,
) -> Result<RunReport> {
    let ended = match l.done.await {
        Ok(r) => r,
        Err(_) => Err(Error::Actor("the run's lead stopped".into())),
    };
    // a run that ended well stops watching the ranks now (they leave once told to stop); a
    // failed one keeps watching while it waits for their goodbyes, so a rank found dead
    // meanwhile (a partition seen from both sides at once) is not waited for
    let watching = if ended.is_ok() {
        drop(watching);
        None
    } else {
        watching
    };
    let report = match ended {
        Ok(()) => l
            .lead
            .send(Finish)
            .timeout(ctx.call)
            .await
            .map_err(|e| Error::Actor(format!("the run's lead: {e}")))?,
        Err(e) => Err(e),
    };
    if let Err(e) = ctx.rv.put(STOP_KEY, &()) {
        tracing::warn!(target: RANK_LOG, "telling the other ranks to stop: {e}");
    }
    // the others read the stop before this node goes away (bounded: a dead or partitioned
    // rank is not waited for at all)
    match &report {
        Ok(r) => await_byes(ctx, alive_ranks(ctx, r), None).await,
        Err(_) => {
            let all = (1..ctx.setup.topo.world_size()).collect();
            await_byes(ctx, all, Some(&l.lead)).await;
        }
    }
    drop(watching);
    report
}

/// The ranks other than 0 still alive at the end of a run that ended well.
fn alive_ranks(ctx: &RankCtx, r: &RunReport) -> Vec<u32> {
    (1..ctx.setup.topo.world_size())
        .filter(|n| {
            !r.events
                .iter()
                .any(|e| e.rank == *n && matches!(e.kind, RankEventKind::Died(_)))
                || r.ranks.iter().any(|x| x.rank == *n && x.fate.is_none())
        })
        .collect()
}

/// How often a failed run's end asks the lead which ranks it found dead.
const GONE_POLL: Duration = Duration::from_millis(50);

/// Waits, for `dead_after_s` (2 s at least) in all, until each of `alive` acknowledged
/// the stop or (`lead` given: a failed run) the lead found it dead.
///
/// The store's wait wakes at each key set, so the byes are awaited rather than polled:
/// a run that ended well waits once, for all of them; a failed run waits at most
/// [`GONE_POLL`] at a time, between which it asks the lead (a dead rank says no bye).
async fn await_byes(ctx: &RankCtx, mut alive: Vec<u32>, lead: Option<&Addr<Lead>>) {
    let grace = ctx.setup.topo.dead_after().max(Duration::from_secs(2));
    let deadline = Instant::now() + grace;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let slice = if lead.is_some() {
            left.min(GONE_POLL)
        } else {
            left
        };
        let rv = ctx.rv.clone();
        let pending = alive.clone();
        let acked: Vec<u32> = blocking("waiting for the ranks to stop", move || {
            let keys: Vec<String> = pending.iter().map(|r| bye_key(*r)).collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let waited = Instant::now();
            // a timeout is the usual answer while some rank has not said bye; any other
            // error must not turn this loop into a busy one
            if rv.store().wait(&keys, slice).is_err() {
                std::thread::sleep(slice.saturating_sub(waited.elapsed()));
            }
            Ok(pending
                .into_iter()
                .filter(|r| rv.peek::<()>(&bye_key(*r)).ok().flatten().is_some())
                .collect())
        })
        .await
        .unwrap_or_default();
        alive.retain(|r| !acked.contains(r));
        if let Some(lead) = lead {
            let gone = lead
                .send(GoneRanks)
                .timeout(ctx.call)
                .await
                .unwrap_or_default();
            alive.retain(|r| !gone.contains(r));
        }
        if alive.is_empty() || Instant::now() >= deadline {
            break;
        }
    }
    for r in alive {
        tracing::warn!(target: RANK_LOG, rank = r, "the rank did not acknowledge the stop");
    }
}

/// A rank other than 0: waits until rank 0 says stop, stops its rollout workers and
/// acknowledges the stop.
///
/// # Errors
/// Rank 0 gone before the end of the run (the rank's arbiters are stopped first).
pub(crate) async fn finish_member(
    ctx: &mut RankCtx,
    watch: &LeadWatch,
    rollouts: &[(ModelId, RolloutRef)],
    engine: Option<&EngineHandle>,
) -> Result<()> {
    let stopped = watch.wait_keys(&ctx.rv, &[STOP_KEY]).await?;
    for model in stop_rollouts(rollouts, ctx.call).await {
        tracing::warn!(target: RANK_LOG,
            "{}: a rollout worker of model `{model}` did not stop within {:?}; its arbiter is \
             stopped with the rank",
            ctx.who,
            ctx.call
        );
    }
    if stopped.is_none() {
        ctx.stop_arbiters();
        return Err(watch.lead_gone(&ctx.who));
    }
    if let Some(e) = engine
        && let Ok(s) = e
            .weights
            .stats
            .send(GetEngineStats)
            .timeout(Duration::from_secs(5))
            .await
    {
        tracing::info!(target: RANK_LOG,
            "{}: stopped; engine loaded {} versions (paused {:.2} ms in total){}",
            ctx.who,
            s.loads,
            s.paused_total.as_secs_f64() * 1e3,
            wire_line(&ctx.meters)
        );
    }
    watch.end(); // rank 0 may exit once it has every rank's acknowledgement
    if let Err(e) = ctx.rv.put(&bye_key(ctx.me), &()) {
        tracing::warn!(target: RANK_LOG, "{}: acknowledging the stop: {e}", ctx.who);
    }
    Ok(())
}

/// What the engine's inlets landed and read off the wire, for the rank's last line: `""`
/// when no transport counted it.
fn wire_line(meters: &[(ModelId, Arc<dyn refit_runtime::WireMeter>)]) -> String {
    meters
        .iter()
        .filter(|(_, m)| m.landed() > 0)
        .map(|(model, m)| {
            let (landed, wire) = (m.landed(), m.on_wire());
            format!(
                "; `{model}` weights: {landed} bytes landed, {wire} on the wire ({:.1}%)",
                100.0 * wire as f64 / landed as f64
            )
        })
        .collect()
}

/// Asks every rollout worker of this rank to stop, all at once, each answering within
/// `deadline`; answers the models of the workers that did not (a worker wedged in its
/// fragment does not hold the rank's exit; its arbiter stops with the rank).
pub(crate) async fn stop_rollouts(
    rollouts: &[(ModelId, RolloutRef)],
    deadline: Duration,
) -> Vec<ModelId> {
    // every stop is sent (and its deadline set) before the first answer is awaited
    let asks: Vec<_> = rollouts
        .iter()
        .map(|(model, r)| (model, r.stop.send(StopRollouts).timeout(deadline)))
        .collect();
    let mut late = Vec::new();
    for (model, ask) in asks {
        match ask.await {
            Err(MailboxError::Timeout) => late.push(model.clone()),
            // stopped, or already gone: nothing left to stop
            Ok(_) | Err(MailboxError::Closed) => {}
        }
    }
    late
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Instant;

    use actix::prelude::*;

    use super::*;
    use crate::protocol::rollout::{GetRolloutStats, RolloutStats};

    /// A rollout worker wedged in its fragment: it never answers a stop.
    struct Wedged;

    impl Actor for Wedged {
        type Context = Context<Self>;
    }

    impl Handler<StartRollouts> for Wedged {
        type Result = ();
        fn handle(&mut self, _: StartRollouts, _: &mut Context<Self>) {}
    }

    impl Handler<StopRollouts> for Wedged {
        type Result = ResponseFuture<RolloutStats>;
        fn handle(&mut self, _: StopRollouts, _: &mut Context<Self>) -> Self::Result {
            Box::pin(std::future::pending())
        }
    }

    impl Handler<GetRolloutStats> for Wedged {
        type Result = MessageResult<GetRolloutStats>;
        fn handle(&mut self, _: GetRolloutStats, _: &mut Context<Self>) -> Self::Result {
            MessageResult(RolloutStats::default())
        }
    }

    #[actix_rt::test]
    async fn a_rollout_worker_that_never_answers_its_stop_is_named_at_the_deadline() {
        let wedged = RolloutRef::local(&Wedged.start());
        let model = ModelId::new("policy").unwrap();
        let deadline = Duration::from_millis(200);
        let started = Instant::now();
        // the outer bound only keeps a failing test from hanging
        let late = tokio::time::timeout(
            Duration::from_secs(10),
            stop_rollouts(&[(model.clone(), wedged)], deadline),
        )
        .await
        .expect("the stop must end at its deadline");
        assert_eq!(late, [model]);
        assert!(started.elapsed() >= deadline);
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
