//! The shm transport's waits, from inside the module (the board's words are private).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use refit_runtime::{
    DType, Error, Manifest, Manifests, ModelId, ReceiverInit, SenderInit, Version, WeightSet,
};

use refit_runtime::testing;

use super::layout::{LAYOUT, OFF_COMMIT_SEQ, OFF_LAYOUT};
use super::{ShmConfig, ShmReadMode, ShmReceiver, ShmSender};

const T: Duration = Duration::from_secs(30);

fn weights(m: &Arc<Manifest>, v: u64) -> WeightSet {
    testing::filled(&testing::id("policy"), m, v, v as f32)
}

/// The model `policy` of one f32 tensor `w` of `floats` values, and its scheme's manifests.
fn policy(floats: usize) -> (Arc<Manifest>, Manifests) {
    let m = testing::manifest(&[("w", DType::F32, &[floats])]);
    let ms = testing::manifests(&[("policy", &m)]);
    (m, ms)
}

#[test]
fn a_board_left_mid_commit_by_a_live_sender_is_a_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (m, ms) = policy(16);
    let cfg = ShmConfig {
        dir: dir.path().to_path_buf(),
        expected_receivers: 1,
        ..ShmConfig::default()
    };
    let s = ShmSender::create(&cfg, &ms).unwrap();
    let r = ShmReceiver::new(s.receiver_spec());
    let h = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T).unwrap());
    let mut sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![weights(&m, 1)], T)
        .unwrap();
    let mut receiver = h.join().unwrap();
    // the sender (this live process) stops in the middle of a commit: the sequence is odd
    let seq = sender.transport().board.u32_at(OFF_COMMIT_SEQ).unwrap();
    seq.fetch_add(1, Ordering::SeqCst);
    let deadline = Duration::from_millis(1500);
    let t = Instant::now();
    let err = receiver.receive(deadline).unwrap_err();
    let waited = t.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("to finish its commit"), "{err}");
    assert!(
        waited >= deadline - Duration::from_millis(50)
            && waited < deadline + Duration::from_secs(2),
        "{waited:?}"
    );
    // a zero-timeout poll still gives a commit its grace before it reports one
    let t = Instant::now();
    let err = receiver.receive(Duration::ZERO).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(
        t.elapsed() >= super::board::COMMIT_GRACE - Duration::from_millis(10)
            && t.elapsed() < super::board::COMMIT_GRACE + Duration::from_secs(2),
        "{:?}",
        t.elapsed()
    );
    // the previous weights stay served; once the commit ends, versions flow again
    assert_eq!(
        receiver.version(&ModelId::new("policy").unwrap()),
        Version(1)
    );
    seq.fetch_add(1, Ordering::SeqCst);
    let pending = sender.send_async(vec![weights(&m, 2)]).unwrap();
    receiver.receive(T).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    assert_eq!(
        receiver.version(&ModelId::new("policy").unwrap()),
        Version(2)
    );
    sender.shutdown().unwrap();
}

/// A board written by another layout version (forged here by rewriting the layout word) is
/// refused by a receiver, naming both versions and the board.
#[test]
fn a_board_of_another_layout_version_is_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let (_, ms) = policy(16);
    let cfg = ShmConfig {
        dir: dir.path().to_path_buf(),
        expected_receivers: 1,
        ..ShmConfig::default()
    };
    let s = ShmSender::create(&cfg, &ms).unwrap();
    s.board
        .u32_at(OFF_LAYOUT)
        .unwrap()
        .store(99, Ordering::SeqCst);
    let spec = s.receiver_spec();
    let e = ReceiverInit::new(ShmReceiver::new(spec.clone()), None)
        .connect(T)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Protocol {
                ours: LAYOUT,
                theirs: 99,
                ..
            }
        ),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.contains("shm board layout protocol version 99")
            && text.contains(&format!("speaks version {LAYOUT}"))
            && text.contains(&spec.board.display().to_string()),
        "{text}"
    );
}

/// A version damaged in shared memory after the sender wrote it is refused by a checksumming
/// scheme, naming the model and the version; the previous version stays served, and the next
/// whole version is taken. Both read modes.
#[test]
fn a_damaged_version_is_refused_and_the_previous_kept() {
    for mode in [ShmReadMode::ZeroCopy, ShmReadMode::Copy] {
        let dir = tempfile::tempdir().unwrap();
        let (m, ms) = policy(64 * 1024);
        let p = ModelId::new("policy").unwrap();
        let cfg = ShmConfig {
            dir: dir.path().to_path_buf(),
            expected_receivers: 1,
            checksum: true,
            ..ShmConfig::default()
        };
        let s = ShmSender::create(&cfg, &ms).unwrap();
        let r = ShmReceiver::new(s.receiver_spec()).with_mode(mode);
        let h = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T).unwrap());
        let mut sender = SenderInit::new(s, ms)
            .with_ack_timeout(T)
            .connect(vec![weights(&m, 1)], T)
            .unwrap();
        let mut receiver = h.join().unwrap();
        // a whole version passes its check
        let pending = sender.send_async(vec![weights(&m, 2)]).unwrap();
        receiver.receive(T).unwrap().unwrap();
        sender.wait(&pending, T).unwrap();
        // version 3 is damaged after the write
        let _never_acked = sender.send_async(vec![weights(&m, 3)]).unwrap();
        sender.transport().damage_current(0).unwrap();
        let err = receiver.receive(T).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Damaged {
                    version: Version(3),
                    ..
                }
            ),
            "{mode:?}: a refusal, not an i/o failure: {err:?}"
        );
        let err = err.to_string();
        assert!(
            err.contains("version 3 of model `policy` refused") && err.contains("checksum"),
            "{mode:?}: {err}"
        );
        assert_eq!(receiver.version(&p), Version(2), "{mode:?}");
        let served = receiver.current(&p).unwrap();
        assert!(
            served.view::<f32>("w").unwrap().iter().all(|&x| x == 2.0),
            "{mode:?}"
        );
        // it is not offered again; the next whole version lands
        assert!(
            receiver
                .receive(Duration::from_millis(50))
                .unwrap()
                .is_none()
        );
        let pending = sender.send_async(vec![weights(&m, 4)]).unwrap();
        receiver.receive(T).unwrap().unwrap();
        sender.wait(&pending, T).unwrap();
        assert_eq!(receiver.version(&p), Version(4));
        sender.shutdown().unwrap();
    }
}

/// The slots a sender starts with are reserved in the directory when it is created, the
/// others only when readers hold old versions.
#[test]
fn starting_slots_are_reserved_and_the_rest_sparse() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let (m, ms) = policy(1 << 20);
    let cfg = ShmConfig {
        dir: dir.path().to_path_buf(),
        slots: 2,
        max_slots: 6,
        ..ShmConfig::default()
    };
    let s = ShmSender::create(&cfg, &ms).unwrap();
    let data = &s.segment_paths()[1];
    let meta = std::fs::metadata(data).unwrap();
    let stride = super::layout::slot_stride(m.total_len()) as u64;
    assert_eq!(meta.len(), 6 * stride, "room for max_slots");
    // the file system counts what is allocated (plus its own metadata), in 512 B blocks
    let allocated = meta.blocks() * 512;
    assert!(
        (2 * stride..3 * stride).contains(&allocated),
        "two slots of {stride} B reserved, found {allocated} B"
    );
}
