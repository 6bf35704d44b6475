//! A generating engine verifying what it serves (`GenModel::verify`): the corrupt-then-
//! restore self-test at the first version, and the weights served read back at the next
//! version, through a real inlet.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod generating;

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use actix::prelude::*;
use refit_actors::WeightInlet;
use refit_actors::actor::{GenModel, Generate, GenerationEngine, UpdateModel};
use refit_actors::bigram::{Bigram, BigramCache, BigramWeights, TABLE};
use refit_actors::generation::{Generator, PauseMode, SamplingParams, StepInput};
use refit_rl::Result;
use refit_runtime::topology::Verify;
use refit_runtime::{Manifest, ModelId, Version, WeightSet};

use generating::*;

type Served = Arc<RwLock<BigramWeights>>;

/// A bigram model whose served table a test can reach (the last version staged), and whose
/// staging can be made to drop what it is given (as a loader that skips a tensor would).
#[derive(Clone)]
struct Exposed {
    inner: Bigram,
    last: Arc<Mutex<Option<Served>>>,
    /// Stage this table whatever the version holds.
    stale: Option<Arc<WeightSet>>,
}

impl Exposed {
    fn new() -> Self {
        Self {
            inner: bigram(),
            last: Arc::default(),
            stale: None,
        }
    }

    /// Overwrites the table served now (a stray write into the engine's weights).
    fn damage(&self, model: &ModelId) {
        let last = self.last.lock().unwrap().clone().unwrap();
        let mut ws = WeightSet::zeroed(model.clone(), self.inner.manifest());
        self.inner.export(&last.read().unwrap(), &mut ws).unwrap();
        ws.view_mut::<f32>(TABLE).unwrap()[7] += 0.5;
        *last.write().unwrap() = self.inner.stage(&ws).unwrap();
    }
}

impl Generator for Exposed {
    type Weights = Served;
    type Cache = BigramCache;
    fn manifest(&self) -> Arc<Manifest> {
        self.inner.manifest()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn stage(&self, weights: &WeightSet) -> Result<Served> {
        let from = self.stale.as_deref().unwrap_or(weights);
        let staged = Arc::new(RwLock::new(self.inner.stage(from)?));
        *self.last.lock().unwrap() = Some(Arc::clone(&staged));
        Ok(staged)
    }
    fn export(&self, weights: &Served, out: &mut WeightSet) -> Result<()> {
        self.inner.export(&weights.read().unwrap(), out)
    }
    fn new_cache(&self) -> BigramCache {
        self.inner.new_cache()
    }
    fn forward(
        &mut self,
        weights: &Served,
        inputs: &mut [StepInput<'_, BigramCache>],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        self.inner.forward(&weights.read().unwrap(), inputs, logits)
    }
}

fn update(model: &ModelId, v: u64) -> UpdateModel {
    UpdateModel {
        model: model.clone(),
        version: Version(v),
        timeout: Duration::from_secs(10),
    }
}

fn engine(
    g: &Exposed,
    level: Verify,
) -> (
    refit_runtime::Sender<refit_transports::inproc::InProcSender>,
    Addr<GenerationEngine<Exposed>>,
) {
    let p = policy();
    let (sender, receiver) = scheme(&p, &bigram(), table(&p, 1));
    let engine = GenerationEngine::new(PauseMode::Keep)
        .with_model(
            GenModel::new(p, g.clone(), g.clone())
                .inlet(Box::new(receiver) as Box<dyn WeightInlet>)
                .verify(level),
        )
        .unwrap()
        .start();
    (sender, engine)
}

/// `verify = "hashes"`: a value of the served table changed after v1 was swapped in is
/// reported by the load of v2, naming the model, the version and the tensor; v2 replaces
/// the table whole (v3 finds nothing). Without verification the same change goes unseen
/// (what makes the test able to fail).
#[actix_rt::test]
async fn a_value_changed_in_served_weights_is_reported_by_the_next_version() {
    let p = policy();
    for level in [Verify::Hashes, Verify::Names] {
        let g = Exposed::new();
        let (mut sender, engine) = engine(&g, level);
        let v1 = within("v1", engine.send(update(&p, 1)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((v1.version, v1.damaged.as_deref()), (Version(1), None));
        g.damage(&p);
        let _pending = sender.send_async(vec![table(&p, 2)]).unwrap();
        let v2 = within("v2", engine.send(update(&p, 2)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(v2.version, Version(2));
        match level {
            Verify::Hashes => {
                let d = v2.damaged.expect("the change is reported");
                assert!(
                    d.contains("model `policy` v1: tensor `bigram.logits`"),
                    "{d}"
                );
            }
            _ => assert_eq!(v2.damaged, None),
        }
        let _pending = sender.send_async(vec![table(&p, 3)]).unwrap();
        let v3 = within("v3", engine.send(update(&p, 3)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((v3.version, v3.damaged), (Version(3), None));
        let c = within(
            "generate",
            engine.send(Generate {
                model: p.clone(),
                prompt: vec![0],
                params: SamplingParams::greedy(3),
                epoch: None,
            }),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(c.tokens, walk(0, 3, 3));
    }
}

/// `verify = "startup"`: a staging that does not carry the version (it stages what it held
/// before, here equal to the version: the read-back alone would pass) fails the first load
/// naming the tensor, and the engine serves nothing it was not given; with verification off
/// the same engine "loads" v1.
#[actix_rt::test]
async fn the_startup_self_test_refuses_a_staging_that_drops_the_version() {
    let p = policy();
    for level in [Verify::Startup, Verify::Off] {
        let mut g = Exposed::new();
        g.stale = Some(Arc::new(table(&p, 1)));
        let (_sender, engine) = engine(&g, level);
        let r = within("v1", engine.send(update(&p, 1))).await.unwrap();
        match level {
            Verify::Startup => {
                let e = r.unwrap_err().to_string();
                assert!(
                    e.contains("self-test") && e.contains("tensor `bigram.logits`"),
                    "{e}"
                );
            }
            _ => assert_eq!(r.unwrap().version, Version(1)),
        }
    }
}
