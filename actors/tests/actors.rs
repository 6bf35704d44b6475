//! The inference engine with real weights: pause, load, continue; refusals keep the served
//! version. (The controller's tests are in `controller.rs`.)
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use refit_actors::actor::{Act, Continue, InferenceEngine, LoadWeights, Pause, ServedVersion};
use refit_actors::{MlpPolicy, policy_model_id};
use refit_runtime::{DType, Manifest, Version, WeightSet};

fn weights(version: u64, fill: f32) -> Arc<WeightSet> {
    let m = Arc::new(MlpPolicy::manifest_for(&[4, 8, 2]).unwrap());
    let mut ws = WeightSet::zeroed(policy_model_id(), m.clone());
    for t in m.tensors() {
        ws.view_mut::<f32>(&t.name).unwrap().fill(fill);
    }
    ws.set_version(Version(version));
    Arc::new(ws)
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
    assert_eq!(stats.samples, 128);
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
