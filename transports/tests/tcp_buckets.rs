//! The TCP transport moves bytes by the sender's bucket plan: one control message per
//! bucket, tensors larger than a bucket cut rather than refused, and a plan that does not
//! fit the receiver's manifest refused before a byte moves.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use refit_node::ClusterToken;
use refit_runtime::{
    BucketPlan, DType, Error, Manifest, Receiver, ReceiverInit, Sender, SenderInit, Version,
};
use refit_transports::tcp::{TcpConfig, TcpReceiver, TcpReceiverConfig, TcpSender, TransferMode};

const T: Duration = Duration::from_secs(60);
const BUCKET: usize = 1 << 20;

/// Small tensors around one of 5 MiB, which no 1 MiB bucket can hold whole.
fn manifest_with_a_huge_tensor() -> Arc<Manifest> {
    Arc::new(
        Manifest::builder()
            .tensor("embed.weight", DType::F32, &[1000, 3])
            .tensor("huge.weight", DType::F32, &[5 << 18])
            .tensor("huge.bias", DType::F32, &[17])
            .tensor("head.weight", DType::F32, &[300, 300])
            .tensor("steps", DType::I64, &[])
            .build()
            .unwrap(),
    )
}

fn connect(
    m: &Arc<Manifest>,
    n: usize,
    mode: TransferMode,
    relay: bool,
) -> (Sender<TcpSender>, Vec<Receiver<TcpReceiver>>) {
    let ms = manifests(&[("policy", m)]);
    let cfg = TcpConfig {
        expected_receivers: n,
        token: Some(ClusterToken::random()),
        bucket_size: BUCKET,
        relay,
        ..TcpConfig::default()
    };
    let s = TcpSender::bind(cfg, &ms).unwrap();
    let spec = s.receiver_spec();
    let rcfg = TcpReceiverConfig {
        streams: 3,
        mode,
        ..TcpReceiverConfig::default()
    };
    let hs: Vec<_> = (0..n)
        .map(|_| {
            let r = TcpReceiver::new(spec.clone()).with_config(rcfg.clone());
            let expected = Some(ms.clone());
            std::thread::spawn(move || ReceiverInit::new(r, expected).connect(T))
        })
        .collect();
    let sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![random_set(m, 1, 1)], T)
        .unwrap();
    let rs = hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    (sender, rs)
}

#[test]
fn a_tensor_larger_than_a_bucket_is_cut_and_arrives_bit_identical() {
    let m = manifest_with_a_huge_tensor();
    let (mut sender, rs) = connect(&m, 1, TransferMode::Full, true);
    let plan = sender.transport().bucket_plan(&id("policy")).unwrap();
    assert_eq!(
        *plan,
        BucketPlan::compute(&id("policy"), &m, &m, BUCKET).unwrap()
    );
    let huge = m.get("huge.weight").unwrap();
    let cut: Vec<_> = plan
        .buckets
        .iter()
        .flat_map(|b| &b.pieces)
        .filter(|p| p.name == "huge.weight")
        .collect();
    assert!(
        cut.len() >= 5,
        "5 MiB in 1 MiB buckets: {} pieces",
        cut.len()
    );
    assert!(cut.iter().all(|p| p.is_chunk(huge.len)));
    let expected = random_set(&m, 1, 1);
    assert!(rs[0].current(&id("policy")).unwrap().bytes() == expected.bytes());
    // the next version too, and every byte of the arena is the sender's
    let v2 = random_set(&m, 2, 2);
    let rs = send_all(&mut sender, rs, v2.clone(), T);
    let got = rs[0].current(&id("policy")).unwrap();
    assert_eq!(got.version(), Version(2));
    assert!(got.bytes() == v2.bytes(), "bytes differ");
    assert_eq!(sender.transport().bytes_sent(), 2 * m.total_len() as u64);
}

#[test]
fn one_bucket_header_arrives_per_bucket_of_the_plan() {
    let m = manifest_with_a_huge_tensor();
    // full transfers: every version moves every bucket, once, to each receiver (one of them
    // from a relay)
    let (mut sender, rs) = connect(&m, 2, TransferMode::Full, true);
    let n = sender.transport().bucket_plan(&id("policy")).unwrap().len() as u64;
    assert!(n > 6, "{n} buckets");
    for r in &rs {
        assert_eq!(r.transport().bucket_headers(), n);
        assert_eq!(
            r.transport().bucket_plan(&id("policy")),
            sender.transport().bucket_plan(&id("policy"))
        );
    }
    let rs = send_all(&mut sender, rs, random_set(&m, 2, 2), T);
    for r in &rs {
        assert_eq!(r.transport().bucket_headers(), 2 * n);
    }
    drop(rs);
    drop(sender);
    // delta transfers: only the buckets that hold a byte of a changed tensor
    let (mut sender, rs) = connect(&m, 1, TransferMode::Delta, false);
    let plan = sender.transport().bucket_plan(&id("policy")).unwrap();
    assert_eq!(
        rs[0].transport().bucket_headers(),
        n,
        "the first version is full"
    );
    let mut v2 = random_set(&m, 1, 1);
    v2.set_version(Version(2));
    v2.view_mut::<f32>("huge.bias").unwrap()[3] = 7.0;
    v2.view_mut::<i64>("steps").unwrap()[0] = 2;
    let touched = plan.touching(&[2, 4]);
    assert!(!touched.is_empty() && (touched.len() as u64) < n);
    let before = sender.transport().bytes_sent();
    let rs = send_all(&mut sender, rs, v2.clone(), T);
    assert_eq!(rs[0].transport().bucket_headers(), n + touched.len() as u64);
    let moved: usize = touched.iter().map(|&i| plan.buckets[i].len).sum();
    assert_eq!(sender.transport().bytes_sent() - before, moved as u64);
    assert!(rs[0].current(&id("policy")).unwrap().bytes() == v2.bytes());
    // an unchanged version moves no bucket and still lands
    let mut v3 = v2;
    v3.set_version(Version(3));
    let rs = send_all(&mut sender, rs, v3, T);
    assert_eq!(rs[0].version(&id("policy")), Version(3));
    assert_eq!(rs[0].transport().bucket_headers(), n + touched.len() as u64);
}

#[test]
fn a_forged_plan_is_refused_and_the_previous_weights_stay_served() {
    let m = manifest_with_a_huge_tensor();
    let p = id("policy");
    let (mut sender, mut rs) = connect(&m, 1, TransferMode::Full, true);
    let v1 = random_set(&m, 1, 1);
    let real = (*sender.transport().bucket_plan(&p).unwrap()).clone();
    let headers = rs[0].transport().bucket_headers();
    // a forged plan: the second bucket claims a tensor the manifest puts elsewhere
    let mut forged = real.clone();
    forged.buckets[1].pieces[0].name = "head.weight".into();
    sender.transport().replace_bucket_plan(forged).unwrap();
    let pending = sender.send_async(vec![random_set(&m, 2, 2)]).unwrap();
    let err = rs[0].receive(T).unwrap_err();
    match &err {
        Error::Bucket { index: 1, reason } => {
            assert!(reason.contains("`head.weight`"), "{reason}")
        }
        other => panic!("expected the plan refused at bucket 1, got {other}"),
    }
    // nothing moved, nothing applied: version 1 is still served, whole
    assert_eq!(rs[0].transport().bucket_headers(), headers);
    assert_eq!(rs[0].version(&p), Version(1));
    assert!(rs[0].current(&p).unwrap().bytes() == v1.bytes());
    assert_eq!(rs[0].transport().bucket_plan(&p).as_deref(), Some(&real));
    assert!(sender.wait(&pending, Duration::from_millis(100)).is_err());
    // a plan cut from another manifest (same model name) is refused by schema
    let other = Manifest::builder()
        .tensor("huge.weight", DType::F32, &[5 << 18])
        .build()
        .unwrap();
    let alien = BucketPlan::compute(&p, &other, &other, BUCKET).unwrap();
    sender.transport().replace_bucket_plan(alien).unwrap();
    let err = rs[0].receive(T).unwrap_err();
    assert!(matches!(err, Error::Schema { .. }), "{err}");
    // a plan whose buckets are larger than it declares
    let mut oversized = real.clone();
    oversized.bucket_size = 4096;
    sender.transport().replace_bucket_plan(oversized).unwrap();
    let err = rs[0].receive(T).unwrap_err();
    assert!(matches!(err, Error::Bucket { index: 0, .. }), "{err}");
    assert_eq!(rs[0].version(&p), Version(1));
    // the sender's real plan again: the version lands
    sender.transport().replace_bucket_plan(real).unwrap();
    rs[0].receive(T).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    assert!(rs[0].current(&p).unwrap().bytes() == random_set(&m, 2, 2).bytes());
}

#[test]
fn a_forged_plan_at_the_first_pull_fails_the_connect() {
    let m = manifest_with_a_huge_tensor();
    let ms = manifests(&[("policy", &m)]);
    let s = TcpSender::bind(
        TcpConfig {
            token: Some(ClusterToken::random()),
            bucket_size: BUCKET,
            ..TcpConfig::default()
        },
        &ms,
    )
    .unwrap();
    let mut forged = (*s.bucket_plan(&id("policy")).unwrap()).clone();
    forged.buckets.pop();
    s.replace_bucket_plan(forged).unwrap();
    let r = TcpReceiver::new(s.receiver_spec());
    let h = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T));
    let mut sender = refit_runtime::SenderInit::new(s, ms);
    sender = sender.with_ack_timeout(Duration::from_secs(2));
    let _ = sender.connect(vec![random_set(&m, 1, 1)], Duration::from_secs(5));
    let err = h.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::Bucket { .. }), "{err}");
    assert!(err.to_string().contains("buckets end at byte"), "{err}");
}

#[test]
fn a_bucket_size_that_is_not_aligned_is_refused_at_bind() {
    let m = manifest_with_a_huge_tensor();
    let ms = manifests(&[("policy", &m)]);
    for bad in [0, 1000] {
        let err = TcpSender::bind(
            TcpConfig {
                token: Some(ClusterToken::random()),
                bucket_size: bad,
                ..TcpConfig::default()
            },
            &ms,
        )
        .unwrap_err();
        assert!(matches!(err, Error::Bucket { .. }), "{err}");
    }
}

/// Four tensors of 4 MiB: every one four times the 1 MiB bucket.
fn manifest_of_tensors_four_buckets_long() -> Arc<Manifest> {
    let mut b = Manifest::builder();
    for i in 0..4 {
        b.push(format!("layer{i}.weight"), DType::F32, &[BUCKET]);
    }
    Arc::new(b.build().unwrap())
}

#[test]
fn tensors_four_times_a_bucket_arrive_bit_identical_through_a_relay_chain() {
    let m = manifest_of_tensors_four_buckets_long();
    let total = m.total_len() as u64;
    // three receivers: the first pulls from the sender, each next one from a receiver still
    // pulling (relayed bucket by bucket as its buckets land)
    let (mut sender, rs) = connect(&m, 3, TransferMode::Full, true);
    let plan = sender.transport().bucket_plan(&id("policy")).unwrap();
    assert_eq!(plan.len(), 16);
    for t in m.tensors() {
        let pieces: Vec<_> = plan
            .buckets
            .iter()
            .flat_map(|b| &b.pieces)
            .filter(|p| p.name == t.name)
            .collect();
        assert_eq!(pieces.len(), 4, "{} in 1 MiB buckets", t.name);
        assert!(pieces.iter().all(|p| p.is_chunk(t.len)));
    }
    let v1 = random_set(&m, 1, 1);
    for r in &rs {
        assert!(r.current(&id("policy")).unwrap().bytes() == v1.bytes());
    }
    let v2 = random_set(&m, 2, 2);
    let rs = send_all(&mut sender, rs, v2.clone(), T);
    for r in &rs {
        let got = r.current(&id("policy")).unwrap();
        assert_eq!(got.version(), Version(2));
        assert!(got.bytes() == v2.bytes(), "bytes differ");
    }
    // each byte left the sender once per version; the receivers relayed the rest
    assert_eq!(sender.transport().bytes_sent(), 2 * total);
    let relayed: u64 = rs.iter().map(|r| r.transport().bytes_relayed()).sum();
    assert_eq!(relayed, 2 * 2 * total);
}

#[test]
fn a_corrupt_bucket_at_the_head_of_a_relay_chain_is_refused_and_pulled_again_by_all() {
    let m = manifest_of_tensors_four_buckets_long();
    let p = id("policy");
    let (mut sender, rs) = connect(&m, 2, TransferMode::Full, true);
    let v2 = random_set(&m, 2, 2);
    // the first chunk the sender serves is damaged: the head of the chain refuses its
    // bucket, the receiver relayed from it sees its source fail and asks for another
    sender.transport().inject_corruption(1);
    let pending = sender.send_async(vec![v2.clone()]).unwrap();
    let hs: Vec<_> = rs
        .into_iter()
        .map(|mut r| {
            std::thread::spawn(move || {
                let mut errors = Vec::new();
                for _ in 0..5 {
                    match r.receive(T) {
                        Ok(Some(_)) => break,
                        Ok(None) => panic!("no version within {T:?}"),
                        Err(e) => {
                            // refused: version 1 stays served, whole
                            assert_eq!(r.version(&id("policy")), Version(1));
                            errors.push(e.to_string());
                        }
                    }
                }
                (r, errors)
            })
        })
        .collect();
    sender.wait(&pending, T).unwrap();
    let mut errors = Vec::new();
    for h in hs {
        let (r, e) = h.join().unwrap();
        let got = r.current(&p).unwrap();
        assert_eq!(got.version(), Version(2));
        assert!(got.bytes() == v2.bytes(), "bytes differ");
        errors.extend(e);
    }
    assert!(
        errors.iter().any(|e| e.contains("checksum")),
        "the damaged bucket was not refused: {errors:?}"
    );
}
