//! Per-GB cost of the engine strategies, for `refit bench` (not a stable API).
//!
//! A transformer-shaped f32 model of about the requested size is built deterministically;
//! each operation runs `reps` times and the fastest run counts. Figures are over the source
//! payload (the f32 bytes read), so they compare directly with a `memcpy` of the same size.

use std::sync::Arc;
use std::time::Instant;

use crate::cast::{CastPlan, CastRules, CastTo};
use crate::delta::{Delta, Granularity};
use crate::dtype::DType;
use crate::error::Result;
use crate::ids::{ModelId, Version};
use crate::layout::{LayoutPlan, LayoutRules};
use crate::manifest::Manifest;
use crate::weights::WeightSet;

/// One measured operation.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    /// What was measured.
    pub name: &'static str,
    /// Source bytes processed per run.
    pub bytes: usize,
    /// Seconds of the fastest run.
    pub seconds: f64,
}

impl Figure {
    /// Throughput, in GB/s (10^9 bytes).
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e9 / self.seconds
    }

    /// Cost, in seconds per GB.
    pub fn s_per_gb(&self) -> f64 {
        self.seconds / (self.bytes as f64 / 1e9)
    }
}

/// The figures of one run: memcpy, rename/fuse, f32→bf16, f32→fp8, delta encode.
#[derive(Clone, Debug, PartialEq)]
pub struct StrategyBench {
    /// Payload bytes of the model used.
    pub bytes: usize,
    /// The measurements, in the order above.
    pub figures: Vec<Figure>,
}

impl std::fmt::Display for StrategyBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<22} {:>10} {:>10} {:>10}",
            "operation", "ms", "GB/s", "s/GB"
        )?;
        for x in &self.figures {
            writeln!(
                f,
                "{:<22} {:>10.2} {:>10.2} {:>10.3}",
                x.name,
                x.seconds * 1e3,
                x.gb_per_s(),
                x.s_per_gb()
            )?;
        }
        Ok(())
    }
}

const H: usize = 256;

fn model(bytes: usize) -> Result<Manifest> {
    let per_layer = (4 * H * H + 3 * 2 * H * H) * 4;
    let mut b = Manifest::builder();
    for i in 0..(bytes / per_layer).max(1) {
        for (n, rows) in [
            ("q", H),
            ("k", H),
            ("v", H),
            ("o", H),
            ("gate", 2 * H),
            ("up", 2 * H),
        ] {
            b.push(format!("layers.{i}.{n}"), DType::F32, &[rows, H]);
        }
        b.push(format!("layers.{i}.down"), DType::F32, &[H, 2 * H]);
    }
    b.build()
}

fn best(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Measures every strategy on a model of about `bytes` bytes, `reps` runs each.
///
/// # Errors
/// Whatever the strategies report (none are expected on the generated model).
pub fn run(bytes: usize, reps: usize) -> Result<StrategyBench> {
    let manifest = Arc::new(model(bytes)?);
    let id = ModelId::new("bench")?;
    let mut base = WeightSet::zeroed(id, Arc::clone(&manifest));
    let mut state = 0x9e37_79b9_u32;
    for x in bytemuck::cast_slice_mut::<u8, f32>(base.bytes_mut()?) {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        *x = (state >> 8) as f32 / (1 << 24) as f32 - 0.5;
    }
    base.set_version(Version(1));
    let mut new = base.clone();
    new.set_version(Version(2));
    // About 3% of 64 KiB blocks change, as in a dense bf16 step.
    for (i, chunk) in new.bytes_mut()?.chunks_mut(64 * 1024).enumerate() {
        if i % 32 == 0 {
            chunk[0] ^= 1;
        }
    }
    let payload = manifest.payload_len();
    let mut figures = Vec::new();

    let mut dst = vec![0_u8; base.bytes().len()];
    let t = best(reps, || {
        dst.copy_from_slice(base.bytes());
        Ok(())
    })?;
    figures.push(Figure {
        name: "memcpy",
        bytes: payload,
        seconds: t,
    });

    let rules = LayoutRules::new()
        .fuse(
            ["layers.{i}.q", "layers.{i}.k", "layers.{i}.v"],
            "model.layers.{i}.qkv",
            0,
        )
        .rename("layers.{i}.o", "model.layers.{i}.o")
        .fuse(
            ["layers.{i}.gate", "layers.{i}.up"],
            "model.layers.{i}.gate_up",
            0,
        )
        .rename("layers.{i}.down", "model.layers.{i}.down");
    let layout = LayoutPlan::new(&manifest, &rules)?;
    let mut out = WeightSet::zeroed(base.model().clone(), Arc::clone(layout.target()));
    let t = best(reps, || layout.apply_into(&base, &mut out))?;
    figures.push(Figure {
        name: "rename/fuse",
        bytes: payload,
        seconds: t,
    });

    for (name, to) in [
        ("cast f32->bf16", CastTo::BF16),
        ("cast f32->fp8 e4m3", CastTo::E4M3_PER_TENSOR),
    ] {
        let plan = CastPlan::new(&manifest, &CastRules::new().dtype(DType::F32, to))?;
        let t = best(reps, || plan.apply(&base).map(drop))?;
        figures.push(Figure {
            name,
            bytes: payload,
            seconds: t,
        });
    }

    let t = best(reps, || {
        Delta::encode(&base, &new, Granularity::Block(64 * 1024)).map(drop)
    })?;
    figures.push(Figure {
        name: "delta encode (3%)",
        bytes: payload,
        seconds: t,
    });
    Ok(StrategyBench {
        bytes: payload,
        figures,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_reports_every_figure() {
        let b = run(1 << 20, 1).unwrap();
        let names: Vec<_> = b.figures.iter().map(|f| f.name).collect();
        assert_eq!(
            names,
            [
                "memcpy",
                "rename/fuse",
                "cast f32->bf16",
                "cast f32->fp8 e4m3",
                "delta encode (3%)"
            ]
        );
        assert_eq!(b.bytes, (4 * H * H + 6 * H * H) * 4);
        for f in &b.figures {
            assert!(f.seconds > 0.0 && f.gb_per_s().is_finite(), "{f:?}");
        }
        assert!(b.to_string().contains("rename/fuse"));
    }

    /// `cargo test --release -p refit-runtime --lib strategy_bench -- --ignored --nocapture`
    #[test]
    #[ignore = "a measurement, not a check"]
    fn print_64_mib() {
        println!("{}", run(64 << 20, 5).unwrap());
    }
}
