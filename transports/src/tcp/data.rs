//! The data plane: buckets of the sender's [`BucketPlan`], served by a stream handler and
//! pulled over several parallel streams straight into the receiver's arena.
//!
//! Each stream carries whole buckets; each bucket travels as exactly one framed
//! [`BucketHeader`] (its control message: index, version, range, pieces, xxh3) followed by its
//! raw bytes. The receiving thread checks the header against the plan before reading a byte,
//! then verifies the bucket's tensors and its checksum as soon as the bucket is in, in
//! parallel with the other streams.

use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use refit_runtime::node::{OpenStream, StreamHead, frame, write_head};
use refit_runtime::{
    BucketHeader, BucketPlan, Error, Manifest, Mismatch, ModelId, Result, Version, WeightSet, wire,
};
use tokio::io::AsyncWriteExt;

use super::NAME;
use super::messages::PullReq;

/// Bytes written per socket write on the serving side (the unit of injected corruption).
pub(crate) const CHUNK: usize = 1 << 20;
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
}

/// Checks a pull against the source's plan; the payload bytes it asks for.
fn check_buckets(req: &PullReq, src: &Source) -> std::result::Result<u64, String> {
    if req.plan != src.plan_id {
        return Err(format!(
            "the pull names bucket plan {:#018x}, this source cuts `{}` by plan {:#018x}",
            req.plan, req.model, src.plan_id
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
        match src.plan.buckets.get(i) {
            Some(b) if i >= next => {
                total += b.len as u64;
                next = i + 1;
            }
            _ => {
                return Err(format!(
                    "bucket {i} is out of order or past the plan's {}",
                    src.plan.len()
                ));
            }
        }
    }
    Ok(total)
}

/// Serves one pull: a head, then each requested bucket as its header frame and its bytes (or
/// an error head when the pull does not fit the source).
pub(crate) async fn serve_pull(
    mut stream: tokio::net::TcpStream,
    src: std::result::Result<Source, String>,
    req: PullReq,
    stats: &ServeStats,
) -> Result<()> {
    let checked = src.and_then(|s| check_buckets(&req, &s).map(|t| (s, t)));
    let (src, total) = match checked {
        Ok(v) => v,
        Err(reason) => return write_head(&mut stream, &StreamHead::Err { reason }).await,
    };
    write_head(&mut stream, &StreamHead::Ok { len: total }).await?;
    let io = |e| Error::io("serving a pull", e);
    for &i in &req.buckets {
        let (header, bytes) = src.plan.bucket(&src.weights, i as usize)?;
        frame::send(&mut stream, &header).await?;
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
    }
    stream.flush().await.map_err(io)
}

/// xxh3-64 of every tensor of `ws`, hashed by up to `threads` threads taking the plan's
/// buckets from a shared queue (each hashes the tensors a bucket holds whole); tensors cut
/// across buckets, and any the plan does not place, are hashed afterwards. Bucket checksums
/// are left to the serving streams, which hash each bucket just before writing it, in
/// parallel with the other streams' socket writes.
pub(crate) fn tensor_sums(plan: &BucketPlan, ws: &WeightSet, threads: usize) -> Vec<u64> {
    let bytes = ws.bytes();
    let specs = ws.manifest().tensors();
    let tensor_bytes = |i: usize| {
        specs
            .get(i)
            .and_then(|t| bytes.get(t.offset..t.offset + t.len))
    };
    let next = AtomicUsize::new(0);
    let work = || {
        let mut out = Vec::new();
        while let Some(b) = plan.buckets.get(next.fetch_add(1, Ordering::Relaxed)) {
            for p in &b.pieces {
                if specs.get(p.tensor).is_some_and(|t| !p.is_chunk(t.len))
                    && let Some(t) = tensor_bytes(p.tensor)
                {
                    out.push((p.tensor, xxhash_rust::xxh3::xxh3_64(t)));
                }
            }
        }
        out
    };
    let done: Vec<(usize, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..threads.max(1)).map(|_| s.spawn(work)).collect();
        let mut all = work();
        for h in handles {
            // a panicking hasher leaves its tensors unhashed: they are hashed below
            all.extend(h.join().unwrap_or_default());
        }
        all
    });
    let mut sums: Vec<Option<u64>> = vec![None; specs.len()];
    for (t, s) in done {
        if let Some(slot) = sums.get_mut(t) {
            *slot = Some(s);
        }
    }
    sums.into_iter()
        .enumerate()
        .map(|(i, s)| s.unwrap_or_else(|| tensor_bytes(i).map_or(0, xxhash_rust::xxh3::xxh3_64)))
        .collect()
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
    /// xxh3-64 of every tensor of the version.
    pub(crate) sums: &'a [u64],
}

impl Expect<'_> {
    /// Checks the tensor bytes `bytes` of manifest tensor `tensor` against its checksum.
    pub(crate) fn check_tensor(&self, tensor: usize, bytes: &[u8]) -> Result<()> {
        let (Some(spec), Some(&expected)) =
            (self.manifest.tensors().get(tensor), self.sums.get(tensor))
        else {
            return Err(Error::transport(
                NAME,
                format!("tensor {tensor} is not in the manifest or has no checksum"),
            ));
        };
        let found = xxhash_rust::xxh3::xxh3_64(bytes);
        if found != expected {
            return Err(Error::tensor(
                self.model,
                &spec.name,
                Mismatch::Checksum { expected, found },
            ));
        }
        Ok(())
    }

    /// Checks a bucket that arrived whole in `dst`: every tensor it holds whole against its
    /// checksum (naming the tensor), then the bucket's own checksum.
    fn check_bucket(&self, header: &BucketHeader, dst: &[u8]) -> Result<()> {
        for p in &header.pieces {
            let Some(spec) = self.manifest.tensors().get(p.tensor) else {
                continue; // the header matched the plan, which was verified
            };
            if !p.is_chunk(spec.len) {
                let at = (spec.offset + p.offset).saturating_sub(header.start);
                let bytes = dst.get(at..at + p.len).ok_or_else(|| Error::Bucket {
                    index: header.index,
                    reason: format!("tensor `{}` runs past the bucket", spec.name),
                })?;
                self.check_tensor(p.tensor, bytes)?;
            }
        }
        self.plan.check_checksum(header, dst)
    }
}

/// Counters a pull updates as buckets arrive.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counters<'a> {
    /// Weight bytes read.
    pub(crate) bytes: &'a AtomicU64,
    /// Bucket control messages (headers) received.
    pub(crate) headers: &'a AtomicU64,
}

/// Opens one stream for one part (its bucket indices).
pub(crate) type Opener<'a> = dyn Fn(&[u32]) -> Result<OpenStream> + Sync + 'a;

/// Pulls `parts` (from [`assign`]) into `arena`, one stream per part on its own thread;
/// `open` opens one stream for one part. Every bucket is checked against the plan before its
/// bytes are read and verified (tensors held whole, then its checksum) once they are in;
/// tensors cut across buckets are left to the caller. Returns the bytes read.
pub(crate) fn pull_buckets(
    arena: &mut [u8],
    parts: &[Vec<u32>],
    exp: Expect<'_>,
    open: &Opener<'_>,
    counters: Counters<'_>,
) -> Result<u64> {
    let dests = carve(arena, exp.plan, parts)?;
    std::thread::scope(|scope| {
        let handles: Vec<_> = parts
            .iter()
            .zip(dests)
            .map(|(part, slices)| scope.spawn(move || pull_part(part, slices, exp, open, counters)))
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

/// Cuts `arena` into the destination slice of every bucket of every part.
fn carve<'a>(
    arena: &'a mut [u8],
    plan: &BucketPlan,
    parts: &[Vec<u32>],
) -> Result<Vec<Vec<&'a mut [u8]>>> {
    let mut order: Vec<(u32, usize)> = parts
        .iter()
        .enumerate()
        .flat_map(|(p, part)| part.iter().map(move |&i| (i, p)))
        .collect();
    order.sort_unstable();
    let mut dests: Vec<Vec<(u32, &mut [u8])>> = parts.iter().map(|_| Vec::new()).collect();
    let mut rest: &mut [u8] = arena;
    let mut base = 0usize;
    for (i, p) in order {
        let b = plan
            .buckets
            .get(i as usize)
            .ok_or_else(|| Error::transport(NAME, format!("bucket {i} is not in the plan")))?;
        if b.start < base || b.start + b.len - base > rest.len() {
            return Err(Error::transport(
                NAME,
                format!("bucket {i} overlaps another or runs past the arena"),
            ));
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(b.start - base);
        let (dst, tail) = tail.split_at_mut(b.len);
        dests[p].push((i, dst));
        rest = tail;
        base = b.start + b.len;
    }
    Ok(dests
        .into_iter()
        .map(|mut d| {
            d.sort_unstable_by_key(|x| x.0);
            d.into_iter().map(|x| x.1).collect()
        })
        .collect())
}

/// One stream: its buckets in order, each header checked, bytes read, bucket verified.
fn pull_part(
    part: &[u32],
    slices: Vec<&mut [u8]>,
    exp: Expect<'_>,
    open: &Opener<'_>,
    counters: Counters<'_>,
) -> Result<u64> {
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
    let broke = |e: &dyn std::fmt::Display| {
        Error::transport(NAME, format!("stream broke mid-transfer: {e}"))
    };
    for (&i, dst) in part.iter().zip(slices) {
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
        exp.plan.check_header(&header)?;
        for piece in dst.chunks_mut(CHUNK) {
            s.stream.read_exact(piece).map_err(|e| broke(&e))?;
            counters
                .bytes
                .fetch_add(piece.len() as u64, Ordering::Relaxed);
        }
        exp.check_bucket(&header, dst)?;
    }
    Ok(want)
}

#[cfg(test)]
mod tests {
    use super::*;
    use refit_runtime::DType;

    fn plan(sizes: &[usize], bucket: usize) -> BucketPlan {
        let mut b = Manifest::builder();
        for (i, n) in sizes.iter().enumerate() {
            b.push(format!("t{i}"), DType::U8, &[*n]);
        }
        let m = b.build().unwrap();
        BucketPlan::compute(&ModelId::new("m").unwrap(), &m, &m, bucket).unwrap()
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
        let src = Source {
            weights: Arc::new(WeightSet::zeroed(ModelId::new("m").unwrap(), m)),
            plan: Arc::clone(&p),
            plan_id: p.fingerprint().unwrap(),
        };
        let req = |plan, buckets| PullReq {
            model: ModelId::new("m").unwrap(),
            version: Version(1),
            plan,
            buckets,
        };
        let id = src.plan_id;
        assert_eq!(check_buckets(&req(id, vec![0, 2, 3]), &src), Ok(3072));
        assert!(check_buckets(&req(id, vec![2, 1]), &src).is_err());
        assert!(check_buckets(&req(id, vec![1, 1]), &src).is_err());
        assert!(check_buckets(&req(id, vec![4]), &src).is_err());
        let e = check_buckets(&req(id ^ 1, vec![0]), &src).unwrap_err();
        assert!(e.contains("bucket plan"), "{e}");
    }

    #[test]
    fn parallel_tensor_sums_equal_the_serial_ones() {
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
            for threads in [1, 3] {
                assert_eq!(tensor_sums(&p, &ws, threads), ws.tensor_checksums());
            }
        }
    }
}
