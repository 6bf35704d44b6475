//! Collector throughput: CartPole with the 4-64-64-2 MLP policy, one worker, then two
//! worker threads (sync and async), then worker processes (one and two, sync; two, async),
//! with a weight update after every 1000-frame batch.
//!
//! ```text
//! cargo run --release --example collector_bench -- [--frames 200000] [--envs 1] [--rounds 5]
//! ```
//!
//! Every figure is printed with its ratio to a baseline measured in the same run: each
//! collector against a bare loop doing the same work with no framework (the same
//! environments stepped side by side, the same MLP forward and sampling, each transition
//! written into flat columns; no collector, no actors, no weight sync), and the worker
//! processes' batch traffic against a loopback TCP socket's throughput (what moving the
//! batches could cost at most). The bare loop and the one-worker collector run in alternate
//! rounds (`--rounds`), so machine load falls on both alike, and their medians are compared
//! against the goal: one worker at 0.9x the bare loop or better.

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
    Batch, CartPole, Collector, Env, MlpPolicy, MultiAsyncCollector, MultiConfig,
    MultiSyncCollector, Policy, UpdatePolicyWeights,
};
use refit_runtime::{HasWeights, ModelId, Version, WeightSet, wire};

const BATCH: usize = 1000;
/// The goal for one worker, as a fraction of the bare loop's frames per second.
const GOAL: f64 = 0.9;

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

/// One batch of transitions as a hand-written loop keeps them: flat columns, reused.
#[derive(Default)]
struct Columns {
    obs: Vec<f32>,
    next_obs: Vec<f32>,
    actions: Vec<u32>,
    log_probs: Vec<f32>,
    rewards: Vec<f32>,
    terminated: Vec<bool>,
    truncated: Vec<bool>,
    /// Returns of the episodes that ended.
    returns: Vec<f64>,
}

impl Columns {
    fn clear(&mut self) {
        self.obs.clear();
        self.next_obs.clear();
        self.actions.clear();
        self.log_probs.clear();
        self.rewards.clear();
        self.terminated.clear();
        self.truncated.clear();
        self.returns.clear();
    }
}

/// The bare loop: what one worker does with no framework. `n_envs` CartPoles stepped side
/// by side, the same policy (`weights` loaded once) acting on each, every transition
/// written into [`Columns`], finished environments reset, `BATCH` frames per batch, until
/// `total` frames. Answers the frames and the loop's time (wall and this thread's CPU).
fn bare_loop(total: u64, n_envs: usize, weights: &WeightSet) -> Res<(u64, Timed)> {
    let mut envs = envs(n_envs, 0);
    let mut policy = MlpPolicy::cartpole()?;
    policy.read_weights(weights)?;
    let mut rng = SmallRng::seed_from_u64(0);
    let mut obs = envs
        .iter_mut()
        .enumerate()
        .map(|(i, e)| e.reset(Some(i as u64)))
        .collect::<refit_rl::Result<Vec<_>>>()?;
    let mut ret = vec![0.0f64; n_envs];
    let steps = BATCH.div_ceil(n_envs);
    let mut cols = Columns::default();
    let mut frames = 0u64;
    let start = Timed::start();
    while frames < total {
        cols.clear();
        for _ in 0..steps {
            for (i, env) in envs.iter_mut().enumerate() {
                let out = policy.act(&obs[i], &mut rng);
                let r = env.step(out.action)?;
                ret[i] += f64::from(r.reward);
                cols.obs.extend_from_slice(&obs[i]);
                cols.next_obs.extend_from_slice(&r.obs);
                cols.actions.push(out.action as u32);
                cols.log_probs.push(out.log_prob);
                cols.rewards.push(r.reward);
                cols.terminated.push(r.terminated);
                cols.truncated.push(r.truncated);
                if r.done() {
                    cols.returns.push(std::mem::take(&mut ret[i]));
                    obs[i] = env.reset(None)?;
                } else {
                    obs[i] = r.obs;
                }
            }
        }
        std::hint::black_box(&cols);
        frames += (steps * n_envs) as u64;
    }
    Ok((frames, start.elapsed()))
}

/// Nanoseconds this thread has run on a CPU (`/proc/thread-self/schedstat`, Linux), or
/// `None` where that file is missing.
fn thread_cpu_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// A loop's wall time and the CPU time of the thread that ran it: on a loaded machine the
/// wall time counts the time other processes held the core, the CPU time does not, so
/// single-threaded loops are compared on both.
#[derive(Clone, Copy, Default)]
struct Timed {
    wall: Duration,
    cpu: Option<Duration>,
    since: Option<(Instant, Option<u64>)>,
}

impl Timed {
    fn start() -> Self {
        Self {
            since: Some((Instant::now(), thread_cpu_ns())),
            ..Self::default()
        }
    }

    fn elapsed(&self) -> Self {
        let Some((t, cpu0)) = self.since else {
            return *self;
        };
        let cpu = cpu0
            .zip(thread_cpu_ns())
            .map(|(a, b)| Duration::from_nanos(b.saturating_sub(a)));
        Self {
            wall: t.elapsed(),
            cpu,
            since: None,
        }
    }
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
    /// Frames per second of the bare loop (median of the rounds).
    bare: f64,
    /// Bytes per second through a loopback TCP socket.
    loopback: f64,
}

impl Tally {
    /// Counts one batch.
    fn batch(&mut self, b: &Batch) {
        self.frames += b.frames as u64;
        self.worker_sync += b.weight_sync;
    }

    fn fps(&self, wall: Duration) -> f64 {
        self.frames as f64 / wall.as_secs_f64()
    }

    fn print(&self, out: &mut Out, name: &str, wall: Duration, base: &Baselines) {
        let fps = self.fps(wall);
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
        out.line(format!(
            "{name:<22} {fps:>9.0} frames/s {:>6.3}x bare loop{traffic}; {} frames in {:.2} s, \
             {} updates: {:.1} us per update call, {:.2} ms polling+applying in workers",
            fps / base.bare,
            self.frames,
            wall.as_secs_f64(),
            self.updates,
            self.update_time.as_secs_f64() * 1e6 / self.updates.max(1) as f64,
            self.worker_sync.as_secs_f64() * 1e3,
        ));
        out.row(name, fps, fps / base.bare, 1, None);
    }
}

/// What the run prints: lines of text, or (`--json`) one JSON array of rows at the end.
struct Out {
    json: bool,
    rows: Vec<String>,
}

impl Out {
    fn line(&self, text: String) {
        if !self.json {
            println!("{text}");
        }
    }

    /// One measured configuration: frames per wall second (a median of `rounds`), its ratio
    /// to the bare loop's, and frames per CPU-second of its thread where measured.
    fn row(&mut self, name: &str, fps: f64, vs_bare: f64, rounds: usize, cpu: Option<(f64, f64)>) {
        let num = |v: f64| {
            if v.is_finite() {
                format!("{v:.4}")
            } else {
                "null".into()
            }
        };
        let cpu = cpu.map_or(String::new(), |(fps, ratio)| {
            format!(
                ", \"cpu_frames_per_s\": {}, \"cpu_vs_bare\": {}",
                num(fps),
                num(ratio)
            )
        });
        self.rows.push(format!(
            "{{\"collector\": {name:?}, \"frames_per_s\": {}, \"vs_bare\": {}, \
             \"rounds\": {rounds}{cpu}}}",
            num(fps),
            num(vs_bare)
        ));
    }

    fn finish(&self) {
        if self.json {
            println!("[\n  {}\n]", self.rows.join(",\n  "));
        }
    }
}

/// Frames per second of several rounds: per wall second, and per second of CPU time of
/// the thread that ran them.
#[derive(Default)]
struct Rates {
    wall: Samples,
    cpu: Samples,
}

impl Rates {
    fn push(&mut self, frames: u64, t: Timed) {
        self.wall.0.push(frames as f64 / t.wall.as_secs_f64());
        if let Some(cpu) = t.cpu.filter(|c| !c.is_zero()) {
            self.cpu.0.push(frames as f64 / cpu.as_secs_f64());
        }
    }

    /// Median against median: wall, and CPU time where both were measured every round.
    fn ratios(&self, base: &Rates) -> (f64, Option<f64>) {
        let cpu = (self.cpu.0.len() == self.wall.0.len() && base.cpu.0.len() == base.wall.0.len())
            .then(|| self.cpu.median() / base.cpu.median());
        (self.wall.median() / base.wall.median(), cpu)
    }

    fn print(&self, out: &mut Out, name: &str, base: &Rates, rounds: usize) {
        let (wall, cpu) = self.ratios(base);
        let cpu_text = match cpu {
            Some(r) => format!(
                "; {:.0} frames per CPU-second {r:.3}x ({})",
                self.cpu.median(),
                self.cpu.range()
            ),
            None => String::new(),
        };
        out.line(format!(
            "{name:<22} {:>9.0} frames/s {wall:>6.3}x bare loop; median of {rounds} rounds \
             ({}){cpu_text}",
            self.wall.median(),
            self.wall.range(),
        ));
        let cpu = cpu.map(|r| (self.cpu.median(), r));
        out.row(name, self.wall.median(), wall, rounds, cpu);
    }
}

/// Figures of several rounds.
#[derive(Default)]
struct Samples(Vec<f64>);

impl Samples {
    fn median(&self) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    fn range(&self) -> String {
        let lo = self.0.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = self.0.iter().copied().fold(0.0, f64::max);
        format!("{lo:.0}-{hi:.0}")
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
    /// Rounds of the bare loop and the one-worker collector, alternating (medians compared).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Print one JSON array of the measured rows (collector, frames_per_s, vs_bare, ...)
    /// instead of text.
    #[arg(long)]
    json: bool,
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

/// Runs [`run`]; an error is one `error: ...` line.
fn main() -> std::process::ExitCode {
    refit::exit_code(run())
}

fn run() -> Res<()> {
    let args = Args::parse();
    refit::init()?;
    if let Some(Sub::Worker { w, envs, frames }) = args.command {
        return worker_process(w, envs, frames);
    }
    let Args {
        frames: total,
        envs: n_envs,
        rounds,
        json,
        ..
    } = args;
    if rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    let mut out = Out {
        json,
        rows: Vec::new(),
    };
    let mut rng = SmallRng::seed_from_u64(1);
    let loopback = loopback_throughput()?;
    out.line(format!(
        "CartPole, MLP 4-64-64-2 tanh, {n_envs} env(s) per worker, {total} frames per \
         measurement, weight update after every {BATCH}-frame batch; loopback TCP {:.2} GB/s",
        loopback / 1e9
    ));

    // The bare loop and one worker (the collector applies each update itself), in
    // alternate rounds.
    let bare_weights = weights(&mut rng, 1)?;
    let mut c = Collector::builder(envs(n_envs, 0), MlpPolicy::cartpole()?)
        .frames_per_batch(BATCH)
        .build()?;
    c.update_weights(weights(&mut rng, 1)?)?;
    let (mut bare, mut single) = (Rates::default(), Rates::default());
    let mut last = (Tally::default(), Duration::ZERO);
    for _ in 0..rounds {
        let (frames, t) = bare_loop(total, n_envs, &bare_weights)?;
        bare.push(frames, t);
        let mut tally = Tally::default();
        let t = drive(&mut c, total, false, &mut rng, &mut tally)?;
        single.push(tally.frames, t);
        last = (tally, t.wall);
    }
    drop(c);
    let base = Baselines {
        bare: bare.wall.median(),
        loopback,
    };
    bare.print(&mut out, "bare loop", &bare, rounds);
    single.print(&mut out, "1 worker", &bare, rounds);
    // the last round in detail (not a row of its own)
    let mut detail = Out {
        json: out.json,
        rows: Vec::new(),
    };
    last.0
        .print(&mut detail, "  (its last round)", last.1, &base);
    let (wall, cpu) = single.ratios(&bare);
    let verdict = |r: f64| if r >= GOAL { "met" } else { "NOT met" };
    out.line(match cpu {
        Some(cpu) => format!(
            "goal: 1 worker >= {GOAL:.2}x bare loop: {} on CPU time ({cpu:.3}x), {} on wall \
             time ({wall:.3}x)",
            verdict(cpu),
            verdict(wall)
        ),
        None => format!(
            "goal: 1 worker >= {GOAL:.2}x bare loop: {} ({wall:.3}x)",
            verdict(wall)
        ),
    });

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
            let wall = drive(&mut c, total, false, &mut rng, &mut tally)?.wall;
            c.shutdown()?;
            ("2 threads, async", wall)
        } else {
            let mut c = MultiSyncCollector::spawn(hub.sender()?, workers, initial, cfg)?;
            let wall = drive(&mut c, total, false, &mut rng, &mut tally)?.wall;
            c.shutdown()?;
            ("2 threads, sync", wall)
        };
        tally.print(&mut out, name, wall, &base);
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
            .collect::<refit_rl::Result<Vec<_>>>()?;
        let config = ProcessConfig {
            total_frames: Some(total),
            queue_depth: 2,
            ..ProcessConfig::default()
        };
        let mut tally = Tally::default();
        let (name, wall) = if asynchronous {
            let mut c = ProcessAsyncCollector::spawn(link.sender, commands, initial, config)?;
            let wall = drive(&mut c, total, true, &mut rng, &mut tally)?.wall;
            c.shutdown()?;
            (format!("{workers} processes, async"), wall)
        } else {
            let mut c = ProcessSyncCollector::spawn(link.sender, commands, initial, config)?;
            let wall = drive(&mut c, total, true, &mut rng, &mut tally)?.wall;
            c.shutdown()?;
            let plural = if workers == 1 { "process" } else { "processes" };
            (format!("{workers} {plural}, sync"), wall)
        };
        tally.print(&mut out, &name, wall, &base);
    }
    out.finish();
    Ok(())
}

/// Takes `total` frames of batches from `c` (or all it yields), publishing fresh random
/// weights after each (made before the loop, as a trainer's would be: what is timed is
/// handing them over); answers the time of that loop alone, wall and this thread's CPU
/// (starting and stopping the collector are not in it, whatever the collector). When `crossed` (batches came from
/// other processes), the first batch is encoded afterwards to learn the bytes per frame.
fn drive<C>(
    c: &mut C,
    total: u64,
    crossed: bool,
    rng: &mut SmallRng,
    tally: &mut Tally,
) -> Res<Timed>
where
    C: Iterator<Item = refit_rl::Result<Batch>> + UpdatePolicyWeights,
{
    let mut first: Option<Batch> = None;
    // unstamped: the collector stamps each with the next version
    let mut fresh = (0..total.div_ceil(BATCH as u64))
        .map(|_| weights(rng, 0))
        .collect::<Res<Vec<_>>>()?;
    let start = Timed::start();
    while tally.frames < total {
        let Some(b) = c.next().transpose()? else {
            break;
        };
        tally.batch(&b);
        if crossed && first.is_none() {
            first = Some(b);
        }
        let ws = match fresh.pop() {
            Some(ws) => ws,
            None => weights(rng, 0)?,
        };
        let t = Instant::now();
        c.update_weights(ws)?;
        tally.update_time += t.elapsed();
        tally.updates += 1;
    }
    let took = start.elapsed();
    if let Some(b) = first.filter(|b| b.frames > 0) {
        tally.bytes_per_frame = wire::encode(&b)?.len() as f64 / b.frames as f64;
    }
    Ok(took)
}
