//! The controller's core on a fake clock: `Instant`s the tests advance, no sleeping, no
//! actix.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use refit_runtime::sync_policy::{SyncConfig, SyncMode, SyncOrder};
use refit_runtime::{ModelId, Version};

use super::{Action, Admit, Landed, SyncCore, WaiterId};
use crate::error::{Error, Result};
use crate::protocol::controller::{Admission, ModelStatus, NotifyOutcome, SyncEventKind};

fn id(s: &str) -> ModelId {
    ModelId::new(s).unwrap()
}

fn core(mode: SyncMode, models: &[&str], t0: Instant) -> SyncCore {
    let cfg = SyncConfig {
        sync_mode: mode,
        staleness_threshold: 1,
        ..SyncConfig::default()
    };
    SyncCore::new(&cfg, models.iter().map(|m| id(m)).collect(), false, t0).unwrap()
}

fn actions(core: &mut SyncCore) -> Vec<Action> {
    std::iter::from_fn(|| core.poll_action()).collect()
}

fn status(core: &SyncCore, model: &str) -> ModelStatus {
    core.status().models.remove(&id(model)).unwrap()
}

fn kinds(core: &SyncCore) -> Vec<SyncEventKind> {
    core.status().events.into_iter().map(|e| e.kind).collect()
}

/// The load the core ordered (exactly one action).
fn load_order(core: &mut SyncCore) -> SyncOrder {
    let mut loads = actions(core).into_iter().filter_map(|a| match a {
        Action::Load(o) => Some(o),
        _ => None,
    });
    let order = loads.next().expect("a load");
    assert!(loads.next().is_none());
    order
}

fn admitted(actions: Vec<Action>) -> Vec<(WaiterId, Result<Admission>)> {
    actions
        .into_iter()
        .filter_map(|a| match a {
            Action::Admitted { id, result, .. } => Some((id, result)),
            _ => None,
        })
        .collect()
}

fn notified(actions: &[Action]) -> Vec<(WaiterId, &Result<NotifyOutcome>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Notified(id, r) => Some((*id, r)),
            _ => None,
        })
        .collect()
}

fn landed(v: u64) -> Result<Landed> {
    Ok(Landed {
        served: Version(v),
        ..Landed::default()
    })
}

#[test]
fn sync_mode_blocks_after_a_batch_until_the_new_version_lands() {
    let t0 = Instant::now();
    let mut c = core(SyncMode::Sync, &["policy"], t0);
    let m = id("policy");
    let Admit::Now(first) = c.admit(&m, None, t0).unwrap() else {
        panic!("the first rollout waits")
    };
    assert_eq!(first.waited, Duration::ZERO);
    c.rollout_done(&m);
    // a batch is ready: rollouts wait for the version trained on it
    c.batch_ready(&m, t0);
    let Admit::Wait(w, deadline) = c.admit(&m, None, t0).unwrap() else {
        panic!("admitted before the sync")
    };
    assert_eq!(deadline, t0 + c.config().timeouts.rollout_wait());
    // the trainer finishes v1: one model, so the round releases at once; the load starts
    let t1 = t0 + Duration::from_secs(1);
    let (n, none) = c.notify(&m, Version(1), t1).unwrap();
    assert_eq!(none, None);
    let acts = actions(&mut c);
    assert!(matches!(&acts[..], [Action::Load(o), ..] if o.version == Version(1)));
    let outcomes = notified(&acts);
    assert_eq!(outcomes.len(), 1);
    assert_eq!(outcomes[0].0, n);
    assert!(outcomes[0].1.as_ref().unwrap().leader);
    assert!(
        admitted(acts).is_empty(),
        "let through before the load landed"
    );
    // the load lands two seconds after the rollout blocked: it is let through
    let t2 = t0 + Duration::from_secs(2);
    c.load_finished(
        &SyncOrder {
            model: m.clone(),
            version: Version(1),
        },
        landed(1),
        t2,
    );
    let through = admitted(actions(&mut c));
    assert_eq!(through.len(), 1);
    assert_eq!(through[0].0, w);
    let a = through[0].1.as_ref().unwrap();
    assert_eq!(
        (a.rollout_version, a.waited),
        (Version(1), Duration::from_secs(2))
    );
    let s = status(&c, "policy");
    assert_eq!((s.admissions, s.blocked, s.loads), (2, 1, 1));
    assert_eq!(s.waited, Duration::from_secs(2));
}

#[test]
fn batch_async_blocks_at_the_staleness_threshold() {
    let t0 = Instant::now();
    let mut c = core(SyncMode::BatchAsync, &["policy"], t0);
    let m = id("policy");
    // a batch does not block this mode
    c.batch_ready(&m, t0);
    assert!(matches!(c.admit(&m, None, t0).unwrap(), Admit::Now(_)));
    // v1 trained, v0 served: staleness 1 reaches the threshold
    c.notify(&m, Version(1), t0).unwrap();
    let order = load_order(&mut c);
    let Admit::Wait(w, _) = c.admit(&m, None, t0).unwrap() else {
        panic!("admitted at the staleness threshold")
    };
    let t1 = t0 + Duration::from_millis(300);
    c.load_finished(&order, landed(1), t1);
    let through = admitted(actions(&mut c));
    assert_eq!(through.len(), 1);
    assert_eq!(through[0].0, w);
    let a = through[0].1.as_ref().unwrap();
    assert_eq!((a.staleness, a.waited), (0, Duration::from_millis(300)));
    assert_eq!(status(&c, "policy").max_staleness, 0);
}

#[test]
fn a_blocked_admission_times_out_at_its_deadline() {
    let t0 = Instant::now();
    let mut c = core(SyncMode::Sync, &["policy"], t0);
    let m = id("policy");
    c.batch_ready(&m, t0);
    let Admit::Wait(w, deadline) = c.admit(&m, None, t0).unwrap() else {
        panic!("admitted before the sync")
    };
    c.expire(deadline - Duration::from_millis(1));
    assert!(actions(&mut c).is_empty(), "expired before its deadline");
    c.expire(deadline);
    let failed = admitted(actions(&mut c));
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].0, w);
    let Err(Error::Runtime(refit_runtime::Error::Timeout { what, after })) = &failed[0].1 else {
        panic!("not a timeout: {:?}", failed[0].1)
    };
    assert_eq!(*after, c.config().timeouts.rollout_wait());
    assert!(what.contains("model `policy`"), "{what}");
    // answered once: a later expiry finds nothing
    c.expire(deadline + Duration::from_secs(60));
    assert!(actions(&mut c).is_empty());
    assert_eq!(status(&c, "policy").admissions, 0);
}

#[test]
fn a_failed_load_keeps_the_previous_version_served() {
    let t0 = Instant::now();
    let mut c = core(SyncMode::FullyAsync, &["policy"], t0);
    let m = id("policy");
    c.notify(&m, Version(1), t0).unwrap();
    let order = load_order(&mut c);
    c.load_finished(
        &order,
        Err(Error::Actor("engine 0 did not load".into())),
        t0,
    );
    let s = status(&c, "policy");
    assert_eq!(
        (s.train_version, s.rollout_version),
        (Version(1), Version(0))
    );
    assert_eq!((s.loads, s.failed_loads), (0, 1));
    assert!(s.last_error.unwrap().contains("engine 0 did not load"));
    assert!(kinds(&c).iter().any(
        |k| matches!(k, SyncEventKind::LoadFailed(v, msg) if *v == Version(1) && msg.contains("engine 0"))
    ));
    // a `synced` waiter for v1 times out naming the failure
    let (w, deadline) = c.await_synced(&m, Version(1), t0);
    assert!(actions(&mut c).is_empty());
    c.expire(deadline);
    let acts = actions(&mut c);
    let [Action::Synced(id, Err(e))] = &acts[..] else {
        panic!("{acts:?}")
    };
    assert_eq!(*id, w);
    assert!(e.to_string().contains("last load error"), "{e}");
    // the next version loads and lands
    c.notify(&m, Version(2), t0).unwrap();
    let order = load_order(&mut c);
    c.load_finished(&order, landed(2), t0);
    assert_eq!(status(&c, "policy").rollout_version, Version(2));
}

#[test]
fn damaged_weights_are_reported() {
    let t0 = Instant::now();
    let mut c = core(SyncMode::FullyAsync, &["policy"], t0);
    let m = id("policy");
    c.notify(&m, Version(1), t0).unwrap();
    let order = load_order(&mut c);
    let damage = "engine 1 served weights that changed after it applied them".to_string();
    let landed = Landed {
        served: Version(1),
        damaged: vec![damage.clone()],
        ..Landed::default()
    };
    c.load_finished(&order, Ok(landed), t0 + Duration::from_secs(3));
    let s = status(&c, "policy");
    assert_eq!(s.rollout_version, Version(1));
    assert_eq!((s.loads, s.damaged), (1, 1));
    assert_eq!(s.last_error.as_deref(), Some(damage.as_str()));
    let events = c.status().events;
    let d = events
        .iter()
        .find(|e| matches!(&e.kind, SyncEventKind::Damaged(d) if *d == damage))
        .expect("a Damaged event");
    assert_eq!(d.at, Duration::from_secs(3));
    assert!(matches!(events.last().unwrap().kind, SyncEventKind::Landed(v) if v == Version(1)));
}

#[test]
fn a_fenced_engine_gets_no_rollouts_until_it_is_repaired() {
    let t0 = Instant::now();
    let mut c = core(SyncMode::FullyAsync, &["policy"], t0);
    let m = id("policy");
    c.notify(&m, Version(1), t0).unwrap();
    let order = load_order(&mut c);
    // v1 committed on engine 0; engine 1 could not stage it
    let landed = Landed {
        served: Version(1),
        committed: vec![0],
        fenced: vec![(1, "fetch timed out".into())],
        ..Landed::default()
    };
    c.load_finished(&order, Ok(landed), t0);
    let acts = actions(&mut c);
    let [
        Action::Repair {
            version, engines, ..
        },
    ] = &acts[..]
    else {
        panic!("{acts:?}")
    };
    assert_eq!((*version, engines.as_slice()), (Version(1), &[1][..]));
    assert_eq!(status(&c, "policy").fenced, vec![1]);
    // engine 0's rollouts go on, engine 1's wait; an engine-blind caller is let through
    assert!(matches!(c.admit(&m, Some(0), t0).unwrap(), Admit::Now(_)));
    assert!(matches!(c.admit(&m, None, t0).unwrap(), Admit::Now(_)));
    let Admit::Wait(w, _) = c.admit(&m, Some(1), t0).unwrap() else {
        panic!("a fenced engine's rollout was admitted")
    };
    assert!(kinds(&c).iter().any(|k| matches!(
        k,
        SyncEventKind::Blocked(refit_runtime::sync_policy::BlockReason::Fenced)
    )));
    // a repair that brings another version leaves it fenced
    c.repaired(&m, 1, Ok(Version(2)), t0);
    assert!(actions(&mut c).is_empty());
    // the fleet's version brings it back, and its waiting rollout through
    let back = t0 + Duration::from_millis(700);
    c.repaired(&m, 1, Ok(Version(1)), back);
    let admits = admitted(actions(&mut c));
    assert!(
        matches!(&admits[..], [(id, Ok(_))] if *id == w),
        "{admits:?}"
    );
    let s = status(&c, "policy");
    assert!(s.fenced.is_empty());
    assert_eq!((s.fences, s.fenced_for), (1, Duration::from_millis(700)));
    assert!(kinds(&c).iter().any(|k| matches!(
        k,
        SyncEventKind::Unfenced { engine: 1, after } if *after == Duration::from_millis(700)
    )));
    // fenced again at v2, then it commits v3 with the fleet: unfenced by the commit
    c.notify(&m, Version(2), t0).unwrap();
    let order = load_order(&mut c);
    let landed = Landed {
        served: Version(2),
        committed: vec![0],
        fenced: vec![(1, "commit of v2 failed".into())],
        ..Landed::default()
    };
    c.load_finished(&order, Ok(landed), back);
    actions(&mut c);
    c.notify(&m, Version(3), back).unwrap();
    let order = load_order(&mut c);
    let landed = Landed {
        served: Version(3),
        committed: vec![0, 1],
        ..Landed::default()
    };
    c.load_finished(&order, Ok(landed), back + Duration::from_secs(1));
    let s = status(&c, "policy");
    assert!(s.fenced.is_empty());
    assert_eq!(s.fences, 2);
}

#[test]
fn the_barrier_waits_for_every_model_until_its_deadline() {
    let t0 = Instant::now();
    let mut c = core(SyncMode::FullyAsync, &["a", "b"], t0);
    let (wa, deadline) = c.notify(&id("a"), Version(1), t0).unwrap();
    let deadline = deadline.expect("a waits for b");
    assert_eq!(deadline, t0 + c.config().timeouts.barrier());
    assert!(notified(&actions(&mut c)).is_empty());
    c.expire(deadline);
    let acts = actions(&mut c);
    let [(w, Err(e))] = &notified(&acts)[..] else {
        panic!("{acts:?}")
    };
    assert_eq!(*w, wa);
    // named after the withdrawal, as the round now stands
    assert!(e.to_string().contains("still missing: a, b"), "{e}");
    // both arrive at v2: released at once, `b` leads
    let (wa, _) = c.notify(&id("a"), Version(2), t0).unwrap();
    let (wb, none) = c.notify(&id("b"), Version(2), t0).unwrap();
    assert_eq!(none, None);
    let acts = actions(&mut c);
    let mut outcomes: Vec<_> = notified(&acts)
        .into_iter()
        .map(|(w, r)| (w, r.as_ref().unwrap().leader))
        .collect();
    outcomes.sort();
    assert_eq!(outcomes, vec![(wa, false), (wb, true)]);
}

#[test]
fn drains_answer_when_the_last_rollout_finishes() {
    let t0 = Instant::now();
    let mut c = core(SyncMode::FullyAsync, &["policy"], t0);
    let m = id("policy");
    assert!(c.await_drained(&m, t0).is_none());
    c.admit(&m, None, t0).unwrap();
    c.admit(&m, None, t0).unwrap();
    let (w, _) = c.await_drained(&m, t0).unwrap();
    c.rollout_done(&m);
    assert!(actions(&mut c).is_empty());
    c.rollout_done(&m);
    let acts = actions(&mut c);
    assert!(matches!(&acts[..], [Action::Drained(id, Ok(()))] if *id == w));
}

/// A resumed run's counts go on from the ones its checkpoint carried: later admissions and
/// loads add to them, the largest staleness and the eval steps are kept, and another
/// model's counts are untouched.
#[test]
fn carried_counts_are_the_base_later_counts_add_to() {
    let t0 = Instant::now();
    let mut c = core(SyncMode::FullyAsync, &["policy", "critic"], t0);
    let m = id("policy");
    let mut carried = status(&c, "policy");
    carried.admissions = 40;
    carried.blocked = 3;
    carried.waited = Duration::from_secs(5);
    carried.max_staleness = 2;
    carried.loads = 12;
    carried.fences = 1;
    c.carry(&m, &carried, 4);
    let Admit::Now(_) = c.admit(&m, None, t0).unwrap() else {
        panic!("a fully-async rollout waits")
    };
    c.load_finished(
        &SyncOrder {
            model: m.clone(),
            version: Version(1),
        },
        landed(1),
        t0,
    );
    let s = status(&c, "policy");
    assert_eq!((s.admissions, s.blocked, s.loads, s.fences), (41, 3, 13, 1));
    assert_eq!((s.waited, s.max_staleness), (Duration::from_secs(5), 2));
    assert_eq!(c.status().evals, 4);
    let other = status(&c, "critic");
    assert_eq!((other.admissions, other.loads), (0, 0));
    // what a checkpoint asks for: the same counts, without the timeline
    let (counts, full) = (c.counts(), c.status());
    assert!(counts.events.is_empty() && !full.events.is_empty());
    assert_eq!((counts.models, counts.evals), (full.models, full.evals));
}
