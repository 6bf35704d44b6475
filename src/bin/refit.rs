//! `refit`: the command-line tool (benchmarks; nodes, serving and pulling weights).

#[path = "../cli/mod.rs"]
mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
