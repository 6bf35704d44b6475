//! The engine contract's conformance suite (`refit_actors::conformance`) run against both
//! engine families, in this process and served by another node, and against an engine that
//! breaks the contract (it serves a staged version before its commit), which the suite
//! must refuse naming the check.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod generating;

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_actors::actor::{
    BackendEngine, GenModel, GenerationEngine, GeneratorBackend, InferenceEngine,
};
use refit_actors::conformance::{self, CHECKS, Publish};
use refit_actors::generation::PauseMode;
use refit_actors::protocol::EngineRef;
use refit_actors::protocol::engine::{
    AbortStage, CancelInFlight, CommitModel, EngineHandle, GetEngineStats, LoadReport,
    ServedVersions, StageModel, StageReport, UpdateModel,
};
use refit_actors::remote::RemoteAddr;
use refit_actors::{MlpPolicy, Result, WeightInlet};
use refit_node::{ClusterToken, Node};
use refit_runtime::{
    Manifests, ModelId, PendingSend, ReceiverInit, Sender, SenderInit, Version, WeightSet,
};
use refit_transports::inproc::{InProc, InProcSender};

use generating::{bigram, policy, table};
use refit_actors::bigram::Bigram;

const SIZES: [usize; 3] = [4, 16, 2];

/// Publishes versions of one model through an in-process sender (version 1 went at
/// connect).
struct Publisher {
    sender: Sender<InProcSender>,
    make: Box<dyn Fn(u64) -> WeightSet>,
    pending: Vec<PendingSend>,
}

impl Publish for Publisher {
    fn publish(&mut self, version: Version) -> Result<()> {
        if version > Version(1) {
            let p = self.sender.send_async(vec![(self.make)(version.0)])?;
            self.pending.push(p);
        }
        Ok(())
    }
}

/// A sender and the inlet it feeds, for `model` of `manifest`'s layout.
fn scheme(
    model: &ModelId,
    make: impl Fn(u64) -> WeightSet + 'static,
) -> (Publisher, Box<dyn WeightInlet>) {
    let first = make(1);
    let manifests = Manifests::new([(model.clone(), Arc::clone(first.manifest()))]).unwrap();
    let hub = InProc::new();
    let receiver = ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
    let r = std::thread::spawn(move || receiver.connect(Duration::from_secs(5)).unwrap());
    let sender = SenderInit::new(hub.sender().unwrap(), manifests)
        .connect(vec![first], Duration::from_secs(5))
        .unwrap();
    let publisher = Publisher {
        sender,
        make: Box::new(make),
        pending: Vec::new(),
    };
    (publisher, Box::new(r.join().unwrap()))
}

fn mlp_weights(model: &ModelId, v: u64) -> WeightSet {
    let m = Arc::new(MlpPolicy::manifest_for(&SIZES).unwrap());
    refit_runtime::testing::filled(model, &m, v, v as f32 * 0.25)
}

/// An acting engine of one MLP model, and its publisher.
fn acting() -> (Addr<InferenceEngine<MlpPolicy>>, Publisher) {
    let m = policy();
    let mm = m.clone();
    let (publisher, inlet) = scheme(&m, move |v| mlp_weights(&mm, v));
    let engine = InferenceEngine::empty(1)
        .with_model(m, MlpPolicy::new(&SIZES).unwrap(), Some(inlet))
        .unwrap()
        .start();
    (engine, publisher)
}

/// A generating engine of one bigram model, and its publisher.
fn generating() -> (
    Addr<GenerationEngine<refit_actors::bigram::Bigram>>,
    Publisher,
) {
    let m = policy();
    let mm = m.clone();
    let (publisher, inlet) = scheme(&m, move |v| table(&mm, v));
    let g = bigram();
    let engine = GenerationEngine::new(PauseMode::Keep)
        .with_model(GenModel::new(m, g.clone(), g).inlet(inlet))
        .unwrap()
        .start();
    (engine, publisher)
}

/// A backend engine (the engine of vLLM or a Python object) over the bigram generator,
/// and its publisher.
fn backed() -> (Addr<BackendEngine<GeneratorBackend<Bigram>>>, Publisher) {
    let m = policy();
    let mm = m.clone();
    let (publisher, inlet) = scheme(&m, move |v| table(&mm, v));
    let backend = GeneratorBackend::new()
        .with_model(m.clone(), bigram(), bigram(), 16)
        .unwrap();
    let engine = BackendEngine::new(Arc::new(backend), vec![(m, inlet)])
        .unwrap()
        .start();
    (engine, publisher)
}

#[actix_rt::test]
async fn both_engine_families_pass_the_suite_in_this_process() {
    let (engine, mut publisher) = acting();
    let passed = conformance::weight_plane(&EngineRef::local(&engine), &policy(), &mut publisher)
        .await
        .unwrap();
    assert_eq!(passed, CHECKS);
    let (engine, mut publisher) = generating();
    let passed = conformance::weight_plane(&EngineRef::local(&engine), &policy(), &mut publisher)
        .await
        .unwrap();
    assert_eq!(passed, CHECKS);
    let (engine, mut publisher) = backed();
    let passed = conformance::weight_plane(&EngineRef::local(&engine), &policy(), &mut publisher)
        .await
        .unwrap();
    assert_eq!(passed, CHECKS);
}

/// `conformance::backend`, what `refit.engine.conformance` runs on a Python engine: a
/// backend in an engine and a system of their own, fed versions of zeros in its layout.
#[test]
fn a_backend_passes_the_suite_in_an_engine_of_its_own() {
    let backend = GeneratorBackend::new()
        .with_model(policy(), bigram(), bigram(), 16)
        .unwrap();
    assert_eq!(conformance::backend(backend, &policy()).unwrap(), CHECKS);
    // a model the backend does not serve is named
    let other = ModelId::new("other").unwrap();
    let backend = GeneratorBackend::new()
        .with_model(policy(), bigram(), bigram(), 16)
        .unwrap();
    let e = conformance::backend(backend, &other)
        .unwrap_err()
        .to_string();
    assert!(e.contains("other"), "{e}");
}

/// Both families served by one node and driven from another, through the wire contract.
#[test]
fn both_engine_families_pass_the_suite_across_nodes() {
    let token = ClusterToken::new("engine-contract-test-token").unwrap();
    let server = Node::loopback(token.clone()).unwrap();
    let client = Node::loopback(token).unwrap();
    actix::System::new().block_on(async move {
        let connect = |target| {
            RemoteAddr::connect(
                &client,
                server.addr(),
                target,
                "engine under test",
                Duration::from_secs(10),
            )
        };
        // each engine served on one node, the suite driven from the other
        let (a, pa) = acting();
        let (g, pg) = generating();
        let (b, pb) = backed();
        let engines = [
            (EngineHandle::acting(&a), pa),
            (EngineHandle::generating(&g), pg),
            (EngineHandle::generating(&b), pb),
        ];
        for (handle, mut publisher) in engines {
            let target = uuid::Uuid::new_v4();
            handle.serve(&server, target);
            let remote = EngineRef::remote(&connect(target).await.unwrap());
            let passed = conformance::weight_plane(&remote, &policy(), &mut publisher)
                .await
                .unwrap();
            assert_eq!(passed, CHECKS);
        }
    });
}

/// An engine that serves what it stages at once (no commit needed): a fleet under it
/// could serve a mix. It forwards every call to a real engine, but answers a stage with a
/// full load.
struct Eager(EngineRef);

impl Actor for Eager {
    type Context = Context<Self>;
}

impl Handler<StageModel> for Eager {
    type Result = ResponseFuture<Result<StageReport>>;
    fn handle(&mut self, msg: StageModel, _: &mut Context<Self>) -> Self::Result {
        let update = self.0.update.clone();
        Box::pin(async move {
            let r = update
                .send(UpdateModel {
                    model: msg.model.clone(),
                    version: msg.version,
                    timeout: msg.timeout,
                })
                .await
                .unwrap()?;
            Ok(StageReport {
                model: msg.model,
                version: r.version,
                fresh: true,
                staged: r.staged,
            })
        })
    }
}

macro_rules! forward {
    ($msg:ty, $field:ident, $out:ty) => {
        impl Handler<$msg> for Eager {
            type Result = ResponseFuture<$out>;
            fn handle(&mut self, msg: $msg, _: &mut Context<Self>) -> Self::Result {
                let to = self.0.$field.clone();
                Box::pin(async move { to.send(msg).await.unwrap() })
            }
        }
    };
}
forward!(UpdateModel, update, Result<LoadReport>);
forward!(CommitModel, commit, Result<LoadReport>);
forward!(AbortStage, abort, ());
forward!(CancelInFlight, cancel, u64);
forward!(
    ServedVersions,
    versions,
    std::collections::BTreeMap<ModelId, Version>
);
forward!(
    GetEngineStats,
    stats,
    refit_actors::protocol::engine::EngineStats
);

/// The suite can fail: an engine that serves a staged version before its commit is
/// refused, naming the check and what it served.
#[actix_rt::test]
async fn an_engine_that_serves_before_the_commit_fails_the_suite_naming_the_check() {
    let (engine, mut publisher) = acting();
    let eager = Eager(EngineRef::local(&engine)).start();
    let e = conformance::weight_plane(&EngineRef::local(&eager), &policy(), &mut publisher)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("check `stage-then-commit`") && e.contains("serves v2, not v1"),
        "{e}"
    );
}
