//! Placements as the topology file says them, run as a user runs them (the real `refit
//! launch`, the cartpole example's ranks as real processes): a trainer on a rank of its own
//! with an engine beside the controller, two models trained on two ranks for one engine
//! set (one model over TCP, the other over shared memory), and the supervision bounds: a
//! frozen rank 0 (SIGSTOP) ends every other rank within `dead_after_s`, a frozen engine is
//! dropped within it and the run goes on.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

mod common;
use common::example;
use common::launch::{Launch, assert_clean, pid_in};

/// A topology file in `dir`: the cartpole example's ranks, `body` (models and processes)
/// after a `[run]`, `[sync]` and `[stop]` of a short run.
fn topology(dir: &Path, name: &str, run: &str, stop: &str, body: &str) -> PathBuf {
    let exe = example("cartpole");
    let text = format!(
        r#"
[run]
command = [{exe:?}, "topology"]
wait_s = 60.0
{run}

[sync]
sync_mode = "batch-async"
staleness_threshold = 2

[stop]
{stop}
max_time_s = 600.0

{body}
"#,
        exe = exe.display().to_string()
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

const POLICY: &str = r#"
[[model]]
id = "policy"
[model.params]
envs_per_worker = 4
fragment_steps = 32
batch_frames = 2048
"#;

/// The pid rank `rank` printed.
fn pid_of(launch: &Launch, rank: u32) -> u32 {
    let (_, line) = launch.wait_for(
        &[&format!("rank {rank} (process `"), ": pid "],
        Duration::from_secs(120),
    );
    pid_in(&line).unwrap()
}

fn signal(sig: &str, pid: u32) -> Instant {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
    Instant::now()
}

/// Rank 0 holds the controller and an engine with its rollouts; the trainer sits on rank 1
/// alone; rank 2 is another engine. Both engines are fed over shared memory from rank 1,
/// the drivers' progress and the report travel to rank 0.
#[test]
fn a_trainer_on_its_own_rank_feeds_an_engine_beside_the_controller() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(
        dir.path(),
        "trainer-apart.toml",
        "",
        "target_return = 150.0\nmax_updates = 60",
        &format!(
            "{POLICY}
[[process]]
name = \"lead\"
roles = [\"controller\", \"evaluator\", \"engine\", \"rollout\"]
rollout_workers = 1

[[process]]
name = \"learner\"
roles = [\"trainer\"]

[[process]]
name = \"actor\"
roles = [\"engine\", \"rollout\"]
rollout_workers = 1
"
        ),
    );
    let (status, out) = Launch::start(&topo, "batch-async").finish(Duration::from_secs(600));
    assert!(status.success(), "{status}\n{out}");
    assert!(out.contains("solved: policy (batch-async mode)"), "{out}");
    assert!(
        out.contains("rank 1 (process `learner`, replica 0): pid")
            && out.contains("model `policy` weights: shm board"),
        "{out}"
    );
    for who in [
        "rank 0 (process `lead`, replica 0)",
        "rank 2 (process `actor`, replica 0)",
    ] {
        assert!(
            out.contains(&format!("{who}: pid"))
                && out
                    .lines()
                    .any(|l| l.contains(who) && l.contains("weights over shm")),
            "{who}\n{out}"
        );
    }
    assert!(out.contains("refit_actors::run::lead: policy v"), "{out}");
    assert_clean(&out);
}

/// Two models, each trained by its own process; one engine set serves both (the version
/// barrier keeps them in step); `verifier` names its own link, TCP, the policy goes over
/// shared memory.
#[test]
fn two_models_trained_on_two_ranks_share_one_engine_set() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(
        dir.path(),
        "two-trainers.toml",
        "",
        "target_return = 100.0\nmax_updates = 40",
        &format!(
            "{POLICY}
[[model]]
id = \"verifier\"
link = \"tcp\"
[model.params]
envs_per_worker = 4
fragment_steps = 32
batch_frames = 2048

[[process]]
name = \"lead\"
roles = [\"controller\", \"evaluator\"]

[[process]]
name = \"policy-trainer\"
roles = [\"trainer\"]
models = [\"policy\"]

[[process]]
name = \"verifier-trainer\"
roles = [\"trainer\"]
models = [\"verifier\"]

[[process]]
name = \"actor\"
replicas = 2
roles = [\"engine\", \"rollout\"]
rollout_workers = 1
"
        ),
    );
    let (status, out) = Launch::start(&topo, "batch-async").finish(Duration::from_secs(900));
    assert!(status.success(), "{status}\n{out}");
    for m in ["policy", "verifier"] {
        assert!(
            out.contains(&format!("solved: {m} (batch-async mode)")),
            "{m}\n{out}"
        );
        assert!(
            out.contains(&format!("refit_actors::run::lead: {m} v")),
            "{m}\n{out}"
        );
    }
    assert!(
        out.contains("rank 1 (process `policy-trainer`, replica 0): pid")
            && out.contains("rank 2 (process `verifier-trainer`, replica 0): pid"),
        "{out}"
    );
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("model `verifier` weights over tcp"))
            .count(),
        2,
        "{out}"
    );
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("model `policy` weights over shm"))
            .count(),
        2,
        "{out}"
    );
}

/// The three-rank CartPole topology with a short keepalive.
fn three_ranks(dir: &Path, on_failure: &str) -> PathBuf {
    topology(
        dir,
        "frozen.toml",
        &format!("on_failure = {on_failure:?}\nkeepalive_s = 0.5\ndead_after_s = 3.0"),
        "target_return = 150.0\nmax_updates = 200",
        &format!(
            "{POLICY}
[[process]]
name = \"learner\"
roles = [\"trainer\", \"controller\", \"evaluator\"]

[[process]]
name = \"actor\"
replicas = 2
roles = [\"engine\", \"rollout\"]
rollout_workers = 1
"
        ),
    )
}

/// A frozen rank 0 (its sockets open, its process stopped: as silent as a host off the
/// network) is dead to the other ranks once it answers no ping for `dead_after_s`: each
/// exits on its own, naming why, and the launcher ends the run.
#[test]
fn a_frozen_rank_0_ends_every_other_rank_within_dead_after() {
    let dir = tempfile::tempdir().unwrap();
    let topo = three_ranks(dir.path(), "abort");
    let launch = Launch::start(&topo, "fully-async");
    launch.wait_for(&[" frames, mean return "], Duration::from_secs(180));
    let lead = pid_of(&launch, 0);
    let frozen = signal("-STOP", lead);
    // each other rank ends within the bound: it finds rank 0 silent itself, or the launcher
    // stops the run because another one did (on_failure = "abort"), whichever comes first
    for r in [1, 2] {
        let own = format!("rank {r} (process `actor`");
        let mine: &[&str] = &[&own, "rank 0 went away before the end of the run"];
        let stopped: &[&str] = &["stopping the run (on_failure = \"abort\")"];
        let (seen, line) = launch.wait_for_any(&[mine, stopped], Duration::from_secs(15));
        assert!(
            line.contains("answered no ping") || line.contains("stopping the run"),
            "{line}"
        );
        let after = seen.duration_since(frozen);
        assert!(
            after < Duration::from_secs(3 + 5),
            "rank {r} took {after:?}\n{}",
            launch.text()
        );
    }
    // the first to end found rank 0 silent by itself
    launch.wait_for(
        &[
            "rank 0 went away before the end of the run",
            "answered no ping",
        ],
        Duration::from_secs(15),
    );
    let (status, out) = launch.finish(Duration::from_secs(60));
    assert!(!status.success(), "{out}");
    assert!(
        !Path::new(&format!("/proc/{lead}")).exists()
            || std::fs::read_to_string(format!("/proc/{lead}/stat"))
                .is_ok_and(|s| s.contains(") Z ")),
        "the frozen rank 0 outlived the launcher\n{out}"
    );
}

/// A frozen engine rank is dead to rank 0 once it answers no ping for `dead_after_s`: it
/// is dropped (its admitted rollouts given up) and, under `on_failure = "continue"`, the
/// run solves with the other engine.
#[test]
fn a_frozen_engine_is_dropped_within_dead_after_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let topo = three_ranks(dir.path(), "continue");
    let launch = Launch::start(&topo, "fully-async");
    launch.wait_for(&[" frames, mean return "], Duration::from_secs(180));
    let engine = pid_of(&launch, 2);
    let frozen = signal("-STOP", engine);
    let (seen, line) = launch.wait_for(
        &["rank 0: rank 2 (process `actor`, replica 1) is gone"],
        Duration::from_secs(15),
    );
    assert!(line.contains("answered no ping"), "{line}");
    assert!(
        seen.duration_since(frozen) < Duration::from_secs(3 + 5),
        "{line}"
    );
    // the frozen rank never ends by itself: the launcher kills it after the run
    let (status, out) = launch.finish(Duration::from_secs(600));
    assert!(status.success(), "{status}\n{out}");
    assert!(out.contains("the run goes on with 1 engines"), "{out}");
    assert!(out.contains("solved: policy (fully-async mode)"), "{out}");
}

/// An engine process with `restart = "on-failure"` that is killed mid-run is started again
/// by the launcher; its new incarnation rejoins the running job (its inlet gets the current
/// weights, rank 0 brings its engine to the served version and adds it back, its rollouts
/// start) and the run solves. Both incarnations are in the report.
#[test]
fn a_killed_engine_is_restarted_rejoins_and_the_run_solves() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(
        dir.path(),
        "restart.toml",
        "on_failure = \"abort\"\nkeepalive_s = 0.5\ndead_after_s = 3.0",
        "target_return = 150.0\nmax_updates = 200",
        &format!(
            "{POLICY}
[[process]]
name = \"learner\"
roles = [\"trainer\", \"controller\", \"evaluator\"]

[[process]]
name = \"actor\"
replicas = 2
roles = [\"engine\", \"rollout\"]
rollout_workers = 1
restart = \"on-failure\"
max_restarts = 2
"
        ),
    );
    let launch = Launch::start(&topo, "fully-async");
    launch.wait_for(&[" frames, mean return "], Duration::from_secs(180));
    let engine = pid_of(&launch, 2);
    let killed = signal("-KILL", engine);
    let (seen, _) = launch.wait_for(
        &["rank 0: rank 2 (process `actor`, replica 1) is gone"],
        Duration::from_secs(15),
    );
    assert!(seen.duration_since(killed) < Duration::from_secs(10));
    launch.wait_for(
        &["rank 2 (process `actor`, replica 1) rejoined (incarnation 1)"],
        Duration::from_secs(120),
    );
    let (status, out) = launch.finish(Duration::from_secs(600));
    assert!(status.success(), "{status}\n{out}");
    assert!(out.contains("solved: policy (fully-async mode)"), "{out}");
    // the new incarnation loaded versions and ran rollouts after it came back
    let after: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.contains("rejoined (incarnation 1)"))
        .collect();
    assert!(
        after
            .iter()
            .any(|l| l.contains("rank 2 (process `actor`, replica 1): stopped; engine loaded")),
        "{out}"
    );
}
