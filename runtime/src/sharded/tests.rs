use super::*;
use crate::DType;

fn manifest() -> Arc<Manifest> {
    crate::testing::manifest(&[
        ("embed", DType::F32, &[100, 7]),
        ("w", DType::BF16, &[33, 9]),
        ("b", DType::F32, &[5]),
    ])
}

fn id() -> ModelId {
    ModelId::new("policy").unwrap()
}

/// What the trainer holds at `version`: every byte of every tensor depends on both.
fn source(version: u64) -> WeightSet {
    let m = manifest();
    let mut ws = WeightSet::zeroed(id(), Arc::clone(&m));
    for t in m.tensors() {
        for (i, b) in ws.tensor_bytes_mut(&t.name).unwrap().iter_mut().enumerate() {
            *b = ((i as u64).wrapping_mul(2_654_435_761) >> 7) as u8 ^ version as u8;
        }
    }
    ws
}

/// Every rank writes its shard from its own thread, then arrives at the barrier.
fn write_all(buf: &ShardedBuffer, src: &WeightSet) {
    std::thread::scope(|s| {
        for rank in 0..buf.world() {
            let w = buf.writer(rank).unwrap();
            s.spawn(move || {
                let r = w.range();
                // Two writes per rank, to show partial writes land at their offsets.
                let mid = r.start + r.len() / 2;
                w.write(mid, &src.bytes()[mid..r.end]).unwrap();
                w.write(r.start, &src.bytes()[r.start..mid]).unwrap();
                w.finish();
            });
        }
    });
}

#[test]
fn four_sharded_writers_produce_the_bytes_of_one() {
    let src = source(1);
    let four = ShardedBuffer::new(id(), manifest(), 4).unwrap();
    let total = manifest().total_len();
    let ranges: Vec<_> = (0..4).map(|r| four.writer(r).unwrap().range()).collect();
    assert_eq!(ranges[0], 0..total.div_ceil(4).div_ceil(64) * 64);
    assert_eq!(ranges[3].end, total);
    write_all(&four, &src);
    four.wait_all(Duration::from_secs(5)).unwrap();
    let a = four.close_version(Version(1)).unwrap();
    let one = ShardedBuffer::new(id(), manifest(), 1).unwrap();
    one.writer(0).unwrap().write_shard(src.bytes()).unwrap();
    one.writer(0).unwrap().finish();
    let b = one.close_version(Version(1)).unwrap();
    assert_eq!(a.bytes(), b.bytes());
    assert_eq!(a.bytes(), src.bytes());
    assert_eq!(four.serve().unwrap().version(), Version(1));
}

#[test]
fn version_n_is_served_unchanged_while_n_plus_1_is_written() {
    let buf = ShardedBuffer::new(id(), manifest(), 4).unwrap();
    assert!(buf.serve().is_none());
    write_all(&buf, &source(1));
    buf.close_version(Version(1)).unwrap();
    let held = buf.serve().unwrap(); // a reader holds version 1
    write_all(&buf, &source(2));
    assert_eq!(buf.serve().unwrap().bytes(), source(1).bytes());
    let v2 = buf.close_version(Version(2)).unwrap();
    assert_eq!(held.version(), Version(1));
    assert_eq!(held.bytes(), source(1).bytes());
    assert_eq!(v2.bytes(), source(2).bytes());
    drop(held);
    // Version 1's arena (no reader left) is recycled for version 3; every byte is rewritten.
    write_all(&buf, &source(3));
    buf.close_version(Version(3)).unwrap();
    assert_eq!(buf.serve().unwrap().bytes(), source(3).bytes());
    assert_eq!(v2.bytes(), source(2).bytes());
}

#[test]
fn the_barrier_and_the_shards_are_enforced() {
    let buf = ShardedBuffer::new(id(), manifest(), 4).unwrap();
    let w1 = buf.writer(1).unwrap();
    let r1 = w1.range();
    let e = w1.write(r1.end - 1, &[0, 0]).unwrap_err().to_string();
    assert!(e.starts_with("shard of rank 1: write of 2 bytes at"), "{e}");
    assert!(w1.write(0, &[1]).is_err());
    assert!(
        w1.write_shard(&[1, 2])
            .unwrap_err()
            .to_string()
            .contains("given")
    );
    w1.finish();
    assert!(
        w1.write(r1.start, &[1])
            .unwrap_err()
            .to_string()
            .contains("already finished")
    );
    let e = buf.close_version(Version(1)).unwrap_err().to_string();
    assert_eq!(
        e,
        "shard of rank 0: has not finished its shard of version 1 (missing ranks [0, 2, 3])"
    );
    let e = buf
        .wait_all(Duration::from_millis(10))
        .unwrap_err()
        .to_string();
    assert!(e.contains("ranks [0, 2, 3]"), "{e}");
    assert!(
        buf.writer(4)
            .unwrap_err()
            .to_string()
            .starts_with("shard of rank 4: no such rank")
    );
    for r in [0, 2, 3] {
        buf.writer(r).unwrap().finish();
    }
    buf.close_version(Version(2)).unwrap();
    for r in 0..4 {
        buf.writer(r).unwrap().finish();
    }
    assert!(matches!(
        buf.close_version(Version(2)),
        Err(Error::StaleVersion { .. })
    ));
    assert!(ShardedBuffer::new(id(), manifest(), 0).is_err());
}
