//! Runs the built examples as a user would and checks what they print.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;
use std::process::Command;

/// Cargo builds examples before integration tests; they sit in `target/<profile>/examples`,
/// beside the `deps` directory holding this test binary.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "example {name} not built at {}",
        path.display()
    );
    path
}

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
                "receiver {r}: sender left (shut down); last version 6"
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
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage"));
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
                "--max-seconds",
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
    let cfg = refit_runtime::SyncConfig::from_path(&path).unwrap();
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
