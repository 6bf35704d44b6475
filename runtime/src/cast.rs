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

pub mod fp8;

use std::fmt;
use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Pattern;
use crate::manifest::{Manifest, TensorSpec};
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

#[derive(Clone, Debug)]
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

/// A checked conversion from a source manifest to the manifest that is sent.
#[derive(Clone, Debug)]
pub struct CastPlan {
    source: Arc<Manifest>,
    target: Arc<Manifest>,
    steps: Vec<Step>,
}

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
        Ok(Self {
            source: Arc::new(source.clone()),
            target: Arc::new(b.build()?),
            steps,
        })
    }

    /// The manifest the plan was made for.
    pub fn source(&self) -> &Arc<Manifest> {
        &self.source
    }

    /// The manifest of what is sent (converted dtypes, `<name>.scale` tensors added).
    pub fn target(&self) -> &Arc<Manifest> {
        &self.target
    }

    /// Converts one version (same model and version).
    ///
    /// # Errors
    /// A schema error when `weights` does not have the source manifest; [`Error::Cast`]
    /// naming the tensor and element when a scaled fp8 tensor holds a NaN or infinity (a
    /// scale cannot be computed from it).
    pub fn apply(&self, weights: &WeightSet) -> Result<WeightSet> {
        let mut out = WeightSet::zeroed(weights.model().clone(), Arc::clone(&self.target));
        self.apply_into(weights, &mut out)?;
        Ok(out)
    }

    /// As [`CastPlan::apply`], into a weight set of the target manifest whose every tensor
    /// byte is overwritten (reused by the converting adapters).
    pub(crate) fn apply_into(&self, weights: &WeightSet, out: &mut WeightSet) -> Result<()> {
        self.source
            .check_same_schema(weights.model(), weights.manifest())?;
        self.target.check_same_schema(out.model(), out.manifest())?;
        out.set_version(weights.version());
        let (src_specs, dst_specs) = (self.source.tensors(), self.target.tensors());
        for step in &self.steps {
            match *step {
                Step::Copy { src, dst } => {
                    let bytes = &weights.bytes()[src_specs[src].range()];
                    out.bytes_mut()?[dst_specs[dst].range()].copy_from_slice(bytes);
                }
                Step::Convert {
                    src,
                    dst,
                    to,
                    scale,
                } => convert(
                    weights,
                    &src_specs[src],
                    out,
                    &dst_specs[dst],
                    to,
                    scale.map(|s| &dst_specs[s]),
                )?,
            }
        }
        Ok(())
    }
}

/// Source elements, before widening to f32.
enum Floats<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

fn convert(
    weights: &WeightSet,
    src: &TensorSpec,
    out: &mut WeightSet,
    dst: &TensorSpec,
    to: CastTo,
    scale: Option<&TensorSpec>,
) -> Result<()> {
    match (src.dtype, to) {
        (DType::F32, CastTo::BF16) => out
            .view_mut::<bf16>(&dst.name)?
            .convert_from_f32_slice(weights.view::<f32>(&src.name)?),
        (DType::F32, CastTo::F16) => out
            .view_mut::<f16>(&dst.name)?
            .convert_from_f32_slice(weights.view::<f32>(&src.name)?),
        (DType::BF16, CastTo::F32) => weights
            .view::<bf16>(&src.name)?
            .convert_to_f32_slice(out.view_mut::<f32>(&dst.name)?),
        (DType::F16, CastTo::F32) => weights
            .view::<f16>(&src.name)?
            .convert_to_f32_slice(out.view_mut::<f32>(&dst.name)?),
        _ => {
            let floats = match src.dtype {
                DType::F32 => Floats::F32(weights.view(&src.name)?),
                DType::BF16 => Floats::BF16(weights.view(&src.name)?),
                DType::F16 => Floats::F16(weights.view(&src.name)?),
                other => return Err(cast_error(&src.name, format!("{other} is not a float"))),
            };
            let Some((scaling, overflow, max)) = to.fp8() else {
                return Err(cast_error(&src.name, "unsupported conversion"));
            };
            let (rows, cols) = as_matrix(&src.shape);
            let (br, bc) = match scaling {
                Scaling::None | Scaling::PerTensor => (rows.max(1), cols.max(1)),
                Scaling::PerBlock { rows, cols } => (rows, cols),
            };
            // Widened once (exact), so the loops below run over plain f32 rows.
            let vals: std::borrow::Cow<'_, [f32]> = match floats {
                Floats::F32(v) => v.into(),
                Floats::BF16(v) => v.to_f32_vec().into(),
                Floats::F16(v) => v.to_f32_vec().into(),
            };
            let mut scales = Vec::new();
            let codes = out.tensor_bytes_mut(&dst.name)?;
            for r0 in (0..rows).step_by(br) {
                for c0 in (0..cols).step_by(bc) {
                    let (r1, c1) = ((r0 + br).min(rows), (c0 + bc).min(cols));
                    let s = if scaling == Scaling::None {
                        1.0
                    } else {
                        let mut amax = 0.0_f32;
                        let mut finite = true;
                        for r in r0..r1 {
                            for &x in &vals[r * cols + c0..r * cols + c1] {
                                finite &= x.is_finite();
                                amax = amax.max(x.abs());
                            }
                        }
                        if !finite {
                            let i = (r0..r1)
                                .flat_map(|r| (c0..c1).map(move |c| r * cols + c))
                                .find(|&i| !vals[i].is_finite())
                                .unwrap_or(0);
                            return Err(cast_error(
                                &src.name,
                                format!("element {i} is {}; a scale needs finite values", vals[i]),
                            ));
                        }
                        if amax == 0.0 { 1.0 } else { amax / max }
                    };
                    for r in r0..r1 {
                        let row = r * cols + c0..r * cols + c1;
                        let (dst, src) = (&mut codes[row.clone()], &vals[row]);
                        // Direct calls (not through `encode`'s pointer) so the encoder inlines.
                        match to {
                            CastTo::E4M3 { .. } => {
                                encode_row(dst, src, s, overflow, fp8::f32_to_e4m3)
                            }
                            _ => encode_row(dst, src, s, overflow, fp8::f32_to_e5m2),
                        }
                    }
                    scales.push(s);
                }
            }
            if scales.is_empty() && scaling == Scaling::PerTensor {
                scales.push(1.0); // an empty tensor still ships its one scale
            }
            if let Some(spec) = scale {
                out.view_mut::<f32>(&spec.name)?.copy_from_slice(&scales);
            }
        }
    }
    Ok(())
}

fn encode_row(
    dst: &mut [u8],
    src: &[f32],
    scale: f32,
    overflow: Overflow,
    encode: impl Fn(f32, Overflow) -> u8,
) {
    for (q, &x) in dst.iter_mut().zip(src) {
        *q = encode(x / scale, overflow);
    }
}

#[cfg(test)]
mod tests;
