//! Subcommands of the `refit` tool.

mod bench;
mod stats;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Refit: move fresh model weights from trainers to everything that runs the policy.
#[derive(Debug, Parser)]
#[command(name = "refit", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure every transport against physical baselines (memcpy, loopback TCP) in one run.
    Bench(bench::BenchArgs),
    /// Internal: a benchmark receiver process (spawned by `refit bench`).
    #[command(name = "__bench-child", hide = true)]
    BenchChild(bench::ChildArgs),
}

pub(crate) fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench::run(&args),
        Command::BenchChild(args) => bench::child(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("refit: error: {e}");
            ExitCode::FAILURE
        }
    }
}
