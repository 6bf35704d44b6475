//! Bring your model: a candle-nn MLP learns a small regression; after every few steps its
//! weights go, as a new version, over TCP to an engine that built the same model with
//! variables of its own. The engine imports each version into its `VarMap` and computes
//! the same outputs, bit for bit, as the trainer did with that version.
//!
//! ```text
//! cargo run --example candle_model -- [--versions 4] [--steps 25]
//! ```

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use candle_core::{DType as CDType, Device, Tensor};
use candle_nn::{Linear, Module, Optimizer, VarBuilder, VarMap};
use refit::prelude::*;
use refit::runtime::candle as bridge;

const WAIT: Duration = Duration::from_secs(30);

// ANCHOR: model
/// The model both sides build: 4 inputs, 32 hidden units, 2 outputs.
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    /// Builds it on `vars`: the variables `fc1.weight`, `fc1.bias`, `fc2.weight`,
    /// `fc2.bias`, created at random where `vars` does not hold them yet.
    fn new(vars: &VarMap) -> candle_core::Result<Self> {
        let vb = VarBuilder::from_varmap(vars, CDType::F32, &Device::Cpu);
        Ok(Self {
            fc1: candle_nn::linear(4, 32, vb.pp("fc1"))?,
            fc2: candle_nn::linear(32, 2, vb.pp("fc2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}
// ANCHOR_END: model

/// The regression it learns (y = [x0 + x1, x2 - x3]) and a probe the engine also sees.
fn data() -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let x = Tensor::randn(0f32, 1.0, (64, 4), &Device::Cpu)?;
    let cols = |i: usize| x.narrow(1, i, 1);
    let y = Tensor::cat(&[(cols(0)? + cols(1)?)?, (cols(2)? - cols(3)?)?], 1)?;
    let probe = Tensor::new(
        &[[0.5f32, -1.0, 2.0, 0.25], [1.0, 1.0, -1.0, 0.0]],
        &Device::Cpu,
    )?;
    Ok((x, y, probe))
}

/// A candle error, as the example's error.
fn candle(e: candle_core::Error) -> Error {
    Error::Strategy(format!("candle: {e}"))
}

/// The versions to publish and the optimiser steps between two.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Versions the trainer publishes after the first.
    #[arg(long, default_value_t = 4)]
    versions: u64,
    /// Optimiser steps between two versions.
    #[arg(long, default_value_t = 25)]
    steps: usize,
}

/// Runs [`run`]; an error is one `error: ...` line.
fn main() -> std::process::ExitCode {
    refit::exit_code(run())
}

fn run() -> Result<()> {
    let args = <Args as clap::Parser>::parse();
    let (x, y, probe) = data().map_err(candle)?;

    // ANCHOR: trainer
    // The trainer's model, its variables in a VarMap; the manifest says what a version holds.
    let vars = VarMap::new();
    let model = Mlp::new(&vars).map_err(candle)?;
    let policy = ModelId::new("policy")?;
    let manifest = Arc::new(bridge::manifest(&vars)?);
    let manifests = Manifests::new([(policy.clone(), Arc::clone(&manifest))])?;
    let token = ClusterToken::random();
    let transport = TcpSender::bind(
        TcpConfig {
            token: Some(token.clone()),
            expected_receivers: 1,
            ..TcpConfig::default()
        },
        &manifests,
    )?;
    let endpoint = transport.endpoint();
    // ANCHOR_END: trainer

    // ANCHOR: engine
    // The engine: the same model on variables of its own (random until the first import).
    let (outputs, seen) = mpsc::channel::<(u64, Vec<Vec<f32>>)>();
    let engine_probe = probe.clone();
    let engine = std::thread::spawn(move || -> Result<()> {
        let vars = VarMap::new();
        let model = Mlp::new(&vars).map_err(candle)?;
        let spec = TcpReceiverSpec::new(endpoint, &token);
        let mut receiver = ReceiverInit::new(TcpReceiver::new(spec), None).connect(WAIT)?;
        let apply = |w: &WeightSet| -> Result<()> {
            // every tensor checked against its variable, then written in place
            bridge::import(w, &vars)?;
            let out = model
                .forward(&engine_probe)
                .and_then(|t| t.to_vec2::<f32>());
            outputs
                .send((w.version().0, out.map_err(candle)?))
                .map_err(|_| Error::State("the trainer stopped listening"))
        };
        // version 1 arrived with the connect
        let first = receiver.current(&ModelId::new("policy")?);
        apply(
            first
                .as_deref()
                .ok_or(Error::State("no version after connect"))?,
        )?;
        loop {
            match receiver.receive(WAIT) {
                Ok(Some(update)) => apply(&update.group[0])?,
                Ok(None) => return Err(Error::State("no version in time")),
                Err(Error::PeerGone { .. }) => return Ok(()), // the trainer is done
                Err(e) => return Err(e),
            }
        }
    });
    // ANCHOR_END: engine

    // ANCHOR: publish
    // Version 1 goes out at connect; each later one after `steps` optimiser steps.
    let mut sender = SenderInit::new(transport, manifests)
        .with_ack_timeout(WAIT)
        .connect(
            vec![bridge::export(policy.clone(), Version(1), &vars)?],
            WAIT,
        )?;
    let mut expected = vec![(1, model.forward(&probe).and_then(|t| t.to_vec2::<f32>()))];
    let mut sgd = candle_nn::SGD::new(vars.all_vars(), 0.05).map_err(candle)?;
    for version in 2..=args.versions + 1 {
        let mut loss = 0.0;
        for _ in 0..args.steps {
            let l =
                candle_nn::loss::mse(&model.forward(&x).map_err(candle)?, &y).map_err(candle)?;
            sgd.backward_step(&l).map_err(candle)?;
            loss = l.to_scalar::<f32>().map_err(candle)?;
        }
        sender.send(bridge::export(policy.clone(), Version(version), &vars)?)?;
        println!("trainer: version {version} published (loss {loss:.4})");
        expected.push((
            version,
            model.forward(&probe).and_then(|t| t.to_vec2::<f32>()),
        ));
    }
    sender.shutdown()?;
    // ANCHOR_END: publish
    engine
        .join()
        .map_err(|_| Error::State("the engine thread panicked"))??;

    // ANCHOR: compare
    // What the engine computed with each version is what the trainer computed with it.
    let engine: Vec<(u64, Vec<Vec<f32>>)> = seen.try_iter().collect();
    if engine.len() != expected.len() {
        return Err(Error::State("the engine did not apply every version"));
    }
    for ((v, got), (w, want)) in engine.iter().zip(expected) {
        let want = want.map_err(candle)?;
        if *v != w || *got != want {
            println!("version {v}: the engine computed {got:?}, the trainer {want:?}");
            return Err(Error::State(
                "the engine's outputs differ from the trainer's",
            ));
        }
        println!("version {v}: the engine's outputs equal the trainer's: {got:?}");
    }
    // ANCHOR_END: compare
    Ok(())
}
