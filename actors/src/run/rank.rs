//! One rank of a run: the roles its process holds, started in one order whatever the
//! placement, each reached through its protocol's typed reference (local when it shares
//! the process, remote otherwise).
//!
//! 1. join the rendezvous (rank 0 serves the store); every other rank watches rank 0;
//! 2. rank 0: the controller (engines are added as their ranks join), one gate per engine
//!    rank, the run's lead, and the evaluator;
//! 3. a trainer rank: per model, the learner, its first version and its weight links
//!    (receiver specs published in the store);
//! 4. senders and inlets connect together (a broadcast sender waits for its receivers);
//! 5. trainers and trajectory pools; the engine; the rank's card; rollout workers;
//! 6. rank 0 adds every engine rank, lands version 1 everywhere, watches every rank, says
//!    start; a restarted rank asks rank 0 to take it back instead;
//! 7. rollouts and drivers run until rank 0 gathers the report and says stop (or dies).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_node::{ClusterToken, LaunchEnv, Peer};
use refit_runtime::sync_policy::SyncConfig;
use refit_runtime::topology::{Role, Topology, TransportKind};
use refit_runtime::{Manifests, ModelId, Version};
use refit_transports::link::{self, ReceiverSpec};
use tokio::sync::oneshot;

use crate::actor::controller::{VersionNotifier, WeightSyncController};
use crate::actor::pool::TrajectoryPool;
use crate::actor::rollout::RolloutConfig;
use crate::actor::workers::Trainer;
use crate::error::{Error, Result};
use crate::protocol::controller::{ControllerLink, ControllerRef};
use crate::protocol::engine::EngineRef;
use crate::protocol::lead::{LeadRef, ModelDone, Rejoin};
use crate::protocol::pool::{PoolRef, PushFragment};
use crate::protocol::rollout::{RolloutRef, StartRollouts};
use crate::remote::{RemoteAddr, serve};
use crate::roles::ModelSpec;

use super::drive::Driver;
use super::gate::{EngineRoute, RankGate};
use super::ids::{RankCard, START_KEY, STOP_KEY, Served, actor_id, bye_key, rank_key, weights_key};
use super::lead::{AddRank, Finish, Lead, LeadSetup, RankDown};
use super::rendezvous::{Place, Rendezvous, watch};
use super::shard::{self, ShardSite};
use super::weights::{self, Leftovers};
use super::workload::{EngineSetup, Inference, Workload};
use super::{InletWrapper, RunConfig, RunReport, StopRule, describe};

/// What a rank is started with.
pub(crate) struct RankSetup {
    pub(crate) topo: Arc<Topology>,
    pub(crate) launch: LaunchEnv,
    pub(crate) token: ClusterToken,
    pub(crate) specs: Vec<ModelSpec>,
    pub(crate) work: Arc<dyn Workload>,
    pub(crate) stop: StopRule,
    pub(crate) eval_episodes: usize,
    pub(crate) wrap_inlet: Option<InletWrapper>,
    pub(crate) incarnation: u32,
}

/// The topology of a run of one process: every role in one rank.
pub(crate) fn one_process(cfg: &RunConfig) -> Result<Topology> {
    let mut text = format!(
        "[run]\ncommand = [\"(this process)\"]\nseed = {}\nwait_s = {}\n",
        cfg.seed,
        cfg.wait.as_secs_f64().max(0.001)
    );
    for m in &cfg.models {
        text.push_str(&format!(
            "[[model]]\nid = \"{}\"\n[model.params]\nworkers = {}\n",
            m.id, m.workers
        ));
    }
    text.push_str(
        "[[process]]\nname = \"local\"\nroles = [\"controller\", \"trainer\", \"evaluator\", \
         \"engine\", \"rollout\"]\n",
    );
    let mut topo = Topology::parse(&text)?;
    topo.sync = cfg.sync.clone();
    topo.sync.models = cfg.models.iter().map(|m| m.id.clone()).collect();
    Ok(topo)
}

/// Deadline of a remote call: the longest a controller, pool, engine or the lead may take
/// to answer (a notification may wait for a barrier round, its loads and a validation).
fn call_deadline(topo: &Topology) -> Duration {
    let t = &topo.sync.timeouts;
    let round = t.barrier() + t.load() * 2 + t.eval();
    topo.wait() + t.rollout_wait().max(round) + Duration::from_secs(5)
}

/// Runs blocking work (store waits, link connects) off the actor threads.
async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    actix_rt::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Actor(format!("{what}: {e}")))?
}

/// The rollout workers rank `rank` serves, reached through `remote`'s connection.
pub(crate) fn rollout_refs(
    topo: &Topology,
    rank: u32,
    remote: &RemoteAddr,
) -> Vec<(ModelId, RolloutRef)> {
    let mut out = Vec::new();
    for m in topo.model_ids() {
        let mi = topo.model_index(&m).unwrap_or(0);
        for w in 0..topo.rollout_workers(rank, &m) as usize {
            let r = remote.at(
                actor_id(Served::Rollout, rank, mi, w),
                format!("rollout worker {w} of `{m}` on rank {rank}"),
            );
            out.push((m.clone(), RolloutRef::remote(&r)));
        }
    }
    out
}

/// Tells the controller that version 1 of every model is out and waits until it landed
/// everywhere.
///
/// # Errors
/// The controller refused or is gone.
pub(crate) async fn land_version_one(
    controller: &Addr<WeightSyncController>,
    ids: &[ModelId],
    sync: &SyncConfig,
) -> Result<()> {
    let mut notifiers: Vec<VersionNotifier> = ids
        .iter()
        .map(|id| VersionNotifier::new(controller.clone(), id.clone(), sync.clone()))
        .collect();
    for n in &mut notifiers {
        n.notify(Version(1)).await?;
    }
    for n in &mut notifiers {
        n.flush().await?;
    }
    Ok(())
}

/// Waits (on a blocking thread) until one of `keys` is set in the store, or rank 0 is
/// gone (`gone` set by the keepalive): answers the key that was set, `None` when rank 0 is
/// gone.
async fn wait_keys(
    rv: &Rendezvous,
    keys: &'static [&'static str],
    gone: &Arc<AtomicBool>,
) -> Result<Option<&'static str>> {
    // short calls: a silent rank 0 must not hold this loop past the keepalive's verdict
    let store = rv.store().clone().with_timeout(Duration::from_secs(1));
    let gone = Arc::clone(gone);
    blocking("waiting for rank 0", move || {
        loop {
            if gone.load(Ordering::SeqCst) || store.peer().is_closed() {
                return Ok(None);
            }
            for k in keys {
                if store.get(k).ok().flatten().is_some() {
                    return Ok(Some(*k));
                }
            }
            match store.wait(keys, Duration::from_millis(500)) {
                Ok(()) => {}
                Err(e) if e.is_timeout() => {}
                Err(_) => return Ok(None),
            }
        }
    })
    .await
}

/// What rank 0 keeps to lead the run.
struct Leading {
    controller: Addr<WeightSyncController>,
    lead: Addr<Lead>,
    gates: BTreeMap<u32, Addr<RankGate>>,
    done: oneshot::Receiver<Result<()>>,
}

/// Runs one rank to the end: rank 0 answers the run's report, the others `None`.
#[allow(clippy::too_many_lines)]
pub(crate) async fn rank_main(s: RankSetup) -> Result<Option<RunReport>> {
    let started = Instant::now();
    let RankSetup {
        topo,
        launch,
        token,
        specs,
        work,
        stop,
        eval_episodes,
        wrap_inlet,
        incarnation,
    } = s;
    let me = launch.rank;
    let plan = topo.rank(me)?;
    let who = describe(&plan);
    let wait = topo.wait();
    let call = call_deadline(&topo);
    let mut sync = topo.sync.clone();
    sync.models = specs.iter().map(|s| s.id.clone()).collect();
    sync.check()?;
    let ids = sync.models.clone();
    let mut arbiters: Vec<Arbiter> = Vec::new();

    // 1. the rendezvous, and the keepalive on rank 0
    let rv = {
        let launch = launch.clone();
        let place = Place {
            host_addr: plan.host.address()?.to_string(),
            bind: plan.bind,
            port: plan.port,
        };
        blocking("joining the rendezvous", move || {
            Rendezvous::join(&launch, &place, token, wait)
        })
        .await?
    };
    let node = rv.node().clone();
    let lead_peer: Peer = rv.store().peer().clone();
    let gone = Arc::new(AtomicBool::new(false));
    let gone_why = Arc::new(std::sync::Mutex::new(String::new()));
    let _lead_watch = (me != 0).then(|| {
        let (gone, why) = (Arc::clone(&gone), Arc::clone(&gone_why));
        watch(
            &node,
            vec![(0, 0, lead_peer.addr())],
            topo.keepalive(),
            topo.dead_after(),
            move |d| {
                refit_runtime::unless_stopping!(error, "rank 0 is gone: {}", d.reason);
                *why.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = d.reason;
                gone.store(true, Ordering::SeqCst);
            },
        )
    });
    let rejoining = me != 0 && (incarnation > 0 || rv.peek::<()>(START_KEY)?.is_some());

    // 2. rank 0: controller, gates, lead; the evaluator where it runs
    let route = plan
        .has(Role::Evaluator)
        .then(|| EngineRoute::new(Vec::new()).start());
    let evaluator = match &route {
        Some(r) => {
            let e = work.start_evaluator(
                &specs,
                Inference {
                    act: r.clone().recipient(),
                    generate: r.clone().recipient(),
                },
                eval_episodes,
                topo.run.seed,
            )?;
            serve(&node, actor_id(Served::Evaluator, me, 0, 0), e.clone());
            Some(e)
        }
        None => None,
    };
    let mut leading = None;
    let (controller, lead) = if me == 0 {
        let c = WeightSyncController::new(&sync, ids.clone(), Vec::new(), evaluator)?.start();
        let cref = ControllerRef::local(&c);
        cref.serve(&node, actor_id(Served::Controller, 0, 0, 0));
        let mut gates = BTreeMap::new();
        for r in topo.engine_ranks() {
            let g = RankGate::new(r, c.clone().recipient(), c.clone().recipient()).start();
            ControllerLink {
                await_rollout: g.clone().recipient(),
                done: g.clone().recipient(),
            }
            .serve(&node, actor_id(Served::Gate, r, 0, 0));
            gates.insert(r, g);
        }
        let (done_tx, done_rx) = oneshot::channel();
        let l = Lead::new(LeadSetup {
            topo: Arc::clone(&topo),
            node: node.clone(),
            call,
            controller: c.clone(),
            route: route.clone(),
            gates: gates.clone(),
            done: done_tx,
            started,
        })
        .start();
        let lref = LeadRef::local(&l);
        lref.serve(&node, actor_id(Served::Lead, 0, 0, 0));
        leading = Some(Leading {
            controller: c,
            lead: l,
            gates,
            done: done_rx,
        });
        (cref, lref)
    } else {
        let at = |kind, name: &str| {
            RemoteAddr::new(lead_peer.clone(), actor_id(kind, 0, 0, 0), name, call)
        };
        (
            ControllerRef::remote(&at(Served::Controller, "controller")),
            LeadRef::remote(&at(Served::Lead, "the run's lead")),
        )
    };

    // 3. trainer side: learners, first versions, weight links
    let trains: Vec<ModelSpec> = specs
        .iter()
        .filter(|s| topo.trainer_ranks(&s.id).first() == Some(&me))
        .cloned()
        .collect();
    if rejoining && !trains.is_empty() {
        return Err(Error::Config(format!(
            "{who} holds a trainer and cannot rejoin a running run (incarnation {incarnation})"
        )));
    }
    let mut leftovers = Leftovers::default();
    let mut opened = Vec::new();
    for spec in &trains {
        work.check(spec, topo.run.seed)?;
        let mut learner = work.learner(spec)?;
        let initial = learner.export()?;
        if initial.model() != &spec.id || initial.version() != Version(1) {
            return Err(Error::Config(format!(
                "the learner of model `{}` exported its first weights as model `{}` v{} \
                 (a fresh learner exports v1 of its own model)",
                spec.id,
                initial.model(),
                initial.version()
            )));
        }
        let want = match topo.model(&spec.id).and_then(|m| m.convert.as_ref()) {
            Some(c) => Some(c.want(&format!("model[{}].convert", spec.id))?),
            None => work.want(spec)?,
        };
        let (wire, conversions) = weights::plan(&initial, want)?;
        work.engine_manifest(spec)?
            .check_same_schema(&spec.id, wire.get(&spec.id)?)?;
        let mut kinds: Vec<(TransportKind, usize)> = Vec::new();
        for r in topo.engine_ranks_of(&spec.id) {
            let k = topo.weights_transport(&spec.id, me, r);
            match kinds.iter_mut().find(|(kind, _)| *kind == k) {
                Some((_, n)) => *n += 1,
                None => kinds.push((k, 1)),
            }
        }
        let links = weights::open_links(
            &node,
            &initial,
            conversions.as_ref(),
            &kinds,
            topo.links.checksum,
        )?;
        for l in &links.specs {
            tracing::info!(
                "{who}: pid {}, model `{}` weights: {l}",
                std::process::id(),
                spec.id
            );
        }
        leftovers.0.extend(links.leftovers.iter().cloned());
        rv.put(&weights_key(&spec.id), &links.specs)?;
        opened.push((spec.clone(), learner, initial, links));
    }
    // the other shards of a sharded trainer: a learner each, served for shard 0 to call
    let shard_site = ShardSite {
        topo: &topo,
        me,
        who: &who,
        node: &node,
        rv: &rv,
        wait,
    };
    let _shards = shard::start_members(&shard_site, &specs, &work, rejoining)?;

    // 4. senders and inlets connect together
    let mut senders = Vec::new();
    for (spec, learner, initial, links) in opened {
        senders.push(actix_rt::task::spawn_blocking(move || {
            links
                .connect(&initial, wait)
                .map(|outlet| (spec, learner, outlet))
        }));
    }
    let engines: Vec<ModelSpec> = specs
        .iter()
        .filter(|s| plan.serves(Role::Engine, &s.id))
        .cloned()
        .collect();
    let mut receivers = Vec::new();
    for spec in &engines {
        let expected = Manifests::new([(spec.id.clone(), work.engine_manifest(spec)?)])?;
        let trainer = topo.trainer_ranks(&spec.id).first().copied().unwrap_or(0);
        let wanted = link::for_kind(&topo.weights_transport(&spec.id, trainer, me))?.name();
        let (rv, node, spec, who) = (rv.clone(), node.clone(), spec.clone(), who.clone());
        receivers.push(actix_rt::task::spawn_blocking(move || {
            let links: Vec<ReceiverSpec> = rv.take(&weights_key(&spec.id), wait)?;
            let link = links
                .iter()
                .find(|l| l.transport() == wanted)
                .ok_or_else(|| {
                    Error::Config(format!(
                        "{who}: the trainer of model `{}` opened no {wanted} link",
                        spec.id
                    ))
                })?;
            let inlet = weights::connect_inlet(&spec.id, link, &node, expected, wait)?;
            tracing::info!(
                "{who}: pid {}, model `{}` weights over {wanted}",
                std::process::id(),
                spec.id
            );
            Ok::<_, Error>((spec, inlet))
        }));
    }
    let mut outlets = Vec::new();
    for t in senders {
        outlets.push(
            t.await
                .map_err(|e| Error::Actor(format!("{who}: connecting a sender: {e}")))??,
        );
    }
    let mut inlets = Vec::new();
    for t in receivers {
        let (spec, inlet) = t
            .await
            .map_err(|e| Error::Actor(format!("{who}: connecting an inlet: {e}")))??;
        let inlet = match &wrap_inlet {
            Some(w) => w(inlet),
            None => inlet,
        };
        inlets.push((spec, inlet));
    }

    // 5. trainers and pools; the engine; the card; rollout workers
    let mut drivers = Vec::new();
    let mut local_pools: BTreeMap<ModelId, PoolRef> = BTreeMap::new();
    for (spec, learner, outlet) in outlets {
        let trainer = if topo.trainer_ranks(&spec.id).len() > 1 {
            shard::start_lead(&shard_site, &spec, learner, outlet).await?
        } else {
            Trainer::start_with_outlet(learner, outlet).recipient()
        };
        let pool = TrajectoryPool::new(
            spec.id.clone(),
            spec.batch_frames,
            sync.allowed_staleness(),
            Some(controller.batch_ready.clone()),
        )
        .with_capacity_batches(sync.max_buffered_batches)
        .start();
        let pref = PoolRef::local(&pool);
        let mi = topo.model_index(&spec.id).unwrap_or(0);
        pref.serve(&node, actor_id(Served::Pool, me, mi, 0));
        local_pools.insert(spec.id.clone(), pref.clone());
        drivers.push((spec, trainer, pref));
    }
    let engine = if inlets.is_empty() {
        None
    } else {
        let started = work.start_engine(
            inlets,
            &EngineSetup {
                seed: topo.run.seed.wrapping_add(u64::from(me)),
                pause: sync.pause_mode,
            },
        )?;
        started
            .handle
            .serve(&node, actor_id(Served::Engine, me, 0, 0));
        arbiters.push(started.arbiter);
        Some(started.handle)
    };
    rv.put(
        &rank_key(me),
        &RankCard {
            node: rv.advertised(),
            pid: std::process::id(),
            incarnation,
        },
    )?;
    // the nodes of the other ranks this one calls (rank 0's is the store's)
    let mut peers: BTreeMap<u32, Peer> = BTreeMap::new();
    peers.insert(0, lead_peer.clone());
    let mut rollouts: Vec<(ModelId, RolloutRef)> = Vec::new();
    for spec in specs.iter().filter(|s| plan.serves(Role::Rollout, &s.id)) {
        let model = &spec.id;
        let mi = topo.model_index(model).unwrap_or(0);
        let trainer = topo.trainer_ranks(model).first().copied().unwrap_or(0);
        let push: Recipient<PushFragment> = match local_pools.get(model) {
            Some(p) => p.push.clone(),
            None => {
                let peer = peer_of(&rv, &node, &mut peers, trainer, wait).await?;
                let pool = RemoteAddr::new(
                    peer,
                    actor_id(Served::Pool, trainer, mi, 0),
                    format!("trajectory pool of `{model}`"),
                    call,
                );
                pool.recipient()
            }
        };
        let gate = match &leading {
            Some(l) => {
                let g = l.gates.get(&me).ok_or_else(|| {
                    Error::Config(format!("{who} runs rollouts without an engine"))
                })?;
                ControllerLink {
                    await_rollout: g.clone().recipient(),
                    done: g.clone().recipient(),
                }
            }
            None => ControllerLink::remote(&RemoteAddr::new(
                lead_peer.clone(),
                actor_id(Served::Gate, me, 0, 0),
                "controller",
                call,
            )),
        };
        let engine = engine
            .as_ref()
            .ok_or_else(|| Error::Config(format!("{who} runs rollouts without an engine")))?;
        for w in 0..topo.rollout_workers(me, model) as usize {
            let index = (me as usize) * 1000 + w;
            let seed = topo
                .run
                .seed
                .wrapping_mul(1000)
                .wrapping_add((mi * 100_000 + index) as u64 * 17);
            let started = work.start_rollout(
                spec,
                RolloutConfig {
                    model: model.clone(),
                    worker: index,
                    fragment_steps: spec.fragment_steps,
                    seed,
                    timeout: wait,
                },
                engine,
                gate.clone(),
                push.clone(),
            )?;
            started
                .handle
                .serve(&node, actor_id(Served::Rollout, me, mi, w));
            arbiters.push(started.arbiter);
            rollouts.push((model.clone(), started.handle));
        }
    }

    // 6. rank 0 adds every engine rank, lands version 1 and says start; a restarted rank
    //    asks to be taken back
    let mut watching = None;
    if let Some(l) = &leading {
        let deadline = Instant::now() + wait;
        let mut nodes = Vec::new();
        for p in topo.ranks().iter().skip(1) {
            let left = deadline.saturating_duration_since(Instant::now());
            let key = rank_key(p.rank);
            let rv2 = rv.clone();
            let card: RankCard = blocking("waiting for a rank", move || rv2.take(&key, left))
                .await
                .map_err(|e| {
                    Error::Config(format!("{} did not join within {wait:?}: {e}", describe(p)))
                })?;
            tracing::info!(rank = p.rank, pid = card.pid, node = %card.node, "rank joined");
            nodes.push((p.rank, card.incarnation, card.node));
        }
        if topo.world_size() > 1 {
            tracing::info!(
                "rank 0: {} ranks joined in {:.1} s",
                topo.world_size(),
                started.elapsed().as_secs_f64()
            );
        }
        for r in topo.engine_ranks() {
            let (engine, rollouts) = if r == me {
                (
                    engine
                        .clone()
                        .ok_or_else(|| Error::Config(format!("{who}: no engine")))?,
                    rollouts.clone(),
                )
            } else {
                let addr = nodes
                    .iter()
                    .find(|(n, _, _)| *n == r)
                    .map(|(_, _, a)| *a)
                    .ok_or_else(|| Error::Config(format!("engine rank {r} did not join")))?;
                let name = topo
                    .rank(r)
                    .map_or_else(|_| format!("rank {r}"), |p| describe(&p));
                let remote = RemoteAddr::connect(
                    &node,
                    addr,
                    actor_id(Served::Engine, r, 0, 0),
                    format!("engine of {name}"),
                    call,
                )
                .await?;
                (EngineRef::remote(&remote), rollout_refs(&topo, r, &remote))
            };
            l.lead
                .send(AddRank {
                    rank: r,
                    incarnation: 0,
                    engine,
                    rollouts,
                    watch: None,
                })
                .timeout(call)
                .await
                .map_err(|e| Error::Actor(format!("the run's lead: {e}")))??;
        }
        land_version_one(&l.controller, &ids, &sync).await?;
        let lead = l.lead.clone();
        watching = Some(watch(
            &node,
            nodes,
            topo.keepalive(),
            topo.dead_after(),
            move |d| lead.do_send(RankDown(d)),
        ));
        rv.put(START_KEY, &())?;
        tracing::info!(
            "rank 0: version 1 serves on {} engines; rollouts start ({} mode)",
            topo.engine_ranks().len(),
            sync.sync_mode
        );
    } else if rejoining {
        if rv.peek::<()>(STOP_KEY)?.is_some() {
            return Ok(None);
        }
        lead.rejoin
            .send(Rejoin {
                rank: me,
                incarnation,
                node: rv.advertised(),
            })
            .timeout(call * 2)
            .await
            .map_err(|e| Error::Actor(format!("{who}: rejoining: {e}")))??;
        tracing::info!("{who}: rejoined the run (incarnation {incarnation})");
    } else {
        match wait_keys(&rv, &[START_KEY, STOP_KEY], &gone).await? {
            Some(START_KEY) => {}
            Some(_) => return Ok(None),
            None => return Err(lead_gone(&who, &gone_why)),
        }
    }

    // 7. rollouts and drivers run
    for (_, r) in &rollouts {
        r.start.do_send(StartRollouts);
    }
    if !rollouts.is_empty() {
        tracing::info!("{who}: {} rollout workers running", rollouts.len());
    }
    for (spec, trainer, pool) in drivers {
        let model = spec.id.clone();
        let driver = Driver {
            model: model.clone(),
            trainer,
            pool,
            controller: controller.clone(),
            notifier: VersionNotifier::new(controller.notify.clone(), model.clone(), sync.clone()),
            lead: lead.clone(),
            mode: sync.sync_mode,
            allowed_staleness: sync.allowed_staleness(),
            stop: stop.clone(),
            wait,
            call,
            started,
        };
        let done = lead.done.clone();
        actix_rt::spawn(async move {
            let report = driver.run().await.map_err(|e| e.to_string());
            if let Err(e) = done.send(ModelDone { model, report }).timeout(call).await {
                tracing::error!("a driver could not hand in its report: {e}");
            }
        });
    }

    let out = match leading {
        Some(l) => {
            let ended = match l.done.await {
                Ok(r) => r,
                Err(_) => Err(Error::Actor("the run's lead stopped".into())),
            };
            drop(watching);
            let report = match ended {
                Ok(()) => l
                    .lead
                    .send(Finish)
                    .timeout(call)
                    .await
                    .map_err(|e| Error::Actor(format!("the run's lead: {e}")))?,
                Err(e) => Err(e),
            };
            if let Err(e) = rv.put(STOP_KEY, &()) {
                tracing::warn!("telling the other ranks to stop: {e}");
            }
            // the others read the stop before this node goes away (bounded: a dead or
            // partitioned rank is not waited for long)
            let alive: Vec<u32> = match &report {
                Ok(r) => (1..topo.world_size())
                    .filter(|n| {
                        !r.events.iter().any(|e| {
                            e.rank == *n && matches!(e.kind, super::RankEventKind::Died(_))
                        }) || r.ranks.iter().any(|x| x.rank == *n && x.fate.is_none())
                    })
                    .collect(),
                Err(_) => (1..topo.world_size()).collect(),
            };
            let rv2 = rv.clone();
            let grace = topo.dead_after().max(Duration::from_secs(2));
            let _ = blocking("waiting for the ranks to stop", move || {
                let deadline = Instant::now() + grace;
                for r in alive {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if rv2.store().wait_get(&bye_key(r), left).is_err() {
                        tracing::warn!(rank = r, "the rank did not acknowledge the stop");
                    }
                }
                Ok(())
            })
            .await;
            let report = report?;
            Some(report)
        }
        None => {
            let stopped = wait_keys(&rv, &[STOP_KEY], &gone).await?;
            for (_, r) in &rollouts {
                let _ = r.stop.send(crate::protocol::rollout::StopRollouts).await;
            }
            if stopped.is_none() {
                for a in arbiters {
                    a.stop();
                }
                return Err(lead_gone(&who, &gone_why));
            }
            if let Some(e) = &engine
                && let Ok(s) = e
                    .stats
                    .send(crate::protocol::engine::GetEngineStats)
                    .timeout(Duration::from_secs(5))
                    .await
            {
                tracing::info!(
                    "{who}: stopped; engine loaded {} versions (paused {:.2} ms in total)",
                    s.loads,
                    s.paused_total.as_secs_f64() * 1e3
                );
            }
            if let Err(e) = rv.put(&bye_key(me), &()) {
                tracing::warn!("{who}: acknowledging the stop: {e}");
            }
            None
        }
    };
    for a in arbiters {
        a.stop();
    }
    drop(leftovers);
    Ok(out)
}

/// The error of a rank whose rank 0 went away.
fn lead_gone(who: &str, why: &std::sync::Mutex<String>) -> Error {
    let why = why
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let why = if why.is_empty() {
        "its connection closed".to_string()
    } else {
        why
    };
    Error::Actor(format!(
        "{who}: rank 0 went away before the end of the run ({why}); this rank stops"
    ))
}

/// The connection to rank `r`'s node (from its card), made once.
pub(super) async fn peer_of(
    rv: &Rendezvous,
    node: &refit_node::Node,
    peers: &mut BTreeMap<u32, Peer>,
    r: u32,
    wait: Duration,
) -> Result<Peer> {
    if let Some(p) = peers.get(&r) {
        return Ok(p.clone());
    }
    let key = rank_key(r);
    let rv2 = rv.clone();
    let card: RankCard = blocking("waiting for a rank", move || rv2.take(&key, wait)).await?;
    let peer = node.connect_async(card.node, wait).await.map_err(|e| {
        Error::Config(format!(
            "rank {r}: its node at {} is not reachable: {e}",
            card.node
        ))
    })?;
    peers.insert(r, peer.clone());
    Ok(peer)
}
