//! Collector throughput: CartPole with the 4-64-64-2 MLP policy, one worker, then two
//! workers (sync and async), with a weight update after every 1000-frame batch.
//!
//! ```text
//! cargo run --release --example collector_bench -- [--frames 200000] [--envs 1]
//! ```
//! (For scale: TorchRL's collectors do about 1.5k frames/s with one worker and 3.2k with two.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use refit_actors::{
    CartPole, Collector, MlpPolicy, MultiAsyncCollector, MultiConfig, MultiSyncCollector,
    UpdatePolicyWeights,
};
use refit_runtime::{ModelId, Version, WeightSet};

const BATCH: usize = 1000;

/// Random weights in the policy layout, stamped `version`.
fn weights(rng: &mut SmallRng, version: u64) -> Result<WeightSet, Box<dyn std::error::Error>> {
    let manifest = Arc::new(MlpPolicy::manifest_for(&[4, 64, 64, 2])?);
    let mut ws = WeightSet::zeroed(ModelId::new("policy")?, Arc::clone(&manifest));
    for t in manifest.tensors() {
        let scale = 1.0 / (t.shape.last().copied().unwrap_or(1) as f32).sqrt();
        for v in ws.view_mut::<f32>(&t.name)? {
            *v = rng.random_range(-scale..scale);
        }
    }
    ws.set_version(Version(version));
    Ok(ws)
}

fn envs(n: usize, seed: u64) -> Vec<CartPole> {
    (0..n)
        .map(|i| CartPole::new(seed + i as u64).with_index(i))
        .collect()
}

struct Run {
    name: &'static str,
    frames: u64,
    wall: Duration,
    updates: u64,
    update_time: Duration,
    worker_sync: Duration,
}

impl Run {
    fn print(&self) {
        let fps = self.frames as f64 / self.wall.as_secs_f64();
        println!(
            "{:<22} {:>9.0} frames/s  ({} frames in {:.2} s; {:>5.1}x TorchRL's {})  \
             {} updates: {:.2} ms in update calls ({:.1} us each), {:.2} ms polling+applying in workers",
            self.name,
            fps,
            self.frames,
            self.wall.as_secs_f64(),
            fps / if self.name.starts_with("single") {
                1500.0
            } else {
                3200.0
            },
            if self.name.starts_with("single") {
                "1.5k"
            } else {
                "3.2k"
            },
            self.updates,
            self.update_time.as_secs_f64() * 1e3,
            self.update_time.as_secs_f64() * 1e6 / self.updates.max(1) as f64,
            self.worker_sync.as_secs_f64() * 1e3,
        );
    }
}

/// CartPole collection speed: one worker, two synchronous and two asynchronous worker
/// threads, with a weight update after every batch.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Args {
    /// Frames to collect per measurement.
    #[arg(long, default_value_t = 200_000)]
    frames: u64,
    /// Environments per worker.
    #[arg(long, default_value_t = 1)]
    envs: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    refit::init()?;
    let Args {
        frames: total,
        envs: n_envs,
    } = Args::parse();
    let mut rng = SmallRng::seed_from_u64(1);
    println!(
        "CartPole, MLP 4-64-64-2 tanh, {n_envs} env(s) per worker, weight update after every {BATCH}-frame batch"
    );

    // One worker: the collector applies the update itself.
    {
        let mut c = Collector::builder(envs(n_envs, 0), MlpPolicy::cartpole()?)
            .frames_per_batch(BATCH)
            .build()?;
        let mut version = 1;
        c.update_weights(weights(&mut rng, version)?)?;
        let (mut frames, mut update_time, mut sync) = (0u64, Duration::ZERO, Duration::ZERO);
        let start = Instant::now();
        while frames < total {
            let Some(b) = c.next_batch()? else { break };
            frames += b.frames as u64;
            sync += b.weight_sync;
            version += 1;
            let ws = weights(&mut rng, version)?;
            let t = Instant::now();
            c.update_weights(ws)?;
            update_time += t.elapsed();
        }
        Run {
            name: "single worker",
            frames,
            wall: start.elapsed(),
            updates: version - 1,
            update_time,
            worker_sync: sync,
        }
        .print();
    }

    for asynchronous in [false, true] {
        let hub = refit_transports::inproc::InProc::new();
        let mut workers = Vec::new();
        for w in 0..2u64 {
            let c = Collector::builder(envs(n_envs, 100 * w), MlpPolicy::cartpole()?)
                .frames_per_batch(if asynchronous { BATCH } else { BATCH / 2 })
                .build()?;
            workers.push((c, hub.receiver()));
        }
        let initial = vec![weights(&mut rng, 1)?];
        let cfg = MultiConfig {
            total_frames: Some(total),
            queue_depth: 2,
            ..MultiConfig::default()
        };
        let (mut frames, mut update_time, mut sync, mut version) =
            (0u64, Duration::ZERO, Duration::ZERO, 1);
        let start = Instant::now();
        let mut step = |c: &mut dyn FnMut(WeightSet) -> refit_actors::Result<()>,
                        b: refit_actors::Batch|
         -> Result<(), Box<dyn std::error::Error>> {
            frames += b.frames as u64;
            sync += b.weight_sync;
            version += 1;
            let ws = weights(&mut rng, version)?;
            let t = Instant::now();
            c(ws)?;
            update_time += t.elapsed();
            Ok(())
        };
        let name = if asynchronous {
            let mut c = MultiAsyncCollector::spawn(hub.sender()?, workers, initial, cfg)?;
            while let Some(b) = c.next_batch()? {
                step(&mut |ws| c.update_weights(ws), b)?;
            }
            c.shutdown()?;
            "2 workers, async"
        } else {
            let mut c = MultiSyncCollector::spawn(hub.sender()?, workers, initial, cfg)?;
            while let Some(b) = c.next_batch()? {
                step(&mut |ws| c.update_weights(ws), b)?;
            }
            c.shutdown()?;
            "2 workers, sync"
        };
        Run {
            name,
            frames,
            wall: start.elapsed(),
            updates: version - 1,
            update_time,
            worker_sync: sync,
        }
        .print();
    }
    Ok(())
}
