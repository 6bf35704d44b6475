//! A sender process and two receiver processes share weights through shared memory.
//!
//! ```text
//! cargo run --release --example shm_weights [-- VERSIONS]
//! ```
//!
//! The sender re-runs this program twice as a receiver, handing each the receiver
//! description as a token; it then publishes `VERSIONS` versions of a small policy and waits
//! for both receivers to acknowledge each one. Every version carries a checksum that the
//! receivers verify. Receivers print every version they apply, read in place from the
//! sender's slot (one copy, the sender's, for both).

use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Duration;

use refit::prelude::*;
use refit::runtime::wire;

#[path = "support/policy.rs"]
mod policy;
use policy::{policy_manifest, weights_at};

// ANCHOR: sender
fn run_sender(versions: u64) -> Result<()> {
    let manifest = Arc::new(policy_manifest()?);
    let manifests = Manifests::new([(ModelId::new("policy")?, Arc::clone(&manifest))])?;
    // init: create the segments; nothing is sent yet. With `checksum`, every version is
    // hashed as it is written and verified by each receiver before it applies it.
    let config = ShmConfig {
        expected_receivers: 2,
        checksum: true,
        ..ShmConfig::default()
    };
    let transport = ShmSender::create(&config, &manifests)?;
    let token = wire::to_token(&transport.receiver_spec())?;
    let exe = std::env::current_exe().map_err(|e| Error::io("locating this program", e))?;
    let mut children = Vec::new();
    for i in 0..2 {
        let child = Command::new(&exe)
            .args(["receiver", &i.to_string(), &token])
            .spawn()
            .map_err(|e| Error::io("spawning a receiver", e))?;
        children.push(child);
    }
    // connect: wait for both receivers, deliver version 1, wait for their acks
    let init = SenderInit::new(transport, manifests).with_ack_timeout(Duration::from_secs(10));
    let mut sender = init.connect(vec![weights_at(&manifest, 1)?], Duration::from_secs(10))?;
    for v in 2..=versions {
        let acked = sender.send(weights_at(&manifest, v)?)?;
        println!("sender: published {acked:?}, acknowledged by both receivers");
        std::thread::sleep(Duration::from_millis(20));
    }
    // shutdown: removes the segments; receivers see the sender leave and exit
    sender.shutdown()?;
    for mut c in children {
        let status = c
            .wait()
            .map_err(|e| Error::io("waiting for a receiver", e))?;
        if !status.success() {
            return Err(Error::State("a receiver failed"));
        }
    }
    Ok(())
}
// ANCHOR_END: sender

// ANCHOR: receiver
fn run_receiver(index: &str, token: &str) -> Result<()> {
    let spec: ShmReceiverSpec = wire::from_token(token)?;
    let expected = Manifests::new([(ModelId::new("policy")?, Arc::new(policy_manifest()?))])?;
    // init (local), then connect: attach, check manifests, apply the initial weights
    let mut receiver = ReceiverInit::new(ShmReceiver::new(spec), Some(expected))
        .connect(Duration::from_secs(10))?;
    let policy = ModelId::new("policy")?;
    println!(
        "receiver {index}: connected at version {}",
        receiver.version(&policy)
    );
    loop {
        match receiver.receive(Duration::from_secs(10)) {
            Ok(Some(update)) => {
                let w = &update.group[0];
                let first = w.view::<f32>("fc1.weight")?[0];
                println!(
                    "receiver {index}: applied version {} (fc1.weight[0] = {first})",
                    w.version()
                );
            }
            Ok(None) => return Err(Error::State("no update for 10 s")),
            Err(Error::PeerGone { reason, .. }) => {
                println!(
                    "receiver {index}: sender left ({reason}); last version {}, {} versions \
                     copied (the others were read where the sender wrote them)",
                    receiver.version(&policy),
                    receiver.transport().versions_copied()
                );
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
}
// ANCHOR_END: receiver

/// Weights through shared memory: this process publishes versions to two receiver
/// processes (itself, re-run as `receiver`).
#[derive(clap::Parser, Debug)]
#[command(long_about = None, args_conflicts_with_subcommands = true)]
struct Args {
    /// Versions to publish (at least 1).
    #[arg(default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    versions: u64,
    #[command(subcommand)]
    command: Option<Sub>,
}

#[derive(clap::Subcommand, Debug)]
enum Sub {
    /// A receiver process (spawned by the sender).
    #[command(hide = true)]
    Receiver {
        /// Receiver index.
        index: String,
        /// The shared-memory receiver's token.
        token: String,
    },
}

fn main() -> ExitCode {
    // ANCHOR: init
    // logging (RUST_LOG) and SIGINT/SIGTERM: segments released, exit status 130/143
    if let Err(e) = refit::init() {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    // ANCHOR_END: init
    let args = <Args as clap::Parser>::parse();
    let result = match &args.command {
        Some(Sub::Receiver { index, token }) => run_receiver(index, token),
        None => run_sender(args.versions),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
