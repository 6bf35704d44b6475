//! Quick start: a trainer publishes versions of a model over TCP, and an engine applies each
//! one whole (or not at all), using nothing but `refit::prelude` and no optional feature.
//! It takes no arguments. The book shows this file whole, and a test builds it as the
//! `main.rs` of a fresh crate whose only dependency is `refit` with no default features.
//!
//! ```text
//! cargo run --example quick_start
//! ```

// ANCHOR: all
use std::sync::Arc;
use std::time::Duration;

use refit::prelude::*;

const WAIT: Duration = Duration::from_secs(30);

/// The trainer's weights at `version` (a real trainer would export its parameters).
fn weights_at(manifest: &Arc<Manifest>, version: u64) -> Result<WeightSet> {
    let mut ws = WeightSet::zeroed(ModelId::new("policy")?, Arc::clone(manifest));
    ws.view_mut::<f32>("fc.weight")?.fill(0.5 * version as f32);
    ws.view_mut::<f32>("fc.bias")?.fill(version as f32);
    ws.set_version(Version(version));
    Ok(ws)
}

fn main() -> Result<()> {
    // 1. The model's layout, which both ends agree on when they connect.
    let manifest = Arc::new(
        Manifest::builder()
            .tensor("fc.weight", DType::F32, &[64, 32])
            .tensor("fc.bias", DType::F32, &[64])
            .build()?,
    );
    let manifests = Manifests::new([(ModelId::new("policy")?, Arc::clone(&manifest))])?;

    // 2. The trainer's end: a sender agent on loopback TCP. Every node of a cluster holds
    //    the same token (across hosts: from REFIT_TOKEN or an owner-only file).
    let token = ClusterToken::random();
    let config = TcpConfig {
        token: Some(token.clone()),
        expected_receivers: 1,
        ..TcpConfig::default()
    };
    let transport = TcpSender::bind(config, &manifests)?;
    // what receivers need to find it: its address and id, no secret
    let endpoint = transport.endpoint();

    // 3. The engine's end, on a thread here (another process or host in real life).
    let engine = std::thread::spawn(move || -> Result<()> {
        let spec = TcpReceiverSpec::new(endpoint, &token);
        let mut receiver = ReceiverInit::new(TcpReceiver::new(spec), None).connect(WAIT)?;
        let policy = ModelId::new("policy")?;
        println!("engine: serving version {}", receiver.version(&policy));
        loop {
            match receiver.receive(WAIT) {
                Ok(Some(update)) => {
                    let w = &update.group[0];
                    let bias = w.view::<f32>("fc.bias")?[0];
                    println!("engine: applied version {} (fc.bias = {bias})", w.version());
                }
                Ok(None) => return Err(Error::State("no version in time")),
                Err(Error::PeerGone { .. }) => break, // the trainer is done
                Err(e) => return Err(e),
            }
        }
        println!(
            "engine: trainer gone, still serving version {}",
            receiver.version(&policy)
        );
        Ok(())
    });

    // 4. Connect (waits for the engine and delivers version 1), then publish: each `send`
    //    returns once the engine has applied the version.
    let mut sender = SenderInit::new(transport, manifests)
        .with_ack_timeout(WAIT)
        .connect(vec![weights_at(&manifest, 1)?], WAIT)?;
    for version in 2..=3 {
        sender.send(weights_at(&manifest, version)?)?;
        println!("trainer: version {version} applied by the engine");
    }
    sender.shutdown()?;
    engine
        .join()
        .map_err(|_| Error::State("the engine thread panicked"))?
}
// ANCHOR_END: all
