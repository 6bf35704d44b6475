//! GRPO on digit reversal in one process: a transformer learns the task from scratch.
//!
//! ```text
//! cargo run --release -p refit-rl --example grpo_local -- [key=value ...]
//! ```
//!
//! Keys of the run: `prompts` (prompts per batch, 16), `updates` (1000), `max_secs` (240),
//! `eval_every` (10), `stop_at` (0.9; `none` runs to the end), `seed` (0). Every other key is
//! a model parameter of `GrpoRoles` (`lr=0.003`, `group_size=8`, `d_model=64`, `max_len=5`,
//! `correction="truncated"`, ...). Prints the learning curve: held-out greedy reward against
//! wall time.
//!
//! candle runs element-wise ops on tensors of 64K elements or more on a process-wide pool
//! whose idle workers spin; on a small shared machine that costs more than it gains (3x the
//! training time on two cores), so the example runs itself again with `CANDLE_NUM_THREADS=1`
//! unless the variable is set.

use std::time::Duration;

use refit_rl::grpo_roles::GrpoRoles;
use refit_rl::local_grpo::{self, LocalConfig};
use refit_rl::{GenRoles, ModelSpec};
use refit_runtime::{Conversion, ModelId};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        let status = std::process::Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .env("CANDLE_NUM_THREADS", "1")
            .status()?;
        std::process::exit(status.code().unwrap_or(1));
    }
    let mut local = LocalConfig::default();
    let mut params = toml::Table::new();
    for arg in std::env::args().skip(1) {
        let (key, value) = arg
            .split_once('=')
            .ok_or_else(|| format!("argument `{arg}` is not key=value"))?;
        let num = |v: &str| -> Result<f64, String> {
            v.parse::<f64>().map_err(|e| format!("{key}: {e}"))
        };
        match key {
            "prompts" => local.prompts_per_batch = num(value)? as usize,
            "updates" => local.max_updates = num(value)? as usize,
            "max_secs" => local.max_time = Duration::from_secs_f64(num(value)?),
            "eval_every" => local.eval_every = num(value)? as usize,
            "stop_at" => {
                local.stop_at = (value != "none")
                    .then(|| num(value))
                    .transpose()?
                    .map(|v| v as f32)
            }
            "seed" => local.seed = num(value)? as u64,
            _ => {
                let v: toml::Table = toml::from_str(&format!("v = {value}"))
                    .or_else(|_| toml::from_str(&format!("v = \"{value}\"")))?;
                params.insert(key.to_string(), v["v"].clone());
            }
        }
    }
    let roles = GrpoRoles::new();
    let spec = ModelSpec::from_params(ModelId::new("policy")?, local.seed, &params)?;
    let settings = roles.settings(&spec)?;
    local.group_size = spec.group_size;
    let mut learner = roles.learner(&spec)?;
    let mut generator = roles.generator(&spec)?;
    let mut task = roles.task(&spec, local.seed)?;
    let conversion = Conversion::new(&learner.manifest(), &roles.conversion())?;
    let m = settings.grpo.model;
    println!(
        "model: d_model {} layers {} heads {} mlp x{} vocab {} context {} ({} parameters)",
        m.d_model,
        m.layers,
        m.heads,
        m.mlp_ratio,
        m.vocab,
        m.context,
        m.params()
    );
    println!(
        "task: reverse {}..={} digits; batch {} prompts x {} completions; lr {}; correction {}",
        settings.task.min_len,
        settings.task.max_len,
        local.prompts_per_batch,
        local.group_size,
        settings.grpo.lr,
        settings.grpo.correction.name()
    );
    println!(
        "update  seconds  heldout  train   entropy  clip    grad    ratio_max | sample  train  publish  eval (s)"
    );
    let curve = local_grpo::run(
        learner.as_mut(),
        &conversion,
        &mut generator,
        &mut task,
        &local,
        |p, stats| {
            let s = |k: &str| stats.and_then(|s| s.get(k)).unwrap_or(f64::NAN);
            println!(
                "{:>6}  {:>7.1}  {:>7.3}  {:>5.3}  {:>7.3}  {:>6.3}  {:>6.3}  {:>9.4} | {:>6.1}  {:>5.1}  {:>7.1}  {:>4.1}",
                p.update,
                p.seconds,
                p.heldout_reward,
                p.train_reward.unwrap_or(f32::NAN),
                s("entropy"),
                s("clip_fraction"),
                s("grad_norm"),
                s("behaviour_ratio_max"),
                p.split.sample,
                p.split.train,
                p.split.publish,
                p.split.eval,
            );
        },
    )?;
    let first = curve.first().map_or(f32::NAN, |p| p.heldout_reward);
    match curve.iter().find(|p| p.heldout_reward >= 0.9) {
        Some(p) => println!(
            "held-out reward {first:.3} -> {:.3} after {} updates in {:.1} s",
            p.heldout_reward, p.update, p.seconds
        ),
        None => println!(
            "held-out reward {first:.3} -> {:.3} (best {:.3}), 0.9 not reached",
            curve.last().map_or(f32::NAN, |p| p.heldout_reward),
            curve.iter().map(|p| p.heldout_reward).fold(0.0, f32::max)
        ),
    }
    Ok(())
}
