//! The GPU check: everything of the GPU data plane that only a GPU machine can verify, in one
//! run. Built with `--features cuda` (see `scripts/gpu-check.sh`), not part of CI's tests.
//!
//! 1. probe (devices, NCCL loadable);
//! 2. a one-rank NCCL communicator, its unique id exchanged through a real node store;
//! 3. a bucket broadcast: a 256 MiB model in 64 MiB buckets through `broadcast_host` and
//!    through device buffers (upload, broadcast, download), bytes compared; then the
//!    broadcast transport (`BroadcastSender` over NCCL) publishing four versions, one
//!    prepare message per bucket counted;
//! 4. CUDA IPC of 1 GiB between two processes (this binary spawns itself), bytes compared
//!    both ways, the handle opened once per generation;
//! 5. 100 update cycles (a new generation every 10) with device memory measured before and
//!    after;
//! 6. bandwidth: NCCL broadcast against a device-to-device copy of the same size, staged
//!    upload/download against a plain pinned copy, all in this run (medians of 5);
//! 7. the `cuda-ipc` link from the link factory, its receiver another process on the same
//!    GPU (this binary again): versions of 1 GiB, bytes compared there, the slots opened
//!    once; 100 updates with free device memory measured before and after; the hand-over
//!    of a tiny version (commit, wake-up, pin, ack) beside the 1 GiB end-to-end;
//! 8. the `nccl` link from the link factory with a receiver process on a second GPU (only
//!    where two GPUs are present: one GPU cannot hold two ranks of a communicator).
//!
//! It ends with the checklist of what a GPU machine must show (issue #26), each item
//! passed, failed, skipped or not measurable yet, with the reason. Without a GPU it fails at
//! step 1 with the probe's reason.

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use refit_node::{ClusterToken, Node, Store, StoreClient};
use std::sync::Arc;

use refit_runtime::{
    DType, Manifest, Manifests, ModelId, ReceiverInit, SenderInit, Version, WeightSet,
};
use refit_transports::broadcast::{BroadcastConfig, BroadcastSender};
use refit_transports::collective::nccl::{NcclCommunicator, NcclOptions};
use refit_transports::collective::{Communicator, Membership, Rendezvous};
use refit_transports::gpu::device::open_device;
use refit_transports::gpu::ipc::{ExportedBuffer, IpcHandle, IpcImports};
use refit_transports::gpu::pinned::{DEFAULT_CHUNK, PinnedStaging};
use refit_transports::link::{self, CUDA_DEVICE_ENV, LinkOptions, OpenedLink, ReceiverSpec};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

type Check<T> = Result<T, String>;

fn step<T>(what: &str, r: refit_runtime::Result<T>) -> Check<T> {
    r.map_err(|e| format!("{what}: {e}"))
}

fn cuda<T>(what: &str, r: Result<T, cudarc::driver::DriverError>) -> Check<T> {
    r.map_err(|e| format!("{what}: {}", refit_transports::gpu::device::driver_text(e)))
}

/// Deterministic bytes for `seed` (splitmix64 per 8-byte word).
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (i, w) in v.chunks_mut(8).enumerate() {
        let mut z = seed.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        w.copy_from_slice(&z.to_le_bytes()[..w.len()]);
    }
    v
}

fn compare(what: &str, got: &[u8], want: &[u8]) -> Check<()> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} bytes, expected {}",
            got.len(),
            want.len()
        ));
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        return Err(format!(
            "{what}: first differing byte at {i} ({:#04x} != {:#04x})",
            got[i], want[i]
        ));
    }
    Ok(())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// How long `f` takes (it waits for its own device work).
fn timed(mut f: impl FnMut() -> Check<()>) -> Check<Duration> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed())
}

/// How long the copy `f` enqueues on `stream` takes, until the stream is idle.
fn device_timed(
    stream: &CudaStream,
    mut f: impl FnMut() -> Result<(), cudarc::driver::DriverError>,
) -> Check<Duration> {
    timed(|| {
        cuda("copy", f())?;
        cuda("sync", stream.synchronize())
    })
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn deadline(secs: u64) -> Instant {
    Instant::now() + Duration::from_secs(secs)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).map_or("", String::as_str);
    let result = match arg(1) {
        "--ipc-child" => ipc_child(arg(2), args.get(3)),
        "--link-child" => link_child(arg(2), arg(3)),
        _ => run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu check FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Check<()> {
    // 1. Probe.
    let report = refit_transports::gpu::probe().map_err(|e| format!("probe: {e}"))?;
    for d in &report.devices {
        println!(
            "[1/8] probe: device {} {} ({} MiB), nccl loadable: {}",
            d.ordinal,
            d.name,
            d.total_memory / MIB,
            report.nccl
        );
    }
    if !report.nccl {
        return Err("probe: libnccl cannot be loaded (put a libnccl.so -> libnccl.so.2 link in a directory on LD_LIBRARY_PATH)".into());
    }

    // 2. A one-rank communicator through a real node store.
    let token = ClusterToken::random();
    let server = step(
        "store node",
        Node::loopback(token.clone()).map_err(refit_runtime::Error::from),
    )?;
    Store::serve(&server);
    let client = step(
        "client node",
        Node::loopback(token).map_err(refit_runtime::Error::from),
    )?;
    let store = step(
        "store client",
        StoreClient::connect(&client, server.addr(), Duration::from_secs(10))
            .map_err(refit_runtime::Error::from),
    )?;
    let t = Instant::now();
    let mut comm = connect(&store, 1)?;
    let id = step(
        "nccl id in the store",
        store
            .get(&comm.membership().key("nccl-id"))
            .map_err(refit_runtime::Error::from),
    )?;
    if id.is_none() {
        return Err("nccl: rank 0 did not publish its unique id".into());
    }
    println!(
        "[2/8] nccl: one-rank communicator (generation 1) up in {:?}, unique id in the store under {}",
        t.elapsed(),
        comm.membership().key("nccl-id")
    );

    // 3. Bucket broadcast: through the communicator, then through the broadcast transport.
    bucket_broadcast(&mut comm)?;
    broadcast_transport(&store)?;

    // 4. CUDA IPC of 1 GiB between two processes.
    ipc_parent(&comm)?;

    // 5. 100 update cycles, device memory before and after.
    let comm = update_cycles(comm, &store)?;

    // 6. Bandwidth.
    bandwidth(comm)?;

    // 7, 8. The links of the factory, receivers in other processes.
    let mut checklist = Checklist::default();
    ipc_link(&mut checklist)?;
    nccl_link(report.devices.len(), &mut checklist)?;
    checklist.item(
        Status::Script,
        "a colocated run (trainer and engine processes on one GPU, cuda-ipc) trains to its target",
        "scripts/gpu-check.sh runs examples/topologies/cartpole-colocated.toml after this binary"
            .into(),
    );
    checklist.print()
}

/// How one item of the checklist came out.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Status {
    Pass,
    Fail,
    /// Not measurable with what exists yet.
    NotYet,
    /// This machine cannot show it.
    Skip,
    /// The GPU check script runs it.
    Script,
}

/// What a GPU machine must show, each item with what was seen.
#[derive(Default)]
struct Checklist(Vec<(Status, &'static str, String)>);

impl Checklist {
    fn item(&mut self, status: Status, what: &'static str, seen: String) {
        self.0.push((status, what, seen));
    }

    /// Prints the list; fails when an item failed.
    fn print(&self) -> Check<()> {
        println!("checklist:");
        for (status, what, seen) in &self.0 {
            let tag = match status {
                Status::Pass => "PASS",
                Status::Fail => "FAIL",
                Status::NotYet => "NOT YET",
                Status::Skip => "SKIP",
                Status::Script => "SCRIPT",
            };
            println!("  [{tag}] {what}: {seen}");
        }
        let failed = self.0.iter().filter(|(s, ..)| *s == Status::Fail).count();
        if failed > 0 {
            return Err(format!("{failed} checklist item(s) failed"));
        }
        println!("gpu check: all steps passed");
        Ok(())
    }
}

/// A model of `len` bytes in 16 tensors.
fn model_manifest(len: usize) -> Check<Arc<Manifest>> {
    let mut b = Manifest::builder();
    for i in 0..16 {
        b.push(format!("layer{i}.weight"), DType::U8, &[len / 16]);
    }
    Ok(Arc::new(step("manifest", b.build())?))
}

/// Version `v`'s bytes: every 8-byte word is `v << 40 ^ its index` (cheap to make and to
/// check at 1 GiB, and different in every word from one version to the next).
fn version_bytes(len: usize, v: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for (i, w) in out.chunks_mut(8).enumerate() {
        w.copy_from_slice(&((v << 40) ^ i as u64).to_le_bytes()[..w.len()]);
    }
    out
}

fn version_of(m: &Arc<Manifest>, v: u64) -> Check<WeightSet> {
    let model = step("model id", ModelId::new("policy"))?;
    step(
        "weights",
        WeightSet::from_bytes(
            model,
            Version(v),
            Arc::clone(m),
            &version_bytes(m.total_len(), v),
        ),
    )
}

/// A receiver process of `spec` (this binary with `--link-child`), on CUDA device `device`,
/// that applies every version up to `last`.
fn spawn_link_child(
    spec: &ReceiverSpec,
    token: &ClusterToken,
    device: usize,
    last: u64,
) -> Check<std::process::Child> {
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    Command::new(exe)
        .arg("--link-child")
        .arg(step("spec token", spec.to_token())?)
        .arg(last.to_string())
        .env(refit_node::TOKEN_ENV, token.expose())
        .env(CUDA_DEVICE_ENV, device.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawning a link child: {e}"))
}

/// Waits (up to 300 s) for a link child and prints what it said.
fn finish_child(mut child: std::process::Child) -> Check<String> {
    let end = deadline(300);
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err("link child did not finish within 300 s (killed)".into());
            }
            Err(e) => return Err(format!("waiting for a link child: {e}")),
        }
    };
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut o, &mut out);
    }
    print!("{out}");
    if !status.success() {
        return Err(format!("link child failed ({status})"));
    }
    Ok(out)
}

/// A receiver of any link, in its own process: applies versions until version `last`,
/// checking each one's bytes against [`version_bytes`].
fn link_child(token: &str, last: &str) -> Check<()> {
    let last: u64 = last.parse().map_err(|_| "link child: no last version")?;
    let spec = step("spec", ReceiverSpec::from_token(token))?;
    let transport = step("receiver", spec.receiver(&LinkOptions::default()))?;
    let mut r = step(
        "connect",
        ReceiverInit::new(transport, None).connect(Duration::from_secs(120)),
    )?;
    let policy = step("model id", ModelId::new("policy"))?;
    let mut checked = 0u64;
    let mut check =
        |r: &refit_runtime::Receiver<Box<dyn refit_runtime::ReceiverTransport>>| -> Check<()> {
            let w = r.current(&policy).ok_or("no weights served")?;
            let v = w.version().get();
            compare(
                &format!("link child, version {v}"),
                w.bytes(),
                &version_bytes(w.bytes().len(), v),
            )?;
            checked += 1;
            Ok(())
        };
    check(&r)?;
    while r.version(&policy).get() < last {
        match r.receive(Duration::from_secs(120)) {
            Ok(Some(_)) => check(&r)?,
            Ok(None) => return Err("link child: no version within 120 s".into()),
            Err(e) => return Err(format!("link child: {e}")),
        }
    }
    step("receiver shutdown", r.shutdown())?;
    println!(
        "      {} receiver (another process): {checked} versions applied, every byte as sent",
        spec.transport()
    );
    Ok(())
}

/// Publishes `versions` through `sender` (version 1 connected first); the publish and
/// end-to-end (until acked) medians.
fn publish_versions(
    sender: &mut refit_runtime::Sender<Box<dyn refit_runtime::SenderTransport>>,
    m: &Arc<Manifest>,
    versions: std::ops::RangeInclusive<u64>,
) -> Check<(Duration, Duration)> {
    let (mut publish, mut e2e) = (Vec::new(), Vec::new());
    for v in versions {
        let w = Arc::new(version_of(m, v)?);
        let t0 = Instant::now();
        let pending = step("publish", sender.publish_shared(vec![w]))?;
        let t1 = Instant::now();
        step("acks", sender.wait(&pending, Duration::from_secs(120)))?;
        publish.push(t1 - t0);
        e2e.push(t0.elapsed());
    }
    Ok((median(publish), median(e2e)))
}

/// One run of the cuda-ipc link: medians of the timed versions, and the device memory free
/// before and after them (bytes).
struct IpcRun {
    publish: Duration,
    e2e: Duration,
    free_before: usize,
    free_after: usize,
}

/// Step 7: the cuda-ipc link, its receiver another process on this GPU.
fn ipc_link(checklist: &mut Checklist) -> Check<()> {
    let ctx = open_device(0).map_err(|e| format!("device 0: {e}"))?;
    let token = ClusterToken::random();
    let run = |len: usize, versions: u64| -> Check<IpcRun> {
        let m = model_manifest(len)?;
        let ms = step(
            "manifests",
            Manifests::new([(step("id", ModelId::new("policy"))?, Arc::clone(&m))]),
        )?;
        let options = LinkOptions {
            expected_receivers: 1,
            token: Some(token.clone()),
            device: Some(0),
            ..LinkOptions::default()
        };
        let opened = step("cuda-ipc open", link::open("cuda-ipc", &ms, &options))?;
        let leftovers = opened.leftovers.clone();
        let child = spawn_link_child(&opened.spec, &token, 0, 4 + versions)?;
        let result = (|| -> Check<IpcRun> {
            let mut sender = step(
                "cuda-ipc connect",
                SenderInit::new(opened.sender, ms)
                    .with_ack_timeout(Duration::from_secs(120))
                    .connect(vec![version_of(&m, 1)?], Duration::from_secs(120)),
            )?;
            // warm-up: every slot written once, the child's arenas made
            let _ = publish_versions(&mut sender, &m, 2..=4)?;
            cuda("sync", ctx.synchronize())?;
            let before = cuda("mem info", ctx.mem_get_info())?.0;
            let (publish, e2e) = publish_versions(&mut sender, &m, 5..=4 + versions)?;
            cuda("sync", ctx.synchronize())?;
            let after = cuda("mem info", ctx.mem_get_info())?.0;
            step("shutdown", sender.shutdown())?;
            Ok(IpcRun {
                publish,
                e2e,
                free_before: before,
                free_after: after,
            })
        })();
        OpenedLink::cleanup(&leftovers);
        let out = finish_child(child);
        // the sender's error first: a child left without versions fails after it
        let result = result?;
        if !out?.contains("every byte as sent") {
            return Err("cuda-ipc link child did not confirm its bytes".into());
        }
        Ok(result)
    };
    let IpcRun { publish, e2e, .. } = run(GIB, 4)?;
    let copy = median(step(
        "device copy",
        refit_transports::gpu::device_copy_times(0, GIB, 5),
    )?);
    println!(
        "[7/8] cuda-ipc link, 1 GiB, medians of 4: publish (host to the slot, commit) {:.1} ms, end-to-end (the receiver's copy to host, apply, ack) {:.1} ms ({:.1} GB/s); device-to-device copy {:.2} ms, ratio {:.2}",
        publish.as_secs_f64() * 1e3,
        e2e.as_secs_f64() * 1e3,
        gbps(GIB, e2e),
        copy.as_secs_f64() * 1e3,
        copy.as_secs_f64() / e2e.as_secs_f64()
    );
    checklist.item(
        Status::Pass,
        "cuda-ipc link between two processes on one GPU",
        "versions of 1 GiB applied in another process, every byte compared, slots opened once"
            .into(),
    );
    let tiny = run(64 << 10, 20)?.e2e;
    checklist.item(
        Status::NotYet,
        "IPC hand-over of 1 GiB <= 1 ms after the trainer's write",
        format!(
            "receivers copy each version to host memory until device weight sets exist; the link's own hand-over (commit, wake-up, pin, copy, ack) of a 64 KiB version took {:.0} us (median of 20), 1 GiB end to end {:.1} ms",
            tiny.as_secs_f64() * 1e6,
            e2e.as_secs_f64() * 1e3
        ),
    );
    let IpcRun {
        free_before: before,
        free_after: after,
        ..
    } = run(64 * MIB, 100)?;
    let grown = before.saturating_sub(after);
    println!(
        "      100 cuda-ipc updates of 64 MiB: device memory free {} MiB before, {} MiB after, grew by {} MiB",
        before / MIB,
        after / MIB,
        grown / MIB
    );
    checklist.item(
        if grown <= 2 * MIB {
            Status::Pass
        } else {
            Status::Fail
        },
        "free device memory unchanged over 100 cuda-ipc updates",
        format!(
            "{} MiB free before, {} MiB after",
            before / MIB,
            after / MIB
        ),
    );
    Ok(())
}

/// Step 8: the nccl link with a receiver process on a second GPU.
fn nccl_link(gpus: usize, checklist: &mut Checklist) -> Check<()> {
    const WHAT: &str = "nccl link with a receiver (two GPUs)";
    if gpus < 2 {
        println!("[8/8] nccl link with a receiver: skipped, one GPU cannot hold two NCCL ranks");
        checklist.item(
            Status::Skip,
            WHAT,
            format!("{gpus} GPU here: NCCL refuses two ranks of one communicator on one GPU"),
        );
        return Ok(());
    }
    let token = ClusterToken::random();
    let m = model_manifest(256 * MIB)?;
    let ms = step(
        "manifests",
        Manifests::new([(step("id", ModelId::new("policy"))?, Arc::clone(&m))]),
    )?;
    let options = LinkOptions {
        expected_receivers: 1,
        token: Some(token.clone()),
        device: Some(0),
        ..LinkOptions::default()
    };
    let opened = step("nccl open", link::open("nccl", &ms, &options))?;
    let child = spawn_link_child(&opened.spec, &token, 1, 5)?;
    let result = (|| -> Check<(Duration, Duration)> {
        let mut sender = step(
            "nccl connect",
            SenderInit::new(opened.sender, ms)
                .with_ack_timeout(Duration::from_secs(120))
                .connect(vec![version_of(&m, 1)?], Duration::from_secs(120)),
        )?;
        let out = publish_versions(&mut sender, &m, 2..=5)?;
        step("shutdown", sender.shutdown())?;
        Ok(out)
    })();
    let said = finish_child(child);
    let (_, e2e) = result?;
    if !said?.contains("every byte as sent") {
        return Err("nccl link child did not confirm its bytes".into());
    }
    let copy = median(step(
        "device copy",
        refit_transports::gpu::device_copy_times(0, 256 * MIB, 5),
    )?);
    println!(
        "[8/8] nccl link, 256 MiB to a receiver on GPU 1, medians of 4: end-to-end {:.1} ms ({:.1} GB/s, host to host through both GPUs); device-to-device copy {:.2} ms",
        e2e.as_secs_f64() * 1e3,
        gbps(256 * MIB, e2e),
        copy.as_secs_f64() * 1e3
    );
    checklist.item(
        Status::Pass,
        WHAT,
        "4 versions of 256 MiB, every byte compared in the receiver".into(),
    );
    Ok(())
}

// ANCHOR: connect
/// Rank 0 of a one-rank group: the unique id goes through the store under
/// `refit/coll/gpu-check/{generation}/nccl-id`.
fn connect(store: &StoreClient, generation: u64) -> Check<NcclCommunicator> {
    let membership = step("membership", Membership::new("gpu-check", generation, 0, 1))?;
    step(
        "nccl connect",
        NcclCommunicator::connect(membership, store, NcclOptions::default(), deadline(60)),
    )
}
// ANCHOR_END: connect

fn bucket_broadcast(comm: &mut NcclCommunicator) -> Check<()> {
    let model = pattern(256 * MIB, 1);
    let mut buckets = 0;
    // ANCHOR: buckets
    for (i, bucket) in model.chunks(64 * MIB).enumerate() {
        // Host bytes: staged through pinned memory, broadcast chunk by chunk.
        let mut host = bucket.to_vec();
        step(
            "broadcast_host",
            comm.broadcast_host(&mut host, 0, deadline(30)),
        )?;
        compare(&format!("bucket {i} (host)"), &host, bucket)?;
        // Device bytes: upload, broadcast in place, download.
        let mut dev = step("alloc", comm.alloc(bucket.len()))?;
        step("upload", comm.upload(bucket, &mut dev, deadline(30)))?;
        step(
            "broadcast",
            comm.broadcast(&mut dev, bucket.len(), 0, deadline(30)),
        )?;
        let mut back = vec![0u8; bucket.len()];
        step("download", comm.download(&dev, &mut back, deadline(30)))?;
        compare(&format!("bucket {i} (device)"), &back, bucket)?;
        buckets += 1;
    }
    // ANCHOR_END: buckets
    println!(
        "[3/8] bucket broadcast: {buckets} buckets of 64 MiB, host and device paths, bytes equal"
    );
    Ok(())
}

/// The broadcast transport (prepare per bucket, checksums, acks) over NCCL: one GPU holds
/// one rank, so the trainer is alone in its group; it publishes four versions of a
/// 256 MiB model in 64 MiB buckets and every bucket is counted.
fn broadcast_transport(store: &StoreClient) -> Check<()> {
    let model = step("model id", ModelId::new("policy"))?;
    let mut b = Manifest::builder();
    for i in 0..16 {
        b.push(format!("layer{i}.weight"), DType::F32, &[4 << 20]);
    }
    let m = Arc::new(step("manifest", b.build())?);
    let at = |v: u64| {
        let bytes = (v as f32).to_le_bytes().repeat(m.total_len() / 4);
        WeightSet::from_bytes(model.clone(), Version(v), Arc::clone(&m), &bytes)
    };
    // ANCHOR: transport
    let store: Arc<dyn Rendezvous> = Arc::new(store.clone());
    let mut config = BroadcastConfig::new("gpu-check-weights");
    config.bucket_size = 64 * MIB;
    let transport = step(
        "broadcast sender",
        BroadcastSender::new(NcclOptions::default(), store, config, Vec::new()),
    )?;
    let stats = transport.stats();
    let manifests = step(
        "manifests",
        Manifests::new([(model.clone(), Arc::clone(&m))]),
    )?;
    let wait = Duration::from_secs(60);
    let first = step("version 1", at(1))?;
    let mut sender = step(
        "connect over nccl",
        SenderInit::new(transport, manifests)
            .with_ack_timeout(wait)
            .connect(vec![first], wait),
    )?;
    for v in 2..=4 {
        step("send", sender.send(step("weights", at(v))?))?;
    }
    step("shutdown", sender.shutdown())?;
    // ANCHOR_END: transport
    let plan = step(
        "bucket plan",
        refit_runtime::BucketPlan::compute(&model, &m, &m, 64 * MIB),
    )?;
    let buckets = plan.len() as u64;
    if stats.prepares() != 4 * buckets {
        return Err(format!(
            "broadcast transport: {} prepare messages for 4 versions of {buckets} buckets",
            stats.prepares()
        ));
    }
    println!(
        "[3/8] broadcast transport over nccl: 4 versions of {} MiB, {} prepare messages (one per bucket), {} MiB broadcast",
        m.total_len() / MIB,
        stats.prepares(),
        stats.bytes() / MIB as u64
    );
    Ok(())
}

fn ipc_parent(comm: &NcclCommunicator) -> Check<()> {
    let ctx = comm.context().clone();
    let stream = cuda("stream", ctx.new_stream())?;
    let mut staging = step("staging", PinnedStaging::new(&ctx, DEFAULT_CHUNK))?;
    let seed = 42u64;
    let want = pattern(GIB, seed);
    // ANCHOR: ipc_export
    let exported = step("export alloc", ExportedBuffer::new(&ctx, GIB))?;
    step(
        "fill",
        staging.upload(
            &want,
            step("range", exported.at(0, GIB))?,
            &stream,
            deadline(60),
        ),
    )?;
    let handle = step("ipc handle", exported.handle(1))?;
    let token = step("handle token", refit_runtime::wire::to_token(&handle))?;
    // ANCHOR_END: ipc_export
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let mut child = Command::new(exe)
        .arg("--ipc-child")
        .arg(&token)
        .arg(seed.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawning the ipc child: {e}"))?;
    let end = deadline(180);
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err("ipc child did not finish within 180 s (killed)".into());
            }
            Err(e) => return Err(format!("waiting for the ipc child: {e}")),
        }
    };
    let out = child
        .stdout
        .take()
        .map(|mut o| {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut o, &mut s);
            s
        })
        .unwrap_or_default();
    print!("{out}");
    if !status.success() {
        return Err(format!("ipc child failed ({status})"));
    }
    // The child overwrote the first MiB with the pattern of seed + 1: read it back here.
    let mut head = vec![0u8; MIB];
    step(
        "read back",
        staging.download(
            step("range", exported.at(0, MIB))?,
            &mut head,
            &stream,
            deadline(30),
        ),
    )?;
    compare(
        "ipc write-back from the child",
        &head,
        &pattern(MIB, seed + 1),
    )?;
    println!(
        "[4/8] cuda ipc: 1 GiB exported, opened and compared by another process, its write seen here"
    );
    Ok(())
}

fn ipc_child(token: &str, seed: Option<&String>) -> Check<()> {
    let seed: u64 = seed
        .and_then(|s| s.parse().ok())
        .ok_or("ipc child: missing seed")?;
    let handle: IpcHandle = step("ipc handle token", refit_runtime::wire::from_token(token))?;
    let ctx = open_device(0).map_err(|e| format!("ipc child: {e}"))?;
    let stream = cuda("stream", ctx.new_stream())?;
    let mut staging = step("staging", PinnedStaging::new(&ctx, DEFAULT_CHUNK))?;
    let want = pattern(handle.len, seed);
    let mut imports = IpcImports::new();
    // ANCHOR: ipc_open
    let t = Instant::now();
    let opened = step("ipc open", imports.get(&ctx, &handle))?;
    let mut got = vec![0u8; opened.len()];
    let at = step("range", opened.at(0, got.len()))?;
    step(
        "ipc read",
        staging.download(at, &mut got, &stream, deadline(60)),
    )?;
    let took = t.elapsed();
    // ANCHOR_END: ipc_open
    compare("ipc child read", &got, &want)?;
    // Same generation, same handle: no second open.
    let again = step("ipc open again", imports.get(&ctx, &handle))?;
    let at = step("range", again.at(0, MIB))?;
    let mark = pattern(MIB, seed + 1);
    step(
        "ipc write",
        staging.upload(&mark, at, &stream, deadline(30)),
    )?;
    if imports.opens() != 1 {
        return Err(format!(
            "ipc child: {} opens for one generation",
            imports.opens()
        ));
    }
    imports.close();
    println!(
        "      ipc child: opened once, read {} MiB in {took:?} ({:.1} GB/s incl. staging to host), bytes equal",
        handle.len / MIB,
        gbps(handle.len, took)
    );
    Ok(())
}

fn update_cycles(mut comm: NcclCommunicator, store: &StoreClient) -> Check<NcclCommunicator> {
    let ctx = comm.context().clone();
    let bucket_len = 64 * MIB;
    let cycle = |comm: &mut NcclCommunicator, version: u64| -> Check<()> {
        let want = pattern(bucket_len, version);
        let mut host = want.clone();
        step(
            "cycle broadcast_host",
            comm.broadcast_host(&mut host, 0, deadline(30)),
        )?;
        compare("cycle host bytes", &host, &want)?;
        let mut dev = step("cycle alloc", comm.alloc(bucket_len))?;
        step("cycle upload", comm.upload(&want, &mut dev, deadline(30)))?;
        step(
            "cycle broadcast",
            comm.broadcast(&mut dev, bucket_len, 0, deadline(30)),
        )?;
        let mut back = vec![0u8; bucket_len];
        step(
            "cycle download",
            comm.download(&dev, &mut back, deadline(30)),
        )?;
        compare("cycle device bytes", &back, &want)?;
        let exported = step(
            "cycle export",
            ExportedBuffer::new(comm.context(), 16 * MIB),
        )?;
        step("cycle handle", exported.handle(version))?;
        Ok(())
    };
    // One warm-up cycle, so lazily made NCCL and driver state is not counted as a leak.
    cycle(&mut comm, 1000)?;
    cuda("sync", ctx.synchronize())?;
    let (free_before, total) = cuda("mem info", ctx.mem_get_info())?;
    let mut generation = 1;
    for version in 0..100u64 {
        if version % 10 == 9 {
            // Membership changed: the old communicator goes, a new generation starts.
            drop(comm);
            generation += 1;
            comm = connect(store, generation)?;
        }
        cycle(&mut comm, version)?;
    }
    cuda("sync", ctx.synchronize())?;
    let (free_after, _) = cuda("mem info", ctx.mem_get_info())?;
    let grown = free_before.saturating_sub(free_after);
    println!(
        "[5/8] 100 update cycles ({} generations): device memory free {} MiB before, {} MiB after (of {} MiB), grew by {} MiB",
        generation,
        free_before / MIB,
        free_after / MIB,
        total / MIB,
        grown / MIB
    );
    if grown > 64 * MIB {
        return Err(format!(
            "device memory grew by {} MiB over 100 cycles (leak)",
            grown / MIB
        ));
    }
    Ok(comm)
}

fn bandwidth(mut comm: NcclCommunicator) -> Check<()> {
    let len = GIB;
    let stream = comm.stream().clone();
    let ctx = comm.context().clone();
    let src_host = pattern(len, 7);
    let mut a = step("alloc a", comm.alloc(len))?;
    let mut b = step("alloc b", comm.alloc(len))?;
    step("upload a", comm.upload(&src_host, &mut a, deadline(60)))?;

    let mut d2d = Vec::new();
    let mut nccl = Vec::new();
    for _ in 0..5 {
        d2d.push(device_timed(&stream, || stream.memcpy_dtod(&a, &mut b))?);
        nccl.push(timed(|| {
            let r = comm.broadcast_into(Some(&a), &mut b, len, 0, deadline(60));
            step("nccl broadcast", r)
        })?);
    }
    let mut back = vec![0u8; len];
    step("download b", comm.download(&b, &mut back, deadline(60)))?;
    compare("nccl broadcast_into", &back, &src_host)?;
    let (d2d, nccl) = (median(d2d), median(nccl));
    let ratio = d2d.as_secs_f64() / nccl.as_secs_f64();
    println!(
        "[6/8] bandwidth, 1 GiB, medians of 5: nccl broadcast (one rank, out of place) {:.1} GB/s, device-to-device copy {:.1} GB/s, ratio {ratio:.2} (target >= 0.8: {})",
        gbps(len, nccl),
        gbps(len, d2d),
        if ratio >= 0.8 { "met" } else { "NOT met" }
    );

    // Staged host copies against one plain copy from/to a 1 GiB pinned buffer.
    // SAFETY: the pinned buffer is written by `copy_from_slice` before any read.
    let mut pinned = cuda("pinned 1 GiB", unsafe {
        ctx.alloc_pinned_with_flags::<u8>(len, 0)
    })?;
    cuda("pinned view", pinned.as_mut_slice())?.copy_from_slice(&src_host);
    let (mut h2d, mut up, mut d2h, mut down) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let s = &stream;
    for _ in 0..5 {
        h2d.push(device_timed(s, || s.memcpy_htod(&pinned, &mut a))?);
        up.push(timed(|| {
            step("upload", comm.upload(&src_host, &mut a, deadline(60)))
        })?);
        d2h.push(device_timed(s, || s.memcpy_dtoh(&a, &mut pinned))?);
        down.push(timed(|| {
            step("download", comm.download(&a, &mut back, deadline(60)))
        })?);
    }
    compare("staged download", &back, &src_host)?;
    let (h2d, up, d2h, down) = (median(h2d), median(up), median(d2h), median(down));
    println!(
        "      staged upload {:.1} GB/s vs pinned host-to-device {:.1} GB/s (ratio {:.2}); staged download {:.1} GB/s vs pinned device-to-host {:.1} GB/s (ratio {:.2})",
        gbps(len, up),
        gbps(len, h2d),
        h2d.as_secs_f64() / up.as_secs_f64(),
        gbps(len, down),
        gbps(len, d2h),
        d2h.as_secs_f64() / down.as_secs_f64()
    );
    // The host side's own limit, in this run: one thread's memcpy of 1 GiB and the split copy
    // the staging uses, both between pageable buffers already touched.
    let (mut one, mut split) = (Vec::new(), Vec::new());
    let threads = refit_runtime::copy::copy_threads();
    for _ in 0..5 {
        one.push(timed(|| {
            back.copy_from_slice(&src_host);
            Ok(())
        })?);
        split.push(timed(|| {
            refit_runtime::copy::copy_parallel(&mut back, &src_host, threads);
            Ok(())
        })?);
    }
    println!(
        "      host memcpy 1 GiB: one thread {:.1} GB/s, {threads} threads {:.1} GB/s",
        gbps(len, median(one)),
        gbps(len, median(split))
    );
    // Host memory registered in place (page-locked without a copy): what registering 1 GiB
    // costs once, and a copy straight from it, against the staged upload above.
    let mut reg = src_host.clone();
    let t = Instant::now();
    // SAFETY: `reg` is neither moved, resized nor dropped until it is unregistered below, and
    // every copy from it has completed (`device_timed` synchronizes the stream) by then.
    let registered =
        unsafe { cudarc::driver::sys::cuMemHostRegister_v2(reg.as_mut_ptr().cast(), len, 0) };
    cuda("registering 1 GiB", registered.result())?;
    let register = t.elapsed();
    let mut direct = Vec::new();
    for _ in 0..5 {
        direct.push(device_timed(s, || s.memcpy_htod(&reg, &mut a))?);
    }
    // SAFETY: `reg` was registered above and no copy from it is in flight.
    let unregistered = unsafe { cudarc::driver::sys::cuMemHostUnregister(reg.as_mut_ptr().cast()) };
    cuda("unregistering", unregistered.result())?;
    println!(
        "      registered host memory: registering 1 GiB took {:.0} ms, then host-to-device from it {:.1} GB/s",
        register.as_secs_f64() * 1e3,
        gbps(len, median(direct))
    );
    let mut host = src_host.clone();
    let t = Instant::now();
    step(
        "broadcast_host 1 GiB",
        comm.broadcast_host(&mut host, 0, deadline(60)),
    )?;
    println!(
        "      broadcast_host of 1 GiB (root, pinned pipeline): {:.1} GB/s",
        gbps(len, t.elapsed())
    );
    Ok(())
}
