//! PPO on CartPole: one trainer and several collector workers, until the mean return of the
//! last 20 episodes reaches 475. By default the workers are separate processes (this program
//! re-run as `worker`) fed with weights through shared memory; `--threads` runs them as
//! threads over the in-process transport, `--async` as asynchronous threads,
//! `--async-processes` as asynchronous worker processes (batches as they come). `--help`
//! lists every option.
//!
//! `--sync-mode sync|fully-async|batch-async` (or `--sync-config FILE.toml`) runs the actor
//! topology instead: rollout worker actors act through an inference engine actor, and the
//! weight-sync controller decides when each new version loads and when rollouts wait.
//!
//! ```text
//! cargo run --release --example cartpole -- [--workers 2] [--envs 4] [--frames-per-batch 2048]
//!     [--threads | --async | --async-processes | --sync-mode MODE | --sync-config FILE]
//!     [--staleness-threshold 2]
//!     [--seed 0] [--max-time-s 60] [--target 475] [--total-frames 2000000]
//! ```
//!
//! `cartpole topology` runs one rank of a topology file spread over processes and hosts, as
//! `refit launch` starts it (`refit launch examples/topologies/cartpole-processes.toml`).
//!
//! The run stops, solved, once the target is reached; it fails (exit code 1) when the frame
//! budget (`--total-frames`; in the actor topology it buys `total / frames-per-batch`
//! updates, rounded up) or the time budget is spent first.

use std::collections::VecDeque;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::{CommandFactory, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use refit_actors::ModelSpec;
use refit_actors::process::{
    ProcessAsyncCollector, ProcessConfig, ProcessSyncCollector, WorkerLink, serve_worker,
    worker_receiver,
};
use refit_actors::run::{self, RunConfig, StopRule};
use refit_actors::{
    Batch, CartPole, CartPolePpo, Collector, MlpPolicy, MultiAsyncCollector, MultiConfig,
    MultiSyncCollector, PpoConfig, PpoTrainer, UpdatePolicyWeights,
};
use refit_runtime::sync_policy::{SyncConfig, SyncMode};

#[path = "support/cartpole_topology.rs"]
mod cartpole_topology;

/// PPO on CartPole-v1 with collector workers (processes by default), or through the actor
/// topology with `--sync-mode` / `--sync-config`.
#[derive(Parser, Debug)]
#[command(long_about = None, args_conflicts_with_subcommands = true)]
struct Args {
    /// Collector workers (or rollout worker actors).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Environments per worker.
    #[arg(long, default_value_t = 4)]
    envs: usize,
    /// Frames per training batch, all workers together.
    #[arg(long, default_value_t = 2048)]
    frames_per_batch: usize,
    /// Asynchronous worker threads over the in-process transport.
    #[arg(long = "async")]
    asynchronous: bool,
    /// Synchronous worker threads over the in-process transport.
    #[arg(long)]
    threads: bool,
    /// Asynchronous worker processes over shared memory (batches as they come).
    #[arg(long, conflicts_with_all = ["asynchronous", "threads"])]
    async_processes: bool,
    /// The weight link of worker processes, by name (shm, tcp, file: any transport of the
    /// link factory that reaches another process).
    #[arg(long, default_value = "shm")]
    transport: String,
    /// Seed of the trainer, the environments and the workers.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Time budget in seconds (`[stop] max_time_s` of a topology file).
    #[arg(
        long = "max-time-s",
        visible_alias = "max-seconds",
        default_value_t = 60.0
    )]
    max_time_s: f64,
    /// Mean return over the last 20 episodes that counts as solved.
    #[arg(long, default_value_t = 475.0)]
    target: f64,
    /// Frame budget.
    #[arg(long, default_value_t = 2_000_000)]
    total_frames: u64,
    /// Runs the actor topology in this sync mode: sync, batch-async or fully-async.
    #[arg(long, value_parser = parse_sync_mode)]
    sync_mode: Option<SyncMode>,
    /// Runs the actor topology with this sync configuration (TOML).
    #[arg(long)]
    sync_config: Option<std::path::PathBuf>,
    /// The actor topology's staleness threshold (overrides the configuration's).
    #[arg(long)]
    staleness_threshold: Option<u64>,
    #[command(subcommand)]
    command: Option<Sub>,
}

#[derive(Subcommand, Debug)]
enum Sub {
    /// One rank of a topology file, as `refit launch` starts it: reads `REFIT_TOPOLOGY` with
    /// the launch's overrides (`refit launch FILE --set sync.sync_mode=fully-async`) and the
    /// launch variables.
    Topology,
    /// A collector worker process (spawned by this program).
    #[command(hide = true)]
    Worker {
        /// Worker index.
        w: usize,
        /// Environments.
        envs: usize,
        /// Frames per batch.
        frames: usize,
        /// Seed.
        seed: u64,
    },
}

fn parse_sync_mode(s: &str) -> Result<SyncMode, String> {
    SyncMode::parse(s).map_err(|e| e.to_string())
}

fn parse_args() -> Args {
    let a = Args::parse();
    if a.command.is_none()
        && (a.workers == 0 || a.envs == 0 || a.frames_per_batch < a.workers * a.envs)
    {
        Args::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                "workers, envs and frames per batch must be positive (and frames per batch at least workers x envs)",
            )
            .exit();
    }
    a
}

/// What the loop reports at the end.
struct Outcome {
    solved: bool,
    frames: u64,
    updates: u64,
    mean_return: f64,
    episodes: usize,
    update_time: Duration,
    train_time: Duration,
}

fn train<C>(
    mut collector: C,
    trainer: &mut PpoTrainer,
    args: &Args,
    start: Instant,
) -> Result<Outcome, Box<dyn std::error::Error>>
where
    C: UpdatePolicyWeights + Iterator<Item = refit_rl::Result<Batch>>,
{
    let pb = ProgressBar::new(args.total_frames);
    pb.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} frames {per_sec} {msg}",
        )?
        .progress_chars("=> "),
    );
    let mut last20: VecDeque<f64> = VecDeque::with_capacity(20);
    let mut out = Outcome {
        solved: false,
        frames: 0,
        updates: 0,
        mean_return: 0.0,
        episodes: 0,
        update_time: Duration::ZERO,
        train_time: Duration::ZERO,
    };
    while let Some(batch) = collector.next() {
        let batch = batch?;
        out.frames += batch.frames as u64;
        out.episodes += batch.episodes.len();
        for e in &batch.episodes {
            if last20.len() == 20 {
                last20.pop_front();
            }
            last20.push_back(e.ret);
        }
        let mean = if last20.is_empty() {
            0.0
        } else {
            last20.iter().sum::<f64>() / last20.len() as f64
        };
        out.mean_return = mean;
        let (lo, hi) = batch.version_range().unwrap_or_default();
        let staleness = trainer.version().get().saturating_sub(lo.get());
        if last20.len() == 20 && mean >= args.target {
            out.solved = true;
            pb.suspend(|| println!(
                "frames {:>7}  mean return {mean:>6.1}  (solved with weights v{}..v{hi}, staleness {staleness})",
                out.frames, lo
            ));
            break;
        }
        // ANCHOR: update
        let stats = trainer.update(&batch)?;
        out.train_time += stats.elapsed;
        let t = Instant::now();
        let ws = trainer.export()?;
        collector.update_weights(ws)?;
        let update = t.elapsed();
        out.update_time += update;
        // ANCHOR_END: update
        out.updates += 1;
        pb.set_position(out.frames.min(args.total_frames));
        pb.set_message(format!("return {mean:.1}"));
        pb.suspend(|| println!(
            "frames {:>7}  mean return {mean:>6.1}  episodes {:>4}  weights v{lo}..v{hi} -> v{}  staleness {staleness}  \
             train {:>4} ms  update {:>5} us  kl {:.4}  entropy {:.3}",
            out.frames,
            out.episodes,
            trainer.version(),
            stats.elapsed.as_millis(),
            update.as_micros(),
            stats.approx_kl,
            stats.entropy,
        ));
        if start.elapsed().as_secs_f64() > args.max_time_s || out.frames >= args.total_frames {
            break;
        }
    }
    pb.finish_and_clear();
    Ok(out)
}

/// The collector of worker `w`: the same in a thread or in a worker process.
fn worker_collector(
    w: usize,
    envs: usize,
    per_worker: usize,
    seed: u64,
) -> refit_rl::Result<Collector<CartPole, MlpPolicy>> {
    let envs = (0..envs)
        .map(|i| CartPole::new(seed * 1000 + (w * envs + i) as u64).with_index(i))
        .collect();
    Collector::builder(envs, MlpPolicy::cartpole()?)
        .frames_per_batch(per_worker)
        .seed(seed.wrapping_mul(7919).wrapping_add(w as u64))
        .build()
}

// ANCHOR: process_worker
/// `cartpole worker W ENVS FRAMES SEED`: a collector worker process. It delivers its
/// batches to the trainer's collector as calls to the collector's node (address and cluster
/// token in its environment); weights arrive over the link its environment names (shared
/// memory by default), whatever its transport. The same worker serves the synchronous and
/// the asynchronous process collectors.
fn run_worker_process(
    w: usize,
    envs: usize,
    frames: usize,
    seed: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let collector = worker_collector(w, envs, frames, seed)?;
    let receiver = worker_receiver()?;
    serve_worker(collector, w, receiver, Duration::from_secs(30))?;
    Ok(())
}
// ANCHOR_END: process_worker

/// Runs [`run`]; an error is one `error: ...` line (what `refit launch` repeats).
fn main() -> std::process::ExitCode {
    refit::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args();
    if let Some(Sub::Worker {
        w,
        envs,
        frames,
        seed,
    }) = &args.command
    {
        refit::init()?;
        return run_worker_process(*w, *envs, *frames, *seed);
    }
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // candle sizes its matmul fan-out from this variable (not from the current rayon
        // pool); on a 4-64-64-2 network, splitting a matmul costs more than it saves, and
        // the collector threads want the other core.
        // SAFETY: no other thread exists yet (nothing has been spawned), so nothing reads
        // the environment concurrently.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    // logging and SIGINT/SIGTERM handling (starts a thread: after the environment is set)
    refit::init()?;
    if matches!(args.command, Some(Sub::Topology)) {
        if !cartpole_topology::run_rank()? {
            run::exit_unsolved();
        }
        return Ok(());
    }
    if args.sync_mode.is_some() || args.sync_config.is_some() {
        return run_actors(&args);
    }
    let start = Instant::now();
    let mut trainer = PpoTrainer::new(PpoConfig {
        lr: 1e-3,
        epochs: 8,
        minibatch: 512,
        gamma: 0.99,
        gae_lambda: 0.95,
        clip: 0.2,
        ent_coef: 0.0,
        seed: args.seed,
        ..PpoConfig::default()
    })?;
    let per_worker = args.frames_per_batch / args.workers;
    let initial = vec![trainer.export()?];
    let config = MultiConfig::default();
    println!(
        "cartpole: {} workers x {} envs, {} frames per {}, ppo lr {} epochs {} minibatch {}",
        args.workers,
        args.envs,
        per_worker * args.workers,
        if args.async_processes {
            format!(
                "worker batch (async worker processes, {} weights)",
                args.transport
            )
        } else if args.asynchronous {
            "worker batch (async threads, in-process weights)".into()
        } else if args.threads {
            "batch (sync threads, in-process weights)".into()
        } else {
            format!("batch (sync worker processes, {} weights)", args.transport)
        },
        trainer.config().lr,
        trainer.config().epochs,
        trainer.config().minibatch
    );
    let hub = refit_transports::inproc::InProc::new();
    let mut workers = Vec::new();
    if args.threads || args.asynchronous {
        for w in 0..args.workers {
            let c = worker_collector(w, args.envs, per_worker, args.seed)?;
            workers.push((c, hub.receiver()));
        }
    }
    let out = if !args.threads && !args.asynchronous {
        let sync_processes = !args.async_processes;
        // ANCHOR: processes
        // the link factory opens the transport named on the command line (shm by default)
        let link = WorkerLink::open(&args.transport, &initial, args.workers)?;
        let exe = std::env::current_exe()?;
        let commands = (0..args.workers)
            .map(|w| {
                let mut c = Command::new(&exe);
                c.arg("worker").arg(w.to_string());
                c.arg(args.envs.to_string()).arg(per_worker.to_string());
                c.arg(args.seed.to_string());
                link.configure(&mut c)?;
                Ok(c)
            })
            .collect::<refit_rl::Result<Vec<_>>>()?;
        let config = ProcessConfig::default();
        if sync_processes {
            let c = ProcessSyncCollector::spawn(link.sender, commands, initial, config)?;
            train(c, &mut trainer, &args, start)?
        } else {
            // workers collect continuously; each batch is one worker's, as it arrives
            let c = ProcessAsyncCollector::spawn(link.sender, commands, initial, config)?;
            train(c, &mut trainer, &args, start)?
        }
        // ANCHOR_END: processes
    } else if args.asynchronous {
        let c = MultiAsyncCollector::spawn(hub.sender()?, workers, initial, config)?;
        train(c, &mut trainer, &args, start)?
    } else {
        let c = MultiSyncCollector::spawn(hub.sender()?, workers, initial, config)?;
        train(c, &mut trainer, &args, start)?
    };
    let wall = start.elapsed();
    println!(
        "{}: mean return {:.1} over the last 20 episodes after {} frames, {} episodes, {} updates, \
         {:.1} s wall ({:.0} frames/s overall); training {:.1} s, weight export+publish {:.2} ms total",
        if out.solved { "solved" } else { "NOT solved" },
        out.mean_return,
        out.frames,
        out.episodes,
        out.updates,
        wall.as_secs_f64(),
        out.frames as f64 / wall.as_secs_f64(),
        out.train_time.as_secs_f64(),
        out.update_time.as_secs_f64() * 1e3,
    );
    if !out.solved {
        std::process::exit(1);
    }
    Ok(())
}

// ANCHOR: actors
/// The actor topology: rollout workers act through the inference engine; the controller
/// decides when each version loads and when rollouts wait.
fn run_actors(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut sync = match &args.sync_config {
        Some(path) => SyncConfig::from_file_text(&refit::read_config(path)?, path)?,
        None => SyncConfig::default(),
    };
    if let Some(mode) = args.sync_mode {
        sync.sync_mode = mode;
    }
    if let Some(t) = args.staleness_threshold {
        sync.staleness_threshold = t;
    }
    sync.check()?;
    let mut spec = ModelSpec::new(refit_actors::policy_model_id(), args.seed);
    spec.workers = args.workers;
    spec.envs_per_worker = args.envs;
    spec.batch_frames = args.frames_per_batch;
    let cfg = RunConfig {
        sync: sync.clone(),
        models: vec![spec],
        eval_episodes: 10,
        stop: StopRule {
            target_eval: None,
            max_updates: args.total_frames.div_ceil(args.frames_per_batch as u64),
            target_return: Some(args.target),
            max_time: Duration::from_secs_f64(args.max_time_s),
        },
        seed: args.seed,
        wrap_inlet: None,
        wait: Duration::from_secs(60),
    };
    println!(
        "cartpole (actors): sync mode {}, staleness threshold {}, filter {}, {} rollout workers x {} envs, batches of {} frames",
        sync.sync_mode,
        sync.staleness_threshold,
        sync.allowed_staleness()
            .map_or("keeps all".to_string(), |s| format!(
                "drops staleness > {s}"
            )),
        args.workers,
        args.envs,
        args.frames_per_batch
    );
    let report = actix_rt::System::new().block_on(run::run(cfg, CartPolePpo::new()))?;
    for (model, r) in &report.models {
        for u in &r.updates {
            println!(
                "{model} v{:>3} -> v{:<3} frames {:>5}  samples v{}..v{}  max staleness {}  dropped {:>4}  evicted {:>5}  mean return {:>6.1}",
                u.train_version,
                u.published,
                u.frames,
                u.sample_versions.0,
                u.sample_versions.1,
                u.max_staleness,
                u.dropped,
                u.evicted,
                u.mean_return
            );
        }
        for e in &r.evals {
            for (m, ev) in &e.models {
                println!(
                    "eval at v{}: {m} mean return {:.1} over {} episodes",
                    e.step, ev.mean_return, ev.episodes
                );
            }
        }
        let c = &report.controller.models[model];
        let s = &r.staleness;
        println!(
            "{}: {model} mean return {:.1} over the last 20 episodes after {} frames, {} updates, {:.1} s wall; \
             staleness of trained samples mean {:.2} max {} (dropped {}, evicted from a full pool {}); rollouts admitted {}, blocked {} ({:.0} ms waiting), \
             staleness at admission max {}; engine paused {:.2} ms in total over {} loads (longest {:.3} ms)",
            if report.solved {
                "solved"
            } else {
                "NOT solved"
            },
            r.mean_return,
            r.frames,
            r.updates.len(),
            report.elapsed.as_secs_f64(),
            s.mean_kept(),
            s.max_kept,
            s.dropped,
            r.evicted,
            c.admissions,
            c.blocked,
            c.waited.as_secs_f64() * 1e3,
            c.max_staleness,
            report.engine.paused_total.as_secs_f64() * 1e3,
            report.engine.loads,
            report.engine.paused_max.as_secs_f64() * 1e3,
        );
    }
    if !report.solved {
        run::exit_unsolved();
    }
    Ok(())
}
// ANCHOR_END: actors
