//! The bytes each update puts on the wire with element-level deltas (`links.delta =
//! "elements"`), against the model's size: on real optimizer steps of the shipped learners
//! (PPO on CartPole, GRPO on digit reversal, in the layout its engines serve) and on a
//! synthetic model where 2% of the elements change per version. Every version goes through
//! a real TCP sender to a receiver in the `Elements` mode, which verifies it whole against
//! the trainer's checksums, and is compared byte for byte with what was sent.
//!
//! ```text
//! cargo run --release --example delta_bytes -- [UPDATES]
//! ```
//!
//! Prints one line per case: the median and range of the bytes sent per update as a
//! fraction of the model, beside a `buckets` receiver's (the default mode) for the same
//! versions.

use std::sync::Arc;
use std::time::Duration;

use refit::prelude::*;
use refit_actors::{
    Batch, CartPole, Collector, GrpoRoles, Learner, MlpPolicy, ModelSpec, PpoConfig, PpoTrainer,
    UpdatePolicyWeights,
};
use refit_rl::local_grpo::{self, LocalConfig};
use refit_rl::{GenRoles, LearnStats};
use refit_runtime::Conversion;
use refit_transports::tcp::TransferMode;

const WAIT: Duration = Duration::from_secs(60);

/// A TCP sender and one receiver per mode, in this process: each version published is
/// pulled by every receiver, and the bytes each pull put on the wire are counted.
struct Wire {
    sender: Sender<TcpSender>,
    receivers: Vec<(TransferMode, Receiver<TcpReceiver>)>,
    /// Per receiver: the wire bytes of each update after the first, as a fraction of the
    /// model.
    fractions: Vec<Vec<f64>>,
}

impl Wire {
    fn new(first: &WeightSet, modes: &[TransferMode]) -> Result<Self> {
        let manifests = Manifests::new([(first.model().clone(), Arc::clone(first.manifest()))])?;
        let token = ClusterToken::random();
        let config = TcpConfig {
            token: Some(token.clone()),
            expected_receivers: modes.len(),
            ..TcpConfig::default()
        };
        let transport = TcpSender::bind(config, &manifests)?;
        let endpoint = transport.endpoint();
        let joining: Vec<_> = modes
            .iter()
            .map(|&mode| {
                // ANCHOR: receiver
                // mode: TransferMode::Elements sends each changed bucket as its
                // element-level difference against the version this receiver holds
                let r = TcpReceiver::new(TcpReceiverSpec::new(endpoint, &token)).with_config(
                    TcpReceiverConfig {
                        mode,
                        relay: false,
                        ..TcpReceiverConfig::default()
                    },
                );
                // ANCHOR_END: receiver
                std::thread::spawn(move || ReceiverInit::new(r, None).connect(WAIT))
            })
            .collect();
        let sender = SenderInit::new(transport, manifests).connect(vec![first.clone()], WAIT)?;
        let mut receivers = Vec::new();
        for (mode, j) in modes.iter().zip(joining) {
            let r = j
                .join()
                .map_err(|_| Error::State("a receiver thread panicked"))??;
            receivers.push((*mode, r));
        }
        Ok(Self {
            sender,
            fractions: vec![Vec::new(); receivers.len()],
            receivers,
        })
    }

    /// Publishes `ws`, lets every receiver pull it, checks each got it bit for bit, and
    /// records what each pull put on the wire.
    fn publish(&mut self, ws: WeightSet) -> Result<()> {
        let size = ws.manifest().total_len() as f64;
        let expected = ws.bytes().to_vec();
        let model = ws.model().clone();
        let before: Vec<u64> = self
            .receivers
            .iter()
            .map(|(_, r)| r.transport().stats().bytes_on_wire)
            .collect();
        let pending = self.sender.send_async(vec![ws])?;
        for (i, (_, r)) in self.receivers.iter_mut().enumerate() {
            r.receive(WAIT)?
                .ok_or(Error::State("the sender closed before the version landed"))?;
            let got = r
                .current(&model)
                .ok_or(Error::State("no version held after a pull"))?;
            if got.bytes() != &expected[..] {
                return Err(Error::State("a version landed with other bytes than sent"));
            }
            let wire = r.transport().stats().bytes_on_wire - before[i];
            self.fractions[i].push(wire as f64 / size);
        }
        self.sender.wait(&pending, WAIT)?;
        Ok(())
    }

    /// One line per receiver: the median and the range of its fractions.
    fn report(&self, case: &str, size: usize) {
        for ((mode, _), f) in self.receivers.iter().zip(&self.fractions) {
            let mut f = f.clone();
            f.sort_by(f64::total_cmp);
            if f.is_empty() {
                continue;
            }
            println!(
                "{case:<34} {:<8} {:>4} updates of {:>9} bytes: median {:>6.2}% of the model (min {:.2}%, max {:.2}%)",
                mode_name(*mode),
                f.len(),
                size,
                100.0 * f[f.len() / 2],
                100.0 * f[0],
                100.0 * f[f.len() - 1],
            );
        }
    }
}

fn mode_name(mode: TransferMode) -> &'static str {
    match mode {
        TransferMode::Full => "full",
        TransferMode::Delta => "buckets",
        TransferMode::Elements => "elements",
    }
}

const MODES: [TransferMode; 2] = [TransferMode::Elements, TransferMode::Delta];

/// PPO on CartPole: each update's exported version.
fn ppo(updates: usize) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut trainer = PpoTrainer::new(PpoConfig {
        lr: 1e-3,
        epochs: 8,
        minibatch: 512,
        seed: 1,
        ..PpoConfig::default()
    })?;
    let envs = (0..8)
        .map(|i| CartPole::new(i).with_index(i as usize))
        .collect();
    let mut collector = Collector::builder(envs, MlpPolicy::cartpole()?)
        .frames_per_batch(2048)
        .seed(7)
        .build()?;
    let first = trainer.export()?;
    let size = first.manifest().total_len();
    let mut wire = Wire::new(&first, &MODES)?;
    for _ in 0..updates {
        let batch: Batch = collector.next().ok_or("the collector ended")??;
        trainer.update(&batch)?;
        let ws = trainer.export()?;
        collector.update_weights(ws.clone())?;
        wire.publish(ws)?;
    }
    wire.report("ppo cartpole (f32, adam)", size);
    Ok(())
}

/// A learner that publishes each version it exports, in its engines' layout, on `wire`.
struct Publishing {
    inner: Box<dyn Learner>,
    conversion: Conversion,
    wire: Option<Wire>,
    error: Option<Error>,
}

impl Learner for Publishing {
    fn update(&mut self, batch: &refit_rl::Batch) -> refit_rl::Result<LearnStats> {
        self.inner.update(batch)
    }

    fn export(&mut self) -> refit_rl::Result<WeightSet> {
        let ws = self.inner.export()?;
        let engine = self.conversion.apply(&ws)?;
        let sent = match self.wire.as_mut() {
            Some(w) => w.publish(engine),
            None => Wire::new(&engine, &MODES).map(|w| self.wire = Some(w)),
        };
        if let Err(e) = sent {
            self.error.get_or_insert(e);
        }
        Ok(ws)
    }

    fn manifest(&self) -> Arc<Manifest> {
        self.inner.manifest()
    }

    fn version(&self) -> Version {
        self.inner.version()
    }
}

/// GRPO on digit reversal: each update's version, converted to the engines' layout.
fn grpo(updates: usize) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let roles = GrpoRoles::new();
    let spec = ModelSpec::new(ModelId::new("policy")?, 0);
    let local = LocalConfig {
        max_updates: updates,
        group_size: spec.group_size,
        stop_at: None,
        eval_every: updates.max(1),
        ..LocalConfig::default()
    };
    let inner = roles.learner(&spec)?;
    let conversion = Conversion::new(&inner.manifest(), &roles.conversion())?;
    let mut learner = Publishing {
        inner,
        conversion: conversion.clone(),
        wire: None,
        error: None,
    };
    let mut generator = roles.generator(&spec)?;
    let mut task = roles.task(&spec, 0)?;
    local_grpo::run(
        &mut learner,
        &conversion,
        &mut generator,
        &mut task,
        &local,
        |_, _| {},
    )?;
    if let Some(e) = learner.error {
        return Err(e.into());
    }
    if let Some(w) = &learner.wire {
        let size = conversion.target().total_len();
        w.report("grpo transformer (engine layout)", size);
    }
    Ok(())
}

/// A 64 MiB f32 model of which 2% of the elements, spread over every tensor, change per
/// version.
fn two_percent(updates: usize) -> Result<()> {
    let mut b = Manifest::builder();
    for i in 0..16 {
        b = b.tensor(format!("layer{i}.weight"), DType::F32, &[1 << 20]);
    }
    let manifest = Arc::new(b.build()?);
    let mut ws = WeightSet::zeroed(ModelId::new("policy")?, Arc::clone(&manifest));
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for t in manifest.tensors() {
        for x in ws.view_mut::<f32>(&t.name)? {
            *x = (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        }
    }
    ws.set_version(Version(1));
    let mut wire = Wire::new(&ws, &MODES)?;
    for v in 2..=updates as u64 + 1 {
        let mut new = ws.clone();
        new.set_version(Version(v));
        for t in manifest.tensors() {
            let x = new.view_mut::<f32>(&t.name)?;
            for _ in 0..x.len() / 50 {
                let i = (next() as usize) % x.len();
                x[i] += 1e-3;
            }
        }
        wire.publish(new.clone())?;
        ws = new;
    }
    wire.report("synthetic, 2% of elements changed", manifest.total_len());
    Ok(())
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let updates: usize = match std::env::args().nth(1) {
        Some(n) => n.parse().map_err(|e| format!("UPDATES: {e}"))?,
        None => 10,
    };
    two_percent(updates)?;
    ppo(updates)?;
    grpo(updates)?;
    Ok(())
}
