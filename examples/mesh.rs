//! Many trainer shards to many engines: M sender processes each hold a slice of the rows of
//! every tensor (what a tensor-parallel or row-sharded trainer holds) and publish it with no
//! gather; N receiver processes each serve a slice of the columns (tensor-parallel engines)
//! and pull exactly that, from every shard at once.
//!
//! ```text
//! cargo run --release --example mesh [-- --senders 2 --receivers 2 --size 64MiB --versions 4]
//! ```
//!
//! Run as is, rank 0 starts the other ranks on loopback. Across hosts, start each rank with
//! the launch variables (RANK, WORLD_SIZE = M + N, MASTER_ADDR, MASTER_PORT) and one
//! REFIT_TOKEN, as `examples/scripts/mesh-netns.sh` does: ranks 0..M are the senders (rank
//! 0 also serves the rendezvous store), ranks M..M+N the receivers. Rank 0 prints, per
//! version, the time from the go until every receiver holds its part, and the median of
//! the versions after the first (the first pull lands in new memory; later ones in the
//! buffers the receiver handed back, each pull opening one stream per sender).

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use refit::node::{ClusterToken, LaunchEnv, Node, NodeConfig, Store, StoreClient};
use refit::prelude::{DType, Error, Manifest, ModelId, Result, Version};
use refit::runtime::mesh::{extract, slices};
use refit::runtime::wire;
use refit::transports::mesh::{MeshEndpoint, MeshReceiver, MeshSender, Parts};

const WAIT: Duration = Duration::from_secs(120);

/// Trainer shards publishing to engines that each want a slice.
#[derive(Parser, Debug)]
struct Args {
    /// Sender processes (trainer shards).
    #[arg(long, default_value_t = 2)]
    senders: usize,
    /// Receiver processes (engines).
    #[arg(long, default_value_t = 2)]
    receivers: usize,
    /// Bytes of the model (`64MiB`, `1GiB`).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    size: usize,
    /// Versions (all timed).
    #[arg(long, default_value_t = 4)]
    versions: u64,
    /// Address of this rank's node (default: loopback, any port).
    #[arg(long)]
    bind: Option<SocketAddr>,
    /// Do not start the other ranks (they are started separately).
    #[arg(long = "no-spawn", action = clap::ArgAction::SetFalse)]
    spawn: bool,
}

fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let size: bytesize::ByteSize = s
        .trim()
        .parse()
        .map_err(|e| format!("bad size {s:?}: {e}"))?;
    usize::try_from(size.as_u64()).map_err(|_| format!("size {s:?} overflows"))
}

// ANCHOR: parts
/// Four f32 matrices of about 1024 columns, about `size` bytes together: rows a multiple
/// of the senders, columns of the receivers.
fn model(size: usize, senders: usize, receivers: usize) -> Result<Manifest> {
    let cols = 1024usize.next_multiple_of(receivers.max(1));
    let rows = (size / (4 * cols * 4))
        .max(1)
        .next_multiple_of(senders.max(1));
    let mut b = Manifest::builder();
    for i in 0..4 {
        b = b.tensor(format!("layer{i}.weight"), DType::F32, &[rows, cols]);
    }
    b.build()
}
// ANCHOR_END: parts

/// Tensor `name` at `version`, whole (what a trainer step would produce).
fn whole(m: &Manifest, name: &str, version: u64) -> Vec<u8> {
    let len = m.get(name).map_or(0, |t| t.len);
    (0..len)
        .map(|i| (i as u64 ^ version.wrapping_mul(131)) as u8)
        .collect()
}

fn sender(args: &Args, rank: usize, node: &Node, store: &StoreClient, m: &Manifest) -> Result<()> {
    // ANCHOR: sender
    // this shard's rows of every tensor
    let parts = slices(m, 0, rank, args.senders);
    let sender = MeshSender::on_node(node, ModelId::new("policy")?, m, parts.clone())?;
    store.set(
        &format!("mesh/sender/{rank}"),
        wire::to_token(&(sender.endpoint(), parts))?.as_bytes(),
    )?;
    let mut took = Vec::new();
    for v in 1..=args.versions {
        // this shard's part of version v, cut from what it computed
        let data = sender
            .parts()
            .iter()
            .map(|(n, p)| extract(m, n, p, &whole(m, n, v)))
            .collect::<Result<Vec<Arc<[u8]>>>>()?;
        store.wait_get(&format!("mesh/go/{v}"), WAIT)?;
        let t = Instant::now();
        sender.publish(Version(v), data)?;
        // ANCHOR_END: sender
        if rank == 0 {
            for r in 0..args.receivers {
                let said = store.wait_get(&format!("mesh/done/{v}/{r}"), WAIT)?;
                if said != b"done" {
                    let why = String::from_utf8_lossy(&said).into_owned();
                    return Err(Error::Config(format!("receiver {r}: {why}")));
                }
            }
            // version 1 is the first pull (into new buffers): timed, not counted
            if v > 1 || args.versions == 1 {
                took.push(t.elapsed().as_secs_f64());
            }
            println!(
                "mesh: version {v} held by every receiver in {:.3} s",
                t.elapsed().as_secs_f64()
            );
            store.set(&format!("mesh/go/{}", v + 1), b"go")?;
        }
    }
    if rank == 0 {
        took.sort_by(f64::total_cmp);
        let median = took.get(took.len() / 2).copied().unwrap_or(f64::NAN);
        println!(
            "mesh: median {median:.3} s per version over {} versions (after the first), {} senders -> {} receivers, {} bytes",
            took.len(),
            args.senders,
            args.receivers,
            m.payload_len()
        );
    }
    // the receivers' last pulls are served before this shard leaves
    store.wait_get(&format!("mesh/go/{}", args.versions + 1), WAIT)?;
    Ok(())
}

fn receiver(
    args: &Args,
    r: usize,
    store: &StoreClient,
    m: &Manifest,
    token: &ClusterToken,
) -> Result<()> {
    // ANCHOR: receiver
    let mut book: Vec<(MeshEndpoint, Parts)> = Vec::new();
    for s in 0..args.senders {
        let text = store.wait_get(&format!("mesh/sender/{s}"), WAIT)?;
        let text = std::str::from_utf8(&text)
            .map_err(|_| Error::Wire("a sender's card is not text".into()))?;
        book.push(wire::from_token(text)?);
    }
    let mut receiver = MeshReceiver::new(m, book, slices(m, 1, r, args.receivers), token.clone())?;
    for v in 1..=args.versions {
        let got = receiver.pull(Version(v), WAIT)?;
        // ANCHOR_END: receiver
        store.set(&format!("mesh/done/{v}/{r}"), b"done")?;
        if v == args.versions {
            println!(
                "mesh receiver {r}: {} parts of version {}, {} bytes per version of {}",
                got.parts.len(),
                got.version,
                receiver.bytes_per_pull(),
                m.payload_len()
            );
        }
        // an engine done with a version hands its buffers back for the next pull
        receiver.recycle(got);
    }
    Ok(())
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let m = model(args.size, args.senders, args.receivers)?;
    let world = args.senders + args.receivers;
    let token = ClusterToken::from_env_or_random()?;
    let launch = match LaunchEnv::from_env() {
        Ok(l) => l,
        Err(_) => LaunchEnv {
            rank: 0,
            world_size: world as u32,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
        },
    };
    let rank = launch.rank as usize;
    let bind = args.bind.unwrap_or_else(|| {
        SocketAddr::from((
            [127, 0, 0, 1],
            if rank == 0 { launch.master_port } else { 0 },
        ))
    });
    let node = Node::start(NodeConfig::loopback(token.clone()).with_bind(bind))?;
    let mut children = Vec::new();
    if rank == 0 {
        Store::serve(&node);
        if args.spawn {
            for r in 1..world {
                let env = LaunchEnv {
                    rank: r as u32,
                    world_size: world as u32,
                    master_addr: node.addr().ip().to_string(),
                    master_port: node.addr().port(),
                };
                children.push(
                    Command::new(std::env::current_exe()?)
                        .args(std::env::args().skip(1))
                        .args(["--no-spawn"])
                        .envs(env.vars())
                        .env(refit::node::TOKEN_ENV, token.expose())
                        .spawn()?,
                );
            }
        }
    }
    let master = if rank == 0 {
        node.addr()
    } else {
        launch.master()?
    };
    let store = StoreClient::connect(&node, master, WAIT)?;
    if rank == 0 {
        store.set("mesh/go/1", b"go")?;
    }
    if rank < args.senders {
        sender(&args, rank, &node, &store, &m)?;
    } else {
        let r = rank - args.senders;
        if let Err(e) = receiver(&args, r, &store, &m, &token) {
            // rank 0 hears it at once instead of waiting out its deadline
            let done = (1..=args.versions)
                .find(|v| !matches!(store.get(&format!("mesh/done/{v}/{r}")), Ok(Some(_))))
                .unwrap_or(args.versions);
            store.set(
                &format!("mesh/done/{done}/{r}"),
                format!("failed: {e}").as_bytes(),
            )?;
            return Err(e.into());
        }
    }
    // rank 0's store stays up until every rank is done with it
    if rank == 0 {
        for r in 1..world {
            store.wait_get(&format!("mesh/bye/{r}"), WAIT)?;
        }
    } else {
        store.set(&format!("mesh/bye/{rank}"), b"bye")?;
    }
    for mut c in children {
        if !c.wait()?.success() {
            return Err("a rank failed".into());
        }
    }
    Ok(())
}
