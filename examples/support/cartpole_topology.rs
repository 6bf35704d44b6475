//! `cartpole topology`: this program's rank of a topology file, as `refit launch` starts it.
//!
//! The launcher sets `REFIT_TOPOLOGY` (the file), `REFIT_SET` (its `--set` overrides),
//! `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and `REFIT_TOKEN`; every rank runs this
//! same function with the CartPole/PPO roles. Rank 0 (trainer, controller, evaluator) logs
//! each weight update as it happens and prints the report at the end: wall time, frames and
//! the staleness histogram. `refit launch FILE --set sync.sync_mode=fully-async` changes the
//! file's `[sync] sync_mode` for one run (any key: see the topology-file chapter).

use refit_actors::CartPolePpo;
use refit_actors::run::{self, RunReport};
use refit_node::LaunchEnv;
use refit_runtime::topology::Topology;

// ANCHOR: rank
/// Runs this process's rank of the topology in `REFIT_TOPOLOGY`; answers whether the run
/// solved CartPole (rank 0) or ended as told (the other ranks).
pub(crate) fn run_rank() -> Result<bool, Box<dyn std::error::Error>> {
    // the file in REFIT_TOPOLOGY with the overrides in REFIT_SET: what the launcher checked
    let topology = refit_node::launch::load_topology()?;
    let launch = LaunchEnv::from_env()?;
    match run::join(&topology, &launch, CartPolePpo::new())? {
        Some(report) => {
            print_report(&topology, &report);
            Ok(report.solved)
        }
        None => Ok(true),
    }
}
// ANCHOR_END: rank

/// Rank 0's summary: per model the wall time, frames, updates, mean return, and the
/// staleness histogram of the samples trained on.
fn print_report(topology: &Topology, report: &RunReport) {
    for (model, r) in &report.models {
        let hist = &r.staleness.histogram;
        let c = &report.controller.models[model];
        println!(
            "{}: {model} ({} mode) mean return {:.1} over the last 20 episodes; {} frames, \
             {} updates, {:.1} s wall; rollouts admitted {}, blocked {}; {} engine loads",
            if report.solved {
                "solved"
            } else {
                "NOT solved"
            },
            topology.sync.sync_mode,
            r.mean_return,
            r.frames,
            r.updates.len(),
            report.elapsed.as_secs_f64(),
            c.admissions,
            c.blocked,
            report.engine.loads,
        );
        let total: u64 = hist.values().sum();
        println!(
            "staleness of trained samples (trainer version - acting version): mean {:.2}, \
             {} dropped as too stale",
            r.staleness.mean_kept(),
            r.staleness.dropped
        );
        for (s, n) in hist {
            println!(
                "  {s:>2}: {n:>7} frames ({:>5.1}%)",
                100.0 * *n as f64 / total.max(1) as f64
            );
        }
    }
}
