//! A trainer split over four ranks (threads) writes its shards into a `ShardedBuffer`; each
//! assembled version is published through a real transport (shared memory, TCP) and the
//! receiver's bytes are checked element by element. A version a rank did not finish is
//! never published.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::{id, shm_pair, tcp_pair};
use refit_runtime::sharded::ShardWriter;
use refit_runtime::{
    DType, Error, Manifest, Manifests, ReceiverInit, ReceiverTransport, SenderInit,
    SenderTransport, ShardedBuffer, Version,
};
use refit_transports::shm::ShmReadMode;

const T: Duration = Duration::from_secs(30);
const WORLD: usize = 4;

/// A small f32 model; tensor sizes are not multiples of a shard, so shards cut tensors.
fn manifest() -> Arc<Manifest> {
    refit_runtime::testing::manifest(&[
        ("embed.weight", DType::F32, &[300, 64]),
        ("layers.0.weight", DType::F32, &[64, 64]),
        ("layers.0.bias", DType::F32, &[64]),
        ("head.weight", DType::F32, &[2, 64]),
    ])
}

/// The value of the f32 at arena byte offset `at` in `version` (what the whole model holds).
fn value(version: u64, at: usize) -> f32 {
    version as f32 * 1000.0 + (at / 4) as f32
}

/// One rank: for each version, writes its shard (as the f32s its part of the flat parameters
/// holds), arrives at the barrier, and waits until the version is closed.
fn rank(w: ShardWriter, versions: std::ops::RangeInclusive<u64>, closed: Arc<Barrier>) {
    for v in versions {
        let r = w.range();
        let bytes: Vec<u8> = (r.start..r.end)
            .step_by(4)
            .flat_map(|at| value(v, at).to_le_bytes())
            .collect();
        w.write_shard(&bytes).unwrap();
        w.finish();
        closed.wait();
    }
}

/// Every tensor of `ws` holds what the ranks wrote for its version.
fn check(ws: &refit_runtime::WeightSet) {
    let v = ws.version().get();
    for t in ws.manifest().tensors() {
        let got = ws.view::<f32>(&t.name).unwrap();
        for (i, x) in got.iter().enumerate() {
            assert_eq!(*x, value(v, t.offset + 4 * i), "{} [{i}] of v{v}", t.name);
        }
    }
}

fn ranks_publish<S, R>(make: impl FnOnce(&Manifests) -> (S, R))
where
    S: SenderTransport + 'static,
    R: ReceiverTransport + 'static,
{
    let m = manifest();
    let ms = Manifests::new([(id("policy"), Arc::clone(&m))]).unwrap();
    let buffer = ShardedBuffer::new(id("policy"), Arc::clone(&m), WORLD).unwrap();
    let closed = Arc::new(Barrier::new(WORLD + 1));
    let ranks: Vec<_> = (0..WORLD)
        .map(|r| {
            let w = buffer.writer(r).unwrap();
            let closed = Arc::clone(&closed);
            std::thread::spawn(move || rank(w, 1..=4, closed))
        })
        .collect();
    // version 1 is the rendezvous' initial weights
    buffer.wait_all(T).unwrap();
    let first = buffer.close_version(Version(1)).unwrap();
    closed.wait();
    let (s, r) = make(&ms);
    let expected = ms.clone();
    let joiner = std::thread::spawn(move || ReceiverInit::new(r, Some(expected)).connect(T));
    let mut tx = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![(*first).clone()], T)
        .unwrap();
    let mut rx = joiner.join().unwrap().unwrap();
    check(&rx.current(&id("policy")).unwrap());
    for v in 2..=4 {
        buffer.wait_all(T).unwrap();
        let pending = buffer.publish(Version(v), &mut tx).unwrap();
        // the ranks write the next version while this one travels
        closed.wait();
        let u = rx
            .receive(T)
            .unwrap()
            .expect("the assembled version arrives");
        assert_eq!(u.entries(), vec![(id("policy"), Version(v))]);
        tx.wait(&pending, T).unwrap();
        check(&rx.current(&id("policy")).unwrap());
    }
    for h in ranks {
        h.join().unwrap();
    }
    // rank 3 never finishes version 5: nothing is closed or published, naming the rank
    for r in 0..3 {
        let w = buffer.writer(r).unwrap();
        w.write_shard(&vec![0; w.range().len()]).unwrap();
        w.finish();
    }
    let e = buffer.publish(Version(5), &mut tx).unwrap_err();
    assert!(matches!(e, Error::Shard { rank: 3, .. }), "{e}");
    assert_eq!(buffer.serve().unwrap().version(), Version(4));
    assert!(rx.receive(Duration::from_millis(200)).unwrap().is_none());
    assert_eq!(rx.version(&id("policy")), Version(4));
    rx.shutdown().unwrap();
    tx.shutdown().unwrap();
}

#[test]
fn sharded_ranks_publish_over_shm() {
    ranks_publish(|ms| shm_pair(ms, ShmReadMode::ZeroCopy));
}

#[test]
fn sharded_ranks_publish_over_tcp() {
    ranks_publish(tcp_pair);
}

/// A buffer over another manifest than the scheme's is refused before it closes anything.
#[test]
fn a_buffer_that_does_not_fit_the_scheme_closes_nothing() {
    let m = manifest();
    let ms = Manifests::new([(id("policy"), Arc::clone(&m))]).unwrap();
    let hub = refit_transports::inproc::InProc::new();
    let r = hub.receiver();
    let expected = ms.clone();
    let joiner = std::thread::spawn(move || ReceiverInit::new(r, Some(expected)).connect(T));
    let mut initial = refit_runtime::WeightSet::zeroed(id("policy"), Arc::clone(&m));
    initial.set_version(Version(1));
    let mut tx = SenderInit::new(hub.sender().unwrap(), ms)
        .connect(vec![initial], T)
        .unwrap();
    let _rx = joiner.join().unwrap().unwrap();
    let other = Arc::new(
        Manifest::builder()
            .tensor("embed.weight", DType::F32, &[300, 65])
            .build()
            .unwrap(),
    );
    let buffer = ShardedBuffer::new(id("policy"), other, 1).unwrap();
    buffer.writer(0).unwrap().finish();
    let e = buffer.publish(Version(2), &mut tx).unwrap_err();
    assert!(e.to_string().contains("embed.weight"), "{e}");
    assert!(buffer.serve().is_none());
    assert_eq!(tx.version(&id("policy")), Version(1));
}
