//! The data plane: byte ranges of an arena, served by a stream handler and pulled over
//! several parallel streams straight into the receiver's arena.

use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use refit_runtime::node::{OpenStream, StreamHead, write_head};
use refit_runtime::{ALIGN, Error, Manifest, Result, WeightSet};
use tokio::io::AsyncWriteExt;

use super::NAME;
use super::messages::PullReq;

/// Bytes written per socket write on the serving side (the unit of injected corruption).
pub(crate) const CHUNK: usize = 1 << 20;
/// Streams are not split below this many bytes each.
const MIN_PART: u64 = 256 << 10;
/// Most ranges one pull request may carry.
const MAX_RANGES: usize = 1 << 16;

/// Counters and test hooks of one serving end.
#[derive(Debug, Default)]
pub(crate) struct ServeStats {
    pub(crate) bytes: AtomicU64,
    pub(crate) corrupt_chunks: AtomicU32,
}

fn check_ranges(req: &PullReq, arena: usize) -> std::result::Result<u64, String> {
    if req.ranges.len() > MAX_RANGES {
        return Err(format!(
            "{} ranges (at most {MAX_RANGES})",
            req.ranges.len()
        ));
    }
    let mut end = 0u64;
    let mut total = 0u64;
    for &(off, len) in &req.ranges {
        let stop = off.checked_add(len).filter(|&s| s <= arena as u64);
        match stop {
            Some(s) if off >= end => {
                end = s;
                total += len;
            }
            _ => {
                return Err(format!(
                    "range {off}..+{len} is out of order or past the arena"
                ));
            }
        }
    }
    Ok(total)
}

/// Serves one pull: a head, then the requested ranges of `ws` (or an error head).
pub(crate) async fn serve_pull(
    mut stream: tokio::net::TcpStream,
    ws: std::result::Result<Arc<WeightSet>, String>,
    req: PullReq,
    stats: &ServeStats,
) -> Result<()> {
    let checked = ws.and_then(|ws| check_ranges(&req, ws.bytes().len()).map(|t| (ws, t)));
    let (ws, total) = match checked {
        Ok(v) => v,
        Err(reason) => return write_head(&mut stream, &StreamHead::Err { reason }).await,
    };
    write_head(&mut stream, &StreamHead::Ok { len: total }).await?;
    let io = |e| Error::io("serving a pull", e);
    for &(off, len) in &req.ranges {
        // ranges were checked against the arena above
        let bytes = &ws.bytes()[off as usize..(off + len) as usize];
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

/// The byte ranges holding `tensors` (indices into the manifest), merged where only padding
/// separates them, ascending.
pub(crate) fn tensor_ranges(manifest: &Manifest, tensors: &[u32]) -> Vec<(u64, u64)> {
    let specs = manifest.tensors();
    let mut spans: Vec<(u64, u64)> = tensors
        .iter()
        .filter_map(|&i| specs.get(i as usize))
        .filter(|t| t.len > 0)
        .map(|t| (t.offset as u64, (t.offset + t.len) as u64))
        .collect();
    spans.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(spans.len());
    for (start, end) in spans {
        match out.last_mut() {
            Some(last) if start <= last.1 + ALIGN as u64 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out.into_iter().map(|(s, e)| (s, e - s)).collect()
}

/// Splits ascending ranges into at most `parts` groups of about equal bytes, cutting ranges
/// where needed; groups are consecutive in arena order.
pub(crate) fn split_ranges(ranges: &[(u64, u64)], parts: usize) -> Vec<Vec<(u64, u64)>> {
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    if total == 0 {
        return Vec::new();
    }
    let parts = (parts.max(1) as u64).min(total.div_ceil(MIN_PART)).max(1);
    let per = total.div_ceil(parts);
    let mut out = vec![Vec::new()];
    let mut room = per;
    for &(mut off, mut len) in ranges {
        while len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = per;
            }
            let take = len.min(room);
            if let Some(cur) = out.last_mut() {
                cur.push((off, take));
            }
            off += take;
            len -= take;
            room -= take;
        }
    }
    out
}

/// Opens one stream for one part (its ranges).
pub(crate) type Opener<'a> = dyn Fn(&[(u64, u64)]) -> Result<OpenStream> + Sync + 'a;

/// Pulls `parts` (from [`split_ranges`]) into `arena`, one stream per part on its own
/// thread; `open` opens one stream for one part. Returns the bytes read.
pub(crate) fn pull_parts(
    arena: &mut [u8],
    parts: &[Vec<(u64, u64)>],
    open: &Opener<'_>,
    progress: &AtomicU64,
) -> Result<u64> {
    // carve the arena into each part's destination slices (parts are ascending, disjoint)
    let mut rest: &mut [u8] = arena;
    let mut base = 0u64;
    let mut dests: Vec<Vec<&mut [u8]>> = Vec::with_capacity(parts.len());
    for part in parts {
        let mut mine = Vec::with_capacity(part.len());
        for &(off, len) in part {
            let skip = usize::try_from(off - base)
                .map_err(|_| Error::transport(NAME, "range offset overflows"))?;
            let len_us =
                usize::try_from(len).map_err(|_| Error::transport(NAME, "range overflows"))?;
            if skip + len_us > rest.len() {
                return Err(Error::transport(NAME, "a range runs past the arena"));
            }
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
            let (dst, tail) = tail.split_at_mut(len_us);
            mine.push(dst);
            rest = tail;
            base = off + len;
        }
        dests.push(mine);
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = parts
            .iter()
            .zip(dests)
            .map(|(part, slices)| {
                scope.spawn(move || -> Result<u64> {
                    let want: u64 = part.iter().map(|r| r.1).sum();
                    let mut s = open(part)?;
                    if s.len != want {
                        return Err(Error::transport(
                            NAME,
                            format!("source announced {} bytes, {want} requested", s.len),
                        ));
                    }
                    for dst in slices {
                        for piece in dst.chunks_mut(CHUNK) {
                            s.stream.read_exact(piece).map_err(|e| {
                                Error::transport(NAME, format!("stream broke mid-transfer: {e}"))
                            })?;
                            progress.fetch_add(piece.len() as u64, Ordering::Relaxed);
                        }
                    }
                    Ok(want)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_split_evenly_and_cover_everything() {
        let ranges = [(0, 1 << 20), (2 << 20, 3 << 20)];
        let parts = split_ranges(&ranges, 4);
        assert_eq!(parts.len(), 4);
        let flat: Vec<_> = parts.iter().flatten().copied().collect();
        assert_eq!(flat.iter().map(|r| r.1).sum::<u64>(), 4 << 20);
        for p in &parts {
            assert_eq!(p.iter().map(|r| r.1).sum::<u64>(), 1 << 20);
        }
        for w in flat.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0);
        }
        // small transfers use fewer streams
        assert_eq!(split_ranges(&[(0, 1000)], 4).len(), 1);
        assert!(split_ranges(&[], 4).is_empty());
    }

    #[test]
    fn pull_requests_are_checked_against_the_arena() {
        let req = |ranges| PullReq {
            model: refit_runtime::ModelId::new("m").unwrap(),
            version: refit_runtime::Version(1),
            ranges,
        };
        assert_eq!(check_ranges(&req(vec![(0, 10), (10, 5)]), 15), Ok(15));
        assert!(check_ranges(&req(vec![(0, 10), (5, 5)]), 15).is_err());
        assert!(check_ranges(&req(vec![(10, 10)]), 15).is_err());
        assert!(check_ranges(&req(vec![(u64::MAX, 2)]), 15).is_err());
    }
}
