//! A sharded trainer as processes (issue #24), run as a user runs it: the real `refit
//! launch`, the cartpole example's ranks. The trainer process has `replicas = 2`: rank 1
//! (shard 0) holds the pool and the driver and publishes; rank 2 (shard 1) trains on every
//! batch too and sends its half of each version to rank 1, which publishes a version only
//! once both halves are in. The output shows, per published version, both shards' parts.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod common;
use common::example;
use common::launch::{Launch, last_version, pid_in};

/// The versions rank 1's driver published (`weight_update{model=policy from=1 to=2}:
/// trained and published`).
fn published(out: &str) -> BTreeSet<u64> {
    out.lines()
        .filter(|l| l.starts_with("[rank 1 learner]") && l.contains("trained and published"))
        .filter_map(|l| {
            let to = l.split(" to=").nth(1)?;
            to.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .ok()
        })
        .collect()
}

/// A topology file in `dir`: rank 0 the controller and evaluator, ranks 1 and 2 the two
/// shards of the trainer (logging each shard's part of each version), rank 3 an engine
/// with two rollout workers; `run` adds to `[run]`.
fn topology(dir: &Path, run: &str) -> PathBuf {
    let exe = example("cartpole").display().to_string();
    // the trainer ranks log each shard's part of each version,
    // and the driver each update it trained and published (debug)
    let log = format!(
        "{},refit_actors::run::shard=debug,refit_actors::run::drive=debug",
        refit::DEFAULT_LOG
    );
    let text = format!(
        r#"
[run]
command = [{exe:?}, "topology"]
{run}

[sync]
sync_mode = "batch-async"
staleness_threshold = 2

[stop]
target_return = 100.0
max_updates = 60
max_time_s = 600.0

[[model]]
id = "policy"
[model.params]
envs_per_worker = 4
fragment_steps = 32
batch_frames = 2048

[[process]]
name = "lead"
roles = ["controller", "evaluator"]

[[process]]
name = "learner"
replicas = 2
roles = ["trainer"]
env = {{ RUST_LOG = {log:?} }}

[[process]]
name = "actor"
roles = ["engine", "rollout"]
rollout_workers = 2
"#
    );
    let path = dir.join("sharded.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `refit launch --dry-run` says where a sharded trainer's weights go: to shard 0, then
/// through its link, or from every shard to the engine over the mesh.
#[test]
fn a_dry_run_says_how_each_shard_publishes() {
    let dir = tempfile::tempdir().unwrap();
    let path = topology(dir.path(), "");
    let dry = |set: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_refit"))
            .arg("launch")
            .arg(&path)
            .args(set)
            .arg("--dry-run")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let gather = dry(&[]);
    assert!(
        gather.contains(
            "model policy: the shard on rank 2 sends its part to rank 1, which publishes"
        ),
        "{gather}"
    );
    assert!(
        gather.contains("model policy: weights from rank 1 to rank 3 over"),
        "{gather}"
    );
    assert!(!gather.contains("from rank 2 to rank 3"), "{gather}");
    let mesh = dry(&["--set", "links.sharded=mesh"]);
    assert!(
        mesh.contains(
            "model policy: weights from ranks 1, 2 (each its part) to rank 3 over the mesh (tcp)"
        ),
        "{mesh}"
    );
}

#[test]
fn a_two_process_sharded_trainer_publishes_versions_assembled_from_both() {
    let dir = tempfile::tempdir().unwrap();
    let path = topology(dir.path(), "wait_s = 60.0");
    let (status, out) = Launch::start(&path, "batch-async").finish(Duration::from_secs(600));
    assert!(status.success(), "{status}\n{out}");
    assert!(out.contains("solved: policy (batch-async mode)"), "{out}");

    // rank 1 assembles from both shards; rank 2 is shard 1 of 2
    let setup = out
        .lines()
        .find(|l| l.contains("model `policy` is trained by 2 shards"))
        .unwrap_or_else(|| panic!("no assembly line\n{out}"));
    assert!(setup.starts_with("[rank 1 learner]"), "{setup}");
    let cut: u64 = setup
        .split("shard 1 (rank 2) bytes ")
        .nth(1)
        .and_then(|s| s.split("..").next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no part of shard 1 in {setup}"));
    let end: u64 = setup
        .split("shard 1 (rank 2) bytes ")
        .nth(1)
        .and_then(|s| s.split("..").nth(1))
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("no end of shard 1 in {setup}"));
    assert!(cut > 0 && end > cut, "{setup}");
    assert!(
        out.lines().any(|l| l.starts_with("[rank 2 learner]")
            && l.contains("shard 1 of 2 of model `policy`'s trainer (rank 1 assembles")),
        "{out}"
    );

    // every version rank 1 published was written by both shards, rank 2's half sent by
    // rank 2's own process
    let versions = published(&out);
    assert!(versions.len() >= 2, "{versions:?}\n{out}");
    for v in &versions {
        for (shard, rank, bytes) in [(0, 1, format!("0..{cut}")), (1, 2, format!("{cut}..{end}"))] {
            let line = format!(
                "model `policy` v{v}: shard {shard} of 2 (rank {rank}) wrote bytes {bytes}"
            );
            assert!(
                out.lines()
                    .any(|l| l.starts_with("[rank 1 learner]") && l.contains(&line)),
                "no `{line}`\n{out}"
            );
        }
        let sent = format!(
            "model `policy` v{v}: shard 1 of 2 (rank 2) trained and sent its {} bytes",
            end - cut
        );
        assert!(
            out.lines()
                .any(|l| l.starts_with("[rank 2 learner]") && l.contains(&sent)),
            "no `{sent}`\n{out}"
        );
    }
}

/// `links.sharded = "mesh"`: each shard publishes its own part of every version from its
/// own process, and the engine pulls each version from both shards at once; nothing is
/// gathered at shard 0 (no part is sent to it, none is written there), and the run learns
/// as the gathering one does.
#[test]
fn a_mesh_sharded_trainer_publishes_from_every_shard_with_no_gather() {
    let dir = tempfile::tempdir().unwrap();
    let path = topology(dir.path(), "wait_s = 60.0\n\n[links]\nsharded = \"mesh\"");
    let (status, out) = Launch::start(&path, "batch-async").finish(Duration::from_secs(600));
    assert!(status.success(), "{status}\n{out}");
    assert!(out.contains("solved: policy (batch-async mode)"), "{out}");
    let said = |rank: &str, what: &str| {
        out.lines()
            .any(|l| l.starts_with(&format!("[rank {rank}")) && l.contains(what))
    };
    assert!(
        said(
            "1 learner",
            "each publishing its own part of every version over the mesh"
        ),
        "{out}"
    );
    assert!(
        said(
            "2 learner",
            "shard 1 of 2 of model `policy`'s trainer (publishes its part over the mesh)"
        ),
        "{out}"
    );
    assert!(
        said(
            "3 actor",
            "model `policy` weights over the mesh, from all 2 trainer shards"
        ),
        "{out}"
    );
    // every version rank 1 published, rank 2 published its own part of; nothing was sent
    // to rank 1 or written there
    let versions = published(&out);
    assert!(versions.len() >= 2, "{versions:?}\n{out}");
    for v in &versions {
        let line = format!("model `policy` v{v}: shard 1 of 2 (rank 2) trained and published its ");
        assert!(said("2 learner", &line), "no `{line}`\n{out}");
    }
    assert!(!out.contains("trained and sent its"), "{out}");
    assert!(!out.contains(") wrote bytes "), "{out}");
}

fn signal(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// A frozen shard (its process stopped, its sockets open) misses the deadline of the next
/// update (`run.wait_s`, well before rank 0's keepalive gives up on it): the update fails
/// naming the shard, its rank and the version, which is never published; the run ends
/// with that error.
#[test]
fn a_frozen_shard_fails_the_update_naming_it_and_the_version_is_not_published() {
    frozen_shard("");
}

/// The same under a mesh: the frozen shard fails the update at shard 0, which publishes
/// nothing of it, so no engine is asked to pull a version one shard never published.
#[test]
fn a_frozen_mesh_shard_fails_the_update_naming_it_and_the_version_is_not_published() {
    frozen_shard("\n[links]\nsharded = \"mesh\"");
}

/// Freezes shard 1 (rank 2) mid-run, with `links` added to the file's `[run]`.
fn frozen_shard(links: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = topology(
        dir.path(),
        &format!("wait_s = 10.0\nkeepalive_s = 1.0\ndead_after_s = 40.0{links}"),
    );
    let launch = Launch::start(&path, "batch-async");
    launch.wait_for(&[" frames, mean return "], Duration::from_secs(180));
    let (_, line) = launch.wait_for(
        &["rank 2 (process `learner`, replica 1): pid "],
        Duration::from_secs(10),
    );
    let shard = pid_in(&line).unwrap();
    signal("-STOP", shard);
    // shard 0 (rank 1) says so at once
    let (_, failed) = launch.wait_for(
        &[
            "[rank 1 learner]",
            "shard 1 (rank 2) missed the deadline",
            "stays the last version published",
        ],
        Duration::from_secs(60),
    );
    // let it go, so that it reads the stop and the run ends without waiting for it
    signal("-CONT", shard);
    let (status, out) = launch.finish(Duration::from_secs(120));
    assert!(!status.success(), "{out}");
    assert!(!out.contains("solved: policy"), "{out}");
    // the run ends with that error
    assert!(
        out.lines().any(|l| l.starts_with("[rank 0 lead]")
            && l.contains("trainer of model `policy`: sharded trainer of model `policy`")
            && l.contains("shard 1 (rank 2) missed the deadline")),
        "{out}"
    );
    let version: u64 = failed
        .split("model `policy`, version ")
        .nth(1)
        .and_then(|s| s.split(':').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no version in {failed}\n{out}"));
    let versions = published(&out);
    assert_eq!(
        versions.last().map(|v| v + 1),
        Some(version),
        "the update after the last published one fails\n{out}"
    );
    assert!(
        !out.contains(&format!("model `policy` v{version}: shard 0 of 2")),
        "v{version} was never assembled\n{out}"
    );
}

/// A sharded trainer checkpoints (shard 0 saves; every shard holds the whole state, so each
/// restores the same file). A shard's rank killed mid-run ends the run, naming it; rank 0's
/// `restart = "on-failure"` has the launcher start every rank again from the last
/// checkpoint; both shards resume from it and the run goes on to its stop rule.
#[test]
fn a_sharded_trainer_whose_shard_dies_resumes_from_its_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let path = topology(dir.path(), "wait_s = 60.0");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("target_return = 100.0\nmax_updates = 60", "max_updates = 9")
        .replace(
            "roles = [\"controller\", \"evaluator\"]",
            "roles = [\"controller\", \"evaluator\"]\nrestart = \"on-failure\"",
        )
        + &format!(
            "\n[checkpoint]\ndir = {:?}\nevery = 2\n",
            ckpt.display().to_string()
        );
    std::fs::write(&path, text).unwrap();
    let launch = Launch::start(&path, "batch-async");
    launch.wait_for(&["policy v6: "], Duration::from_secs(300));
    let (_, line) = launch.wait_for(
        &["rank 2 (process `learner`, replica 1): pid "],
        Duration::from_secs(10),
    );
    signal("-KILL", pid_in(&line).unwrap());
    let (_, restart) = launch.wait_for(&["starting every rank again"], Duration::from_secs(60));
    let from: u64 = restart
        .split("from the checkpoint of version ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not resumed from a checkpoint: {restart}"));
    assert!(from >= 4 && from.is_multiple_of(2), "{restart}");
    let (status, out) = launch.finish(Duration::from_secs(300));
    assert!(status.success(), "{status}\n{out}");
    // both shards restored the same checkpoint, and rank 0 served the version after it
    for (rank, process) in [(1, "learner"), (2, "learner")] {
        let said = format!("model `policy` resumed from version {from}");
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("[rank {rank} {process}]")) && l.contains(&said)),
            "rank {rank} did not say `{said}`\n{out}"
        );
    }
    assert!(
        out.contains(&format!("(resumed from version {from})")),
        "{out}"
    );
    assert_eq!(last_version(&out), 10, "{out}");
}
