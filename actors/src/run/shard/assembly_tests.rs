#![allow(clippy::unwrap_used)]

use super::*;
use refit_runtime::DType;

fn id() -> ModelId {
    ModelId::new("policy").unwrap()
}

fn manifest() -> Arc<Manifest> {
    refit_runtime::testing::manifest(&[
        ("w1", DType::F32, &[4, 64]),
        ("b1", DType::F32, &[64]),
        ("w2", DType::F32, &[64, 2]),
    ])
}

/// What shard `shard` exports at `version`: every byte depends on both, so a part of the
/// assembled version shows which shard wrote it.
fn export(shard: usize, version: u64) -> WeightSet {
    let mut ws = WeightSet::zeroed(id(), manifest());
    ws.set_version(Version(version));
    for (i, b) in ws.bytes_mut().unwrap().iter_mut().enumerate() {
        *b = (i as u64)
            .wrapping_mul(31)
            .wrapping_add(version * 7 + shard as u64 * 101) as u8;
    }
    ws
}

/// Shard `shard`'s part of `ws`, in chunks of `chunk` bytes.
fn write_part(a: &mut Assembly, shard: usize, ws: &WeightSet, chunk: usize) -> Result<()> {
    let r = a.range(shard);
    let bytes = &ws.bytes()[r.clone()];
    let mut offset = r.start;
    for c in bytes.chunks(chunk) {
        a.write(Chunk {
            version: ws.version(),
            shard,
            schema: ws.manifest().schema_hash(),
            offset,
            bytes: c,
        })?;
        offset += c.len();
    }
    Ok(())
}

fn shard_err(e: &Error) -> (Version, usize, u32, String) {
    match e {
        Error::Shard {
            model,
            version,
            shard,
            rank,
            reason,
        } => {
            assert_eq!(model, &id());
            (*version, *shard, *rank, reason.clone())
        }
        other => panic!("not a shard error: {other}"),
    }
}

#[test]
fn a_version_closes_only_once_every_shard_wrote_its_whole_part() {
    let mut a = Assembly::new(id(), manifest(), vec![4, 5, 6], Version(1)).unwrap();
    assert_eq!(a.world(), 3);
    let total = manifest().total_len();
    assert_eq!(a.range(0).start, 0);
    assert_eq!(a.range(2).end, total);
    assert_eq!(a.range(0).end, a.range(1).start);
    a.open(Version(2)).unwrap();
    let parts: Vec<WeightSet> = (0..3).map(|s| export(s, 2)).collect();
    a.write_export(0, &parts[0]).unwrap();
    write_part(&mut a, 2, &parts[2], 100).unwrap();
    // shard 1 wrote nothing: the version does not close, and the error names it
    assert!(!a.complete());
    let (v, s, r, why) = shard_err(&a.close().unwrap_err());
    assert_eq!((v, s, r), (Version(2), 1, 5));
    assert!(why.contains("wrote nothing"), "{why}");
    assert!(a.served().is_none());
    // half of it: still not
    let r1 = a.range(1);
    let half = r1.len() / 2;
    a.write(Chunk {
        version: Version(2),
        shard: 1,
        schema: manifest().schema_hash(),
        offset: r1.start,
        bytes: &parts[1].bytes()[r1.start..r1.start + half],
    })
    .unwrap();
    let (_, s, _, why) = shard_err(&a.close().unwrap_err());
    assert_eq!(s, 1);
    assert!(
        why.contains(&format!("wrote {half} of the {}", r1.len())),
        "{why}"
    );
    a.write(Chunk {
        version: Version(2),
        shard: 1,
        schema: manifest().schema_hash(),
        offset: r1.start + half,
        bytes: &parts[1].bytes()[r1.start + half..r1.end],
    })
    .unwrap();
    assert!(a.complete());
    let closed = a.close().unwrap();
    assert_eq!(closed.version(), Version(2));
    // each shard's bytes, from its own export
    for (s, part) in parts.iter().enumerate() {
        let r = a.range(s);
        assert_eq!(&closed.bytes()[r.clone()], &part.bytes()[r], "shard {s}");
    }
    assert_eq!(a.served().unwrap().version(), Version(2));
    assert_eq!(a.open_version(), None);
}

#[test]
fn a_shard_of_another_version_is_refused_whole_naming_it() {
    let mut a = Assembly::new(id(), manifest(), vec![1, 2], Version(1)).unwrap();
    a.open(Version(2)).unwrap();
    a.write_export(0, &export(0, 2)).unwrap();
    // shard 1 starts right, then sends a chunk of v3: its whole part is refused
    let good = export(1, 2);
    let r1 = a.range(1);
    a.write(Chunk {
        version: Version(2),
        shard: 1,
        schema: manifest().schema_hash(),
        offset: r1.start,
        bytes: &good.bytes()[r1.start..r1.start + 64],
    })
    .unwrap();
    let ahead = export(1, 3);
    let e = write_part(&mut a, 1, &ahead, 1 << 20).unwrap_err();
    let (v, s, r, why) = shard_err(&e);
    assert_eq!((v, s, r), (Version(2), 1, 2));
    assert!(why.contains("exported version 3"), "{why}");
    // the right bytes afterwards do not make up for it
    let e = a
        .write(Chunk {
            version: Version(2),
            shard: 1,
            schema: manifest().schema_hash(),
            offset: r1.start + 64,
            bytes: &good.bytes()[r1.start + 64..r1.end],
        })
        .unwrap_err();
    assert!(shard_err(&e).3.contains("exported version 3"));
    let (_, s, _, why) = shard_err(&a.close().unwrap_err());
    assert_eq!(s, 1);
    assert!(why.contains("exported version 3"), "{why}");
    assert!(a.served().is_none());
}

#[test]
fn a_shard_of_another_size_or_layout_is_refused_whole_naming_it() {
    let mut a = Assembly::new(id(), manifest(), vec![3, 4], Version(1)).unwrap();
    a.open(Version(2)).unwrap();
    // shard 0's export of a smaller model: refused
    let small = Arc::new(
        Manifest::builder()
            .tensor("w1", DType::F32, &[4, 8])
            .build()
            .unwrap(),
    );
    let mut other = WeightSet::zeroed(id(), small);
    other.set_version(Version(2));
    let (v, s, r, why) = shard_err(&a.write_export(0, &other).unwrap_err());
    assert_eq!((v, s, r), (Version(2), 0, 3));
    assert!(why.contains("bytes, the model's arena holds"), "{why}");
    // shard 1: a chunk past the end of its part
    let ws = export(1, 2);
    let r1 = a.range(1);
    let mut long = ws.bytes()[r1.clone()].to_vec();
    long.extend_from_slice(&[0; 8]);
    let e = a
        .write(Chunk {
            version: Version(2),
            shard: 1,
            schema: manifest().schema_hash(),
            offset: r1.start,
            bytes: &long,
        })
        .unwrap_err();
    let (_, s, r, why) = shard_err(&e);
    assert_eq!((s, r), (1, 4));
    assert!(why.contains("past the end of its part"), "{why}");
    let (_, s, _, _) = shard_err(&a.close().unwrap_err());
    assert_eq!(s, 0, "the first shard refused is named");

    // the next version: another layout's schema hash, and a chunk out of order
    a.open(Version(3)).unwrap();
    let e = a
        .write(Chunk {
            version: Version(3),
            shard: 0,
            schema: 0xdead_beef,
            offset: 0,
            bytes: &[0; 64],
        })
        .unwrap_err();
    assert!(shard_err(&e).3.contains("another layout"), "{e}");
    let ws = export(1, 3);
    let e = a
        .write(Chunk {
            version: Version(3),
            shard: 1,
            schema: manifest().schema_hash(),
            offset: r1.start + 64,
            bytes: &ws.bytes()[r1.start + 64..r1.end],
        })
        .unwrap_err();
    assert!(shard_err(&e).3.contains("goes on at"), "{e}");
    // a shard that does not exist
    let e = a
        .write(Chunk {
            version: Version(3),
            shard: 2,
            schema: manifest().schema_hash(),
            offset: 0,
            bytes: &[],
        })
        .unwrap_err();
    assert!(shard_err(&e).3.contains("does not exist"), "{e}");
}

#[test]
fn a_failed_version_leaves_the_last_one_served_and_the_next_starts_over() {
    let mut a = Assembly::new(id(), manifest(), vec![1, 2], Version(1)).unwrap();
    a.open(Version(2)).unwrap();
    for s in 0..2 {
        write_part(&mut a, s, &export(s, 2), 1000).unwrap();
    }
    a.close().unwrap();
    // v3: shard 1 wrote, shard 0 is then found gone; its reason is kept
    a.open(Version(3)).unwrap();
    write_part(&mut a, 1, &export(1, 3), 1000).unwrap();
    a.fail(0, "is gone: its process died");
    let (v, s, _, why) = shard_err(&a.close().unwrap_err());
    assert_eq!((v, s), (Version(3), 0));
    assert!(why.contains("is gone"), "{why}");
    assert_eq!(a.served().unwrap().version(), Version(2));
    // a version not newer than the served one is refused; the next one starts over
    assert!(a.open(Version(2)).is_err());
    a.open(Version(4)).unwrap();
    assert!(!a.complete(), "parts of the failed version do not count");
    for s in 0..2 {
        write_part(&mut a, s, &export(s, 4), 1000).unwrap();
    }
    let v4 = a.close().unwrap();
    assert_eq!(v4.version(), Version(4));
    assert_eq!(&v4.bytes()[a.range(1)], &export(1, 4).bytes()[a.range(1)]);
}

#[test]
fn a_shard_with_an_empty_part_still_reports_its_version() {
    // 64 bytes for 2 shards: shard 0 holds all of it (parts are cut on 64-byte lines)
    let tiny = Arc::new(
        Manifest::builder()
            .tensor("b", DType::F32, &[16])
            .build()
            .unwrap(),
    );
    let mut a = Assembly::new(id(), Arc::clone(&tiny), vec![1, 2], Version(1)).unwrap();
    assert!(a.range(1).is_empty());
    a.open(Version(2)).unwrap();
    let mut ws = WeightSet::zeroed(id(), Arc::clone(&tiny));
    ws.set_version(Version(2));
    a.write_export(0, &ws).unwrap();
    let (_, s, _, why) = shard_err(&a.close().unwrap_err());
    assert_eq!(s, 1);
    assert!(why.contains("wrote nothing"), "{why}");
    let e = a
        .write(Chunk {
            version: Version(5),
            shard: 1,
            schema: tiny.schema_hash(),
            offset: 64,
            bytes: &[],
        })
        .unwrap_err();
    assert!(shard_err(&e).3.contains("exported version 5"));
    a.open(Version(3)).unwrap();
    ws.set_version(Version(3));
    a.write_export(0, &ws).unwrap();
    a.write(Chunk {
        version: Version(3),
        shard: 1,
        schema: tiny.schema_hash(),
        offset: 64,
        bytes: &[],
    })
    .unwrap();
    assert_eq!(a.close().unwrap().version(), Version(3));
}

/// Under a mesh the shards publish their own parts: the assembly only keeps count, closes
/// a version once every shard published it, and names a shard that published another
/// version or none (the last version closed stays the one served).
#[test]
fn a_mesh_version_closes_once_every_shard_published_it() {
    let mut a = Assembly::new(id(), manifest(), vec![3, 4, 5], Version(1)).unwrap();
    a.open(Version(2)).unwrap();
    a.published(0, Version(2));
    a.published(2, Version(2));
    let e = a.close_published().unwrap_err();
    let (v, shard, rank, why) = shard_err(&e);
    assert_eq!((v, shard, rank), (Version(2), 1, 4));
    assert!(why.contains("wrote nothing"), "{why}");
    assert_eq!(a.closed(), Version(1));
    a.published(1, Version(2));
    assert_eq!(a.close_published().unwrap(), Version(2));
    assert_eq!(a.closed(), Version(2));
    // a shard that published another version fails the next one, named
    a.open(Version(3)).unwrap();
    for s in [0, 1] {
        a.published(s, Version(3));
    }
    a.published(2, Version(4));
    let (v, shard, _, why) = shard_err(&a.close_published().unwrap_err());
    assert_eq!((v, shard), (Version(3), 2));
    assert!(why.contains("published version 4"), "{why}");
    assert_eq!(a.closed(), Version(2));
}
