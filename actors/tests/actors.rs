//! The inference engine with real weights: pause, load, continue; refusals keep the served
//! version. (The controller's tests are in `controller.rs`.)
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use refit_actors::actor::{
    Act, Continue, Evaluator, InferenceEngine, LoadWeights, Pause, RunEval, ServedVersion,
};
use refit_actors::{CartPole, MlpPolicy, policy_model_id};
use refit_runtime::{DType, Manifest, Version, WeightSet};

fn weights(version: u64, fill: f32) -> Arc<WeightSet> {
    let m = Arc::new(MlpPolicy::manifest_for(&[4, 8, 2]).unwrap());
    Arc::new(refit_runtime::testing::filled(
        &policy_model_id(),
        &m,
        version,
        fill,
    ))
}

#[actix_rt::test]
async fn engine_pauses_loads_and_continues() {
    let engine =
        actix::Actor::start(InferenceEngine::new(MlpPolicy::new(&[4, 8, 2]).unwrap(), 7).unwrap());
    let obs = vec![0.1, -0.2, 0.3, 0.0];
    let first = engine
        .send(Act { obs: obs.clone() })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.version, Version::ZERO);
    engine.send(Pause).await.unwrap();
    // a request made while paused waits for Continue, and is served by the new weights
    let pending = engine.send(Act { obs: obs.clone() });
    let loaded = engine
        .send(LoadWeights {
            weights: weights(1, 0.01),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(loaded, Version(1));
    engine.send(Continue).await.unwrap();
    let acted = tokio::time::timeout(Duration::from_secs(5), pending)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(acted.version, Version(1));
    // a stale version and a wrong layout are refused; version 1 stays served
    let stale = engine
        .send(LoadWeights {
            weights: weights(1, 0.5),
        })
        .await
        .unwrap()
        .unwrap_err();
    assert!(stale.to_string().contains("version 1 refused"), "{stale}");
    let bad = Manifest::builder()
        .tensor("pi.0.weight", DType::F32, &[8, 5])
        .build()
        .unwrap();
    let mut wrong = WeightSet::zeroed(policy_model_id(), Arc::new(bad));
    wrong.set_version(Version(2));
    let err = engine
        .send(LoadWeights {
            weights: Arc::new(wrong),
        })
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("pi.0.weight"), "{err}");
    assert_eq!(engine.send(ServedVersion).await.unwrap(), Version(1));
}

#[actix_rt::test]
async fn a_collector_worker_and_a_trainer_close_the_loop_through_the_engine() {
    use refit_actors::actor::{CollectBatch, CollectorWorker, Train, Trainer};
    use refit_actors::{CartPole, Collector, PpoConfig, PpoTrainer};
    let sizes = vec![4, 16, 2];
    let s = sizes.clone();
    let worker = CollectorWorker::start(move || {
        let envs = (0..2).map(CartPole::new).collect();
        Collector::builder(envs, MlpPolicy::new(&s).unwrap())
            .frames_per_batch(128)
            .build()
            .unwrap()
    });
    let cfg = PpoConfig {
        sizes: sizes.clone(),
        epochs: 1,
        minibatch: 64,
        ..PpoConfig::default()
    };
    let trainer = Trainer::start(move || PpoTrainer::new(cfg.clone()).unwrap());
    let engine =
        actix::Actor::start(InferenceEngine::new(MlpPolicy::new(&sizes).unwrap(), 1).unwrap());
    let batch = worker.send(CollectBatch).await.unwrap().unwrap().unwrap();
    assert_eq!(batch.frames, 128);
    let (stats, weights) = trainer.send(Train { batch }).await.unwrap().unwrap();
    assert_eq!(stats.get("samples"), Some(128.0));
    assert_eq!(weights.version(), Version(1));
    // the trained weights reach both the worker's policy and the engine
    let v = worker
        .send(LoadWeights {
            weights: weights.clone(),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(v, Version(1));
    engine.send(LoadWeights { weights }).await.unwrap().unwrap();
    let acted = engine
        .send(Act {
            obs: vec![0.0, 0.1, 0.0, -0.1],
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(acted.version, Version(1));
    let next = worker.send(CollectBatch).await.unwrap().unwrap().unwrap();
    assert!(next.transitions.iter().all(|t| t.version == Version(1)));
}

#[actix_rt::test]
async fn a_pause_never_followed_by_continue_stops_rollouts_with_a_timeout() {
    use actix::Actor;
    use refit_actors::CartPole;
    use refit_actors::actor::{
        EngineRef, RolloutConfig, RolloutWorker, StartRollouts, StopRollouts, TrajectoryPool,
        WeightSyncController,
    };
    use refit_runtime::sync_policy::{SyncConfig, SyncMode};
    let engine = InferenceEngine::new(MlpPolicy::new(&[4, 8, 2]).unwrap(), 7)
        .unwrap()
        .start();
    let controller = WeightSyncController::new(
        &SyncConfig::with_mode(SyncMode::FullyAsync),
        vec![policy_model_id()],
        vec![EngineRef::local(&engine)],
        None,
    )
    .unwrap()
    .start();
    let pool = TrajectoryPool::new(policy_model_id(), 64, None, None).start();
    let deadline = Duration::from_millis(1500);
    let worker = RolloutWorker::new(
        RolloutConfig {
            model: policy_model_id(),
            worker: 0,
            fragment_steps: 4,
            seed: 1,
            timeout: deadline,
        },
        vec![CartPole::new(0)],
        engine.clone().recipient(),
        controller,
        pool.recipient(),
    )
    .unwrap()
    .start();
    // paused and never continued: the worker's first request queues in the engine
    engine.send(Pause).await.unwrap();
    let t = std::time::Instant::now();
    worker.send(StartRollouts).await.unwrap();
    let stats = loop {
        // stops new fragments; the one in flight still ends (with the error) and is counted
        let stats = worker.send(StopRollouts).await.unwrap();
        if stats.error.is_some() || t.elapsed() > deadline + Duration::from_secs(10) {
            break stats;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let waited = t.elapsed();
    let err = stats
        .error
        .expect("the worker never gave up on the paused engine");
    assert!(
        err.contains("timed out") && err.contains("the engine to act for model `policy`"),
        "{err}"
    );
    assert_eq!(stats.fragments, 0);
    assert!(
        waited >= deadline - Duration::from_millis(100)
            && waited < deadline + Duration::from_secs(2),
        "{waited:?}"
    );
    engine.send(Continue).await.unwrap();
}

/// An MLP whose weight loads take `delay` (a large model's copy, stretched so that what
/// happens during an apply can be observed).
struct SlowToLoad {
    inner: MlpPolicy,
    delay: Duration,
}

impl refit_runtime::HasWeights for SlowToLoad {
    fn weight_manifest(&self) -> refit_runtime::Result<Manifest> {
        self.inner.weight_manifest()
    }
    fn write_weights(&self, out: &mut WeightSet) -> refit_runtime::Result<()> {
        self.inner.write_weights(out)
    }
    fn read_weights(&mut self, weights: &WeightSet) -> refit_runtime::Result<()> {
        std::thread::sleep(self.delay);
        self.inner.read_weights(weights)
    }
}

impl refit_actors::Policy for SlowToLoad {
    fn act(&mut self, obs: &[f32], rng: &mut rand::rngs::SmallRng) -> refit_actors::ActionOut {
        self.inner.act(obs, rng)
    }
    fn obs_dim(&self) -> usize {
        refit_actors::Policy::obs_dim(&self.inner)
    }
    fn num_actions(&self) -> usize {
        refit_actors::Policy::num_actions(&self.inner)
    }
}

#[actix_rt::test]
async fn one_models_apply_does_not_stall_requests_for_another() {
    use actix::Actor;
    use refit_actors::actor::{ActBatch, ServedVersions};
    use refit_runtime::{HasWeights, ModelId};
    let (a, b) = (
        ModelId::new("solver").unwrap(),
        ModelId::new("verifier").unwrap(),
    );
    let slow = |delay| SlowToLoad {
        inner: MlpPolicy::new(&[4, 8, 2]).unwrap(),
        delay,
    };
    let engine = InferenceEngine::empty(3)
        .with_model(a.clone(), slow(Duration::from_secs(2)), None)
        .unwrap()
        .with_model(b.clone(), slow(Duration::ZERO), None)
        .unwrap()
        .start();
    let ask = |model: &ModelId| {
        engine.send(ActBatch {
            model: model.clone(),
            obs: vec![0.0; 8],
            epoch: None,
            greedy: false,
        })
    };
    let mut v1 = WeightSet::zeroed(
        a.clone(),
        Arc::new(slow(Duration::ZERO).weight_manifest().unwrap()),
    );
    v1.set_version(Version(1));
    let load = actix_rt::spawn(engine.send(LoadWeights {
        weights: Arc::new(v1),
    }));
    // the solver's apply is under way (it takes 2 s)
    tokio::time::sleep(Duration::from_millis(200)).await;
    let solver_req = ask(&a);
    let verifier = ask(&b).await.unwrap().unwrap();
    assert_eq!(verifier.actions.len(), 2);
    assert!(
        !load.is_finished(),
        "the verifier was answered only after the solver's apply"
    );
    let served = engine.send(ServedVersions).await.unwrap();
    assert_eq!(served[&a], Version::ZERO, "the apply is not over yet");
    assert!(!load.is_finished());
    assert_eq!(load.await.unwrap().unwrap().unwrap(), Version(1));
    // the solver's request queued during its apply and was answered by the new weights
    let solver = solver_req.await.unwrap().unwrap();
    assert_eq!(solver.version, Version(1));
    let stats = engine
        .send(refit_actors::actor::GetEngineStats)
        .await
        .unwrap();
    assert_eq!(stats.loads, 1);
    assert!(stats.paused_max >= Duration::from_secs(2), "{stats:?}");
}

/// An ack means applied: the engine stages version 2 through its inlet (a real scheme), and
/// its sender hears of it only once the (slow) apply is over and version 2 is served.
#[actix_rt::test]
async fn an_engine_acknowledges_a_version_only_once_it_serves_it() {
    use actix::Actor;
    use refit_actors::actor::{ActBatch, ServedVersions, UpdateModel};
    use refit_runtime::{HasWeights, Manifests, ReceiverInit, SenderInit};
    use refit_transports::inproc::InProc;
    const T: Duration = Duration::from_secs(30);
    let id = policy_model_id();
    let policy = SlowToLoad {
        inner: MlpPolicy::new(&[4, 8, 2]).unwrap(),
        delay: Duration::from_secs(2),
    };
    let manifests =
        Manifests::new([(id.clone(), Arc::new(policy.weight_manifest().unwrap()))]).unwrap();
    let hub = InProc::new();
    let rx = ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
    let joiner = std::thread::spawn(move || rx.connect(T));
    let mut tx = SenderInit::new(hub.sender().unwrap(), manifests)
        .connect(vec![(*weights(1, 0.1)).clone()], T)
        .unwrap();
    let rx = joiner.join().unwrap().unwrap();
    let engine = InferenceEngine::empty(5)
        .with_model(id.clone(), policy, Some(Box::new(rx)))
        .unwrap()
        .start();
    let pending = tx.send_async(vec![(*weights(2, 0.2)).clone()]).unwrap();
    let load = actix_rt::spawn(engine.send(UpdateModel {
        model: id.clone(),
        version: Version(2),
        timeout: T,
    }));
    // the sender waits for the ack on its own thread while the engine stages and applies
    let acked = actix_rt::task::spawn_blocking(move || {
        let r = tx.wait(&pending, T);
        (tx, r)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // the apply (2 s) is under way: a request queues, and no ack has been sent
    let during = engine.send(ActBatch {
        model: id.clone(),
        obs: vec![0.0; 4],
        epoch: None,
        greedy: false,
    });
    assert!(!acked.is_finished(), "acknowledged before the apply ended");
    let (_tx, r) = acked.await.unwrap();
    r.unwrap();
    // when the sender sees the ack, the engine serves version 2
    let served = engine.send(ServedVersions).await.unwrap();
    assert_eq!(served[&id], Version(2));
    // the request that queued during the apply was answered with version 2
    assert_eq!(during.await.unwrap().unwrap().version, Version(2));
    let report = load.await.unwrap().unwrap().unwrap();
    assert_eq!(report.version, Version(2));
    assert!(report.paused >= Duration::from_secs(2), "{report:?}");
}

/// A request queued on a paused engine whose pause never ends (its controller gone) is
/// answered with a timeout at the engine's queue deadline; the engine lives, and serves the
/// next request once it continues.
#[actix_rt::test]
async fn a_request_queued_on_a_paused_engine_times_out_at_its_deadline() {
    let deadline = Duration::from_millis(300);
    let engine = actix::Actor::start(
        InferenceEngine::new(MlpPolicy::new(&[4, 8, 2]).unwrap(), 7)
            .unwrap()
            .with_queue_deadline(deadline),
    );
    let obs = vec![0.1, -0.2, 0.3, 0.0];
    engine.send(Pause).await.unwrap();
    let started = std::time::Instant::now();
    // the outer bound only keeps a failing test from hanging: without the deadline the
    // request waits for a Continue that never comes
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        engine.send(Act { obs: obs.clone() }),
    )
    .await
    .expect("a queued request must be answered by its deadline")
    .unwrap()
    .unwrap_err();
    let waited = started.elapsed();
    assert!(waited >= deadline, "answered after {waited:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("timed out") && msg.contains("model `policy`") && msg.contains("paused"),
        "{msg}"
    );
    engine.send(Continue).await.unwrap();
    let acted = engine.send(Act { obs }).await.unwrap().unwrap();
    assert_eq!(acted.version, Version::ZERO);
}

/// An evaluator whose engine never answers (paused for good) fails its eval step at its
/// request deadline, naming the model, instead of holding the step for good; it then runs
/// the next step once the engine serves again.
#[actix_rt::test]
async fn an_eval_step_whose_engine_never_answers_fails_at_the_request_deadline() {
    let engine =
        actix::Actor::start(InferenceEngine::new(MlpPolicy::new(&[4, 8, 2]).unwrap(), 7).unwrap());
    engine.send(Pause).await.unwrap();
    let deadline = Duration::from_millis(300);
    let evaluator = actix::Actor::start(
        Evaluator::new(
            engine.clone().recipient(),
            vec![policy_model_id()],
            |_, i| Ok(CartPole::new(i as u64)),
            2,
            50,
            0,
        )
        .with_request_deadline(deadline),
    );
    let started = std::time::Instant::now();
    // the outer bound only keeps a failing test from hanging (the engine's own queue
    // deadline is minutes)
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        evaluator.send(RunEval { step: Version(3) }),
    )
    .await
    .expect("the eval step must end at the evaluator's request deadline")
    .unwrap()
    .unwrap_err();
    assert!(started.elapsed() >= deadline);
    let msg = err.to_string();
    assert!(
        msg.contains("timed out") && msg.contains("model `policy` (step 3)"),
        "{msg}"
    );
    engine.send(Continue).await.unwrap();
    let report = evaluator
        .send(RunEval { step: Version(4) })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.models[&policy_model_id()].episodes, 2);
}
