//! A remote actor: an actix actor served by one process and used from another through a
//! typed handle, over the node runtime (TCP, cluster token, a deadline on every call).
//!
//! ```text
//! cargo run --example remote_actor                  # both sides: this process spawns the server
//! # or by hand, in two terminals, with one shared token:
//! REFIT_TOKEN=0123456789abcdef0123 cargo run --example remote_actor -- serve --bind 127.0.0.1:7700
//! REFIT_TOKEN=0123456789abcdef0123 cargo run --example remote_actor -- call \
//!     --addr 127.0.0.1:7700 --target <uuid printed by serve> 5 7 2000
//! ```
//!
//! `serve` starts a `Tally` actor and exposes it under a uuid; `call` adds each number to the
//! remote tally (a number over 1000 is refused by the actor: the refusal comes back as a
//! typed error) and reads the total through a plain `Recipient`. `demo` (the default) runs
//! `serve` as a child process, calls it, then kills it and shows that a call to the dead
//! actor fails at once with a typed error instead of hanging. `bench` prints the median
//! round trip of a remote send against a local actor's.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use actix::prelude::*;
use clap::{Parser, Subcommand};
use refit::actors::remote::{RemoteAddr, RemoteMessage, Uuid, serve};
use refit::actors::{Error, Result};
use refit::node::{ClusterToken, Node, NodeConfig};
use serde::{Deserialize, Serialize};

// ANCHOR: messages
/// Adds to the tally; answers the new total. Numbers over 1000 are refused.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<u64>")]
struct Add(u64);

impl RemoteMessage for Add {
    const NAME: &'static str = "tally.add";
}

/// Reads the total (a plain answer: through a proxy `Recipient`, a failed call is a
/// `MailboxError`, as with a stopped local actor).
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "u64")]
struct Total;

impl RemoteMessage for Total {
    const NAME: &'static str = "tally.total";
}
// ANCHOR_END: messages

/// The actor: a running total.
#[derive(Default)]
struct Tally(u64);

impl Actor for Tally {
    type Context = Context<Self>;
}

impl Handler<Add> for Tally {
    type Result = Result<u64>;
    fn handle(&mut self, Add(n): Add, _: &mut Context<Self>) -> Result<u64> {
        if n > 1000 {
            return Err(Error::Config(format!("{n} is over the limit of 1000")));
        }
        self.0 += n;
        Ok(self.0)
    }
}

impl Handler<Total> for Tally {
    type Result = u64;
    fn handle(&mut self, _: Total, _: &mut Context<Self>) -> u64 {
        self.0
    }
}

#[derive(Debug, Parser)]
#[command(about = "A remote actor: serve one, call it from another process")]
struct Args {
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Serve a tally actor until killed; prints `serving <addr> <uuid>`.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:0")]
        bind: SocketAddr,
    },
    /// Add numbers to a served tally and read its total.
    Call {
        /// The serving node's address.
        #[arg(long)]
        addr: SocketAddr,
        /// The actor's uuid (printed by `serve`).
        #[arg(long)]
        target: Uuid,
        /// Deadline of each call, in milliseconds.
        #[arg(long, default_value_t = 5000)]
        deadline_ms: u64,
        /// Numbers to add.
        numbers: Vec<u64>,
    },
    /// Spawn `serve`, call it, kill it, call again (the default).
    Demo,
    /// Median round trip of a remote send against a local actor's, in one run.
    Bench {
        /// Calls timed on each side.
        #[arg(long, default_value_t = 2000)]
        calls: usize,
    },
}

fn token() -> std::result::Result<ClusterToken, String> {
    ClusterToken::from_env()
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "set REFIT_TOKEN (the same in both processes)".to_owned())
}

// ANCHOR: serve
/// The serving process: a node, the actor, its messages exposed under one uuid.
fn run_server(bind: SocketAddr) -> std::result::Result<(), String> {
    let node =
        Node::start(NodeConfig::loopback(token()?).with_bind(bind)).map_err(|e| e.to_string())?;
    let target = Uuid::new_v4();
    actix::System::new().block_on(async move {
        let tally = Tally::default().start();
        serve::<Add>(&node, target, tally.clone().recipient());
        serve::<Total>(&node, target, tally.recipient());
        println!("serving {} {target}", node.addr());
        // serve until killed
        std::future::pending::<()>().await;
    });
    Ok(())
}
// ANCHOR_END: serve

// ANCHOR: call
/// The calling side: a handle to the remote tally, used directly and as a `Recipient`.
async fn call(remote: &RemoteAddr, numbers: &[u64]) -> Result<()> {
    for &n in numbers {
        // the outer `?` is the call (dead peer, deadline, refusal); the inner result is
        // the actor's answer
        match remote.send(Add(n)).await? {
            Ok(total) => println!("add {n}: total {total}"),
            Err(e) => println!("add {n}: refused: {e}"),
        }
    }
    // code written for local actors takes the proxy as it is
    let total: Recipient<Total> = remote.recipient();
    let t = total
        .send(Total)
        .await
        .map_err(|e| Error::Actor(e.to_string()))?;
    println!("total: {t}");
    Ok(())
}
// ANCHOR_END: call

fn run_client(
    addr: SocketAddr,
    target: Uuid,
    deadline: Duration,
    numbers: &[u64],
) -> std::result::Result<(), String> {
    let client = Node::loopback(token()?).map_err(|e| e.to_string())?;
    actix::System::new()
        .block_on(async move {
            // ANCHOR: connect
            let remote = RemoteAddr::connect(&client, addr, target, "tally", deadline).await?;
            // ANCHOR_END: connect
            call(&remote, numbers).await
        })
        .map_err(|e| e.to_string())
}

/// Starts `serve` as a child process; answers it and the address and uuid it printed.
fn spawn_server(
    token: &ClusterToken,
) -> std::result::Result<(std::process::Child, SocketAddr, Uuid), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .arg("serve")
        .env("REFIT_TOKEN", token.expose())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the server: {e}"))?;
    match server_address(&mut child) {
        Ok((addr, target)) => Ok((child, addr, target)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

/// Reads the `serving <addr> <uuid>` line of a server.
fn server_address(
    child: &mut std::process::Child,
) -> std::result::Result<(SocketAddr, Uuid), String> {
    let stdout = child.stdout.take().ok_or("no server stdout")?;
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| format!("reading the server's address: {e}"))?;
    let mut words = line.split_whitespace().skip(1);
    match (words.next(), words.next()) {
        (Some(a), Some(t)) => Ok((
            a.parse::<SocketAddr>()
                .map_err(|e| format!("server address {a:?}: {e}"))?,
            t.parse::<Uuid>()
                .map_err(|e| format!("server target {t:?}: {e}"))?,
        )),
        _ => Err(format!(
            "the server printed {line:?}, not `serving <addr> <uuid>`"
        )),
    }
}

/// Both sides: the server as a child process of this one.
fn demo() -> std::result::Result<(), String> {
    let token = ClusterToken::random();
    let (mut child, addr, target) = spawn_server(&token)?;
    let result = demo_with(&mut child, addr, target, token);
    let _ = child.kill();
    let _ = child.wait();
    result
}

fn demo_with(
    child: &mut std::process::Child,
    addr: SocketAddr,
    target: Uuid,
    token: ClusterToken,
) -> std::result::Result<(), String> {
    println!(
        "server pid {} serves the tally at {addr} as {target}",
        child.id()
    );
    let client = Node::loopback(token).map_err(|e| e.to_string())?;
    let deadline = Duration::from_secs(5);
    actix::System::new()
        .block_on(async move {
            let remote = RemoteAddr::connect(&client, addr, target, "tally", deadline).await?;
            call(&remote, &[5, 7, 2000, 30]).await?;
            let _ = child.kill();
            let _ = child.wait();
            let t = Instant::now();
            match remote.send(Add(1)).await {
                Ok(answer) => Err(Error::Actor(format!("a killed server answered {answer:?}"))),
                Err(e) => {
                    println!(
                        "after the server was killed: {e} ({} ms)",
                        t.elapsed().as_millis()
                    );
                    Ok(())
                }
            }
        })
        .map_err(|e| e.to_string())
}

/// The median of the durations, in microseconds.
fn median_us(mut d: Vec<Duration>) -> f64 {
    d.sort();
    d.get(d.len() / 2).map_or(0.0, |m| m.as_secs_f64() * 1e6)
}

/// Times `calls` sends of `Add(0)` to a local actor, then to the same actor type served by
/// a child process, and prints both medians and their ratio.
fn bench(calls: usize) -> std::result::Result<(), String> {
    let token = ClusterToken::random();
    let (mut child, addr, target) = spawn_server(&token)?;
    let client = Node::loopback(token).map_err(|e| e.to_string())?;
    let result = actix::System::new().block_on(async move {
        let local = Tally::default().start();
        let remote =
            RemoteAddr::connect(&client, addr, target, "tally", Duration::from_secs(5)).await?;
        let proxy: Recipient<Add> = remote.recipient();
        let mut local_t = Vec::with_capacity(calls);
        let mut remote_t = Vec::with_capacity(calls);
        let mut proxy_t = Vec::with_capacity(calls);
        for _ in 0..calls {
            let t = Instant::now();
            local
                .send(Add(0))
                .await
                .map_err(|e| Error::Actor(e.to_string()))??;
            local_t.push(t.elapsed());
            let t = Instant::now();
            remote.send(Add(0)).await??;
            remote_t.push(t.elapsed());
            let t = Instant::now();
            proxy
                .send(Add(0))
                .await
                .map_err(|e| Error::Actor(e.to_string()))??;
            proxy_t.push(t.elapsed());
        }
        let (l, r, p) = (median_us(local_t), median_us(remote_t), median_us(proxy_t));
        println!("{calls} calls each, medians:");
        println!("  local actor          {l:8.1} us");
        println!("  remote send          {r:8.1} us  ({:.1}x local)", r / l);
        println!("  remote via Recipient {p:8.1} us  ({:.1}x local)", p / l);
        Ok::<(), Error>(())
    });
    let _ = child.kill();
    let _ = child.wait();
    result.map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let r = match args.command.unwrap_or(Cmd::Demo) {
        Cmd::Serve { bind } => run_server(bind),
        Cmd::Call {
            addr,
            target,
            deadline_ms,
            numbers,
        } => run_client(addr, target, Duration::from_millis(deadline_ms), &numbers),
        Cmd::Demo => demo(),
        Cmd::Bench { calls } => bench(calls.max(1)),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("remote_actor: {e}");
            ExitCode::FAILURE
        }
    }
}
