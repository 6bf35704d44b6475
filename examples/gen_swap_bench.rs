//! The pause of a generating engine's version swap against the size of the weights: the
//! scheduler swaps an `Arc` at a step boundary and hands the old version to its reaper
//! thread, so the pause should not grow with the model. Each size is measured against two
//! physical baselines of the same run: a memcpy of the weights (what an apply-by-copy
//! would pause for) and freeing them inline (what dropping the old version on the loop
//! would add).
//!
//! ```text
//! cargo run --release --example gen_swap_bench -- [--sizes 16,128,512] [--rounds 9] [--running 32]
//! ```
//!
//! The model is a bigram table of `vocab x vocab` f32 (`vocab` chosen for each size), with
//! `--running` greedy sequences in the batch at every swap. Columns: the baselines; the
//! swap's pause in keep and abort mode (abort ends every running sequence); in keep mode,
//! a plain decoding step, the step whose boundary swapped, and the step after it (while the
//! reaper thread frees the old version); the keep pause over the memcpy. Medians.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use refit_rl::bigram::Bigram;
use refit_rl::generation::{Generator, PauseMode, SamplingParams};
use refit_rl::scheduler::{Scheduler, SchedulerConfig};
use refit_runtime::{ModelId, Version};

#[derive(Parser)]
struct Args {
    /// Weight sizes in MiB (each rounded to a square table).
    #[arg(long, value_delimiter = ',', default_value = "16,128,512")]
    sizes: Vec<usize>,
    /// Swaps (and baseline runs) per size; medians are reported.
    #[arg(long, default_value_t = 9)]
    rounds: usize,
    /// Sequences decoding at every swap.
    #[arg(long, default_value_t = 32)]
    running: usize,
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs.get(xs.len() / 2).copied().unwrap_or_default()
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Medians over `rounds` swaps in `mode` with `running` sequences in flight.
struct Swaps {
    /// The swap itself (the scheduler's `Swap::paused`).
    pause: Duration,
    /// A step with no swap.
    plain_step: Duration,
    /// The step whose boundary swapped (the pause, the forward, the handoff of the old
    /// version to the reaper).
    swap_step: Duration,
    /// The step after it (the reaper frees the old version meanwhile).
    next_step: Duration,
}

fn swaps(
    g: &Bigram,
    ws: &refit_runtime::WeightSet,
    mode: PauseMode,
    rounds: usize,
    running: usize,
) -> Result<Swaps, Box<dyn std::error::Error>> {
    let model = ModelId::new("policy")?;
    let first = Arc::new(g.stage(ws)?);
    let mut s = Scheduler::new(g.clone(), SchedulerConfig::new(model, running, mode))?
        .with_weights(first, Version(1));
    let (mut pause, mut plain, mut swap_step, mut next) = (vec![], vec![], vec![], vec![]);
    let context = g.max_context() as u32;
    for round in 0..rounds {
        while s.running() + s.waiting() < running {
            s.submit(vec![0], SamplingParams::greedy(context - 2), None)?;
        }
        // the first step of a new batch prefills; the second is a plain step
        s.step();
        let t = Instant::now();
        s.step();
        plain.push(t.elapsed());
        // staged beside the loop, as the engine's staging thread does
        let staged = Arc::new(g.stage(ws)?);
        s.offer(staged, Version(round as u64 + 2))?;
        let t = Instant::now();
        let report = s.step();
        swap_step.push(t.elapsed());
        let t = Instant::now();
        s.step();
        next.push(t.elapsed());
        pause.push(report.swap.ok_or("no swap at the step boundary")?.paused);
    }
    Ok(Swaps {
        pause: median(pause),
        plain_step: median(plain),
        swap_step: median(swap_step),
        next_step: median(next),
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    println!(
        "{:>5} {:>6} {:>9} {:>8} | {:>10} {:>11} | {:>9} {:>9} {:>9} | {:>11}",
        "MiB",
        "vocab",
        "memcpy ms",
        "free ms",
        "keep us",
        "abort us",
        "step ms",
        "swap+ ms",
        "next ms",
        "keep/memcpy"
    );
    for mib in args.sizes {
        let vocab = (((mib << 20) / 4) as f64).sqrt() as usize;
        let g = Bigram::new(vocab, 1 << 20)?;
        let ws = g.weight_set(ModelId::new("policy")?, Version(1), |p, n| {
            if n == (p + 1) % vocab as u32 {
                1.0
            } else {
                0.0
            }
        })?;
        let bytes = ws.bytes().len();
        // baselines: copying the weights once, and freeing a staged copy inline
        let mut dst = vec![0u8; bytes];
        let mut copies = Vec::new();
        let mut frees = Vec::new();
        for _ in 0..args.rounds {
            let t = Instant::now();
            dst.copy_from_slice(ws.bytes());
            copies.push(t.elapsed());
            std::hint::black_box(&dst);
            let staged = Arc::new(g.stage(&ws)?);
            let t = Instant::now();
            drop(staged);
            frees.push(t.elapsed());
        }
        let memcpy = median(copies);
        let free = median(frees);
        let keep = swaps(&g, &ws, PauseMode::Keep, args.rounds, args.running)?;
        let abort = swaps(&g, &ws, PauseMode::Abort, args.rounds, args.running)?;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "{:>5} {:>6} {:>9.2} {:>8.2} | {:>10.2} {:>11.2} | {:>9.3} {:>9.3} {:>9.3} | {:>11.6}",
            bytes >> 20,
            vocab,
            ms(memcpy),
            ms(free),
            us(keep.pause),
            us(abort.pause),
            ms(keep.plain_step),
            ms(keep.swap_step),
            ms(keep.next_step),
            keep.pause.as_secs_f64() / memcpy.as_secs_f64()
        );
    }
    Ok(())
}
