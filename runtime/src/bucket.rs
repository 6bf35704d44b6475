//! Bucket plans: a weight set's arena cut into buckets of a configured size, one control
//! message each, and a receive-side assembler that exposes nothing until every bucket arrived.
//!
//! The plan is computed once by the sender from both ends' manifests
//! ([`BucketPlan::compute`]), shipped (it is serde), checked by the receiver against its own
//! manifest ([`BucketPlan::verify`]) and replayed for every version. Buckets cover the arena
//! contiguously from byte 0 to its end (alignment padding included, so the assembled arena is
//! bit-identical). Small tensors share a bucket; a bucket is closed early rather than cut a
//! tensor that would fit whole in the next one; a tensor larger than a bucket is cut into
//! chunks, never refused.

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Mismatch, Result};
use crate::ids::{ModelId, Version};
use crate::manifest::{ALIGN, Manifest};
use crate::weights::WeightSet;

/// One tensor, or a chunk of one, inside a bucket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// Position of the tensor in the manifest.
    pub tensor: usize,
    /// Its name.
    pub name: String,
    /// First byte of the piece, counted from the tensor's start.
    pub offset: usize,
    /// Bytes in the piece (the whole tensor unless it is chunked).
    pub len: usize,
}

impl Piece {
    /// True when the piece is only part of its tensor.
    pub fn is_chunk(&self, tensor_len: usize) -> bool {
        self.offset != 0 || self.len != tensor_len
    }
}

/// One bucket of a plan: an arena byte range and the pieces of tensors it covers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketSpec {
    /// First arena byte.
    pub start: usize,
    /// Bytes in the bucket.
    pub len: usize,
    /// The tensors or chunks it covers, in arena order (empty tensors are in none).
    pub pieces: Vec<Piece>,
}

impl BucketSpec {
    /// The arena byte range.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.len
    }

    /// Where `piece`'s bytes sit inside this bucket's bytes (`None` when `manifest` places
    /// the tensor elsewhere).
    pub fn piece_range(&self, manifest: &Manifest, piece: &Piece) -> Option<Range<usize>> {
        let start = (manifest.tensors().get(piece.tensor)?.offset + piece.offset)
            .checked_sub(self.start)?;
        let end = start.checked_add(piece.len)?;
        (end <= self.len).then_some(start..end)
    }

    /// The xxh3-64 of each piece's bytes, in piece order (an empty slice for a piece the
    /// manifest places outside the bucket).
    pub fn piece_checksums(&self, manifest: &Manifest, bytes: &[u8]) -> Vec<u64> {
        self.pieces
            .iter()
            .map(|p| {
                let r = self.piece_range(manifest, p).unwrap_or_default();
                crate::hash::xxh3_64(bytes.get(r).unwrap_or_default())
            })
            .collect()
    }

    /// The bucket's checksum from its pieces' checksums: xxh3-64 over the bucket's bytes in
    /// arena order with each piece's bytes replaced by its checksum (little-endian). The
    /// alignment padding between tensors is covered, and tensor bytes are hashed once, piece
    /// by piece — so a transport that hashes pieces as they land (or once at publish) gets
    /// the bucket checksum without a second pass.
    pub fn checksum_from_pieces(
        &self,
        manifest: &Manifest,
        bytes: &[u8],
        piece_sums: &[u64],
    ) -> u64 {
        self.checksum_with_gaps(manifest, piece_sums, |r| self.gap_in(bytes, r))
    }

    /// The bytes `r` of the bucket's `bytes`; after the last piece, all of `bytes` from
    /// there (as many as it holds).
    fn gap_in<'a>(&self, bytes: &'a [u8], r: Range<usize>) -> &'a [u8] {
        let gap = if r.end >= self.len {
            bytes.get(r.start..)
        } else {
            bytes.get(r)
        };
        gap.unwrap_or_default()
    }

    /// The bytes of the bucket that lie in no piece (padding between tensors, and after the
    /// last), as ranges relative to the bucket's start, in order: what its checksum covers
    /// besides the pieces' checksums.
    pub fn gaps(&self, manifest: &Manifest) -> Vec<Range<usize>> {
        let mut at = 0;
        let mut gaps = Vec::new();
        for p in &self.pieces {
            if let Some(r) = self.piece_range(manifest, p)
                && r.start >= at
            {
                if r.start > at {
                    gaps.push(at..r.start);
                }
                at = r.end;
            }
        }
        if at < self.len {
            gaps.push(at..self.len);
        }
        gaps
    }

    /// [`BucketSpec::checksum_from_pieces`], the bytes between the pieces given by `gap`
    /// (a range of [`BucketSpec::gaps`]; asked for in order).
    fn checksum_with_gaps<'a>(
        &self,
        manifest: &Manifest,
        piece_sums: &[u64],
        mut gap: impl FnMut(Range<usize>) -> &'a [u8],
    ) -> u64 {
        let mut h = crate::hash::Xxh3::new();
        let mut at = 0;
        for (p, s) in self.pieces.iter().zip(piece_sums) {
            if let Some(r) = self.piece_range(manifest, p)
                && r.start >= at
            {
                h.update(gap(at..r.start));
                at = r.end;
            }
            h.update(&s.to_le_bytes());
        }
        h.update(gap(at..self.len.max(at)));
        h.digest()
    }

    /// The bucket's checksum ([`BucketSpec::checksum_from_pieces`] of its own pieces).
    pub fn checksum(&self, manifest: &Manifest, bytes: &[u8]) -> u64 {
        self.checksum_from_pieces(manifest, bytes, &self.piece_checksums(manifest, bytes))
    }

    /// Checks a bucket that arrived whole: `found`, the checksums of its pieces (hashed as
    /// they landed, e.g. by a [`PieceHasher`]), against `expected` (the sender's, when it
    /// sent them; each mismatch names its tensor), then the bucket's checksum derived from
    /// them and `bytes` (which also covers the bytes between tensors; `bytes` may be empty
    /// when the pieces cover the bucket whole) against `header`'s. Returns that checksum.
    ///
    /// # Errors
    /// [`Error::Tensor`] naming the model and tensor whose piece differs from `expected`;
    /// [`Error::Bucket`] naming the bucket (and its tensors) when the counts do not fit its
    /// pieces or the bucket's checksum differs.
    pub fn verify_landed(
        &self,
        model: &ModelId,
        manifest: &Manifest,
        header: &BucketHeader,
        bytes: &[u8],
        expected: Option<&[u64]>,
        found: &[u64],
    ) -> Result<u64> {
        self.verify_with_gaps(model, manifest, header, expected, found, |r| {
            self.gap_in(bytes, r)
        })
    }

    /// [`BucketSpec::verify_landed`] for a bucket whose bytes went on as they landed (a
    /// sink that keeps no copy): `gaps` holds the bytes of its [`BucketSpec::gaps`], one
    /// after the other, in order.
    ///
    /// # Errors
    /// As [`BucketSpec::verify_landed`].
    pub fn verify_landed_gaps(
        &self,
        model: &ModelId,
        manifest: &Manifest,
        header: &BucketHeader,
        gaps: &[u8],
        expected: Option<&[u64]>,
        found: &[u64],
    ) -> Result<u64> {
        let mut used = 0;
        self.verify_with_gaps(model, manifest, header, expected, found, |r| {
            let s = gaps.get(used..used + r.len()).unwrap_or_default();
            used += r.len();
            s
        })
    }

    fn verify_with_gaps<'a>(
        &self,
        model: &ModelId,
        manifest: &Manifest,
        header: &BucketHeader,
        expected: Option<&[u64]>,
        found: &[u64],
        gap: impl FnMut(Range<usize>) -> &'a [u8],
    ) -> Result<u64> {
        let n = self.pieces.len();
        if found.len() != n || expected.is_some_and(|e| e.len() != n) {
            return Err(bucket_error(
                header.index,
                "the checksums do not fit the plan's pieces",
            ));
        }
        for (i, (p, &found)) in self.pieces.iter().zip(found).enumerate() {
            let Some(&expected) = expected.and_then(|e| e.get(i)) else {
                break;
            };
            if found != expected {
                let name = manifest
                    .tensors()
                    .get(p.tensor)
                    .map_or(p.name.as_str(), |t| t.name.as_str());
                return Err(Error::tensor(
                    model,
                    name,
                    Mismatch::Checksum { expected, found },
                ));
            }
        }
        let sum = self.checksum_with_gaps(manifest, found, gap);
        if sum != header.checksum {
            let names: Vec<&str> = self.pieces.iter().map(|p| p.name.as_str()).collect();
            return Err(bucket_error(
                header.index,
                format!(
                    "checksum {:#018x} declared, bytes hash to {sum:#018x} (tensors {})",
                    header.checksum,
                    names.join(", ")
                ),
            ));
        }
        Ok(sum)
    }
}

/// Hashes the pieces of one bucket as its bytes land, in order and in chunks of any size,
/// while they are still in cache: one pass serves both the tensor checks and the bucket
/// checksum ([`BucketSpec::verify_landed`]).
pub struct PieceHasher {
    ranges: Vec<Range<usize>>,
    next: usize,
    hasher: crate::hash::Xxh3,
    sums: Vec<u64>,
}

impl std::fmt::Debug for PieceHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PieceHasher")
            .field("pieces", &self.ranges.len())
            .field("done", &self.sums.len())
            .finish()
    }
}

impl PieceHasher {
    /// A hasher for the pieces of `spec` (bucket `index` of its plan), placed by `manifest`.
    ///
    /// # Errors
    /// [`Error::Bucket`] naming the bucket when a piece lies outside it, or pieces overlap or
    /// are out of arena order.
    pub fn new(spec: &BucketSpec, manifest: &Manifest, index: usize) -> Result<Self> {
        let ranges = spec
            .pieces
            .iter()
            .map(|p| {
                spec.piece_range(manifest, p).ok_or_else(|| {
                    bucket_error(
                        index,
                        format!("piece of tensor `{}` lies outside the bucket", p.name),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if ranges.windows(2).any(|w| w[0].end > w[1].start) {
            return Err(bucket_error(
                index,
                "pieces overlap or are out of arena order",
            ));
        }
        Ok(Self {
            sums: Vec::with_capacity(ranges.len()),
            ranges,
            next: 0,
            hasher: crate::hash::Xxh3::new(),
        })
    }

    /// Feeds `chunk`, the bucket's bytes from offset `at` (they follow every byte fed before).
    pub fn feed(&mut self, chunk: &[u8], at: usize) {
        let end = at + chunk.len();
        while let Some(r) = self.ranges.get(self.next) {
            let (s, e) = (r.start.max(at), r.end.min(end));
            if s < e {
                self.hasher
                    .update(chunk.get(s - at..e - at).unwrap_or_default());
            }
            if r.end > end {
                break;
            }
            self.sums.push(self.hasher.digest());
            self.hasher.reset();
            self.next += 1;
        }
    }

    /// The checksums of the pieces completed so far (all of them once the whole bucket was
    /// fed), in piece order.
    pub fn sums(&self) -> &[u64] {
        &self.sums
    }
}

/// The sender's authoritative cut of one model's arena into buckets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketPlan {
    /// The model.
    pub model: ModelId,
    /// Schema hash of the manifest the plan was cut from.
    pub schema_hash: u64,
    /// The configured bucket size in bytes (a multiple of [`ALIGN`]); no bucket is larger.
    pub bucket_size: usize,
    /// Arena size in bytes.
    pub total_len: usize,
    /// The buckets, in arena order.
    pub buckets: Vec<BucketSpec>,
}

/// The control message sent with each bucket's bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketHeader {
    /// Position of the bucket in the plan.
    pub index: usize,
    /// The version the bytes belong to.
    pub version: Version,
    /// First arena byte.
    pub start: usize,
    /// Bytes in the bucket.
    pub len: usize,
    /// The tensors or chunks it covers.
    pub pieces: Vec<Piece>,
    /// xxh3-64 of the bucket's bytes.
    pub checksum: u64,
    /// When the bytes travel as an element-level delta against a base version the
    /// receiver holds ([`crate::delta::elements`]): the encoding's length, which is what
    /// follows the header instead of `len` raw bytes. `None`: the raw bytes follow.
    #[serde(default)]
    pub encoded: Option<usize>,
    /// xxh3-64 of each of the bucket's pieces, in order, where the sender declares them here
    /// rather than in the transfer's terms (it hashed the bucket as it served it, not the
    /// whole version before announcing it). Empty: declared elsewhere, or not at all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub piece_sums: Vec<u64>,
}

fn bucket_error(index: usize, reason: impl Into<String>) -> Error {
    Error::Bucket {
        index,
        reason: reason.into(),
    }
}

impl BucketPlan {
    /// Cuts `sender`'s arena into buckets of at most `bucket_size` bytes, after checking that
    /// `receiver` describes the same tensors.
    ///
    /// # Errors
    /// The schema error of [`Manifest::check_same_schema`] when the manifests differ;
    /// [`Error::Bucket`] (index 0) when `bucket_size` is zero or not a multiple of [`ALIGN`].
    pub fn compute(
        model: &ModelId,
        sender: &Manifest,
        receiver: &Manifest,
        bucket_size: usize,
    ) -> Result<Self> {
        receiver.check_same_schema(model, sender)?;
        if bucket_size == 0 || !bucket_size.is_multiple_of(ALIGN) {
            return Err(bucket_error(
                0,
                format!("bucket size {bucket_size} is not a positive multiple of {ALIGN}"),
            ));
        }
        let mut order: Vec<usize> = (0..sender.len()).collect();
        order.sort_by_key(|&i| sender.tensors()[i].offset);
        let specs = sender.tensors();
        let total = sender.total_len();
        let mut cuts = vec![0];
        let mut start = 0;
        while total - start > bucket_size {
            let end = start + bucket_size;
            // A tensor straddling `end` that begins after `start` moves whole to the next bucket.
            let straddler = order
                .iter()
                .map(|&i| &specs[i])
                .find(|t| t.len > 0 && t.offset < end && t.offset + t.len > end);
            let cut = match straddler {
                Some(t) if t.offset > start => t.offset,
                _ => end,
            };
            cuts.push(cut);
            start = cut;
        }
        cuts.push(total);
        cuts.dedup();
        let buckets = cuts
            .windows(2)
            .map(|w| BucketSpec {
                start: w[0],
                len: w[1] - w[0],
                pieces: pieces_in(sender, &order, w[0]..w[1]),
            })
            .collect();
        Ok(Self {
            model: model.clone(),
            schema_hash: sender.schema_hash(),
            bucket_size,
            total_len: total,
            buckets,
        })
    }

    /// Number of buckets.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    /// True when the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Checks a plan received from the sender against this end's manifest: same schema,
    /// buckets that cover the arena contiguously within the bucket size, and pieces that are
    /// exactly the tensors' bytes in each bucket.
    ///
    /// # Errors
    /// [`Error::Schema`] when the schema hash differs; [`Error::Bucket`] naming the bucket
    /// (and the tensor where there is one) for any other disagreement.
    pub fn verify(&self, manifest: &Manifest) -> Result<()> {
        if self.schema_hash != manifest.schema_hash() {
            return Err(Error::Schema {
                model: self.model.clone(),
                expected: manifest.schema_hash(),
                found: self.schema_hash,
            });
        }
        if self.total_len != manifest.total_len() {
            return Err(bucket_error(
                0,
                format!(
                    "plan covers {} bytes, the arena has {}",
                    self.total_len,
                    manifest.total_len()
                ),
            ));
        }
        let mut order: Vec<usize> = (0..manifest.len()).collect();
        order.sort_by_key(|&i| manifest.tensors()[i].offset);
        let mut at = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            if b.start != at || b.len == 0 || b.len > self.bucket_size {
                return Err(bucket_error(
                    i,
                    format!(
                        "covers bytes {}..{}, expected to start at {at} with 1..={} bytes",
                        b.start,
                        b.start + b.len,
                        self.bucket_size
                    ),
                ));
            }
            let expected = pieces_in(manifest, &order, b.range());
            if b.pieces != expected {
                let culprit = b
                    .pieces
                    .iter()
                    .zip(&expected)
                    .find(|(a, e)| a != e)
                    .map_or_else(
                        || format!("lists {} pieces, the manifest gives {}", b.pieces.len(), expected.len()),
                        |(a, e)| {
                            format!(
                                "piece of tensor `{}` (bytes {}..+{}) disagrees with the manifest's `{}` (bytes {}..+{})",
                                a.name, a.offset, a.len, e.name, e.offset, e.len
                            )
                        },
                    );
                return Err(bucket_error(i, culprit));
            }
            at = b.start + b.len;
        }
        if at != self.total_len {
            return Err(bucket_error(
                self.buckets.len(),
                format!("buckets end at byte {at}, the arena at {}", self.total_len),
            ));
        }
        Ok(())
    }

    /// A fingerprint of the plan (xxh3-64 of its wire encoding): two ends whose plans have the
    /// same fingerprint cut the arena the same way, so a transport ships the plan once and
    /// names it by fingerprint afterwards.
    ///
    /// # Errors
    /// [`Error::Wire`] when the plan cannot be encoded.
    pub fn fingerprint(&self) -> Result<u64> {
        Ok(crate::hash::xxh3_64(&crate::wire::encode(self)?))
    }

    /// The buckets holding at least one byte of any of `tensors` (manifest positions), in
    /// ascending order: what a delta transfer of those tensors moves.
    pub fn touching(&self, tensors: &[usize]) -> Vec<usize> {
        let mut wanted = tensors.to_vec();
        wanted.sort_unstable();
        self.buckets
            .iter()
            .enumerate()
            .filter(|(_, b)| {
                b.pieces
                    .iter()
                    .any(|p| wanted.binary_search(&p.tensor).is_ok())
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// Checks a received bucket header against the plan: its index is in range and its byte
    /// range and pieces are the plan's. Returns the plan's spec of that bucket.
    ///
    /// # Errors
    /// [`Error::Bucket`] naming the bucket when its index is out of range or its range or
    /// pieces differ from the plan.
    pub fn check_header(&self, header: &BucketHeader) -> Result<&BucketSpec> {
        let i = header.index;
        let spec = self.buckets.get(i).ok_or_else(|| {
            bucket_error(
                i,
                format!("out of range, the plan has {} buckets", self.len()),
            )
        })?;
        if header.start != spec.start || header.len != spec.len || header.pieces != spec.pieces {
            return Err(bucket_error(
                i,
                format!(
                    "header covers bytes {}..+{}, the plan says {}..+{}",
                    header.start, header.len, spec.start, spec.len
                ),
            ));
        }
        Ok(spec)
    }

    /// Checks that `bytes`, the payload of `header`, have the header's checksum
    /// ([`BucketSpec::checksum`]; `manifest` places the pieces).
    ///
    /// # Errors
    /// [`Error::Bucket`] naming the bucket and its tensors when the checksum differs or the
    /// header is not one of the plan's buckets.
    pub fn check_checksum(
        &self,
        manifest: &Manifest,
        header: &BucketHeader,
        bytes: &[u8],
    ) -> Result<()> {
        let spec = self.check_header(header)?;
        let pieces = spec.piece_checksums(manifest, bytes);
        spec.verify_landed(&self.model, manifest, header, bytes, None, &pieces)
            .map(|_| ())
    }

    /// The header and bytes of bucket `index` of `weights`.
    ///
    /// # Errors
    /// [`Error::Schema`] when `weights` has another manifest; [`Error::Bucket`] when `index` is
    /// out of range.
    pub fn bucket<'a>(
        &self,
        weights: &'a WeightSet,
        index: usize,
    ) -> Result<(BucketHeader, &'a [u8])> {
        if weights.manifest().schema_hash() != self.schema_hash {
            return Err(Error::Schema {
                model: self.model.clone(),
                expected: self.schema_hash,
                found: weights.manifest().schema_hash(),
            });
        }
        let b = self.buckets.get(index).ok_or_else(|| {
            bucket_error(index, format!("out of range, the plan has {}", self.len()))
        })?;
        let bytes = &weights.bytes()[b.range()];
        Ok((
            BucketHeader {
                index,
                version: weights.version(),
                start: b.start,
                len: b.len,
                pieces: b.pieces.clone(),
                checksum: b.checksum(weights.manifest(), bytes),
                encoded: None,
                piece_sums: Vec::new(),
            },
            bytes,
        ))
    }

    /// Every bucket of `weights`, in order.
    ///
    /// # Errors
    /// As [`BucketPlan::bucket`].
    pub fn buckets<'a>(&self, weights: &'a WeightSet) -> Result<Vec<(BucketHeader, &'a [u8])>> {
        (0..self.len()).map(|i| self.bucket(weights, i)).collect()
    }
}

/// The non-empty intersections of tensors with `range`, in arena order.
fn pieces_in(m: &Manifest, order: &[usize], range: Range<usize>) -> Vec<Piece> {
    order
        .iter()
        .filter_map(|&i| {
            let t = &m.tensors()[i];
            let (s, e) = (t.offset.max(range.start), (t.offset + t.len).min(range.end));
            (s < e).then(|| Piece {
                tensor: i,
                name: t.name.clone(),
                offset: s - t.offset,
                len: e - s,
            })
        })
        .collect()
}

/// Receive side: accepts the buckets of one version in any order and hands out the weight
/// set only once every bucket arrived and checked out.
///
/// A bucket is checked (plan, version, range, pieces, checksum, not seen before) before any
/// of its bytes are copied; a refused bucket changes nothing, so a retransmission can still
/// complete the version. The arena being filled is never readable from outside.
#[derive(Debug)]
pub struct BucketAssembler {
    plan: BucketPlan,
    manifest: Arc<Manifest>,
    arena: Option<WeightSet>,
    version: Option<Version>,
    seen: Vec<bool>,
    received: usize,
}

impl BucketAssembler {
    /// An assembler for `plan`, after [`BucketPlan::verify`] against `manifest`.
    ///
    /// # Errors
    /// As [`BucketPlan::verify`].
    pub fn new(plan: BucketPlan, manifest: Arc<Manifest>) -> Result<Self> {
        plan.verify(&manifest)?;
        let n = plan.len();
        Ok(Self {
            plan,
            manifest,
            arena: None,
            version: None,
            seen: vec![false; n],
            received: 0,
        })
    }

    /// The version being assembled (fixed by its first accepted bucket).
    pub fn version(&self) -> Option<Version> {
        self.version
    }

    /// `(received, total)` buckets of the version being assembled.
    pub fn progress(&self) -> (usize, usize) {
        (self.received, self.plan.len())
    }

    /// True when every bucket of the current version arrived.
    pub fn is_complete(&self) -> bool {
        self.received == self.plan.len()
    }

    /// Checks one bucket and copies its bytes in.
    ///
    /// # Errors
    /// [`Error::Bucket`] naming the bucket when its index is out of range, it was already
    /// received, it belongs to another version than the buckets before it, its range or
    /// pieces differ from the plan, its length differs from its bytes, or its checksum does not
    /// match; nothing is copied then.
    pub fn accept(&mut self, header: &BucketHeader, bytes: &[u8]) -> Result<()> {
        let i = header.index;
        if i >= self.plan.len() {
            return Err(bucket_error(
                i,
                format!("out of range, the plan has {} buckets", self.plan.len()),
            ));
        }
        if let Some(v) = self.version
            && v != header.version
        {
            return Err(bucket_error(
                i,
                format!(
                    "belongs to version {}, version {v} is being assembled",
                    header.version
                ),
            ));
        }
        if self.seen[i] {
            return Err(bucket_error(
                i,
                format!("received twice for version {}", header.version),
            ));
        }
        let range = self.plan.check_header(header)?.range();
        if bytes.len() != range.len() {
            return Err(bucket_error(
                i,
                format!("{} bytes declared, {} arrived", range.len(), bytes.len()),
            ));
        }
        self.plan.check_checksum(&self.manifest, header, bytes)?;
        let arena = self.arena.get_or_insert_with(|| {
            WeightSet::zeroed(self.plan.model.clone(), Arc::clone(&self.manifest))
        });
        arena.bytes_mut()?[range].copy_from_slice(bytes);
        self.version = Some(header.version);
        self.seen[i] = true;
        self.received += 1;
        Ok(())
    }

    /// The complete weight set, stamped with its version; the assembler is then ready for
    /// the next version.
    ///
    /// # Errors
    /// [`Error::Bucket`] naming the first missing bucket when the version is not complete
    /// (the buckets received so far are kept).
    pub fn take(&mut self) -> Result<WeightSet> {
        if let Some(missing) = self.seen.iter().position(|s| !s) {
            return Err(bucket_error(
                missing,
                format!(
                    "not received; {} of {} buckets arrived for version {}",
                    self.received,
                    self.plan.len(),
                    self.version.map_or_else(|| "-".into(), |v| v.to_string())
                ),
            ));
        }
        let mut ws = self.arena.take().unwrap_or_else(|| {
            WeightSet::zeroed(self.plan.model.clone(), Arc::clone(&self.manifest))
        });
        ws.set_version(self.version.unwrap_or(Version::ZERO));
        self.reset();
        Ok(ws)
    }

    /// Drops the version being assembled (its buckets are discarded).
    pub fn reset(&mut self) {
        self.arena = None;
        self.version = None;
        self.seen.fill(false);
        self.received = 0;
    }
}

#[cfg(test)]
mod tests;
