//! TCP pull throughput against a raw loopback socket baseline, measured in the same run.
//!
//! ```text
//! cargo test --release -p refit-transports --test tcp_throughput -- --ignored --nocapture
//! REFIT_TCP_BENCH_MIB=256 cargo test --release ...   # smaller model
//! ```
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use refit_node::ClusterToken;
use refit_runtime::{DType, Manifest, ReceiverInit, SenderInit, Version, WeightSet};
use refit_transports::tcp::{TcpConfig, TcpReceiver, TcpReceiverConfig, TcpSender, TransferMode};

const T: Duration = Duration::from_secs(300);

/// Raw loopback: `streams` sockets each move a disjoint slice of `src` into `dst`.
fn raw_loopback(src: &[u8], dst: &mut [u8], streams: usize) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let per = src.len().div_ceil(streams);
    let t = Instant::now();
    std::thread::scope(|s| {
        for part in src.chunks(per) {
            let listener = &listener;
            s.spawn(move || {
                let (mut c, _) = listener.accept().unwrap();
                c.write_all(part).unwrap();
            });
        }
        for part in dst.chunks_mut(per) {
            s.spawn(move || {
                let mut c = TcpStream::connect(addr).unwrap();
                c.read_exact(part).unwrap();
            });
        }
    });
    t.elapsed()
}

fn mib_per_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / d.as_secs_f64()
}

#[test]
#[ignore = "benchmark: run with --release --ignored --nocapture"]
fn tcp_pull_vs_raw_loopback() {
    let mib: usize = std::env::var("REFIT_TCP_BENCH_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let mut b = Manifest::builder();
    for i in 0..(mib / 64).max(1) {
        b.push(format!("layer{i}.weight"), DType::F32, &[16 << 20]); // 64 MiB each
    }
    let m = Arc::new(b.build().unwrap());
    let size = m.total_len();
    let src = vec![0xa5u8; size];
    let mut dst = vec![0u8; size];
    println!("model: {} MiB in {} tensors", size >> 20, m.len());
    for streams in [1, 4] {
        let d = (0..3)
            .map(|_| raw_loopback(&src, &mut dst, streams))
            .min()
            .unwrap();
        println!(
            "raw loopback, {streams} stream(s): {:>7.0} MiB/s ({d:.3?})",
            mib_per_s(size, d)
        );
    }
    drop(dst);
    // what a pull costs besides the socket: a fresh arena (page faults) and the checksums
    let t = Instant::now();
    let mut fresh = WeightSet::zeroed(id("policy"), Arc::clone(&m));
    fresh.bytes_mut().unwrap().fill(1);
    println!(
        "fresh arena + first touch: {:>7.0} MiB/s",
        mib_per_s(size, t.elapsed())
    );
    let t = Instant::now();
    let sums = fresh.tensor_checksums();
    println!(
        "xxh3 of every tensor:      {:>7.0} MiB/s ({} sums)",
        mib_per_s(size, t.elapsed()),
        sums.len()
    );
    drop(fresh);
    let ms = manifests(&[("policy", &m)]);
    let ws = |v: u64| {
        WeightSet::from_bytes(
            id("policy"),
            Version(v),
            Arc::clone(&m),
            &vec![v as u8; size],
        )
        .unwrap()
    };
    for streams in [1, 4] {
        let cfg = TcpConfig {
            token: Some(ClusterToken::random()),
            expected_receivers: 1,
            keep_versions: 1,
            ..TcpConfig::default()
        };
        let s = TcpSender::bind(cfg, &ms).unwrap();
        let r = TcpReceiver::new(s.receiver_spec()).with_config(TcpReceiverConfig {
            streams,
            mode: TransferMode::Full,
            keep_versions: 1,
            ..TcpReceiverConfig::default()
        });
        let h = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T).unwrap());
        let mut sender = SenderInit::new(s, ms.clone())
            .with_ack_timeout(T)
            .connect(vec![ws(1)], T)
            .unwrap();
        let mut receiver = h.join().unwrap();
        let mut best = Duration::MAX;
        for v in 2..=4 {
            let next = ws(v);
            let t = Instant::now();
            let pending = sender.send_async(vec![next]).unwrap();
            receiver.receive(T).unwrap().unwrap();
            sender.wait(&pending, T).unwrap();
            best = best.min(t.elapsed());
        }
        println!(
            "refit tcp pull, {streams} stream(s): {:>7.0} MiB/s ({best:.3?}; publish checksums, \
             pull, verify, apply, ack)",
            mib_per_s(size, best)
        );
    }
}
