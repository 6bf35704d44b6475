//! Adapting a trainer's weights to an engine's layout: rename, fuse, split, transpose.
//!
//! Write [`LayoutRules`] once; [`LayoutPlan::new`] checks them against the trainer's
//! [`Manifest`] at connect and computes the engine's manifest; [`LayoutPlan::apply`] then
//! turns each version into the engine's layout with exact byte copies.

mod kernels;
mod pattern;
mod rules;

use std::collections::HashMap;
use std::fmt;

use crate::error::{Error, Result};
use crate::manifest::{Manifest, TensorSpec};
use crate::plan::{Checked, Ops, Plan, Sealed};
use crate::weights::WeightSet;

pub(crate) use pattern::Pattern;
pub use rules::LayoutRules;
use rules::Rule;

/// One step of a layout plan; indices are positions in the source / target manifests.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    Copy {
        src: usize,
        dst: usize,
    },
    Transpose {
        src: usize,
        dst: usize,
    },
    Fuse {
        srcs: Vec<usize>,
        dst: usize,
        axis: usize,
    },
    Split {
        src: usize,
        dsts: Vec<usize>,
        axis: usize,
    },
}

/// An op before the target manifest exists: target names with dtype and shape.
struct Pending {
    first_src: usize,
    kind: PendingKind,
    outputs: Vec<(String, Vec<usize>)>,
}

enum PendingKind {
    Copy(usize),
    Transpose(usize),
    Fuse(Vec<usize>, usize),
    Split(usize, usize),
}

/// The operations of a [`LayoutPlan`] (renames, transposes, fusions, splits).
#[derive(Clone, Debug)]
pub struct LayoutOps(Vec<Op>);

/// A checked mapping from a source manifest to a target manifest, computed once and applied
/// to every version ([`Plan::apply`]) with exact byte copies.
pub type LayoutPlan = Plan<LayoutOps>;

impl LayoutPlan {
    /// Checks `rules` against `source` and computes the target manifest.
    ///
    /// Target tensors are laid out in the order of their first source tensor; the parts of a
    /// split follow each other.
    ///
    /// # Errors
    /// [`Error::Layout`] naming the rule or tensor when a pattern does not parse, a rule
    /// matches no tensor, a tensor is matched by two rules (or twice by one), a tensor is
    /// matched by none (and [`LayoutRules::keep_unmatched`] was not called), a fuse group
    /// lacks a member or its shapes or dtypes disagree, a split does not divide its axis, a
    /// transpose is not 2-D, or two rules produce the same name.
    pub fn new(source: &Manifest, rules: &LayoutRules) -> Result<Self> {
        if let Some(e) = &rules.error {
            return Err(clone_layout_error(e));
        }
        let specs = source.tensors();
        let mut claimed: Vec<Option<usize>> = vec![None; specs.len()];
        for (r, rule) in rules.rules.iter().enumerate() {
            rule.check_placeholders()?;
            let mut any = false;
            for pat in rule.sources() {
                for (t, spec) in specs.iter().enumerate() {
                    if pat.matches(&spec.name).is_none() {
                        continue;
                    }
                    any = true;
                    if let Some(prev) = claimed[t] {
                        return Err(Error::Layout {
                            culprit: format!("tensor `{}`", spec.name),
                            reason: if prev == r {
                                format!("matched twice by rule `{rule}`")
                            } else {
                                format!("matched by rule `{}` and rule `{rule}`", rules.rules[prev])
                            },
                        });
                    }
                    claimed[t] = Some(r);
                }
            }
            if !any {
                return Err(rule.error("matches no tensor"));
            }
        }
        let mut pending = Vec::new();
        for rule in &rules.rules {
            plan_rule(rule, source, &mut pending)?;
        }
        for (t, c) in claimed.iter().enumerate() {
            if c.is_none() {
                if !rules.keep_unmatched {
                    return Err(Error::Layout {
                        culprit: format!("tensor `{}`", specs[t].name),
                        reason: "no rule maps it (add a rule, `keep` it or `keep_unmatched`)"
                            .into(),
                    });
                }
                pending.push(Pending {
                    first_src: t,
                    kind: PendingKind::Copy(t),
                    outputs: vec![(specs[t].name.clone(), specs[t].shape.clone())],
                });
            }
        }
        pending.sort_by_key(|p| p.first_src);
        let mut builder = Manifest::builder();
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, p) in pending.iter().enumerate() {
            for (name, shape) in &p.outputs {
                if let Some(prev) = seen.insert(name, i) {
                    let from = |q: &Pending| specs[q.first_src].name.clone();
                    return Err(Error::Layout {
                        culprit: format!("tensor `{name}`"),
                        reason: format!(
                            "produced twice (from `{}` and from `{}`)",
                            from(&pending[prev]),
                            from(p)
                        ),
                    });
                }
                builder.push(name.clone(), specs[p.first_src].dtype, shape);
            }
        }
        let target = builder.build()?;
        let pos = |name: &str| target.position(name).unwrap_or(usize::MAX);
        let ops = pending
            .iter()
            .map(|p| {
                let dst = pos(&p.outputs[0].0);
                match &p.kind {
                    PendingKind::Copy(s) => Op::Copy { src: *s, dst },
                    PendingKind::Transpose(s) => Op::Transpose { src: *s, dst },
                    PendingKind::Fuse(srcs, axis) => Op::Fuse {
                        srcs: srcs.clone(),
                        dst,
                        axis: *axis,
                    },
                    PendingKind::Split(s, axis) => Op::Split {
                        src: *s,
                        dsts: p.outputs.iter().map(|(n, _)| pos(n)).collect(),
                        axis: *axis,
                    },
                }
            })
            .collect();
        Ok(Plan::of(source, target, LayoutOps(ops)))
    }
}

impl Sealed for LayoutOps {}

impl Ops for LayoutOps {
    fn write(
        plan: &LayoutPlan,
        weights: &WeightSet,
        out: &mut WeightSet,
        _: Checked,
    ) -> Result<()> {
        let src_specs = plan.source.tensors();
        let dst_specs = plan.target.tensors();
        let src = weights.bytes();
        let dst = out.bytes_mut()?;
        for op in &plan.ops.0 {
            match op {
                Op::Copy { src: s, dst: d } => {
                    dst[dst_specs[*d].range()].copy_from_slice(&src[src_specs[*s].range()]);
                }
                Op::Transpose { src: s, dst: d } => {
                    let spec = &src_specs[*s];
                    kernels::transpose(
                        &src[spec.range()],
                        &mut dst[dst_specs[*d].range()],
                        spec.shape[0],
                        spec.shape[1],
                        spec.dtype.size(),
                    );
                }
                Op::Fuse { srcs, dst: d, axis } => {
                    let parts: Vec<&[u8]> =
                        srcs.iter().map(|s| &src[src_specs[*s].range()]).collect();
                    let (runs, outer) = runs(srcs.iter().map(|s| &src_specs[*s]), *axis);
                    kernels::concat(&parts, &runs, outer, &mut dst[dst_specs[*d].range()]);
                }
                Op::Split { src: s, dsts, axis } => {
                    let (runs, outer) = runs(dsts.iter().map(|d| &dst_specs[*d]), *axis);
                    let mut outs = disjoint_mut(dst, dsts.iter().map(|d| dst_specs[*d].range()));
                    kernels::cut(&src[src_specs[*s].range()], &runs, outer, &mut outs);
                }
            }
        }
        out.set_version(weights.version());
        Ok(())
    }
}

/// A run of bytes the layout moves unchanged: `len` bytes of the source arena from `src` land
/// at byte `at` of a target tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    /// Byte offset in the source arena.
    pub(crate) src: usize,
    /// Byte offset inside the target tensor.
    pub(crate) at: usize,
    /// Bytes.
    pub(crate) len: usize,
}

impl Segment {
    /// The whole tensor `spec`, unmoved.
    pub(crate) fn whole(spec: &TensorSpec) -> Self {
        Self {
            src: spec.offset,
            at: 0,
            len: spec.len,
        }
    }
}

impl LayoutPlan {
    /// Where each target tensor's bytes come from, as runs of the source arena in the
    /// tensor's order (runs that follow each other on both sides merged): what lets a cast
    /// read the trainer's bytes straight from their place instead of from a laid-out copy.
    /// `None` when an op reorders the elements of a run (a transpose).
    pub(crate) fn segments(&self) -> Option<Vec<Vec<Segment>>> {
        let src_specs = self.source.tensors();
        let dst_specs = self.target.tensors();
        let mut out: Vec<Vec<Segment>> = vec![Vec::new(); dst_specs.len()];
        let mut push = |d: usize, seg: Segment| {
            let runs = &mut out[d];
            match runs.last_mut() {
                Some(last) if last.src + last.len == seg.src && last.at + last.len == seg.at => {
                    last.len += seg.len;
                }
                _ => runs.push(seg),
            }
        };
        for op in &self.ops.0 {
            match op {
                Op::Copy { src, dst } => push(*dst, Segment::whole(&src_specs[*src])),
                Op::Transpose { .. } => return None,
                Op::Fuse { srcs, dst, axis } => {
                    let (runs, outer) = runs(srcs.iter().map(|s| &src_specs[*s]), *axis);
                    let mut at = 0;
                    for o in 0..outer {
                        for (s, &run) in srcs.iter().zip(&runs) {
                            let src = src_specs[*s].offset + o * run;
                            push(*dst, Segment { src, at, len: run });
                            at += run;
                        }
                    }
                }
                Op::Split { src, dsts, axis } => {
                    let (runs, outer) = runs(dsts.iter().map(|d| &dst_specs[*d]), *axis);
                    let mut from = src_specs[*src].offset;
                    for o in 0..outer {
                        for (d, &run) in dsts.iter().zip(&runs) {
                            push(
                                *d,
                                Segment {
                                    src: from,
                                    at: o * run,
                                    len: run,
                                },
                            );
                            from += run;
                        }
                    }
                }
            }
        }
        Some(out)
    }
}

/// Run lengths along `axis` of each spec, and the shared outer count.
fn runs<'a>(specs: impl Iterator<Item = &'a TensorSpec>, axis: usize) -> (Vec<usize>, usize) {
    let mut outer_n = 1;
    let runs = specs
        .map(|s| {
            outer_n = kernels::outer(&s.shape, axis);
            s.shape[axis] * kernels::inner_bytes(&s.shape, axis, s.dtype.size())
        })
        .collect();
    (runs, outer_n)
}

/// Disjoint mutable slices of `bytes` for ranges in increasing order (as laid out by one plan).
pub(crate) fn disjoint_mut(
    bytes: &mut [u8],
    ranges: impl Iterator<Item = std::ops::Range<usize>>,
) -> Vec<&mut [u8]> {
    let mut out = Vec::new();
    let mut rest = bytes;
    let mut base = 0;
    for r in ranges {
        let tail = std::mem::take(&mut rest);
        let (_, from_start) = tail.split_at_mut(r.start - base);
        let (piece, after) = from_start.split_at_mut(r.len());
        out.push(piece);
        rest = after;
        base = r.end;
    }
    out
}

/// Layout errors are plain data; rebuild one so a rule set can be reused after a failure.
fn clone_layout_error(e: &Error) -> Error {
    match e {
        Error::Layout { culprit, reason } => Error::Layout {
            culprit: culprit.clone(),
            reason: reason.clone(),
        },
        other => Error::Layout {
            culprit: "rules".into(),
            reason: other.to_string(),
        },
    }
}

fn plan_rule(rule: &Rule, source: &Manifest, out: &mut Vec<Pending>) -> Result<()> {
    let specs = source.tensors();
    let matches = |p: &Pattern| {
        specs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| p.matches(&s.name).map(|c| (i, c)))
            .collect::<Vec<_>>()
    };
    match rule {
        Rule::Keep { pattern } => {
            for (i, _) in matches(pattern) {
                out.push(Pending {
                    first_src: i,
                    kind: PendingKind::Copy(i),
                    outputs: vec![(specs[i].name.clone(), specs[i].shape.clone())],
                });
            }
        }
        Rule::Rename { from, to } => {
            for (i, caps) in matches(from) {
                out.push(Pending {
                    first_src: i,
                    kind: PendingKind::Copy(i),
                    outputs: vec![(to.fill(&caps)?, specs[i].shape.clone())],
                });
            }
        }
        Rule::Transpose { from, to } => {
            for (i, caps) in matches(from) {
                let s = &specs[i];
                if s.shape.len() != 2 {
                    return Err(rule.error(format!(
                        "tensor `{}` has shape {:?}; only 2-D tensors are transposed",
                        s.name, s.shape
                    )));
                }
                out.push(Pending {
                    first_src: i,
                    kind: PendingKind::Transpose(i),
                    outputs: vec![(to.fill(&caps)?, vec![s.shape[1], s.shape[0]])],
                });
            }
        }
        Rule::Fuse { from, to, axis } => {
            let groups = matches(&from[0]);
            for pat in &from[1..] {
                let n = matches(pat).len();
                if n != groups.len() {
                    return Err(rule.error(format!(
                        "`{}` matches {} tensors but `{pat}` matches {n}; every fuse group needs all {} members",
                        from[0],
                        groups.len(),
                        from.len()
                    )));
                }
            }
            for (first, caps) in groups {
                let mut members = vec![first];
                for pat in &from[1..] {
                    let name = pat.fill(&caps)?;
                    let i = source.position(&name).ok_or_else(|| {
                        rule.error(format!(
                            "fuse group of `{}` lacks `{name}`",
                            specs[first].name
                        ))
                    })?;
                    members.push(i);
                }
                let shape = fused_shape(rule, &members, specs, *axis)?;
                out.push(Pending {
                    first_src: members.iter().copied().min().unwrap_or(first),
                    kind: PendingKind::Fuse(members, *axis),
                    outputs: vec![(to.fill(&caps)?, shape)],
                });
            }
        }
        Rule::Split {
            from,
            to,
            axis,
            sizes,
        } => {
            for (i, caps) in matches(from) {
                let s = &specs[i];
                let dim = *s.shape.get(*axis).ok_or_else(|| {
                    rule.error(format!(
                        "tensor `{}` has shape {:?}, no axis {axis}",
                        s.name, s.shape
                    ))
                })?;
                let sizes = match sizes {
                    Some(v) => v.clone(),
                    None if dim % to.len() == 0 => vec![dim / to.len(); to.len()],
                    None => {
                        return Err(rule.error(format!(
                            "tensor `{}`: axis {axis} of size {dim} does not split into {} equal parts",
                            s.name,
                            to.len()
                        )));
                    }
                };
                if sizes.iter().sum::<usize>() != dim {
                    return Err(rule.error(format!(
                        "tensor `{}`: parts {sizes:?} do not add up to axis {axis} of size {dim}",
                        s.name
                    )));
                }
                let outputs = to
                    .iter()
                    .zip(&sizes)
                    .map(|(p, &n)| {
                        let mut shape = s.shape.clone();
                        shape[*axis] = n;
                        Ok((p.fill(&caps)?, shape))
                    })
                    .collect::<Result<Vec<_>>>()?;
                out.push(Pending {
                    first_src: i,
                    kind: PendingKind::Split(i, *axis),
                    outputs,
                });
            }
        }
    }
    Ok(())
}

fn fused_shape(
    rule: &Rule,
    members: &[usize],
    specs: &[TensorSpec],
    axis: usize,
) -> Result<Vec<usize>> {
    let first = &specs[members[0]];
    if axis >= first.shape.len() {
        return Err(rule.error(format!(
            "tensor `{}` has shape {:?}, no axis {axis}",
            first.name, first.shape
        )));
    }
    let mut shape = first.shape.clone();
    for &m in &members[1..] {
        let s = &specs[m];
        let same_rest = s.shape.len() == first.shape.len()
            && s.shape
                .iter()
                .zip(&first.shape)
                .enumerate()
                .all(|(d, (a, b))| d == axis || a == b);
        if s.dtype != first.dtype || !same_rest {
            return Err(rule.error(format!(
                "`{}` ({} {:?}) cannot be fused with `{}` ({} {:?}) on axis {axis}",
                s.name, s.dtype, s.shape, first.name, first.dtype, first.shape
            )));
        }
        shape[axis] += s.shape[axis];
    }
    Ok(shape)
}

impl fmt::Display for LayoutPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, t) = (self.source.tensors(), self.target.tensors());
        let desc = |x: &TensorSpec| format!("{} {} {:?}", x.name, x.dtype, x.shape);
        for op in &self.ops.0 {
            match op {
                Op::Copy { src, dst } if s[*src].name == t[*dst].name => {
                    writeln!(f, "keep      {}", desc(&s[*src]))?;
                }
                Op::Copy { src, dst } => {
                    writeln!(f, "rename    {} -> {}", s[*src].name, desc(&t[*dst]))?;
                }
                Op::Transpose { src, dst } => {
                    writeln!(f, "transpose {} -> {}", desc(&s[*src]), desc(&t[*dst]))?;
                }
                Op::Fuse { srcs, dst, axis } => {
                    let names: Vec<&str> = srcs.iter().map(|i| s[*i].name.as_str()).collect();
                    writeln!(
                        f,
                        "fuse      [{}] -axis {axis}-> {}",
                        names.join(", "),
                        desc(&t[*dst])
                    )?;
                }
                Op::Split { src, dsts, axis } => {
                    let names: Vec<String> = dsts.iter().map(|i| desc(&t[*i])).collect();
                    writeln!(
                        f,
                        "split     {} -axis {axis}-> [{}]",
                        desc(&s[*src]),
                        names.join(", ")
                    )?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
