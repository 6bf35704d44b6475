//! Helpers shared by the transport tests.
#![allow(dead_code, unreachable_pub, missing_docs, clippy::unwrap_used)]

use std::sync::Arc;

use refit_runtime::{DType, Manifest, Manifests, Version, WeightSet};
use refit_transports::shm::{ShmConfig, ShmReadMode, ShmReceiver, ShmSender};
use refit_transports::tcp::{TcpConfig, TcpReceiver, TcpSender};

// not every test uses every helper
#[allow(unused_imports)]
pub use refit_runtime::testing::id;

#[allow(unused_imports)]
pub use refit_runtime::testing::manifests;

pub fn manifest(hidden: usize) -> Arc<Manifest> {
    refit_runtime::testing::manifest(&[
        ("fc1.weight", DType::F32, &[hidden, 4]),
        ("fc1.bias", DType::F32, &[hidden]),
        ("head.weight", DType::F32, &[2, hidden]),
        ("steps", DType::I64, &[]),
    ])
}

/// A weight set whose every f32 equals the version and whose `steps` is the version.
pub fn stamped(model: &str, m: &Arc<Manifest>, version: u64) -> WeightSet {
    let mut ws = WeightSet::zeroed(id(model), Arc::clone(m));
    for t in m.tensors() {
        match t.dtype {
            DType::F32 => ws.view_mut::<f32>(&t.name).unwrap().fill(version as f32),
            DType::I64 => ws.view_mut::<i64>(&t.name).unwrap().fill(version as i64),
            _ => unreachable!(),
        }
    }
    ws.set_version(Version(version));
    ws
}

/// Checks that every tensor carries the weight set's own version stamp.
pub fn check_stamp(ws: &WeightSet) -> Result<(), String> {
    let v = ws.version().get();
    for t in ws.tensors() {
        let ok = match t.dtype() {
            DType::F32 => t.as_slice::<f32>().unwrap().iter().all(|&x| x == v as f32),
            DType::I64 => t.as_slice::<i64>().unwrap().iter().all(|&x| x == v as i64),
            _ => false,
        };
        if !ok {
            return Err(format!(
                "torn read: tensor `{}` of {} disagrees with version {v}",
                t.name(),
                ws.model()
            ));
        }
    }
    Ok(())
}

/// Pseudo-random bytes (xorshift), different for every seed.
pub fn fill(ws: &mut WeightSet, seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in ws.bytes_mut().unwrap().chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
}

/// Version `version` of `policy` filled with pseudo-random bytes from `seed`.
pub fn random_set(m: &Arc<Manifest>, version: u64, seed: u64) -> WeightSet {
    let mut ws = WeightSet::zeroed(id("policy"), Arc::clone(m));
    fill(&mut ws, seed);
    ws.set_version(Version(version));
    ws
}

/// Publishes `ws` over TCP, lets every receiver apply it on its own thread, and waits for
/// the acknowledgements; hands the receivers back.
pub fn send_all(
    sender: &mut refit_runtime::Sender<refit_transports::tcp::TcpSender>,
    rs: Vec<refit_runtime::Receiver<refit_transports::tcp::TcpReceiver>>,
    ws: WeightSet,
    timeout: std::time::Duration,
) -> Vec<refit_runtime::Receiver<refit_transports::tcp::TcpReceiver>> {
    let pending = sender.send_async(vec![ws]).unwrap();
    let hs: Vec<_> = rs
        .into_iter()
        .map(|mut r| {
            std::thread::spawn(move || {
                r.receive(timeout).unwrap().unwrap();
                r
            })
        })
        .collect();
    sender.wait(&pending, timeout).unwrap();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A shared-memory sender of `ms` expecting one receiver, and that receiver.
pub fn shm_pair(ms: &Manifests, mode: ShmReadMode) -> (ShmSender, ShmReceiver) {
    let cfg = ShmConfig {
        expected_receivers: 1,
        ..ShmConfig::default()
    };
    let s = ShmSender::create(&cfg, ms).unwrap();
    let r = ShmReceiver::new(s.receiver_spec()).with_mode(mode);
    (s, r)
}

/// A TCP sender of `ms` (random token) expecting one receiver, and that receiver.
pub fn tcp_pair(ms: &Manifests) -> (TcpSender, TcpReceiver) {
    let cfg = TcpConfig {
        expected_receivers: 1,
        token: Some(refit_node::ClusterToken::random()),
        ..TcpConfig::default()
    };
    let s = TcpSender::bind(cfg, ms).unwrap();
    let r = TcpReceiver::new(s.receiver_spec());
    (s, r)
}
