//! `refit bench --engine-pause`: a generating engine's pause per update, beside the
//! transport's time for the same bytes, a decoding step and `memcpy`, all in one run.

use std::time::Duration;

use crate::engine::{self, EngineFigures, PauseBenchConfig, SizeFigures};
use refit_actors::generation::PauseMode;
use serde::Serialize;

use crate::links::BenchArgs;
use crate::stats::{Summary, fmt_secs};

use crate::links::BoxResult;

/// One figure: samples over the timed updates, with its ratios to figures of the same run.
#[derive(Debug, Clone, Serialize)]
struct PauseRow {
    /// Bytes of the engine's layout (what the link moves).
    bytes: usize,
    link: String,
    mode: String,
    metric: String,
    seconds: Summary,
    /// `(name of the other figure, this median / its median)`.
    ratios: Vec<Ratio>,
}

#[derive(Debug, Clone, Serialize)]
struct Ratio {
    to: String,
    ratio: f64,
}

/// What the rows cannot say: the load each engine ran under.
#[derive(Debug, Clone, Serialize)]
struct EngineLoad {
    bytes: usize,
    link: String,
    mode: String,
    /// Requests the clients kept decoding.
    requests: usize,
    /// Sequences running when each load was asked.
    running: Vec<usize>,
    /// Sequences each swap aborted (abort mode).
    aborted: Vec<u64>,
    /// Tokens generated during each load.
    tokens_in_load: Vec<u64>,
}

#[derive(Debug, Serialize)]
struct Report {
    rows: Vec<PauseRow>,
    engines: Vec<EngineLoad>,
}

pub(crate) fn run(args: &BenchArgs, e: &crate::links::EngineArgs) -> BoxResult<()> {
    let modes = e
        .engine_modes
        .iter()
        .map(|m| PauseMode::parse(m))
        .collect::<Result<Vec<_>, _>>()?;
    for l in &e.engine_transports {
        refit_transports::link::find(l)?;
    }
    let cfg = PauseBenchConfig {
        sizes: e.engine_sizes.clone(),
        links: e.engine_transports.clone(),
        modes,
        updates: args.iters,
        warmup: e.engine_warmup,
        requests: e.engine_requests,
        max_tokens: e.engine_tokens,
        threads: e.engine_threads,
    };
    let figures = engine::run(&cfg, &mut |line| eprintln!("refit bench: {line}"))?;
    let report = Report {
        rows: figures.iter().flat_map(rows).collect(),
        engines: figures.iter().flat_map(loads).collect(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print(&figures, &report, &cfg);
    }
    Ok(())
}

fn summary(samples: &[Duration]) -> Summary {
    Summary::of(samples)
}

fn rows(size: &SizeFigures) -> Vec<PauseRow> {
    let bytes = size.wire_bytes;
    let row = |link: &str, mode: &str, metric: &str, s: Summary, ratios: &[(&str, f64)]| PauseRow {
        bytes,
        link: link.into(),
        mode: mode.into(),
        metric: metric.into(),
        seconds: s,
        ratios: ratios
            .iter()
            .map(|(to, base)| Ratio {
                to: (*to).into(),
                ratio: s.median / base,
            })
            .collect(),
    };
    let memcpy = summary(&size.memcpy);
    let mut out = vec![row("-", "-", "memcpy", memcpy, &[])];
    if size.split_threads > 1 {
        let metric = format!("memcpy ({} threads)", size.split_threads);
        let s = summary(&size.memcpy_split);
        out.push(row("-", "-", &metric, s, &[("memcpy", memcpy.median)]));
    }
    let m = ("memcpy", memcpy.median);
    for t in &size.transports {
        let moved = summary(&t.moved());
        out.push(row(
            &t.link,
            "-",
            "transport: publish",
            summary(&t.publish),
            &[m],
        ));
        out.push(row(
            &t.link,
            "-",
            "transport: fetch",
            summary(&t.fetch),
            &[m],
        ));
        out.push(row(&t.link, "-", "transport: moved", moved, &[m]));
    }
    for e in &size.engines {
        let transport = size
            .transports
            .iter()
            .find(|t| t.link == e.link)
            .map_or(f64::NAN, |t| summary(&t.moved()).median);
        let tr = ("transport", transport);
        let step = summary(&e.each(|u| u.step));
        let st = ("step", step.median);
        let (link, mode) = (e.link.as_str(), e.mode.as_str());
        let in_load: Vec<Duration> = e.updates.iter().filter_map(|u| u.step_in_load).collect();
        out.extend([
            row(link, mode, "decode step", step, &[]),
            row(
                link,
                mode,
                "pause",
                summary(&e.each(|u| u.paused)),
                &[st, tr],
            ),
            row(
                link,
                mode,
                "staging (fetch+stage)",
                summary(&e.each(|u| u.staged)),
                &[tr, st],
            ),
            row(link, mode, "decode step in load", summary(&in_load), &[st]),
            row(
                link,
                mode,
                "load (asked..served)",
                summary(&e.each(|u| u.load)),
                &[st],
            ),
            row(
                link,
                mode,
                "publish (convert+link)",
                summary(&e.each(|u| u.publish)),
                &[tr],
            ),
            row(
                link,
                mode,
                "  convert",
                summary(&e.each(|u| u.convert)),
                &[m],
            ),
        ]);
        if e.mode == PauseMode::Wait {
            out.push(row(
                link,
                mode,
                "  drain",
                summary(&e.each(|u| u.drained)),
                &[st],
            ));
        }
    }
    out
}

fn loads(size: &SizeFigures) -> Vec<EngineLoad> {
    size.engines
        .iter()
        .map(|e: &EngineFigures| EngineLoad {
            bytes: size.wire_bytes,
            link: e.link.clone(),
            mode: e.mode.as_str().into(),
            requests: e.requests,
            running: e.each(|u| u.running),
            aborted: e.each(|u| u.aborted),
            tokens_in_load: e.each(|u| u.tokens_in_load),
        })
        .collect()
}

fn print(figures: &[SizeFigures], report: &Report, cfg: &PauseBenchConfig) {
    println!(
        "engine pause per update: a TransformerGenerator engine fed through the link, the \
         trainer's f32 converted to the engine's layout (fused qkv, bf16) on the send path, \
         {} requests decoding; {} timed updates after {} untimed",
        cfg.requests, cfg.updates, cfg.warmup
    );
    for size in figures {
        let c = &size.config;
        println!();
        println!(
            "model: {} layers of width {}, {:.1}M parameters: {} in the engine's layout \
             (moved), {} served (f32)",
            c.layers,
            c.d_model,
            c.params() as f64 / 1e6,
            fmt_mib(size.wire_bytes),
            fmt_mib(size.trainer_bytes)
        );
        println!(
            "{:<8} {:<6} {:<24} {:>2} {:>11} {:>11} {:>11}   ratios of the median",
            "link", "mode", "metric", "n", "min", "median", "max"
        );
        for r in report.rows.iter().filter(|r| r.bytes == size.wire_bytes) {
            let ratios: Vec<String> = r
                .ratios
                .iter()
                .map(|x| format!("{} x {}", fmt_ratio(x.ratio), x.to))
                .collect();
            println!(
                "{:<8} {:<6} {:<24} {:>2} {:>11} {:>11} {:>11}   {}",
                r.link,
                r.mode,
                r.metric,
                r.seconds.samples,
                fmt_secs(r.seconds.min),
                fmt_secs(r.seconds.median),
                fmt_secs(r.seconds.max),
                ratios.join(", ")
            );
        }
        for l in report.engines.iter().filter(|l| l.bytes == size.wire_bytes) {
            let abort = if l.mode == PauseMode::Abort.as_str() {
                format!(", sequences aborted per swap {:?}", l.aborted)
            } else {
                String::new()
            };
            println!(
                "  {} {}: sequences running when each load was asked {:?} (of {}), tokens \
                 generated during each load {:?}{abort}",
                l.link, l.mode, l.running, l.requests, l.tokens_in_load
            );
        }
    }
}

/// Bytes in MiB with one decimal (the models' sizes are not round).
fn fmt_mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

/// A ratio with three significant digits.
fn fmt_ratio(x: f64) -> String {
    if !x.is_finite() {
        "-".into()
    } else if x == 0.0 || x >= 100.0 {
        format!("{x:.0}")
    } else {
        let digits = (2 - x.abs().log10().floor() as i32).max(0) as usize;
        format!("{x:.digits$}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_keep_three_digits() {
        assert_eq!(fmt_ratio(0.000_012_34), "0.0000123");
        assert_eq!(fmt_ratio(1.234), "1.23");
        assert_eq!(fmt_ratio(12.34), "12.3");
        assert_eq!(fmt_ratio(1234.0), "1234");
        assert_eq!(fmt_ratio(f64::NAN), "-");
    }
}
