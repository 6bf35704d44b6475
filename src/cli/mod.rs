//! Subcommands of the `refit` tool. `refit bench` is a shell over `refit_bench`, where the
//! benchmarks live.

mod launch;
mod metrics;
mod net;
mod reference;
mod status;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

/// Refit: move fresh model weights from trainers to everything that runs the policy.
#[derive(Debug, Parser)]
#[command(name = "refit", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure every transport against physical baselines (memcpy, loopback TCP) in one run;
    /// with --engine-pause, a generating engine's pause per update instead.
    Bench(refit_bench::BenchArgs),
    /// Start every rank of a topology file here and supervise them, or (with RANK/WORLD_SIZE,
    /// Slurm's variables or --rank) this machine's rank of a multi-host run.
    Launch(launch::LaunchArgs),
    /// Start a node: remote calls and a rendezvous store on TCP.
    Node(net::NodeArgs),
    /// Serve a safetensors file, or a Hugging Face model folder, as a sender agent.
    Serve(net::ServeArgs),
    /// Pull a model from a sender agent into a safetensors file (written atomically).
    Pull(net::PullArgs),
    /// Write a fresh cluster token to a new file only you can read (mode 0600).
    Token(net::TokenFileArgs),
    /// Report whether the CUDA driver and NCCL can be used, and the devices present.
    Probe,
    /// Print the ranks of a running `refit launch --status-addr`: process, state, restarts,
    /// health, failed updates and the versions each serves.
    Status(status::StatusArgs),
    /// Internal: a benchmark receiver process (spawned by `refit bench`).
    #[command(name = refit_bench::CHILD_COMMAND, hide = true)]
    BenchChild(refit_bench::ChildArgs),
    /// Internal: print the book's command-line reference page (Markdown).
    #[command(name = "__cli-reference", hide = true)]
    CliReference,
}

pub(crate) fn main() -> ExitCode {
    // the arguments first: `--help`, `--version` and a bad flag start nothing
    let cli = Cli::parse();
    if let Command::CliReference = cli.command {
        print!("{}", reference::page(Cli::command()));
        return ExitCode::SUCCESS;
    }
    // logging (`RUST_LOG`, `NO_COLOR`), and SIGINT/SIGTERM releasing shared memory before
    // exiting. Not `refit::init()`: a metrics page is served only by the commands that
    // take `--metrics-addr` (whose default is `REFIT_METRICS_ADDR`), never by the tool
    // itself
    refit::init_logging();
    if let Err(e) = refit::node::signals::install_signal_handlers() {
        eprintln!("refit: error: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Bench(args) => refit_bench::run(&args),
        Command::BenchChild(args) => refit_bench::child(&args),
        Command::Probe => probe(),
        Command::Status(a) => status::run(&a),
        Command::Launch(a) => return launch::run(&a),
        Command::Node(a) => return net::node(a),
        Command::Serve(a) => return net::serve(a),
        Command::Pull(a) => return net::pull(a),
        Command::Token(a) => return net::token_file(a),
        Command::CliReference => Ok(()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("refit: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn probe() -> Result<(), Box<dyn std::error::Error>> {
    use refit::transports::link::{LINKS, LinkOptions};
    let report = refit::transports::gpu::probe();
    if let Ok(report) = &report {
        for d in &report.devices {
            println!(
                "cuda device {}: {} ({:.1} GiB)",
                d.ordinal,
                d.name,
                d.total_memory as f64 / f64::from(1u32 << 30)
            );
        }
        println!(
            "nccl: {}",
            if report.nccl {
                "loadable"
            } else {
                "not found (libnccl.so)"
            }
        );
    }
    // every link of the factory, and whether this process can open it (the GPU links
    // answer with their reason: not compiled with CUDA, or the probe's)
    let options = LinkOptions::default();
    for l in LINKS {
        match l.usable(&options) {
            Ok(()) => println!("link {}: usable ({})", l.name(), l.reach()),
            Err(e) => println!("link {}: not usable: {e}", l.name()),
        }
    }
    report?;
    Ok(())
}
