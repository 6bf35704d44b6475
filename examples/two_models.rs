//! Two models trained by two trainers, served by one inference engine: a "solver" and a
//! "verifier" (here both CartPole policies; in an LLM pipeline the second would be a
//! reward or verifier model). The weight-sync controller keeps them in step with a version
//! barrier: on non-eval steps each model loads as soon as its trainer publishes; on eval
//! steps the barrier's leader pauses rollouts, cancels in-flight episodes, loads both
//! models in order, validates, and resumes.
//!
//! ```text
//! cargo run --release --example two_models -- [--updates 20] [--validate-freq 5]
//!     [--sync-mode sync|fully-async|batch-async] [--config sync.toml] [--seed 0]
//! ```

use std::time::Duration;

use clap::Parser;

use refit_actors::CartPolePpo;
use refit_actors::ModelSpec;
use refit_actors::actor::SyncEventKind;
use refit_actors::run::{self, RunConfig, StopRule};
use refit_runtime::ModelId;
use refit_runtime::sync_policy::{SyncConfig, SyncMode};

/// Two models (solver and verifier) trained by two trainers and served by one inference
/// engine, kept in step by the weight-sync controller's version barrier.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Args {
    /// Updates per model.
    #[arg(long, default_value_t = 20)]
    updates: u64,
    /// Every K-th version is an eval step (overrides the configuration's).
    #[arg(long)]
    validate_freq: Option<u64>,
    /// Sync mode: sync, batch-async or fully-async (overrides the configuration's).
    #[arg(long = "sync-mode", value_parser = parse_sync_mode)]
    mode: Option<SyncMode>,
    /// Sync configuration (TOML).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn parse_sync_mode(s: &str) -> Result<SyncMode, String> {
    SyncMode::parse(s).map_err(|e| e.to_string())
}

/// Runs [`run`]; an error is one `error: ...` line.
fn main() -> std::process::ExitCode {
    refit::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    refit::init()?;
    let args = Args::parse();
    // ANCHOR: config
    let mut sync = match &args.config {
        Some(path) => SyncConfig::from_file_text(&refit::read_config(path)?, path)?,
        None => SyncConfig::from_toml(
            r#"
            sync_mode = "fully-async"
            validate_freq = 5
            models = ["solver", "verifier"]
            "#,
        )?,
    };
    if let Some(mode) = args.mode {
        sync.sync_mode = mode;
    }
    if let Some(k) = args.validate_freq {
        sync.validate_freq = k;
    }
    let solver = ModelId::new("solver")?;
    let verifier = ModelId::new("verifier")?;
    let cfg = RunConfig {
        sync: sync.clone(),
        models: vec![
            ModelSpec::new(solver.clone(), args.seed),
            ModelSpec::new(verifier.clone(), args.seed + 1),
        ],
        eval_episodes: 8,
        stop: StopRule {
            target_eval: None,
            max_updates: args.updates,
            target_return: None,
            max_time: Duration::from_secs(300),
        },
        seed: args.seed,
        wrap_inlet: None,
        wait: Duration::from_secs(60),
    };
    let report = actix_rt::System::new().block_on(run::run(cfg, CartPolePpo::new()))?;
    // ANCHOR_END: config
    println!(
        "two models, sync mode {}, eval every {} versions, {} updates each, {:.1} s",
        sync.sync_mode,
        sync.validate_freq,
        args.updates,
        report.elapsed.as_secs_f64()
    );
    for e in &report.models[&solver].evals {
        let parts: Vec<String> = e
            .models
            .iter()
            .map(|(m, ev)| {
                let versions: Vec<String> = ev.versions.iter().map(|v| format!("v{v}")).collect();
                format!(
                    "{m} at {} mean return {:.1}",
                    versions.join(","),
                    ev.mean_return
                )
            })
            .collect();
        println!("eval at v{}: {}", e.step, parts.join("; "));
    }
    // The first eval round, as the controller recorded it.
    let events = &report.controller.events;
    if let Some(start) = events
        .iter()
        .position(|e| matches!(e.kind, SyncEventKind::Leader { eval: true, .. }))
    {
        let SyncEventKind::Leader { version, .. } = events[start].kind else {
            unreachable!("matched above")
        };
        println!("timeline of the eval round at v{version}:");
        let quiet = |e: &&refit_actors::actor::SyncEvent| {
            !matches!(
                e.kind,
                SyncEventKind::Admitted(_) | SyncEventKind::Blocked(_)
            )
        };
        let before: Vec<_> = events[..start].iter().filter(quiet).collect();
        let round = events[start..]
            .iter()
            .take_while(|e| e.kind != SyncEventKind::Released(version))
            .filter(quiet);
        for e in before[before.len().saturating_sub(4)..]
            .iter()
            .copied()
            .chain(round)
        {
            let who = e
                .model
                .as_ref()
                .map_or("-".to_string(), ToString::to_string);
            println!(
                "  {:>9.3} ms  {who:<9} {}",
                e.at.as_secs_f64() * 1e3,
                e.kind
            );
        }
    }
    for (m, s) in &report.controller.models {
        let r = &report.models[m];
        println!(
            "{m}: trained to v{}, engine serves v{}, {} loads ({} failed), mean return {:.1}, \
             trained-sample staleness mean {:.2} max {}, rollouts blocked {} of {} (eval pauses included)",
            s.train_version,
            s.rollout_version,
            s.loads,
            s.failed_loads,
            r.mean_return,
            r.staleness.mean_kept(),
            r.staleness.max_kept,
            s.blocked,
            s.admissions
        );
    }
    println!(
        "{} eval steps, every one with both models at the round's version; engine paused {:.2} ms over {} loads",
        report.controller.evals,
        report.engine.paused_total.as_secs_f64() * 1e3,
        report.engine.loads
    );
    Ok(())
}
