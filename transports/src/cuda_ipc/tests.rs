//! The link's refusals without a GPU, and its protocol over host memory standing in for the
//! device (the scheme suite runs the lifecycle tests over it too).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use refit_node::ClusterToken;
use refit_runtime::{
    DType, Manifest, Manifests, ModelId, ReceiverInit, SenderInit, SenderTransport, Version,
    WeightSet,
};

use super::*;
use crate::link::LinkOptions;
use refit_runtime::testing;

const T: Duration = Duration::from_secs(10);

fn manifests() -> (Arc<Manifest>, Manifests) {
    let m = testing::manifest(&[("w", DType::F32, &[1024]), ("b", DType::F32, &[16])]);
    let ms = testing::manifests(&[("policy", &m)]);
    (m, ms)
}

/// Every f32 equal to the version (the arena has no padding).
fn weights(m: &Arc<Manifest>, v: u64) -> WeightSet {
    testing::filled(&testing::id("policy"), m, v, v as f32)
}

/// Without a GPU (CI), both ends refuse with the reason, naming the feature (or the probe's
/// reason with `cuda`); the spec's transport is checked first. Never a panic.
#[test]
fn gpu_cuda_ipc_link_refuses_without_a_gpu_and_says_why() {
    let (_, ms) = manifests();
    let dir = tempfile::tempdir().unwrap();
    let options = LinkOptions {
        expected_receivers: 1,
        dir: Some(dir.path().to_path_buf()),
        ..LinkOptions::default()
    };
    let Err(e) = CudaIpcLink.open(&ms, &options) else {
        assert!(crate::gpu::check_device(0, false).is_ok());
        return;
    };
    let e = e.to_string();
    assert!(e.starts_with("cuda-ipc transport: "), "{e}");
    if cfg!(feature = "cuda") {
        assert!(e.contains("no usable GPU"), "{e}");
        assert!(CudaIpcLink.built().is_ok());
    } else {
        assert!(
            e.contains("not compiled with CUDA") && e.contains("--features cuda"),
            "{e}"
        );
        assert_eq!(CudaIpcLink.built().unwrap_err().to_string(), e);
    }
    // nothing was left in the directory
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    let (_sender, spec) = CudaIpcLink
        .open_over(&ms, &options, Box::new(HostSlots::new()))
        .unwrap();
    let r = CudaIpcLink
        .receiver(&spec, &options)
        .map(|_| ())
        .unwrap_err();
    assert_eq!(r.to_string(), e);
}

/// The link's sender and receiver over host slots: versions land whole, the handles are
/// opened once for the whole run, and the data segments hold the slots' headers only.
#[test]
fn versions_flow_through_exported_slots_opened_once() {
    let (m, ms) = manifests();
    let dir = tempfile::tempdir().unwrap();
    let options = LinkOptions {
        expected_receivers: 1,
        dir: Some(dir.path().to_path_buf()),
        token: Some(ClusterToken::random()),
        ..LinkOptions::default()
    };
    let (sender, spec) = CudaIpcLink
        .open_over(&ms, &options, Box::new(HostSlots::new()))
        .unwrap();
    let paths = sender.segment_paths();
    // board first, then one data segment per model: three headers, no arena
    assert_eq!(std::fs::metadata(&paths[1]).unwrap().len(), 3 * 4096);
    let opens = Arc::new(AtomicU64::new(0));
    let rx = CudaIpcLink
        .join_over(&spec, Box::new(HostSlots::counting(Arc::clone(&opens))))
        .unwrap();
    let r = std::thread::spawn(move || ReceiverInit::new(rx, None).connect(T));
    let mut sender = SenderInit::new(sender, ms)
        .with_ack_timeout(T)
        .connect(vec![weights(&m, 1)], T)
        .unwrap();
    assert_eq!(sender.transport().name(), "cuda-ipc");
    let mut r = r.join().unwrap().unwrap();
    let p = ModelId::new("policy").unwrap();
    for v in 2..=12 {
        let pending = sender.send_async(vec![weights(&m, v)]).unwrap();
        assert!(r.receive(T).unwrap().is_some());
        sender.wait(&pending, T).unwrap();
        let got = r.current(&p).unwrap();
        assert_eq!(got.version(), Version(v));
        assert!(got.view::<f32>("w").unwrap().iter().all(|&x| x == v as f32));
    }
    assert_eq!(opens.load(Ordering::Relaxed), 1);
    // an exported board lends no host slots
    let e = sender
        .transport_mut()
        .loan(&p, Version(13), std::time::Instant::now() + T)
        .unwrap_err();
    assert!(e.to_string().contains("device memory"), "{e}");
    sender.shutdown().unwrap();
}

/// A plain shm receiver refuses a cuda-ipc board and the other way round, naming the board.
#[test]
fn boards_of_the_other_kind_are_refused() {
    let (m, ms) = manifests();
    let dir = tempfile::tempdir().unwrap();
    let options = LinkOptions {
        dir: Some(dir.path().to_path_buf()),
        ..LinkOptions::default()
    };
    let (sender, spec) = CudaIpcLink
        .open_over(&ms, &options, Box::new(HostSlots::new()))
        .unwrap();
    let _sender = SenderInit::new(sender, ms.clone())
        .connect(vec![weights(&m, 1)], T)
        .unwrap();
    let board: crate::shm::ShmReceiverSpec = spec.params().unwrap();
    let e = ReceiverInit::new(ShmReceiver::new(board), None)
        .connect(T)
        .unwrap_err();
    assert!(
        e.to_string().contains("open it with the cuda-ipc link"),
        "{e}"
    );

    let (shm, shm_spec) = crate::shm::ShmLink.open_typed(&ms, &options).unwrap();
    let _shm = SenderInit::new(shm, ms)
        .connect(vec![weights(&m, 1)], T)
        .unwrap();
    let board: crate::shm::ShmReceiverSpec = shm_spec.params().unwrap();
    let rx = ShmReceiver::new(board).with_imports(Box::new(HostSlots::new()));
    let e = ReceiverInit::new(rx, None).connect(T).unwrap_err();
    assert!(e.to_string().contains("not a cuda-ipc board"), "{e}");
}
