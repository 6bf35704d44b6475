//! A new user's first hour: every wrong input to `refit serve`, `refit pull`, `refit status`
//! and `refit bench` is answered with one line in the user's words (`refit: error: ...`),
//! exit code 1, no panic and no Debug form; inputs are checked before the cluster token is
//! asked for. And a Hugging Face model folder (an index and two shards, what `vllm serve`
//! takes) is served as one model and pulled bit for bit.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use refit::runtime::WeightSet;
use refit::transports::tcp::TcpEndpoint;
use safetensors::Dtype;

const TOKEN: &str = "first-hour-token-0123456789abcdef";

/// The `refit` binary with no token in its environment.
fn refit() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_refit"));
    c.env_remove("REFIT_TOKEN")
        .env_remove("REFIT_TOKEN_FILE")
        .env_remove("REFIT_METRICS_ADDR")
        .env("NO_COLOR", "1");
    c
}

/// Asserts that `out` failed with exit code 1 and said exactly one line on stderr, the
/// error, containing `says`; no panic, no Debug form of an error.
fn refused(out: &Output, says: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(out.status.code(), Some(1), "exit code of: {stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Error: "),
        "{stderr}"
    );
    assert_eq!(lines.len(), 1, "one line, not: {stderr}");
    assert!(lines[0].starts_with("refit: error: "), "{stderr}");
    assert!(lines[0].contains(says), "`{says}` not in: {stderr}");
}

/// The bytes of a safetensors file holding `tensors` (name, dtype, shape, bytes), written by
/// the `safetensors` crate as any Python or Rust writer would.
fn safetensors_bytes(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap();
            ((*name).to_owned(), view)
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// A pattern of `n` bytes, different for each `seed`.
fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A small good model file.
fn write_model(path: &Path) {
    std::fs::write(
        path,
        safetensors_bytes(&[("w", Dtype::F32, vec![64], pattern(256, 1))]),
    )
    .unwrap();
}

/// The tensors of the Hugging Face folder: (shard, name, dtype, shape, bytes).
type Tensors = Vec<(&'static str, &'static str, Dtype, Vec<usize>, Vec<u8>)>;

const SHARD1: &str = "model-00001-of-00002.safetensors";
const SHARD2: &str = "model-00002-of-00002.safetensors";

/// A Hugging Face model folder: `model.safetensors.index.json` and two shards.
fn hf_folder(dir: &Path) -> Tensors {
    let tensors: Tensors = vec![
        (
            SHARD1,
            "model.embed_tokens.weight",
            Dtype::F32,
            vec![16, 8],
            pattern(512, 3),
        ),
        (
            SHARD1,
            "model.layers.0.self_attn.q_proj.weight",
            Dtype::BF16,
            vec![8, 8],
            pattern(128, 5),
        ),
        (
            SHARD2,
            "model.layers.0.mlp.up_proj.weight",
            Dtype::BF16,
            vec![16, 8],
            pattern(256, 7),
        ),
        (
            SHARD2,
            "lm_head.weight",
            Dtype::F32,
            vec![16, 8],
            pattern(512, 11),
        ),
    ];
    let mut map = Vec::new();
    for shard in [SHARD1, SHARD2] {
        let part: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .filter(|t| t.0 == shard)
            .map(|t| (t.1, t.2, t.3.clone(), t.4.clone()))
            .collect();
        std::fs::write(dir.join(shard), safetensors_bytes(&part)).unwrap();
        map.extend(part.iter().map(|t| format!("\"{}\": \"{shard}\"", t.0)));
    }
    let index = format!(
        "{{\"metadata\": {{\"total_size\": 1408}}, \"weight_map\": {{{}}}}}",
        map.join(", ")
    );
    std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
    tensors
}

/// A spec in `refit serve`'s form whose sender is gone (port 9 of loopback): a pull given
/// it has good inputs, and gets as far as the token.
fn dead_spec() -> String {
    let node = refit::node::Node::loopback(refit::node::ClusterToken::random()).unwrap();
    let endpoint = TcpEndpoint {
        addr: "127.0.0.1:9".parse().unwrap(),
        agent: node.id(),
    };
    node.shutdown();
    refit::runtime::wire::to_token(&endpoint).unwrap()
}

/// Kills the serving process when the test ends, whatever happens.
struct Serving(Child);

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_missing_file_is_told_before_any_token_is_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let out = refit()
        .args(["serve", "missing.safetensors"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    refused(&out, "`missing.safetensors`: No such file or directory");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("token"), "{stderr}");
    // pull: its output folder, and its spec, before the token
    let out = refit()
        .args([
            "pull",
            "no/such/folder/out.safetensors",
            "--spec",
            &dead_spec(),
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    refused(
        &out,
        "cannot write `no/such/folder/out.safetensors`: its folder `no/such/folder` does not exist",
    );
}

#[test]
fn a_file_that_is_not_safetensors_says_so() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("notes.txt"),
        "these are notes, not weights\n",
    )
    .unwrap();
    let out = refit()
        .args(["serve", "notes.txt"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    refused(&out, "notes.txt: not a safetensors file (");
}

#[test]
fn a_truncated_file_names_the_bytes_promised_and_present() {
    let dir = tempfile::tempdir().unwrap();
    let good = safetensors_bytes(&[("w", Dtype::F32, vec![256], pattern(1024, 2))]);
    let cut = &good[..good.len() - 300];
    std::fs::write(dir.path().join("cut.safetensors"), cut).unwrap();
    let out = refit()
        .args(["serve", "cut.safetensors"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    refused(
        &out,
        &format!(
            "cut.safetensors: truncated: header promises {} bytes, file has {}",
            good.len(),
            cut.len()
        ),
    );
}

#[test]
fn a_hugging_face_folder_is_served_as_one_model_and_pulled_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    let tensors = hf_folder(&hf);
    let spec = dir.path().join("spec");
    let out = dir.path().join("out.safetensors");
    let serving = Serving(
        refit()
            .arg("serve")
            .arg(&hf)
            .args(["--for-s", "120", "--spec-file"])
            .arg(&spec)
            .env("REFIT_TOKEN", TOKEN)
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
    let pulled = refit()
        .arg("pull")
        .arg(&out)
        .arg("--spec-file")
        .arg(&spec)
        .args(["--timeout-s", "60"])
        .env("REFIT_TOKEN", TOKEN)
        .output()
        .unwrap();
    drop(serving);
    let stderr = String::from_utf8_lossy(&pulled.stderr);
    assert!(pulled.status.success(), "{stderr}");
    assert!(stderr.contains("pulled `policy` version 1"), "{stderr}");
    let back = WeightSet::read_safetensors(&out, None).unwrap();
    assert_eq!(back.manifest().len(), tensors.len());
    for (_, name, dtype, shape, bytes) in &tensors {
        let t = back.tensor(name).unwrap();
        assert_eq!(t.shape(), shape.as_slice(), "{name}");
        assert_eq!(t.dtype().to_safetensors(), *dtype, "{name}");
        assert!(t.bytes() == bytes.as_slice(), "tensor {name} differs");
    }
    // the first shard's tensors come first: the order is the shards', then each file's
    let first: Vec<&str> = back.manifest().tensors()[..2]
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert!(
        first.contains(&"model.embed_tokens.weight")
            && first.contains(&"model.layers.0.self_attn.q_proj.weight"),
        "{first:?}"
    );
    // --watch follows one file: a folder is refused with it
    let out = refit()
        .arg("serve")
        .arg(&hf)
        .arg("--watch")
        .output()
        .unwrap();
    refused(&out, "--watch follows one file");
}

#[test]
fn a_folder_whose_index_names_a_missing_shard_names_it() {
    let dir = tempfile::tempdir().unwrap();
    hf_folder(dir.path());
    std::fs::remove_file(dir.path().join(SHARD2)).unwrap();
    let out = refit().arg("serve").arg(dir.path()).output().unwrap();
    refused(
        &out,
        &format!(
            "shard `{SHARD2}` (holding tensor `lm_head.weight` and 1 more) is missing from \
             the folder"
        ),
    );
    // a folder that is no model at all
    let empty = tempfile::tempdir().unwrap();
    let out = refit().arg("serve").arg(empty.path()).output().unwrap();
    refused(
        &out,
        "a folder holding neither model.safetensors.index.json nor model.safetensors",
    );
}

#[test]
fn an_address_given_as_a_spec_is_told_what_a_spec_is() {
    let dir = tempfile::tempdir().unwrap();
    let out = refit()
        .args(["pull", "out.safetensors", "--spec", "127.0.0.1:29611"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    refused(
        &out,
        "`127.0.0.1:29611` is an address, not a spec: a spec is the line `refit serve` prints \
         after `spec:` (or writes with --spec-file); give it with --spec or --spec-file",
    );
    // any other text: never called a token
    let out = refit()
        .args(["pull", "out.safetensors", "--spec", "hello"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    refused(&out, "`hello` is not a spec (");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("token"));
}

#[test]
fn links_that_cannot_serve_another_process_or_lack_their_count_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_model(&dir.path().join("m.safetensors"));
    let out = refit()
        .args(["serve", "m.safetensors", "--link", "inproc"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    refused(
        &out,
        "--link inproc reaches only the serving process, so no receiver could use its spec; \
         links that serve other processes: ",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tcp (the network)") && stderr.contains("shm (one host)"),
        "{stderr}"
    );
    let out = refit()
        .args(["serve", "m.safetensors", "--link", "broadcast"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    refused(
        &out,
        "--link broadcast needs --receivers N (the chain's length)",
    );
}

#[test]
fn bad_tokens_say_what_a_token_must_be() {
    let dir = tempfile::tempdir().unwrap();
    write_model(&dir.path().join("m.safetensors"));
    let spec = dead_spec();
    for args in [
        vec!["serve", "m.safetensors"],
        vec!["pull", "out.safetensors", "--spec", &spec],
    ] {
        let out = refit()
            .args(&args)
            .env("REFIT_TOKEN_FILE", "")
            .current_dir(dir.path())
            .output()
            .unwrap();
        refused(&out, "REFIT_TOKEN_FILE is set but empty");
        let out = refit()
            .args(&args)
            .env("REFIT_TOKEN", "short")
            .current_dir(dir.path())
            .output()
            .unwrap();
        refused(
            &out,
            "REFIT_TOKEN is 5 bytes long: a cluster token is 16 to 256 bytes with no \
             whitespace or control characters (`refit token FILE` makes one",
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("peer"), "{stderr}");
    }
}

#[test]
fn status_of_a_dead_address_asks_whether_the_launch_runs() {
    let out = refit()
        .args(["status", "127.0.0.1:1", "--timeout-s", "2"])
        .output()
        .unwrap();
    refused(
        &out,
        "cannot reach the launch's status at 127.0.0.1:1 (connection refused): is `refit launch \
         --status-addr` running there?",
    );
}

#[test]
fn bench_without_warm_up_is_refused_not_printed_as_nan() {
    let out = refit().args(["bench", "--warmup", "0"]).output().unwrap();
    refused(&out, "--warmup must be at least 1");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("NaN"));
}
