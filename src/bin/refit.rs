//! `refit`: the command-line tool (benchmarks; nodes, serving and pulling weights).

#[path = "../cli/mod.rs"]
mod cli;

fn main() -> std::process::ExitCode {
    // logging (`RUST_LOG`), and SIGINT/SIGTERM releasing shared memory before exiting
    if let Err(e) = refit::init() {
        eprintln!("refit: error: {e}");
        return std::process::ExitCode::FAILURE;
    }
    cli::main()
}
