//! One suite of lifecycle tests, run over every transport of this crate.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use refit_runtime::{
    DType, Error, Manifest, Manifests, ReceiverInit, ReceiverTransport, SenderInit,
    SenderTransport, Version, WeightSet,
};
use refit_transports::broadcast::GroupEnd;
use refit_transports::broadcast::{BroadcastConfig, BroadcastReceiver, BroadcastSender};
use refit_transports::collective::{CpuConfig, LocalRendezvous, Rendezvous};
use refit_transports::cuda_ipc::{CudaIpcLink, HostSlots};
use refit_transports::file::{FileConfig, FileReceiver, FileSender};
use refit_transports::inproc::InProc;
use refit_transports::link::{LinkOptions, ReceiverSpec};
use refit_transports::nccl::NcclLink;
use refit_transports::shm::{ShmConfig, ShmReadMode, ShmReceiver, ShmSender};
use refit_transports::tcp::{TcpConfig, TcpReceiver, TcpReceiverConfig, TcpSender, TransferMode};

const T: Duration = Duration::from_secs(10);

/// Makes a sender transport and `n` receiver transports for the given models.
trait Make {
    type S: SenderTransport + std::fmt::Debug + 'static;
    type R: ReceiverTransport + std::fmt::Debug + 'static;
    fn make(&self, ms: &Manifests, n: usize) -> (Self::S, Vec<Self::R>);
}

struct InProcMake;
impl Make for InProcMake {
    type S = refit_transports::inproc::InProcSender;
    type R = refit_transports::inproc::InProcReceiver;
    fn make(&self, _ms: &Manifests, n: usize) -> (Self::S, Vec<Self::R>) {
        let hub = InProc::new();
        let rs = (0..n).map(|_| hub.receiver()).collect();
        (hub.sender().unwrap(), rs)
    }
}

struct ShmMake(ShmReadMode);
impl Make for ShmMake {
    type S = ShmSender;
    type R = ShmReceiver;
    fn make(&self, ms: &Manifests, n: usize) -> (Self::S, Vec<Self::R>) {
        let cfg = ShmConfig {
            expected_receivers: n,
            ..ShmConfig::default()
        };
        let s = ShmSender::create(&cfg, ms).unwrap();
        let spec = s.receiver_spec();
        let rs = (0..n)
            .map(|_| ShmReceiver::new(spec.clone()).with_mode(self.0))
            .collect();
        (s, rs)
    }
}

struct TcpMake(TransferMode);
impl Make for TcpMake {
    type S = TcpSender;
    type R = TcpReceiver;
    fn make(&self, ms: &Manifests, n: usize) -> (Self::S, Vec<Self::R>) {
        let cfg = TcpConfig {
            expected_receivers: n,
            token: Some(refit_node::ClusterToken::random()),
            ..TcpConfig::default()
        };
        let s = TcpSender::bind(cfg, ms).unwrap();
        let spec = s.receiver_spec();
        let rcfg = TcpReceiverConfig {
            mode: self.0,
            ..TcpReceiverConfig::default()
        };
        let rs = (0..n)
            .map(|_| TcpReceiver::new(spec.clone()).with_config(rcfg.clone()))
            .collect();
        (s, rs)
    }
}

/// Each scheme gets its own directory, removed when the runner is dropped.
#[derive(Default)]
struct FileMake(std::sync::Mutex<Vec<tempfile::TempDir>>);
impl Make for FileMake {
    type S = FileSender;
    type R = FileReceiver;
    fn make(&self, _ms: &Manifests, n: usize) -> (Self::S, Vec<Self::R>) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = FileConfig {
            expected_receivers: n,
            ..FileConfig::new(dir.path())
        };
        let s = FileSender::create(&cfg).unwrap();
        let spec = s.receiver_spec();
        self.0.lock().unwrap().push(dir);
        let rs = (0..n).map(|_| FileReceiver::new(spec.clone())).collect();
        (s, rs)
    }
}

/// Rank 0 and `n` receivers of a CPU broadcast group (threads here; real processes in
/// `broadcast_processes.rs`), meeting through an in-memory store.
struct BroadcastMake;
impl Make for BroadcastMake {
    type S = BroadcastSender<CpuConfig>;
    type R = BroadcastReceiver<CpuConfig>;
    fn make(&self, _ms: &Manifests, n: usize) -> (Self::S, Vec<Self::R>) {
        let store: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new());
        let cpu = CpuConfig::new(refit_node::ClusterToken::random());
        let cfg = BroadcastConfig {
            heartbeat: Duration::from_millis(200),
            ..BroadcastConfig::new(format!("suite-{}", uuid_like()))
        };
        let members: Vec<String> = (1..=n).map(|i| format!("r{i}")).collect();
        let s = BroadcastSender::new(
            cpu.clone(),
            Arc::clone(&store),
            cfg.clone(),
            members.clone(),
        )
        .unwrap();
        let rs = members
            .iter()
            .map(|m| {
                BroadcastReceiver::new(cpu.clone(), Arc::clone(&store), cfg.clone(), m.as_str())
                    .unwrap()
            })
            .collect();
        (s, rs)
    }
}

/// The CPU collective's connector for an end of a group.
fn cpu(end: &GroupEnd) -> CpuConfig {
    CpuConfig::new(end.token.clone()).with_bind(end.ip)
}

// ANCHOR: nccl_over_cpu
/// The `nccl` link's own sender and receivers (its prepare/commit protocol, one
/// communicator per generation, the unique id's store), over the CPU collective instead of
/// NCCL: what `NcclLink` opens on GPUs, runnable in CI.
struct NcclOverCpuMake;
impl Make for NcclOverCpuMake {
    type S = BroadcastSender<CpuConfig>;
    type R = BroadcastReceiver<CpuConfig>;
    fn make(&self, _ms: &Manifests, n: usize) -> (Self::S, Vec<Self::R>) {
        let options = LinkOptions {
            expected_receivers: n,
            token: Some(refit_node::ClusterToken::random()),
            ..LinkOptions::default()
        };
        let (s, spec) = NcclLink.open_over(&options, cpu).unwrap();
        let rs = (0..n)
            .map(|_| NcclLink.join_over(&spec, &options, cpu).unwrap())
            .collect();
        (s, rs)
    }
}
// ANCHOR_END: nccl_over_cpu

// ANCHOR: ipc_over_host
/// The `cuda-ipc` link's own sender and receivers (the shm board, its slots exported by
/// handle and opened once), over host memory instead of a GPU's.
struct IpcOverHostMake;
impl Make for IpcOverHostMake {
    type S = ShmSender;
    type R = ShmReceiver;
    fn make(&self, ms: &Manifests, n: usize) -> (Self::S, Vec<Self::R>) {
        let options = LinkOptions {
            expected_receivers: n,
            ..LinkOptions::default()
        };
        let (s, spec) = CudaIpcLink
            .open_over(ms, &options, Box::new(HostSlots::new()))
            .unwrap();
        let rs = (0..n)
            .map(|_| {
                CudaIpcLink
                    .join_over(&spec, Box::new(HostSlots::new()))
                    .unwrap()
            })
            .collect();
        (s, rs)
    }
}
// ANCHOR_END: ipc_over_host

fn uuid_like() -> u64 {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn all_makers(f: impl Fn(&dyn Fn() -> Box<dyn Runner>)) {
    f(&|| Box::new(InProcMake));
    f(&|| Box::new(ShmMake(ShmReadMode::Copy)));
    f(&|| Box::new(ShmMake(ShmReadMode::ZeroCopy)));
    f(&|| Box::new(TcpMake(TransferMode::Delta)));
    f(&|| Box::new(TcpMake(TransferMode::Full)));
    f(&|| Box::new(FileMake::default()));
    f(&|| Box::new(BroadcastMake));
    f(&|| Box::new(NcclOverCpuMake));
    f(&|| Box::new(IpcOverHostMake));
}

/// Object-safe runner so one list covers every transport.
trait Runner {
    fn versions_flow_and_stale_is_refused(&self);
    fn bad_tensor_is_refused_and_previous_served(&self);
    fn two_models_land_together(&self);
    fn timeout_and_dead_sender(&self);
}

fn connect_all<M: Make>(
    m: &M,
    ms: &Manifests,
    initial: Vec<WeightSet>,
    n: usize,
) -> (
    refit_runtime::Sender<M::S>,
    Vec<refit_runtime::Receiver<M::R>>,
) {
    let (s, rs) = m.make(ms, n);
    let handles: Vec<_> = rs
        .into_iter()
        .map(|r| std::thread::spawn(move || ReceiverInit::new(r, None).connect(T)))
        .collect();
    let sender = SenderInit::new(s, ms.clone())
        .with_ack_timeout(T)
        .connect(initial, T)
        .unwrap();
    let receivers = handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    (sender, receivers)
}

impl<M: Make> Runner for M {
    fn versions_flow_and_stale_is_refused(&self) {
        let m = manifest(16);
        let ms = manifests(&[("policy", &m)]);
        let (mut sender, mut receivers) = connect_all(self, &ms, vec![stamped("policy", &m, 1)], 2);
        let p = id("policy");
        for r in &receivers {
            assert_eq!(r.version(&p), Version(1));
            check_stamp(&r.current(&p).unwrap()).unwrap();
        }
        // receivers apply on their own threads while the sender waits for their acks
        let stop = Arc::new(AtomicBool::new(false));
        let loops: Vec<_> = receivers
            .drain(..)
            .map(|r| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut r = r;
                    let mut last = 1;
                    while !stop.load(Ordering::Acquire) {
                        if let Some(u) = r.receive(Duration::from_millis(20)).unwrap() {
                            let w = &u.group[0];
                            check_stamp(w).unwrap();
                            assert!(w.version().get() > last, "versions only grow");
                            last = w.version().get();
                        }
                    }
                    r
                })
            })
            .collect();
        for v in 2..=40 {
            let acked = sender.send(stamped("policy", &m, v)).unwrap();
            assert_eq!(acked, vec![(p.clone(), Version(v))]);
        }
        let dup = sender.send(stamped("policy", &m, 40)).unwrap_err();
        assert!(matches!(dup, Error::StaleVersion { .. }), "{dup}");
        let old = sender.send(stamped("policy", &m, 7)).unwrap_err();
        assert!(
            old.to_string()
                .contains("version 7 refused, version 40 already applied"),
            "{old}"
        );
        stop.store(true, Ordering::Release);
        for h in loops {
            let r = h.join().unwrap();
            assert_eq!(r.version(&p), Version(40));
            check_stamp(&r.current(&p).unwrap()).unwrap();
        }
        sender.shutdown().unwrap();
    }

    fn bad_tensor_is_refused_and_previous_served(&self) {
        let m = manifest(8);
        let ms = manifests(&[("policy", &m)]);
        let (mut sender, mut receivers) = connect_all(self, &ms, vec![stamped("policy", &m, 1)], 1);
        let p = id("policy");
        let wrong_shape = manifest(9);
        let err = sender
            .send(stamped("policy", &wrong_shape, 2))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tensor `fc1.weight`: shape [8, 4] expected, found [9, 4]"),
            "{err}"
        );
        let wrong_dtype = Arc::new(
            Manifest::builder()
                .tensor("fc1.weight", DType::F16, &[8, 4])
                .tensor("fc1.bias", DType::F32, &[8])
                .tensor("head.weight", DType::F32, &[2, 8])
                .tensor("steps", DType::I64, &[])
                .build()
                .unwrap(),
        );
        let mut ws = WeightSet::zeroed(id("policy"), wrong_dtype);
        ws.set_version(Version(2));
        let err = sender.send(ws).unwrap_err().to_string();
        assert!(
            err.contains("tensor `fc1.weight`: dtype f32 expected, found f16"),
            "{err}"
        );
        let renamed = Arc::new(
            Manifest::builder()
                .tensor("fc1.weight", DType::F32, &[8, 4])
                .tensor("fc1.b", DType::F32, &[8])
                .tensor("head.weight", DType::F32, &[2, 8])
                .tensor("steps", DType::I64, &[])
                .build()
                .unwrap(),
        );
        let err = sender
            .send(stamped("policy", &renamed, 2))
            .unwrap_err()
            .to_string();
        assert!(err.contains("tensor `fc1.bias`: missing"), "{err}");
        let err = sender.send(stamped("critic", &m, 2)).unwrap_err();
        assert!(matches!(err, Error::UnknownModel(_)), "{err}");
        // nothing was published: the receiver still serves version 1, and 2 still goes through
        assert!(
            receivers[0]
                .receive(Duration::from_millis(30))
                .unwrap()
                .is_none()
        );
        assert_eq!(receivers[0].version(&p), Version(1));
        check_stamp(&receivers[0].current(&p).unwrap()).unwrap();
        let pending = sender.send_async(vec![stamped("policy", &m, 2)]).unwrap();
        assert!(receivers[0].receive(T).unwrap().is_some());
        sender.wait(&pending, T).unwrap();
        assert_eq!(receivers[0].version(&p), Version(2));
        // a receiver that expects another layout refuses to connect, naming the tensor
        let (s2, mut rs2) = self.make(&ms, 1);
        let expect = manifests(&[("policy", &wrong_shape)]);
        let r = rs2.remove(0);
        let h = std::thread::spawn(move || ReceiverInit::new(r, Some(expect)).connect(T));
        let _sender2 = SenderInit::new(s2, ms.clone())
            .with_ack_timeout(Duration::from_millis(300))
            .connect(vec![stamped("policy", &m, 1)], Duration::from_millis(300));
        let err = h.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("tensor `fc1.weight`"), "{err}");
    }

    fn two_models_land_together(&self) {
        let ma = manifest(32);
        let mc = manifest(8);
        let ms = manifests(&[("actor", &ma), ("critic", &mc)]);
        let (mut sender, mut receivers) = connect_all(
            self,
            &ms,
            vec![stamped("actor", &ma, 1), stamped("critic", &mc, 1)],
            1,
        );
        let r = receivers.remove(0);
        let served = r.served();
        let lp = r.spawn_loop(|_| {}, |e| panic!("refused: {e}"));
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let (a, c) = (id("actor"), id("critic"));
                let mut checks = 0u64;
                // at least one check even if the sends finish before this thread runs
                loop {
                    let done = stop.load(Ordering::Acquire);
                    let snap = served.load();
                    let (va, vc) = (snap.version(&a), snap.version(&c));
                    assert_eq!(va, vc, "actor and critic seen at different versions");
                    check_stamp(snap.get(&a).unwrap()).unwrap();
                    check_stamp(snap.get(&c).unwrap()).unwrap();
                    checks += 1;
                    if done {
                        break checks;
                    }
                }
            })
        };
        for v in 2..=60 {
            sender
                .send_group(vec![stamped("actor", &ma, v), stamped("critic", &mc, v)])
                .unwrap();
        }
        stop.store(true, Ordering::Release);
        assert!(reader.join().unwrap() > 0);
        let r = lp.stop().unwrap();
        assert_eq!(r.version(&id("critic")), Version(60));
        // a group with one bad member publishes nothing
        let bad = manifest(3);
        assert!(
            sender
                .send_group(vec![stamped("actor", &ma, 61), stamped("critic", &bad, 61)])
                .is_err()
        );
        assert_eq!(sender.version(&id("actor")), Version(60));
    }

    fn timeout_and_dead_sender(&self) {
        let m = manifest(4);
        let ms = manifests(&[("policy", &m)]);
        let (sender, mut receivers) = connect_all(self, &ms, vec![stamped("policy", &m, 1)], 1);
        let t = Instant::now();
        assert!(
            receivers[0]
                .receive(Duration::from_millis(80))
                .unwrap()
                .is_none()
        );
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(70) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        drop(sender);
        let t = Instant::now();
        let err = receivers[0].receive(Duration::from_secs(30)).unwrap_err();
        assert!(matches!(err, Error::PeerGone { .. }), "{err}");
        assert!(t.elapsed() < Duration::from_secs(2));
        // the last applied weights stay served
        check_stamp(&receivers[0].current(&id("policy")).unwrap()).unwrap();
        // a receiver with no sender times out, never hangs
        let (_s, mut rs) = self.make(&ms, 1);
        let t = Instant::now();
        let err = ReceiverInit::new(rs.remove(0), None)
            .connect(Duration::from_millis(150))
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}

#[test]
fn versions_flow_and_stale_is_refused() {
    all_makers(|mk| mk().versions_flow_and_stale_is_refused());
}

#[test]
fn bad_tensor_is_refused_and_previous_served() {
    all_makers(|mk| mk().bad_tensor_is_refused_and_previous_served());
}

#[test]
fn two_models_land_together() {
    all_makers(|mk| mk().two_models_land_together());
}

#[test]
fn timeout_and_dead_sender() {
    all_makers(|mk| mk().timeout_and_dead_sender());
}

#[test]
fn sender_with_no_receiver_times_out_on_acks() {
    let m = manifest(4);
    let ms = manifests(&[("policy", &m)]);
    let cfg = ShmConfig {
        expected_receivers: 1,
        ..ShmConfig::default()
    };
    let s = ShmSender::create(&cfg, &ms).unwrap();
    let paths = s.segment_paths();
    assert!(paths.iter().all(|p| p.exists()));
    let t = Instant::now();
    let err = SenderInit::new(s, ms)
        .connect(vec![stamped("policy", &m, 1)], Duration::from_millis(200))
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2));
    // the failed sender was dropped: its segments are gone
    assert!(paths.iter().all(|p| !p.exists()), "segments left behind");
}

/// Shared memory with `slots` reserved and room for `max_slots`, read in place.
struct ShmSlots(usize, usize);
impl Make for ShmSlots {
    type S = ShmSender;
    type R = ShmReceiver;
    fn make(&self, ms: &Manifests, n: usize) -> (Self::S, Vec<Self::R>) {
        let cfg = ShmConfig {
            expected_receivers: n,
            slots: self.0,
            max_slots: self.1,
            ..ShmConfig::default()
        };
        let s = ShmSender::create(&cfg, ms).unwrap();
        let spec = s.receiver_spec();
        let rs = (0..n).map(|_| ShmReceiver::new(spec.clone())).collect();
        (s, rs)
    }
}

/// Publishes version `v` of `policy` and has the one receiver take it.
fn publish_and_take(
    sender: &mut refit_runtime::Sender<ShmSender>,
    rs: &mut [refit_runtime::Receiver<ShmReceiver>],
    m: &Arc<Manifest>,
    v: u64,
) -> refit_runtime::Result<()> {
    let pending = sender.send_async(vec![stamped("policy", m, v)])?;
    let u = rs[0].receive(T)?.expect("the version arrives");
    check_stamp(&u.group[0]).unwrap();
    sender.wait(&pending, T)
}

#[test]
fn a_reader_holding_an_old_version_costs_a_slot_and_copies_never_a_wait() {
    let m = manifest(64);
    let ms = manifests(&[("policy", &m)]);
    let (mut sender, mut rs) = connect_all(&ShmSlots(3, 4), &ms, vec![stamped("policy", &m, 1)], 1);
    let p = id("policy");
    // the default read serves the slot in place
    let held = rs[0].current(&p).unwrap();
    assert!(held.is_shared());
    assert_eq!(rs[0].transport().versions_copied(), 0);
    // publish many versions while the program keeps version 1 (pinned): the sender never
    // waits; it adds one slot, and marks the receiver behind, which then reads new versions
    // into private memory instead of pinning more slots
    for v in 2..=20 {
        publish_and_take(&mut sender, &mut rs, &m, v).unwrap();
        check_stamp(&held).unwrap();
    }
    assert_eq!(held.version(), Version(1));
    assert_eq!(sender.transport().slots_in_use(&p).unwrap(), 4);
    assert!(sender.transport().behind_marks() >= 1);
    // from version 3 on (version 1 then two behind) every version was copied
    assert_eq!(rs[0].transport().versions_copied(), 18);
    // once the old version is let go, versions are read in place again
    drop(held);
    for v in 21..=24 {
        publish_and_take(&mut sender, &mut rs, &m, v).unwrap();
    }
    assert_eq!(rs[0].transport().versions_copied(), 18);
    assert_eq!(sender.transport().slots_in_use(&p).unwrap(), 4);
    sender.shutdown().unwrap();
}

#[test]
fn at_max_slots_a_publish_waits_for_its_deadline_naming_the_holders() {
    let m = manifest(64);
    let ms = manifests(&[("policy", &m)]);
    let (mut sender, mut rs) = connect_all(&ShmSlots(3, 3), &ms, vec![stamped("policy", &m, 1)], 1);
    let p = id("policy");
    let held = rs[0].current(&p).unwrap();
    publish_and_take(&mut sender, &mut rs, &m, 2).unwrap();
    let held2 = rs[0].current(&p).unwrap();
    publish_and_take(&mut sender, &mut rs, &m, 3).unwrap();
    // versions 1 and 2 pinned, 3 in force, no room to grow: the writer says so within its
    // deadline instead of overwriting
    sender.set_ack_timeout(Duration::from_millis(100));
    let err = publish_and_take(&mut sender, &mut rs, &m, 4).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("pinned by readers") && text.contains(&std::process::id().to_string()),
        "{text}"
    );
    check_stamp(&held).unwrap();
    check_stamp(&held2).unwrap();
    drop((held, held2));
    sender.set_ack_timeout(T);
    publish_and_take(&mut sender, &mut rs, &m, 5).unwrap();
    assert_eq!(rs[0].version(&p), Version(5));
    assert_eq!(sender.transport().slots_in_use(&p).unwrap(), 3);
}

#[test]
fn loaned_slots_publish_without_a_copy_and_seal() {
    let m = manifest(32);
    let ms = manifests(&[("policy", &m)]);
    let (mut sender, mut rs) = connect_all(
        &ShmMake(ShmReadMode::ZeroCopy),
        &ms,
        vec![stamped("policy", &m, 1)],
        1,
    );
    let p = id("policy");
    let far = Instant::now() + T;
    for v in 2..=12 {
        let mut ws = sender.transport_mut().loan(&p, Version(v), far).unwrap();
        assert!(ws.is_shared());
        ws.copy_from(&stamped("policy", &m, v)).unwrap(); // fills the slot in place
        let ws = Arc::new(ws);
        let keep = Arc::clone(&ws);
        let pending = sender.publish_shared(vec![ws]).unwrap();
        let u = rs[0].receive(T).unwrap().unwrap();
        sender.wait(&pending, T).unwrap();
        check_stamp(&u.group[0]).unwrap();
        // the receiver reads the very bytes the trainer wrote: same shared memory, no copy
        assert_eq!(u.group[0].bytes(), keep.bytes());
        // once published, the loan is sealed: writing through a kept handle is refused
        let mut keep = Arc::try_unwrap(keep).unwrap();
        assert!(matches!(keep.bytes_mut(), Err(Error::ReadOnly(_))));
    }
    // a loan given up unpublished leaves nothing behind; the next publish copies as usual
    let abandoned = sender.transport_mut().loan(&p, Version(13), far).unwrap();
    drop(abandoned);
    let pending = sender.send_async(vec![stamped("policy", &m, 13)]).unwrap();
    rs[0].receive(T).unwrap();
    sender.wait(&pending, T).unwrap();
    assert_eq!(rs[0].version(&p), Version(13));
    check_stamp(&rs[0].current(&p).unwrap()).unwrap();
}

/// The `nccl` link's prepare/commit protocol run by its own code over the CPU collective:
/// two receivers, a bucket damaged on the way refused whole by both (the previous version
/// kept), a third receiver joining (a new generation, a new communicator, the newest version
/// re-sent), one leaving (another generation), versions flowing after each, and the
/// sender's goodbye reported by every receiver when it shuts down.
#[test]
fn nccl_link_protocol_over_the_cpu_collective_regroups_and_refuses_a_corrupt_bucket() {
    use std::sync::Mutex;
    let m = manifest(64);
    let ms = manifests(&[("policy", &m)]);
    let p = id("policy");
    let options = LinkOptions {
        expected_receivers: 2,
        token: Some(refit_node::ClusterToken::random()),
        ..LinkOptions::default()
    };
    let (transport, spec) = NcclLink.open_over(&options, cpu).unwrap();
    // the spec travels as text, as it would to another process
    let spec = ReceiverSpec::from_token(&spec.to_token().unwrap()).unwrap();
    assert_eq!(spec.transport(), "nccl");
    let join = || NcclLink.join_over(&spec, &options, cpu).unwrap();
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let (b1, b2) = (join(), join());
    assert_eq!((b1.member(), b2.member()), ("b1", "b2"));
    let h1 = std::thread::spawn(move || ReceiverInit::new(b1, None).connect(T));
    let h2 = std::thread::spawn(move || ReceiverInit::new(b2, None).connect(T));
    let mut sender = SenderInit::new(transport, ms.clone())
        .with_ack_timeout(T)
        .connect(vec![stamped("policy", &m, 1)], T)
        .unwrap();
    let loop_of =
        |h: std::thread::JoinHandle<refit_runtime::Result<refit_runtime::Receiver<_>>>| {
            let errors = Arc::clone(&errors);
            h.join().unwrap().unwrap().spawn_loop(
                |_| {},
                move |e| {
                    errors.lock().unwrap().push(e.to_string());
                    true
                },
            )
        };
    let (l1, l2) = (loop_of(h1), loop_of(h2));
    let at = |l: &refit_runtime::ReceiverLoop<BroadcastReceiver<CpuConfig>>| {
        let w = l.served().load().get(&p).cloned().unwrap();
        check_stamp(&w).unwrap();
        w.version().get()
    };
    for v in 2..=4 {
        sender.send(stamped("policy", &m, v)).unwrap();
    }
    assert_eq!((at(&l1), at(&l2)), (4, 4));
    let stats = sender.transport().stats();
    let prepares = stats.prepares();

    // one bucket damaged after its prepare: both receivers refuse version 5 whole
    sender.transport().inject_corruption(1);
    let e = sender
        .send(stamped("policy", &m, 5))
        .unwrap_err()
        .to_string();
    assert!(e.contains("refused") && e.contains("checksum"), "{e}");
    let deadline = Instant::now() + T;
    while errors
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.contains("checksum"))
        .count()
        < 2
    {
        assert!(Instant::now() < deadline, "{:?}", errors.lock().unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!((at(&l1), at(&l2)), (4, 4));
    sender.send(stamped("policy", &m, 6)).unwrap();
    assert_eq!((at(&l1), at(&l2)), (6, 6));
    // one prepare per bucket of every version broadcast (4, 5 and 6 after the baseline)
    let buckets =
        refit_runtime::BucketPlan::compute(&p, &m, &m, refit_transports::nccl::BUCKET_SIZE)
            .unwrap()
            .len() as u64;
    assert_eq!(stats.prepares() - prepares, 2 * buckets);

    // a third receiver joins: generation 2, every rank on a new communicator, version 6
    // re-sent (the two holding it ack it again, the newcomer starts from it)
    let b3 = join();
    assert_eq!(b3.member(), "b3");
    let h3 = std::thread::spawn(move || ReceiverInit::new(b3, None).connect(T));
    let members = |names: &[&str]| names.iter().map(|n| (*n).to_owned()).collect();
    let deadline = Instant::now() + T;
    let entries = sender
        .transport_mut()
        .regroup(members(&["b1", "b2", "b3"]), deadline)
        .unwrap();
    assert_eq!(entries, vec![(p.clone(), Version(6))]);
    sender
        .transport_mut()
        .wait_acks(&entries, deadline)
        .unwrap();
    let l3 = loop_of(h3);
    assert_eq!(sender.transport().generation(), 2);
    assert_eq!(at(&l3), 6);
    sender.send(stamped("policy", &m, 7)).unwrap();
    assert_eq!((at(&l1), at(&l2), at(&l3)), (7, 7, 7));

    // the second one leaves: generation 3 without it, the others go on
    l2.stop().unwrap().shutdown().unwrap();
    let deadline = Instant::now() + T;
    let entries = sender
        .transport_mut()
        .regroup(members(&["b1", "b3"]), deadline)
        .unwrap();
    sender
        .transport_mut()
        .wait_acks(&entries, deadline)
        .unwrap();
    assert_eq!(sender.transport().generation(), 3);
    sender.send(stamped("policy", &m, 8)).unwrap();
    assert_eq!((at(&l1), at(&l3)), (8, 8));
    assert_eq!(stats.generation(), 3);
    // a clean shutdown says goodbye: receivers report the sender gone at once (an NCCL
    // rank would otherwise only learn it from its idle timeout)
    sender.shutdown().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let goodbyes = || {
        errors
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.contains("is gone: the sender shut down"))
            .count()
    };
    while goodbyes() < 2 {
        assert!(Instant::now() < deadline, "{:?}", errors.lock().unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
    for l in [l1, l3] {
        let r = l.stop().unwrap();
        assert_eq!(r.version(&p), Version(8));
    }
}
