//! The streaming receive over TCP: each tensor handed over as soon as its buckets are
//! verified, nothing of the version kept by the receiver, memory bounded by a few buckets;
//! a damaged bucket or a failing apply reported as what it did to the caller's model.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use refit_node::ClusterToken;
use refit_runtime::{
    DType, Error, Manifest, Mismatch, Receiver, ReceiverInit, Result, Sender, SenderInit, Version,
    WeightSet,
};
use refit_transports::tcp::{TcpConfig, TcpReceiver, TcpReceiverConfig, TcpSender};

const T: Duration = Duration::from_secs(60);
const MIB: usize = 1 << 20;

/// The caller's model: each tensor's bytes by name, and the version each came from.
#[derive(Default)]
struct Model(BTreeMap<String, (Version, Vec<u8>)>);

impl Model {
    fn apply(&mut self, one: WeightSet) -> Result<()> {
        let t = &one.manifest().tensors()[0];
        assert_eq!(one.manifest().len(), 1, "one tensor at a time");
        let bytes = one.bytes()[t.range()].to_vec();
        self.0.insert(t.name.clone(), (one.version(), bytes));
        Ok(())
    }

    /// True when every tensor holds `ws`'s bytes, from its version.
    fn holds(&self, ws: &WeightSet) -> bool {
        ws.manifest().tensors().iter().all(|t| {
            self.0
                .get(&t.name)
                .is_some_and(|(v, b)| *v == ws.version() && b[..] == ws.bytes()[t.range()])
        }) && self.0.len() == ws.manifest().len()
    }
}

/// `tensors` f32 tensors of `mib` MiB each, with one of 14 bytes after the first (the
/// arena pads it to the alignment: bytes between tensors) and one of no bytes at the end.
fn model_manifest(tensors: usize, mib: usize) -> Arc<Manifest> {
    let mut b = Manifest::builder();
    for i in 0..tensors {
        b.push(format!("layer{i}.weight"), DType::F32, &[mib << 18]);
        if i == 0 {
            b.push("odd", DType::F16, &[7]);
        }
    }
    b.push("empty", DType::F32, &[0]);
    Arc::new(b.build().unwrap())
}

/// A TCP sender of `ms` for one receiver, with `bucket` bytes per bucket.
fn sender_for(ms: &refit_runtime::Manifests, bucket: usize) -> TcpSender {
    let cfg = TcpConfig {
        expected_receivers: 1,
        token: Some(ClusterToken::random()),
        bucket_size: bucket,
        ..TcpConfig::default()
    };
    TcpSender::bind(cfg, ms).unwrap()
}

/// A sender of `initial` with `bucket` bytes per bucket, and one streaming receiver of it,
/// which streamed `initial` into the returned model (the sender's connect waits for that).
fn streaming_pair(
    m: &Arc<Manifest>,
    initial: WeightSet,
    bucket: usize,
) -> (Sender<TcpSender>, Receiver<TcpReceiver>, Model) {
    let ms = manifests(&[("policy", m)]);
    let s = sender_for(&ms, bucket);
    let r = TcpReceiver::new(s.receiver_spec())
        .with_config(TcpReceiverConfig::default())
        .streaming();
    let h = std::thread::spawn(move || {
        let mut r = ReceiverInit::new(r, None).connect_streaming(T).unwrap();
        let mut model = Model::default();
        let got = r.stream(T, &mut |one| model.apply(one)).unwrap().unwrap();
        assert_eq!(got, vec![(id("policy"), Version(1))]);
        (r, model)
    });
    let sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![initial], T)
        .unwrap();
    let (r, model) = h.join().unwrap();
    (sender, r, model)
}

#[test]
fn a_streaming_receiver_applies_each_tensor_once_verified_and_keeps_no_copy() {
    // 32 tensors of 4 MiB (128 MiB), 4 MiB buckets over 4 streams
    let (bucket, tensor) = (4 * MIB, 4 * MIB);
    let m = model_manifest(32, 4);
    let v1 = random_set(&m, 1, 1);
    let (mut sender, mut r, mut model) = streaming_pair(&m, v1.to_owned_copy(), bucket);
    assert!(model.holds(&v1), "the initial version, bit-identical");
    // nothing of the version is held by the receiver: it lives in the caller's model
    assert!(r.current(&id("policy")).is_none());
    assert_eq!(r.version(&id("policy")), Version(1));

    let v2 = random_set(&m, 2, 2);
    let pending = sender.send_async(vec![v2.to_owned_copy()]).unwrap();
    r.stream(T, &mut |one| model.apply(one)).unwrap().unwrap();
    // acknowledged once every tensor was applied
    sender.wait(&pending, T).unwrap();
    assert!(model.holds(&v2));
    // every byte came over (no base is held for a delta), and nothing was relayed
    assert_eq!(r.transport().bytes_relayed(), 0);
    // memory: the tensors of the buckets in flight on each stream and those queued for
    // the caller, far below the model
    let peak = r.transport().streaming_peak() as usize;
    let bound = 4 * (bucket + tensor) + 2 * tensor;
    eprintln!(
        "streaming peak {} MiB for a {} MiB model (bound {} MiB)",
        peak / MIB,
        m.total_len() / MIB,
        bound / MIB
    );
    assert!(peak <= bound, "peak {peak} over {bound}");
    assert!(peak < m.total_len() / 2, "peak {peak}");
}

#[test]
fn a_tensor_cut_across_buckets_is_handed_over_whole() {
    // 4 tensors of 8 MiB in 3 MiB buckets: every tensor spans three or four buckets
    let m = model_manifest(4, 8);
    let v1 = random_set(&m, 1, 5);
    let (_sender, _r, model) = streaming_pair(&m, v1.to_owned_copy(), 3 * MIB);
    assert!(model.holds(&v1));
}

#[test]
fn a_damaged_bucket_is_refused_and_the_next_stream_brings_the_version_whole() {
    let m = model_manifest(16, 1);
    let v1 = random_set(&m, 1, 3);
    let (mut sender, mut r, mut model) = streaming_pair(&m, v1.to_owned_copy(), MIB);
    let v2 = random_set(&m, 2, 4);
    sender.transport().inject_corruption(1);
    let pending = sender.send_async(vec![v2.to_owned_copy()]).unwrap();
    let err = r.stream(T, &mut |one| model.apply(one)).unwrap_err();
    // the damage is named (a tensor's checksum, or a bucket's when it hit the padding
    // between tensors) whether or not other tensors were applied first
    let checksum = |e: &Error| match e {
        Error::Tensor {
            problem: Mismatch::Checksum { .. },
            ..
        } => true,
        Error::Bucket { reason, .. } => reason.contains("checksum"),
        _ => false,
    };
    match &err {
        Error::PartlyApplied {
            version,
            applied,
            tensors,
            source,
            ..
        } => {
            assert_eq!(*version, Version(2));
            assert!(*applied > 0 && applied < tensors, "{err}");
            assert!(checksum(source), "{err}");
            assert!(err.to_string().contains("mixed"), "{err}");
        }
        e => assert!(checksum(e), "{err}"),
    }
    assert_eq!(r.version(&id("policy")), Version(1), "not admitted");
    assert!(sender.wait(&pending, Duration::from_millis(100)).is_err());
    // the version is still pending: the next stream pulls every byte again, clean
    r.stream(T, &mut |one| model.apply(one)).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    assert!(model.holds(&v2));
    assert_eq!(r.version(&id("policy")), Version(2));
}

#[test]
fn an_apply_that_fails_stops_the_pull_and_says_how_far_it_got() {
    let m = model_manifest(8, 1);
    let v1 = random_set(&m, 1, 7);
    let (mut sender, mut r, mut model) = streaming_pair(&m, v1.to_owned_copy(), MIB);
    let v2 = random_set(&m, 2, 8);
    let pending = sender.send_async(vec![v2.to_owned_copy()]).unwrap();
    let mut n = 0;
    let err = r
        .stream(T, &mut |one| {
            n += 1;
            if n == 3 {
                return Err(Error::Config("the engine refused it".into()));
            }
            model.apply(one)
        })
        .unwrap_err();
    match &err {
        Error::PartlyApplied {
            applied, source, ..
        } => {
            assert_eq!(*applied, 2);
            assert!(matches!(**source, Error::Config(_)), "{err}");
        }
        other => panic!("expected PartlyApplied, got {other}"),
    }
    assert_eq!(r.version(&id("policy")), Version(1));
    assert!(sender.wait(&pending, Duration::from_millis(100)).is_err());
    // the receiver lives on: the version streams in whole at the next call
    r.stream(T, &mut |one| model.apply(one)).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    assert!(model.holds(&v2));
}

#[test]
fn a_receiver_that_does_not_stream_hands_over_tensor_by_tensor_too() {
    let m = model_manifest(4, 1);
    let v1 = random_set(&m, 1, 9);
    let ms = manifests(&[("policy", &m)]);
    let cfg = TcpConfig {
        expected_receivers: 1,
        token: Some(ClusterToken::random()),
        ..TcpConfig::default()
    };
    let s = TcpSender::bind(cfg, &ms).unwrap();
    let r = TcpReceiver::new(s.receiver_spec());
    let h = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T));
    let mut sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![v1], T)
        .unwrap();
    let mut r = h.join().unwrap().unwrap();
    let v2 = random_set(&m, 2, 10);
    let pending = sender.send_async(vec![v2.to_owned_copy()]).unwrap();
    let mut model = Model::default();
    r.stream(T, &mut |one| model.apply(one)).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    assert!(model.holds(&v2));
    assert_eq!(r.transport().streaming_peak(), 0);
}

#[test]
fn an_apply_slower_than_the_stall_window_past_the_deadline_is_no_stall() {
    let m = model_manifest(4, 1);
    let v1 = random_set(&m, 1, 11);
    let (mut sender, mut r, mut model) = streaming_pair(&m, v1.to_owned_copy(), MIB);
    let v2 = random_set(&m, 2, 12);
    let pending = sender.send_async(vec![v2.to_owned_copy()]).unwrap();
    let mut first = true;
    // a deadline of 200 ms, a stall window of 1 s (the default), an apply of 1.5 s; a call
    // that found nothing announced yet (a loaded machine) is made again
    let until = std::time::Instant::now() + T;
    while r
        .stream(Duration::from_millis(200), &mut |one| {
            if std::mem::take(&mut first) {
                std::thread::sleep(Duration::from_millis(1500));
            }
            model.apply(one)
        })
        .unwrap()
        .is_none()
    {
        assert!(std::time::Instant::now() < until, "v2 never came");
    }
    sender.wait(&pending, T).unwrap();
    assert!(model.holds(&v2));
}

#[test]
fn models_sent_together_are_acknowledged_together_after_a_failure_part_way() {
    let (a, b) = (model_manifest(2, 1), model_manifest(3, 1));
    let ms = manifests(&[("a", &a), ("b", &b)]);
    let s = sender_for(&ms, MIB);
    let r = TcpReceiver::new(s.receiver_spec()).streaming();
    let set = |m: &Arc<Manifest>, name: &str, v: u64, seed: u64| {
        let ws = random_set(m, v, seed);
        WeightSet::from_bytes(id(name), Version(v), Arc::clone(m), ws.bytes()).unwrap()
    };
    let initial = vec![set(&a, "a", 1, 1), set(&b, "b", 1, 2)];
    let h = std::thread::spawn(move || {
        let mut r = ReceiverInit::new(r, None).connect_streaming(T).unwrap();
        let mut n = 0;
        // the second model fails at its first tensor, after the first streamed in whole
        let err = r
            .stream(T, &mut |_| {
                n += 1;
                if n == a.len() + 1 {
                    return Err(Error::Config("no room".into()));
                }
                Ok(())
            })
            .unwrap_err();
        assert!(
            matches!(err, Error::PartlyApplied { applied, .. } if applied == a.len()),
            "{err}"
        );
        // both stream in again and are acknowledged together
        let mut got = r.stream(T, &mut |_| Ok(())).unwrap().unwrap();
        got.sort();
        assert_eq!(got, vec![(id("a"), Version(1)), (id("b"), Version(1))]);
        r
    });
    let _sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(initial, T)
        .unwrap();
    h.join().unwrap();
}
