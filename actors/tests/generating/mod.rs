//! Shared pieces of the generating-engine tests: a bigram model whose versions count up by
//! their number (v1: `t -> t+1`, v2: `t -> t+2`), so every greedy token shows the version
//! that produced it; a gate that lets a test hold the decoding thread between steps; a
//! counting task; an in-process weight scheme.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use rand::Rng;
use rand::rngs::SmallRng;
use refit_actors::actor::{GenModel, GenerationEngine, GetGenStatus};
use refit_actors::bigram::{Bigram, BigramCache, BigramWeights};
use refit_actors::generation::{Generator, PauseMode, SamplingParams, StepInput, Token};
use refit_actors::task::{Reward, Task};
use refit_rl::Result;
use refit_runtime::{
    Manifest, Manifests, ModelId, Receiver, ReceiverInit, Sender, SenderInit, Version, WeightSet,
};
use refit_transports::inproc::{InProc, InProcReceiver, InProcSender};

pub const VOCAB: usize = 10;
pub const CONTEXT: usize = 64;
/// The deadline of every wait in these tests.
pub const DEADLINE: Duration = Duration::from_secs(30);

pub fn id(s: &str) -> ModelId {
    ModelId::new(s).unwrap()
}

pub fn policy() -> ModelId {
    id("policy")
}

pub fn bigram() -> Bigram {
    Bigram::new(VOCAB, CONTEXT).unwrap()
}

/// Version `v` of `model`: the greedy walk goes `t -> t + v` (mod the vocabulary).
pub fn table(model: &ModelId, v: u64) -> WeightSet {
    bigram()
        .weight_set(model.clone(), Version(v), move |p, n| {
            if n as usize == (p as usize + v as usize) % VOCAB {
                3.0
            } else {
                0.0
            }
        })
        .unwrap()
}

/// The greedy continuation of `last` under version `v`.
pub fn walk(last: Token, v: u64, n: usize) -> Vec<Token> {
    let mut t = last as usize;
    (0..n)
        .map(|_| {
            t = (t + v as usize) % VOCAB;
            t as Token
        })
        .collect()
}

/// `f` within [`DEADLINE`].
pub async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    match actix_rt::time::timeout(DEADLINE, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {DEADLINE:?}"),
    }
}

/// Polls `cond` every millisecond until it holds, for at most [`DEADLINE`].
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < DEADLINE, "{what}: not within {DEADLINE:?}");
        actix_rt::time::sleep(Duration::from_millis(1)).await;
    }
}

// ---- the gate ----

#[derive(Debug, Default)]
struct GateState {
    /// Forward passes still allowed (`None`: no limit).
    permits: Option<u64>,
    /// Forward passes entered (allowed or waiting).
    entered: u64,
}

/// Holds the decoding thread inside its forward pass until the test allows it on.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl Gate {
    /// A gate that lets nothing through.
    pub fn closed() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(GateState {
                permits: Some(0),
                entered: 0,
            }),
            changed: Condvar::new(),
        })
    }

    /// Lets everything through from now on.
    pub fn open(&self) {
        self.state.lock().unwrap().permits = None;
        self.changed.notify_all();
    }

    /// Lets `n` more forward passes through.
    pub fn allow(&self, n: u64) {
        let mut s = self.state.lock().unwrap();
        if let Some(p) = s.permits.as_mut() {
            *p += n;
        }
        drop(s);
        self.changed.notify_all();
    }

    /// Forward passes entered so far.
    pub fn entered(&self) -> u64 {
        self.state.lock().unwrap().entered
    }

    /// Waits (without blocking the actix thread) until forward pass `n` has been entered:
    /// with a closed gate, the decoding thread is then held in it.
    pub async fn wait_entered(&self, n: u64) {
        until(&format!("forward pass {n}"), || self.entered() >= n).await;
    }

    /// Called by the decoding thread at each forward pass.
    fn pass(&self) -> Result<()> {
        let mut s = self.state.lock().unwrap();
        s.entered += 1;
        let t = Instant::now();
        while s.permits == Some(0) {
            let left = DEADLINE.saturating_sub(t.elapsed());
            if left.is_zero() {
                return Err(refit_rl::Error::Config("the test gate never opened".into()));
            }
            s = self.changed.wait_timeout(s, left).unwrap().0;
        }
        if let Some(p) = s.permits.as_mut() {
            *p -= 1;
        }
        Ok(())
    }
}

/// The bigram model behind a [`Gate`].
#[derive(Debug, Clone)]
pub struct Gated {
    inner: Bigram,
    gate: Arc<Gate>,
}

impl Gated {
    pub fn new(gate: &Arc<Gate>) -> Self {
        Self {
            inner: bigram(),
            gate: Arc::clone(gate),
        }
    }
}

impl Generator for Gated {
    type Weights = BigramWeights;
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
    fn stage(&self, weights: &WeightSet) -> Result<BigramWeights> {
        self.inner.stage(weights)
    }
    fn new_cache(&self) -> BigramCache {
        self.inner.new_cache()
    }
    fn forward(
        &mut self,
        weights: &BigramWeights,
        inputs: &mut [StepInput<'_, BigramCache>],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        self.gate.pass()?;
        self.inner.forward(weights, inputs, logits)
    }
}

/// An engine serving `policy` at version 1 behind `gate`.
pub fn gated_engine(mode: PauseMode, gate: &Arc<Gate>) -> Addr<GenerationEngine<Gated>> {
    let g = Gated::new(gate);
    let model = GenModel::new(policy(), g.clone(), g).initial(Arc::new(table(&policy(), 1)));
    GenerationEngine::new(mode)
        .with_model(model)
        .unwrap()
        .start()
}

/// Waits until the engine's decoding thread of `model` has been handed `version`.
pub async fn wait_offered<G: Generator>(
    engine: &Addr<GenerationEngine<G>>,
    model: &ModelId,
    version: Version,
) {
    let t = Instant::now();
    loop {
        let status = within("status", engine.send(GetGenStatus)).await.unwrap();
        if status[model].offered >= Some(version) {
            return;
        }
        assert!(t.elapsed() < DEADLINE, "version {version} never offered");
        actix_rt::time::sleep(Duration::from_millis(1)).await;
    }
}

// ---- a task ----

/// One-token prompts; the reward is the share of generated tokens that count up by one
/// from the token before (v1's greedy completions earn 1, v2's earn 0).
#[derive(Debug, Clone)]
pub struct CountUp {
    pub max_tokens: u32,
}

impl Task for CountUp {
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn prompt(&mut self, rng: &mut SmallRng) -> Vec<Token> {
        vec![rng.random_range(0..VOCAB as Token)]
    }
    fn heldout(&self) -> Vec<Vec<Token>> {
        vec![vec![0], vec![3], vec![6]]
    }
    fn sampling(&self) -> SamplingParams {
        SamplingParams::greedy(self.max_tokens)
    }
    fn reward(&self, prompt: &[Token], completion: &[Token]) -> Result<Reward> {
        let mut prev = *prompt.last().unwrap();
        let per_token: Vec<f32> = completion
            .iter()
            .map(|&t| {
                let up = t as usize == (prev as usize + 1) % VOCAB;
                prev = t;
                if up { 1.0 } else { 0.0 }
            })
            .collect();
        let total = per_token.iter().sum::<f32>() / per_token.len().max(1) as f32;
        Ok(Reward {
            total,
            per_token: Some(per_token),
        })
    }
}

// ---- an in-process scheme ----

/// A trainer's sender and an engine's receiver of `model` in this process, carrying the
/// layout of `trainer` (the engine's generator may expect another), connected with
/// `initial`.
pub fn scheme(
    model: &ModelId,
    trainer: &Bigram,
    initial: WeightSet,
) -> (Sender<InProcSender>, Receiver<InProcReceiver>) {
    let manifests = Manifests::new([(model.clone(), trainer.manifest())]).unwrap();
    let hub = InProc::new();
    let receiver = ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
    let r = std::thread::spawn(move || receiver.connect(DEADLINE).unwrap());
    let sender = SenderInit::new(hub.sender().unwrap(), manifests)
        .connect(vec![initial], DEADLINE)
        .unwrap();
    (sender, r.join().unwrap())
}
