//! The transfer plan of many senders and many receivers: which bytes go from which sender
//! to which receiver, when trainer shards each hold a part of a version and engines each
//! serve a part of it.
//!
//! Each sender holds, per tensor, a [`Part`]: the whole tensor, a slice along one dimension
//! (a tensor-parallel shard), or a contiguous range of the flattened tensor (an FSDP flat
//! shard). Each receiver wants, per tensor, a `Part` in its own layout. A part is a set of
//! runs of the tensor's row-major elements; both ends keep their part contiguous, in
//! row-major order (a slice's rows one after the other).
//!
//! [`MeshPlan::compute`] checks the whole of it before a byte moves: the senders' parts of
//! every wanted tensor do not overlap, and cover every element wanted of it (a gap or an
//! overlap is refused naming the tensor, the element range and the senders), every slice
//! divides its dimension, every name is the manifest's. It then cuts each receiver's runs by the senders' runs into
//! pieces (sender, offset in the sender's part, offset in the receiver's part, bytes),
//! merged where they continue each other. The plan depends on the layouts alone, so it is
//! computed once and replayed for every version.
//!
//! This is plain code: no socket, no thread, no clock.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::manifest::{Manifest, TensorSpec};

/// A part of one tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Part {
    /// Every element.
    Whole,
    /// Slice `rank` of `world` equal slices along dimension `dim` (a tensor-parallel
    /// shard: dimension 0 cuts rows, 1 columns of a matrix).
    Slice {
        /// The dimension cut.
        dim: usize,
        /// Which slice.
        rank: usize,
        /// How many slices.
        world: usize,
    },
    /// Elements `start..end` of the flattened tensor (an FSDP flat shard).
    Flat {
        /// First element.
        start: usize,
        /// One past the last element.
        end: usize,
    },
}

/// What one end holds or wants: a part per tensor, by name; tensors not named are not held
/// (a sender) or not wanted (a receiver).
pub type Parts = Vec<(String, Part)>;

/// Bytes that go from one sender to one receiver for one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The sender (its index in the senders given).
    pub sender: usize,
    /// The tensor (its position in the manifest).
    pub tensor: usize,
    /// Byte offset in the sender's part of the tensor.
    pub src: usize,
    /// Byte offset in the receiver's part of the tensor.
    pub dst: usize,
    /// Bytes.
    pub len: usize,
}

/// The checked plan: per receiver, its pieces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshPlan {
    /// Per receiver (in the order given), its pieces, tensor by tensor in manifest order,
    /// ascending in the receiver's part.
    pub receivers: Vec<Vec<Piece>>,
    /// How many senders the plan was made for.
    pub senders: usize,
}

impl MeshPlan {
    /// Plans how `receivers` get the parts they want from the parts `senders` hold, for
    /// tensors of `manifest`.
    ///
    /// # Errors
    /// [`Error::Mesh`] naming the tensor: a name not in the manifest, named twice by one
    /// end, a slice of a dimension it does not have or that does not divide it, a flat range
    /// past the tensor; a tensor some receiver wants whose senders' parts overlap, or leave
    /// out an element wanted (naming the element range and the senders).
    pub fn compute(manifest: &Manifest, senders: &[Parts], receivers: &[Parts]) -> Result<Self> {
        let tensors = manifest.tensors();
        let index = |name: &str| {
            tensors
                .iter()
                .position(|t| t.name == name)
                .ok_or_else(|| mesh(name, "not in the manifest"))
        };
        // per tensor: every sender's runs, each with its offset in the sender's part
        let mut held: BTreeMap<usize, Vec<Held>> = BTreeMap::new();
        for (s, parts) in senders.iter().enumerate() {
            for t in named_once(parts, &index)? {
                let (t, part) = t;
                let mut at = 0;
                for run in runs(&tensors[t], part)? {
                    let len = run.len();
                    held.entry(t).or_default().push(Held {
                        sender: s,
                        run,
                        local: at,
                    });
                    at += len;
                }
            }
        }
        // the senders' parts of each wanted tensor may not overlap, and must cover what is
        // wanted of it
        let mut checked = std::collections::BTreeSet::new();
        let mut plans = Vec::with_capacity(receivers.len());
        for parts in receivers {
            let mut wanted = named_once(parts, &index)?;
            wanted.sort_by_key(|(t, _)| *t);
            let mut pieces = Vec::new();
            for (t, part) in wanted {
                let spec = &tensors[t];
                let h = held
                    .get_mut(&t)
                    .ok_or_else(|| mesh(&spec.name, "wanted, and held by no sender"))?;
                if checked.insert(t) {
                    check_disjoint(spec, h)?;
                }
                cut(t, spec, &runs(spec, part)?, h, &mut pieces)?;
            }
            plans.push(pieces);
        }
        Ok(Self {
            receivers: plans,
            senders: senders.len(),
        })
    }

    /// Bytes receiver `r` gets.
    pub fn bytes_to(&self, r: usize) -> usize {
        self.receivers
            .get(r)
            .map_or(0, |p| p.iter().map(|p| p.len).sum())
    }

    /// Bytes sender `s` sends, to every receiver together.
    pub fn bytes_from(&self, s: usize) -> usize {
        self.receivers
            .iter()
            .flatten()
            .filter(|p| p.sender == s)
            .map(|p| p.len)
            .sum()
    }
}

/// Every tensor of `manifest`, slice `rank` of `world` along dimension `dim`: what a
/// tensor-parallel rank holds (a trainer shard, `dim` 0: its rows) or serves (an engine,
/// `dim` 1: its columns) of a model whose tensors are all cut the same way. Checked where
/// it is used ([`MeshPlan::compute`], a mesh end's construction).
pub fn slices(manifest: &Manifest, dim: usize, rank: usize, world: usize) -> Parts {
    manifest
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), Part::Slice { dim, rank, world }))
        .collect()
}

/// Every tensor of `manifest`, whole: what an engine serving the whole model wants.
pub fn wholes(manifest: &Manifest) -> Parts {
    manifest
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), Part::Whole))
        .collect()
}

/// The model's elements, in manifest order, cut into `world` contiguous runs of about
/// equal bytes, one per shard (FSDP's flat sharding): shard `s` holds the tensors its run
/// covers, each whole or as a [`Part::Flat`] range. Together the shards hold every element
/// once; a shard whose run is empty (more shards than elements) holds nothing.
pub fn flat_shards(manifest: &Manifest, world: usize) -> Vec<Parts> {
    let world = world.max(1);
    let total = manifest.payload_len();
    let mut shards: Vec<Parts> = vec![Vec::new(); world];
    // byte position of each tensor's first element in the manifest-order concatenation
    let mut at = 0usize;
    for t in manifest.tensors() {
        let el = t.dtype.size().max(1);
        let n = t.numel();
        for (s, parts) in shards.iter_mut().enumerate() {
            // the shard's byte run, cut at element boundaries of this tensor
            let (lo, hi) = (total * s / world, total * (s + 1) / world);
            let start = lo.saturating_sub(at).div_ceil(el).min(n);
            let end = hi.saturating_sub(at).div_ceil(el).min(n);
            if start < end {
                let part = if start == 0 && end == n {
                    Part::Whole
                } else {
                    Part::Flat { start, end }
                };
                parts.push((t.name.clone(), part));
            }
        }
        at += t.len;
    }
    shards
}

/// Bytes of `part` of tensor `name` of `manifest` (what an end holding it keeps).
///
/// # Errors
/// [`Error::Mesh`] naming the tensor: not in the manifest, or a part that does not fit it.
pub fn part_bytes(manifest: &Manifest, name: &str, part: &Part) -> Result<usize> {
    let spec = manifest
        .get(name)
        .ok_or_else(|| mesh(name, "not in the manifest"))?;
    let elements: usize = runs(spec, part)?.iter().map(ExactSizeIterator::len).sum();
    Ok(elements * spec.dtype.size())
}

/// The bytes of `part` of tensor `name`, cut from the whole tensor's bytes `whole` (what a
/// trainer holding the whole tensor publishes as one shard's part, or what an engine's part
/// should hold), in one shared buffer made in place: what a mesh sender publishes.
///
/// # Errors
/// [`Error::Mesh`] naming the tensor: not in the manifest, a part that does not fit it, or
/// `whole` not the tensor's length.
pub fn extract(manifest: &Manifest, name: &str, part: &Part, whole: &[u8]) -> Result<Arc<[u8]>> {
    let spec = manifest
        .get(name)
        .ok_or_else(|| mesh(name, "not in the manifest"))?;
    if whole.len() != spec.len {
        return Err(mesh(
            name,
            format!("{} bytes given for a tensor of {}", whole.len(), spec.len),
        ));
    }
    let el = spec.dtype.size();
    // allocated once, as an `Arc` (an `Arc` of a `Vec` would copy the part once more)
    let mut out: Arc<[u8]> = std::iter::repeat_n(0u8, part_bytes(manifest, name, part)?).collect();
    let dst = Arc::get_mut(&mut out).ok_or(Error::State("a new buffer is shared"))?;
    let mut at = 0;
    for r in runs(spec, part)? {
        let bytes = &whole[r.start * el..r.end * el];
        dst[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    }
    Ok(out)
}

/// One run of a sender's part: elements of the flattened tensor, and where they start in
/// the sender's part.
#[derive(Clone, Debug)]
struct Held {
    sender: usize,
    run: Range<usize>,
    local: usize,
}

fn mesh(tensor: &str, reason: impl Into<String>) -> Error {
    Error::Mesh {
        tensor: tensor.to_owned(),
        reason: reason.into(),
    }
}

/// The parts of one end by manifest position, refusing a name given twice.
fn named_once<'a>(
    parts: &'a Parts,
    index: &impl Fn(&str) -> Result<usize>,
) -> Result<Vec<(usize, &'a Part)>> {
    let mut out: Vec<(usize, &Part)> = Vec::with_capacity(parts.len());
    for (name, part) in parts {
        let t = index(name)?;
        if out.iter().any(|(u, _)| *u == t) {
            return Err(mesh(name, "named twice by one end"));
        }
        out.push((t, part));
    }
    Ok(out)
}

/// The runs of `part` of `spec`, in elements of the flattened tensor, ascending and merged.
fn runs(spec: &TensorSpec, part: &Part) -> Result<Vec<Range<usize>>> {
    let numel = spec.numel();
    match *part {
        Part::Whole => Ok(std::iter::once(0..numel).collect()),
        Part::Flat { start, end } => {
            if start > end || end > numel {
                return Err(mesh(
                    &spec.name,
                    format!("flat range {start}..{end} of a tensor of {numel} elements"),
                ));
            }
            Ok(std::iter::once(start..end).collect())
        }
        Part::Slice { dim, rank, world } => {
            let Some(&n) = spec.shape.get(dim) else {
                return Err(mesh(
                    &spec.name,
                    format!("slice along dimension {dim} of shape {:?}", spec.shape),
                ));
            };
            if world == 0 || rank >= world || n % world != 0 {
                return Err(mesh(
                    &spec.name,
                    format!(
                        "slice {rank} of {world} along dimension {dim} of size {n}: the \
                         slices must divide it"
                    ),
                ));
            }
            let inner: usize = spec.shape[dim + 1..].iter().product();
            let outer: usize = spec.shape[..dim].iter().product();
            let (step, len) = (n * inner, n / world * inner);
            let mut out: Vec<Range<usize>> = Vec::new();
            for o in 0..outer {
                let start = o * step + rank * len;
                match out.last_mut() {
                    Some(last) if last.end == start => last.end = start + len,
                    _ if len > 0 => out.push(start..start + len),
                    _ => {}
                }
            }
            Ok(out)
        }
    }
}

/// Refuses senders' runs of `spec` that overlap (sorting them by start): two shards may not
/// both hold an element.
fn check_disjoint(spec: &TensorSpec, held: &mut [Held]) -> Result<()> {
    held.sort_by_key(|h| (h.run.start, h.run.end));
    let mut end = 0;
    let mut last: Option<usize> = None;
    for h in held.iter().filter(|h| !h.run.is_empty()) {
        if h.run.start < end {
            return Err(mesh(
                &spec.name,
                format!(
                    "elements {}..{} are held by sender {} and sender {}",
                    h.run.start,
                    end.min(h.run.end),
                    last.unwrap_or(h.sender),
                    h.sender
                ),
            ));
        }
        end = h.run.end;
        last = Some(h.sender);
    }
    Ok(())
}

/// Cuts the receiver's `wanted` runs of tensor `t` by the senders' runs `held` (sorted,
/// disjoint), appending the pieces, merged where they continue each other.
///
/// # Errors
/// [`Error::Mesh`] naming the tensor and the elements when a wanted element is held by no
/// sender.
fn cut(
    t: usize,
    spec: &TensorSpec,
    wanted: &[Range<usize>],
    held: &[Held],
    out: &mut Vec<Piece>,
) -> Result<()> {
    let el = spec.dtype.size();
    let mut local = 0;
    for w in wanted {
        let mut i = held.partition_point(|h| h.run.end <= w.start);
        let mut at = w.start;
        while at < w.end {
            let h = match held.get(i) {
                Some(h) if h.run.start <= at => h,
                next => {
                    let gap_end = next.map_or(w.end, |h| h.run.start.min(w.end));
                    return Err(mesh(
                        &spec.name,
                        format!("elements {at}..{gap_end} are held by no sender"),
                    ));
                }
            };
            let end = w.end.min(h.run.end);
            let piece = Piece {
                sender: h.sender,
                tensor: t,
                src: (h.local + at - h.run.start) * el,
                dst: (local + at - w.start) * el,
                len: (end - at) * el,
            };
            match out.last_mut() {
                Some(p)
                    if p.sender == piece.sender
                        && p.tensor == t
                        && p.src + p.len == piece.src
                        && p.dst + p.len == piece.dst =>
                {
                    p.len += piece.len;
                }
                _ => out.push(piece),
            }
            at = end;
            i += 1;
        }
        local += w.len();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn manifest() -> Manifest {
        crate::testing::manifest(&[
            ("w", DType::F32, &[4, 6]),
            ("b", DType::F32, &[6]),
            ("e", DType::U8, &[3, 2, 4]),
        ])
        .as_ref()
        .clone()
    }

    fn whole(names: &[&str]) -> Parts {
        names
            .iter()
            .map(|n| ((*n).to_owned(), Part::Whole))
            .collect()
    }

    fn slice(name: &str, dim: usize, rank: usize, world: usize) -> (String, Part) {
        (name.to_owned(), Part::Slice { dim, rank, world })
    }

    /// The elements of `part` of a tensor whose element `i` is `i`, in the part's layout.
    fn expected(spec: &TensorSpec, part: &Part) -> Vec<usize> {
        runs(spec, part).unwrap().into_iter().flatten().collect()
    }

    /// Runs `plan` on senders' buffers (element `i` of each tensor is `i`, each element of
    /// `el` bytes holding it little-endian) and answers each receiver's buffers.
    fn execute(
        m: &Manifest,
        senders: &[Parts],
        receivers: &[Parts],
        plan: &MeshPlan,
    ) -> Vec<BTreeMap<usize, Vec<u8>>> {
        let tensors = m.tensors();
        let bytes = |spec: &TensorSpec, els: &[usize]| -> Vec<u8> {
            let el = spec.dtype.size();
            els.iter()
                .flat_map(|&i| i.to_le_bytes()[..el].to_vec())
                .collect()
        };
        let src: Vec<BTreeMap<usize, Vec<u8>>> = senders
            .iter()
            .map(|p| {
                p.iter()
                    .map(|(n, part)| {
                        let t = tensors.iter().position(|s| &s.name == n).unwrap();
                        (t, bytes(&tensors[t], &expected(&tensors[t], part)))
                    })
                    .collect()
            })
            .collect();
        receivers
            .iter()
            .zip(&plan.receivers)
            .map(|(parts, pieces)| {
                let mut dst: BTreeMap<usize, Vec<u8>> = parts
                    .iter()
                    .map(|(n, part)| {
                        let t = tensors.iter().position(|s| &s.name == n).unwrap();
                        let len = expected(&tensors[t], part).len() * tensors[t].dtype.size();
                        (t, vec![0xee; len])
                    })
                    .collect();
                for p in pieces {
                    let from = &src[p.sender][&p.tensor][p.src..p.src + p.len];
                    dst.get_mut(&p.tensor).unwrap()[p.dst..p.dst + p.len].copy_from_slice(from);
                }
                dst
            })
            .collect()
    }

    fn check_delivers(m: &Manifest, senders: &[Parts], receivers: &[Parts]) -> MeshPlan {
        let plan = MeshPlan::compute(m, senders, receivers).unwrap();
        let got = execute(m, senders, receivers, &plan);
        for (parts, got) in receivers.iter().zip(&got) {
            for (name, part) in parts {
                let (t, spec) = m
                    .tensors()
                    .iter()
                    .enumerate()
                    .find(|(_, s)| &s.name == name)
                    .unwrap();
                let el = spec.dtype.size();
                let want: Vec<u8> = expected(spec, part)
                    .iter()
                    .flat_map(|&i| i.to_le_bytes()[..el].to_vec())
                    .collect();
                assert_eq!(got[&t], want, "tensor {name}, part {part:?}");
            }
        }
        plan
    }

    #[test]
    fn row_shards_to_column_halves_each_byte_once() {
        let m = manifest();
        // two trainer shards: rows of `w`, halves of `b` and the flat halves of `e`
        let senders = vec![
            vec![
                slice("w", 0, 0, 2),
                slice("b", 0, 0, 2),
                ("e".into(), Part::Flat { start: 0, end: 12 }),
            ],
            vec![
                slice("w", 0, 1, 2),
                slice("b", 0, 1, 2),
                ("e".into(), Part::Flat { start: 12, end: 24 }),
            ],
        ];
        // two engines: columns of `w`, `b` and `e` whole
        let receivers = vec![
            vec![
                slice("w", 1, 0, 2),
                ("b".into(), Part::Whole),
                slice("e", 1, 0, 2),
            ],
            vec![
                slice("w", 1, 1, 2),
                ("b".into(), Part::Whole),
                slice("e", 1, 1, 2),
            ],
        ];
        let plan = check_delivers(&m, &senders, &receivers);
        // each engine gets half of w and e, all of b: together one replica and one b more
        let (w, b, e) = (4 * 6 * 4, 6 * 4, 24);
        assert_eq!(plan.bytes_to(0), w / 2 + b + e / 2);
        assert_eq!(plan.bytes_to(1), w / 2 + b + e / 2);
        assert_eq!(plan.bytes_from(0) + plan.bytes_from(1), w + 2 * b + e);
        // the senders share the load evenly
        assert_eq!(plan.bytes_from(0), plan.bytes_from(1));
    }

    #[test]
    fn any_cut_to_any_cut_delivers_exactly_the_wanted_elements() {
        let m = manifest();
        // n senders holding flat ranges of every tensor
        let flat = |n: usize| -> Vec<Parts> {
            (0..n)
                .map(|r| {
                    ["w", "b", "e"]
                        .iter()
                        .map(|t| {
                            let k = m.get(t).unwrap().numel();
                            let part = Part::Flat {
                                start: k * r / n,
                                end: k * (r + 1) / n,
                            };
                            ((*t).to_owned(), part)
                        })
                        .collect()
                })
                .collect()
        };
        let receivers = vec![
            whole(&["w", "b", "e"]),
            vec![slice("w", 1, 2, 3), slice("e", 2, 1, 2)],
            vec![slice("w", 0, 3, 4)],
            vec![("e".into(), Part::Flat { start: 5, end: 19 })],
        ];
        for n in [1, 2, 3, 5] {
            let plan = check_delivers(&m, &flat(n), &receivers);
            assert_eq!(plan.bytes_to(0), 4 * 6 * 4 + 6 * 4 + 24);
            assert_eq!(plan.bytes_to(2), 6 * 4);
        }
        // row shards to column and row slices
        let senders: Vec<Parts> = (0..2)
            .map(|r| vec![slice("w", 0, r, 2), slice("b", 0, r, 2)])
            .collect();
        check_delivers(
            &m,
            &senders,
            &[vec![slice("w", 1, 1, 3), slice("b", 0, 0, 3)]],
        );
    }

    #[test]
    fn gaps_overlaps_and_bad_slices_are_refused_naming_the_tensor() {
        let m = manifest();
        let want = vec![whole(&["w"])];
        let gap = vec![
            vec![("w".into(), Part::Flat { start: 0, end: 10 })],
            vec![("w".into(), Part::Flat { start: 12, end: 24 })],
        ];
        let e = MeshPlan::compute(&m, &gap, &want).unwrap_err().to_string();
        assert!(
            e.contains("`w`") && e.contains("10..12") && e.contains("no sender"),
            "{e}"
        );
        let tail = vec![vec![("w".into(), Part::Flat { start: 0, end: 20 })]];
        let e = MeshPlan::compute(&m, &tail, &want).unwrap_err().to_string();
        assert!(e.contains("20..24"), "{e}");
        let overlap = vec![
            vec![("w".into(), Part::Flat { start: 0, end: 14 })],
            vec![("w".into(), Part::Flat { start: 12, end: 24 })],
        ];
        let e = MeshPlan::compute(&m, &overlap, &want)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("12..14") && e.contains("sender 0 and sender 1"),
            "{e}"
        );
        let odd = vec![vec![slice("w", 1, 0, 4)]];
        let e = MeshPlan::compute(&m, &odd, &want).unwrap_err().to_string();
        assert!(e.contains("`w`") && e.contains("divide"), "{e}");
        let e = MeshPlan::compute(&m, &[whole(&["w"])], &[vec![slice("w", 2, 0, 1)]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("dimension 2"), "{e}");
        let e = MeshPlan::compute(&m, &[whole(&["w"])], &[whole(&["b"])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`b`") && e.contains("held by no sender"), "{e}");
        let e = MeshPlan::compute(&m, &[whole(&["w", "x"])], &want)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`x`") && e.contains("not in the manifest"),
            "{e}"
        );
        let e = MeshPlan::compute(&m, &[whole(&["w", "w"])], &want)
            .unwrap_err()
            .to_string();
        assert!(e.contains("twice"), "{e}");
        let e = MeshPlan::compute(
            &m,
            &[whole(&["w"])],
            &[vec![("w".into(), Part::Flat { start: 3, end: 99 })]],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("3..99"), "{e}");
        // a receiver wanting only what the senders hold of a tensor needs no more
        let top = vec![vec![slice("w", 0, 0, 2)]];
        let plan = MeshPlan::compute(&m, &top, &[vec![slice("w", 0, 0, 2)]]).unwrap();
        assert_eq!(plan.bytes_to(0), 48);
        let e = MeshPlan::compute(&m, &top, &[vec![slice("w", 1, 0, 2)]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("elements 12..15 are held by no sender"), "{e}");
        // a tensor nobody wants need not be covered
        assert!(
            MeshPlan::compute(
                &m,
                &[
                    whole(&["w"]),
                    vec![("b".into(), Part::Flat { start: 0, end: 2 })]
                ],
                &want
            )
            .is_ok()
        );
    }

    #[test]
    fn a_column_slice_of_row_shards_merges_contiguous_pieces() {
        let m = manifest();
        // one sender with everything: a row slice is one piece, a column slice one per row
        let plan = MeshPlan::compute(
            &m,
            &[whole(&["w"])],
            &[vec![slice("w", 0, 1, 2)], vec![slice("w", 1, 0, 2)]],
        )
        .unwrap();
        assert_eq!(
            plan.receivers[0],
            vec![Piece {
                sender: 0,
                tensor: 0,
                src: 48,
                dst: 0,
                len: 48
            }]
        );
        assert_eq!(plan.receivers[1].len(), 4);
        assert!(plan.receivers[1].iter().all(|p| p.len == 12));
    }

    #[test]
    fn row_shards_to_column_engines_by_slices_move_each_byte_once() {
        let m =
            crate::testing::manifest(&[("a", DType::F32, &[4, 6]), ("b", DType::BF16, &[2, 8])])
                .as_ref()
                .clone();
        let senders: Vec<Parts> = (0..2).map(|r| slices(&m, 0, r, 2)).collect();
        let receivers: Vec<Parts> = (0..2).map(|r| slices(&m, 1, r, 2)).collect();
        assert_eq!(senders[1], vec![slice("a", 0, 1, 2), slice("b", 0, 1, 2)]);
        let plan = check_delivers(&m, &senders, &receivers);
        // each engine gets its half, each shard sends its half: the model once in all
        assert_eq!(plan.bytes_to(0), m.payload_len() / 2);
        assert_eq!(plan.bytes_to(1), m.payload_len() / 2);
        assert_eq!(plan.bytes_from(0) + plan.bytes_from(1), m.payload_len());
        // a slice that does not divide is refused where it is planned
        assert!(MeshPlan::compute(&m, &[slices(&m, 1, 0, 4)], &receivers).is_err());
    }

    #[test]
    fn flat_shards_cover_every_element_once_in_about_equal_bytes() {
        let m = manifest();
        for world in 1..=7 {
            let shards = flat_shards(&m, world);
            assert_eq!(shards.len(), world);
            // an engine wanting the whole model is planned from them: no gap, no overlap
            let plan = check_delivers(&m, &shards, &[wholes(&m)]);
            assert_eq!(plan.bytes_to(0), m.payload_len(), "world {world}");
            let most = (0..world).map(|s| plan.bytes_from(s)).max().unwrap();
            // each within one element of the largest dtype of an equal share
            assert!(most <= m.payload_len().div_ceil(world) + 4, "world {world}");
        }
        // more shards than elements: the last ones hold nothing
        let tiny = crate::testing::manifest(&[("x", DType::F32, &[2])])
            .as_ref()
            .clone();
        let shards = flat_shards(&tiny, 4);
        assert_eq!(shards.iter().filter(|p| p.is_empty()).count(), 2);
        check_delivers(&tiny, &shards, &[wholes(&tiny)]);
    }
}
