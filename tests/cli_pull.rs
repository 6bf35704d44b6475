//! `refit serve` and `refit pull` as a user runs them: real processes, a real safetensors file
//! served over TCP and pulled into another one (received straight into the output file).
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit::runtime::{DType, Manifest, ModelId, Version, WeightSet};

const BUCKET: usize = 1 << 20;

/// Kills the serving process when the test ends, whatever happens.
struct Serving(Child);

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn weights(m: Manifest, seed: u64) -> WeightSet {
    let mut ws = WeightSet::zeroed(ModelId::new("policy").unwrap(), Arc::new(m));
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in ws.bytes_mut().unwrap().iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    ws.set_version(Version(1));
    ws
}

/// Serves `ws` with 1 MiB buckets, pulls it with `refit pull`, and checks every tensor of the
/// file it wrote is bit-identical.
fn serve_and_pull(ws: &WeightSet, dir: &Path) {
    let model = dir.join("model.safetensors");
    let spec = dir.join("spec");
    let out = dir.join("out.safetensors");
    ws.write_safetensors(&model).unwrap();
    let token = "0123456789abcdef0123456789abcdef";
    let _serving = Serving(
        Command::new(env!("CARGO_BIN_EXE_refit"))
            .arg("serve")
            .arg(&model)
            .args(["--bucket-size", "1MiB", "--for-s", "120", "--spec-file"])
            .arg(&spec)
            .env("REFIT_TOKEN", token)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    while !spec.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "refit serve wrote no spec"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pulled = Command::new(env!("CARGO_BIN_EXE_refit"))
        .arg("pull")
        .arg("--spec-file")
        .arg(&spec)
        .arg(&out)
        .args(["--timeout-s", "60"])
        .env("REFIT_TOKEN", token)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&pulled.stderr);
    assert!(pulled.status.success(), "{stderr}");
    assert!(stderr.contains("pulled `policy` version 1"), "{stderr}");
    let back = WeightSet::read_safetensors(&out, None).unwrap();
    assert_eq!(back.version(), Version(1));
    assert_eq!(**back.manifest(), **ws.manifest());
    for (a, b) in ws.tensors().zip(back.tensors()) {
        assert!(a.bytes() == b.bytes(), "tensor {} differs", a.name());
    }
    // nothing but the three files is left in the directory (no temporary file)
    assert_eq!(std::fs::read_dir(dir).unwrap().count(), 3);
}

#[test]
fn a_pull_of_tensors_four_times_the_bucket_size_is_bit_identical() {
    let mut b = Manifest::builder();
    for i in 0..4 {
        b.push(format!("layer{i}.weight"), DType::F32, &[BUCKET]);
    }
    let dir = tempfile::tempdir().unwrap();
    serve_and_pull(&weights(b.build().unwrap(), 1), dir.path());
}

#[cfg(target_os = "linux")]
#[test]
fn a_pull_into_memory_backed_files_is_received_into_the_map_bit_identical() {
    // /dev/shm is tmpfs: the pull maps its file and reads the socket straight into it
    // (huge pages where the kernel gives them, positioned writes where it does not)
    let mut b = Manifest::builder();
    for i in 0..4 {
        b.push(format!("layer{i}.weight"), DType::F32, &[BUCKET + 16 * i]);
    }
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    serve_and_pull(&weights(b.build().unwrap(), 3), dir.path());
}

#[test]
fn a_pull_of_tensors_the_arena_pads_apart_is_bit_identical() {
    // odd sizes: the arena pads each tensor to 64 bytes, the file packs them together
    let m = Manifest::builder()
        .tensor("embed.weight", DType::BF16, &[1000, 3])
        .tensor("huge.weight", DType::F32, &[3 * BUCKET / 4 + 5])
        .tensor("mask", DType::Bool, &[7])
        .tensor("head.weight", DType::F32, &[300, 301])
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    serve_and_pull(&weights(m, 2), dir.path());
}
