//! A trainer node and worker nodes as separate processes, weights moving over TCP.
//!
//! ```text
//! cargo run --release --example multi_node [-- --workers 2 --versions 5 --size 64MiB --delta off]
//! ```
//!
//! `--size` sets the weight bytes (default 4 MiB), `--delta` what a version after the first
//! carries (`buckets`, the default: only the buckets whose tensors changed; `elements`: those
//! buckets as element-level deltas; `off`: every byte), `--sparse` makes each version change
//! 2% of the elements of every tensor (instead of whole tensors), `--bucket-size` the bytes
//! per bucket; the trainer prints, per version, the time until every worker acknowledged it.
//!
//! Run as is, the trainer (rank 0) starts its workers itself on loopback. Across hosts, start
//! each process with the usual launch variables and one shared token:
//!
//! ```text
//! # host A (rank 0, the trainer)
//! REFIT_TOKEN=... RANK=0 WORLD_SIZE=3 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \
//!     multi_node trainer --bind 10.0.0.1:29500 --no-spawn
//! # hosts B and C (ranks 1 and 2)
//! REFIT_TOKEN=... RANK=1 WORLD_SIZE=3 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \
//!     multi_node worker --bind 10.0.0.2:0
//! ```
//!
//! The trainer serves a rendezvous store and a TCP sender agent on one node and publishes
//! the agent's endpoint (address and id, no secret) in the store. Each worker reads it, adds
//! the cluster token it was started with, registers its receiver, and applies
//! every version the trainer announces: the trainer calls `_receive_weights_scheme` on the
//! worker's node, the worker pulls the bytes over parallel streams (or from another worker
//! that already holds them), verifies every tensor's checksum, applies and acknowledges.

use std::net::SocketAddr;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit::node::{ClusterToken, LaunchEnv, Node, NodeConfig, Store, StoreClient};
use refit::prelude::*;
use refit::runtime::wire;
use refit::transports::tcp::{
    DEFAULT_BUCKET_SIZE, TcpConfig, TcpEndpoint, TcpReceiver, TcpReceiverConfig, TcpReceiverSpec,
    TcpSender, TransferMode,
};

const WAIT: Duration = Duration::from_secs(120);

/// Weights across nodes: a trainer node publishes to worker nodes over TCP (spawned on
/// loopback by default, or started per rank with the launch variables).
#[derive(clap::Parser, Debug)]
#[command(long_about = None)]
struct Args {
    /// This process's role.
    #[arg(default_value = "trainer", value_parser = ["trainer", "worker"])]
    role: String,
    /// Worker nodes.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Versions to publish.
    #[arg(long, default_value_t = 5)]
    versions: u64,
    /// Address to bind.
    #[arg(long)]
    bind: Option<SocketAddr>,
    /// Do not spawn the workers (they are started separately).
    #[arg(long = "no-spawn", action = clap::ArgAction::SetFalse)]
    spawn: bool,
    /// Bytes of weights (`4MiB`, `1GiB`, `4096`).
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    size: usize,
    /// What a version after the first carries: every byte (`off`), the buckets holding a
    /// changed tensor (`buckets`), or those as element-level deltas (`elements`).
    #[arg(long, default_value = "buckets", value_parser = ["off", "buckets", "elements"])]
    delta: String,
    /// Each version changes 2% of the elements of every tensor (default: the head every
    /// version, the encoder every other one, whole).
    #[arg(long)]
    sparse: bool,
    /// Bucket size of a transfer.
    #[arg(long, default_value_t = DEFAULT_BUCKET_SIZE, value_parser = parse_size)]
    bucket_size: usize,
}

/// `4MiB`, `1GiB`, `4096` (binary units need the `i`: `4MB` is 4,000,000 bytes), as the
/// `refit` tool reads sizes.
fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let size: bytesize::ByteSize = s
        .trim()
        .parse()
        .map_err(|e| format!("bad size {s:?}: {e}"))?;
    usize::try_from(size.as_u64())
        .ok()
        .filter(|_| size.as_u64() != u64::MAX)
        .ok_or(format!("size {s:?} overflows"))
}

// ANCHOR: model
/// The policy's layout: about `size` bytes of weights in three tensors (4 MiB: an encoder
/// of 512 x 1024, its bias, a head of 1024 x 512).
fn policy_manifest(size: usize) -> Result<Manifest> {
    let rows = (size / (2 * 1024 * 4)).max(1);
    Manifest::builder()
        .tensor("encoder.weight", DType::F32, &[rows, 1024])
        .tensor("encoder.bias", DType::F32, &[rows])
        .tensor("head.weight", DType::F32, &[1024, rows])
        .build()
}

/// What the trainer would produce at `version`: the head changes every version, the encoder
/// every other one (so delta transfers move only what changed).
fn weights_at(manifest: &Arc<Manifest>, version: u64) -> Result<WeightSet> {
    let mut ws = WeightSet::zeroed(ModelId::new("policy")?, Arc::clone(manifest));
    let encoder = (version / 2) as f32;
    ws.view_mut::<f32>("encoder.weight")?.fill(encoder);
    ws.view_mut::<f32>("encoder.bias")?.fill(encoder);
    ws.view_mut::<f32>("head.weight")?.fill(version as f32);
    ws.set_version(Version(version));
    Ok(ws)
}
// ANCHOR_END: model

/// Version `version` of the policy: [`weights_at`], or with `sparse` one where 2% of the
/// elements of every tensor changed since the version before (element `i` steps up at the
/// versions `v` where `v + 31 i` is a multiple of 50).
fn version_at(manifest: &Arc<Manifest>, version: u64, sparse: bool) -> Result<WeightSet> {
    if !sparse {
        return weights_at(manifest, version);
    }
    let mut ws = WeightSet::zeroed(ModelId::new("policy")?, Arc::clone(manifest));
    for t in manifest.tensors() {
        for (i, x) in ws.view_mut::<f32>(&t.name)?.iter_mut().enumerate() {
            let i = i as u64;
            let base = (i.wrapping_mul(2_654_435_761) % 1000) as f32 * 1e-3;
            *x = base + ((version + (31 * i) % 50) / 50) as f32 * 1e-3;
        }
    }
    ws.set_version(Version(version));
    Ok(ws)
}

// ANCHOR: trainer
fn trainer(args: &Args) -> Result<()> {
    let token = ClusterToken::from_env_or_random()?;
    let launch = LaunchEnv::from_env().ok();
    let bind = args
        .bind
        .or(launch.as_ref().and_then(|l| l.master().ok()))
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    // one node hosts the rendezvous store and the sender agent
    let node = Node::start(NodeConfig::loopback(token.clone()).with_bind(bind))?;
    Store::serve(&node);
    let manifest = Arc::new(policy_manifest(args.size)?);
    let manifests = Manifests::new([(ModelId::new("policy")?, Arc::clone(&manifest))])?;
    let config = TcpConfig {
        expected_receivers: args.workers as usize,
        bucket_size: args.bucket_size,
        ..TcpConfig::default()
    };
    let transport = TcpSender::on_node(&node, config, &manifests)?;
    let store = StoreClient::connect(&node, node.addr(), WAIT)?;
    store.set(
        "refit/policy/sender",
        wire::to_token(&transport.endpoint())?.as_bytes(),
    )?;
    println!(
        "trainer: node {} serving the store and the sender",
        node.addr()
    );
    let children = if args.spawn {
        spawn_workers(args, &token, node.addr())?
    } else {
        Vec::new()
    };
    // connect: wait for every worker to register, deliver version 1, wait for their acks
    let mut sender = SenderInit::new(transport, manifests)
        .with_ack_timeout(WAIT)
        .connect(vec![version_at(&manifest, 1, args.sparse)?], WAIT)?;
    let mut took = Vec::new();
    for v in 2..=args.versions {
        // ... a training step would go here ...
        let next = version_at(&manifest, v, args.sparse)?;
        let start = Instant::now();
        sender.send(next)?;
        let t = start.elapsed();
        took.push(t.as_secs_f64());
        println!(
            "trainer: version {v} acknowledged by {} workers in {:.3} s ({} bytes)",
            args.workers,
            t.as_secs_f64(),
            manifest.total_len()
        );
    }
    took.sort_by(f64::total_cmp);
    if let Some(median) = took.get(took.len() / 2) {
        println!(
            "trainer: median {median:.3} s per version over {} versions, {} workers",
            took.len(),
            args.workers
        );
    }
    sender.shutdown()?;
    for mut child in children {
        let status = child
            .wait()
            .map_err(|e| Error::io("waiting for a worker", e))?;
        if !status.success() {
            return Err(Error::State("a worker failed"));
        }
    }
    println!("trainer: done");
    Ok(())
}
// ANCHOR_END: trainer

// ANCHOR: launch
/// Starts the workers on this host with the launch variables a cluster launcher would set.
fn spawn_workers(
    args: &Args,
    token: &ClusterToken,
    master: SocketAddr,
) -> Result<Vec<std::process::Child>> {
    let exe = std::env::current_exe().map_err(|e| Error::io("locating this program", e))?;
    (1..=args.workers)
        .map(|rank| {
            let launch = LaunchEnv {
                rank,
                world_size: args.workers + 1,
                master_addr: master.ip().to_string(),
                master_port: master.port(),
            };
            let mut cmd = Command::new(&exe);
            cmd.args(["--delta", &args.delta]);
            cmd.arg("worker")
                .envs(launch.vars())
                .env(refit::node::TOKEN_ENV, token.expose())
                .spawn()
                .map_err(|e| Error::io("spawning a worker", e))
        })
        .collect()
}
// ANCHOR_END: launch

// ANCHOR: worker
fn worker(args: &Args) -> Result<()> {
    let launch = LaunchEnv::from_env()?;
    let rank = launch.rank;
    let token = ClusterToken::from_env()?.ok_or(Error::State("REFIT_TOKEN is not set"))?;
    // the worker's own node: the trainer calls `_receive_weights_scheme` on it, and other
    // workers pull relayed bytes from it
    let bind = args
        .bind
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let node = Node::start(NodeConfig::loopback(token.clone()).with_bind(bind))?;
    let store = StoreClient::connect(&node, launch.master()?, WAIT)?;
    let endpoint: TcpEndpoint = wire::from_token(
        std::str::from_utf8(&store.wait_get("refit/policy/sender", WAIT)?)
            .map_err(|_| Error::Wire("the sender's endpoint is not text".into()))?,
    )?;
    let spec = TcpReceiverSpec::new(endpoint, &token);
    let config = TcpReceiverConfig {
        advertise: args.bind.filter(|b| b.port() != 0),
        mode: match args.delta.as_str() {
            "off" => TransferMode::Full,
            "elements" => TransferMode::Elements,
            _ => TransferMode::Delta,
        },
        ..TcpReceiverConfig::default()
    };
    let transport = TcpReceiver::new(spec)
        .with_node(node.clone())
        .with_config(config);
    let mut receiver = ReceiverInit::new(transport, None).connect(WAIT)?;
    let policy = ModelId::new("policy")?;
    println!(
        "worker {rank}: applied version {}",
        receiver.version(&policy)
    );
    loop {
        match receiver.receive(WAIT) {
            Ok(Some(update)) => {
                let w = &update.group[0];
                let head = w.view::<f32>("head.weight")?[0];
                println!(
                    "worker {rank}: applied version {} (head = {head})",
                    w.version()
                );
            }
            Ok(None) => return Err(Error::State("no update in time")),
            Err(Error::PeerGone { .. }) => break,
            Err(e) => return Err(e),
        }
    }
    println!(
        "worker {rank}: trainer gone after version {}",
        receiver.version(&policy)
    );
    Ok(())
}
// ANCHOR_END: worker

fn main() -> ExitCode {
    if let Err(e) = refit::init() {
        eprintln!("multi_node: {e}");
        return ExitCode::FAILURE;
    }
    let args = <Args as clap::Parser>::parse();
    let result = if args.role == "worker" {
        worker(&args)
    } else {
        trainer(&args)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("multi_node {}: {e}", args.role);
            ExitCode::FAILURE
        }
    }
}
