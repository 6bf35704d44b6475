//! A trainer publishes versions as safetensors files in a directory; a Refit receiver
//! applies them, a reader holds one version mapped while newer ones land, and any program
//! with a safetensors reader can open the newest through `policy.safetensors`.
//!
//! ```text
//! cargo run --release --example file_weights [-- VERSIONS]
//! ```

use std::sync::Arc;
use std::time::Duration;

use refit::prelude::*;
use refit::transports::file::{FileConfig, FileReceiver, FileSender, FileVersion};

#[path = "support/policy.rs"]
mod policy;
use policy::{policy_manifest, weights_at};

fn run(versions: u64) -> Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| Error::io("making a directory", e))?;
    let dir = tmp.path().join("weights");
    let manifest = Arc::new(policy_manifest()?);
    let policy = ModelId::new("policy")?;
    // ANCHOR: publish
    // the sender owns the directory; it keeps the newest 2 versions for readers that do
    // not lock, and every version a Refit reader still holds
    let config = FileConfig {
        expected_receivers: 1,
        ..FileConfig::new(&dir)
    };
    let transport = FileSender::create(&config)?;
    let spec = transport.receiver_spec(); // serialisable: ship it to another process
    let manifests = Manifests::new([(policy.clone(), Arc::clone(&manifest))])?;
    let receiver = std::thread::spawn(move || {
        ReceiverInit::new(FileReceiver::new(spec), None).connect(Duration::from_secs(10))
    });
    let mut sender = SenderInit::new(transport, manifests)
        .connect(vec![weights_at(&manifest, 1)?], Duration::from_secs(10))?;
    let receiver = receiver
        .join()
        .map_err(|_| Error::State("receiver thread panicked"))??;
    // ANCHOR_END: publish
    // ANCHOR: hold
    // a reader maps version 1 and holds it: it stays on disk and whole meanwhile
    let held = FileVersion::open_newest(&dir, &policy, Duration::from_secs(5))?;
    let lp = receiver.spawn_loop(
        |u| println!("receiver: applied version {}", u.group[0].version()),
        |e| {
            eprintln!("receiver: refused: {e}");
            true
        },
    );
    for v in 2..=versions {
        sender.send(weights_at(&manifest, v)?)?;
    }
    let first = held
        .tensor("fc1.bias")
        .and_then(|b| b.get(..4))
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    println!(
        "reader: still holds version {} (fc1.bias[0] = {:?}) at {}",
        held.version(),
        first,
        held.path().display()
    );
    drop(held); // no longer held: the next publish collects it
    // ANCHOR_END: hold
    let receiver = lp.stop()?;
    println!("receiver: serves version {}", receiver.version(&policy));
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .map_err(|e| Error::io("listing", e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("policy"))
        .collect();
    files.sort();
    println!("directory: {}", files.join(" "));
    // ANCHOR: foreign
    // any safetensors reader: the symlink names the newest version
    let newest = WeightSet::read_safetensors(dir.join("policy.safetensors"), None)?;
    println!("policy.safetensors: version {}", newest.version());
    // ANCHOR_END: foreign
    receiver.shutdown()?;
    sender.shutdown()
}

/// Weights through files: a sender publishes versions as safetensors files, a receiver
/// applies them, a reader holds an old version, a collector keeps what is held.
#[derive(clap::Parser, Debug)]
#[command(long_about = None)]
struct Args {
    /// Versions to publish (at least 2).
    #[arg(default_value_t = 5, value_parser = clap::value_parser!(u64).range(2..))]
    versions: u64,
}

fn main() -> std::process::ExitCode {
    let versions = <Args as clap::Parser>::parse().versions;
    match run(versions) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("file_weights: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
