//! Collector throughput: CartPole with the 4-64-64-2 MLP policy, one worker, then two
//! worker threads (sync and async), then worker processes (one and two, sync; two, async),
//! with a weight update after every 1000-frame batch.
//!
//! ```text
//! cargo run --release --example collector_bench -- [--frames 200000] [--envs 1]
//! ```
//!
//! Each figure is printed with its ratio to a baseline measured in the same run: every
//! collector against the single in-process collector (what the workers' own stepping costs),
//! and the worker processes' batch traffic against a loopback TCP socket's throughput (what
//! moving the batches could cost at most).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use refit_actors::process::{
    ProcessAsyncCollector, ProcessConfig, ProcessSyncCollector, WorkerLink, serve_worker,
    worker_receiver,
};
use refit_actors::{
    Batch, CartPole, Collector, MlpPolicy, MultiAsyncCollector, MultiConfig, MultiSyncCollector,
    UpdatePolicyWeights,
};
use refit_runtime::{ModelId, Version, WeightSet, wire};

const BATCH: usize = 1000;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Random weights in the policy layout, stamped `version`.
fn weights(rng: &mut SmallRng, version: u64) -> Res<WeightSet> {
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

/// What one measurement counted.
#[derive(Default)]
struct Tally {
    frames: u64,
    /// Encoded bytes per frame of the first batch (measured when batches cross processes).
    bytes_per_frame: f64,
    updates: u64,
    update_time: Duration,
    worker_sync: Duration,
}

struct Baselines {
    /// Frames per second of the single in-process collector.
    single: f64,
    /// Bytes per second through a loopback TCP socket.
    loopback: f64,
}

impl Tally {
    /// Counts one batch.
    fn batch(&mut self, b: &Batch) {
        self.frames += b.frames as u64;
        self.worker_sync += b.weight_sync;
    }

    fn print(&self, name: &str, wall: Duration, base: &Baselines) -> f64 {
        let fps = self.frames as f64 / wall.as_secs_f64();
        let vs_single = if base.single > 0.0 {
            format!("{:.2}x one in-process collector", fps / base.single)
        } else {
            "the baseline".into()
        };
        let traffic = if self.bytes_per_frame > 0.0 {
            let bps = fps * self.bytes_per_frame;
            format!(
                "; batches {:.1} MB/s = {:.2}% of loopback TCP",
                bps / 1e6,
                100.0 * bps / base.loopback
            )
        } else {
            String::new()
        };
        println!(
            "{name:<26} {fps:>9.0} frames/s ({vs_single}{traffic}); {} frames in {:.2} s, \
             {} updates: {:.1} us per update call, {:.2} ms polling+applying in workers",
            self.frames,
            wall.as_secs_f64(),
            self.updates,
            self.update_time.as_secs_f64() * 1e6 / self.updates.max(1) as f64,
            self.worker_sync.as_secs_f64() * 1e3,
        );
        fps
    }
}

/// Bytes per second one thread writes to another through a loopback TCP socket (64 KiB
/// writes, about 0.5 s).
fn loopback_throughput() -> Res<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let writer = std::thread::spawn(move || -> std::io::Result<u64> {
        let mut s = TcpStream::connect(addr)?;
        let chunk = vec![7u8; 64 << 10];
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < Duration::from_millis(500) {
            s.write_all(&chunk)?;
            sent += chunk.len() as u64;
        }
        Ok(sent)
    });
    let (mut s, _) = listener.accept()?;
    let mut buf = vec![0u8; 64 << 10];
    let start = Instant::now();
    let mut got = 0u64;
    loop {
        match s.read(&mut buf)? {
            0 => break,
            n => got += n as u64,
        }
    }
    let wall = start.elapsed();
    let sent = writer
        .join()
        .map_err(|_| "the loopback writer panicked")??;
    if sent != got {
        return Err(format!("loopback: {sent} bytes sent, {got} received").into());
    }
    Ok(got as f64 / wall.as_secs_f64())
}

/// CartPole collection speed: one worker, two synchronous and two asynchronous worker
/// threads, then worker processes, with a weight update after every batch.
#[derive(Parser, Debug)]
#[command(long_about = None, args_conflicts_with_subcommands = true)]
struct Args {
    /// Frames to collect per measurement.
    #[arg(long, default_value_t = 200_000)]
    frames: u64,
    /// Environments per worker.
    #[arg(long, default_value_t = 1)]
    envs: usize,
    #[command(subcommand)]
    command: Option<Sub>,
}

#[derive(Subcommand, Debug)]
enum Sub {
    /// A worker process (started by this program).
    #[command(hide = true)]
    Worker {
        /// Worker index.
        w: usize,
        /// Environments.
        envs: usize,
        /// Frames per batch.
        frames: usize,
    },
}

fn worker_process(w: usize, n_envs: usize, frames: usize) -> Res<()> {
    let c = Collector::builder(envs(n_envs, 100 * w as u64), MlpPolicy::cartpole()?)
        .frames_per_batch(frames)
        .build()?;
    serve_worker(c, w, worker_receiver()?, Duration::from_secs(30))?;
    Ok(())
}

fn main() -> Res<()> {
    let args = Args::parse();
    refit::init()?;
    if let Some(Sub::Worker { w, envs, frames }) = args.command {
        return worker_process(w, envs, frames);
    }
    let Args {
        frames: total,
        envs: n_envs,
        ..
    } = args;
    let mut rng = SmallRng::seed_from_u64(1);
    let loopback = loopback_throughput()?;
    println!(
        "CartPole, MLP 4-64-64-2 tanh, {n_envs} env(s) per worker, weight update after every \
         {BATCH}-frame batch; loopback TCP {:.2} GB/s",
        loopback / 1e9
    );
    let mut base = Baselines {
        single: 0.0,
        loopback,
    };

    // One worker: the collector applies the update itself.
    {
        let mut c = Collector::builder(envs(n_envs, 0), MlpPolicy::cartpole()?)
            .frames_per_batch(BATCH)
            .build()?;
        c.update_weights(weights(&mut rng, 1)?)?;
        let mut tally = Tally::default();
        let wall = drive(&mut c, total, false, &mut rng, &mut tally)?;
        base.single = tally.print("single worker", wall, &base);
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
        let mut tally = Tally::default();
        let (name, wall) = if asynchronous {
            let mut c = MultiAsyncCollector::spawn(hub.sender()?, workers, initial, cfg)?;
            let wall = drive(&mut c, total, false, &mut rng, &mut tally)?;
            c.shutdown()?;
            ("2 threads, async", wall)
        } else {
            let mut c = MultiSyncCollector::spawn(hub.sender()?, workers, initial, cfg)?;
            let wall = drive(&mut c, total, false, &mut rng, &mut tally)?;
            c.shutdown()?;
            ("2 threads, sync", wall)
        };
        tally.print(name, wall, &base);
    }

    for (workers, asynchronous) in [(1, false), (2, false), (2, true)] {
        let initial = vec![weights(&mut rng, 1)?];
        let link = WorkerLink::open("shm", &initial, workers)?;
        let per_worker = if asynchronous { BATCH } else { BATCH / workers };
        let exe = std::env::current_exe()?;
        let commands = (0..workers)
            .map(|w| {
                let mut c = Command::new(&exe);
                c.arg("worker").arg(w.to_string());
                c.arg(n_envs.to_string()).arg(per_worker.to_string());
                link.configure(&mut c)?;
                Ok(c)
            })
            .collect::<refit_actors::Result<Vec<_>>>()?;
        let config = ProcessConfig {
            total_frames: Some(total),
            queue_depth: 2,
            ..ProcessConfig::default()
        };
        let mut tally = Tally::default();
        let (name, wall) = if asynchronous {
            let mut c = ProcessAsyncCollector::spawn(link.sender, commands, initial, config)?;
            let wall = drive(&mut c, total, true, &mut rng, &mut tally)?;
            c.shutdown()?;
            (format!("{workers} processes, async"), wall)
        } else {
            let mut c = ProcessSyncCollector::spawn(link.sender, commands, initial, config)?;
            let wall = drive(&mut c, total, true, &mut rng, &mut tally)?;
            c.shutdown()?;
            let plural = if workers == 1 { "process" } else { "processes" };
            (format!("{workers} {plural}, sync"), wall)
        };
        tally.print(&name, wall, &base);
    }
    Ok(())
}

/// Takes `total` frames of batches from `c` (or all it yields), publishing fresh random
/// weights after each; answers the time of that loop alone (starting and stopping the
/// collector are not in it, whatever the collector). When `crossed` (batches came from
/// other processes), the first batch is encoded afterwards to learn the bytes per frame.
fn drive<C>(
    c: &mut C,
    total: u64,
    crossed: bool,
    rng: &mut SmallRng,
    tally: &mut Tally,
) -> Res<Duration>
where
    C: Iterator<Item = refit_actors::Result<Batch>> + UpdatePolicyWeights,
{
    let mut first: Option<Batch> = None;
    let start = Instant::now();
    while tally.frames < total {
        let Some(b) = c.next().transpose()? else {
            break;
        };
        tally.batch(&b);
        if crossed && first.is_none() {
            first = Some(b);
        }
        let ws = weights(rng, tally.updates + 2)?;
        let t = Instant::now();
        c.update_weights(ws)?;
        tally.update_time += t.elapsed();
        tally.updates += 1;
    }
    let wall = start.elapsed();
    if let Some(b) = first.filter(|b| b.frames > 0) {
        tally.bytes_per_frame = wire::encode(&b)?.len() as f64 / b.frames as f64;
    }
    Ok(wall)
}
