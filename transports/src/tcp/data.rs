//! The data plane: buckets of the sender's [`BucketPlan`], served by a stream handler and
//! pulled over several parallel streams straight into the receiver's arena.
//!
//! Each stream carries whole buckets; each bucket travels as exactly one framed
//! [`BucketHeader`] (its control message: index, version, range, pieces, xxh3) followed by its
//! raw bytes. The receiving thread checks the header against the plan before reading a byte,
//! hashes each piece as its bytes land (while they are in cache), then verifies the pieces
//! and the bucket's checksum (derived from the piece checksums and the gap bytes) as soon as
//! the bucket is in, in parallel with the other streams. The sender hashes each bucket once,
//! when it is first served (the next bucket of a stream meanwhile, on a blocking thread), not
//! the whole version before announcing it: the hashing overlaps the transfer, and the header
//! declares the pieces' checksums ([`Hashes`]). A relay serves a version it is still pulling
//! as its bytes arrive, a socket read at a time (see [`InFlight`]).

use std::io::Read;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use refit_node::{OpenStream, StreamHead, frame, write_head};
use refit_runtime::bucket::{BucketSpec, PieceHasher};
use refit_runtime::{
    BucketHeader, BucketPlan, Error, Manifest, ModelId, Result, Version, WeightSet, wire,
};
use tokio::io::AsyncWriteExt;

use super::NAME;
use super::encoded::{Encodings, max_encoded};
use super::inflight::{BucketWriter, Declared, InFlight};
use super::messages::PullReq;

/// Bytes written per socket write on the serving side (the unit of injected corruption).
pub(crate) const CHUNK: usize = crate::FORWARD_PIECE;
/// Bytes read per socket read on the pulling side: small enough that the four streams' fresh
/// bytes stay in the two cores' L2 caches while they are hashed.
const READ: usize = 256 << 10;
/// Most buckets one pull request may ask for.
const MAX_BUCKETS: usize = 1 << 20;

/// Counters and test hooks of one serving end.
#[derive(Debug, Default)]
pub(crate) struct ServeStats {
    pub(crate) bytes: AtomicU64,
    pub(crate) corrupt_chunks: AtomicU32,
}

/// What a source serves pulls from: one version and the plan that cuts it.
#[derive(Debug, Clone)]
pub(crate) struct Source {
    pub(crate) weights: Arc<WeightSet>,
    pub(crate) plan: Arc<BucketPlan>,
    pub(crate) plan_id: u64,
    /// The version's checksums, cut by `plan`, hashed a bucket at a time as pulls first ask
    /// for it (known whole already on a relay, which verified them as the bytes landed).
    pub(crate) sums: Arc<Hashes>,
    /// The buckets' encodings against the base version the pull names, when it names one
    /// ([`TransferMode::Elements`](super::TransferMode::Elements)).
    pub(crate) encoded: Option<Arc<Encodings>>,
}

/// What a pull is served from: a whole version, or one still landing on a relay (served
/// as its bytes arrive).
#[derive(Debug, Clone)]
pub(crate) enum Serve {
    /// A version held whole.
    Whole(Source),
    /// A version this relay is pulling itself.
    Landing(Arc<InFlight>),
}

/// The checksums of one version cut by one bucket plan, whole: on the sender, once every
/// bucket is hashed ([`Hashes::whole`]); on a receiver, those it verified as the bytes
/// landed (what it relays the version with).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sums {
    /// Fingerprint of the plan that cut them.
    pub(crate) plan_id: u64,
    /// xxh3-64 of every piece of the plan (a tensor held whole by a bucket, or a chunk of a
    /// cut one), bucket after bucket in plan order.
    pub(crate) pieces: Vec<u64>,
    /// The checksum of every bucket ([`BucketSpec::checksum_from_pieces`]).
    pub(crate) buckets: Vec<u64>,
}

impl Sums {
    /// Hashes every piece of `ws` by `plan` (one pass over the bytes), bucket by bucket on
    /// rayon's global pool when `threads > 1`, then derives the bucket checksums (what
    /// [`Hashes`] make a bucket at a time, at once: the tests' reference).
    #[cfg(test)]
    pub(crate) fn compute(plan: &BucketPlan, plan_id: u64, ws: &WeightSet, threads: usize) -> Self {
        use rayon::prelude::*;
        let hash = |b: &BucketSpec| Hashed::of(b, ws);
        let done: Vec<Hashed> = if threads > 1 && plan.buckets.len() > 1 {
            plan.buckets.par_iter().map(hash).collect()
        } else {
            plan.buckets.iter().map(hash).collect()
        };
        Self::of_buckets(plan_id, done.iter())
    }

    /// The sums of a version from every bucket's, in plan order.
    fn of_buckets<'a>(plan_id: u64, buckets: impl ExactSizeIterator<Item = &'a Hashed>) -> Self {
        let mut sums = Self {
            plan_id,
            pieces: Vec::new(),
            buckets: Vec::with_capacity(buckets.len()),
        };
        for b in buckets {
            sums.pieces.extend_from_slice(&b.pieces);
            sums.buckets.push(b.checksum);
        }
        sums
    }

    /// The sums of a version that arrived whole: `pieces` were verified as the bytes landed,
    /// the bucket checksums are derived from them and the arena's gap bytes.
    pub(crate) fn of_arena(
        plan: &BucketPlan,
        plan_id: u64,
        manifest: &Manifest,
        arena: &[u8],
        pieces: Vec<u64>,
    ) -> Self {
        let starts = piece_starts(plan);
        let buckets = plan
            .buckets
            .iter()
            .zip(starts.windows(2))
            .map(|(b, w)| {
                let data = arena.get(b.range()).unwrap_or_default();
                b.checksum_from_pieces(manifest, data, pieces.get(w[0]..w[1]).unwrap_or_default())
            })
            .collect();
        Self {
            plan_id,
            pieces,
            buckets,
        }
    }
}

/// One bucket's checksums: each of its pieces', and its own (derived from those and the bytes
/// between its tensors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hashed {
    pub(crate) pieces: Vec<u64>,
    pub(crate) checksum: u64,
}

impl Hashed {
    /// Hashes bucket `b` of `ws` (one pass over its bytes).
    fn of(b: &BucketSpec, ws: &WeightSet) -> Self {
        let manifest = ws.manifest();
        let data = ws.bytes().get(b.range()).unwrap_or_default();
        let pieces = b.piece_checksums(manifest, data);
        let checksum = b.checksum_from_pieces(manifest, data, &pieces);
        Self { pieces, checksum }
    }
}

/// The checksums of one version cut by one plan, hashed a bucket at a time when first asked
/// for: serving a bucket hashes it just before its header goes out, so a version is announced
/// without a pass over its bytes and its hashing overlaps the transfer. Each bucket is hashed
/// once, by whoever asks first (others asking meanwhile wait for that hash); the whole
/// [`Sums`] exist once every bucket is hashed ([`Hashes::complete`] hashes the rest).
#[derive(Debug)]
pub(crate) struct Hashes {
    plan: Arc<BucketPlan>,
    plan_id: u64,
    buckets: Vec<OnceLock<Hashed>>,
    whole: OnceLock<Arc<Sums>>,
}

impl Hashes {
    /// Nothing hashed yet.
    pub(crate) fn new(plan: Arc<BucketPlan>, plan_id: u64) -> Self {
        let buckets = plan.buckets.iter().map(|_| OnceLock::new()).collect();
        Self {
            plan,
            plan_id,
            buckets,
            whole: OnceLock::new(),
        }
    }

    /// Every bucket known already: `sums` (cut by `plan`), e.g. verified as the bytes landed.
    pub(crate) fn known(plan: Arc<BucketPlan>, sums: Sums) -> Self {
        let starts = piece_starts(&plan);
        let buckets = starts
            .windows(2)
            .zip(&sums.buckets)
            .map(|(w, &checksum)| {
                OnceLock::from(Hashed {
                    pieces: sums.pieces.get(w[0]..w[1]).unwrap_or_default().to_vec(),
                    checksum,
                })
            })
            .collect();
        Self {
            plan_id: sums.plan_id,
            plan,
            buckets,
            whole: OnceLock::from(Arc::new(sums)),
        }
    }

    /// Fingerprint of the plan that cuts them.
    pub(crate) fn plan_id(&self) -> u64 {
        self.plan_id
    }

    /// Buckets of the plan.
    pub(crate) fn len(&self) -> usize {
        self.buckets.len()
    }

    /// Bucket `i`'s checksums, when hashed already.
    pub(crate) fn hashed(&self, i: usize) -> Option<&Hashed> {
        self.buckets.get(i)?.get()
    }

    /// Bucket `i`'s checksums, hashed from `ws` now unless done before (waiting while another
    /// thread hashes it); `None` for a bucket not in the plan.
    pub(crate) fn bucket(&self, i: usize, ws: &WeightSet) -> Option<&Hashed> {
        let spec = self.plan.buckets.get(i)?;
        Some(self.buckets.get(i)?.get_or_init(|| Hashed::of(spec, ws)))
    }

    /// Hashes every bucket not hashed yet (in parallel on rayon's pool when `threads > 1`);
    /// the version's whole sums ([`Hashes::whole`]).
    pub(crate) fn complete(&self, ws: &WeightSet, threads: usize) -> Option<Arc<Sums>> {
        use rayon::prelude::*;
        let todo: Vec<usize> = (0..self.len())
            .filter(|&i| self.hashed(i).is_none())
            .collect();
        if threads > 1 && todo.len() > 1 {
            todo.par_iter().for_each(|&i| {
                let _ = self.bucket(i, ws);
            });
        } else {
            for i in todo {
                let _ = self.bucket(i, ws);
            }
        }
        self.whole()
    }

    /// The version's whole sums, once every bucket is hashed (`None` before).
    pub(crate) fn whole(&self) -> Option<Arc<Sums>> {
        if let Some(s) = self.whole.get() {
            return Some(Arc::clone(s));
        }
        let hashed: Option<Vec<&Hashed>> = self.buckets.iter().map(OnceLock::get).collect();
        let sums = Arc::new(Sums::of_buckets(self.plan_id, hashed?.into_iter()));
        Some(Arc::clone(self.whole.get_or_init(|| sums)))
    }
}

/// Where the pieces of each bucket start in the flattened piece list (one entry per bucket,
/// plus the total).
pub(crate) fn piece_starts(plan: &BucketPlan) -> Vec<usize> {
    let mut at = 0;
    let mut starts = Vec::with_capacity(plan.len() + 1);
    starts.push(0);
    for b in &plan.buckets {
        at += b.pieces.len();
        starts.push(at);
    }
    starts
}

/// Checks a pull against the source's plan; the payload bytes it asks for.
fn check_buckets(req: &PullReq, src: &Serve) -> std::result::Result<u64, String> {
    let (plan, plan_id) = match src {
        Serve::Whole(src) => {
            if src.sums.plan_id() != src.plan_id || src.sums.len() != src.plan.len() {
                return Err(format!(
                    "the checksums of `{}` version {} were cut by another bucket plan",
                    req.model, req.version
                ));
            }
            (&src.plan, src.plan_id)
        }
        Serve::Landing(f) => (&f.plan, f.plan_id),
    };
    if req.plan != plan_id {
        return Err(format!(
            "the pull names bucket plan {:#018x}, this source cuts `{}` by plan {plan_id:#018x}",
            req.plan, req.model
        ));
    }
    if req.buckets.len() > MAX_BUCKETS {
        return Err(format!(
            "{} buckets asked (at most {MAX_BUCKETS})",
            req.buckets.len()
        ));
    }
    let mut total = 0u64;
    let mut next = 0usize;
    for &i in &req.buckets {
        let i = i as usize;
        match plan.buckets.get(i) {
            Some(b) if i >= next => {
                total += b.len as u64;
                next = i + 1;
            }
            _ => {
                return Err(format!(
                    "bucket {i} is out of order or past the plan's {}",
                    plan.len()
                ));
            }
        }
    }
    Ok(total)
}

/// Serves one pull: a head, then each requested bucket as its header frame and its bytes (or
/// an error head when the pull does not fit the source). A version still landing is served
/// as its bytes arrive; a bucket whose bytes stop coming ends the stream, and the
/// puller asks for another source.
pub(crate) async fn serve_pull(
    mut stream: tokio::net::TcpStream,
    src: std::result::Result<Serve, String>,
    req: PullReq,
    stats: &ServeStats,
) -> Result<()> {
    let checked = src.and_then(|s| check_buckets(&req, &s).map(|t| (s, t)));
    let (src, total) = match checked {
        Ok(v) => v,
        Err(reason) => return Ok(write_head(&mut stream, &StreamHead::Err { reason }).await?),
    };
    write_head(&mut stream, &StreamHead::Ok { len: total }).await?;
    for (k, &i) in req.buckets.iter().enumerate() {
        let index = i as usize;
        match &src {
            Serve::Whole(s) => {
                let all = s.weights.bytes();
                let Some(b) = s.plan.buckets.get(index) else {
                    return Err(Error::Bucket {
                        index,
                        reason: "not in the plan".into(),
                    });
                };
                let bytes = all.get(b.range()).ok_or_else(|| Error::Bucket {
                    index,
                    reason: format!("runs past the arena's {} bytes", all.len()),
                })?;
                let hashed = bucket_sums(s, index).await?;
                // the next bucket of this pull is hashed while this one's bytes go out
                if let Some(&next) = req.buckets.get(k + 1) {
                    prefetch_sums(s, next as usize);
                }
                let encoded = match &s.encoded {
                    Some(e) => encode_bucket(e, index, b, &s.weights).await?,
                    None => None,
                };
                let mut header = header_of(index, b, s.weights.version(), hashed.checksum);
                header.piece_sums = hashed.pieces;
                header.encoded = encoded.as_ref().map(|e| e.len());
                frame::send(&mut stream, &header).await?;
                write_bytes(&mut stream, encoded.as_deref().unwrap_or(bytes), stats).await?;
            }
            Serve::Landing(f) => {
                // passed on as the bytes arrive, before the bucket is complete or verified:
                // the header declares the checksum the relay's own source declared, and
                // every receiver verifies the bytes against the sender's checksums itself
                let b = f.plan.buckets.get(index).ok_or_else(|| Error::Bucket {
                    index,
                    reason: "not in the plan".into(),
                })?;
                let gone = |reason| Error::Bucket { index, reason };
                let declared = f.started(index).await.map_err(gone)?;
                let mut header = header_of(index, b, f.version(), declared.checksum);
                header.piece_sums = declared.pieces;
                frame::send(&mut stream, &header).await?;
                let mut sent = 0;
                while sent < b.len {
                    let bytes = f.arrived(index, sent).await.map_err(gone)?;
                    write_bytes(&mut stream, bytes, stats).await?;
                    sent += bytes.len();
                }
            }
        }
    }
    stream
        .flush()
        .await
        .map_err(|e| Error::io("serving a pull", e))
}

/// Bucket `index`'s checksums from `s`: known already, else hashed now on a blocking thread
/// (or waited for, when another pull or a prefetch is hashing it).
async fn bucket_sums(s: &Source, index: usize) -> Result<Hashed> {
    if let Some(h) = s.sums.hashed(index) {
        return Ok(h.clone());
    }
    let (sums, ws) = (Arc::clone(&s.sums), Arc::clone(&s.weights));
    tokio::task::spawn_blocking(move || sums.bucket(index, &ws).cloned())
        .await
        .map_err(|e| Error::transport(NAME, format!("hashing bucket {index} failed: {e}")))?
        .ok_or_else(|| Error::Bucket {
            index,
            reason: "not in the plan".into(),
        })
}

/// Starts hashing bucket `index` of `s` on a blocking thread unless it is hashed already.
fn prefetch_sums(s: &Source, index: usize) {
    if s.sums.hashed(index).is_none() {
        let (sums, ws) = (Arc::clone(&s.sums), Arc::clone(&s.weights));
        drop(tokio::task::spawn_blocking(move || {
            let _ = sums.bucket(index, &ws);
        }));
    }
}

/// Bucket `index` (`spec`) of `ws` encoded by `enc` (made on a blocking thread unless an
/// earlier pull made it): `None` where the raw bytes are sent.
async fn encode_bucket(
    enc: &Arc<Encodings>,
    index: usize,
    spec: &BucketSpec,
    ws: &Arc<WeightSet>,
) -> Result<Option<Arc<[u8]>>> {
    let (enc, spec, ws) = (Arc::clone(enc), spec.clone(), Arc::clone(ws));
    tokio::task::spawn_blocking(move || enc.bucket(index, &spec, &ws))
        .await
        .map_err(|e| Error::transport(NAME, format!("encoding bucket {index} failed: {e}")))?
}

/// The header of bucket `index` (`spec`) of `version`, declaring `checksum`.
fn header_of(index: usize, spec: &BucketSpec, version: Version, checksum: u64) -> BucketHeader {
    BucketHeader {
        index,
        version,
        start: spec.start,
        len: spec.len,
        pieces: spec.pieces.clone(),
        checksum,
        encoded: None,
        piece_sums: Vec::new(),
    }
}

/// Writes `bytes` to a pull's stream, [`CHUNK`] bytes per write (each counted, and damaged
/// when the corruption hook asks for it).
async fn write_bytes(
    stream: &mut tokio::net::TcpStream,
    bytes: &[u8],
    stats: &ServeStats,
) -> Result<()> {
    let io = |e| Error::io("serving a pull", e);
    for chunk in bytes.chunks(CHUNK) {
        let corrupt = stats
            .corrupt_chunks
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if corrupt {
            let mut bad = chunk.to_vec();
            let mid = bad.len() / 2;
            bad[mid] ^= 0x5a;
            stream.write_all(&bad).await.map_err(io)?;
        } else {
            stream.write_all(chunk).await.map_err(io)?;
        }
        stats.bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// Spreads `buckets` (ascending) over at most `streams` streams: each bucket goes whole to
/// the stream with the fewest bytes so far, so streams end about together; each stream's
/// list stays ascending.
pub(crate) fn assign(plan: &BucketPlan, buckets: &[u32], streams: usize) -> Vec<Vec<u32>> {
    let n = streams.max(1).min(buckets.len());
    let mut parts: Vec<(u64, Vec<u32>)> = vec![(0, Vec::new()); n];
    for &i in buckets {
        let len = plan.buckets.get(i as usize).map_or(0, |b| b.len as u64);
        if let Some(p) = parts.iter_mut().min_by_key(|p| p.0) {
            p.0 += len;
            p.1.push(i);
        }
    }
    parts.into_iter().map(|p| p.1).collect()
}

/// What every pulled bucket is checked against.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expect<'a> {
    pub(crate) model: &'a ModelId,
    pub(crate) version: Version,
    pub(crate) manifest: &'a Manifest,
    pub(crate) plan: &'a BucketPlan,
    /// xxh3-64 of every piece of the plan, in plan order ([`Sums::pieces`]), as the
    /// transfer's terms declared them; empty: each bucket's header declares its own.
    pub(crate) sums: &'a [u64],
    /// Where each bucket's pieces start in the plan's pieces ([`piece_starts`]).
    pub(crate) starts: &'a [usize],
    /// Where the checksums of each verified bucket's pieces are kept.
    pub(crate) verified: &'a Verified,
}

/// The checksums of the pieces a pull verified, in plan order: once every bucket is in, the
/// version's own (what a receiver relaying it serves with).
#[derive(Debug)]
pub(crate) struct Verified(Mutex<Vec<u64>>);

impl Verified {
    /// Room for `pieces` checksums.
    pub(crate) fn new(pieces: usize) -> Self {
        Self(Mutex::new(vec![0; pieces]))
    }

    fn record(&self, at: usize, sums: &[u64]) {
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(dst) = all.get_mut(at..at + sums.len()) {
            dst.copy_from_slice(sums);
        }
    }

    /// What was recorded (zeros for pieces of buckets not verified).
    pub(crate) fn take(&self) -> Vec<u64> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Expect<'_> {
    /// Checks a bucket that arrived whole in `dst`, with `found` the checksums of its pieces
    /// hashed as they landed, by the runtime's check ([`BucketSpec::verify_landed`]): every
    /// piece against the sender's checksum (naming the tensor), then the bucket's own
    /// checksum (which also covers the bytes between tensors).
    fn check_bucket(
        &self,
        spec: &BucketSpec,
        header: &BucketHeader,
        dst: &[u8],
        found: &[u64],
    ) -> Result<u64> {
        let expected = self.expected(header)?;
        let sum = spec.verify_landed(
            self.model,
            self.manifest,
            header,
            dst,
            Some(expected),
            found,
        )?;
        self.record(header.index, found);
        Ok(sum)
    }

    /// [`Expect::check_bucket`] for a bucket whose bytes went on as they landed: `gaps`
    /// holds its bytes between tensors ([`BucketSpec::gaps`]), one after the other.
    fn check_bucket_gaps(
        &self,
        spec: &BucketSpec,
        header: &BucketHeader,
        gaps: &[u8],
        found: &[u64],
    ) -> Result<u64> {
        let expected = self.expected(header)?;
        let sum = spec.verify_landed_gaps(
            self.model,
            self.manifest,
            header,
            gaps,
            Some(expected),
            found,
        )?;
        self.record(header.index, found);
        Ok(sum)
    }

    fn record(&self, index: usize, found: &[u64]) {
        if let Some(&at) = self.starts.get(index) {
            self.verified.record(at, found);
        }
    }

    /// The sender's checksums of the pieces of the bucket `header` announces: from the
    /// transfer's terms, else as the header declares them (their count is checked with the
    /// bucket).
    fn expected<'s>(&'s self, header: &'s BucketHeader) -> Result<&'s [u64]> {
        if self.sums.is_empty() {
            return Ok(&header.piece_sums);
        }
        let index = header.index;
        self.starts
            .get(index..index + 2)
            .and_then(|w| self.sums.get(w[0]..w[1]))
            .ok_or_else(|| Error::Bucket {
                index,
                reason: "the checksums do not fit the plan's pieces".into(),
            })
    }
}

/// Counters a pull updates as buckets arrive.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counters<'a> {
    /// Weight bytes landed (a bucket sent encoded counts its whole length).
    pub(crate) bytes: &'a AtomicU64,
    /// Bytes of weights read off the sockets (an encoded bucket counts its encoding).
    pub(crate) wire: &'a AtomicU64,
    /// Bucket control messages (headers) received.
    pub(crate) headers: &'a AtomicU64,
}

/// Opens one stream for one part (its bucket indices).
pub(crate) type Opener<'a> = dyn Fn(&[u32]) -> Result<OpenStream> + Sync + 'a;

/// Where pulled bytes go.
#[derive(Clone, Copy)]
pub(crate) enum Dest<'a> {
    /// Into the arena of a version in flight, bucket by bucket (relayable as they arrive).
    Arena(&'a InFlight),
    /// Into a sink (e.g. the file the weights are bound for): into memory it lends
    /// ([`Sink::claim`]; every bucket must then be covered by its pieces), else through a
    /// small buffer (the bytes between tensors kept aside for the bucket's checksum).
    Sink(&'a dyn Sink),
}

/// Takes the bytes of a transfer in place of an arena: e.g. the file the weights are bound
/// for, written as the bytes arrive (so nothing makes a second pass over them). Bytes are
/// written before their bucket is verified; a transfer that fails drops the sink unfinished.
pub trait Sink: Send + Sync {
    /// Writes `bytes`, the arena's bytes from offset `at`.
    ///
    /// # Errors
    /// An I/O error, which fails the transfer.
    fn write_at(&self, at: usize, bytes: &[u8]) -> Result<()>;

    /// The sink's own memory for the arena's bytes `range` (e.g. a writable map of the
    /// file), when it has memory a transfer can read the socket straight into: the bytes
    /// then land once, where they stay, and are hashed there while in cache. Each byte is
    /// handed out at most once (a range overlapping one claimed before is an error), so the
    /// slices never alias. `None` (the default): the transfer reads into a small buffer and
    /// calls [`write_at`](Self::write_at).
    ///
    /// # Errors
    /// An I/O error preparing the memory (e.g. the file system is full), or a range claimed
    /// twice or past the end, which fails the transfer.
    fn claim(&self, range: std::ops::Range<usize>) -> Result<Option<SinkSlice<'_>>> {
        let _ = range;
        Ok(None)
    }

    /// The arena's bytes `range` (one bucket, written before) are verified against the
    /// sender's checksums: e.g. a sink that applies the tensors as they arrive hands over
    /// those now whole. The default does nothing.
    ///
    /// # Errors
    /// A failure handing the bytes on, which fails the transfer.
    fn verified(&self, range: std::ops::Range<usize>) -> Result<()> {
        let _ = range;
        Ok(())
    }

    /// Every byte is in and verified: the storage of the version (the arena's bytes, e.g. a
    /// read-only map of the file), which must be exactly the arena's length.
    ///
    /// # Errors
    /// An I/O error, which fails the transfer.
    fn finish(self: Box<Self>) -> Result<Arc<dyn refit_runtime::SharedBytes>>;
}

/// Bytes of a sink's own memory that one transfer stream fills ([`Sink::claim`]).
#[derive(Debug)]
pub struct SinkSlice<'a>(&'a mut [u8]);

impl<'a> SinkSlice<'a> {
    /// Wraps `bytes`, which nothing else reads or writes while the slice lives.
    pub fn new(bytes: &'a mut [u8]) -> Self {
        Self(bytes)
    }
}

impl std::ops::Deref for SinkSlice<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.0
    }
}

impl std::ops::DerefMut for SinkSlice<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0
    }
}

/// True when the pieces of every bucket of `plan` cover it whole (no padding between
/// tensors): a sink can then take the bytes without anything reading them back.
pub(crate) fn covered(plan: &BucketPlan) -> bool {
    plan.buckets
        .iter()
        .all(|b| b.pieces.iter().map(|p| p.len).sum::<usize>() == b.len)
}

/// Pulls `parts` (from [`assign`]) into `dest`, one stream per part on its own
/// thread; `open` opens one stream for one part. Every bucket is checked against the plan
/// before its bytes are read; its pieces (whole tensors and chunks of cut ones) are hashed as
/// they land and verified, then its checksum, once it is in; then it is marked landed, so a
/// relayed pull of the same version can serve it at once. Returns the bytes read.
pub(crate) fn pull_buckets(
    dest: Dest<'_>,
    parts: &[Vec<u32>],
    exp: Expect<'_>,
    open: &Opener<'_>,
    counters: Counters<'_>,
) -> Result<u64> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = parts
            .iter()
            .map(|part| {
                scope.spawn(move || {
                    let r = pull_part(part, dest, exp, open, counters);
                    if let (Err(_), Dest::Arena(f)) = (&r, dest) {
                        // relayed pulls stop passing on this version's bytes at once
                        f.fail();
                    }
                    r
                })
            })
            .collect();
        let mut total = 0;
        let mut first_err = None;
        for h in handles {
            match h.join() {
                Ok(Ok(n)) => total += n,
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(Error::transport(NAME, "a pull thread panicked"));
                }
            }
        }
        first_err.map_or(Ok(total), Err)
    })
}

/// One stream: its buckets in order, each header checked, bytes read, bucket verified and
/// marked landed.
fn pull_part(
    part: &[u32],
    dest: Dest<'_>,
    exp: Expect<'_>,
    open: &Opener<'_>,
    counters: Counters<'_>,
) -> Result<u64> {
    let mut scratch = match dest {
        Dest::Sink(_) => vec![0u8; READ],
        Dest::Arena(_) => Vec::new(),
    };
    let want: u64 = part
        .iter()
        .filter_map(|&i| exp.plan.buckets.get(i as usize))
        .map(|b| b.len as u64)
        .sum();
    let mut s = open(part)?;
    if s.len != want {
        return Err(Error::transport(
            NAME,
            format!("source announced {} bytes, {want} requested", s.len),
        ));
    }
    for &i in part {
        let header: BucketHeader = frame::recv_blocking(&mut s.stream, wire::MAX_CONTROL_MESSAGE)
            .map_err(|e| broke(&e))?;
        counters.headers.fetch_add(1, Ordering::Relaxed);
        if header.index != i as usize || header.version != exp.version {
            return Err(Error::Bucket {
                index: i as usize,
                reason: format!(
                    "header of bucket {} of version {} arrived where version {} was asked for",
                    header.index, header.version, exp.version
                ),
            });
        }
        let spec = exp.plan.check_header(&header)?;
        let mut landing = PieceHasher::new(spec, exp.manifest, i as usize)?;
        if let Some(n) = header.encoded {
            let Dest::Arena(flight) = dest else {
                return Err(Error::Bucket {
                    index: i as usize,
                    reason: "sent encoded to a sink, which takes raw bytes".into(),
                });
            };
            let mut dst = claim(flight, &header, spec)?;
            read_encoded(
                &mut s.stream,
                n,
                &mut scratch,
                &mut dst,
                &mut landing,
                counters,
            )?;
            exp.check_bucket(spec, &header, dst.written(), landing.sums())?;
            dst.land();
            continue;
        }
        let flight = match dest {
            Dest::Arena(f) => f,
            Dest::Sink(sink) => {
                if let Some(mut dst) = sink.claim(spec.start..spec.start + spec.len)? {
                    // straight into the sink's memory: one copy, hashed while in cache
                    if dst.len() != spec.len {
                        return Err(Error::State("a sink gave a slice of another length"));
                    }
                    read_hashed(&mut s.stream, &mut dst, &mut landing, counters)?;
                    exp.check_bucket(spec, &header, &[], landing.sums())?;
                    sink.verified(spec.start..spec.start + spec.len)?;
                    continue;
                }
                // else the sink takes the bytes from a small reused buffer, hashed while in
                // cache; the bytes between tensors are kept aside for the bucket's checksum,
                // so no byte of the bucket is read again
                let gaps = spec.gaps(exp.manifest);
                let mut gap_bytes = Vec::with_capacity(gaps.iter().map(|g| g.len()).sum());
                let mut at = 0;
                while at < spec.len {
                    let end = (at + READ).min(spec.len);
                    let chunk = scratch.get_mut(..end - at).unwrap_or_default();
                    s.stream.read_exact(chunk).map_err(|e| broke(&e))?;
                    landing.feed(chunk, at);
                    for g in &gaps {
                        let (from, to) = (g.start.max(at), g.end.min(end));
                        if from < to {
                            gap_bytes.extend_from_slice(
                                chunk.get(from - at..to - at).unwrap_or_default(),
                            );
                        }
                    }
                    sink.write_at(spec.start + at, chunk)?;
                    counters
                        .bytes
                        .fetch_add((end - at) as u64, Ordering::Relaxed);
                    counters
                        .wire
                        .fetch_add((end - at) as u64, Ordering::Relaxed);
                    at = end;
                }
                exp.check_bucket_gaps(spec, &header, &gap_bytes, landing.sums())?;
                sink.verified(spec.start..spec.start + spec.len)?;
                continue;
            }
        };
        let mut dst = claim(flight, &header, spec)?;
        read_hashed(&mut s.stream, &mut dst, &mut landing, counters)?;
        exp.check_bucket(spec, &header, dst.written(), landing.sums())?;
        dst.land();
    }
    Ok(want)
}

/// The writer of the bucket `header` announces (`spec` in the plan), for this stream alone.
fn claim<'f>(
    flight: &'f InFlight,
    header: &BucketHeader,
    spec: &BucketSpec,
) -> Result<BucketWriter<'f>> {
    let index = header.index;
    let declared = Declared {
        checksum: header.checksum,
        pieces: header.piece_sums.clone(),
    };
    let dst = flight.claim(index, declared).ok_or_else(|| Error::Bucket {
        index,
        reason: "pulled twice or not part of the transfer".into(),
    })?;
    if dst.len() != spec.len {
        return Err(Error::Bucket {
            index,
            reason: "the transfer's plan and the header's disagree on its length".into(),
        });
    }
    Ok(dst)
}

/// Reads a bucket sent as an element-level delta (`n` bytes of encoding) into `buf` and
/// applies it to `dst`, which holds the base's bytes of the bucket; then hashes the
/// result (a second pass over the bucket: the apply does not hash as it goes), counts it,
/// and publishes it to relayed pulls whole.
fn read_encoded(
    stream: &mut impl Read,
    n: usize,
    buf: &mut Vec<u8>,
    dst: &mut BucketWriter<'_>,
    landing: &mut PieceHasher,
    counters: Counters<'_>,
) -> Result<()> {
    let (index, len) = (dst.index(), dst.len());
    let bad = |reason: String| Error::Bucket { index, reason };
    if n > max_encoded(len) {
        return Err(bad(format!(
            "an encoding of {n} bytes for a bucket of {len}"
        )));
    }
    buf.resize(n, 0);
    for chunk in buf.chunks_mut(READ) {
        stream.read_exact(chunk).map_err(|e| broke(&e))?;
        counters
            .wire
            .fetch_add(chunk.len() as u64, Ordering::Relaxed);
    }
    let piece = dst.piece(0, len)?;
    refit_runtime::delta::elements::apply(piece, buf).map_err(|e| bad(e.to_string()))?;
    landing.feed(piece, 0);
    dst.arrived(len);
    counters.bytes.fetch_add(len as u64, Ordering::Relaxed);
    Ok(())
}

/// A data stream that failed part-way.
fn broke(e: &dyn std::fmt::Display) -> Error {
    Error::transport(NAME, format!("stream broke mid-transfer: {e}"))
}

/// Memory a bucket's bytes are read into, one piece (a socket read) at a time.
trait Fill {
    /// The bucket's length.
    fn len(&self) -> usize;
    /// The bytes `at..end` to fill next.
    fn piece(&mut self, at: usize, end: usize) -> Result<&mut [u8]>;
    /// The bytes up to `end` are in (a relay serves them on from here).
    fn arrived(&mut self, end: usize) {
        let _ = end;
    }
}

impl Fill for SinkSlice<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn piece(&mut self, at: usize, end: usize) -> Result<&mut [u8]> {
        self.0
            .get_mut(at..end)
            .ok_or(Error::State("a piece past the end of a sink's slice"))
    }
}

impl Fill for BucketWriter<'_> {
    fn len(&self) -> usize {
        BucketWriter::len(self)
    }

    fn piece(&mut self, at: usize, end: usize) -> Result<&mut [u8]> {
        BucketWriter::piece(self, at, end)
    }

    fn arrived(&mut self, end: usize) {
        BucketWriter::arrived(self, end);
    }
}

/// Reads a bucket's bytes from `stream` into `dst`, a piece of `READ` bytes at a time,
/// each hashed as it lands (while in cache), counted, and published to relayed pulls.
fn read_hashed(
    stream: &mut impl Read,
    dst: &mut impl Fill,
    landing: &mut PieceHasher,
    counters: Counters<'_>,
) -> Result<()> {
    let len = dst.len();
    let mut at = 0;
    while at < len {
        let end = (at + READ).min(len);
        let piece = dst.piece(at, end)?;
        stream.read_exact(piece).map_err(|e| broke(&e))?;
        landing.feed(piece, at);
        dst.arrived(end);
        counters
            .bytes
            .fetch_add((end - at) as u64, Ordering::Relaxed);
        counters
            .wire
            .fetch_add((end - at) as u64, Ordering::Relaxed);
        at = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use refit_runtime::DType;
    use std::time::Duration;

    fn plan(sizes: &[usize], bucket: usize) -> BucketPlan {
        let mut b = Manifest::builder();
        for (i, n) in sizes.iter().enumerate() {
            b.push(format!("t{i}"), DType::U8, &[*n]);
        }
        let m = b.build().unwrap();
        BucketPlan::compute(&ModelId::new("m").unwrap(), &m, &m, bucket).unwrap()
    }

    /// A relay passes on a bucket's bytes before it has verified them; the receiver it
    /// serves verifies them against the sender's checksums itself, so a damaged byte it got
    /// that way is refused, naming the tensor, and the version never completes.
    #[test]
    fn a_relay_passes_on_unverified_bytes_and_the_next_receiver_refuses_a_damaged_bucket() {
        use refit_node::{ClusterToken, Node, NodeConfig};
        let mut b = Manifest::builder();
        for (i, n) in [700_000usize, 900_000, 300_000].iter().enumerate() {
            b.push(format!("t{i}"), DType::U8, &[*n]);
        }
        let m = Arc::new(b.build().unwrap());
        let model = ModelId::new("m").unwrap();
        let plan = Arc::new(BucketPlan::compute(&model, &m, &m, 1 << 20).unwrap());
        let plan_id = plan.fingerprint().unwrap();
        let mut good = WeightSet::zeroed(model.clone(), Arc::clone(&m));
        for (i, x) in good.bytes_mut().unwrap().iter_mut().enumerate() {
            *x = (i * 7 % 253) as u8;
        }
        good.set_version(Version(3));
        let sums = Sums::compute(&plan, plan_id, &good, 1);
        let all: Vec<u32> = (0..u32::try_from(plan.len()).unwrap()).collect();
        assert!(all.len() >= 2);
        let flight = |ws: WeightSet| {
            Arc::new(
                InFlight::new(ws, Arc::clone(&plan), plan_id, &all, Duration::from_secs(5))
                    .unwrap(),
            )
        };
        // the relay: every byte arrived, one of bucket 0 damaged, nothing verified yet
        let mut zero = WeightSet::zeroed(model.clone(), Arc::clone(&m));
        zero.set_version(Version(3));
        let relay = flight(zero.clone());
        let damaged = m.tensors()[0].offset + 1234;
        for (i, spec) in plan.buckets.iter().enumerate() {
            let declared = Declared {
                checksum: sums.buckets[i],
                pieces: Vec::new(),
            };
            let mut w = relay.claim(i, declared).unwrap();
            let dst = w.piece(0, spec.len).unwrap();
            dst.copy_from_slice(&good.bytes()[spec.range()]);
            if spec.range().contains(&damaged) {
                dst[damaged - spec.start] ^= 0x10;
            }
            w.arrived(spec.len);
        }
        assert!(relay.finish().is_err(), "the relay verified nothing");
        let node = Node::start(NodeConfig::loopback(ClusterToken::random())).unwrap();
        let target = uuid::Uuid::new_v4();
        let stats = Arc::new(ServeStats::default());
        let (f, st) = (Arc::clone(&relay), Arc::clone(&stats));
        node.register_stream(target, "pull", move |_, bytes, stream| {
            let (f, st) = (Arc::clone(&f), Arc::clone(&st));
            Box::pin(async move {
                let req: PullReq = wire::decode(&bytes, wire::MAX_CONTROL_MESSAGE)?;
                Ok(serve_pull(stream, Ok(Serve::Landing(f)), req, &st).await?)
            })
        });
        let next = flight(zero);
        let starts = piece_starts(&plan);
        let verified = Verified::new(sums.pieces.len());
        let exp = Expect {
            model: &model,
            version: Version(3),
            manifest: &m,
            plan: &plan,
            sums: &sums.pieces,
            starts: &starts,
            verified: &verified,
        };
        let (bytes, headers) = (AtomicU64::new(0), AtomicU64::new(0));
        let wire = AtomicU64::new(0);
        let counters = Counters {
            bytes: &bytes,
            wire: &wire,
            headers: &headers,
        };
        let open = |part: &[u32]| {
            let req = PullReq {
                model: model.clone(),
                version: Version(3),
                plan: plan_id,
                buckets: part.to_vec(),
                base: None,
            };
            node.open_stream(node.addr(), target, "pull", &req, Duration::from_secs(10))
                .map_err(Into::into)
        };
        // the whole buckets first, one stream each: they land, served before the relay
        // verified any of its bytes
        let bad = plan
            .buckets
            .iter()
            .position(|spec| spec.range().contains(&damaged))
            .unwrap();
        let whole: Vec<usize> = (0..plan.len()).filter(|&i| i != bad).collect();
        let parts: Vec<Vec<u32>> = whole.iter().map(|&i| vec![i as u32]).collect();
        pull_buckets(Dest::Arena(&next), &parts, exp, &open, counters).unwrap();
        let served: u64 = whole.iter().map(|&i| plan.buckets[i].len as u64).sum();
        // the relay counts a piece once its write returned, which may be just after the
        // receiver read it
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while stats.bytes.load(Ordering::Relaxed) < served && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(stats.bytes.load(Ordering::Relaxed), served);
        // then the damaged bucket: refused by this receiver, naming the tensor (the pull may
        // stop at the damaged piece, so the relay's count of its bytes is not asserted)
        let e = pull_buckets(
            Dest::Arena(&next),
            &[vec![bad as u32]],
            exp,
            &open,
            counters,
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::Tensor { name, problem: refit_runtime::Mismatch::Checksum { .. }, .. } if name == "t0"),
            "{e}"
        );
        assert!(e.to_string().contains("checksum"), "{e}");
        assert!(next.finish().is_err(), "a damaged version never completes");
        node.shutdown();
    }

    #[test]
    fn buckets_are_spread_whole_and_ascending() {
        let p = plan(&[1024; 8], 1024);
        let all: Vec<u32> = (0..8).collect();
        let parts = assign(&p, &all, 4);
        assert_eq!(parts, [vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        // fewer buckets than streams: one stream per bucket
        assert_eq!(assign(&p, &[2, 5], 4), [vec![2], vec![5]]);
        assert!(assign(&p, &[], 4).is_empty());
        // a big bucket is balanced by several small ones
        let q = plan(&[64, 64, 64, 4096], 4096);
        assert_eq!(q.len(), 2);
        assert_eq!(assign(&q, &[0, 1], 2), [vec![0], vec![1]]);
    }

    #[test]
    fn pull_requests_are_checked_against_the_plan() {
        let p = Arc::new(plan(&[1024; 4], 1024));
        let m = Arc::new({
            let mut b = Manifest::builder();
            for i in 0..4 {
                b.push(format!("t{i}"), DType::U8, &[1024]);
            }
            b.build().unwrap()
        });
        let weights = WeightSet::zeroed(ModelId::new("m").unwrap(), m);
        let plan_id = p.fingerprint().unwrap();
        let src = Source {
            sums: Arc::new(Hashes::new(Arc::clone(&p), plan_id)),
            weights: Arc::new(weights),
            plan: Arc::clone(&p),
            plan_id,
            encoded: None,
        };
        let req = |plan, buckets| PullReq {
            model: ModelId::new("m").unwrap(),
            version: Version(1),
            plan,
            buckets,
            base: None,
        };
        let id = src.plan_id;
        let src = Serve::Whole(src);
        assert_eq!(check_buckets(&req(id, vec![0, 2, 3]), &src), Ok(3072));
        assert!(check_buckets(&req(id, vec![2, 1]), &src).is_err());
        assert!(check_buckets(&req(id, vec![1, 1]), &src).is_err());
        assert!(check_buckets(&req(id, vec![4]), &src).is_err());
        let e = check_buckets(&req(id ^ 1, vec![0]), &src).unwrap_err();
        assert!(e.contains("bucket plan"), "{e}");
    }

    #[test]
    fn parallel_sums_hash_every_piece_once_and_cover_the_gaps() {
        let mut b = Manifest::builder();
        for (i, n) in [100usize, 5000, 0, 64, 3000, 7].iter().enumerate() {
            b.push(format!("t{i}"), DType::U8, &[*n]);
        }
        let m = Arc::new(b.build().unwrap());
        let mut ws = WeightSet::zeroed(ModelId::new("m").unwrap(), Arc::clone(&m));
        for (i, x) in ws.bytes_mut().unwrap().iter_mut().enumerate() {
            *x = (i * 31 % 251) as u8;
        }
        for bucket in [64, 1024, 1 << 20] {
            let p = BucketPlan::compute(&ModelId::new("m").unwrap(), &m, &m, bucket).unwrap();
            let serial = Sums::compute(&p, 7, &ws, 1);
            assert_eq!(Sums::compute(&p, 7, &ws, 3), serial);
            assert_eq!(serial.buckets.len(), p.len());
            // every piece is the xxh3 of its bytes
            let flat: Vec<u64> = p
                .buckets
                .iter()
                .flat_map(|b| &b.pieces)
                .map(|pc| {
                    let at = m.tensors()[pc.tensor].offset + pc.offset;
                    refit_runtime::hash::xxh3_64(&ws.bytes()[at..at + pc.len])
                })
                .collect();
            assert_eq!(serial.pieces, flat);
            // the receiver's derivation agrees
            let again = Sums::of_arena(&p, 7, &m, ws.bytes(), flat.clone());
            assert_eq!(again, serial);
            // a flipped byte between tensors changes its bucket's checksum only
            let gap = m.tensors()[1].offset - 1;
            assert!(gap >= 100, "t0 is padded");
            let mut bytes = ws.bytes().to_vec();
            bytes[gap] ^= 1;
            let flipped = Sums::of_arena(&p, 7, &m, &bytes, flat);
            let hit: Vec<usize> = (0..p.len())
                .filter(|&i| flipped.buckets[i] != serial.buckets[i])
                .collect();
            assert_eq!(hit.len(), 1);
            assert!(p.buckets[hit[0]].range().contains(&gap));
            // no change since itself; a changed tensor is found by its pieces (the
            // runtime's bucket delta over these sums)
            use refit_runtime::delta::BucketDelta;
            let same = BucketDelta::changed_tensors(&p, &serial.pieces, &serial.pieces);
            assert_eq!(same, Some(vec![]));
            let mut other = ws.clone();
            other.bytes_mut().unwrap()[m.tensors()[4].offset + 2999] ^= 1;
            let changed = Sums::compute(&p, 7, &other, 2);
            let found = BucketDelta::changed_tensors(&p, &serial.pieces, &changed.pieces);
            assert_eq!(found, Some(vec![4]));
        }
    }

    #[test]
    fn landing_hashes_equal_the_one_shot_ones_for_any_read_size() {
        let mut b = Manifest::builder();
        for (i, n) in [100usize, 5000, 64, 3000].iter().enumerate() {
            b.push(format!("t{i}"), DType::U8, &[*n]);
        }
        let m = Arc::new(b.build().unwrap());
        let mut ws = WeightSet::zeroed(ModelId::new("m").unwrap(), Arc::clone(&m));
        for (i, x) in ws.bytes_mut().unwrap().iter_mut().enumerate() {
            *x = (i * 17 % 253) as u8;
        }
        let p = BucketPlan::compute(&ModelId::new("m").unwrap(), &m, &m, 4096).unwrap();
        let sums = Sums::compute(&p, 1, &ws, 1);
        let starts = piece_starts(&p);
        let verified = Verified::new(sums.pieces.len());
        let exp = Expect {
            model: &ModelId::new("m").unwrap(),
            version: Version(1),
            manifest: &m,
            plan: &p,
            sums: &sums.pieces,
            starts: &starts,
            verified: &verified,
        };
        for step in [1, 7, 64, 1000, 1 << 20] {
            for (i, spec) in p.buckets.iter().enumerate() {
                let bytes = &ws.bytes()[spec.range()];
                let mut l = PieceHasher::new(spec, &m, i).unwrap();
                let mut at = 0;
                while at < bytes.len() {
                    let end = (at + step).min(bytes.len());
                    l.feed(&bytes[at..end], at);
                    at = end;
                }
                assert_eq!(l.sums(), &sums.pieces[starts[i]..starts[i + 1]]);
                let header = BucketHeader {
                    index: i,
                    version: Version(1),
                    start: spec.start,
                    len: spec.len,
                    pieces: spec.pieces.clone(),
                    checksum: sums.buckets[i],
                    encoded: None,
                    piece_sums: Vec::new(),
                };
                exp.check_bucket(spec, &header, bytes, l.sums()).unwrap();
                // a wrong piece names its tensor
                let mut bad = l.sums().to_vec();
                bad[0] ^= 1;
                let e = exp.check_bucket(spec, &header, bytes, &bad).unwrap_err();
                assert!(matches!(e, Error::Tensor { .. }), "{e}");
            }
        }
        assert_eq!(
            verified.take(),
            sums.pieces,
            "every verified piece is recorded"
        );
    }

    /// Where the transfer's terms carry no checksums, each header declares its bucket's
    /// pieces': they are checked as the terms' would be (a wrong one names its tensor, a
    /// wrong count names the bucket), and what was verified is the version's checksums.
    #[test]
    fn checksums_declared_by_the_headers_are_verified_and_recorded() {
        let mut b = Manifest::builder();
        for (i, n) in [3000usize, 100, 5000].iter().enumerate() {
            b.push(format!("t{i}"), DType::U8, &[*n]);
        }
        let m = Arc::new(b.build().unwrap());
        let model = ModelId::new("m").unwrap();
        let mut ws = WeightSet::zeroed(model.clone(), Arc::clone(&m));
        for (i, x) in ws.bytes_mut().unwrap().iter_mut().enumerate() {
            *x = (i * 13 % 251) as u8;
        }
        let p = Arc::new(BucketPlan::compute(&model, &m, &m, 4096).unwrap());
        assert!(p.len() >= 2);
        let hashes = Hashes::new(Arc::clone(&p), 1);
        let starts = piece_starts(&p);
        let verified = Verified::new(*starts.last().unwrap());
        let exp = Expect {
            model: &model,
            version: Version(1),
            manifest: &m,
            plan: &p,
            sums: &[],
            starts: &starts,
            verified: &verified,
        };
        for (i, spec) in p.buckets.iter().enumerate().rev() {
            let bytes = &ws.bytes()[spec.range()];
            let mut l = PieceHasher::new(spec, &m, i).unwrap();
            l.feed(bytes, 0);
            let declared = hashes.bucket(i, &ws).unwrap().clone();
            let mut header = header_of(i, spec, Version(1), declared.checksum);
            header.piece_sums = declared.pieces.clone();
            // a forged piece checksum is refused naming the tensor
            header.piece_sums[0] ^= 1;
            let e = exp
                .check_bucket(spec, &header, bytes, l.sums())
                .unwrap_err();
            assert!(matches!(e, Error::Tensor { .. }), "{e}");
            // a header declaring none (or too few) for its pieces is refused naming the bucket
            header.piece_sums.clear();
            let e = exp
                .check_bucket(spec, &header, bytes, l.sums())
                .unwrap_err();
            assert!(
                matches!(e, Error::Bucket { index, .. } if index == i),
                "{e}"
            );
            header.piece_sums = declared.pieces;
            exp.check_bucket(spec, &header, bytes, l.sums()).unwrap();
        }
        let whole = Sums::compute(&p, 1, &ws, 1);
        assert_eq!(verified.take(), whole.pieces);
    }

    /// A version's checksums hashed a bucket at a time, in any order, equal those hashed at
    /// once; the whole sums exist once every bucket is hashed, and known ones are served
    /// as they are.
    #[test]
    fn hashes_made_bucket_by_bucket_equal_the_whole_versions() {
        let mut b = Manifest::builder();
        for (i, n) in [100usize, 5000, 0, 64, 3000, 7].iter().enumerate() {
            b.push(format!("t{i}"), DType::U8, &[*n]);
        }
        let m = Arc::new(b.build().unwrap());
        let model = ModelId::new("m").unwrap();
        let mut ws = WeightSet::zeroed(model.clone(), Arc::clone(&m));
        for (i, x) in ws.bytes_mut().unwrap().iter_mut().enumerate() {
            *x = (i * 29 % 241) as u8;
        }
        let p = Arc::new(BucketPlan::compute(&model, &m, &m, 1024).unwrap());
        let want = Sums::compute(&p, 9, &ws, 1);
        let lazy = Hashes::new(Arc::clone(&p), 9);
        assert!(lazy.whole().is_none());
        assert!(lazy.hashed(1).is_none());
        let one = lazy.bucket(1, &ws).unwrap().clone();
        assert_eq!(lazy.hashed(1), Some(&one));
        assert_eq!(one.checksum, want.buckets[1]);
        assert!(lazy.whole().is_none(), "one bucket of {} hashed", p.len());
        assert!(lazy.bucket(p.len(), &ws).is_none(), "past the plan");
        assert_eq!(lazy.complete(&ws, 2).as_deref(), Some(&want));
        assert_eq!(lazy.whole().as_deref(), Some(&want));
        // every bucket hashed one by one: whole too
        let each = Hashes::new(Arc::clone(&p), 9);
        for i in (0..p.len()).rev() {
            each.bucket(i, &ws).unwrap();
        }
        assert_eq!(each.whole().as_deref(), Some(&want));
        let known = Hashes::known(Arc::clone(&p), want.clone());
        assert_eq!(known.plan_id(), 9);
        assert_eq!(known.len(), p.len());
        for i in 0..p.len() {
            assert_eq!(known.hashed(i), lazy.hashed(i));
        }
    }
}
