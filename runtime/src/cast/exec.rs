//! Runs a [`CastPlan`] over runs of a source arena, in pieces spread over threads.
//!
//! Each target tensor is read from [`Segment`]s: the source tensor where it lies (a cast on
//! its own), or the trainer's bytes the layout would have moved there (a layout followed by
//! a cast that needs no laid-out copy). A conversion is then one pass over memory: every
//! source byte is read once and every target byte written once, by the vectorised loops of
//! [`super::kernels`]. An fp8 scale needs the largest magnitude of its tensor or block
//! before the first element is encoded: a tensor of up to [`LOCAL`] bytes, and each
//! row-block of per-block scales, is scanned and then encoded by one piece of work while its
//! bytes are in the cache; a larger tensor with one scale is scanned in a pass of its own
//! first.
//!
//! Work is cut into pieces of about [`PIECE`] bytes, at element (and row-block)
//! boundaries, and the pieces, in the order of the bytes they write, are split between up
//! to [`copy_threads`](crate::copy::copy_threads) threads, each taking a contiguous share of
//! about equal bytes: one thread for a conversion of less than
//! [`SPLIT_FROM`](crate::copy::SPLIT_FROM) bytes, every core the machine lends for a larger
//! one.

use std::ops::Range;

use super::kernels::{self, WIDEN};
use super::{CastPlan, CastTo, Scaling, Step, as_matrix, cast_error};
use crate::copy::{SPLIT_FROM, copy_threads};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{Segment, disjoint_mut};
use crate::manifest::TensorSpec;
use crate::weights::WeightSet;

/// Bytes of source one piece of work reads, at most (1 MiB), row-blocks of per-block scales
/// apart.
pub(crate) const PIECE: usize = 1 << 20;

/// Tensors with one fp8 scale up to this size (4 MiB of source) are scanned and encoded by
/// one piece of work, the second read hitting the cache; larger ones are scanned first, in
/// pieces of their own.
pub(crate) const LOCAL: usize = 4 << 20;

/// What a piece of work writes.
#[derive(Clone, Copy, Debug)]
enum Work {
    /// The bytes as they are.
    Copy,
    /// Element by element, from one dtype to another (no scale).
    Cast { from: DType, to: DType },
    /// To fp8, every element divided by a scale known before (1 without scaling).
    Fp8 { from: DType, to: CastTo, scale: f32 },
    /// A whole tensor to fp8 with one scale, found by this piece: source tensor `tensor` of
    /// step `step`, read through its runs; `dst` is the whole target tensor.
    Fp8Tensor {
        from: DType,
        to: CastTo,
        step: usize,
        tensor: usize,
    },
    /// Rows `rows` of source tensor `tensor` (one run from `src`) to fp8 with per-block
    /// scales: blocks of `block` columns of rows of `cols` elements, row-block `index`, the
    /// scales found by this piece.
    Fp8Rows {
        from: DType,
        to: CastTo,
        step: usize,
        tensor: usize,
        cols: usize,
        block: usize,
        index: usize,
    },
}

/// One piece: reads `src` (bytes of the source arena), writes `dst` (bytes of the output).
#[derive(Clone, Debug)]
struct Job {
    src: Range<usize>,
    dst: Range<usize>,
    work: Work,
}

/// Scales a piece found: those of `step` from `at` on.
type Found = (usize, usize, Vec<f32>);

/// What every piece reads besides its own bytes.
struct Ctx<'a> {
    plan: &'a CastPlan,
    src: &'a [u8],
    segments: &'a [Vec<Segment>],
}

/// Whether `segments` (per source tensor of `plan`) let it run without a laid-out copy: a
/// tensor with per-block fp8 scales must come whole, from one run.
pub(crate) fn direct(plan: &CastPlan, segments: &[Vec<Segment>]) -> bool {
    let specs = plan.source.tensors();
    plan.steps().iter().all(|step| {
        let (src, per_block) = match *step {
            Step::Copy { src, .. } => (src, false),
            Step::Convert { src, to, .. } => (
                src,
                matches!(to.fp8(), Some((Scaling::PerBlock { .. }, ..))),
            ),
        };
        match segments.get(src).map(Vec::as_slice) {
            None => false,
            Some([one]) => !per_block || (one.at == 0 && one.len == specs[src].len),
            Some(_) => !per_block,
        }
    })
}

/// Each source tensor of `plan` where it lies: one run each.
pub(crate) fn whole(plan: &CastPlan) -> Vec<Vec<Segment>> {
    plan.source
        .tensors()
        .iter()
        .map(|s| vec![Segment::whole(s)])
        .collect()
}

/// Converts by `plan`: the source tensors are read from `segments` of `src` (one list per
/// source tensor, in the tensor's order, covering it), the target tensors written into
/// `out` (every byte of each).
pub(crate) fn run(
    plan: &CastPlan,
    src: &[u8],
    segments: &[Vec<Segment>],
    out: &mut WeightSet,
) -> Result<()> {
    let ctx = Ctx {
        plan,
        src,
        segments,
    };
    let (src_specs, dst_specs) = (plan.source.tensors(), plan.target.tensors());
    // the scales of large tensors with one scale, found in a pass of their own
    let early = early_scales(&ctx)?;
    let mut jobs = Vec::new();
    for (k, step) in plan.steps().iter().enumerate() {
        let (s, d) = match *step {
            Step::Copy { src, dst } | Step::Convert { src, dst, .. } => (src, dst),
        };
        let runs = segments
            .get(s)
            .ok_or(Error::State("a cast without the runs of a source tensor"))?;
        let (spec, target) = (&src_specs[s], &dst_specs[d]);
        check_runs(spec, target, runs)?;
        let from = spec.dtype;
        let work = match *step {
            Step::Copy { .. } => Work::Copy,
            Step::Convert { to, .. } => match to.fp8() {
                None => Work::Cast {
                    from,
                    to: to.dtype(),
                },
                Some((Scaling::None, ..)) => Work::Fp8 {
                    from,
                    to,
                    scale: 1.0,
                },
                Some((Scaling::PerTensor, ..)) => match early.get(k).copied().flatten() {
                    Some(scale) => Work::Fp8 { from, to, scale },
                    None => {
                        // `src` only weighs the piece: its runs say where the bytes are
                        jobs.push(Job {
                            src: 0..spec.len,
                            dst: target.range(),
                            work: Work::Fp8Tensor {
                                from,
                                to,
                                step: k,
                                tensor: s,
                            },
                        });
                        continue;
                    }
                },
                Some((Scaling::PerBlock { rows: br, cols: bc }, ..)) => {
                    // whole row-blocks of the one run (`direct` checked there is one)
                    let run = runs.first().copied().unwrap_or(Segment::whole(spec));
                    let (rows, cols) = as_matrix(&spec.shape);
                    let (row_src, row_dst) = (cols * from.size(), cols * target.dtype.size());
                    for (index, r0) in (0..rows).step_by(br.max(1)).enumerate() {
                        let r1 = (r0 + br).min(rows);
                        jobs.push(Job {
                            src: run.src + r0 * row_src..run.src + r1 * row_src,
                            dst: target.offset + r0 * row_dst..target.offset + r1 * row_dst,
                            work: Work::Fp8Rows {
                                from,
                                to,
                                step: k,
                                tensor: s,
                                cols,
                                block: bc,
                                index,
                            },
                        });
                    }
                    continue;
                }
            },
        };
        pieces(spec, target, runs, work, &mut jobs);
    }
    jobs.sort_by_key(|j| j.dst.start);
    if jobs.windows(2).any(|w| w[0].dst.end > w[1].dst.start) {
        return Err(Error::State("cast pieces overlap"));
    }
    let bytes = out.bytes_mut()?;
    if jobs.last().is_some_and(|j| j.dst.end > bytes.len()) {
        return Err(Error::State("cast pieces run past the output arena"));
    }
    let threads = threads_for(jobs.iter().map(|j| j.src.len()).sum());
    let found = write_parallel(bytes, &jobs, threads, |job, dst| write(&ctx, job, dst))?;
    // the scales, beside their tensors
    let mut scales: Vec<Vec<f32>> = plan
        .steps()
        .iter()
        .zip(&early)
        .map(|(step, e)| match (*step, e) {
            (_, Some(s)) => vec![*s],
            (
                Step::Convert {
                    src,
                    to: CastTo::E4M3 { scaling, .. } | CastTo::E5M2 { scaling, .. },
                    ..
                },
                None,
            ) => match scaling {
                Scaling::None => Vec::new(),
                Scaling::PerTensor => vec![1.0],
                Scaling::PerBlock { rows, cols } => {
                    let (r, c) = as_matrix(&src_specs[src].shape);
                    vec![1.0; r.div_ceil(rows.max(1)) * c.div_ceil(cols.max(1))]
                }
            },
            _ => Vec::new(),
        })
        .collect();
    for (step, at, values) in found {
        if let Some(d) = scales
            .get_mut(step)
            .and_then(|s| s.get_mut(at..at + values.len()))
        {
            d.copy_from_slice(&values);
        }
    }
    for (step, s) in plan.steps().iter().zip(&scales) {
        if let Step::Convert {
            scale: Some(at), ..
        } = *step
        {
            let spec = &dst_specs[at];
            let dst = out
                .bytes_mut()?
                .get_mut(spec.range())
                .ok_or(Error::State("a scale tensor outside the arena"))?;
            for (d, v) in dst.chunks_exact_mut(4).zip(s) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    Ok(())
}

/// Checks that `runs` cover source tensor `s`, and that it and target `d` hold as many
/// elements.
fn check_runs(s: &TensorSpec, d: &TensorSpec, runs: &[Segment]) -> Result<()> {
    let covered: usize = runs.iter().map(|r| r.len).sum();
    let elements = |t: &TensorSpec| t.len / t.dtype.size().max(1);
    if covered != s.len || elements(s) != elements(d) {
        return Err(cast_error(
            &s.name,
            format!(
                "its runs cover {covered} of its {} bytes, for {} elements of `{}`",
                s.len,
                elements(d),
                d.name
            ),
        ));
    }
    Ok(())
}

/// Threads for a conversion reading `bytes`.
fn threads_for(bytes: usize) -> usize {
    if bytes < SPLIT_FROM {
        1
    } else {
        copy_threads().min(bytes / PIECE).max(1)
    }
}

/// Cuts the runs of source tensor `s` (target `d`) into pieces of whole elements, at most
/// [`PIECE`] source bytes each.
fn pieces(s: &TensorSpec, d: &TensorSpec, runs: &[Segment], work: Work, jobs: &mut Vec<Job>) {
    let (from, to) = (s.dtype.size().max(1), d.dtype.size());
    for (r, at, n) in cut(runs, from) {
        let first = (r.at + at) / from;
        jobs.push(Job {
            src: r.src + at..r.src + at + n,
            dst: d.offset + first * to..d.offset + (first + n / from) * to,
            work,
        });
    }
}

/// The pieces of `runs`: each run cut into pieces of whole `size`-byte elements, at most
/// [`PIECE`] bytes each, as (run, offset in it, bytes).
fn cut(runs: &[Segment], size: usize) -> impl Iterator<Item = (Segment, usize, usize)> + '_ {
    let step = (PIECE / size).max(1) * size;
    runs.iter().flat_map(move |r| {
        (0..r.len)
            .step_by(step)
            .map(move |at| (*r, at, step.min(r.len - at)))
    })
}

/// Runs `write` on each job with its bytes of `out` (jobs sorted, disjoint), on `threads`
/// threads taking contiguous shares of about equal source bytes; the scales they found.
/// The first error in job order wins.
fn write_parallel(
    out: &mut [u8],
    jobs: &[Job],
    threads: usize,
    write: impl Fn(&Job, &mut [u8]) -> Result<Option<Found>> + Sync,
) -> Result<Vec<Found>> {
    let shares = shares(jobs, threads);
    let spans = shares.iter().map(|share| {
        let start = share.first().map_or(0, |j| j.dst.start);
        start..share.last().map_or(start, |j| j.dst.end)
    });
    let regions = disjoint_mut(out, spans);
    let work: Vec<_> = shares.into_iter().zip(regions).collect();
    let found = on_threads(work, |(share, region)| {
        let start = share.first().map_or(0, |j| j.dst.start);
        let mut found = Vec::new();
        for job in share {
            let dst = region
                .get_mut(job.dst.start - start..job.dst.end - start)
                .ok_or(Error::State("a cast piece outside its share"))?;
            found.extend(write(job, dst)?);
        }
        Ok(found)
    })?;
    Ok(found.into_iter().flatten().collect())
}

/// Runs `f` on each item, the first on this thread and each other on a thread of its own;
/// the answers in order, or the first error in order.
fn on_threads<T: Send, R: Send>(
    items: Vec<T>,
    f: impl Fn(T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    if items.len() <= 1 {
        return items.into_iter().map(f).collect();
    }
    std::thread::scope(|scope| {
        let f = &f;
        let mut items = items.into_iter();
        let first = items.next();
        let handles: Vec<_> = items.map(|i| scope.spawn(move || f(i))).collect();
        let mut out = Vec::with_capacity(handles.len() + 1);
        let mut failed = None;
        for r in first.map(f).into_iter().chain(handles.into_iter().map(|h| {
            h.join()
                .unwrap_or(Err(Error::State("a cast thread panicked")))
        })) {
            match r {
                Ok(v) => out.push(v),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        failed.map_or(Ok(out), Err)
    })
}

/// Splits `items` into at most `threads` contiguous shares of about equal source bytes.
fn shares<T: Sourced>(items: &[T], threads: usize) -> Vec<&[T]> {
    let total: usize = items.iter().map(Sourced::bytes).sum();
    let per = total.div_ceil(threads.max(1)).max(1);
    let mut out = Vec::with_capacity(threads);
    let (mut start, mut acc) = (0, 0);
    for (i, j) in items.iter().enumerate() {
        acc += j.bytes();
        if acc >= per && out.len() + 1 < threads {
            out.push(&items[start..=i]);
            start = i + 1;
            acc = 0;
        }
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// Work measured in the source bytes it reads.
trait Sourced {
    fn bytes(&self) -> usize;
}

impl Sourced for Job {
    fn bytes(&self) -> usize {
        self.src.len()
    }
}

impl Sourced for (usize, Range<usize>) {
    fn bytes(&self) -> usize {
        self.1.len()
    }
}

/// Typed views of raw arena bytes (every tensor of an arena is aligned for its dtype).
fn typed<T: bytemuck::Pod>(b: &[u8]) -> Result<&[T]> {
    bytemuck::try_cast_slice(b).map_err(|_| Error::State("a cast piece is not aligned"))
}

fn typed_mut<T: bytemuck::Pod>(b: &mut [u8]) -> Result<&mut [T]> {
    bytemuck::try_cast_slice_mut(b).map_err(|_| Error::State("a cast piece is not aligned"))
}

/// Source bytes `range`.
fn bytes_at(src: &[u8], range: Range<usize>) -> Result<&[u8]> {
    src.get(range)
        .ok_or(Error::State("a cast piece outside the source"))
}

/// The scale of a tensor or block whose largest magnitude has the `f32` bits `amax` (sign
/// cleared), for a format whose largest finite is `max`; `None` when a value is not finite.
fn scale_of(amax: u32, max: f32) -> Option<f32> {
    let amax = (amax < 0x7f80_0000).then(|| f32::from_bits(amax))?;
    Some(if amax == 0.0 { 1.0 } else { amax / max })
}

/// One job: its source bytes converted into `dst`; the scales it found, if it finds any.
fn write(ctx: &Ctx<'_>, job: &Job, dst: &mut [u8]) -> Result<Option<Found>> {
    match job.work {
        Work::Copy => {
            let from = bytes_at(ctx.src, job.src.clone())?;
            if from.len() != dst.len() {
                return Err(Error::State("a copied piece changes length"));
            }
            dst.copy_from_slice(from);
        }
        Work::Cast { from: f, to } => {
            let from = bytes_at(ctx.src, job.src.clone())?;
            match (f, to) {
                (DType::F32, DType::BF16) => kernels::f32_to_bf16(typed(from)?, typed_mut(dst)?),
                (DType::F32, DType::F16) => kernels::f32_to_f16(typed(from)?, typed_mut(dst)?),
                (DType::BF16, DType::F32) => kernels::bf16_to_f32(typed(from)?, typed_mut(dst)?),
                (DType::F16, DType::F32) => kernels::f16_to_f32(typed(from)?, typed_mut(dst)?),
                _ => return Err(Error::State("an unsupported cast")),
            }
        }
        Work::Fp8 { from: f, to, scale } => {
            fp8(f, bytes_at(ctx.src, job.src.clone())?, to, scale, dst)?;
        }
        Work::Fp8Tensor {
            from: f,
            to,
            step,
            tensor,
        } => {
            let spec = &ctx.plan.source.tensors()[tensor];
            let runs = ctx.segments.get(tensor).map_or(&[][..], Vec::as_slice);
            let Some((scaling, _, max)) = to.fp8() else {
                return Err(Error::State("an fp8 piece of another dtype"));
            };
            let mut amax = 0;
            for r in runs {
                amax = amax.max(amax_of(f, bytes_at(ctx.src, r.src..r.src + r.len)?)?);
            }
            let scale =
                scale_of(amax, max).ok_or_else(|| non_finite(spec, scaling, ctx.src, runs))?;
            let size = f.size().max(1);
            for r in runs {
                let at = r.at / size;
                let out = dst
                    .get_mut(at..at + r.len / size)
                    .ok_or(Error::State("an fp8 run outside its tensor"))?;
                fp8(f, bytes_at(ctx.src, r.src..r.src + r.len)?, to, scale, out)?;
            }
            return Ok(Some((step, 0, vec![scale])));
        }
        Work::Fp8Rows {
            from: f,
            to,
            step,
            tensor,
            cols,
            block,
            index,
        } => {
            let Some((scaling, _, max)) = to.fp8() else {
                return Err(Error::State("an fp8 piece of another dtype"));
            };
            let from = bytes_at(ctx.src, job.src.clone())?;
            let (size, block) = (f.size().max(1), block.max(1));
            let blocks = cols.div_ceil(block);
            if cols == 0 {
                return Ok(Some((step, index * blocks, Vec::new())));
            }
            // the largest magnitude of each block of these rows, then their codes
            let mut amax = vec![0u32; blocks];
            for row in from.chunks_exact(cols * size) {
                for (m, b) in amax.iter_mut().zip(row.chunks(block * size)) {
                    *m = (*m).max(amax_of(f, b)?);
                }
            }
            let scales = amax
                .iter()
                .map(|&a| scale_of(a, max))
                .collect::<Option<Vec<f32>>>()
                .ok_or_else(|| {
                    let spec = &ctx.plan.source.tensors()[tensor];
                    let runs = ctx.segments.get(tensor).map_or(&[][..], Vec::as_slice);
                    non_finite(spec, scaling, ctx.src, runs)
                })?;
            for (src_row, dst_row) in from
                .chunks_exact(cols * size)
                .zip(dst.chunks_exact_mut(cols))
            {
                for ((src_block, dst_block), &s) in src_row
                    .chunks(block * size)
                    .zip(dst_row.chunks_mut(block))
                    .zip(&scales)
                {
                    fp8(f, src_block, to, s, dst_block)?;
                }
            }
            return Ok(Some((step, index * blocks, scales)));
        }
    }
    Ok(None)
}

/// `dst[i] = fp8(from[i] / scale)`, 16-bit floats widened (exactly) a cache-sized chunk at a
/// time.
fn fp8(f: DType, from: &[u8], to: CastTo, scale: f32, dst: &mut [u8]) -> Result<()> {
    let Some((_, overflow, _)) = to.fp8() else {
        return Err(Error::State("an fp8 piece of another dtype"));
    };
    let encode = |src: &[f32], dst: &mut [u8]| match to {
        CastTo::E4M3 { .. } => kernels::f32_to_e4m3(src, scale, overflow, dst),
        _ => kernels::f32_to_e5m2(src, scale, overflow, dst),
    };
    let widen: fn(&[u16], &mut [f32]) = match f {
        DType::F32 => {
            encode(typed(from)?, dst);
            return Ok(());
        }
        DType::BF16 => kernels::bf16_to_f32,
        DType::F16 => kernels::f16_to_f32,
        _ => return Err(Error::State("fp8 from a dtype that is not a float")),
    };
    let mut wide = [0f32; WIDEN];
    for (src, dst) in typed::<u16>(from)?.chunks(WIDEN).zip(dst.chunks_mut(WIDEN)) {
        let wide = &mut wide[..src.len()];
        widen(src, wide);
        encode(wide, dst);
    }
    Ok(())
}

/// The largest magnitude of the `f`-typed elements of `b`, as `f32` bits with the sign
/// cleared (`>= 0x7f80_0000` when one is infinite or NaN).
fn amax_of(f: DType, b: &[u8]) -> Result<u32> {
    let mut m = 0;
    match f {
        DType::F32 => kernels::f32_amax(typed(b)?, &mut m),
        DType::BF16 | DType::F16 => {
            let mut h = 0;
            kernels::half_amax(typed(b)?, &mut h);
            let mut wide = [0f32];
            if f == DType::BF16 {
                kernels::bf16_to_f32(&[h], &mut wide);
            } else {
                kernels::f16_to_f32(&[h], &mut wide);
            }
            m = wide[0].to_bits() & 0x7fff_ffff;
        }
        _ => return Err(Error::State("a scale of a dtype that is not a float")),
    }
    Ok(m)
}

/// The scales of the tensors with one fp8 scale larger than [`LOCAL`], found in a pass of
/// their own (`None` for every other step).
fn early_scales(ctx: &Ctx<'_>) -> Result<Vec<Option<f32>>> {
    let specs = ctx.plan.source.tensors();
    let mut scans: Vec<(usize, Range<usize>)> = Vec::new();
    for (k, step) in ctx.plan.steps().iter().enumerate() {
        let Step::Convert { src: s, to, .. } = *step else {
            continue;
        };
        let spec = &specs[s];
        if !matches!(to.fp8(), Some((Scaling::PerTensor, ..))) || spec.len <= LOCAL {
            continue;
        }
        let runs = ctx
            .segments
            .get(s)
            .ok_or(Error::State("a cast without the runs of a source tensor"))?;
        for (r, at, n) in cut(runs, spec.dtype.size().max(1)) {
            scans.push((k, r.src + at..r.src + at + n));
        }
    }
    let mut amax = vec![None; ctx.plan.steps().len()];
    if scans.is_empty() {
        return Ok(amax);
    }
    let threads = threads_for(scans.iter().map(|s| s.1.len()).sum());
    let found = on_threads(shares(&scans, threads), |share| {
        share
            .iter()
            .map(|(k, r)| {
                let Step::Convert { src, .. } = ctx.plan.steps()[*k] else {
                    return Err(Error::State("a scale scan of a copy"));
                };
                amax_of(specs[src].dtype, bytes_at(ctx.src, r.clone())?)
            })
            .collect::<Result<Vec<u32>>>()
    })?;
    let found = found.into_iter().flatten();
    let mut bits: Vec<u32> = vec![0; ctx.plan.steps().len()];
    for ((k, _), b) in scans.iter().zip(found) {
        bits[*k] = bits[*k].max(b);
        amax[*k] = Some(0.0);
    }
    for (k, step) in ctx.plan.steps().iter().enumerate() {
        let (Some(_), Step::Convert { src, to, .. }) = (amax[k], *step) else {
            continue;
        };
        let Some((scaling, _, max)) = to.fp8() else {
            continue;
        };
        let runs = ctx.segments.get(src).map_or(&[][..], Vec::as_slice);
        amax[k] = Some(
            scale_of(bits[k], max)
                .ok_or_else(|| non_finite(&specs[src], scaling, ctx.src, runs))?,
        );
    }
    Ok(amax)
}

/// The error for a scaled tensor holding a NaN or infinity: the first such element (in the
/// tensor's order; per-block, of the first block holding one, blocks row by row), as the
/// scale of its tensor or block cannot be computed.
fn non_finite(spec: &TensorSpec, scaling: Scaling, src: &[u8], runs: &[Segment]) -> Error {
    let size = spec.dtype.size().max(1);
    let value = |i: usize| -> f32 {
        // element `i` of the tensor, through its runs
        let at = i * size;
        let Some(r) = runs.iter().find(|r| r.at <= at && at < r.at + r.len) else {
            return 0.0;
        };
        let off = r.src + at - r.at;
        match (spec.dtype, src.get(off..off + size).unwrap_or_default()) {
            (DType::F32, &[a, b, c, d]) => f32::from_le_bytes([a, b, c, d]),
            (DType::BF16, &[a, b]) => half::bf16::from_le_bytes([a, b]).to_f32(),
            (DType::F16, &[a, b]) => half::f16::from_le_bytes([a, b]).to_f32(),
            _ => 0.0,
        }
    };
    let (rows, cols) = as_matrix(&spec.shape);
    let (br, bc) = match scaling {
        Scaling::PerBlock { rows, cols } => (rows.max(1), cols.max(1)),
        _ => (rows.max(1), cols.max(1)),
    };
    let mut first = 0;
    'blocks: for r0 in (0..rows).step_by(br) {
        for c0 in (0..cols).step_by(bc) {
            let (r1, c1) = ((r0 + br).min(rows), (c0 + bc).min(cols));
            if let Some(i) = (r0..r1)
                .flat_map(|r| (c0..c1).map(move |c| r * cols + c))
                .find(|&i| !value(i).is_finite())
            {
                first = i;
                break 'blocks;
            }
        }
    }
    cast_error(
        &spec.name,
        format!(
            "element {first} is {}; a scale needs finite values",
            value(first)
        ),
    )
}
