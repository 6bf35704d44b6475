//! `cartpole topology`: this program's rank of a topology file, as `refit launch` starts it.
//!
//! The launcher sets `REFIT_TOPOLOGY` (the file), `REFIT_SET` (its `--set` overrides),
//! `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and `REFIT_TOKEN`; every rank runs this
//! same function with the CartPole/PPO roles. Rank 0 (trainer, controller, evaluator) logs
//! each weight update as it happens and prints the report at the end: wall time, frames,
//! the staleness histogram, and what delivering each version to the engines took beside a
//! `memcpy` of the same bytes. `refit launch FILE --set sync.sync_mode=fully-async` changes the
//! file's `[sync] sync_mode` for one run (any key: see the topology-file chapter).

use refit_actors::run::{self, RunReport};
use refit_actors::{CartPolePpo, LearnStats};
use refit_node::LaunchEnv;
use refit_runtime::sync_policy::StalenessStats;
use refit_runtime::topology::Topology;

// ANCHOR: rank
/// Runs this process's rank of the topology in `REFIT_TOPOLOGY`; answers whether the run
/// solved CartPole (rank 0; a topology without a target to reach succeeds when it used up
/// its budget) or ended as told (the other ranks).
pub(crate) fn run_rank() -> Result<bool, Box<dyn std::error::Error>> {
    // the file in REFIT_TOPOLOGY with the overrides in REFIT_SET: what the launcher checked
    let topology = refit_node::launch::load_topology()?;
    let launch = LaunchEnv::from_env()?;
    match run::join(&topology, &launch, CartPolePpo::new())? {
        Some(report) => {
            print_report(&topology, &report);
            print_delivery(&report);
            let stop = topology.stop();
            let targeted = stop.target_return.is_some() || stop.target_eval.is_some();
            Ok(report.solved || !targeted)
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
        if c.damaged > 0 {
            println!(
                "{model}: {} loads found an engine serving weights changed after it applied \
                 them (verify = \"hashes\"); the last: {}",
                c.damaged,
                c.last_error.as_deref().unwrap_or("")
            );
        }
        if let Some(line) = c.fences_line() {
            println!("{model}: {line}");
        }
        let total: u64 = hist.values().sum();
        println!(
            "staleness of trained samples (trainer version - acting version): mean {:.2}, \
             {}",
            r.staleness.mean_kept(),
            StalenessStats::dropped_words(r.staleness.dropped, topology.sync.allowed_staleness())
        );
        for (s, n) in hist {
            println!(
                "  {s:>2}: {n:>7} frames ({:>5.1}%)",
                100.0 * *n as f64 / total.max(1) as f64
            );
        }
    }
}

/// The shortest copy whose time says something (a shorter one is mostly the clock's cost).
const MEASURABLE_S: f64 = 50e-6;

/// `seconds` as a person reads them (`0.3 us`, `4.2 ms`).
fn ms(seconds: f64) -> String {
    refit_runtime::units::duration(std::time::Duration::from_secs_f64(seconds.max(0.0)))
}

/// Rank 0's weight delivery per update, per model: the trainer's publish through its outlet
/// (over shared memory: the version written once into a slot and committed, whatever the
/// number of engines) plus the engines' fetch (mean per load), beside the fastest one-thread
/// simple copy of the same bytes measured here, now (`memcpy` or streaming stores); then
/// what the engines did with it (the apply into their policy, the model paused meanwhile)
/// and the trainer's export, apart.
fn print_delivery(report: &RunReport) {
    let loads = report.engine.loads.max(1) as f64;
    let fetch = report.engine.staged_total.as_secs_f64() / loads;
    let apply = report.engine.paused_total.as_secs_f64() / loads;
    for (model, r) in &report.models {
        let of =
            |key: &str| -> Vec<f64> { r.updates.iter().filter_map(|u| u.learn.get(key)).collect() };
        let (publish, export) = (of(LearnStats::PUBLISH_S), of(LearnStats::EXPORT_S));
        let Some(&bytes) = of(LearnStats::BYTES).last() else {
            continue;
        };
        let bytes = bytes as usize;
        let copies = refit_runtime::copy::fastest_copy(&vec![7u8; bytes], 3, 1);
        let memcpy = median(
            &copies
                .times()
                .iter()
                .map(|d| d.as_secs_f64())
                .collect::<Vec<_>>(),
        );
        let delivery = median(&publish) + fetch;
        // a copy this short is mostly the timer's own cost: no ratio is said for it
        let against = if memcpy >= MEASURABLE_S {
            format!(
                ", {:.2}x the fastest simple copy of the same bytes here ({}, {})",
                delivery / memcpy,
                copies.best.name(),
                ms(memcpy)
            )
        } else {
            String::new()
        };
        println!(
            "weights of {model}: {} per version; delivery per update (median of {}): \
             publish {} + engine fetch {} = {}{against}; engine apply {}, trainer export {}",
            refit_runtime::units::bytes(bytes as u64),
            publish.len(),
            ms(median(&publish)),
            ms(fetch),
            ms(delivery),
            ms(apply),
            ms(median(&export)),
        );
    }
}

/// The median of `v` (NaN when empty).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
