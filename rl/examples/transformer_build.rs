//! How long a large transformer takes to build, export, convert and stage: the costs a
//! weight-sync measurement with an LLM-sized model pays before its first update.
//!
//! ```text
//! cargo run --release -p refit-rl --example transformer_build -- [GiB, default 1]
//! ```
//!
//! Prints each phase with its time and its ratio to a plain copy of the same number of
//! trainer bytes measured in the same run (the physical baseline).

use std::time::Instant;

use refit_rl::generation::{Generator, StepInput};
use refit_rl::grpo::{GrpoConfig, GrpoLearner};
use refit_rl::transformer::{TransformerConfig, TransformerGenerator};
use refit_runtime::ModelId;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gib: f64 = std::env::args().nth(1).map_or(Ok(1.0), |a| a.parse())?;
    let cfg = TransformerConfig::of_bytes((gib * (1u64 << 30) as f64) as usize, 32, 64);
    let bytes = cfg.params() * 4;
    println!(
        "model: d_model {} layers {} heads {} ({} parameters, {:.2} GiB of f32)",
        cfg.d_model,
        cfg.layers,
        cfg.heads,
        cfg.params(),
        bytes as f64 / (1u64 << 30) as f64
    );
    // Baselines: a copy of as many bytes into fresh memory (as the phases below write into
    // fresh arenas), and into memory already touched (memcpy's bandwidth).
    let src = vec![1u8; bytes];
    let t = Instant::now();
    let mut dst = src.clone();
    let copy = t.elapsed().as_secs_f64();
    let t = Instant::now();
    dst.copy_from_slice(&src);
    let touched = t.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    drop((src, dst));
    println!("{:<34} {:>8.3} s", "baseline: copy into fresh memory", copy);
    println!("{:<34} {:>8.3} s", "(copy into touched memory)", touched);
    let row = |name: &str, s: f64| println!("{name:<34} {s:>8.3} s  {:>6.1}x copy", s / copy);

    let id = ModelId::new("policy")?;
    let t = Instant::now();
    let init = cfg.init_weights(id.clone(), 0)?;
    row("init (seeded, into the arena)", t.elapsed().as_secs_f64());
    let t = Instant::now();
    let mut learner = GrpoLearner::from_weights(GrpoConfig::new(cfg), &init)?;
    row("learner (candle vars + AdamW)", t.elapsed().as_secs_f64());
    drop(init);
    let t = Instant::now();
    let ws = learner.export()?;
    row("export (trainer layout)", t.elapsed().as_secs_f64());
    let conversion = cfg.conversion()?;
    let t = Instant::now();
    let engine = conversion.apply(&ws)?;
    row("convert (fuse qkv, cast bf16)", t.elapsed().as_secs_f64());
    drop(ws);
    let mut generator = TransformerGenerator::new(cfg, 2)?;
    let t = Instant::now();
    let staged = generator.stage(&engine)?;
    row("stage (verify, upcast to f32)", t.elapsed().as_secs_f64());
    let mut caches: Vec<_> = (0..8).map(|_| generator.new_cache()).collect();
    let prompt = [1u32, 2, 3, 4];
    let mut logits = Vec::new();
    let t = Instant::now();
    let mut inputs: Vec<_> = caches
        .iter_mut()
        .map(|cache| StepInput {
            cache,
            tokens: &prompt,
        })
        .collect();
    generator.forward(&staged, &mut inputs, &mut logits)?;
    row("prefill 8 x 4 tokens", t.elapsed().as_secs_f64());
    let t = Instant::now();
    let mut inputs: Vec<_> = caches
        .iter_mut()
        .map(|cache| StepInput {
            cache,
            tokens: &prompt[..1],
        })
        .collect();
    generator.forward(&staged, &mut inputs, &mut logits)?;
    row("decode step of 8 sequences", t.elapsed().as_secs_f64());
    Ok(())
}
