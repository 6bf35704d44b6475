//! Runs the built examples as a user would and checks what they print.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;
use std::process::Command;

mod common;
use common::example;

#[test]
fn shm_weights_example_runs_sender_and_two_receiver_processes() {
    let out = Command::new(example("shm_weights"))
        .arg("6")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for r in 0..2 {
        assert!(
            stdout.contains(&format!("receiver {r}: connected at version 1")),
            "{stdout}"
        );
        for v in 2..=6 {
            let line = format!("receiver {r}: applied version {v} (fc1.weight[0] = {v})");
            assert!(stdout.contains(&line), "missing {line:?} in\n{stdout}");
        }
        assert!(
            stdout.contains(&format!(
                "receiver {r}: sender left (shut down); last version 6, 0 versions copied"
            )),
            "{stdout}"
        );
    }
    assert_eq!(stdout.matches("acknowledged by both receivers").count(), 5);
}

#[test]
fn shm_weights_example_refuses_bad_arguments() {
    let out = Command::new(example("shm_weights"))
        .arg("zero")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid value 'zero'") && stderr.contains("VERSIONS"),
        "{stderr}"
    );
}

/// Every example that takes arguments parses them with clap: `--help` succeeds and lists
/// the options, and an unknown option is refused with exit status 2, named. (The quick
/// start takes none: it is the book's first program, which compiles in a fresh crate
/// depending on nothing but `refit`.)
#[test]
fn every_example_answers_help_and_refuses_an_unknown_option() {
    let examples = [
        ("cartpole", "--async-processes"),
        ("two_models", "--validate-freq"),
        ("collector_bench", "--frames"),
        ("file_weights", "[VERSIONS]"),
        ("shm_weights", "[VERSIONS]"),
        ("multi_node", "--no-spawn"),
        ("mesh", "--receivers"),
        ("engine_layout", "--help"),
    ];
    for (name, option) in examples {
        let out = Command::new(example(name)).arg("--help").output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name} --help failed: {stdout}");
        assert!(
            stdout.contains("Usage:") && stdout.contains(option),
            "{name} --help:\n{stdout}"
        );
        let out = Command::new(example(name))
            .arg("--no-such-option")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{name}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--no-such-option"), "{name}: {stderr}");
    }
}

/// `collector_bench` prints every collector against a bare loop measured in the same run:
/// the bare loop's own ratio is 1, every other row has frames per second and a ratio, and the
/// one-worker rows have CPU-time figures as well.
#[test]
fn collector_bench_measures_every_collector_against_the_bare_loop() {
    let stdout = run_ok(
        "collector_bench",
        &["--frames", "2000", "--rounds", "1", "--json"],
    );
    let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["collector"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "bare loop",
            "1 worker",
            "2 threads, sync",
            "2 threads, async",
            "1 process, sync",
            "2 processes, sync",
            "2 processes, async"
        ]
    );
    for r in &rows {
        let fps = r["frames_per_s"].as_f64().unwrap();
        let ratio = r["vs_bare"].as_f64().unwrap();
        assert!(fps > 0.0 && ratio > 0.0, "{r}");
    }
    assert_eq!(rows[0]["vs_bare"].as_f64(), Some(1.0));
    let one = &rows[1];
    let wall = one["frames_per_s"].as_f64().unwrap() / rows[0]["frames_per_s"].as_f64().unwrap();
    assert!(
        (wall - one["vs_bare"].as_f64().unwrap()).abs() < 1e-3,
        "{one}"
    );
    if cfg!(target_os = "linux") {
        assert!(one["cpu_vs_bare"].as_f64().unwrap() > 0.0, "{one}");
    }
    // the text form says how the goal stands
    let text = run_ok("collector_bench", &["--frames", "2000", "--rounds", "1"]);
    assert!(
        text.contains("goal: 1 worker >= 0.90x bare loop:"),
        "{text}"
    );
}

fn run_ok(name: &str, args: &[&str]) -> String {
    let out = Command::new(example(name)).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name} {args:?}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Solves CartPole (mean return 475, Gymnasium's threshold) through the actor topology in
/// every sync mode, within a frame budget: a run that stops learning runs out of frames
/// and fails. Seeds 0-3 solved in 49k-74k frames (24-34 updates of 2048 frames); the budget
/// is twice that.
#[test]
fn cartpole_learns_through_the_actor_topology_in_every_sync_mode() {
    for mode in ["sync", "batch-async", "fully-async"] {
        let stdout = run_ok(
            "cartpole",
            &[
                "--sync-mode",
                mode,
                "--target",
                "475",
                "--total-frames",
                "150000",
                "--max-time-s",
                "900",
            ],
        );
        assert!(stdout.contains(&format!("sync mode {mode}")), "{stdout}");
        let solved = stdout
            .lines()
            .find(|l| l.starts_with("solved: policy mean return"))
            .unwrap_or_else(|| panic!("not solved within 150k frames:\n{stdout}"));
        let mean: f64 = solved
            .trim_start_matches("solved: policy mean return ")
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(mean >= 475.0, "{solved}");
        if mode == "sync" {
            // on-policy: every trained sample came from the version that trained on it
            assert!(
                stdout.contains("staleness of trained samples mean 0.00 max 0"),
                "{stdout}"
            );
        }
        if mode == "fully-async" {
            assert!(stdout.contains("blocked 0 (0 ms waiting)"), "{stdout}");
        }
    }
}

/// The real example with asynchronous worker processes (itself re-run as `worker`): batches
/// stream in, every update is trained on and published, and a spent frame budget is a clear
/// failure (exit status 1, "NOT solved"), not a hang.
#[test]
fn cartpole_runs_asynchronous_worker_processes_until_its_budget() {
    let out = Command::new(example("cartpole"))
        .args([
            "--async-processes",
            "--total-frames",
            "4096",
            "--target",
            "1000",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("async worker processes"), "{stdout}");
    let updates = stdout.lines().filter(|l| l.contains(" -> v")).count();
    assert!(updates >= 4, "{updates} updates:\n{stdout}");
    // each batch is one worker's (1024 frames of the 2048 per round)
    assert!(stdout.contains("frames    1024"), "{stdout}");
    assert!(stdout.contains("NOT solved"), "{stdout}");
}

#[test]
fn two_models_example_keeps_both_models_in_step_at_every_eval() {
    let stdout = run_ok("two_models", &["--updates", "4", "--validate-freq", "2"]);
    for v in [2, 4] {
        let line = format!("eval at v{v}: solver at v{v} mean return");
        assert!(stdout.contains(&line), "missing {line:?} in\n{stdout}");
        assert!(
            stdout.contains(&format!("verifier at v{v} mean return")),
            "{stdout}"
        );
    }
    assert!(stdout.contains("2 eval steps"), "{stdout}");
    assert!(stdout.contains("leader: load solver"), "{stdout}");
    for m in ["solver", "verifier"] {
        assert!(
            stdout.contains(&format!("{m}: trained to v5, engine serves v5")),
            "{stdout}"
        );
    }
}

#[test]
fn a_sync_config_with_an_unknown_key_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sync.toml");
    std::fs::write(&path, "sync_mode = \"sync\"\nstaleness = 2\n").unwrap();
    let out = Command::new(example("two_models"))
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unknown field `staleness`") && stderr.contains("sync.toml"),
        "{stderr}"
    );
}

#[test]
fn the_sample_sync_config_parses_and_drives_two_models() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/configs/sync.toml");
    let cfg = refit_runtime::SyncConfig::from_file_text(&refit::read_config(&path).unwrap(), &path)
        .unwrap();
    assert_eq!(cfg.sync_mode, refit_runtime::SyncMode::BatchAsync);
    assert_eq!(cfg.validate_freq, 5);
    let stdout = run_ok(
        "two_models",
        &["--config", path.to_str().unwrap(), "--updates", "5"],
    );
    assert!(
        stdout.contains("sync mode batch-async, eval every 5 versions"),
        "{stdout}"
    );
    assert!(stdout.contains("eval at v5: solver at v5"), "{stdout}");
}

#[test]
fn sigterm_stops_the_shm_weights_sender_cleanly_and_says_so_in_the_log() {
    use std::io::{BufRead, Read};
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let mut sender = Command::new(example("shm_weights"))
        .arg("100000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(sender.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("acknowledged by both receivers") {
        let mut line = String::new();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "{seen}");
        seen.push_str(&line);
    }
    let kill = Command::new("kill")
        .args(["-TERM", &sender.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let t = Instant::now();
    let status = loop {
        if let Some(s) = sender.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no exit on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(143), "{status:?}");
    let mut stderr = String::new();
    sender
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    // the subscriber is installed: the signal thread's warning reaches stderr
    assert!(
        stderr.contains("SIGTERM") && stderr.contains("releasing shared memory"),
        "{stderr}"
    );
    // the receivers saw the board shut down and left (their stdout closes)
    stdout.read_to_string(&mut seen).unwrap();
    for r in 0..2 {
        assert!(
            seen.contains(&format!("receiver {r}: sender left (shut down)")),
            "{seen}"
        );
    }
}

/// A fused-qkv, bf16 engine process receives from an f32 trainer over shm (converting on
/// its side) and over TCP (the trainer's two ranks publish through a sharded buffer and its
/// sender converts); each engine checks every version against the reference conversion.
#[test]
fn engine_layout_example_serves_the_engines_layout_over_shm_and_tcp() {
    let stdout = run_ok("engine_layout", &[]);
    for (link, side) in [("shm", "receiver side"), ("tcp", "sender side")] {
        for v in 1..=3 {
            let line = format!("engine ({link}, {side}): v{v} matches the reference conversion");
            assert!(stdout.contains(&line), "{line}\n{stdout}");
        }
    }
    assert!(
        stdout.contains("trainer (tcp, sender side): 3 versions converted"),
        "{stdout}"
    );
    assert_eq!(stdout.matches("buckets reassembled").count(), 2, "{stdout}");
}

#[test]
fn a_bad_rust_log_is_reported_and_the_default_used() {
    let out = Command::new(example("engine_layout"))
        .env("RUST_LOG", "refit=notalevel")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ignoring RUST_LOG"), "{stderr}");
}

#[test]
fn file_weights_example_publishes_holds_and_collects() {
    let stdout = run_ok("file_weights", &["6"]);
    for v in 2..=6 {
        assert!(
            stdout.contains(&format!("receiver: applied version {v}")),
            "{stdout}"
        );
    }
    assert!(
        stdout.contains("reader: still holds version 1 (fc1.bias[0] = Some(1.0))"),
        "{stdout}"
    );
    assert!(stdout.contains("receiver: serves version 6"), "{stdout}");
    // version 1 was held through 2..=6; the collector kept it, and the newest 2 besides
    assert!(
        stdout.contains(
            "directory: policy.safetensors policy.v1.safetensors policy.v5.safetensors \
             policy.v6.safetensors"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("policy.safetensors: version 6"), "{stdout}");
}

/// Runs the `mesh` example (two trainer-shard processes and three engine processes on
/// loopback): every engine pulls its third of the columns of every version from both
/// shards.
#[test]
fn two_shards_feed_three_column_engines_every_version() {
    let stdout = run_ok(
        "mesh",
        &[
            "--senders",
            "2",
            "--receivers",
            "3",
            "--size",
            "6MiB",
            "--versions",
            "3",
        ],
    );
    for v in 1..=3 {
        assert!(
            stdout.contains(&format!("mesh: version {v} held by every receiver")),
            "{stdout}"
        );
    }
    assert!(stdout.contains("2 senders -> 3 receivers"), "{stdout}");
    let engines = stdout
        .lines()
        .filter(|l| l.starts_with("mesh receiver"))
        .count();
    assert_eq!(engines, 3, "{stdout}");
}
