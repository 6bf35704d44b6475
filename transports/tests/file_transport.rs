//! The file transport beyond the scheme suite: damaged files are refused naming them, held
//! versions stay whole and on disk, a writer aborted mid-write names no partial version,
//! and Python's `safetensors` reads the files with the bytes Refit wrote.
//!
//! The crash test re-runs this test binary as the writer (`REFIT_CHILD_ROLE`), a real
//! process that aborts in the middle of writing a version.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use refit_runtime::{Error, ReceiverInit, SenderInit, Version, WeightSet};
use refit_transports::file::{FileConfig, FileReceiver, FileSender, FileVersion, POINTER};

const ROLE: &str = "REFIT_CHILD_ROLE";
const DIR: &str = "REFIT_CHILD_DIR";
const T: Duration = Duration::from_secs(20);

/// Entry point of the child process; a no-op in a normal test run.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    if role == "busy-writer" {
        // publishes ever newer versions until killed
        let m = manifest(64 * 1024);
        let ms = manifests(&[("policy", &m)]);
        let s = FileSender::create(&FileConfig::new(&dir)).unwrap();
        let mut sender = SenderInit::new(s, ms)
            .connect(vec![stamped("policy", &m, 1)], T)
            .unwrap();
        for v in 2.. {
            sender.send(stamped("policy", &m, v)).unwrap();
        }
    }
    assert_eq!(role, "crash-writer");
    let m = manifest(4096);
    let ms = manifests(&[("policy", &m)]);
    let s = FileSender::create(&FileConfig::new(&dir)).unwrap();
    let mut sender = SenderInit::new(s, ms)
        .connect(vec![stamped("policy", &m, 1)], T)
        .unwrap();
    sender.send(stamped("policy", &m, 2)).unwrap();
    sender
        .transport_mut()
        .crash_mid_write(&stamped("policy", &m, 3));
}

/// Names of the entries of `dir`.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// A file sender and a receiver attached to it.
type Ends = (
    refit_runtime::Sender<FileSender>,
    refit_runtime::Receiver<FileReceiver>,
);

fn connect_one(cfg: &FileConfig, m: &std::sync::Arc<refit_runtime::Manifest>) -> Ends {
    let ms = manifests(&[("policy", m)]);
    let s = FileSender::create(cfg).unwrap();
    let r = FileReceiver::new(s.receiver_spec());
    let h = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T));
    let sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![stamped("policy", m, 1)], T)
        .unwrap();
    (sender, h.join().unwrap().unwrap())
}

/// A sender keeping one version on disk and one receiver attached, in `dir`.
fn connect_keep_one(dir: &Path, m: &std::sync::Arc<refit_runtime::Manifest>) -> Ends {
    let cfg = FileConfig {
        keep: 1,
        expected_receivers: 1,
        ..FileConfig::new(dir)
    };
    connect_one(&cfg, m)
}

/// Publishes version `v` of `policy`, has `r` receive it and waits for its acknowledgement.
fn publish_received(
    sender: &mut refit_runtime::Sender<FileSender>,
    r: &mut refit_runtime::Receiver<FileReceiver>,
    m: &std::sync::Arc<refit_runtime::Manifest>,
    v: u64,
) {
    let pending = sender.send_async(vec![stamped("policy", m, v)]).unwrap();
    r.receive(T).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
}

/// Publishes version `v` of `policy` with one byte inside `head.weight` flipped on disk
/// after the publish; `r` refuses it, naming the file and the tensor, and still serves
/// `served`.
fn refused_with_a_flipped_byte(
    sender: &mut refit_runtime::Sender<FileSender>,
    r: &mut refit_runtime::Receiver<FileReceiver>,
    m: &std::sync::Arc<refit_runtime::Manifest>,
    v: u64,
    served: Version,
) {
    use std::os::unix::fs::FileExt;
    let p = id("policy");
    let _pending = sender.send_async(vec![stamped("policy", m, v)]).unwrap();
    let path = sender.transport().version_path(&p, Version(v));
    let bytes = std::fs::read(&path).unwrap();
    let layout = refit_runtime::inspect_safetensors(&bytes, "file", None, true).unwrap();
    let at = layout.ranges[layout.manifest.position("head.weight").unwrap()].start + 5;
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[bytes[at] ^ 0x08], at as u64).unwrap();
    let err = r.receive(T).unwrap_err().to_string();
    let name = format!("policy.v{v}.safetensors");
    assert!(
        err.contains(&name) && err.contains("tensor `head.weight`: checksum"),
        "{err}"
    );
    assert_eq!(r.version(&p), served);
    check_stamp(&r.current(&p).unwrap()).unwrap();
}

#[test]
fn an_update_with_one_bad_file_is_refused_whole_and_never_lands_in_part() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(64);
    let ms = manifests(&[("policy", &m), ("critic", &m)]);
    let s = FileSender::create(&FileConfig {
        expected_receivers: 1,
        ..FileConfig::new(dir.path())
    })
    .unwrap();
    let r = FileReceiver::new(s.receiver_spec());
    let h = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T));
    let mut sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![stamped("policy", &m, 1), stamped("critic", &m, 1)], T)
        .unwrap();
    let mut r = h.join().unwrap().unwrap();
    let (p, c) = (id("policy"), id("critic"));

    // one update of both models; the critic's file is truncated after it was published
    let _pending = sender
        .send_async(vec![stamped("policy", &m, 2), stamped("critic", &m, 2)])
        .unwrap();
    let bad = sender.transport().version_path(&c, Version(2));
    let len = std::fs::metadata(&bad).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&bad)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let err = r.receive(T).unwrap_err();
    assert!(err.to_string().contains("critic.v2.safetensors"), "{err}");
    // the policy's good half of the update is not offered on its own later
    assert!(r.receive(Duration::from_millis(100)).unwrap().is_none());
    assert_eq!(r.version(&p), Version(1));
    assert_eq!(r.version(&c), Version(1));

    // the next whole update lands, both models together
    let pending = sender
        .send_async(vec![stamped("policy", &m, 3), stamped("critic", &m, 3)])
        .unwrap();
    let u = r.receive(T).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    assert_eq!(u.group.len(), 2);
    assert_eq!((r.version(&p), r.version(&c)), (Version(3), Version(3)));
    sender.shutdown().unwrap();
}

#[test]
fn truncated_or_corrupted_files_are_refused_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(64);
    let cfg = FileConfig {
        expected_receivers: 1,
        ..FileConfig::new(dir.path())
    };
    let (mut sender, mut r) = connect_one(&cfg, &m);
    let p = id("policy");

    // version 2 is truncated on disk after it was published
    let _pending = sender.send_async(vec![stamped("policy", &m, 2)]).unwrap();
    let v2 = sender.transport().version_path(&p, Version(2));
    let len = std::fs::metadata(&v2).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&v2)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let err = r.receive(T).unwrap_err();
    assert!(matches!(err, Error::Safetensors { .. }), "{err}");
    assert!(err.to_string().contains("policy.v2.safetensors"), "{err}");
    assert_eq!(r.version(&p), Version(1));
    check_stamp(&r.current(&p).unwrap()).unwrap();
    // the refused version is not offered again
    assert!(r.receive(Duration::from_millis(50)).unwrap().is_none());

    // version 3 has one flipped byte inside `head.weight`
    refused_with_a_flipped_byte(&mut sender, &mut r, &m, 3, Version(1));

    // a good version goes through
    let pending = sender.send_async(vec![stamped("policy", &m, 4)]).unwrap();
    let u = r.receive(T).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    check_stamp(&u.group[0]).unwrap();
    assert_eq!(r.version(&p), Version(4));
    sender.shutdown().unwrap();
}

#[test]
fn a_held_version_stays_whole_and_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(256);
    let (mut sender, mut r) = connect_keep_one(dir.path(), &m);
    let p = id("policy");
    // a reader maps the newest version (1) and holds it
    let held = FileVersion::open_newest(dir.path(), &p, T).unwrap();
    assert_eq!(held.version(), Version(1));
    let v1 = sender.transport().version_path(&p, Version(1));
    let read_whole = |v: &FileVersion, stamp: f32| {
        for t in ["fc1.weight", "fc1.bias", "head.weight"] {
            let b = v.tensor(t).unwrap();
            assert!(
                b.chunks_exact(4)
                    .all(|c| f32::from_le_bytes(c.try_into().unwrap()) == stamp),
                "tensor {t} of the held version changed"
            );
        }
    };
    // the writer publishes 2..=6 while the reader keeps reading version 1
    for v in 2..=6u64 {
        publish_received(&mut sender, &mut r, &m, v);
        read_whole(&held, 1.0);
        assert!(v1.exists(), "held version removed after publishing {v}");
    }
    assert_eq!(held.to_weights().unwrap().version(), Version(1));
    check_stamp(&held.to_weights().unwrap()).unwrap();
    // the versions nobody held were collected; keep = 1 leaves the newest only
    for v in 2..=5 {
        assert!(!sender.transport().version_path(&p, Version(v)).exists());
    }
    drop(held);
    publish_received(&mut sender, &mut r, &m, 7);
    assert!(!v1.exists(), "released version not collected");
    let versions: Vec<String> = names(dir.path())
        .into_iter()
        .filter(|n| n.starts_with("policy.v"))
        .collect();
    assert_eq!(versions, vec!["policy.v7.safetensors".to_string()]);
    // the symlink names the newest
    let newest = WeightSet::read_safetensors(sender.transport().newest_path(&p), None).unwrap();
    assert_eq!(newest.version(), Version(7));
    sender.shutdown().unwrap();
}

#[test]
fn a_writer_aborted_mid_write_names_no_partial_version() {
    let dir = tempfile::tempdir().unwrap();
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, "crash-writer")
        .env(DIR, dir.path())
        .status()
        .unwrap();
    assert!(!status.success(), "the writer was meant to abort");
    let files = names(dir.path());
    // the aborted write left its temporary file (half a version) and nothing named v3
    let tmp: Vec<&String> = files
        .iter()
        .filter(|n| n.starts_with(".policy.v3.safetensors.tmp-"))
        .collect();
    assert_eq!(tmp.len(), 1, "{files:?}");
    assert!(
        !files.iter().any(|n| n == "policy.v3.safetensors"),
        "{files:?}"
    );
    // every named version is whole and verifies; the pointer names version 2
    for n in files.iter().filter(|n| n.starts_with("policy.v")) {
        let v = FileVersion::open(dir.path().join(n), T).unwrap();
        check_stamp(&v.to_weights().unwrap()).unwrap();
    }
    let pointer = std::fs::read_to_string(dir.path().join(POINTER)).unwrap();
    assert!(pointer.contains("policy.v2.safetensors"), "{pointer}");
    // a receiver gets the last whole version, then learns the writer is dead
    let p = id("policy");
    let spec = refit_transports::file::FileReceiverSpec {
        dir: dir.path().to_path_buf(),
    };
    let mut r = ReceiverInit::new(FileReceiver::new(spec), None)
        .connect(T)
        .unwrap();
    assert_eq!(r.version(&p), Version(2));
    check_stamp(&r.current(&p).unwrap()).unwrap();
    let err = r.receive(T).unwrap_err();
    assert!(matches!(err, Error::PeerGone { .. }), "{err}");
    drop(r);
    // the next writer in the directory removes the dead writer's temporary file
    let _next = FileSender::create(&FileConfig::new(dir.path())).unwrap();
    assert!(!dir.path().join(tmp[0]).exists());
}

/// Captures the phase samples recorded on this thread.
#[derive(Default)]
struct Capture(std::sync::Mutex<Vec<String>>);
impl metrics::Recorder for Capture {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        self.0
            .lock()
            .unwrap()
            .push(format!("{} {}", key.name(), labels.join(",")));
        metrics::Histogram::noop()
    }
}

#[test]
fn every_phase_of_a_file_update_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(16);
    let cfg = FileConfig {
        expected_receivers: 1,
        ..FileConfig::new(dir.path())
    };
    let (mut sender, mut r) = connect_one(&cfg, &m);
    let cap = Capture::default();
    metrics::with_local_recorder(&cap, || {
        let pending = sender.send_async(vec![stamped("policy", &m, 2)]).unwrap();
        r.receive(T).unwrap().unwrap();
        sender.wait(&pending, T).unwrap();
    });
    let seen = cap.0.lock().unwrap().clone();
    for phase in ["assemble", "verify", "wire", "apply"] {
        let want = format!(
            "{} phase={phase},model=policy,transport=file",
            refit_runtime::metrics::PHASE_SECONDS
        );
        assert_eq!(
            seen.iter().filter(|s| **s == want).count(),
            1,
            "{want} in {seen:?}"
        );
    }
    sender.shutdown().unwrap();
}

#[test]
fn a_writer_killed_at_any_moment_leaves_only_whole_versions() {
    for round in 0..3u64 {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, "busy-writer")
            .env(DIR, dir.path())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // let it publish a few versions, then SIGKILL it wherever it is
        let t = std::time::Instant::now();
        while !std::fs::read_to_string(dir.path().join(POINTER))
            .is_ok_and(|p| !p.contains("policy.v1.") && !p.contains("policy.v2."))
        {
            assert!(t.elapsed() < T, "the writer published nothing");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(7 * round));
        child.kill().unwrap();
        child.wait().unwrap();
        // every named version is whole, and the pointer names one of them
        let files = names(dir.path());
        let named: Vec<&String> = files.iter().filter(|n| n.starts_with("policy.v")).collect();
        assert!(!named.is_empty(), "{files:?}");
        for n in &named {
            let v = FileVersion::open(dir.path().join(n), T)
                .unwrap_or_else(|e| panic!("round {round}: {n} is not whole: {e}"));
            check_stamp(&v.to_weights().unwrap()).unwrap();
        }
        let newest = FileVersion::open_newest(dir.path(), &id("policy"), T).unwrap();
        check_stamp(&newest.to_weights().unwrap()).unwrap();
    }
}

#[test]
fn two_senders_cannot_share_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let _a = FileSender::create(&FileConfig::new(dir.path())).unwrap();
    let err = FileSender::create(&FileConfig::new(dir.path())).unwrap_err();
    assert!(err.to_string().contains("another sender"), "{err}");
}

const PY_CHECK: &str = r#"
import json, os, sys
from safetensors import safe_open
path, out = sys.argv[1], sys.argv[2]
with safe_open(path, framework="numpy") as f:
    meta = f.metadata()
    names = list(f.keys())
    for name in names:
        with open(os.path.join(out, name + ".bin"), "wb") as w:
            w.write(f.get_tensor(name).tobytes())
print(json.dumps({"version": meta["refit.version"], "model": meta["refit.model"], "names": sorted(names)}))
"#;

/// Python's `safetensors` (with numpy) reads the newest file through the symlink, and every
/// tensor's bytes equal the ones Refit wrote. Where Python or the packages are missing the
/// test says so loudly; under CI (`CI` set) it fails instead.
#[test]
fn python_safetensors_reads_the_published_bytes() {
    let probe = Command::new("python3")
        .args(["-c", "import safetensors, numpy"])
        .output();
    let ok = matches!(&probe, Ok(o) if o.status.success());
    if !ok {
        let why = match &probe {
            Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
            Err(e) => e.to_string(),
        };
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run this test: `python3 -c 'import safetensors, numpy'` failed: {why}"
        );
        eprintln!(
            "\n!!! NOT CHECKED: python_safetensors_reads_the_published_bytes needs python3 with \
             `safetensors` and `numpy` (pip install safetensors numpy): {why}\n"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(300);
    let ms = manifests(&[("policy", &m)]);
    let s = FileSender::create(&FileConfig::new(dir.path().join("weights"))).unwrap();
    let newest = s.newest_path(&id("policy"));
    let mut sender = SenderInit::new(s, ms)
        .connect(vec![random_set(&m, 1, 11)], T)
        .unwrap();
    let ws = random_set(&m, 3, 77);
    sender.send(ws.clone()).unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let run = Command::new("python3")
        .args(["-c", PY_CHECK])
        .arg(&newest)
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report = String::from_utf8_lossy(&run.stdout);
    assert!(report.contains(r#""version": "3""#), "{report}");
    assert!(report.contains(r#""model": "policy""#), "{report}");
    for t in ws.tensors() {
        let py = std::fs::read(out.join(format!("{}.bin", t.name()))).unwrap();
        assert_eq!(py, t.bytes(), "tensor {} differs in python", t.name());
    }
    assert_eq!(
        std::fs::read_dir(&out).unwrap().count(),
        ws.manifest().len(),
        "python saw other tensors than refit wrote"
    );
    sender.shutdown().unwrap();
}

/// The path of the file mapped at `addr` in this process (from `/proc/self/maps`).
#[cfg(target_os = "linux")]
fn mapped_file_at(addr: usize) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (lo, hi) = fields.next()?.split_once('-')?;
        let (lo, hi) = (
            usize::from_str_radix(lo, 16).ok()?,
            usize::from_str_radix(hi, 16).ok()?,
        );
        (lo <= addr && addr < hi).then(|| fields.nth(4).unwrap_or_default().to_string())
    })
}

#[cfg(target_os = "linux")]
#[test]
fn a_version_is_served_from_its_files_map_and_a_corrupted_one_is_still_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(64);
    let (mut sender, mut r) = connect_keep_one(dir.path(), &m);
    let p = id("policy");
    let pending = sender.send_async(vec![stamped("policy", &m, 2)]).unwrap();
    let held = r.receive(T).unwrap().unwrap().group[0].clone();
    sender.wait(&pending, T).unwrap();
    check_stamp(&held).unwrap();
    let v2 = sender.transport().version_path(&p, Version(2));

    // no copy: every tensor's bytes lie in a read-only map of the version file, at the
    // place the file's header gives them
    let file = std::fs::read(&v2).unwrap();
    let layout = refit_runtime::inspect_safetensors(&file, "v2", None, true).unwrap();
    let base = held.bytes().as_ptr() as usize;
    let mapped = mapped_file_at(base).unwrap_or_default();
    assert!(mapped.ends_with("policy.v2.safetensors"), "{mapped:?}");
    let start = layout.ranges[0].start - m.tensors()[0].offset;
    for (t, r) in held.tensors().zip(&layout.ranges) {
        assert_eq!(
            t.bytes().as_ptr() as usize - base + start,
            r.start,
            "{}",
            t.name()
        );
        assert_eq!(t.bytes(), &file[r.clone()]);
    }
    assert!(held.is_shared(), "a mapped version belongs to its map");

    // held by the application, the version stays on disk and whole while newer ones come
    // and go (keep = 1)
    for v in 3..=5u64 {
        publish_received(&mut sender, &mut r, &m, v);
        assert!(v2.exists(), "served version removed after publishing {v}");
        check_stamp(&held).unwrap();
    }
    assert!(!sender.transport().version_path(&p, Version(3)).exists());

    // a byte flipped in place inside `head.weight` of version 6 is still refused, naming
    // the file and the tensor, and version 5 stays served
    refused_with_a_flipped_byte(&mut sender, &mut r, &m, 6, Version(5));

    // once the application lets go, the version is collected
    drop(held);
    publish_received(&mut sender, &mut r, &m, 7);
    assert!(!v2.exists(), "released version not collected");
    sender.shutdown().unwrap();
}
