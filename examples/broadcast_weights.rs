//! A trainer broadcasting weights to receiver processes through the CPU collective: rank 0
//! sends each bucket once, down a chain of receivers that forward it as it arrives.
//!
//! ```text
//! cargo run --release --example broadcast_weights [-- --receivers 3 --versions 5 --size 64MiB]
//! ```
//!
//! Run as is, the trainer starts its receivers itself on loopback and prints, per version,
//! the time until every receiver applied and acknowledged it. Across hosts, give every
//! process the same token and start the receivers by hand:
//!
//! ```text
//! # host A: the trainer, serving the rendezvous store
//! REFIT_TOKEN=... broadcast_weights trainer --bind 10.0.0.1:29500 --receivers 2 --no-spawn
//! # hosts B and C
//! REFIT_TOKEN=... broadcast_weights receiver --store 10.0.0.1:29500 --member r1 --bind 10.0.0.2
//! REFIT_TOKEN=... broadcast_weights receiver --store 10.0.0.1:29500 --member r2 --bind 10.0.0.3
//! ```

use std::net::{IpAddr, SocketAddr};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit::prelude::*;
use refit::runtime::node::{ClusterToken, Node, NodeConfig, Store, StoreClient, TOKEN_ENV};
use refit::transports::broadcast::{BroadcastConfig, BroadcastReceiver, BroadcastSender};
use refit::transports::collective::{CpuConfig, Rendezvous};

const WAIT: Duration = Duration::from_secs(120);
const GROUP: &str = "weights/policy";

/// Weights by broadcast: a trainer and receiver processes on the CPU collective.
#[derive(clap::Parser, Debug)]
#[command(long_about = None)]
struct Args {
    /// This process's role.
    #[arg(default_value = "trainer", value_parser = ["trainer", "receiver"])]
    role: String,
    /// Receivers (trainer).
    #[arg(long, default_value_t = 2)]
    receivers: usize,
    /// Versions to publish after the initial one (trainer).
    #[arg(long, default_value_t = 5)]
    versions: u64,
    /// Weight bytes (trainer).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    size: usize,
    /// Bucket bytes.
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    bucket_size: usize,
    /// The trainer's store address (trainer: where to serve it).
    #[arg(long, default_value = "127.0.0.1:0")]
    bind: String,
    /// The store to join (receiver).
    #[arg(long)]
    store: Option<SocketAddr>,
    /// This receiver's name (receiver).
    #[arg(long, default_value = "r1")]
    member: String,
    /// Do not start the receivers (trainer; start them by hand).
    #[arg(long)]
    no_spawn: bool,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len()));
    let n: usize = num.parse().map_err(|e| format!("size {s:?}: {e}"))?;
    let mult = match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => return Err(format!("size {s:?}: unknown unit {other:?}")),
    };
    Ok(n * mult)
}

fn config(bucket: usize) -> BroadcastConfig {
    BroadcastConfig {
        bucket_size: bucket,
        ..BroadcastConfig::new(GROUP)
    }
}

// ANCHOR: manifest
/// 16 f32 tensors of `size / 16` bytes each.
fn manifest(size: usize) -> Result<Arc<Manifest>, Error> {
    let mut b = Manifest::builder();
    for i in 0..16 {
        b.push(format!("layer{i}.weight"), DType::F32, &[size / 64]);
    }
    Ok(Arc::new(b.build()?))
}
// ANCHOR_END: manifest

/// Every f32 equals the version: receivers check what they got.
fn at(m: &Arc<Manifest>, v: u64) -> Result<WeightSet, Error> {
    let bytes = (v as f32).to_le_bytes().repeat(m.total_len() / 4);
    WeightSet::from_bytes(ModelId::new("policy")?, Version(v), Arc::clone(m), &bytes)
}

fn trainer(args: &Args, token: ClusterToken) -> Result<(), Box<dyn std::error::Error>> {
    let bind: SocketAddr = args.bind.parse()?;
    let node = Node::start(NodeConfig::loopback(token.clone()).with_bind(bind))?;
    Store::serve(&node);
    println!("trainer: serving the store at {}", node.addr());
    let members: Vec<String> = (1..=args.receivers).map(|i| format!("r{i}")).collect();
    let mut children = Vec::new();
    if !args.no_spawn {
        for m in &members {
            children.push(
                Command::new(std::env::current_exe()?)
                    .args(["receiver", "--member", m, "--store"])
                    .arg(node.addr().to_string())
                    .args(["--bucket-size", &args.bucket_size.to_string()])
                    .env(TOKEN_ENV, token.expose())
                    .spawn()?,
            );
        }
    }
    // ANCHOR: trainer
    let store: Arc<dyn Rendezvous> = Arc::new(StoreClient::connect(&node, node.addr(), WAIT)?);
    let cpu = CpuConfig::new(token).with_bind(bind.ip());
    let transport = BroadcastSender::new(cpu, store, config(args.bucket_size), members)?;
    let m = manifest(args.size)?;
    let manifests = Manifests::new([(ModelId::new("policy")?, Arc::clone(&m))])?;
    let mut sender = SenderInit::new(transport, manifests)
        .with_ack_timeout(WAIT)
        .connect(vec![at(&m, 1)?], WAIT)?;
    let mut times = Vec::new();
    for v in 2..=args.versions + 1 {
        let w = at(&m, v)?;
        let t = Instant::now();
        sender.send(w)?; // every bucket broadcast once, applied and acknowledged by all
        times.push(t.elapsed().as_secs_f64());
        println!(
            "trainer: version {v} acknowledged by every receiver in {:.3} s",
            times[times.len() - 1]
        );
    }
    sender.shutdown()?;
    // ANCHOR_END: trainer
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    println!(
        "trainer: median {median:.3} s per version of {} MiB to {} receivers",
        args.size >> 20,
        args.receivers
    );
    for mut c in children {
        if !c.wait()?.success() {
            return Err("a receiver failed".into());
        }
    }
    Ok(())
}

fn receiver(args: &Args, token: ClusterToken) -> Result<(), Box<dyn std::error::Error>> {
    let store_addr = args.store.ok_or("--store is needed")?;
    let bind: IpAddr = args
        .bind
        .parse::<SocketAddr>()
        .map_or_else(|_| args.bind.parse::<IpAddr>(), |a| Ok(a.ip()))?;
    let node =
        Node::start(NodeConfig::loopback(token.clone()).with_bind(SocketAddr::new(bind, 0)))?;
    // ANCHOR: receiver
    let store: Arc<dyn Rendezvous> = Arc::new(StoreClient::connect(&node, store_addr, WAIT)?);
    let cpu = CpuConfig::new(token).with_bind(bind);
    let transport = BroadcastReceiver::new(cpu, store, config(args.bucket_size), &args.member)?;
    let mut r = ReceiverInit::new(transport, None).connect(WAIT)?;
    let policy = ModelId::new("policy")?;
    loop {
        match r.receive(WAIT) {
            Ok(Some(u)) => {
                let w = &u.group[0];
                let v = w.version().get() as f32;
                let ok = w
                    .tensors()
                    .all(|t| t.as_slice::<f32>().is_ok_and(|x| x.iter().all(|&y| y == v)));
                if !ok {
                    return Err(format!("version {v} arrived with other values").into());
                }
            }
            Ok(None) => return Err("no version within the deadline".into()),
            // the trainer left: done
            Err(Error::PeerGone { .. }) => break,
            Err(e) => return Err(e.into()),
        }
    }
    // ANCHOR_END: receiver
    println!("{}: last version {}", args.member, r.version(&policy).get());
    Ok(())
}

fn main() -> ExitCode {
    let args = <Args as clap::Parser>::parse();
    let run = || -> Result<(), Box<dyn std::error::Error>> {
        let token = ClusterToken::from_env_or_random()?;
        if args.role == "trainer" {
            trainer(&args, token)
        } else {
            receiver(&args, token)
        }
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("broadcast_weights {}: {e}", args.role);
            ExitCode::FAILURE
        }
    }
}
