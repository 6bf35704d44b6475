//! Checkpoint and resume as a user runs them: the real `refit launch` on
//! `examples/topologies/cartpole-resume.toml` (its command pointed at this build's cartpole
//! example). Rank 0, which holds the trainer, is killed mid-run; `--resume` goes on from the
//! last checkpoint (the versions lost are at most one checkpoint interval); a damaged or
//! missing checkpoint is refused naming the file, never replaced by a fresh start.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod common;
use common::launch::{Launch, shipped_topology};

/// The shipped file, checkpointing every 3 versions into `dir/ckpt`, stopping after
/// `updates` updates.
fn topology_file(dir: &Path, updates: u64) -> (PathBuf, PathBuf) {
    let ckpt = dir.join("ckpt");
    let topo = shipped_topology(
        dir,
        "cartpole-resume.toml",
        "cartpole",
        &[
            ("dir", format!("{:?}", ckpt.display().to_string())),
            ("every", "3".into()),
            ("target_return", "100000.0".into()),
            ("max_updates", updates.to_string()),
        ],
    );
    (topo, ckpt)
}

/// Whether the run ended by its stop rule: the summary printed (CartPole is not solved in a
/// few updates, and the example says so with status 1).
fn ended_by_its_stop_rule(status: std::process::ExitStatus, out: &str) -> bool {
    (status.success() || status.code() == Some(1)) && out.contains("solved: policy (")
}

/// The version of the last `policy vN: ` update line in `out`.
fn last_version(out: &str) -> u64 {
    out.lines()
        .filter_map(|l| l.split("policy v").nth(1)?.split(':').next()?.parse().ok())
        .max()
        .unwrap_or(0)
}

#[test]
fn a_run_whose_rank_0_is_killed_resumes_from_its_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (topo, ckpt) = topology_file(dir.path(), 1000);
    let launch = Launch::start(&topo, "batch-async");
    // checkpoints at v3 and v6 are written before v7 is published
    launch.wait_for(&["policy v7: "], Duration::from_secs(300));
    let (_, started) = launch.wait_for(&["started rank 0"], Duration::from_secs(1));
    let pid = started
        .split("(pid ")
        .nth(1)
        .and_then(|p| p.trim_end_matches(')').parse::<i32>().ok())
        .unwrap();
    // SAFETY: kill has no memory-safety preconditions; the pid is rank 0's, a child of the
    // launcher we started and still running.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let killed_at = Instant::now();
    let (status, out) = launch.finish(Duration::from_secs(60));
    assert!(!status.success(), "{out}");
    let reached = last_version(&out);
    let saved: Vec<String> = std::fs::read_dir(ckpt.join("policy"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let newest = saved
        .iter()
        .filter_map(|n| {
            n.strip_prefix('v')?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()
        })
        .max()
        .unwrap_or(0u64);
    assert!(saved.len() <= 2, "keep = 2: {saved:?}");
    assert!(newest >= 6 && newest % 3 == 0, "{saved:?}\n{out}");
    // at most one interval lost
    assert!(
        reached - newest < 3 + 1,
        "reached v{reached}, newest checkpoint v{newest}"
    );

    // the same command with --resume: the run goes on from there, and stops 3 updates on
    let (topo, _) = topology_file(dir.path(), 3);
    let launch = Launch::start_with(&topo, "batch-async", &["--resume"]);
    let want = format!(
        "version {} serves on 2 engines (resumed from version {newest})",
        newest + 1
    );
    launch.wait_for(&[&want], Duration::from_secs(120));
    let back = killed_at.elapsed();
    let (status, out) = launch.finish(Duration::from_secs(300));
    assert!(ended_by_its_stop_rule(status, &out), "{status}\n{out}");
    assert!(
        out.contains(&format!("model `policy` resumed from version {newest}")),
        "{out}"
    );
    // the updates go on from the checkpoint's version: never from v1 again
    assert!(out.contains(&format!("policy v{}: ", newest + 2)), "{out}");
    assert!(!out.contains("policy v2: "), "{out}");
    assert_eq!(last_version(&out), newest + 4, "{out}");
    println!(
        "killed at v{reached}; resumed from v{newest} ({} versions lost); serving again {:.1} s \
         after the kill",
        reached - newest,
        back.as_secs_f64()
    );
}

#[test]
fn resume_refuses_a_damaged_or_missing_checkpoint_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (topo, ckpt) = topology_file(dir.path(), 3);
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
    assert!(ended_by_its_stop_rule(status, &out), "{status}\n{out}");
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
