//! The weight-sync controller with real actors and real weight transfer (the in-process
//! scheme, or the in-process scheme behind a slow link): every sync mode, validation
//! cadence, and the two-model version barrier with its leader's eval sequence.
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Actor;
use refit_actors::ModelSpec;
use refit_actors::actor::{
    ActBatch, EngineRef, Evaluator, GetStatus, InferenceEngine, RunEval, ServedVersions,
    SyncEventKind, UpdateModel, VersionNotifier, WeightSyncController,
};
use refit_actors::run::{self as topology, InletWrapper, RunConfig, RunReport, StopRule};
use refit_actors::{CartPole, CartPolePpo, MlpPolicy, WeightInlet, policy_model_id};
use refit_runtime::sync_policy::{LeaderStep, SyncConfig, SyncMode, leader_sequence};
use refit_runtime::{Manifests, ModelId, ReceiverInit, Sender, SenderInit, Version, WeightSet};
use refit_transports::inproc::{InProc, InProcReceiver, InProcSender};

const SIZES: [usize; 3] = [4, 16, 2];

fn id(s: &str) -> ModelId {
    ModelId::new(s).unwrap()
}

/// A link that takes `delay` before each fetch: the bytes still cross the real scheme.
struct SlowLink {
    inner: Box<dyn WeightInlet>,
    delay: Duration,
}

impl WeightInlet for SlowLink {
    fn fetch(
        &mut self,
        model: &ModelId,
        at_least: Version,
        timeout: Duration,
    ) -> refit_runtime::Result<Arc<WeightSet>> {
        std::thread::sleep(self.delay);
        self.inner.fetch(model, at_least, timeout)
    }
    fn applied(&mut self, model: &ModelId, version: Version) -> refit_runtime::Result<()> {
        self.inner.applied(model, version)
    }
}

fn slow(delay: Duration) -> InletWrapper {
    Arc::new(move |inner| Box::new(SlowLink { inner, delay }) as Box<dyn WeightInlet>)
}

fn spec(name: &str, seed: u64) -> ModelSpec {
    let mut s = ModelSpec::new(id(name), seed)
        .with_param("hidden", vec![32])
        .with_param("epochs", 2)
        .with_param("minibatch", 128);
    s.workers = 2;
    s.envs_per_worker = 2;
    s.fragment_steps = 16;
    s.batch_frames = 256;
    s
}

fn run_config(mode: SyncMode, models: Vec<ModelSpec>, updates: u64) -> RunConfig {
    let mut sync = SyncConfig::with_mode(mode);
    sync.staleness_threshold = 2;
    sync.timeouts.rollout_wait_s = 60.0;
    RunConfig {
        sync,
        models,
        eval_episodes: 2,
        stop: StopRule {
            target_eval: None,
            max_updates: updates,
            target_return: None,
            max_time: Duration::from_secs(120),
        },
        seed: 3,
        wrap_inlet: None,
        wait: Duration::from_secs(60),
    }
}

async fn run(cfg: RunConfig) -> RunReport {
    topology::run(cfg, CartPolePpo::new()).await.unwrap()
}

/// The last `Landed` version of `model` before event `seq`.
fn landed_before(report: &RunReport, model: &ModelId, seq: u64) -> Version {
    report
        .controller
        .events
        .iter()
        .filter(|e| e.seq < seq && e.model.as_ref() == Some(model))
        .filter_map(|e| match e.kind {
            SyncEventKind::Landed(v) => Some(v),
            _ => None,
        })
        .max()
        .unwrap_or(Version::ZERO)
}

#[actix_rt::test]
async fn sync_mode_no_rollout_uses_an_old_version_after_the_sync_point() {
    let m = id("policy");
    let report = run(run_config(SyncMode::Sync, vec![spec("policy", 1)], 8)).await;
    let r = &report.models[&m];
    assert_eq!(r.updates.len(), 8);
    let mut fragments = 0;
    for u in &r.updates {
        // every sample was produced by the version that trains on it
        assert_eq!(
            u.sample_versions,
            (u.train_version, u.train_version),
            "{u:?}"
        );
        for f in &u.fragments {
            let landed = landed_before(&report, &m, f.admission.seq);
            assert!(
                f.versions.0 >= landed,
                "fragment admitted after v{landed} landed acted with v{:?}",
                f.versions
            );
            assert_eq!(f.admission.staleness, 0, "{f:?}");
            fragments += 1;
        }
    }
    assert!(fragments >= 8 * 8, "{fragments} fragments");
    assert_eq!(
        r.staleness.dropped, 0,
        "drained batches drop nothing: {:?}",
        r.staleness
    );
    let status = &report.controller.models[&m];
    assert!(
        status.blocked > 0,
        "sync mode blocks rollouts between batch and load: {status:?}"
    );
    assert_eq!(status.rollout_version, Version(9));
}

#[actix_rt::test]
async fn batch_async_staleness_never_exceeds_the_threshold() {
    let m = id("policy");
    let mut cfg = run_config(SyncMode::BatchAsync, vec![spec("policy", 2)], 8);
    // a slow link lets the trainer outrun the loads, so the threshold has to bite
    cfg.wrap_inlet = Some(slow(Duration::from_millis(250)));
    let report = run(cfg).await;
    let r = &report.models[&m];
    let threshold = 2;
    for u in &r.updates {
        assert!(u.max_staleness <= threshold, "{u:?}");
        for f in &u.fragments {
            assert!(f.admission.staleness < threshold, "{f:?}");
        }
    }
    let status = &report.controller.models[&m];
    assert!(status.max_staleness < threshold, "{status:?}");
    assert!(
        status.blocked > 0,
        "the threshold never blocked: {status:?}"
    );
    let blocked_by_staleness = report.controller.events.iter().any(|e| {
        matches!(
            e.kind,
            SyncEventKind::Blocked(refit_runtime::sync_policy::BlockReason::Staleness { .. })
        )
    });
    assert!(blocked_by_staleness);
}

#[actix_rt::test]
async fn fully_async_rollouts_never_block() {
    let m = id("policy");
    let mut cfg = run_config(SyncMode::FullyAsync, vec![spec("policy", 3)], 10);
    cfg.wrap_inlet = Some(slow(Duration::from_millis(60)));
    let report = run(cfg).await;
    let status = &report.controller.models[&m];
    assert!(status.admissions > 20, "{status:?}");
    assert_eq!(status.blocked, 0, "{status:?}");
    assert_eq!(status.waited, Duration::ZERO);
    assert!(
        report
            .controller
            .events
            .iter()
            .all(|e| !matches!(e.kind, SyncEventKind::Blocked(_)))
    );
    // rollouts went on while the engine was behind the trainer
    assert!(status.max_staleness >= 1, "{status:?}");
    let r = &report.models[&m];
    assert_eq!(r.staleness.dropped, 0);
    assert!(
        r.workers
            .iter()
            .all(|w| w.blocked.is_zero() && w.error.is_none()),
        "{:?}",
        r.workers
    );
}

#[actix_rt::test]
async fn two_models_run_many_eval_steps_and_every_eval_sees_both_at_the_round_version() {
    let (solver, verifier) = (id("solver"), id("verifier"));
    let mut cfg = run_config(
        SyncMode::FullyAsync,
        vec![spec("verifier", 5), spec("solver", 4)],
        12,
    );
    cfg.sync.validate_freq = 3;
    // different link speeds make the two models' non-eval loads overlap and interleave
    cfg.wrap_inlet = Some(slow(Duration::from_millis(15)));
    let report = run(cfg).await;
    let evals = &report.models[&solver].evals;
    // versions 3, 6, 9, 12 are eval steps (the initial version is 1, 12 updates end at 13)
    let steps: Vec<Version> = evals.iter().map(|e| e.step).collect();
    assert_eq!(steps, vec![Version(3), Version(6), Version(9), Version(12)]);
    assert_eq!(report.controller.evals, 4);
    for e in evals {
        for m in [&solver, &verifier] {
            assert_eq!(
                e.models[m].versions.iter().copied().collect::<Vec<_>>(),
                vec![e.step],
                "{e:?}"
            );
            assert!(e.models[m].episodes > 0);
        }
    }
    assert_eq!(
        &report.models[&verifier].evals, evals,
        "both trainers get the same eval"
    );
    // the leader's sequence, in order, for every eval round
    let expected = leader_sequence([&solver, &verifier], true);
    let ev = &report.controller.events;
    let mut rounds = 0;
    for (i, e) in ev.iter().enumerate() {
        let SyncEventKind::Leader {
            version,
            eval: true,
        } = e.kind
        else {
            continue;
        };
        rounds += 1;
        let steps: Vec<LeaderStep> = ev[i..]
            .iter()
            .take_while(|x| x.kind != SyncEventKind::Released(version))
            .filter_map(|x| match &x.kind {
                SyncEventKind::Step(s) => Some(s.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(steps, expected, "round v{version}");
        // each model landed at the round's version before validation started
        let eval_at = ev[i..]
            .iter()
            .position(|x| x.kind == SyncEventKind::Step(LeaderStep::Eval))
            .unwrap()
            + i;
        for m in [&solver, &verifier] {
            assert!(landed_before(&report, m, ev[eval_at].seq) >= version);
        }
    }
    assert_eq!(rounds, 4);
    for m in [&solver, &verifier] {
        let s = &report.controller.models[m];
        assert_eq!(
            (s.train_version, s.rollout_version),
            (Version(13), Version(13)),
            "{s:?}"
        );
        assert_eq!(s.failed_loads, 0);
    }
}

/// One in-process scheme per model: (sender, receiver for the engine).
fn scheme(
    model: &ModelId,
) -> (
    Sender<InProcSender>,
    refit_runtime::Receiver<InProcReceiver>,
) {
    let manifest = Arc::new(MlpPolicy::manifest_for(&SIZES).unwrap());
    let manifests = Manifests::new([(model.clone(), manifest.clone())]).unwrap();
    let hub = InProc::new();
    let receiver = ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
    let r = std::thread::spawn(move || receiver.connect(Duration::from_secs(5)).unwrap());
    let sender = SenderInit::new(hub.sender().unwrap(), manifests)
        .connect(vec![weights(model, 1, 0.0)], Duration::from_secs(5))
        .unwrap();
    (sender, r.join().unwrap())
}

/// An engine serving one `SIZES` policy per model, each fed through its inlet.
fn engine_with(
    inlets: Vec<(ModelId, Box<dyn WeightInlet>)>,
) -> actix::Addr<InferenceEngine<MlpPolicy>> {
    inlets
        .into_iter()
        .fold(InferenceEngine::empty(1), |e, (m, inlet)| {
            e.with_model(m, MlpPolicy::new(&SIZES).unwrap(), Some(inlet))
                .unwrap()
        })
        .start()
}

fn weights(model: &ModelId, version: u64, fill: f32) -> WeightSet {
    let m = Arc::new(MlpPolicy::manifest_for(&SIZES).unwrap());
    refit_runtime::testing::filled(model, &m, version, fill)
}

#[actix_rt::test]
async fn the_pause_covers_only_the_apply_and_models_load_independently() {
    let (a, b) = (id("solver"), id("verifier"));
    let (mut sa, ra) = scheme(&a);
    let (_sb, rb) = scheme(&b);
    let engine = engine_with(vec![
        (
            a.clone(),
            Box::new(SlowLink {
                inner: Box::new(ra),
                delay: Duration::from_millis(150),
            }) as Box<dyn WeightInlet>,
        ),
        (b.clone(), Box::new(rb) as Box<dyn WeightInlet>),
    ]);
    mock_publish(&mut sa, &a, 2).unwrap();
    let load = |v| {
        engine.send(UpdateModel {
            model: a.clone(),
            version: Version(v),
            timeout: Duration::from_secs(5),
        })
    };
    let first = load(2);
    // while solver's bytes are being staged, verifier keeps answering
    let t = Instant::now();
    let acted = engine
        .send(ActBatch {
            model: b.clone(),
            obs: vec![0.0; 8],
            epoch: None,
            greedy: false,
        })
        .await
        .unwrap()
        .unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(acted.actions.len(), 2);
    let report = first.await.unwrap().unwrap();
    assert_eq!(report.version, Version(2));
    assert!(report.staged >= Duration::from_millis(150), "{report:?}");
    // the pause is the apply (on a blocking thread), not the 150 ms of staging
    assert!(report.paused < Duration::from_millis(150), "{report:?}");
    // same-model loads are serialised: the second waits for the first's lock
    let (p3, p4) = (load(3), load(4));
    let _ = mock_publish(&mut sa, &a, 4);
    let (r3, r4) = (p3.await.unwrap().unwrap(), p4.await.unwrap().unwrap());
    assert_eq!((r3.version, r4.version), (Version(4), Version(4)));
    assert!(r4.staged >= Duration::from_millis(300), "{r4:?}");
    let served = engine.send(ServedVersions).await.unwrap();
    assert_eq!(served[&a], Version(4));
    assert_eq!(served[&b], Version::ZERO);
}

/// The acting engine's stage and commit: a staged version is not served (requests answer
/// with the old one) until its commit; aborted or held past its deadline, it is dropped and
/// the model's lock given back (the next load goes through).
#[actix_rt::test]
async fn an_acting_engine_serves_a_staged_version_only_once_committed() {
    use refit_actors::actor::{AbortStage, CommitModel, StageModel};
    let m = id("policy");
    let (mut s, r) = scheme(&m);
    let engine = engine_with(vec![(m.clone(), Box::new(r) as Box<dyn WeightInlet>)]);
    let stage = |v, hold| StageModel {
        model: m.clone(),
        version: Version(v),
        timeout: Duration::from_secs(5),
        hold,
    };
    let commit = |v| CommitModel {
        model: m.clone(),
        version: Version(v),
        timeout: Duration::from_secs(5),
    };
    let act = || ActBatch {
        model: m.clone(),
        obs: vec![0.0; SIZES[0]],
        epoch: None,
        greedy: true,
    };
    let long = Duration::from_secs(30);
    let staged = engine.send(stage(1, long)).await.unwrap().unwrap();
    assert_eq!((staged.version, staged.fresh), (Version(1), true));
    assert_eq!(
        engine.send(act()).await.unwrap().unwrap().version,
        Version(0)
    );
    let loaded = engine.send(commit(1)).await.unwrap().unwrap();
    assert_eq!(loaded.version, Version(1));
    assert_eq!(
        engine.send(act()).await.unwrap().unwrap().version,
        Version(1)
    );
    // aborted
    mock_publish(&mut s, &m, 2).unwrap();
    engine.send(stage(2, long)).await.unwrap().unwrap();
    engine.send(AbortStage { model: m.clone() }).await.unwrap();
    let e = engine
        .send(commit(2))
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("nothing is staged") && e.contains("v1 is served"),
        "{e}"
    );
    // held past its deadline
    engine
        .send(stage(2, Duration::from_millis(50)))
        .await
        .unwrap()
        .unwrap();
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    assert!(engine.send(commit(2)).await.unwrap().is_err());
    // the lock is free: a load goes through
    let loaded = engine
        .send(UpdateModel {
            model: m.clone(),
            version: Version(2),
            timeout: Duration::from_secs(5),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(loaded.version, Version(2));
    // nothing newer: the stage says what is served, and holds nothing
    let staged = engine.send(stage(2, long)).await.unwrap().unwrap();
    assert_eq!((staged.version, staged.fresh), (Version(2), false));
}

/// Tells the controller `model`'s trainer finished `v` and waits until it serves everywhere
/// (or the load failed: the error).
async fn land(
    ctl: &actix::Addr<WeightSyncController>,
    n: &mut VersionNotifier,
    model: &ModelId,
    v: u64,
) -> refit_actors::Result<Version> {
    use refit_actors::actor::AwaitSynced;
    n.notify(Version(v)).await?;
    n.flush().await?;
    ctl.send(AwaitSynced {
        model: model.clone(),
        version: Version(v),
    })
    .await
    .unwrap()
}

fn mock_publish(s: &mut Sender<InProcSender>, m: &ModelId, v: u64) -> refit_runtime::Result<()> {
    s.send_async(vec![weights(m, v, v as f32 / 100.0)])
        .map(|_| ())
}

#[actix_rt::test]
async fn an_eval_that_sees_a_model_at_an_older_version_is_refused() {
    // The check the leader applies after its loads: if a model were left behind (the
    // sequence broken), validation would see it at an older version and the round fails.
    let (a, b) = (id("solver"), id("verifier"));
    let (mut sa, ra) = scheme(&a);
    let (_sb, rb) = scheme(&b);
    let engine = engine_with(vec![
        (a.clone(), Box::new(ra) as Box<dyn WeightInlet>),
        (b.clone(), Box::new(rb) as Box<dyn WeightInlet>),
    ]);
    for (m, v) in [(&a, 1), (&b, 1)] {
        engine
            .send(UpdateModel {
                model: m.clone(),
                version: Version(v),
                timeout: Duration::from_secs(5),
            })
            .await
            .unwrap()
            .unwrap();
    }
    mock_publish(&mut sa, &a, 2).unwrap();
    engine
        .send(UpdateModel {
            model: a.clone(),
            version: Version(2),
            timeout: Duration::from_secs(5),
        })
        .await
        .unwrap()
        .unwrap();
    let evaluator = Evaluator::new(
        engine.clone().recipient(),
        vec![a.clone(), b.clone()],
        |_: &ModelId, i| Ok(CartPole::new(i as u64)),
        2,
        50,
        0,
    )
    .start();
    let report = evaluator
        .send(RunEval { step: Version(2) })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.models[&a].versions.len(), 1);
    let err = report.check_versions(Version(2)).unwrap_err().to_string();
    assert!(err.contains("`verifier` at v1"), "{err}");
}

#[actix_rt::test]
async fn an_eval_step_whose_load_fails_fails_the_round_and_resumes_acquisition() {
    let (a, b) = (id("solver"), id("verifier"));
    let (mut sa, ra) = scheme(&a);
    let (mut sb, rb) = scheme(&b);
    let engine = engine_with(vec![
        (a.clone(), Box::new(ra) as Box<dyn WeightInlet>),
        (b.clone(), Box::new(rb) as Box<dyn WeightInlet>),
    ]);
    let evaluator = Evaluator::new(
        engine.clone().recipient(),
        vec![a.clone(), b.clone()],
        |_: &ModelId, i| Ok(CartPole::new(i as u64)),
        1,
        20,
        0,
    )
    .start();
    let mut cfg = SyncConfig::with_mode(SyncMode::FullyAsync);
    cfg.validate_freq = 2;
    cfg.timeouts.load_s = 0.5;
    let ctl = WeightSyncController::new(
        &cfg,
        vec![a.clone(), b.clone()],
        vec![EngineRef::local(&engine)],
        Some(evaluator.recipient()),
    )
    .unwrap()
    .start();
    let mut na = VersionNotifier::new(ctl.clone(), a.clone(), cfg.clone());
    let mut nb = VersionNotifier::new(ctl.clone(), b.clone(), cfg.clone());
    na.notify(Version(1)).await.unwrap();
    nb.notify(Version(1)).await.unwrap();
    na.flush().await.unwrap();
    nb.flush().await.unwrap();
    // solver publishes v2; verifier's trainer says v2 but never publishes it
    mock_publish(&mut sa, &a, 2).unwrap();
    let _ = &mut sb;
    let (ra, rb) = tokio::join!(na.notify(Version(2)), nb.notify(Version(2)));
    for r in [ra, rb] {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("verifier") && e.contains("failed"), "{e}");
    }
    let status = ctl.send(GetStatus).await.unwrap();
    assert!(
        !status.acquisition_paused,
        "a failed eval step must not leave rollouts paused"
    );
    assert_eq!(
        status.models[&b].rollout_version,
        Version(1),
        "the previous version stays served"
    );
    assert_eq!(status.models[&a].rollout_version, Version(2));
    assert_eq!(status.evals, 0);
}

#[actix_rt::test]
async fn without_an_evaluator_rollouts_stay_paused_until_end_validate() {
    use refit_actors::actor::{CheckRollout, EndValidate};
    use refit_runtime::sync_policy::{BlockReason, Decision};
    let m = id("policy");
    let (mut s, r) = scheme(&m);
    let engine = engine_with(vec![(m.clone(), Box::new(r) as Box<dyn WeightInlet>)]);
    let mut cfg = SyncConfig::with_mode(SyncMode::FullyAsync);
    cfg.validate_freq = 2;
    let ctl =
        WeightSyncController::new(&cfg, vec![m.clone()], vec![EngineRef::local(&engine)], None)
            .unwrap()
            .start();
    let mut n = VersionNotifier::new(ctl.clone(), m.clone(), cfg.clone());
    n.notify(Version(1)).await.unwrap();
    n.flush().await.unwrap();
    // the round is released before the load lands (fully-async); wait for the sync point
    let landed = ctl
        .send(refit_actors::actor::AwaitSynced {
            model: m.clone(),
            version: Version(1),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(landed, Version(1));
    let check = || ctl.send(CheckRollout { model: m.clone() });
    assert_eq!(
        check().await.unwrap().unwrap(),
        Decision::Continue { staleness: 0 }
    );
    mock_publish(&mut s, &m, 2).unwrap();
    // an eval step: the leader loads v2, finds no evaluator, and leaves acquisition paused
    let outcome = n.notify(Version(2)).await.unwrap().unwrap();
    assert_eq!(outcome.version, Version(2));
    assert!(outcome.eval.is_none());
    assert_eq!(engine.send(ServedVersions).await.unwrap()[&m], Version(2));
    assert_eq!(
        check().await.unwrap().unwrap(),
        Decision::Block(BlockReason::Validation)
    );
    ctl.send(EndValidate).await.unwrap();
    assert_eq!(
        check().await.unwrap().unwrap(),
        Decision::Continue { staleness: 0 }
    );
    // a stale notification is refused, naming the versions
    let e = n.notify(Version(2)).await.unwrap_err().to_string();
    assert!(e.contains("version 2 refused"), "{e}");
}

#[actix_rt::test]
async fn a_policy_error_with_no_caller_lands_in_the_status_not_only_the_log() {
    use refit_actors::actor::BatchReady;
    let m = id("policy");
    let (_s, r) = scheme(&m);
    let engine = engine_with(vec![(m.clone(), Box::new(r) as Box<dyn WeightInlet>)]);
    let cfg = SyncConfig::with_mode(SyncMode::BatchAsync);
    let ctl =
        WeightSyncController::new(&cfg, vec![m.clone()], vec![EngineRef::local(&engine)], None)
            .unwrap()
            .start();
    // a batch for a model the controller does not run: nobody awaits the answer
    ctl.send(BatchReady { model: id("ghost") }).await.unwrap();
    let status = ctl.send(GetStatus).await.unwrap();
    let errors: Vec<&String> = status
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            SyncEventKind::PolicyError(msg) => Some(msg),
            _ => None,
        })
        .collect();
    assert_eq!(errors.len(), 1, "{:?}", status.events);
    assert!(errors[0].contains("ghost"), "{}", errors[0]);
}

#[actix_rt::test]
async fn the_staleness_filter_drops_old_samples_in_a_run_and_counts_them() {
    let m = id("policy");
    let mut cfg = run_config(SyncMode::FullyAsync, vec![spec("policy", 4)], 8);
    // rollouts never wait, the engine lags the trainer by a slow link, and the filter keeps
    // only samples of the trainer's own version: whatever acted with an older one is dropped
    cfg.sync.max_staleness = Some(0);
    cfg.wrap_inlet = Some(slow(Duration::from_millis(150)));
    let report = run(cfg).await;
    let r = &report.models[&m];
    assert_eq!(r.updates.len(), 8);
    let dropped: u64 = r.updates.iter().map(|u| u.dropped).sum();
    assert!(dropped > 0, "nothing was dropped: {:?}", r.staleness);
    // every drop is counted once, by the batch that was gathered while it happened
    assert_eq!(dropped, r.staleness.dropped, "{:?}", r.staleness);
    for u in &r.updates {
        assert_eq!(u.max_staleness, 0, "{u:?}");
        assert_eq!(
            u.sample_versions,
            (u.train_version, u.train_version),
            "{u:?}"
        );
    }
    assert_eq!(report.controller.models[&m].blocked, 0);
}

#[actix_rt::test]
async fn under_async_notify_the_trainer_runs_one_version_ahead_of_the_engine() {
    let m = id("policy");
    let mut cfg = run_config(SyncMode::BatchAsync, vec![spec("policy", 5)], 8);
    // a load takes 250 ms: a trainer that waited for its version to land would never
    // finish the next one first
    cfg.wrap_inlet = Some(slow(Duration::from_millis(250)));
    let report = run(cfg).await;
    // when the trainer finished v + 1 it had trained on v; the engine served what had
    // landed by then
    let ahead: Vec<(Version, Version)> = report
        .controller
        .events
        .iter()
        .filter(|e| e.model.as_ref() == Some(&m))
        .filter_map(|e| match e.kind {
            SyncEventKind::TrainerFinished(v) if v.0 > 2 => {
                Some((Version(v.0 - 1), landed_before(&report, &m, e.seq)))
            }
            _ => None,
        })
        .filter(|(trained_on, served)| trained_on.0 == served.0 + 1)
        .collect();
    assert!(
        !ahead.is_empty(),
        "the trainer never trained while its previous version was still loading"
    );
    // the controller saw it too: rollouts admitted with the engine one version behind
    let status = &report.controller.models[&m];
    assert_eq!(status.max_staleness, 1, "{status:?}");
    let r = &report.models[&m];
    assert!(
        r.updates
            .iter()
            .flat_map(|u| &u.fragments)
            .any(|f| f.admission.train_version.0 == f.admission.rollout_version.0 + 1),
        "no fragment admitted while the trainer led by one"
    );
}

/// A whole run whose engines verify what they serve (`verify = "hashes"`): every load
/// checks the apply and the weights served before it, and finds nothing to report.
#[actix_rt::test]
async fn a_run_that_verifies_what_it_serves_reports_no_damage() {
    let m = id("policy");
    let mut model = spec("policy", 1);
    model.verify = refit_runtime::topology::Verify::Hashes;
    let report = run(run_config(SyncMode::Sync, vec![model], 4)).await;
    let status = &report.controller.models[&m];
    assert!(status.loads >= 4, "{status:?}");
    assert_eq!((status.damaged, status.failed_loads), (0, 0), "{status:?}");
}

/// An MLP whose served weights a test can damage: the first request after `damage` is set
/// flips one bit of its last tensor, in the policy itself (as a stray write would).
struct Damageable {
    inner: MlpPolicy,
    damage: Arc<std::sync::atomic::AtomicBool>,
}

impl refit_runtime::HasWeights for Damageable {
    fn weight_manifest(&self) -> refit_runtime::Result<refit_runtime::Manifest> {
        self.inner.weight_manifest()
    }
    fn write_weights(&self, out: &mut WeightSet) -> refit_runtime::Result<()> {
        self.inner.write_weights(out)
    }
    fn read_weights(&mut self, weights: &WeightSet) -> refit_runtime::Result<()> {
        self.inner.read_weights(weights)
    }
}

impl refit_actors::Policy for Damageable {
    fn act(&mut self, obs: &[f32], rng: &mut rand::rngs::SmallRng) -> refit_actors::ActionOut {
        use refit_runtime::HasWeights;
        if self.damage.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let manifest = Arc::new(self.inner.weight_manifest().unwrap());
            let last = manifest.tensors().last().unwrap().name.clone();
            let mut ws = WeightSet::zeroed(policy_model_id(), manifest);
            self.inner.write_weights(&mut ws).unwrap();
            let v = &mut ws.view_mut::<f32>(&last).unwrap()[0];
            *v = f32::from_bits(v.to_bits() ^ 1);
            self.inner.read_weights(&ws).unwrap();
        }
        self.inner.act(obs, rng)
    }
    fn obs_dim(&self) -> usize {
        self.inner.obs_dim()
    }
    fn num_actions(&self) -> usize {
        self.inner.num_actions()
    }
}

/// `verify = "hashes"`: one bit of an engine's served weights flipped after the apply of v1
/// is reported by the load of v2, naming the engine, the model, the version and the tensor;
/// v2 replaces the weights whole (v3 finds nothing). Without verification the same flip
/// goes unseen (what makes the test able to fail).
#[actix_rt::test]
async fn a_bit_flipped_in_served_weights_is_reported_by_the_next_update() {
    for verify in [true, false] {
        let m = id("policy");
        let (mut s, r) = scheme(&m);
        let damage = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let policy = Damageable {
            inner: MlpPolicy::new(&SIZES).unwrap(),
            damage: Arc::clone(&damage),
        };
        let mut engine = InferenceEngine::empty(1)
            .with_model(m.clone(), policy, Some(Box::new(r) as Box<dyn WeightInlet>))
            .unwrap();
        if verify {
            engine = engine
                .verify_served(&m, refit_runtime::topology::Verify::Hashes)
                .unwrap();
        }
        let engine = engine.start();
        let cfg = SyncConfig::with_mode(SyncMode::FullyAsync);
        let ctl =
            WeightSyncController::new(&cfg, vec![m.clone()], vec![EngineRef::local(&engine)], None)
                .unwrap()
                .start();
        let mut n = VersionNotifier::new(ctl.clone(), m.clone(), cfg.clone());
        land(&ctl, &mut n, &m, 1).await.unwrap();
        // a stray write into the served weights, then a request served by them
        damage.store(true, std::sync::atomic::Ordering::SeqCst);
        let obs = vec![0.0; SIZES[0]];
        let acted = engine
            .send(ActBatch {
                model: m.clone(),
                obs: obs.clone(),
                epoch: None,
                greedy: true,
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(acted.version, Version(1));
        assert!(!damage.load(std::sync::atomic::Ordering::SeqCst));
        for v in [2, 3] {
            mock_publish(&mut s, &m, v).unwrap();
            land(&ctl, &mut n, &m, v).await.unwrap();
        }
        let status = ctl.send(GetStatus).await.unwrap();
        let model = &status.models[&m];
        assert_eq!(model.rollout_version, Version(3), "verify={verify}");
        let damaged: Vec<&String> = status
            .events
            .iter()
            .filter_map(|e| match &e.kind {
                SyncEventKind::Damaged(d) => Some(d),
                _ => None,
            })
            .collect();
        if verify {
            assert_eq!(model.damaged, 1, "{damaged:?}");
            let last = MlpPolicy::bias_name(SIZES.len() - 2);
            let d = damaged[0];
            assert!(
                d.contains("engine 0")
                    && d.contains("model `policy` v1")
                    && d.contains(&format!("tensor `{last}`"))
                    && d.contains("v2 replaced them whole"),
                "{d}"
            );
            assert_eq!(model.last_error.as_deref(), Some(d.as_str()));
        } else {
            assert_eq!(model.damaged, 0);
            assert!(damaged.is_empty(), "{damaged:?}");
        }
    }
}

/// A link that fails its next `fails` fetches (an engine that cannot take a version).
struct FailingLink {
    inner: Box<dyn WeightInlet>,
    fails: Arc<std::sync::atomic::AtomicU32>,
}

impl WeightInlet for FailingLink {
    fn fetch(
        &mut self,
        model: &ModelId,
        at_least: Version,
        timeout: Duration,
    ) -> refit_runtime::Result<Arc<WeightSet>> {
        use std::sync::atomic::Ordering;
        if self
            .fails
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(refit_runtime::Error::Wire(format!(
                "injected: v{at_least} cannot be fetched"
            )));
        }
        self.inner.fetch(model, at_least, timeout)
    }
    fn applied(&mut self, model: &ModelId, version: Version) -> refit_runtime::Result<()> {
        self.inner.applied(model, version)
    }
}

/// Two engines fed by one sender; engine 1's link fails as many fetches as `fails` says.
/// Answers the sender, the engines, and a controller committing by `rule`.
fn two_engine_fleet(
    m: &ModelId,
    fails: &Arc<std::sync::atomic::AtomicU32>,
    rule: refit_runtime::topology::Commit,
) -> (
    Sender<InProcSender>,
    Vec<actix::Addr<InferenceEngine<MlpPolicy>>>,
    actix::Addr<WeightSyncController>,
) {
    let manifest = Arc::new(MlpPolicy::manifest_for(&SIZES).unwrap());
    let manifests = Manifests::new([(m.clone(), manifest)]).unwrap();
    let hub = InProc::new();
    let inits: Vec<_> = (0..2)
        .map(|_| ReceiverInit::new(hub.receiver(), Some(manifests.clone())))
        .collect();
    let joins: Vec<_> = inits
        .into_iter()
        .map(|r| std::thread::spawn(move || r.connect(Duration::from_secs(5)).unwrap()))
        .collect();
    let sender = SenderInit::new(hub.sender().unwrap(), manifests)
        .connect(vec![weights(m, 1, 0.0)], Duration::from_secs(5))
        .unwrap();
    let mut receivers = joins.into_iter().map(|j| j.join().unwrap());
    let ok = Box::new(receivers.next().unwrap()) as Box<dyn WeightInlet>;
    let failing = Box::new(FailingLink {
        inner: Box::new(receivers.next().unwrap()),
        fails: Arc::clone(fails),
    }) as Box<dyn WeightInlet>;
    let engines = vec![
        engine_with(vec![(m.clone(), ok)]),
        engine_with(vec![(m.clone(), failing)]),
    ];
    let cfg = SyncConfig::with_mode(SyncMode::FullyAsync);
    let ctl = WeightSyncController::new(
        &cfg,
        vec![m.clone()],
        engines.iter().map(EngineRef::local).collect(),
        None,
    )
    .unwrap()
    .with_commit(m.clone(), rule)
    .start();
    (sender, engines, ctl)
}

/// The version each engine serves.
async fn served_by(engines: &[actix::Addr<InferenceEngine<MlpPolicy>>], m: &ModelId) -> Vec<u64> {
    let mut out = Vec::new();
    for e in engines {
        out.push(e.send(ServedVersions).await.unwrap()[m].0);
    }
    out
}

/// `commit = "all"`: one of two engines fails to stage v2, so v2 is committed nowhere: both
/// engines keep serving v1 (never a mix), the failure names the engine; v3 lands on both.
#[actix_rt::test]
async fn under_commit_all_a_version_one_engine_cannot_stage_is_served_by_none() {
    let m = id("policy");
    let fails = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (mut s, engines, ctl) = two_engine_fleet(&m, &fails, refit_runtime::topology::Commit::All);
    let mut n = VersionNotifier::new(ctl.clone(), m.clone(), SyncConfig::default());
    land(&ctl, &mut n, &m, 1).await.unwrap();
    assert_eq!(served_by(&engines, &m).await, [1, 1]);
    fails.store(1, std::sync::atomic::Ordering::SeqCst);
    mock_publish(&mut s, &m, 2).unwrap();
    n.notify(Version(2)).await.unwrap();
    n.flush().await.unwrap();
    // the load of v2 ends (failed): wait for it on the status
    let status = loop {
        let st = ctl.send(GetStatus).await.unwrap();
        if st.models[&m].failed_loads > 0 {
            break st;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(served_by(&engines, &m).await, [1, 1], "a mix was served");
    let model = &status.models[&m];
    assert_eq!(model.rollout_version, Version(1));
    let e = model.last_error.as_deref().unwrap();
    assert!(
        e.contains("committed on no engine")
            && e.contains("engine 1: runtime: wire: injected: v2 cannot be fetched"),
        "{e}"
    );
    assert!(model.fenced.is_empty(), "{model:?}");
    mock_publish(&mut s, &m, 3).unwrap();
    land(&ctl, &mut n, &m, 3).await.unwrap();
    assert_eq!(served_by(&engines, &m).await, [3, 3]);
}

/// `commit = { quorum = 1 }`: one of two engines fails to stage a version; the other serves
/// it, the failing one is fenced (its rollouts wait, the other's are admitted), repaired by a
/// full load of the fleet's version, and takes rollouts again. Failing the repair too, it
/// stays fenced until it commits the next version with the fleet.
#[actix_rt::test]
async fn under_a_quorum_an_engine_that_cannot_stage_is_fenced_repaired_and_returns() {
    use refit_actors::actor::AwaitRollout;
    let m = id("policy");
    let fails = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (mut s, engines, ctl) =
        two_engine_fleet(&m, &fails, refit_runtime::topology::Commit::Quorum(1));
    let mut n = VersionNotifier::new(ctl.clone(), m.clone(), SyncConfig::default());
    let mut publish = async |v: u64| {
        mock_publish(&mut s, &m, v).unwrap();
        land(&ctl, &mut n, &m, v).await.unwrap();
    };
    let status = async || ctl.send(GetStatus).await.unwrap().models[&m].clone();
    let admit = |engine: usize| {
        ctl.send(AwaitRollout {
            model: m.clone(),
            engine: Some(engine),
        })
    };
    // v2: the stage fails once, the repair brings it
    fails.store(1, std::sync::atomic::Ordering::SeqCst);
    publish(2).await;
    let back = Instant::now();
    while !status().await.fenced.is_empty() {
        assert!(back.elapsed() < Duration::from_secs(10), "never repaired");
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(served_by(&engines, &m).await, [2, 2]);
    assert_eq!(status().await.fences, 1);
    // ANCHOR: fenced
    // v3: stage and repair fail; engine 1 serves v2 while the fleet serves v3, and gets no
    // rollouts
    fails.store(2, std::sync::atomic::Ordering::SeqCst);
    publish(3).await;
    while fails.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(served_by(&engines, &m).await, [3, 2]);
    let st = status().await;
    assert_eq!((st.fenced.as_slice(), st.fences), (&[1][..], 2), "{st:?}");
    let a0 = admit(0).await.unwrap().unwrap();
    assert_eq!(a0.rollout_version, Version(3));
    let mut a1 = Box::pin(admit(1));
    assert!(
        actix_rt::time::timeout(Duration::from_millis(300), &mut a1)
            .await
            .is_err(),
        "a fenced engine's rollout was admitted"
    );
    // v4 stages and commits on both: engine 1 is back, its rollout admitted
    publish(4).await;
    let a1 = a1.await.unwrap().unwrap();
    assert_eq!(a1.rollout_version, Version(4));
    assert_eq!(served_by(&engines, &m).await, [4, 4]);
    // ANCHOR_END: fenced
    let st = status().await;
    assert!(
        st.fenced.is_empty() && st.fenced_for > Duration::from_millis(300),
        "{st:?}"
    );
    let events = ctl.send(GetStatus).await.unwrap().events;
    let fenced: Vec<String> = events
        .iter()
        .filter(|e| matches!(e.kind, SyncEventKind::Fenced { .. }))
        .map(|e| e.kind.to_string())
        .collect();
    assert_eq!(fenced.len(), 2, "{fenced:?}");
    assert!(
        fenced[1].contains("engine 1 fenced: runtime: wire: injected: v3"),
        "{fenced:?}"
    );
}
