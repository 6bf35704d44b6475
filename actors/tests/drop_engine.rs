//! A controller whose engine's process dies: loads land on the engines left (the dead one's
//! remote call fails with a typed error, it is not waited for), `DropEngine` takes it out
//! of the controller, and `AddEngine` brings a new engine (a restarted rank) to the version
//! the others serve before it takes part in loads.
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use actix::Actor;
use refit_actors::actor::{
    AddEngine, AwaitSynced, DropEngine, EngineRef, GetStatus, InferenceEngine, ServedVersions,
    VersionNotifier, WeightSyncController,
};
use refit_actors::remote::RemoteAddr;
use refit_actors::{MlpPolicy, WeightOutlet, policy_model_id};
use refit_node::{ClusterToken, Node};
use refit_runtime::sync_policy::{SyncConfig, SyncMode};
use refit_runtime::{Manifests, ReceiverInit, SenderInit, Version, WeightSet};
use refit_transports::inproc::InProc;
use uuid::Uuid;

const SIZES: [usize; 3] = [4, 8, 2];
const WAIT: Duration = Duration::from_secs(10);

fn weights(version: u64) -> WeightSet {
    let m = Arc::new(MlpPolicy::manifest_for(&SIZES).unwrap());
    refit_runtime::testing::filled(&policy_model_id(), &m, version, version as f32)
}

#[actix_rt::test]
async fn a_dead_engine_is_not_waited_for_and_can_be_dropped() {
    let model = policy_model_id();
    let manifests = Manifests::new([(model.clone(), Arc::clone(weights(1).manifest()))]).unwrap();
    let hub = InProc::new();
    let receivers: Vec<_> = (0..2)
        .map(|_| {
            let r = ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
            std::thread::spawn(move || r.connect(WAIT).unwrap())
        })
        .collect();
    let mut sender = SenderInit::new(hub.sender().unwrap(), manifests)
        .connect(vec![weights(1)], WAIT)
        .unwrap();
    let mut engines = Vec::new();
    for r in receivers {
        let engine = InferenceEngine::empty(1)
            .with_model(
                model.clone(),
                MlpPolicy::new(&SIZES).unwrap(),
                Some(Box::new(r.join().unwrap())),
            )
            .unwrap()
            .start();
        engines.push(engine);
    }
    // engine 1 lives behind a node, as in another process
    let token = ClusterToken::new("drop-engine-test-token").unwrap();
    let (far, near) = (
        Node::loopback(token.clone()).unwrap(),
        Node::loopback(token).unwrap(),
    );
    let target = Uuid::new_v4();
    EngineRef::local(&engines[1]).serve(&far, target);
    let peer = near.connect(far.addr(), WAIT).unwrap();
    let remote = RemoteAddr::new(peer, target, "engine 1", WAIT);
    let handles = vec![EngineRef::local(&engines[0]), EngineRef::remote(&remote)];
    let sync = SyncConfig::with_mode(SyncMode::FullyAsync);
    let controller = WeightSyncController::new(&sync, vec![model.clone()], handles, None)
        .unwrap()
        .start();
    let mut notifier = VersionNotifier::new(controller.clone(), model.clone(), sync);
    notifier.notify(Version(1)).await.unwrap();
    notifier.flush().await.unwrap();
    let synced = |v| AwaitSynced {
        model: model.clone(),
        version: Version(v),
    };
    assert_eq!(
        controller.send(synced(1)).await.unwrap().unwrap(),
        Version(1)
    );
    for e in &engines {
        assert_eq!(e.send(ServedVersions).await.unwrap()[&model], Version(1));
    }

    // engine 1's process goes away: version 2 lands on engine 0 without waiting for it
    far.shutdown();
    sender.publish(Arc::new(weights(2))).unwrap();
    notifier.notify(Version(2)).await.unwrap();
    notifier.flush().await.unwrap();
    let landed = tokio::time::timeout(WAIT, controller.send(synced(2)))
        .await
        .expect("the controller waited for a dead engine")
        .unwrap()
        .unwrap();
    assert_eq!(landed, Version(2));
    assert_eq!(
        engines[0].send(ServedVersions).await.unwrap()[&model],
        Version(2)
    );
    let status = controller.send(GetStatus).await.unwrap();
    assert_eq!(status.models[&model].failed_loads, 0, "{status:?}");

    // dropped; a restarted engine (fresh, serving nothing) is added back under its id:
    // it is brought to v2 before it joins, then every load lands on it too
    controller
        .send(DropEngine { index: 1 })
        .await
        .unwrap()
        .unwrap();
    let hub = InProc::new();
    let m3 = Arc::clone(weights(2).manifest());
    let manifests = Manifests::new([(model.clone(), m3)]).unwrap();
    let r = ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
    let r = std::thread::spawn(move || r.connect(WAIT).unwrap());
    let mut sender2 = SenderInit::new(hub.sender().unwrap(), manifests)
        .connect(vec![weights(2)], WAIT)
        .unwrap();
    let fresh = InferenceEngine::empty(2)
        .with_model(
            model.clone(),
            MlpPolicy::new(&SIZES).unwrap(),
            Some(Box::new(r.join().unwrap())),
        )
        .unwrap()
        .start();
    assert_eq!(
        fresh.send(ServedVersions).await.unwrap()[&model],
        Version::ZERO
    );
    let served = controller
        .send(AddEngine {
            index: 1,
            engine: EngineRef::local(&fresh),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(served[&model], Version(2));
    sender.publish(Arc::new(weights(3))).unwrap();
    sender2.publish(Arc::new(weights(3))).unwrap();
    notifier.notify(Version(3)).await.unwrap();
    notifier.flush().await.unwrap();
    assert_eq!(
        controller.send(synced(3)).await.unwrap().unwrap(),
        Version(3)
    );
    for e in [&engines[0], &fresh] {
        assert_eq!(e.send(ServedVersions).await.unwrap()[&model], Version(3));
    }
    // even the last engine can be dropped (it may come back); loads then fail, named
    for i in [0, 1] {
        controller
            .send(DropEngine { index: i })
            .await
            .unwrap()
            .unwrap();
    }
    sender.publish(Arc::new(weights(4))).unwrap();
    notifier.notify(Version(4)).await.unwrap();
    notifier.flush().await.unwrap();
    let status = controller.send(GetStatus).await.unwrap();
    let last = status.models[&model].last_error.clone().unwrap_or_default();
    assert!(last.contains("no engine"), "{last}");
}
