//! Dtype conversion on the sender: `f32` to `bf16` / `f16`, and `f32` / `bf16` / `f16` to fp8
//! (e4m3 or e5m2) with per-tensor or per-block scales.
//!
//! Write [`CastRules`] once; [`CastPlan::new`] checks them against a [`Manifest`] and computes
//! the manifest of what is sent; [`CastPlan::apply`] converts each version.
//!
//! Rounding:
//! - to `bf16` and `f16`: round to nearest, ties to even (the `half` crate's `from_f32`); NaN
//!   stays NaN, overflow gives infinity (as a plain IEEE cast does);
//! - to fp8: see [`fp8`] for the exact rules (ties to even, subnormals, saturation to ±448 /
//!   ±57344 by default, NaN as `0x7f` / `0xff`);
//! - `bf16` / `f16` to `f32` is exact.
//!
//! **Speed.** The element loops are branch-free arithmetic the compiler vectorises (with a
//! copy for AVX2 chosen at run time on x86-64), bit for bit the scalar conversions above, and
//! a large conversion is cut into pieces spread over the copy threads
//! ([`copy_threads`](crate::copy::copy_threads)): about one pass over memory per version
//! (see `exec.rs` for how fp8 scales are found without a second pass over small tensors).
//!
//! **Scales.** With [`Scaling::PerTensor`] or [`Scaling::PerBlock`], each scaled tensor
//! `<name>` is followed in the manifest by an `f32` tensor named **`<name>.scale`** holding
//! the *dequantisation* multiplier: `scale = amax / max` where `amax` is the largest magnitude
//! in the tensor or block and `max` the format's largest finite (448 for e4m3, 57344 for
//! e5m2); the sender stores `fp8(x / scale)`, and the engine recovers `x ≈ value * scale`.
//! (This is what vLLM calls `weight_scale`; DeepSeek-V3 checkpoints store the same
//! multiplier under the name `weight_scale_inv`.) A tensor or block of zeros gets scale 1.
//! A per-tensor scale has shape `[1]`; per-block scales have shape `[ceil(R / rows),
//! ceil(C / cols)]` where the tensor is viewed as `R × C` with `C` its last dimension (a
//! scalar is `1 × 1`, a vector `1 × n`).

mod exec;
pub mod fp8;
mod kernels;

use std::fmt;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{Pattern, Segment};
use crate::manifest::Manifest;
use crate::plan::{Checked, Ops, Plan, Sealed};
use crate::weights::WeightSet;

pub use fp8::Overflow;

/// How fp8 values are scaled before encoding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scaling {
    /// No scale: values are encoded as they are (and saturate or overflow per [`Overflow`]).
    #[default]
    None,
    /// One scale for the whole tensor, shipped as `<name>.scale` of shape `[1]`.
    PerTensor,
    /// One scale per `rows × cols` block of the tensor seen as a matrix (DeepSeek-style
    /// 128 × 128 blocks, or `1 × n` per-row groups), shipped as `<name>.scale`.
    PerBlock {
        /// Block height.
        rows: usize,
        /// Block width.
        cols: usize,
    },
}

/// What a tensor is converted to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CastTo {
    /// bfloat16, round to nearest even.
    BF16,
    /// IEEE half, round to nearest even.
    F16,
    /// f32 (exact from bf16 / f16).
    F32,
    /// fp8 e4m3 (`e4m3fn`).
    E4M3 {
        /// Scale layout.
        scaling: Scaling,
        /// What out-of-range values become.
        overflow: Overflow,
    },
    /// fp8 e5m2.
    E5M2 {
        /// Scale layout.
        scaling: Scaling,
        /// What out-of-range values become.
        overflow: Overflow,
    },
}

impl CastTo {
    /// e4m3 with one scale per tensor, saturating.
    pub const E4M3_PER_TENSOR: Self = Self::E4M3 {
        scaling: Scaling::PerTensor,
        overflow: Overflow::Saturate,
    };

    /// The dtype this produces.
    pub fn dtype(self) -> DType {
        match self {
            Self::BF16 => DType::BF16,
            Self::F16 => DType::F16,
            Self::F32 => DType::F32,
            Self::E4M3 { .. } => DType::F8E4M3,
            Self::E5M2 { .. } => DType::F8E5M2,
        }
    }

    fn fp8(self) -> Option<Fp8Encoding> {
        match self {
            Self::E4M3 { scaling, overflow } => Some((scaling, overflow, fp8::E4M3_MAX)),
            Self::E5M2 { scaling, overflow } => Some((scaling, overflow, fp8::E5M2_MAX)),
            _ => None,
        }
    }
}

/// Scaling, overflow rule and largest finite value of one fp8 target.
type Fp8Encoding = (Scaling, Overflow, f32);

/// Which tensors a cast rule selects.
#[derive(Clone, Debug)]
enum Select {
    Name(Pattern),
    DType(DType),
}

impl fmt::Display for Select {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Name(p) => write!(f, "{p}"),
            Self::DType(d) => write!(f, "every {d} tensor"),
        }
    }
}

/// Which tensors are converted to what. Tensors no rule selects pass through unchanged; a rule
/// that selects nothing, or a tensor selected by two rules, is an error at plan time.
#[derive(Debug, Default)]
pub struct CastRules {
    rules: Vec<(Select, CastTo)>,
    error: Option<(String, String)>,
}

impl CastRules {
    /// No rules.
    pub fn new() -> Self {
        Self::default()
    }

    /// Tensors whose name matches `pattern` (a name with `{name}` placeholders, as in
    /// [`LayoutRules`](crate::LayoutRules)) are converted to `to`.
    pub fn tensors(mut self, pattern: &str, to: CastTo) -> Self {
        match Pattern::parse(pattern) {
            Ok(p) => self.rules.push((Select::Name(p), to)),
            Err(e) => {
                if self.error.is_none() {
                    self.error = Some((pattern.into(), e.to_string()));
                }
            }
        }
        self
    }

    /// Every tensor of dtype `from` is converted to `to`.
    pub fn dtype(mut self, from: DType, to: CastTo) -> Self {
        self.rules.push((Select::DType(from), to));
        self
    }
}

#[derive(Clone, Copy, Debug)]
enum Step {
    Copy {
        src: usize,
        dst: usize,
    },
    Convert {
        src: usize,
        dst: usize,
        to: CastTo,
        scale: Option<usize>,
    },
}

/// The steps of a [`CastPlan`] (each tensor copied or converted, with its scales).
#[derive(Clone, Debug)]
pub struct CastSteps(Vec<Step>);

/// A checked conversion from a source manifest to the manifest that is sent (converted
/// dtypes, `<name>.scale` tensors added), applied to every version ([`Plan::apply`]).
pub type CastPlan = Plan<CastSteps>;

fn cast_error(tensor: &str, reason: impl Into<String>) -> Error {
    Error::Cast {
        tensor: tensor.into(),
        reason: reason.into(),
    }
}

/// `(R, C)`: the tensor seen as a matrix whose rows are its last dimension.
fn as_matrix(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        None => (1, 1),
        Some((&c, rest)) => (rest.iter().product(), c),
    }
}

fn supported(from: DType, to: CastTo) -> bool {
    matches!(
        (from, to),
        (DType::F32, CastTo::BF16 | CastTo::F16)
            | (DType::BF16 | DType::F16, CastTo::F32)
            | (
                DType::F32 | DType::BF16 | DType::F16,
                CastTo::E4M3 { .. } | CastTo::E5M2 { .. }
            )
    )
}

impl CastPlan {
    /// Checks `rules` against `source` and computes the manifest of what is sent.
    ///
    /// # Errors
    /// [`Error::Cast`] naming the rule or tensor when a pattern does not parse, a rule selects
    /// no tensor, a tensor is selected twice, a conversion is not supported (supported: `f32`
    /// to `bf16` / `f16`; `bf16` / `f16` to `f32`; `f32` / `bf16` / `f16` to fp8), a block is
    /// empty, or a `<name>.scale` tensor already exists.
    pub fn new(source: &Manifest, rules: &CastRules) -> Result<Self> {
        if let Some((p, e)) = &rules.error {
            return Err(cast_error(p, e.clone()));
        }
        let specs = source.tensors();
        let mut chosen: Vec<Option<usize>> = vec![None; specs.len()];
        for (r, (select, to)) in rules.rules.iter().enumerate() {
            let mut any = false;
            for (t, spec) in specs.iter().enumerate() {
                let hit = match select {
                    Select::Name(p) => p.matches(&spec.name).is_some(),
                    Select::DType(d) => spec.dtype == *d,
                };
                if !hit {
                    continue;
                }
                any = true;
                if let Some(prev) = chosen[t] {
                    return Err(cast_error(
                        &spec.name,
                        format!(
                            "selected by rule `{}` and rule `{select}`",
                            rules.rules[prev].0
                        ),
                    ));
                }
                if !supported(spec.dtype, *to) {
                    return Err(cast_error(
                        &spec.name,
                        format!("{} to {} is not supported", spec.dtype, to.dtype()),
                    ));
                }
                if let Some((
                    Scaling::PerBlock { rows: 0, .. } | Scaling::PerBlock { cols: 0, .. },
                    ..,
                )) = to.fp8()
                {
                    return Err(cast_error(&spec.name, "empty scale block"));
                }
                chosen[t] = Some(r);
            }
            if !any {
                return Err(cast_error(&select.to_string(), "rule selects no tensor"));
            }
        }
        let mut b = Manifest::builder();
        let mut steps = Vec::with_capacity(specs.len());
        let mut n = 0;
        for (t, spec) in specs.iter().enumerate() {
            let Some(r) = chosen[t] else {
                b.push(spec.name.clone(), spec.dtype, &spec.shape);
                steps.push(Step::Copy { src: t, dst: n });
                n += 1;
                continue;
            };
            let to = rules.rules[r].1;
            b.push(spec.name.clone(), to.dtype(), &spec.shape);
            let scale_shape = match to.fp8().map(|f| f.0) {
                Some(Scaling::PerTensor) => Some(vec![1]),
                Some(Scaling::PerBlock { rows, cols }) => {
                    let (r, c) = as_matrix(&spec.shape);
                    Some(vec![r.div_ceil(rows), c.div_ceil(cols)])
                }
                _ => None,
            };
            let scale = if let Some(shape) = scale_shape {
                let name = format!("{}.scale", spec.name);
                if source.get(&name).is_some() {
                    return Err(cast_error(&spec.name, format!("`{name}` already exists")));
                }
                b.push(name, DType::F32, &shape);
                Some(n + 1)
            } else {
                None
            };
            steps.push(Step::Convert {
                src: t,
                dst: n,
                to,
                scale,
            });
            n += 1 + usize::from(scale.is_some());
        }
        Ok(Plan::of(source, b.build()?, CastSteps(steps)))
    }

    /// Whether [`CastPlan::apply_runs`] can read the source tensors from `runs` (a tensor with
    /// per-block fp8 scales must lie whole in one run).
    pub(crate) fn takes_runs(&self, runs: &[Vec<Segment>]) -> bool {
        exec::direct(self, runs)
    }

    /// Converts a version whose source tensors lie in `runs` of `src` (one list per source
    /// tensor, in the tensor's order: e.g. the trainer's bytes a layout would move there)
    /// into `out`, a weight set of the target manifest whose every tensor byte is
    /// overwritten; `out` takes `version`.
    pub(crate) fn apply_runs(
        &self,
        src: &[u8],
        runs: &[Vec<Segment>],
        version: crate::ids::Version,
        out: &mut WeightSet,
    ) -> Result<()> {
        self.target.check_same_schema(out.model(), out.manifest())?;
        self.write_runs(src, runs, version, out)
    }

    /// [`CastPlan::apply_runs`] once `out`'s manifest is known to be the target's.
    fn write_runs(
        &self,
        src: &[u8],
        runs: &[Vec<Segment>],
        version: crate::ids::Version,
        out: &mut WeightSet,
    ) -> Result<()> {
        exec::run(self, src, runs, out)?;
        out.set_version(version);
        Ok(())
    }

    /// The plan's steps, one per source tensor, in order.
    fn steps(&self) -> &[Step] {
        &self.ops.0
    }
}

impl Sealed for CastSteps {}

impl Ops for CastSteps {
    fn write(plan: &CastPlan, weights: &WeightSet, out: &mut WeightSet, _: Checked) -> Result<()> {
        // both manifests were checked: no second check of the output's
        plan.write_runs(weights.bytes(), &exec::whole(plan), weights.version(), out)
    }
}

#[cfg(test)]
mod tests;
