use super::*;
use crate::{DType, Manifest};

fn manifest() -> Arc<Manifest> {
    crate::testing::manifest(&[
        ("embed", DType::F32, &[64, 16]), // 4096 bytes
        ("w", DType::F32, &[32, 32]),     // 4096 bytes
        ("b", DType::F32, &[32]),
    ])
}

fn version(v: u64) -> WeightSet {
    let mut ws = WeightSet::zeroed(ModelId::new("policy").unwrap(), manifest());
    for name in ["embed", "w", "b"] {
        for (i, x) in ws.view_mut::<f32>(name).unwrap().iter_mut().enumerate() {
            *x = i as f32 * 0.5;
        }
    }
    ws.set_version(Version(v));
    ws
}

#[test]
fn delta_carries_only_changed_blocks_and_applies_bit_identically() {
    let base = version(3);
    let mut new = version(5);
    new.view_mut::<f32>("w").unwrap()[10] = -1.0; // bytes 40..44 of w: block 0 of 1024
    new.view_mut::<f32>("w").unwrap()[700] = 2.0; // byte 2800: block 2
    new.view_mut::<f32>("b").unwrap()[31] = 9.0;
    let d = Delta::encode(&base, &new, Granularity::Block(1024)).unwrap();
    let at: Vec<(usize, usize, usize)> = d
        .changed
        .iter()
        .map(|c| (c.tensor, c.block, c.bytes.len()))
        .collect();
    assert_eq!(at, [(1, 0, 1024), (1, 2, 1024), (2, 0, 128)]);
    assert_eq!(d.carried_bytes(), 2176);
    assert_eq!((d.base, d.version), (Version(3), Version(5)));
    let out = d.apply(&base).unwrap();
    assert_eq!(out.bytes(), new.bytes());
    assert_eq!(out.version(), Version(5));
    // Per tensor: w and b whole.
    let t = Delta::encode(&base, &new, Granularity::Tensor).unwrap();
    assert_eq!(t.carried_bytes(), 4096 + 128);
    assert_eq!(t.apply(&base).unwrap().bytes(), new.bytes());
    // Nothing changed: nothing carried, still applies.
    let same = Delta::encode(&base, &version(4), Granularity::Block(100)).unwrap();
    assert_eq!(same.carried_bytes(), 0);
    assert_eq!(same.apply(&base).unwrap().bytes(), base.bytes());
    // Wire round trip.
    let back: Delta = rmp_serde::from_slice(&rmp_serde::to_vec_named(&d).unwrap()).unwrap();
    assert_eq!(back, d);
}

#[test]
fn wrong_base_and_corrupt_changes_are_refused() {
    let base = version(3);
    let mut new = version(5);
    new.view_mut::<f32>("embed").unwrap()[0] = 1.5;
    let d = Delta::encode(&base, &new, Granularity::Block(256)).unwrap();
    let e = d.apply(&version(4)).unwrap_err().to_string();
    assert_eq!(
        e,
        "model `policy`: delta from base version 3 to 5 refused, this receiver holds version 4"
    );
    let mut bad = d.clone();
    bad.changed[0].bytes[0] ^= 1;
    let e = bad.apply(&base).unwrap_err().to_string();
    assert!(
        e.starts_with("model `policy`, tensor `embed`: checksum"),
        "{e}"
    );
    let mut drifted = base.clone();
    drifted.view_mut::<f32>("b").unwrap()[0] = 7.0; // same version, other bytes
    let e = d.apply(&drifted).unwrap_err().to_string();
    assert!(
        e.starts_with("model `policy`, tensor `<arena>`: checksum"),
        "{e}"
    );
    assert!(matches!(
        Delta::encode(&new, &base, Granularity::Tensor),
        Err(Error::StaleVersion { .. })
    ));
}

#[test]
fn policy_sends_full_anchors_and_receiver_follows() {
    let policy = DeltaPolicy {
        full_every: 3,
        max_fraction: 0.5,
        granularity: Granularity::Block(512),
    };
    let mut enc = DeltaEncoder::new(policy);
    let mut rx = DeltaReceiver::new(ModelId::new("policy").unwrap());
    let mut kinds = String::new();
    let mut total = 0;
    for v in 1..=7_u64 {
        let mut ws = version(v);
        ws.view_mut::<f32>("w").unwrap()[v as usize] = v as f32 * 100.0;
        if v >= 5 {
            // At 5, a big change: full is cheaper than the delta.
            ws.view_mut::<f32>("embed").unwrap().fill(3.0);
        }
        let ws = Arc::new(ws);
        let out = enc.next(Arc::clone(&ws)).unwrap();
        total += out.carried_bytes();
        kinds.push(if matches!(out, Outgoing::Full(_)) {
            'F'
        } else {
            'd'
        });
        let got = rx.apply(&out).unwrap();
        assert_eq!(got.bytes(), ws.bytes(), "version {v}");
        assert_eq!(got.version(), Version(v));
    }
    assert_eq!(kinds, "FddFFdF");
    assert_eq!(enc.carried_bytes(), total as u64);
    // A delta for a base the receiver does not hold.
    let mut lost = DeltaReceiver::new(ModelId::new("policy").unwrap());
    let d = Delta::encode(&version(1), &version(2), Granularity::Tensor).unwrap();
    let e = lost.apply(&Outgoing::Delta(d)).unwrap_err().to_string();
    assert_eq!(
        e,
        "model `policy`: delta from base version 1 to 2 refused, this receiver holds no version"
    );
    assert!(lost.current().is_none());
}
