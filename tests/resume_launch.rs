//! Checkpoint and resume as a user runs them: the real `refit launch` on
//! `examples/topologies/cartpole-resume.toml` (its command pointed at this build's cartpole
//! example). Rank 0, which holds the trainer, is killed mid-run; `--resume` goes on from the
//! last checkpoint (the versions lost are at most one checkpoint interval); a damaged or
//! missing checkpoint is refused naming the file, never replaced by a fresh start.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod common;
use common::launch::{Launch, last_version, shipped_topology};

/// The shipped file, checkpointing every 3 versions into `dir/ckpt`, stopping at version
/// `last` (its `max_updates` is `last - 1`: counted from the run's version 1), with no
/// target return (a finished run exits 0); without `restart`, no process restarts.
fn topology_file(dir: &Path, last: u64, restart: bool) -> (PathBuf, PathBuf) {
    let ckpt = dir.join("ckpt");
    let topo = shipped_topology(
        dir,
        "cartpole-resume.toml",
        "cartpole",
        &[
            ("dir", format!("{:?}", ckpt.display().to_string())),
            ("every", "3".into()),
            ("max_updates", (last - 1).to_string()),
        ],
    );
    // as shipped, every process restarts on failure
    let text: String = std::fs::read_to_string(&topo)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("target_return = "))
        .filter(|l| restart || !l.starts_with("restart = "))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&topo, text).unwrap();
    (topo, ckpt)
}

/// The newest checkpoint version of `policy` in `ckpt`, and how many files are kept.
fn newest_checkpoint(ckpt: &Path) -> (u64, usize) {
    let saved: Vec<u64> = std::fs::read_dir(ckpt.join("policy"))
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.strip_prefix('v')?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()
        })
        .collect();
    (saved.iter().copied().max().unwrap_or(0), saved.len())
}

/// SIGKILLs rank 0 of `launch` (its pid from the launcher's `started rank 0` line).
fn kill_rank_0(launch: &Launch) -> Instant {
    let (_, started) = launch.wait_for(&["started rank 0"], Duration::from_secs(1));
    let pid = started
        .split("(pid ")
        .nth(1)
        .and_then(|p| p.trim_end_matches(')').parse::<i32>().ok())
        .unwrap();
    // SAFETY: kill has no memory-safety preconditions; the pid is rank 0's, a child of the
    // launcher we started and still running.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    Instant::now()
}

/// The integer `key = N` of a run state file.
fn counted(state: &str, key: &str) -> u64 {
    state
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key} = "))?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `{key}` in {state}"))
}

#[test]
fn a_run_whose_rank_0_is_killed_resumes_from_its_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (topo, ckpt) = topology_file(dir.path(), 1000, false);
    let launch = Launch::start(&topo, "batch-async");
    // checkpoints at v3 and v6 are written before v7 is published
    launch.wait_for(&["policy v7: "], Duration::from_secs(300));
    let killed_at = kill_rank_0(&launch);
    let (status, out) = launch.finish(Duration::from_secs(60));
    assert!(!status.success(), "{out}");
    let reached = last_version(&out);
    let (newest, kept) = newest_checkpoint(&ckpt);
    assert!(kept <= 2, "keep = 2: {kept} files");
    assert!(newest >= 6 && newest % 3 == 0, "v{newest}\n{out}");
    // at most one interval lost
    assert!(
        reached - newest < 3 + 1,
        "reached v{reached}, newest checkpoint v{newest}"
    );

    // beside it, what the controller had counted by then
    let state = std::fs::read_to_string(ckpt.join(format!("policy/v{newest}.state.toml")))
        .unwrap_or_else(|e| panic!("no run state beside v{newest}: {e}"));
    let admitted = counted(&state, "admissions");
    assert!(admitted > 0, "{state}");

    // the same command with --resume: the run goes on from there to its stop rule
    let (topo, _) = topology_file(dir.path(), newest + 4, false);
    let launch = Launch::start_with(&topo, "batch-async", &["--resume"]);
    let want = format!(
        "version {} serves on 2 engines (resumed from version {newest})",
        newest + 1
    );
    launch.wait_for(&[&want], Duration::from_secs(120));
    let back = killed_at.elapsed();
    let (status, out) = launch.finish(Duration::from_secs(300));
    assert!(status.success(), "{status}\n{out}");
    assert!(
        out.contains(&format!("model `policy` resumed from version {newest}")),
        "{out}"
    );
    // the updates go on from the checkpoint's version: never from v1 again
    assert!(out.contains(&format!("policy v{}: ", newest + 2)), "{out}");
    assert!(!out.contains("policy v2: "), "{out}");
    assert_eq!(last_version(&out), newest + 4, "{out}");
    // the controller's counts went on from the checkpoint's
    assert!(
        out.contains(&format!(
            "the controller's counts go on from version {newest}'s: {admitted} rollouts admitted"
        )),
        "{out}"
    );
    let total: u64 = out
        .split("rollouts admitted ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no summary\n{out}"));
    assert!(
        total > admitted,
        "{total} admitted in all, {admitted} before the kill"
    );
    println!(
        "killed at v{reached}; resumed from v{newest} ({} versions lost); serving again {:.1} s \
         after the kill",
        reached - newest,
        back.as_secs_f64()
    );
}

/// Rank 0's process says `restart = "on-failure"`: the launcher starts every rank again,
/// resumed from the last checkpoint, and the run goes on to its stop rule by itself.
#[test]
fn the_launcher_restarts_a_run_whose_rank_0_died_from_its_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (topo, ckpt) = topology_file(dir.path(), 12, true);
    let launch = Launch::start(&topo, "batch-async");
    launch.wait_for(&["policy v7: "], Duration::from_secs(300));
    let killed_at = kill_rank_0(&launch);
    let (_, restart) = launch.wait_for(&["starting every rank again"], Duration::from_secs(60));
    let (newest, _) = newest_checkpoint(&ckpt);
    assert!(
        restart.contains(&format!(
            "from the checkpoint of version {newest} (run restart 1 of 3)"
        )),
        "{restart}"
    );
    let want = format!("(resumed from version {newest})");
    let (served_at, _) = launch.wait_for(&[&want], Duration::from_secs(120));
    let (status, out) = launch.finish(Duration::from_secs(300));
    assert!(status.success(), "{status}\n{out}");
    assert_eq!(last_version(&out), 12, "{out}");
    println!(
        "rank 0 killed after v7; every rank started again from v{newest}, serving {:.1} s after \
         the kill",
        served_at.duration_since(killed_at).as_secs_f64()
    );
}

#[test]
fn resume_refuses_a_damaged_or_missing_checkpoint_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (topo, ckpt) = topology_file(dir.path(), 4, false);
    // nothing to resume from: refused, not a fresh start
    let (status, out) =
        Launch::start_with(&topo, "batch-async", &["--resume"]).finish(Duration::from_secs(120));
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("no checkpoint version that every model has"),
        "{out}"
    );
    assert!(out.contains("without --resume"), "{out}");
    assert!(
        !out.contains("policy v2: "),
        "a run told to resume started from zero\n{out}"
    );
    // a run that checkpoints v3, then a truncated v3
    let (status, out) = Launch::start(&topo, "batch-async").finish(Duration::from_secs(300));
    assert!(status.success(), "{status}\n{out}");
    let file = ckpt.join("policy").join("v3.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let (status, out) =
        Launch::start_with(&topo, "batch-async", &["--resume"]).finish(Duration::from_secs(120));
    assert!(!status.success(), "{out}");
    assert!(
        out.contains(&format!("checkpoint {} is unusable", file.display())),
        "{out}"
    );
    // a topology without [checkpoint] has nothing to resume from
    let plain = shipped_topology(dir.path(), "cartpole-processes.toml", "cartpole", &[]);
    let (status, out) =
        Launch::start_with(&plain, "batch-async", &["--resume"]).finish(Duration::from_secs(60));
    assert!(!status.success(), "{out}");
    assert!(out.contains("has no [checkpoint] section"), "{out}");
}

/// The generating topology resumes the same way: the GRPO learner's policy and optimiser
/// come back, the generating engines serve the version after the checkpoint.
#[test]
fn the_grpo_topology_resumes_from_its_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let topo = shipped_topology(dir.path(), "grpo-processes.toml", "grpo", &[]);
    let ckpt = dir.path().join("ckpt");
    let args = |updates: &str| -> Vec<String> {
        [
            "--set",
            &format!("checkpoint.dir={}", ckpt.display()),
            "--set",
            "checkpoint.every=2",
            "--set",
            &format!("stop.max_updates={updates}"),
            "--set",
            "model.policy.params.min_len=3",
            "--set",
            "model.policy.params.max_len=3",
            "--set",
            "model.policy.params.heldout=16",
        ]
        .map(String::from)
        .to_vec()
    };
    let first = args("3");
    let first: Vec<&str> = first.iter().map(String::as_str).collect();
    let (_, out) =
        Launch::start_with(&topo, "batch-async", &first).finish(Duration::from_secs(300));
    // not solved in 3 updates (the example then exits 1), but ended by its stop rule
    assert!(out.contains("solved: policy held-out reward"), "{out}");
    assert!(out.contains("policy/v4.safetensors"), "{out}");
    let mut again = args("6");
    again.push("--resume".into());
    let again: Vec<&str> = again.iter().map(String::as_str).collect();
    let (_, out) =
        Launch::start_with(&topo, "batch-async", &again).finish(Duration::from_secs(300));
    assert!(
        out.contains("version 5 serves on 2 engines (resumed from version 4)"),
        "{out}"
    );
    assert!(out.contains("policy v7: "), "{out}");
    assert!(!out.contains("policy v2: "), "{out}");
    assert_eq!(last_version(&out), 7, "{out}");
}

/// SIGTERM (what a scheduler sends before preempting a job) saves the trainer's state on
/// the way out, whatever `every` says: the run resumes from the version it had reached.
#[test]
fn sigterm_saves_a_checkpoint_on_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let (topo, ckpt) = topology_file(dir.path(), 1000, false);
    let text = std::fs::read_to_string(&topo)
        .unwrap()
        .replace("every = 3", "every = 1000");
    std::fs::write(&topo, text).unwrap();
    let launch = Launch::start(&topo, "batch-async");
    launch.wait_for(&["policy v5: "], Duration::from_secs(300));
    // SAFETY: kill has no memory-safety preconditions; the pid is our unreaped child's.
    let sent = unsafe { libc::kill(launch.child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(sent, 0);
    let (_, out) = launch.finish(Duration::from_secs(60));
    let (_, line) = out
        .lines()
        .enumerate()
        .find(|(_, l)| l.contains("on the way out"))
        .unwrap_or_else(|| panic!("no checkpoint on the way out:\n{out}"));
    let (saved, _) = newest_checkpoint(&ckpt);
    assert!(saved >= 5, "{line}");
    assert!(line.contains(&format!("v{saved}.safetensors")), "{line}");
    let (topo, _) = topology_file(dir.path(), saved + 2, false);
    let (status, out) =
        Launch::start_with(&topo, "batch-async", &["--resume"]).finish(Duration::from_secs(300));
    assert!(status.success(), "{status}\n{out}");
    assert!(
        out.contains(&format!("(resumed from version {saved})")),
        "{out}"
    );
}
