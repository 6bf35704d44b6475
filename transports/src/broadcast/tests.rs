//! Rank 0 driven by hand (a raw CPU communicator), so a test can send what a correct sender
//! never would: a bucket whose bytes miss their checksum.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use refit_node::ClusterToken;
use refit_runtime::{BucketPlan, DType, Manifest, ModelId, ReceiverInit, Version, WeightSet, wire};

use super::messages::{self, Control};
use super::sender::prepare;
use super::*;
use crate::collective::{CpuComm, LocalRendezvous};

const LONG: Duration = Duration::from_secs(30);

/// Every f32 equal to the version (the arenas here have no padding).
fn weights(m: &Arc<Manifest>, v: u64) -> WeightSet {
    refit_runtime::testing::filled(&refit_runtime::testing::id("policy"), m, v, v as f32)
}

/// Broadcasts every bucket of `w` as publish `seq`, flipping a byte of bucket `corrupt`.
fn send_version(
    comm: &mut CpuComm,
    plan: &BucketPlan,
    w: &WeightSet,
    seq: u64,
    corrupt: Option<usize>,
) {
    for b in 0..plan.len() {
        let (p, bytes) = prepare(plan, w, b, (0, 1), seq).unwrap();
        messages::send(comm, &Control::Prepare(p), Instant::now() + LONG).unwrap();
        let mut bytes = bytes.to_vec();
        if corrupt == Some(b) {
            bytes[3] ^= 0x40;
        }
        comm.broadcast_send(&bytes, Instant::now() + LONG).unwrap();
    }
}

#[test]
fn a_bucket_whose_bytes_miss_their_checksum_is_refused_and_the_old_version_kept() {
    let m = Arc::new(
        Manifest::builder()
            .tensor("a", DType::F32, &[4096])
            .tensor("b", DType::F32, &[4096])
            .build()
            .unwrap(),
    );
    let store: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new());
    let cpu = CpuConfig::new(ClusterToken::random());
    let cfg = BroadcastConfig {
        bucket_size: 16384,
        ..BroadcastConfig::new("checksum")
    };
    store
        .set(
            &cfg.members_key(1),
            &wire::encode(&vec!["r1".to_owned()]).unwrap(),
        )
        .unwrap();
    store.set(&cfg.current_key(), b"1").unwrap();
    let rx = BroadcastReceiver::new(cpu.clone(), Arc::clone(&store), cfg.clone(), "r1").unwrap();
    let stats = rx.stats();
    let joiner = std::thread::spawn(move || ReceiverInit::new(rx, None).connect(LONG));
    let membership = Membership::new("checksum", 1, 0, 2).unwrap();
    let mut comm =
        CpuComm::connect(membership, store.as_ref(), &cpu, Instant::now() + LONG).unwrap();
    let policy = ModelId::new("policy").unwrap();
    let list = vec![(policy.clone(), (*m).clone())];
    let hello = Control::Hello {
        protocol: PROTOCOL_VERSION,
    };
    messages::send(&mut comm, &hello, Instant::now() + LONG).unwrap();
    messages::send(&mut comm, &Control::Manifests(list), Instant::now() + LONG).unwrap();
    let plan = BucketPlan::compute(&policy, &m, &m, 16384).unwrap();
    assert_eq!(plan.len(), 2);
    send_version(&mut comm, &plan, &weights(&m, 1), 1, None);
    let mut r = joiner.join().unwrap().unwrap();
    assert_eq!(r.version(&policy), Version(1));
    // version 2 with a flipped byte in its second bucket: refused, naming bucket and tensor
    send_version(&mut comm, &plan, &weights(&m, 2), 2, Some(1));
    let e = r.receive(LONG).unwrap_err().to_string();
    assert!(
        e.contains("bucket 1") && e.contains("checksum") && e.contains("tensors b"),
        "{e}"
    );
    assert_eq!(r.version(&policy), Version(1));
    let served = r.current(&policy).unwrap();
    assert!(served.view::<f32>("b").unwrap().iter().all(|&x| x == 1.0));
    // rank 0 learns it through the store, under that publish's number
    let key = cfg.ack_key("r1", 2, &policy, Version(2));
    let said = store.wait_get(&key, LONG).unwrap();
    assert!(
        said.starts_with(b"refused: bucket 1"),
        "{}",
        String::from_utf8_lossy(&said)
    );
    // the same version sent again intact lands
    send_version(&mut comm, &plan, &weights(&m, 2), 3, None);
    assert!(r.receive(LONG).unwrap().is_some());
    assert_eq!(r.version(&policy), Version(2));
    assert_eq!(stats.prepares(), 6);
    assert_eq!(stats.refused(), 1);
}

/// A rank 0 of another protocol version (999, or one of before versions that opens with the
/// manifests) is left by the receiver, whose error names both versions.
#[test]
fn a_sender_of_another_protocol_version_is_refused_naming_both() {
    let m = Manifest::builder()
        .tensor("a", DType::F32, &[16])
        .build()
        .unwrap();
    let policy = ModelId::new("policy").unwrap();
    for (group, theirs) in [("v999", 999u32), ("v0", 0)] {
        let store: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new());
        let cpu = CpuConfig::new(ClusterToken::random());
        let cfg = BroadcastConfig::new(group);
        store
            .set(
                &cfg.members_key(1),
                &wire::encode(&vec!["r1".to_owned()]).unwrap(),
            )
            .unwrap();
        store.set(&cfg.current_key(), b"1").unwrap();
        let rx =
            BroadcastReceiver::new(cpu.clone(), Arc::clone(&store), cfg.clone(), "r1").unwrap();
        let joiner = std::thread::spawn(move || ReceiverInit::new(rx, None).connect(LONG));
        let membership = Membership::new(group, 1, 0, 2).unwrap();
        let mut comm =
            CpuComm::connect(membership, store.as_ref(), &cpu, Instant::now() + LONG).unwrap();
        let first = if theirs == 0 {
            Control::Manifests(vec![(policy.clone(), m.clone())])
        } else {
            Control::Hello { protocol: theirs }
        };
        // the receiver may have left before the send completes
        let _ = messages::send(&mut comm, &first, Instant::now() + LONG);
        let e = joiner.join().unwrap().unwrap_err();
        assert!(
            matches!(
                e,
                refit_runtime::Error::Protocol {
                    ours: PROTOCOL_VERSION,
                    ..
                }
            ),
            "{e}"
        );
        let text = e.to_string();
        assert!(
            text.contains(&format!("broadcast protocol version {theirs}"))
                && text.contains(&format!("speaks version {PROTOCOL_VERSION}"))
                && text.contains(group),
            "{text}"
        );
    }
}
