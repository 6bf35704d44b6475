//! An engine rank: one inlet per model from rank 0's published links, its inference
//! engine served to the controller, its rollout workers, until rank 0 says stop.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::topology::{RankPlan, Topology};
use refit_runtime::{HasWeights, Manifests, ModelId};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::remote::{RemoteAddr, serve};
use crate::roles::{ModelSpec, Roles};

use super::cards::*;
use super::links;
use super::rendezvous::{Rendezvous, STOP_KEY, rank_key};
use super::{call_deadline, describe};
use crate::actor::controller::{AwaitRollout, RolloutDone};
use crate::actor::engine::{
    ActBatch, CancelInFlight, GetEngineStats, InferenceEngine, ServedVersions, UpdateModel,
};
use crate::actor::rollout::{
    ControllerLink, PushFragment, RolloutConfig, RolloutWorker, StartRollouts, StopRollouts,
};
use crate::actor::topology::start_rollout_worker;
use refit_transports::link::ReceiverSpec;

/// An engine rank.
pub(super) fn follow<R: Roles>(
    topo: &Topology,
    plan: &RankPlan,
    rv: &Rendezvous,
    roles: &Arc<R>,
    specs: &[ModelSpec],
) -> Result<()> {
    let wait = topo.wait();
    let rank = plan.rank;
    let who = describe(plan);
    let leader: LeaderCard = rv
        .take(&rank_key(0), wait)
        .map_err(|e| Error::Config(format!("{who}: rank 0 did not publish its card: {e}")))?;
    let kind = topo.weights_transport(0, rank);
    let mut engine =
        InferenceEngine::<R::Policy>::empty(topo.run.seed.wrapping_add(u64::from(rank)));
    for spec in specs {
        let policy = roles.policy(spec)?;
        let expected = Manifests::new([(spec.id.clone(), Arc::new(policy.weight_manifest()?))])?;
        let links: Vec<ReceiverSpec> = rv.take(&weights_key(&spec.id), wait)?;
        let wanted = refit_transports::link::for_kind(&kind)?.name();
        let link = links
            .iter()
            .find(|l| l.transport() == wanted)
            .ok_or_else(|| {
                Error::Config(format!(
                    "{who}: rank 0 opened no {kind} link for model `{}`",
                    spec.id
                ))
            })?;
        let inlet = links::connect_inlet(&spec.id, link, rv.node(), expected, wait)?;
        engine = engine.with_model(spec.id.clone(), policy, Some(inlet))?;
        println!(
            "{who}: pid {}, model `{}` weights over {wanted}",
            std::process::id(),
            spec.id
        );
    }
    let gate = *leader
        .gates
        .get(&rank)
        .ok_or_else(|| Error::Config(format!("{who}: rank 0 has no controller gate for it")))?;
    actix_rt::System::new().block_on(async move {
        let engine_arbiter = Arbiter::new();
        let engine = InferenceEngine::start_in_arbiter(&engine_arbiter.handle(), move |_| engine);
        let engine_id = Uuid::new_v4();
        let node = rv.node();
        serve::<UpdateModel>(node, engine_id, engine.clone().recipient());
        serve::<CancelInFlight>(node, engine_id, engine.clone().recipient());
        serve::<ServedVersions>(node, engine_id, engine.clone().recipient());
        serve::<ActBatch>(node, engine_id, engine.clone().recipient());

        let deadline = call_deadline(topo);
        let leader_peer = rv.store().peer().clone();
        let controller = RemoteAddr::new(leader_peer.clone(), gate, "controller", deadline);
        let link = ControllerLink {
            await_rollout: controller.recipient::<AwaitRollout>(),
            done: controller.recipient::<RolloutDone>(),
        };
        let mut workers: Vec<(ModelId, Addr<RolloutWorker<R::Env>>)> = Vec::new();
        let mut arbiters = vec![engine_arbiter];
        for (mi, spec) in specs.iter().enumerate() {
            let pool_id = *leader.pools.get(&spec.id).ok_or_else(|| {
                Error::Config(format!("{who}: rank 0 has no pool for model `{}`", spec.id))
            })?;
            let pool = RemoteAddr::new(
                leader_peer.clone(),
                pool_id,
                format!("trajectory pool of `{}`", spec.id),
                deadline,
            );
            for w in 0..plan.rollout_workers as usize {
                let index = (rank as usize) * 1000 + w;
                let base = topo
                    .run
                    .seed
                    .wrapping_mul(1000)
                    .wrapping_add((mi * 100_000 + index) as u64 * 17);
                let (arbiter, addr) = start_rollout_worker(
                    &**roles,
                    spec,
                    RolloutConfig {
                        model: spec.id.clone(),
                        worker: index,
                        fragment_steps: spec.fragment_steps,
                        seed: base,
                        timeout: topo.wait(),
                    },
                    engine.clone().recipient(),
                    link.clone(),
                    pool.recipient::<PushFragment>(),
                )?;
                arbiters.push(arbiter);
                workers.push((spec.id.clone(), addr));
            }
        }
        rv.put(
            &rank_key(rank),
            &RankCard {
                node: node.addr(),
                engine: engine_id,
                pid: std::process::id(),
            },
        )?;
        // wait for rank 0's go (or its end)
        let rv2 = rv.clone();
        let started = actix_rt::task::spawn_blocking(move || {
            loop {
                match rv2
                    .store()
                    .wait(&[START_KEY, STOP_KEY], Duration::from_secs(1))
                {
                    Ok(()) => return true,
                    Err(e) if e.is_timeout() => {
                        if rv2.store().get(START_KEY).ok().flatten().is_some() {
                            return true;
                        }
                        if rv2.store().get(STOP_KEY).ok().flatten().is_some()
                            || rv2.store().peer().is_closed()
                        {
                            return false;
                        }
                    }
                    Err(_) => return false,
                }
            }
        })
        .await
        .unwrap_or(false);
        if started {
            for (_, w) in &workers {
                w.do_send(StartRollouts);
            }
            println!("{who}: {} rollout workers running", workers.len());
        }
        let rv2 = rv.clone();
        let stopped = actix_rt::task::spawn_blocking(move || rv2.wait_stop())
            .await
            .map_err(|e| Error::Actor(format!("{who}: waiting for the end: {e}")))??;
        let mut stats = RankStats::default();
        for (m, w) in &workers {
            let s = w
                .send(StopRollouts)
                .await
                .map_err(|e| Error::Actor(format!("{who}: rollout worker: {e}")))?;
            stats
                .workers
                .entry(m.clone())
                .or_default()
                .push(WorkerStats::from(&s));
        }
        let es = engine
            .send(GetEngineStats)
            .await
            .map_err(|e| Error::Actor(format!("{who}: engine: {e}")))?;
        stats.loads = es.loads;
        stats.paused_total = es.paused_total;
        stats.paused_max = es.paused_max;
        stats.staged_total = es.staged_total;
        stats.cancelled = es.cancelled;
        for a in arbiters {
            a.stop();
        }
        if !stopped {
            return Err(Error::Actor(format!(
                "{who}: rank 0 went away before the end of the run"
            )));
        }
        if let Err(e) = rv.put(&stats_key(rank), &stats) {
            tracing::warn!("{who}: reporting statistics: {e}");
        }
        println!(
            "{who}: stopped; engine loaded {} versions (paused {:.2} ms in total)",
            stats.loads,
            stats.paused_total.as_secs_f64() * 1e3
        );
        Ok(())
    })
}
