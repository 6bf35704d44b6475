//! A generating run's report as the lines a person reads at the end of a run: the held-out
//! reward from first to last and by wall time, the fences, the staleness of what was
//! trained, and each engine's pauses.

use std::fmt::Write;

use refit_runtime::sync_policy::StalenessStats;

use super::report::RunReport;

impl RunReport {
    /// The end-of-run summary of a generating run (one line per fact, ending with a
    /// newline): what `grpo` and a Python trainer rank print on rank 0. `allowed` is the
    /// staleness the pool allowed ([`SyncConfig::allowed_staleness`]), to say why samples
    /// were dropped.
    ///
    /// [`SyncConfig::allowed_staleness`]: refit_runtime::sync_policy::SyncConfig::allowed_staleness
    pub fn summary(&self, allowed: Option<u64>) -> String {
        let mut out = String::new();
        for (model, r) in &self.models {
            let first = r.evals.first().and_then(|e| e.models.get(model));
            let last = r.evals.last().and_then(|e| e.models.get(model));
            let _ = writeln!(
                out,
                "{}: {model} held-out reward (greedy) {:.3} -> {:.3} in {} updates, {:.1} s wall",
                if self.solved { "solved" } else { "NOT solved" },
                first.map_or(f64::NAN, |m| m.mean_return),
                last.map_or(f64::NAN, |m| m.mean_return),
                r.updates.len(),
                self.elapsed.as_secs_f64(),
            );
            let at: Vec<String> = r
                .evals
                .iter()
                .filter_map(|e| {
                    let u = r.updates.iter().find(|u| u.published == e.step)?;
                    let m = e.models.get(model)?;
                    Some(format!(
                        "{:.1}s:{:.2}",
                        u.elapsed.as_secs_f64(),
                        m.mean_return
                    ))
                })
                .collect();
            let _ = writeln!(
                out,
                "held-out reward (greedy) by wall time: {}",
                at.join(" ")
            );
            if let Some(line) = self
                .controller
                .models
                .get(model)
                .and_then(|c| c.fences_line())
            {
                let _ = writeln!(out, "{model}: {line}");
            }
            let hist = &r.staleness.histogram;
            let total: u64 = hist.values().sum();
            let _ = writeln!(
                out,
                "staleness of trained completions (trainer version - oldest token's version): \
                 mean {:.2}, {}",
                r.staleness.mean_kept(),
                StalenessStats::dropped_words(r.staleness.dropped, allowed)
            );
            for (s, n) in hist {
                let _ = writeln!(
                    out,
                    "  {s:>2}: {n:>7} completions ({:>5.1}%)",
                    100.0 * *n as f64 / total.max(1) as f64
                );
            }
            let mixed: usize = r.updates.iter().map(|u| u.mixed).sum();
            if mixed > 0 {
                let _ = writeln!(
                    out,
                    "{model}: {mixed} trained completions carried two or more versions (an \
                     update landed inside them)"
                );
            }
        }
        let _ = writeln!(
            out,
            "engine pauses (the time no token was produced because of an update):"
        );
        for r in &self.ranks {
            let e = &r.engine;
            let _ = writeln!(
                out,
                "  rank {} (incarnation {}): {} loads, pause mean {:.1} us, max {:.1} us; \
                 staged beside generation {:.1} ms mean; {} tokens; {} sequences aborted",
                r.rank,
                r.incarnation,
                e.loads,
                e.paused_total.as_secs_f64() * 1e6 / e.loads.max(1) as f64,
                e.paused_max.as_secs_f64() * 1e6,
                e.staged_total.as_secs_f64() * 1e3 / e.loads.max(1) as f64,
                e.tokens,
                e.aborted
            );
        }
        out
    }
}
