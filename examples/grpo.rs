//! GRPO on digit reversal: a small transformer learns, from scratch, to write a string of
//! digits backwards, served by generating engines that stage every new version beside
//! generation and swap it in at a decoding step's boundary.
//!
//! ```text
//! cargo build --release --example grpo --bin refit
//! target/release/refit launch examples/topologies/grpo-processes.toml   # 3 processes, shm
//! cargo run --release --example grpo -- [--sync-mode batch-async] [--max-time-s 600]
//! ```
//!
//! `grpo topology` is one rank of a topology file, as `refit launch` starts it: rank 0
//! (trainer, controller, evaluator) prints one line per update (mean reward, tokens per
//! second of the engines, the versions the batch was sampled under, each engine's pause per
//! load) and at the end the held-out curve, the staleness histogram and a pause summary.
//! Without `topology` the same run happens in one process (every reference local, weights
//! through the in-process link). `grpo topology --backend` runs an engine rank's generator
//! behind the backend contract (`refit_actors::actor::EngineBackend`), the path a vLLM or
//! Python engine takes (`examples/topologies/grpo-backend.toml`). `grpo scores DIR` writes a
//! version in the engines' layout and the scores Refit's generator gives a few sequences,
//! which an engine written elsewhere is checked against.
//!
//! The run stops once the mean reward on held-out prompts (greedy) reaches `[stop]
//! target_eval` (0.9), or its budget is spent (exit status 1).

use std::time::Duration;

use clap::{Parser, Subcommand};
use refit_actors::actor::GeneratorBackend;
use refit_actors::run::{self, RunConfig, RunReport, StopRule};
use refit_actors::{GenRoles, GrpoRoles, ModelSpec, policy_model_id};
use refit_node::LaunchEnv;
use refit_runtime::sync_policy::{PauseMode, SyncConfig, SyncMode};

/// GRPO on digit reversal through generating engines (one process, or a topology rank).
#[derive(Parser, Debug)]
#[command(long_about = None, args_conflicts_with_subcommands = true)]
struct Args {
    /// sync, batch-async or fully-async.
    #[arg(long, default_value = "batch-async", value_parser = parse_mode)]
    sync_mode: SyncMode,
    /// batch-async: rollouts wait while the trainer is this many versions ahead.
    #[arg(long, default_value_t = 1)]
    staleness_threshold: u64,
    /// What engines do with sequences in flight at a swap: abort, wait or keep.
    #[arg(long, default_value = "keep", value_parser = parse_pause)]
    pause_mode: PauseMode,
    /// Rollout workers.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Held-out reward that counts as solved.
    #[arg(long, default_value_t = 0.9)]
    target: f64,
    /// Time budget in seconds (`[stop] max_time_s` of a topology file).
    #[arg(
        long = "max-time-s",
        visible_alias = "max-seconds",
        default_value_t = 600.0
    )]
    max_time_s: f64,
    /// Update budget.
    #[arg(long, default_value_t = 400)]
    max_updates: u64,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(subcommand)]
    command: Option<Sub>,
}

#[derive(Subcommand, Debug)]
enum Sub {
    /// One rank of a topology file, as `refit launch` starts it (`REFIT_TOPOLOGY`, the
    /// launch variables, `--set` overrides in `REFIT_SET`).
    Topology {
        /// Serve this rank's engine through the backend contract (a `BackendEngine` of
        /// the generator) instead of Refit's generating engine.
        #[arg(long)]
        backend: bool,
    },
    /// Writes a version of the policy in the engines' layout (`DIR/engine.safetensors`) and
    /// the log-probability Refit's generator gives each token of a few sequences after its
    /// prefix (`DIR/scores.json`): what an engine of the same model written elsewhere
    /// (PyTorch, vLLM) is checked against.
    Scores {
        /// Where the two files go.
        dir: std::path::PathBuf,
        /// A key of the model's params (`heads=2`), as a topology's `[model.params]` and
        /// read as `--set` reads a value; repeated for several.
        #[arg(long = "param", value_name = "KEY=VALUE")]
        params: Vec<String>,
    },
}

fn parse_mode(s: &str) -> Result<SyncMode, String> {
    SyncMode::parse(s).map_err(|e| e.to_string())
}

fn parse_pause(s: &str) -> Result<PauseMode, String> {
    PauseMode::parse(s).map_err(|e| e.to_string())
}

/// Runs [`run`]; an error is one `error: ...` line (what `refit launch` repeats).
fn main() -> std::process::ExitCode {
    refit::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // candle runs element-wise ops of large tensors on a process-wide pool whose idle
        // workers spin; on a small machine shared by the trainer and the engines that costs
        // more than it gains (3x the training time on two cores)
        // SAFETY: no other thread exists yet (nothing has been spawned), so nothing reads
        // the environment concurrently.
        unsafe { std::env::set_var("CANDLE_NUM_THREADS", "1") };
    }
    // logging and SIGINT/SIGTERM handling (starts a thread: after the environment is set)
    refit::init()?;
    // the staleness the pool allows, to say why samples were dropped
    let (report, allowed) = match args.command {
        Some(Sub::Topology { backend }) => {
            let topology = refit_node::launch::load_topology()?;
            let launch = LaunchEnv::from_env()?;
            let joined = if backend {
                // ANCHOR: backend
                let roles = GrpoRoles::new();
                let mut engine = GeneratorBackend::new();
                for spec in run::model_specs(&topology)? {
                    let (generator, stager) = (roles.generator(&spec)?, roles.generator(&spec)?);
                    engine = engine.with_model(spec.id.clone(), generator, stager, 64)?;
                }
                run::join_backend(&topology, &launch, roles, engine)?
                // ANCHOR_END: backend
            } else {
                run::join_generating(&topology, &launch, GrpoRoles::new())?
            };
            match joined {
                Some(report) => (report, topology.sync.allowed_staleness()),
                None => return Ok(()),
            }
        }
        Some(Sub::Scores { dir, params }) => return write_scores(&dir, &params, args.seed),
        None => {
            let mut sync = SyncConfig::with_mode(args.sync_mode);
            sync.staleness_threshold = args.staleness_threshold;
            (one_process(&args)?, sync.allowed_staleness())
        }
    };
    print!("{}", report.summary(allowed));
    if !report.solved {
        run::exit_unsolved();
    }
    Ok(())
}

// ANCHOR: one_process
/// The same run in one process: the model's settings as the topology file gives them.
fn one_process(args: &Args) -> Result<RunReport, Box<dyn std::error::Error>> {
    let mut spec = ModelSpec::new(policy_model_id(), args.seed);
    spec.workers = args.workers;
    spec.batch_frames = 128; // completions: 16 prompts x 8
    spec.group_size = 8;
    spec.prompts_per_fragment = 4;
    let mut sync = SyncConfig::with_mode(args.sync_mode);
    sync.staleness_threshold = args.staleness_threshold;
    sync.validate_freq = 5;
    sync.pause_mode = args.pause_mode;
    let cfg = RunConfig {
        sync,
        models: vec![spec],
        eval_episodes: 0,
        stop: StopRule {
            max_updates: args.max_updates,
            target_return: None,
            target_eval: Some(args.target),
            max_time: Duration::from_secs_f64(args.max_time_s),
        },
        seed: args.seed,
        wrap_inlet: None,
        wait: Duration::from_secs(120),
    };
    Ok(actix_rt::System::new().block_on(run::run_generating(cfg, GrpoRoles::new()))?)
}
// ANCHOR_END: one_process

/// `grpo scores DIR`: see [`Sub::Scores`]. The learner's first version, its matrices scaled
/// up (a fresh model's logits are nearly flat: an engine computing something else would
/// still score close to them), converted to the engines' layout, staged in Refit's
/// generator, which scores a few sequences.
fn write_scores(
    dir: &std::path::Path,
    params: &[String],
    seed: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    use refit_actors::actor::EngineBackend;
    use refit_actors::generation::Generator;
    use refit_actors::protocol::engine::Score;

    let roles = GrpoRoles::new();
    let mut spec = ModelSpec::new(policy_model_id(), seed);
    for param in params {
        // `KEY=VALUE` read as `--set` reads it (TOML, or a string for a bare word)
        let set = refit_runtime::topology::Override::parse(param)?;
        spec.params
            .insert(set.key().to_owned(), set.value().clone());
    }
    let mut weights = roles.learner(&spec)?.export()?;
    let manifest = std::sync::Arc::clone(weights.manifest());
    for t in manifest.tensors().iter().filter(|t| t.shape.len() == 2) {
        weights
            .view_mut::<f32>(&t.name)?
            .iter_mut()
            .for_each(|w| *w *= 25.0);
    }
    let want = roles
        .want(&spec)?
        .ok_or("the GRPO roles convert to the engines' layout")?;
    let engine = refit_runtime::convert::Conversion::new(&manifest, &want)?.apply(&weights)?;
    std::fs::create_dir_all(dir)?;
    engine.write_safetensors(dir.join("engine.safetensors"))?;

    let generator = roles.generator(&spec)?;
    let vocab = u32::try_from(generator.vocab_size())?;
    let model = spec.id.clone();
    let backend = GeneratorBackend::new().with_model(
        model.clone(),
        generator,
        roles.generator(&spec)?,
        16,
    )?;
    let version = engine.version();
    backend.stage(std::sync::Arc::new(engine))?;
    backend.commit(&model, version)?;
    let batch: Vec<Score> = (0..4u32)
        .map(|s| Score {
            model: model.clone(),
            prompt: (0..3).map(|i| (s * 5 + i * 3 + 1) % vocab).collect(),
            tokens: (0..5).map(|i| (s * 7 + i * 2 + 2) % vocab).collect(),
            temperature: 1.0,
            epoch: None,
        })
        .collect();
    let served = std::collections::BTreeMap::from([(model.clone(), version)]);
    let mut sequences = Vec::new();
    for (req, answer) in batch.iter().zip(backend.score(&batch, &served)) {
        let scored = answer?;
        let list = |v: &[String]| v.join(", ");
        let ints = |v: &[u32]| list(&v.iter().map(u32::to_string).collect::<Vec<_>>());
        let floats: Vec<String> = scored.logprobs.iter().map(|p| format!("{p:.7}")).collect();
        sequences.push(format!(
            "{{\"prompt\": [{}], \"tokens\": [{}], \"logprobs\": [{}]}}",
            ints(&req.prompt),
            ints(&req.tokens),
            list(&floats)
        ));
    }
    let json = format!(
        "{{\"model\": \"{model}\", \"version\": {}, \"sequences\": [\n  {}\n]}}\n",
        version.get(),
        sequences.join(",\n  ")
    );
    std::fs::write(dir.join("scores.json"), json)?;
    println!(
        "wrote {} and {}",
        dir.join("engine.safetensors").display(),
        dir.join("scores.json").display()
    );
    Ok(())
}
