//! GRPO through the shipped generating topology, run as a user runs it: the real `refit
//! launch` on `examples/topologies/grpo-processes.toml` (its command pointed at this
//! build's grpo example; a shorter task so that a debug build finishes in about a minute):
//! a transformer trainer on rank 0 and two generating engines fed over shared memory in
//! their own layout learn digit reversal from scratch, in each sync mode (one of them with a
//! KL term to a reference the engines serve), and nothing is left behind.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::time::Duration;

mod common;
use common::launch::{Launch, assert_clean, shipped_topology};

/// A shorter task, so that a debug build learns it in about a minute.
const SHORT: [&str; 8] = [
    "--set",
    "model.policy.params.min_len=3",
    "--set",
    "model.policy.params.max_len=3",
    "--set",
    "model.policy.params.heldout=64",
    "--set",
    "stop.target_eval=0.6",
];

/// `grpo-processes.toml` as shipped, with the command pointed at this build's example.
fn topology_file(dir: &Path) -> PathBuf {
    shipped_topology(dir, "grpo-processes.toml", "grpo", &[])
}

#[test]
fn grpo_learns_through_refit_launch_in_every_sync_mode() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology_file(dir.path());
    // the sync run also serves a KL reference on the engines beside the policy (refreshed
    // every 4 versions), each completion scored under it across the process boundary
    let reference = [
        "--set",
        "model.policy.params.reference_every=4",
        "--set",
        "model.policy.params.kl_coef=0.02",
    ];
    for (mode, more) in [
        ("fully-async", &[][..]),
        ("sync", &reference[..]),
        ("batch-async", &[][..]),
    ] {
        let mut args = SHORT.to_vec();
        args.extend_from_slice(more);
        let launch = Launch::start_with(&topo, mode, &args);
        let (status, out) = launch.finish(Duration::from_secs(900));
        assert!(status.success(), "{mode}: {status}\n{out}");
        let solved = out
            .lines()
            .find(|l| l.contains("solved: policy held-out reward"))
            .unwrap_or_else(|| panic!("{mode}: no report\n{out}"));
        // "held-out reward (greedy) A -> B in N updates"
        let rewards: Vec<f64> = solved
            .split("reward (greedy) ")
            .nth(1)
            .unwrap()
            .split(" in ")
            .next()
            .unwrap()
            .split(" -> ")
            .map(|v| v.trim().parse().unwrap())
            .collect();
        assert!(rewards[0] <= 0.3 && rewards[1] >= 0.6, "{mode}: {solved}");
        // each engine loaded versions, swapped in at step boundaries, and generated
        for r in [1, 2] {
            assert!(
                out.contains(&format!("rank {r} (process `engine`, replica {})", r - 1))
                    && out.contains("model `policy` weights over shm"),
                "{mode}\n{out}"
            );
        }
        assert!(out.contains("mean reward"), "{mode}\n{out}");
        assert!(out.contains("engine pauses"), "{mode}\n{out}");
        if mode == "sync" {
            assert!(out.contains("mean 0.00, 0 dropped"), "{mode}\n{out}");
        }
        assert_clean(&out);
    }
}

/// The engines behind the backend contract (`grpo-backend.toml`: the path a vLLM or Python
/// engine takes): the run learns as with Refit's own generating engines, every completion
/// labelled with the versions that made it, each engine's pause reported. Under
/// `pause_mode = "abort"` each commit interrupts the engine's running batch: the report
/// counts the sequences aborted (asked again by the rollout workers), and the run learns.
#[test]
fn grpo_learns_with_backend_engines_under_refit_launch() {
    let dir = tempfile::tempdir().unwrap();
    let topo = shipped_topology(dir.path(), "grpo-backend.toml", "grpo", &[]);
    let text = std::fs::read_to_string(&topo).unwrap();
    assert!(text.contains("\"topology\", \"--backend\"]"), "{text}");
    for pause in ["keep", "abort"] {
        let mut args = SHORT.to_vec();
        let set = format!("sync.pause_mode={pause}");
        args.extend(["--set", &set]);
        let launch = Launch::start_with(&topo, "batch-async", &args);
        let (status, out) = launch.finish(Duration::from_secs(900));
        assert!(status.success(), "{pause}: {status}\n{out}");
        assert!(out.contains("solved: policy held-out reward"), "{out}");
        assert!(out.contains("engine pauses"), "{out}");
        assert!(out.contains("mean reward"), "{out}");
        let aborted: u64 = out
            .lines()
            .filter_map(|l| l.split("tokens; ").nth(1))
            .filter_map(|t| t.split(' ').next()?.parse::<u64>().ok())
            .sum();
        assert_eq!(
            aborted > 0,
            pause == "abort",
            "{pause}: {aborted} aborted\n{out}"
        );
        assert_clean(&out);
    }
}
