use super::*;
use crate::DType;

fn manifest() -> Arc<Manifest> {
    crate::testing::manifest(&[
        ("a", DType::U8, &[100]),    // 0..100
        ("b", DType::U8, &[10]),     // 128..138
        ("big", DType::U8, &[1000]), // 192..1192
        ("c", DType::U8, &[20]),     // 1216..1236, arena 1280
    ])
}

fn id() -> ModelId {
    ModelId::new("policy").unwrap()
}

fn filled(m: &Arc<Manifest>, version: u64) -> WeightSet {
    let mut ws = WeightSet::zeroed(id(), Arc::clone(m));
    for t in m.tensors() {
        for (i, b) in ws.tensor_bytes_mut(&t.name).unwrap().iter_mut().enumerate() {
            *b = (i as u64 * 13 + version * 7 + t.offset as u64) as u8;
        }
    }
    ws.set_version(Version(version));
    ws
}

#[test]
fn small_tensors_share_and_large_ones_are_chunked() {
    let m = manifest();
    let plan = BucketPlan::compute(&id(), &m, &m, 256).unwrap();
    let ranges: Vec<_> = plan.buckets.iter().map(BucketSpec::range).collect();
    assert_eq!(
        ranges,
        [0..192, 192..448, 448..704, 704..960, 960..1216, 1216..1280]
    );
    let p = |name: &str, tensor, offset, len| Piece {
        tensor,
        name: name.into(),
        offset,
        len,
    };
    assert_eq!(
        plan.buckets[0].pieces,
        [p("a", 0, 0, 100), p("b", 1, 0, 10)]
    );
    assert_eq!(plan.buckets[1].pieces, [p("big", 2, 0, 256)]);
    assert_eq!(plan.buckets[4].pieces, [p("big", 2, 768, 232)]);
    assert_eq!(plan.buckets[5].pieces, [p("c", 3, 0, 20)]);
    assert!(plan.buckets[4].pieces[0].is_chunk(1000));
    assert!(!plan.buckets[5].pieces[0].is_chunk(20));
    let one = BucketPlan::compute(&id(), &m, &m, 4096).unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(one.buckets[0].pieces.len(), 4);
    for bad in [0, 100] {
        let e = BucketPlan::compute(&id(), &m, &m, bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "bucket size {bad} is not a positive multiple of 64"
            )),
            "{e}"
        );
    }
    let other = Manifest::builder()
        .tensor("a", DType::U8, &[101])
        .build()
        .unwrap();
    let e = BucketPlan::compute(&id(), &m, &other, 256)
        .unwrap_err()
        .to_string();
    assert!(e.contains("tensor `a`"), "{e}");
}

#[test]
fn buckets_in_any_order_assemble_bit_identical_every_version() {
    let m = manifest();
    let plan = BucketPlan::compute(&id(), &m, &m, 256).unwrap();
    // The plan travels as msgpack and is verified on the other end.
    let shipped: BucketPlan =
        rmp_serde::from_slice(&rmp_serde::to_vec_named(&plan).unwrap()).unwrap();
    let mut asm = BucketAssembler::new(shipped, Arc::clone(&m)).unwrap();
    for version in [1, 2] {
        let ws = filled(&m, version);
        let mut buckets = plan.buckets(&ws).unwrap();
        buckets.reverse();
        buckets.swap(1, 3);
        for (n, (h, bytes)) in buckets.iter().enumerate() {
            assert!(!asm.is_complete());
            assert!(asm.take().is_err(), "a partial set must not come out");
            asm.accept(h, bytes).unwrap();
            assert_eq!(asm.progress(), (n + 1, 6));
        }
        let out = asm.take().unwrap();
        assert_eq!(out.version(), Version(version));
        assert_eq!(out.bytes(), ws.bytes());
        assert_eq!(asm.progress(), (0, 6));
    }
}

#[test]
fn corrupt_duplicate_foreign_and_out_of_range_buckets_are_refused() {
    let m = manifest();
    let plan = BucketPlan::compute(&id(), &m, &m, 256).unwrap();
    let mut asm = BucketAssembler::new(plan.clone(), Arc::clone(&m)).unwrap();
    let ws = filled(&m, 3);
    let buckets = plan.buckets(&ws).unwrap();
    let (h0, b0) = &buckets[0];
    let mut bad = b0.to_vec();
    bad[5] ^= 1;
    let e = asm.accept(h0, &bad).unwrap_err().to_string();
    assert!(
        e.starts_with("bucket 0: checksum") && e.ends_with("(tensors a, b)"),
        "{e}"
    );
    assert_eq!(asm.progress(), (0, 6));
    asm.accept(h0, b0).unwrap();
    let e = asm.accept(h0, b0).unwrap_err().to_string();
    assert_eq!(e, "bucket 0: received twice for version 3");
    let mut far = h0.clone();
    far.index = 6;
    assert_eq!(
        asm.accept(&far, b0).unwrap_err().to_string(),
        "bucket 6: out of range, the plan has 6 buckets"
    );
    let newer = filled(&m, 4);
    let (h1, b1) = plan.bucket(&newer, 1).unwrap();
    assert_eq!(
        asm.accept(&h1, b1).unwrap_err().to_string(),
        "bucket 1: belongs to version 4, version 3 is being assembled"
    );
    let (mut h2, b2) = plan.bucket(&ws, 2).unwrap();
    h2.start += 64;
    assert!(
        asm.accept(&h2, b2)
            .unwrap_err()
            .to_string()
            .contains("the plan says 448..+256")
    );
    assert!(asm.accept(&buckets[3].0, &buckets[3].1[1..]).is_err());
    let e = asm.take().unwrap_err().to_string();
    assert_eq!(
        e,
        "bucket 1: not received; 1 of 6 buckets arrived for version 3"
    );
    for (h, b) in &buckets[1..] {
        asm.accept(h, b).unwrap();
    }
    assert_eq!(asm.take().unwrap().bytes(), ws.bytes());
}

#[test]
fn receiver_refuses_a_plan_that_disagrees_with_its_manifest() {
    let m = manifest();
    let plan = BucketPlan::compute(&id(), &m, &m, 256).unwrap();
    let mut tampered = plan.clone();
    tampered.buckets[4].pieces[0].len = 200;
    let e = tampered.verify(&m).unwrap_err().to_string();
    assert!(
        e.starts_with("bucket 4: piece of tensor `big` (bytes 768..+200) disagrees"),
        "{e}"
    );
    let mut gap = plan.clone();
    gap.buckets.remove(2);
    assert!(
        gap.verify(&m)
            .unwrap_err()
            .to_string()
            .starts_with("bucket 2: covers bytes 704..960")
    );
    let mut oversized = plan.clone();
    oversized.bucket_size = 128;
    assert!(
        oversized
            .verify(&m)
            .unwrap_err()
            .to_string()
            .starts_with("bucket 0:")
    );
    let other = Manifest::builder()
        .tensor("z", DType::U8, &[1])
        .build()
        .unwrap();
    assert!(matches!(plan.verify(&other), Err(Error::Schema { .. })));
    assert!(BucketAssembler::new(tampered, m).is_err());
}

#[test]
fn empty_arena_has_no_buckets_and_assembles_at_once() {
    let m = Arc::new(Manifest::builder().build().unwrap());
    let plan = BucketPlan::compute(&id(), &m, &m, 64).unwrap();
    assert!(plan.is_empty());
    let mut asm = BucketAssembler::new(plan, m).unwrap();
    assert!(asm.is_complete());
    assert_eq!(asm.take().unwrap().bytes().len(), 0);
}

#[test]
fn delta_buckets_are_those_touching_changed_tensors() {
    let m = manifest();
    let plan = BucketPlan::compute(&id(), &m, &m, 256).unwrap();
    assert_eq!(plan.touching(&[1]), [0]);
    assert_eq!(plan.touching(&[2]), [1, 2, 3, 4]);
    assert_eq!(plan.touching(&[3, 0]), [0, 5]);
    assert!(plan.touching(&[]).is_empty());
    assert!(plan.touching(&[99]).is_empty());
}

#[test]
fn headers_are_checked_against_the_plan_and_fingerprints_tell_plans_apart() {
    let m = manifest();
    let plan = BucketPlan::compute(&id(), &m, &m, 256).unwrap();
    let ws = filled(&m, 1);
    let (header, bytes) = plan.bucket(&ws, 2).unwrap();
    assert_eq!(plan.check_header(&header).unwrap().range(), 448..704);
    plan.check_checksum(&m, &header, bytes).unwrap();
    let mut bad = bytes.to_vec();
    bad[3] ^= 1;
    let e = plan
        .check_checksum(&m, &header, &bad)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("bucket 2: checksum") && e.contains("big"),
        "{e}"
    );
    // the checksum is the one every transport uses: derived from the pieces' checksums
    let spec = &plan.buckets[2];
    assert_eq!(
        header.checksum,
        spec.checksum_from_pieces(&m, bytes, &spec.piece_checksums(&m, bytes))
    );
    let mut padded = bytes.to_vec();
    let last_piece = spec.piece_range(&m, spec.pieces.last().unwrap()).unwrap();
    if last_piece.end < padded.len() {
        padded[last_piece.end] ^= 1; // alignment padding is covered too
        assert!(plan.check_checksum(&m, &header, &padded).is_err());
    }
    let mut moved = header.clone();
    moved.start += 64;
    assert!(plan.check_header(&moved).is_err());
    let mut out = header;
    out.index = 6;
    assert!(
        plan.check_header(&out)
            .unwrap_err()
            .to_string()
            .contains("out of range")
    );
    let other = BucketPlan::compute(&id(), &m, &m, 512).unwrap();
    assert_eq!(
        plan.fingerprint().unwrap(),
        plan.clone().fingerprint().unwrap()
    );
    assert_ne!(plan.fingerprint().unwrap(), other.fingerprint().unwrap());
}
