//! `refit bench`: every transport against physical baselines measured in the same run.

use std::error::Error as StdError;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use refit_node::{ClusterToken, TOKEN_ENV, TOKEN_FILE_ENV};
use refit_runtime::{
    DType, Element, Error, Manifest, Manifests, ModelId, Receiver, ReceiverInit, ReceiverTransport,
    Sender, SenderInit, SenderTransport, Version, WeightSet, wire,
};
use refit_transports::link::{
    self, CUDA_DEVICE_ENV, LinkFactory, LinkOptions, OpenedLink, Reach, ReceiverSpec,
};
use refit_transports::nccl::NcclLink;
use refit_transports::shm::{
    ShmConfig, ShmLink, ShmReadMode, ShmReceiver, ShmReceiverSpec, ShmSender,
};
use refit_transports::tcp::TcpLink;
use serde::Serialize;

use crate::stats::{Summary, fmt_bytes, fmt_secs, parse_bytes};

mod mesh;
mod tcp;

/// What the benchmarks answer: a figure, or what stopped it.
pub type BoxResult<T> = Result<T, Box<dyn StdError>>;

const SIZES: [usize; 4] = [4 << 20, 64 << 20, 512 << 20, 2 << 30];
const WAIT: Duration = Duration::from_secs(120);
/// Largest size measured with transports whose receivers keep copies of their own.
const COPIES_MAX: usize = 512 << 20;
/// Largest size measured with copying shm receivers.
const COPY_MODE_MAX: usize = 512 << 20;
/// The name of the shared-memory rows of the link factory's default path (what engines and
/// `refit launch` use): receivers serve each version from the sender's slot.
const SHM_DEFAULT: &str = "shm (zero-copy)";

/// Arguments of `refit bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Largest weight-set size measured; sizes are 4 MiB, 64 MiB, 512 MiB and 2 GiB up to it.
    #[arg(long, default_value = "2GiB", value_parser = parse_bytes)]
    max_size: usize,
    /// Receiver counts (receivers of the shared-memory transport are separate processes).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    receivers: Vec<usize>,
    /// Timed updates per configuration.
    #[arg(long, default_value_t = 5)]
    pub(crate) iters: usize,
    /// Untimed updates first (2: a receiver holds two versions while it pulls a third, so
    /// its third pull is the first into a recycled arena; earlier ones touch new memory,
    /// which the connect rows time apart).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Transports to measure, by name: any of the link factory's (inproc, shm, tcp, file,
    /// ...); each gets the same rows, plus extra rows for some (shm: loaned slots, the
    /// per-version checksum and copying receivers after the default zero-copy rows; tcp:
    /// `refit pull`). The GPU links (nccl, cuda-ipc) are set against a device-to-device copy
    /// measured in the same run; one this build or machine cannot open is skipped, with the
    /// reason on stderr (nccl needs a GPU per rank).
    #[arg(long, value_delimiter = ',', default_value = "inproc,shm,tcp,file")]
    transports: Vec<String>,
    /// Size of the model the conversion to an engine's layout (fused, bf16 / fp8, through
    /// the converting sender and receiver over shm) and the delta encode are measured on;
    /// 0 skips them.
    #[arg(long, default_value = "64MiB", value_parser = parse_bytes)]
    strategies_size: usize,
    /// Times each process transport's connect (receiver processes, once started, register,
    /// pull the initial weights and acknowledge; also timed from their start) this many
    /// times, each with fresh processes, beside a steady update on the same processes after
    /// the warm-up.
    #[arg(long, default_value_t = 5)]
    connect_runs: usize,
    /// Size of the model `refit pull` fetches into --pull-dir (four tensors, each far larger
    /// than a bucket), timed against raw loopback TCP of the same size; 0 skips it.
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pull_size: usize,
    /// Where the `refit pull` rows write their file.
    #[arg(long, default_value = "/dev/shm")]
    pull_dir: std::path::PathBuf,
    /// Mesh shapes timed, `MxN` each: M trainer shards (each its rows of every tensor)
    /// publishing to N engines (each pulling its columns from every shard at once), all in
    /// this process over loopback, against the raw stream of the same bytes in the same run.
    #[arg(long, value_delimiter = ',', default_value = "1x1,2x2,4x4")]
    mesh: Vec<mesh::Shape>,
    /// Size of the mesh rows' model (at most --max-size); 0 skips them.
    #[arg(long, default_value = "512MiB", value_parser = parse_bytes)]
    mesh_size: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Measure a generating engine's pause per update instead of the transports: a
    /// transformer engine fed through a link of the factory, with the trainer's weights
    /// converted to the engine's layout on the send path, while requests decode; beside the
    /// link's own time for the same bytes, a decoding step and memcpy (--iters updates per
    /// engine; the --engine-* options).
    #[arg(long)]
    engine_pause: bool,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
}

/// The options of `refit bench --engine-pause`.
#[derive(Debug, clap::Args)]
#[cfg_attr(not(feature = "actors"), allow(dead_code))]
pub struct EngineArgs {
    /// Model sizes, in bytes of the engine's layout (bf16: what the link moves; the
    /// trainer's f32 model, and what the engine serves, are twice that).
    #[arg(long, value_delimiter = ',', default_value = "1MiB,100MiB,1GiB", value_parser = parse_bytes)]
    pub(crate) engine_sizes: Vec<usize>,
    /// Links feeding the engine, by name (each also timed alone): shm, inproc, ...
    #[arg(long, value_delimiter = ',', default_value = "shm")]
    pub(crate) engine_transports: Vec<String>,
    /// Pause modes (keep, abort, wait): an engine per link and mode.
    #[arg(long, value_delimiter = ',', default_value = "keep,abort,wait")]
    pub(crate) engine_modes: Vec<String>,
    /// Untimed updates before the timed ones.
    #[arg(long, default_value_t = 1)]
    pub(crate) engine_warmup: usize,
    /// Requests kept decoding during every update.
    #[arg(long, default_value_t = 4)]
    pub(crate) engine_requests: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 16)]
    pub(crate) engine_tokens: u32,
    /// Threads of the engine's decoding generator and of its staging one, each.
    #[arg(long, default_value_t = 1)]
    pub(crate) engine_threads: usize,
}

/// Arguments of the hidden child process.
#[derive(Debug, clap::Args)]
pub struct ChildArgs {
    /// `tcp-sink`, `link` (a receiver of any transport) or `shm-copy` / `shm-zero`.
    role: String,
    /// Address or receiver token.
    target: String,
    /// Bytes per round (tcp-sink).
    #[arg(default_value_t = 0)]
    bytes: usize,
    /// Rounds (tcp-sink).
    #[arg(default_value_t = 0)]
    rounds: usize,
    /// Bytes per read (tcp-sink).
    #[arg(default_value_t = 4 << 20)]
    chunk: usize,
    /// Write what is read into a new file at this path, once per round (tcp-sink).
    #[arg(long)]
    file: Option<std::path::PathBuf>,
    /// Read each round into new memory, a buffer of the round's size (tcp-sink).
    #[arg(long)]
    new_memory: bool,
    /// Read each round into one buffer of the round's size, touched before the first
    /// (tcp-sink).
    #[arg(long)]
    arena: bool,
    /// With `--arena`: connections, each carrying a contiguous range of the round (tcp-sink).
    #[arg(long, default_value_t = 1)]
    conns: usize,
    /// With `--arena`: hash every piece read with the transports' checksum and compare each
    /// range's digest with the one its writer sends after it (tcp-sink).
    #[arg(long)]
    hash: bool,
}

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
struct Row {
    transport: String,
    metric: String,
    bytes: usize,
    receivers: usize,
    seconds: Summary,
    baseline: String,
    baseline_median: f64,
    ratio: f64,
}

struct Baselines {
    memcpy: Summary,
    tcp: f64,
    /// A device-to-device copy of the same size, when a GPU link is measured.
    device: Option<f64>,
}

/// The links named in `--transports` that this process can open; every other one is named
/// on stderr with the reason it is skipped (a GPU link without the `cuda` feature or
/// without a GPU).
///
/// # Errors
/// An unknown name, or no name (as [`link::parse_list`]).
fn usable_links(names: &[String]) -> BoxResult<Vec<&'static dyn LinkFactory>> {
    let mut usable = Vec::new();
    for l in link::parse_list(&names.join(","))? {
        match l.usable(&LinkOptions::default()) {
            Ok(()) => usable.push(l),
            Err(e) => eprintln!("refit bench: skipping {}: {e}", l.name()),
        }
    }
    Ok(usable)
}

/// Runs `refit bench` as `args` asks: the links (or, with `--engine-pause`, the generating
/// engine's pause), each figure printed with its ratio to the baselines of the same run.
///
/// Called from the `refit` binary only: the receiver processes are that binary run again
/// (`refit` [`CHILD_COMMAND`](crate::CHILD_COMMAND), answered by [`child`]; the pull rows
/// run `refit pull` and `refit serve`).
///
/// # Errors
/// A bad argument (named), a link that cannot be opened, or a receiver process that fails.
pub fn run(args: &BenchArgs) -> BoxResult<()> {
    if args.iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    if args.warmup == 0 {
        // the steady rows time the update after the warm-up, into an arena a receiver has
        // used before: with none, there is no such update to time
        return Err(
            "--warmup must be at least 1: the steady rows time an update after the \
                    warm-up (the default, 2, makes it the first into a recycled arena)"
                .into(),
        );
    }
    if args.engine_pause {
        return engine_pause(args);
    }
    let sizes: Vec<usize> = SIZES.into_iter().filter(|&s| s <= args.max_size).collect();
    if sizes.is_empty() {
        return Err(format!(
            "--max-size {} is below the smallest size, 4 MiB",
            args.max_size
        )
        .into());
    }
    let links = usable_links(&args.transports)?;
    let gpus = links
        .iter()
        .any(|l| l.on_device())
        .then(refit_transports::gpu::probe)
        .and_then(Result::ok)
        .map_or(0, |r| r.devices.len());
    // the raw TCP baseline's chunk sizes, searched once at the largest size streamed
    tcp::tune(sizes.iter().copied().max().unwrap_or(0).max(args.pull_size))?;
    let mut rows = Vec::new();
    for &size in &sizes {
        let mut weights = make_weights(size, 16)?;
        let (memcpy, copy_rows) = memcpy_baseline(size, args.iters.max(3), 1, None);
        rows.extend(copy_rows);
        let threads = refit_runtime::copy::copy_threads();
        if threads > 1 {
            let (_, split) = memcpy_baseline(size, args.iters.max(3), threads, Some(memcpy));
            rows.extend(split);
        }
        let tcp = tcp_baseline(size, args.iters.max(3))?;
        rows.push(row(
            "tcp-loopback",
            "stream",
            size,
            1,
            tcp,
            "memcpy",
            memcpy.median,
        ));
        let mut base = Baselines {
            memcpy,
            tcp: tcp.median,
            device: None,
        };
        if links.iter().any(|l| l.on_device()) {
            // the GPU links' physical baseline: a device-to-device copy of the same bytes
            let device = LinkOptions::default().cuda_device()?;
            let copies = refit_transports::gpu::device_copy_times(device, size, args.iters.max(3))?;
            let copy = Summary::of(&copies);
            rows.push(row("device-copy", "copy", size, 1, copy, "-", copy.median));
            base.device = Some(copy.median);
        }
        for &l in &links {
            for &n in &args.receivers {
                // receivers that keep versions of their own: above 512 MiB four of them
                // would not fit beside the sender in this machine's memory
                if l.receivers_copy() && size > COPIES_MAX {
                    continue;
                }
                if l.name() == NcclLink.name() && n + 1 > gpus {
                    // NCCL refuses two ranks of one communicator on one GPU
                    eprintln!(
                        "refit bench: skipping nccl N={n}: it needs {} GPUs (one per rank), this machine has {gpus}",
                        n + 1
                    );
                    continue;
                }
                eprintln!("refit bench: {} {} N={n}", l.name(), fmt_bytes(size));
                let link_rows = bench_link(l, &mut weights, n, args, &base)?;
                if l.name() == ShmLink.name() {
                    // the default path first, under the name of its read mode, then the
                    // other modes
                    rows.extend(link_rows.into_iter().map(|mut r| {
                        r.transport = SHM_DEFAULT.into();
                        r
                    }));
                    rows.extend(bench_shm_modes(&mut weights, n, size, args, &base)?);
                } else {
                    rows.extend(link_rows);
                }
            }
        }
    }
    if args.pull_size > 0 && links.iter().any(|l| l.name() == TcpLink.name()) {
        eprintln!(
            "refit bench: refit pull of {} into {}",
            fmt_bytes(args.pull_size),
            args.pull_dir.display()
        );
        rows.extend(tcp::bench_pull(args)?);
    }
    let mesh_size = args.mesh_size.min(args.max_size);
    if mesh_size > 0 && !args.mesh.is_empty() {
        rows.extend(mesh::rows(&args.mesh, mesh_size, args.warmup, args.iters)?);
    }
    if args.strategies_size > 0 {
        eprintln!(
            "refit bench: conversion to an engine's layout over shm, {}",
            fmt_bytes(args.strategies_size)
        );
        rows.extend(bench_strategies(args)?);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print_table(&rows);
    }
    Ok(())
}

#[cfg(feature = "actors")]
fn engine_pause(args: &BenchArgs) -> BoxResult<()> {
    super::engine_pause::run(args, &args.engine)
}

#[cfg(not(feature = "actors"))]
fn engine_pause(_: &BenchArgs) -> BoxResult<()> {
    Err("--engine-pause needs refit built with the `actors` feature (on by default)".into())
}

/// The conversion's link: a shared-memory sender and one receiver, in this process.
struct ShmPair;

impl crate::strategy::Link for ShmPair {
    type S = ShmSender;
    type R = ShmReceiver;
    fn name(&self) -> &'static str {
        "shm"
    }
    fn make(&mut self, manifests: &Manifests) -> refit_runtime::Result<(ShmSender, ShmReceiver)> {
        let config = ShmConfig {
            expected_receivers: 1,
            ..ShmConfig::default()
        };
        let s = ShmSender::create(&config, manifests)?;
        let r = ShmReceiver::new(s.receiver_spec()).with_mode(ShmReadMode::Copy);
        Ok((s, r))
    }
}

/// The conversion to an engine's layout on the real path (the converting sender and
/// receiver around shm), the same updates without it, and the delta encode, each beside
/// a `memcpy` of the trainer's payload measured in the same run.
fn bench_strategies(args: &BenchArgs) -> BoxResult<Vec<Row>> {
    let sb = crate::strategy::run(args.strategies_size, args.iters.max(3), &mut ShmPair)?;
    let memcpy = sb.figure("memcpy").map_or(f64::NAN, |f| f.median());
    Ok(sb
        .figures
        .iter()
        .map(|f| {
            let samples: Vec<Duration> = f
                .samples
                .iter()
                .map(|&s| Duration::from_secs_f64(s))
                .collect();
            let baseline = if f.name == "memcpy" { "-" } else { "memcpy" };
            row(
                "strategy (shm)",
                &f.name,
                f.bytes,
                1,
                Summary::of(&samples),
                baseline,
                memcpy,
            )
        })
        .collect())
}

fn row(
    transport: &str,
    metric: &str,
    bytes: usize,
    receivers: usize,
    s: Summary,
    baseline: &str,
    base: f64,
) -> Row {
    Row {
        transport: transport.into(),
        metric: metric.into(),
        bytes,
        receivers,
        seconds: s,
        baseline: baseline.into(),
        baseline_median: base,
        ratio: s.median / base,
    }
}

fn print_table(rows: &[Row]) {
    println!(
        "{:<22} {:<20} {:>8} {:>2} {:>11} {:>11} {:>11} {:>11} {:>10} {:>9}",
        "transport", "metric", "size", "N", "min", "median", "p99", "max", "GB/s", "x base"
    );
    for r in rows {
        // a row without samples has no median: "-", never NaN
        let gbps = r.bytes as f64 / r.seconds.median / 1e9;
        let gbps = if gbps.is_finite() {
            format!("{gbps:.2}")
        } else {
            "-".to_owned()
        };
        println!(
            "{:<22} {:<20} {:>8} {:>2} {:>11} {:>11} {:>11} {:>11} {:>10} {:>9}",
            r.transport,
            r.metric,
            fmt_bytes(r.bytes),
            r.receivers,
            fmt_secs(r.seconds.min),
            fmt_secs(r.seconds.median),
            fmt_secs(r.seconds.p99),
            fmt_secs(r.seconds.max),
            gbps,
            if r.baseline == "-" || !r.ratio.is_finite() {
                "-".to_string()
            } else {
                format!("{:.3} {}", r.ratio, r.baseline)
            },
        );
    }
}

/// A weight set of `size` bytes in `tensors` tensors, filled with a pattern (pages
/// faulted in).
fn make_weights(size: usize, tensors: usize) -> BoxResult<Arc<WeightSet>> {
    let mut b = Manifest::builder();
    for i in 0..tensors {
        b.push(format!("layer{i}.weight"), DType::U8, &[size / tensors]);
    }
    let mut ws = WeightSet::zeroed(ModelId::new("bench")?, Arc::new(b.build()?));
    for (i, chunk) in ws.bytes_mut()?.chunks_mut(4096).enumerate() {
        chunk.fill(i as u8 | 1);
    }
    ws.set_version(Version(1));
    Ok(Arc::new(ws))
}

/// The cluster token of this run's TCP rows: random, handed to receiver processes in their
/// environment, never on their command line (which `ps` shows).
fn bench_token() -> &'static ClusterToken {
    static TOKEN: std::sync::OnceLock<ClusterToken> = std::sync::OnceLock::new();
    TOKEN.get_or_init(ClusterToken::random)
}

fn spawn_child(args: &[&str]) -> BoxResult<Child> {
    spawn_child_on(args, None)
}

/// A receiver process's first line once it has started, before it connects: then it waits
/// for a line on its standard input ([`wait_for_go`]).
const READY: &str = "ready";

/// In a receiver process: says it has started ([`READY`] on standard output) and waits
/// until this bench writes a line to its standard input, so that connect rows time the
/// connect and not the start of a process.
fn wait_for_go() -> BoxResult<()> {
    use std::io::{BufRead, Write};
    let mut out = std::io::stdout().lock();
    writeln!(out, "{READY}")?;
    out.flush()?;
    let mut go = String::new();
    if std::io::stdin().lock().read_line(&mut go)? == 0 {
        return Err("the bench closed this receiver's input before it could connect".into());
    }
    Ok(())
}

/// Starts receiver processes (`child` arguments; receiver `i` on CUDA device `i + 1` when
/// `one_gpu_each`) and waits until each says it has started ([`wait_for_go`]).
fn start_receivers(child: &[&str], n: usize, one_gpu_each: bool) -> BoxResult<Vec<Child>> {
    use std::io::BufRead;
    let mut children = Vec::with_capacity(n);
    for i in 0..n {
        let mut cmd = child_command(child, one_gpu_each.then_some(i + 1))?;
        children.push(cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?);
    }
    for c in &mut children {
        let mut line = String::new();
        if let Some(out) = c.stdout.as_mut() {
            // a process that fails before it is ready closes its output: an empty line
            std::io::BufReader::new(out).read_line(&mut line)?;
        }
        if line.trim_end() != READY {
            return Err(format!("a {} receiver process did not start", child[0]).into());
        }
    }
    Ok(children)
}

/// Tells started receivers to connect ([`wait_for_go`]).
fn tell_receivers_to_connect(children: &mut [Child]) -> BoxResult<()> {
    use std::io::Write;
    for c in children {
        let input = c.stdin.as_mut().ok_or("a receiver process without input")?;
        writeln!(input, "go")?;
        input.flush()?;
    }
    Ok(())
}

/// As [`spawn_child`], its GPU links' ends on CUDA device `device` when given.
fn spawn_child_on(args: &[&str], device: Option<usize>) -> BoxResult<Child> {
    Ok(child_command(args, device)?.spawn()?)
}

/// The command of a bench child process (see [`spawn_child_on`]).
fn child_command(args: &[&str], device: Option<usize>) -> BoxResult<Command> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg(crate::CHILD_COMMAND)
        .args(args)
        .env(TOKEN_ENV, bench_token().expose())
        .env_remove(TOKEN_FILE_ENV)
        .stdin(Stdio::null());
    if let Some(d) = device {
        cmd.env(CUDA_DEVICE_ENV, d.to_string());
    }
    Ok(cmd)
}

/// Raw loopback TCP between two processes, tuned ([`tcp::tuning`]): the time to stream
/// `size` bytes and get one byte back.
fn tcp_baseline(size: usize, iters: usize) -> BoxResult<Summary> {
    tcp::baseline(size, iters)
}

/// Next version of the u8 weights, every tensor's first byte changed ([`next_version`]).
/// The byte written, `2v + 1`, differs from the previous version's for every `v` (`v | 1`
/// did not: versions 2k and 2k+1 were equal, so every other update was an empty delta).
fn bump(weights: &mut Arc<WeightSet>) -> BoxResult<()> {
    next_version::<u8>(weights, |first, v| {
        *first = (v.get() as u8).wrapping_mul(2) | 1
    })?;
    Ok(())
}

/// Stamps the next version on `weights`, the first element of every tensor changed by
/// `change` (given that version), so a delta moves every bucket, as a full transfer does.
/// Copies the weights first (untimed) if a transport still holds the previous ones (the
/// TCP sender keeps recent versions for receivers still pulling).
///
/// # Errors
/// A tensor whose dtype is not `T`.
pub(crate) fn next_version<T: Element>(
    weights: &mut Arc<WeightSet>,
    change: impl Fn(&mut T, Version),
) -> refit_runtime::Result<Version> {
    let ws = Arc::make_mut(weights);
    let next = ws.version().next();
    let names: Vec<String> = ws
        .manifest()
        .tensors()
        .iter()
        .map(|t| t.name.clone())
        .collect();
    for name in &names {
        if let Some(first) = ws.view_mut::<T>(name)?.first_mut() {
            change(first, next);
        }
    }
    ws.set_version(next);
    Ok(next)
}

/// The rows every transport of the link factory gets, opened by name: its receivers are
/// threads of this process when it cannot leave one, else processes (fresh ones for each
/// of `--connect-runs` connects, the timed updates on the last ones); against memcpy, or
/// raw loopback TCP for a transport that crosses hosts.
fn bench_link(
    l: &'static dyn LinkFactory,
    weights: &mut Arc<WeightSet>,
    n: usize,
    args: &BenchArgs,
    base: &Baselines,
) -> BoxResult<Vec<Row>> {
    let size = weights.manifest().total_len();
    let manifests = Manifests::new([(weights.model().clone(), Arc::clone(weights.manifest()))])?;
    let options = LinkOptions {
        expected_receivers: n,
        token: Some(bench_token().clone()),
        ..LinkOptions::default()
    };
    if l.reach() == Reach::Process {
        let opened = l.open(&manifests, &options)?;
        let leftovers = opened.leftovers.clone();
        let receivers = (0..n)
            .map(|_| opened.spec.receiver(&LinkOptions::default()))
            .collect::<Result<Vec<_>, _>>()?;
        // every version shares one arena: what moves is the transport's own work
        let timed = timed_threaded_updates(
            opened.sender,
            receivers,
            manifests,
            weights,
            args.warmup + args.iters.max(20),
            args.warmup,
            |v| Ok(Arc::new(weights.view_as(Version(v))?)),
        );
        OpenedLink::cleanup(&leftovers);
        let (publish, e2e) = timed?;
        return Ok(threaded_rows(l.name(), size, n, &publish, &e2e, base));
    }
    let runs = args.connect_runs.max(1);
    let (mut connect, mut steady) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    let mut with_start = Vec::with_capacity(runs);
    let mut times = Times::default();
    // fresh receiver processes each run: their connect pulls into memory never used
    // before, as a user's first pull does; then, on the same processes, the warm-up updates
    // and one steady update (into a recycled arena), so that every run gives a first and a
    // steady figure under the same load; the other timed updates run on the last ones
    for run in 0..runs {
        let counts = (args.warmup, if run + 1 == runs { args.iters } else { 1 });
        let opened = l.open(&manifests, &options)?;
        let leftovers = opened.leftovers.clone();
        let spec = opened.spec.to_token()?;
        let t = with_receiver_processes(
            opened.sender,
            manifests.clone(),
            &["link", &spec],
            n,
            weights,
            (false, l.name() == NcclLink.name()),
            Some(counts),
        );
        OpenedLink::cleanup(&leftovers);
        let t = t?;
        connect.extend(t.connect.iter().copied());
        with_start.extend(t.with_start.iter().copied());
        steady.extend(t.e2e.first().copied());
        times = t;
    }
    times.connect = connect;
    times.with_start = with_start;
    times.steady = steady;
    if l.receivers_copy() {
        // what the first pull's fresh arena costs on its own: its pages' first touch
        times.touch = Some(first_touch_baseline(size, 3, true));
    }
    if l.reach() == Reach::Network {
        times.into_new_memory = Some(tcp::floor_into_new_memory(size)?);
        let iters = args.iters.max(3);
        times.arena_to_arena = Some(tcp::floor_arena_to_arena(size, iters, false)?);
        times.arena_to_arena_hashed = Some(tcp::floor_arena_to_arena(size, iters, true)?);
    }
    let baseline = match (l.on_device(), base.device, l.reach()) {
        (true, Some(copy), _) => ("device-copy", copy),
        (_, _, Reach::Network) => ("tcp-loopback", base.tcp),
        (_, _, Reach::Process | Reach::Host) => ("memcpy", base.memcpy.median),
    };
    Ok(times.rows(l.name(), size, n, baseline))
}

/// The two rows of a transport timed by [`timed_threaded_updates`], against memcpy.
fn threaded_rows(
    name: &str,
    size: usize,
    n: usize,
    publish: &[Duration],
    e2e: &[Duration],
    base: &Baselines,
) -> Vec<Row> {
    let m = base.memcpy.median;
    vec![
        row(name, "publish", size, n, Summary::of(publish), "memcpy", m),
        row(name, "end-to-end", size, n, Summary::of(e2e), "memcpy", m),
    ]
}

/// Receivers in threads of this process (each connects, then receives until told to stop)
/// and a sender publishing `runs` versions made by `version_of`: the publish times (until
/// the send returns) and the end-to-end times (until every receiver acknowledged), the
/// first `warmup` runs left out.
fn timed_threaded_updates<T, R>(
    transport: T,
    receivers: Vec<R>,
    manifests: Manifests,
    weights: &Arc<WeightSet>,
    runs: usize,
    warmup: usize,
    mut version_of: impl FnMut(u64) -> BoxResult<Arc<WeightSet>>,
) -> BoxResult<(Vec<Duration>, Vec<Duration>)>
where
    T: SenderTransport,
    R: ReceiverTransport + Send + 'static,
{
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = receivers
        .into_iter()
        .map(|r| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || -> Result<(), String> {
                let mut r = ReceiverInit::new(r, None)
                    .connect(WAIT)
                    .map_err(|e| e.to_string())?;
                while !stop.load(Ordering::Acquire) {
                    r.receive(Duration::from_millis(20))
                        .map_err(|e| e.to_string())?;
                }
                Ok(())
            })
        })
        .collect();
    let timed = || -> BoxResult<_> {
        let mut sender = SenderInit::new(transport, manifests)
            .with_ack_timeout(WAIT)
            .connect(vec![(**weights).clone()], WAIT)?;
        let mut v = weights.version().get();
        let (mut publish, mut e2e) = (Vec::new(), Vec::new());
        for i in 0..runs {
            v += 1;
            let ws = version_of(v)?;
            let t0 = Instant::now();
            let pending = sender.publish_shared(vec![ws])?;
            let t1 = Instant::now();
            sender.wait(&pending, WAIT)?;
            let t2 = Instant::now();
            if i >= warmup {
                publish.push(t1 - t0);
                e2e.push(t2 - t0);
            }
        }
        Ok((sender, publish, e2e))
    };
    let result = timed();
    // receivers stop before the sender leaves (they would report it gone)
    stop.store(true, Ordering::Release);
    let mut joined: BoxResult<()> = Ok(());
    for t in threads {
        let r = match t.join() {
            Ok(r) => r.map_err(Into::into),
            Err(_) => Err("receiver thread panicked".into()),
        };
        if joined.is_ok() {
            joined = r;
        }
    }
    let (sender, publish, e2e) = result?;
    joined?;
    sender.shutdown()?;
    Ok((publish, e2e))
}

/// Shared memory's rows after the default path's: the sender filling a lent slot in place,
/// the per-version checksum (computed as the sender writes, verified by every receiver), and
/// (copying receivers hold two private arenas each: up to 512 MiB) receivers copying each
/// version out of the slot.
fn bench_shm_modes(
    weights: &mut Arc<WeightSet>,
    n: usize,
    size: usize,
    args: &BenchArgs,
    base: &Baselines,
) -> BoxResult<Vec<Row>> {
    let mut rows = Vec::new();
    let loaned = ShmRows {
        mode: ShmReadMode::ZeroCopy,
        loaned: true,
        checksum: false,
    };
    rows.extend(bench_shm(weights, n, loaned, args, base)?);
    let checksummed = ShmRows {
        mode: ShmReadMode::ZeroCopy,
        loaned: false,
        checksum: true,
    };
    rows.extend(bench_shm(weights, n, checksummed, args, base)?);
    if size <= COPY_MODE_MAX {
        let copying = ShmRows {
            mode: ShmReadMode::Copy,
            loaned: false,
            checksum: false,
        };
        rows.extend(bench_shm(weights, n, copying, args, base)?);
    }
    Ok(rows)
}

/// One configuration of [`bench_shm`].
#[derive(Clone, Copy)]
struct ShmRows {
    /// How the receivers read.
    mode: ShmReadMode,
    /// The sender fills a lent slot in place (timed apart as `fill`, the trainer's own
    /// extraction) and publishes without a copy.
    loaned: bool,
    /// A checksum per version ([`ShmConfig::checksum`]).
    checksum: bool,
}

/// Shared memory with `n` receiver processes, read as `rows` says.
fn bench_shm(
    weights: &mut Arc<WeightSet>,
    n: usize,
    rows: ShmRows,
    args: &BenchArgs,
    base: &Baselines,
) -> BoxResult<Vec<Row>> {
    let ShmRows {
        mode,
        loaned,
        checksum,
    } = rows;
    let size = weights.manifest().total_len();
    let manifests = Manifests::new([(weights.model().clone(), Arc::clone(weights.manifest()))])?;
    let config = ShmConfig {
        expected_receivers: n,
        checksum,
        ..ShmConfig::default()
    };
    let transport = ShmSender::create(&config, &manifests)?;
    let token = wire::to_token(&transport.receiver_spec())?;
    let role = match mode {
        ShmReadMode::Copy => "shm-copy",
        ShmReadMode::ZeroCopy => "shm-zero",
    };
    let times = with_receiver_processes(
        transport,
        manifests,
        &[role, &token],
        n,
        weights,
        (loaned, false),
        Some((args.warmup, args.iters)),
    )?;
    let name = match (mode, loaned, checksum) {
        (_, true, _) => "shm (loaned)",
        (_, _, true) => "shm (checksum)",
        (ShmReadMode::Copy, _, _) => "shm (copy)",
        (ShmReadMode::ZeroCopy, _, _) => "shm (zero-copy)",
    };
    Ok(times.rows(name, size, n, ("memcpy", base.memcpy.median)))
}

/// Runs one receiver process of `refit bench` (`refit __bench-child`,
/// [`CHILD_COMMAND`](crate::CHILD_COMMAND)), as its parent asked.
///
/// # Errors
/// An unknown role, or a link or stream that fails.
pub fn child(args: &ChildArgs) -> BoxResult<()> {
    match args.role.as_str() {
        "tcp-sink" => tcp::sink(args),
        "link" => {
            // any transport of the link factory; a tcp receiver presents the token of its
            // environment (set by `spawn_child`)
            let spec = ReceiverSpec::from_token(&args.target)?;
            wait_for_go()?;
            let r = spec.receiver(&LinkOptions::default())?;
            match ReceiverInit::new(r, None).connect(WAIT) {
                Ok(r) => drain(r),
                // a connect-only run: the sender may leave as soon as it has every
                // acknowledgement, before this end hears the answer to its own
                Err(Error::PeerGone { .. }) => Ok(()),
                Err(e) => Err(e.into()),
            }
        }
        "shm-copy" | "shm-zero" => {
            let mode = if args.role == "shm-copy" {
                ShmReadMode::Copy
            } else {
                ShmReadMode::ZeroCopy
            };
            let spec: ShmReceiverSpec = wire::from_token(&args.target)?;
            wait_for_go()?;
            let mut r =
                ReceiverInit::new(ShmReceiver::new(spec).with_mode(mode), None).connect(WAIT)?;
            loop {
                match r.receive(WAIT) {
                    Ok(Some(_)) => {}
                    Ok(None) => return Err("no update within the deadline".into()),
                    Err(Error::PeerGone { .. }) => return Ok(()),
                    Err(e) => return Err(e.into()),
                }
            }
        }
        other => Err(format!("unknown child role {other:?}").into()),
    }
}

/// Timings of the updates of one configuration, by phase.
#[derive(Default)]
struct Times {
    /// Receiver processes, started and waiting, told to connect until every one has applied
    /// and acknowledged the initial weights.
    connect: Vec<Duration>,
    /// The same from the start of the processes.
    with_start: Vec<Duration>,
    /// The first update after the warm-up on the processes of each connect run.
    steady: Vec<Duration>,
    /// Writing one byte into every page of a fresh arena of the same size.
    touch: Option<Summary>,
    /// Raw loopback TCP of the same size read into new memory: a simple program's first
    /// receive (links that reach the network).
    into_new_memory: Option<Summary>,
    /// Raw loopback TCP of the same size from a whole-size buffer into another, both
    /// touched: a simple program moving a version between arenas (links that reach the
    /// network), over one connection or as many as a pull opens, whichever was faster
    /// (and how many that was).
    arena_to_arena: Option<(Summary, usize)>,
    /// The same program checking every byte end to end, as a pull does (links that reach
    /// the network), and its connections.
    arena_to_arena_hashed: Option<(Summary, usize)>,
    e2e: Vec<Duration>,
    write: Vec<Duration>,
    acks: Vec<Duration>,
    fill: Vec<Duration>,
}

impl Times {
    fn rows(&self, name: &str, size: usize, n: usize, baseline: (&str, f64)) -> Vec<Row> {
        let (bname, base) = baseline;
        let mut rows = vec![
            row(
                name,
                "end-to-end",
                size,
                n,
                Summary::of(&self.e2e),
                bname,
                base,
            ),
            row(
                name,
                "  publish",
                size,
                n,
                Summary::of(&self.write),
                bname,
                base,
            ),
            row(
                name,
                "  apply+ack",
                size,
                n,
                Summary::of(&self.acks),
                bname,
                base,
            ),
        ];
        if !self.connect.is_empty() {
            // first and steady side by side, each against the baseline; then what a fresh
            // arena's pages cost alone
            let mut first = vec![
                row(
                    name,
                    "connect+first pull",
                    size,
                    n,
                    Summary::of(&self.connect),
                    bname,
                    base,
                ),
                row(
                    name,
                    "  steady update",
                    size,
                    n,
                    Summary::of(&self.steady),
                    bname,
                    base,
                ),
                row(
                    name,
                    "  (process start+)",
                    size,
                    n,
                    Summary::of(&self.with_start),
                    bname,
                    base,
                ),
            ];
            if let Some(touch) = self.touch {
                first.push(row(
                    name,
                    "  (arena first touch)",
                    size,
                    1,
                    touch,
                    bname,
                    base,
                ));
            }
            // a raw stream doing more of the same job (into new memory, between arenas), and
            // the figure it is the floor of against it
            // an arena stream's floor: its time, and its row named by its connections
            let arenas = |floor: Option<(Summary, usize)>, hashed: &str| {
                let what = floor.map_or_else(String::new, |(_, conns)| match conns {
                    1 => format!("arenas, 1 connection{hashed}"),
                    c => format!("arenas, {c} connections{hashed}"),
                });
                (floor.map(|(s, _)| s), what)
            };
            let (plain, plain_what) = arenas(self.arena_to_arena, "");
            let (hashed, hashed_what) = arenas(self.arena_to_arena_hashed, ", hashed");
            let floors = [
                (
                    self.into_new_memory,
                    "new memory".to_string(),
                    "raw into new memory",
                    "connect+first pull",
                    &self.connect,
                ),
                (
                    plain,
                    plain_what,
                    "raw arena to arena",
                    "steady update",
                    &self.steady,
                ),
                (
                    hashed,
                    hashed_what,
                    "raw arena to arena, hashed",
                    "steady update",
                    &self.steady,
                ),
            ];
            for (raw, what, floor, metric, times) in floors {
                let Some(raw) = raw else { continue };
                first.push(row(
                    name,
                    &format!("  (raw, {what})"),
                    size,
                    1,
                    raw,
                    bname,
                    base,
                ));
                let timed = Summary::of(times);
                first.push(row(
                    name,
                    &format!("  {metric}"),
                    size,
                    n,
                    timed,
                    floor,
                    raw.median,
                ));
            }
            rows.splice(0..0, first);
        }
        if !self.fill.is_empty() {
            rows.push(row(
                name,
                "  (fill)",
                size,
                n,
                Summary::of(&self.fill),
                bname,
                base,
            ));
        }
        rows
    }
}

/// Warm-up then timed updates: publish version N, wait until every receiver acknowledged it.
/// `loaned` (shared memory only) fills a lent slot in place first, timed apart as `fill`.
fn timed_updates<T: SenderTransport + LoanSlots>(
    sender: &mut Sender<T>,
    weights: &mut Arc<WeightSet>,
    loaned: bool,
    (warmup, iters): (usize, usize),
) -> BoxResult<Times> {
    let mut t = Times::default();
    for i in 0..warmup + iters {
        bump(weights)?;
        let update = if loaned {
            let far = Instant::now() + WAIT;
            let mut lent = sender.transport_mut().loan_slot(weights, far)?;
            let start = Instant::now();
            lent.bytes_mut()?.copy_from_slice(weights.bytes());
            if i >= warmup {
                t.fill.push(start.elapsed());
            }
            Arc::new(lent)
        } else {
            Arc::clone(weights)
        };
        let t0 = Instant::now();
        let pending = sender.publish_shared(vec![update])?;
        let t1 = Instant::now();
        sender.wait(&pending, WAIT)?;
        let t2 = Instant::now();
        if i >= warmup {
            t.write.push(t1 - t0);
            t.acks.push(t2 - t1);
            t.e2e.push(t2 - t0);
        }
    }
    Ok(t)
}

/// Transports that can lend a slot to fill in place.
trait LoanSlots {
    fn loan_slot(&mut self, weights: &WeightSet, deadline: Instant) -> BoxResult<WeightSet>;
}

impl LoanSlots for ShmSender {
    fn loan_slot(&mut self, weights: &WeightSet, deadline: Instant) -> BoxResult<WeightSet> {
        Ok(self.loan(weights.model(), weights.version(), deadline)?)
    }
}

impl LoanSlots for Box<dyn SenderTransport> {
    fn loan_slot(&mut self, _: &WeightSet, _: Instant) -> BoxResult<WeightSet> {
        Err(format!("the {} transport does not lend slots here", self.name()).into())
    }
}

/// Writing one byte into every page of `size` bytes of memory never used before (what a
/// fresh arena costs its first transfer before a byte moves): a plain heap buffer, or with
/// `arena` a runtime arena (an anonymous map, advised to use transparent huge pages where
/// they are not cold: [`refit_runtime::AlignedBuf::huge_pages`]).
fn first_touch_baseline(size: usize, iters: usize, arena: bool) -> Summary {
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let mut heap = Vec::new();
        let mut mapped = refit_runtime::AlignedBuf::zeroed(0);
        let fresh = if arena {
            mapped = refit_runtime::AlignedBuf::zeroed(size);
            mapped.as_mut_slice()
        } else {
            heap = vec![0u8; size];
            heap.as_mut_slice()
        };
        let t = Instant::now();
        for page in fresh.chunks_mut(4096) {
            page[0] = 1;
        }
        std::hint::black_box(&mut *fresh);
        samples.push(t.elapsed());
        drop((heap, mapped));
    }
    Summary::of(&samples)
}

/// A benchmark receiver: applies every update until the sender leaves.
fn drain<T: ReceiverTransport>(mut r: Receiver<T>) -> BoxResult<()> {
    loop {
        match r.receive(WAIT) {
            Ok(Some(_)) => {}
            Ok(None) => return Err("no update within the deadline".into()),
            Err(Error::PeerGone { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Starts `n` receiver processes (`child` arguments), connects the scheme (timed from the
/// moment the started processes are told to connect, and from their start), times the
/// updates when `timed` (untimed warm-up updates, then timed ones),
/// shuts the sender down (receivers see it leave and exit) and checks every process succeeded.
/// `(loaned, one_gpu_each)`: fill lent slots (see [`timed_updates`]); give receiver `i`
/// CUDA device `i + 1` (NCCL: one rank per GPU, the sender on device 0).
fn with_receiver_processes<T: SenderTransport + LoanSlots>(
    transport: T,
    manifests: Manifests,
    child: &[&str],
    n: usize,
    weights: &mut Arc<WeightSet>,
    (loaned, one_gpu_each): (bool, bool),
    timed: Option<(usize, usize)>,
) -> BoxResult<Times> {
    // a view of the bench's own arena, not a copy: the connect must not time this program
    // giving a private copy of the initial weights back to the system (an munmap of the
    // whole size) once the sender is done with it; the steady updates publish the bench's
    // arena the same way
    let initial = weights.view_as(weights.version())?;
    let started = Instant::now();
    let mut children = start_receivers(child, n, one_gpu_each)?;
    let t0 = Instant::now();
    tell_receivers_to_connect(&mut children)?;
    let mut sender = SenderInit::new(transport, manifests)
        .with_ack_timeout(WAIT)
        .connect(vec![initial], WAIT)?;
    let (connect, with_start) = (t0.elapsed(), started.elapsed());
    let mut times = match timed {
        Some(counts) => timed_updates(&mut sender, weights, loaned, counts)?,
        None => Times::default(),
    };
    times.connect.push(connect);
    times.with_start.push(with_start);
    sender.transport_mut().shutdown()?;
    drop(sender);
    for mut c in children {
        if !c.wait()?.success() {
            return Err(format!("a {} receiver process failed", child[0]).into());
        }
    }
    Ok(times)
}

/// The `memcpy` baseline: the fastest simple copy of `size` bytes between buffers already
/// touched (the C library's `memcpy` or streaming stores, `refit_runtime::copy`), on one
/// thread or split in contiguous parts across `threads`; with its rows: the best (against
/// `one`, the one-thread baseline, when given) and each copy tried against the best.
fn memcpy_baseline(
    size: usize,
    iters: usize,
    threads: usize,
    one: Option<Summary>,
) -> (Summary, Vec<Row>) {
    let copies = refit_runtime::copy::fastest_copy(&vec![7u8; size], iters, threads);
    let best = Summary::of(copies.times());
    let name = match threads {
        1 => "memcpy".to_string(),
        n => format!("memcpy ({n} threads)"),
    };
    let metric = format!("copy ({})", copies.best.name());
    let mut rows = vec![match one {
        Some(one) => row(&name, &metric, size, 1, best, "memcpy", one.median),
        None => row(&name, &metric, size, 1, best, "-", best.median),
    }];
    for (c, times) in &copies.tried {
        let s = Summary::of(times);
        let tried = format!("  tried {}", c.name());
        rows.push(row(&name, &tried, size, 1, s, "best tried", best.median));
    }
    (best, rows)
}
