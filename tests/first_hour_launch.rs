//! A new user's first hour with `refit launch`: each mistake of a newcomer (a wrong type,
//! an unknown key or a bad range in `params`, a program that is not there) is answered
//! with one clear line before any rank starts, with no panic and no Debug form; a rank
//! that fails at its start prints its error once, and the launcher's last line repeats it;
//! `--dry-run` prints the ranks and starts nothing; `--log-dir` keeps one log per rank.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::launch::{Launch, shipped_topology};

/// `refit launch FILE ARGS...` run to its end (at most two minutes), from `cwd`.
fn launch(cwd: &Path, file: &Path, args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_refit"))
        .current_dir(cwd)
        .arg("launch")
        .arg(file)
        .args(args)
        .env_remove("REFIT_TOKEN")
        .env_remove("REFIT_TOKEN_FILE")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("REFIT_METRICS_ADDR")
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("refit launch did not end in two minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The shipped CartPole topology, pointed at this build's example.
fn cartpole(dir: &Path) -> std::path::PathBuf {
    shipped_topology(dir, "cartpole-processes.toml", "cartpole", &[])
}

/// Asserts that the launch failed, started no rank, printed no panic and no Debug form,
/// and that its last line is `refit launch: error: ` followed by text holding each of `says`.
fn refused_before_start(out: &Output, says: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for bad in ["panicked", "Error: ", "Config(", "started rank"] {
        assert!(
            !stderr.contains(bad) && !stdout.contains(bad),
            "`{bad}` in:\n{stderr}"
        );
    }
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "one error line, not:\n{stderr}");
    let last = stderr.lines().last().unwrap();
    assert!(last.starts_with("refit launch: error: "), "{stderr}");
    for s in says {
        assert!(last.contains(s), "`{s}` not in the last line:\n{stderr}");
    }
}

#[test]
fn a_bad_value_in_params_is_refused_before_any_rank_starts() {
    let dir = tempfile::tempdir().unwrap();
    let topo = cartpole(dir.path());
    // a wrong type: the learner's own param, checked by the rank program run as a check
    let out = launch(dir.path(), &topo, &["--set", "model.policy.params.lr=abc"]);
    refused_before_start(
        &out,
        &[
            "model `policy`: params.lr must be a finite number",
            "before any rank started",
        ],
    );
    // an unknown key: the same, naming the keys the roles know
    let out = launch(dir.path(), &topo, &["--set", "model.policy.params.lrr=1"]);
    refused_before_start(&out, &["unknown parameter params.lrr", "knows hidden, lr"]);
    // the same in a GRPO model whose engines verify what they serve: named as the typo it
    // is, not as a failure of the verification that reads the params too
    let grpo = shipped_topology(dir.path(), "grpo-processes.toml", "grpo", &[]);
    let out = launch(dir.path(), &grpo, &["--set", "model.policy.params.hedas=2"]);
    let says = [
        "model `policy`: unknown parameter params.hedas",
        "knows arch",
    ];
    refused_before_start(&out, &says);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("verify"), "{stderr}");
    // a bad range of a framework key: the launcher's own check, naming the file
    let out = launch(
        dir.path(),
        &topo,
        &["--set", "model.policy.params.batch_frames=0"],
    );
    refused_before_start(
        &out,
        &[
            "params.batch_frames must be a positive integer, not 0",
            "cartpole-processes.toml",
        ],
    );
}

#[test]
fn a_rank_that_fails_at_its_start_says_why_once_and_the_launcher_repeats_it() {
    let dir = tempfile::tempdir().unwrap();
    let topo = cartpole(dir.path());
    // without the check, rank 0 meets the bad value after it started its actors: it must
    // end with its error, not a panic
    let out = launch(
        dir.path(),
        &topo,
        &[
            "--set",
            "run.check=false",
            "--set",
            "model.policy.params.lr=abc",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Error: "),
        "{stderr}"
    );
    let said = "[rank 0 learner] error: invalid configuration: model `policy`: params.lr must be \
                a finite number";
    assert_eq!(stderr.matches(said).count(), 1, "{stderr}");
    let last = stderr.lines().last().unwrap();
    assert_eq!(
        last,
        "refit launch: error: rank 0 (learner) failed: invalid configuration: model `policy`: \
         params.lr must be a finite number",
        "{stderr}"
    );
}

#[test]
fn a_program_that_is_not_there_says_how_command_is_resolved_and_how_to_build_it() {
    let dir = tempfile::tempdir().unwrap();
    // the shipped file as it is, run from a folder that holds no build
    let shipped =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/topologies/cartpole-processes.toml");
    let out = launch(dir.path(), &shipped, &[]);
    refused_before_start(
        &out,
        &[
            &format!(
                "cannot start `{}/target/release/examples/cartpole`",
                dir.path().display()
            ),
            "resolved against the folder `refit launch` runs in",
            "`cargo build --release --example cartpole`",
        ],
    );
}

#[test]
fn dry_run_prints_every_rank_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let topo = cartpole(dir.path());
    let out = launch(dir.path(), &topo, &["--dry-run"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    for want in [
        "rank 0 (learner, replica 0): host local (127.0.0.1)",
        "roles: trainer, controller, evaluator",
        "rank 2 (actor, replica 1): host local (127.0.0.1)",
        "roles: engine, rollout",
        "/examples/cartpole topology",
        "model policy: weights from rank 0 to rank 1 over shm",
        "dry run: nothing started",
    ] {
        assert!(stdout.contains(want), "`{want}` not in:\n{stdout}");
    }
    assert!(!stderr.contains("started rank"), "{stderr}");
}

#[test]
fn log_dir_keeps_each_ranks_output_in_a_file_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let topo = dir.path().join("echo.toml");
    std::fs::write(
        &topo,
        r#"
[run]
command = ["sh", "-c", "echo out of $RANK; echo err of $RANK >&2"]
check = false
[[model]]
id = "policy"
[[process]]
name = "learner"
roles = ["trainer", "controller"]
[[process]]
name = "actor"
replicas = 2
roles = ["engine", "rollout"]
"#,
    )
    .unwrap();
    let logs = dir.path().join("logs");
    let out = launch(
        dir.path(),
        &topo,
        &["--log-dir", logs.to_str().unwrap(), "--grace-s", "2"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for (rank, name) in [(0, "learner"), (1, "actor"), (2, "actor")] {
        let log = std::fs::read_to_string(logs.join(format!("rank-{rank}-{name}.log")))
            .unwrap_or_else(|e| panic!("rank {rank}'s log: {e}\n{stderr}"));
        assert!(
            log.contains(&format!("out of {rank}\n")) && log.contains(&format!("err of {rank}\n")),
            "{log}"
        );
        // unprefixed in the file, prefixed on the terminal
        assert!(!log.contains("[rank"), "{log}");
    }
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("[rank 1 actor] out of 1"),
        "{stderr}"
    );
}

#[test]
fn ctrl_c_stops_the_run_quietly_with_the_summary_so_far() {
    let dir = tempfile::tempdir().unwrap();
    // a run that would go on for minutes
    let topo = shipped_topology(
        dir.path(),
        "cartpole-processes.toml",
        "cartpole",
        &[
            ("target_return", "100000.0".into()),
            ("max_updates", "100000".into()),
        ],
    );
    let launch = Launch::start(&topo, "batch-async");
    launch.wait_for(&["policy v3: "], Duration::from_secs(180));
    // what a terminal's Ctrl-C sends to the launcher
    // SAFETY: kill has no memory-safety preconditions; the pid is our unreaped child's.
    let sent = unsafe { libc::kill(launch.child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(sent, 0);
    let (status, out) = launch.finish(Duration::from_secs(30));
    assert_eq!(status.code(), Some(130), "{out}");
    let summary = out
        .lines()
        .find(|l| l.starts_with("[rank 0 learner] interrupted after "))
        .unwrap_or_else(|| panic!("no summary so far:\n{out}"));
    assert!(
        summary.contains("policy at v") && summary.contains("mean return"),
        "{summary}"
    );
    for noisy in [" WARN ", " ERROR ", "panicked", "error:"] {
        assert!(!out.contains(noisy), "`{noisy}` in:\n{out}");
    }
}
