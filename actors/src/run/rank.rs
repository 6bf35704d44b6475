//! One rank of a run: a table of role starters ([`super::start`]) walked in one order
//! whatever the placement, each role reached through its protocol's typed reference
//! (local when it shares the process, remote otherwise).
//!
//! 1. join the rendezvous (rank 0 serves the store); every other rank watches rank 0;
//! 2. the starters: the evaluator; rank 0's controller, gates and lead; the trainers'
//!    learners, first versions and weight links (receiver specs published in the store),
//!    and the other shards of sharded trainers; senders and inlets connected together;
//!    trainers and trajectory pools; the engine; the rank's card; rollout workers;
//! 3. rank 0 adds every engine rank, lands version 1 everywhere, watches every rank, says
//!    start; a restarted rank asks rank 0 to take it back instead ([`super::begin`]);
//! 4. rollouts and drivers run until rank 0 gathers the report and says stop (or dies)
//!    ([`super::end`]).

use std::time::{Duration, Instant};

use refit_runtime::topology::Topology;

use crate::error::Result;

use super::begin::{admit, await_start};
use super::end::{finish_lead, finish_member, run};
use super::ids::{RankCard, START_KEY, rank_key};
use super::keepalive::LeadWatch;
use super::peers::blocking;
use super::rendezvous::{Place, Rendezvous};
use super::setup::RankSetup;
use super::shard;
use super::start::{self, RankCtx};
use super::{RunConfig, RunReport, describe};

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

/// Runs one rank to the end: rank 0 answers the run's report, the others `None`.
pub(crate) async fn rank_main(s: RankSetup) -> Result<Option<RunReport>> {
    let (mut ctx, watch) = join(s).await?;

    // the starters, in order
    let eval = start::evaluator::start(&ctx)?;
    let heads = start::controller::start(&ctx, eval)?;
    let opened = start::trainer::open(&ctx)?;
    let _shards = shard::start_members(
        &ctx.shard_site(),
        &ctx.setup.specs,
        &ctx.setup.work,
        ctx.rejoining,
    )?;
    let links = start::links::connect(&ctx, opened.models).await?;
    let training = start::pool::start(&ctx, links.outlets, &heads.controller).await?;
    ctx.meters = links.meters;
    let engine = start::engine::start(&mut ctx, links.inlets)?;
    publish_card(&ctx)?;
    let gates = heads.leading.as_ref().map(|l| &l.gates);
    let rollouts = start::rollout::start(&mut ctx, &training.pools, gates, engine.as_ref()).await?;

    // the start: rank 0 admits every rank; the others rejoin or wait for it
    let watching = match &heads.leading {
        Some(l) => Some(admit(&ctx, l, engine.as_ref(), &rollouts).await?),
        None if await_start(&ctx, &heads.lead, &watch).await? => None,
        None => return Ok(None),
    };

    // the run and its end
    run(&ctx, &heads, &rollouts, training.drivers);
    let out = match heads.leading {
        Some(l) => Some(finish_lead(&ctx, l, watching).await?),
        None => {
            finish_member(&mut ctx, &watch, &rollouts, engine.as_ref()).await?;
            None
        }
    };
    ctx.stop_arbiters();
    drop(opened.leftovers);
    Ok(out)
}

/// Joins the rendezvous (rank 0 serves the store) and, on every other rank, starts
/// watching rank 0: the rank's context and its watch on rank 0.
async fn join(s: RankSetup) -> Result<(RankCtx, LeadWatch)> {
    let started = Instant::now();
    let me = s.launch.rank;
    let plan = s.topo.rank(me)?;
    let wait = s.topo.wait();
    let mut sync = s.topo.sync.clone();
    sync.models = s.specs.iter().map(|s| s.id.clone()).collect();
    sync.check()?;
    let place = Place {
        host_addr: plan.host.address()?.to_string(),
        bind: plan.bind,
        port: plan.port,
    };
    let (launch, token) = (s.launch.clone(), s.token.clone());
    let rv = blocking("joining the rendezvous", move || {
        Rendezvous::join(&launch, &place, token, wait)
    })
    .await?;
    let node = rv.node().clone();
    let watch = LeadWatch::start(me, &rv, &node, &s.topo);
    let rejoining = me != 0 && (s.incarnation > 0 || rv.peek::<()>(START_KEY)?.is_some());
    let ctx = RankCtx {
        who: describe(&plan),
        call: call_deadline(&s.topo),
        ids: sync.models.clone(),
        lead_peer: rv.store().peer().clone(),
        setup: s,
        plan,
        me,
        wait,
        started,
        sync,
        rejoining,
        rv,
        node,
        arbiters: Vec::new(),
        meters: Vec::new(),
    };
    Ok((ctx, watch))
}

/// Publishes this rank's card: its node serves its roles now.
fn publish_card(ctx: &RankCtx) -> Result<()> {
    ctx.rv.put(
        &rank_key(ctx.me),
        &RankCard::ours(ctx.rv.advertised(), ctx.setup.incarnation),
    )
}
