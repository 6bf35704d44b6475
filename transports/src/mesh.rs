//! Many senders to many receivers over TCP: each trainer shard publishes the part of a
//! version it holds, with no gather, and each engine pulls the part it serves straight from
//! every shard holding a piece of it, all shards at once.
//!
//! - A [`MeshSender`] runs on a [node](refit_node) and serves its parts of the tensors (a
//!   [`Part`] each: whole, a slice along a dimension, a flat range) for the newest versions
//!   it published ([`MeshSender::publish`]).
//! - A [`MeshReceiver`] is told every sender's endpoint and parts and what it wants. At
//!   construction it plans its pieces with [`MeshPlan`] (checked whole: a gap, an overlap or
//!   a slice that does not divide is refused, naming the tensor and the elements), and
//!   replays that plan for every version: [`MeshReceiver::pull`] opens one stream per
//!   sender that holds a piece it needs, in parallel, and reads the pieces straight into its
//!   own parts.
//! - A version is pulled only once every sender holding a piece of it published it (a sender
//!   asked for a version it has not published yet waits for it, up to the pull's deadline),
//!   and it is handed out only whole: every stream ends with the xxh3 of the bytes it
//!   carried, hashed by the sender as it writes them and by the receiver as they land; a
//!   stream that breaks, a sender that no longer keeps the version, or a checksum that
//!   differs fails the pull naming the sender, and nothing of the version is returned.
//!
//! Each byte crosses the wire once per receiver that wants it, and only to a receiver that
//! wants it: engines that each serve a tensor-parallel slice get that slice alone.

use std::collections::VecDeque;
use std::io::Read;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use refit_node::{ClusterToken, Node, StreamHead, open_stream, write_head};
pub use refit_runtime::mesh::{MeshPlan, Part, Parts, Piece};
use refit_runtime::{Error, Manifest, Mismatch, ModelId, Result, Version, WeightSet, wire};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use uuid::Uuid;

const NAME: &str = "mesh";
/// The stream method a sender serves pulls under.
const PULL: &str = "mesh.pull";
/// Versions a sender keeps for receivers still pulling them.
const KEEP: usize = 2;
/// Bytes per socket read and write.
const CHUNK: usize = 256 << 10;

/// Where a mesh sender is: its node's address and its id on that node (no secret).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshEndpoint {
    /// The sender's node.
    pub addr: SocketAddr,
    /// The sender on that node.
    pub agent: Uuid,
}

/// Pieces of one part of a sender, `count` of them, each `len` bytes, the first at
/// `offset` and each next one `stride` bytes further: the pieces of a slice (a column
/// slice of a row-major tensor is one piece per row) go in a few of these, so a request
/// stays small whatever the model's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Run {
    part: u32,
    offset: u64,
    len: u64,
    stride: u64,
    count: u64,
}

impl Run {
    /// The runs of `pieces` (`(part, offset, bytes)` each, in order): consecutive pieces of
    /// one part and one length, evenly spaced, are one run.
    fn of(pieces: &[(u32, u64, u64)]) -> Vec<Run> {
        let mut runs: Vec<Run> = Vec::new();
        for &(part, offset, len) in pieces {
            if let Some(r) = runs.last_mut()
                && r.part == part
                && r.len == len
                && match r.count {
                    1 => offset > r.offset,
                    _ => Some(offset) == r.offset.checked_add(r.stride * r.count),
                }
            {
                if r.count == 1 {
                    r.stride = offset - r.offset;
                }
                r.count += 1;
                continue;
            }
            runs.push(Run {
                part,
                offset,
                len,
                stride: len,
                count: 1,
            });
        }
        runs
    }

    /// The byte ranges of this run in a part of `held` bytes, in order; `None` when one
    /// falls outside it.
    fn ranges(self, held: usize) -> Option<impl Iterator<Item = std::ops::Range<usize>>> {
        let (offset, len, stride, count) = (
            usize::try_from(self.offset).ok()?,
            usize::try_from(self.len).ok()?,
            usize::try_from(self.stride).ok()?,
            usize::try_from(self.count).ok()?,
        );
        let last = offset.checked_add(stride.checked_mul(count.checked_sub(1)?)?)?;
        (len > 0 && last.checked_add(len)? <= held)
            .then(|| (0..count).map(move |i| offset + i * stride..offset + i * stride + len))
    }
}

/// The request of one pull stream: these pieces of this version, in order.
#[derive(Debug, Serialize, Deserialize)]
struct Pull {
    version: Version,
    /// The pieces, as runs of the sender's parts (a part is its index in the sender's
    /// parts).
    pieces: Vec<Run>,
    /// How long the sender may wait for the version to be published.
    wait: Duration,
}

/// One version of a sender's parts.
#[derive(Debug)]
struct Held {
    version: Version,
    parts: Vec<Arc<[u8]>>,
}

#[derive(Debug)]
struct Shared {
    /// Byte length of each part.
    lens: Vec<usize>,
    held: Mutex<VecDeque<Held>>,
    published: tokio::sync::watch::Sender<Version>,
}

impl Shared {
    fn find(&self, version: Version) -> Option<Vec<Arc<[u8]>>> {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.iter()
            .find(|h| h.version == version)
            .map(|h| h.parts.clone())
    }
}

/// A trainer shard's end: serves its parts of each version it publishes.
#[derive(Debug)]
pub struct MeshSender {
    node: Node,
    model: ModelId,
    agent: Uuid,
    parts: Parts,
    shared: Arc<Shared>,
}

impl MeshSender {
    /// A sender on `node` holding `parts` of the tensors of `manifest`, the layout of
    /// `model` (each part checked against it: a name, a slice or a range that does not fit
    /// is refused).
    ///
    /// # Errors
    /// [`Error::Mesh`] naming the tensor.
    pub fn on_node(node: &Node, model: ModelId, manifest: &Manifest, parts: Parts) -> Result<Self> {
        let lens = parts
            .iter()
            .map(|(name, part)| refit_runtime::mesh::part_bytes(manifest, name, part))
            .collect::<Result<Vec<_>>>()?;
        let (published, _) = tokio::sync::watch::channel(Version::ZERO);
        let shared = Arc::new(Shared {
            lens,
            held: Mutex::new(VecDeque::new()),
            published,
        });
        let agent = Uuid::new_v4();
        let s = Arc::clone(&shared);
        node.register_stream(agent, PULL, move |_, bytes, stream| {
            let s = Arc::clone(&s);
            Box::pin(async move {
                let req: Pull = wire::decode(&bytes, wire::MAX_CONTROL_MESSAGE)?;
                Ok(serve(stream, &s, req).await?)
            })
        });
        Ok(Self {
            node: node.clone(),
            model,
            agent,
            parts,
            shared,
        })
    }

    /// Where receivers find this sender.
    pub fn endpoint(&self) -> MeshEndpoint {
        MeshEndpoint {
            addr: self.node.advertised(),
            agent: self.agent,
        }
    }

    /// The parts this sender holds.
    pub fn parts(&self) -> &Parts {
        &self.parts
    }

    /// Publishes `version` of this sender's parts: `data` holds one buffer per part, in the
    /// order of [`MeshSender::parts`], each the part's bytes in its row-major layout. The
    /// newest versions are kept for receivers still pulling them.
    ///
    /// # Errors
    /// [`Error::Tensor`] naming the tensor when a part has no buffer, or a buffer is not
    /// its part's length (or has no part); [`Error::StaleVersion`] when `version` is not
    /// newer than the last one published. Nothing is published then.
    pub fn publish(&self, version: Version, data: Vec<Arc<[u8]>>) -> Result<()> {
        let refused = |name: &str, problem| Error::tensor(&self.model, name, problem);
        if let Some((name, _)) = self.parts.get(data.len()) {
            return Err(refused(name, Mismatch::Missing));
        }
        if data.len() > self.parts.len() {
            return Err(refused(
                &format!("<buffer {}>", self.parts.len()),
                Mismatch::Unexpected,
            ));
        }
        for ((d, &expected), (name, _)) in data.iter().zip(&self.shared.lens).zip(&self.parts) {
            if d.len() != expected {
                let found = d.len();
                return Err(refused(name, Mismatch::Size { expected, found }));
            }
        }
        let mut held = self.shared.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(last) = held.back()
            && last.version >= version
        {
            return Err(Error::StaleVersion {
                model: self.model.clone(),
                offered: version,
                current: last.version,
            });
        }
        held.push_back(Held {
            version,
            parts: data,
        });
        while held.len() > KEEP {
            held.pop_front();
        }
        drop(held);
        self.shared.published.send_replace(version);
        Ok(())
    }
}

impl Drop for MeshSender {
    fn drop(&mut self) {
        self.node.unregister(self.agent);
    }
}

/// Serves one pull: waits (up to the request's wait) for the version, then writes each
/// piece, then the xxh3 of every byte written.
async fn serve(mut stream: tokio::net::TcpStream, s: &Shared, req: Pull) -> Result<()> {
    let parts = match held_when_published(s, req.version, req.wait).await {
        Ok(p) => p,
        Err(reason) => return Ok(write_head(&mut stream, &StreamHead::Err { reason }).await?),
    };
    // every run checked before a byte goes: inside its part, and no more bytes in all than
    // the parts hold (each wanted byte is asked for once)
    let held: u64 = parts.iter().map(|p| p.len() as u64).sum();
    let mut total = 0u64;
    for r in &req.pieces {
        let inside = parts.get(r.part as usize).and_then(|p| r.ranges(p.len()));
        let bytes = r.len.checked_mul(r.count);
        total = match (inside, bytes) {
            (Some(_), Some(b)) => total.saturating_add(b),
            _ => {
                let reason = format!(
                    "pieces {}+{} (every {} bytes, {} of them) of part {} are not held here",
                    r.offset, r.len, r.stride, r.count, r.part
                );
                return Ok(write_head(&mut stream, &StreamHead::Err { reason }).await?);
            }
        };
    }
    if total > held {
        let reason = format!("{total} bytes asked of a sender holding {held}");
        return Ok(write_head(&mut stream, &StreamHead::Err { reason }).await?);
    }
    write_head(&mut stream, &StreamHead::Ok { len: total + 8 }).await?;
    let io = |e| Error::io("serving a mesh pull", e);
    let mut hasher = refit_runtime::hash::Xxh3::new();
    // small pieces (a column slice of a row-major tensor is one piece per row) are
    // gathered into writes of up to CHUNK bytes; a chunk of CHUNK goes straight out
    let mut stream = tokio::io::BufWriter::with_capacity(CHUNK, stream);
    for r in &req.pieces {
        let part = &parts[r.part as usize];
        for range in r.ranges(part.len()).into_iter().flatten() {
            for chunk in part[range].chunks(CHUNK) {
                hasher.update(chunk);
                stream.write_all(chunk).await.map_err(io)?;
            }
        }
    }
    stream
        .write_all(&hasher.digest().to_le_bytes())
        .await
        .map_err(io)?;
    stream.flush().await.map_err(io)
}

/// The parts of `version` once published (waiting up to `wait`); why not otherwise.
async fn held_when_published(
    s: &Shared,
    version: Version,
    wait: Duration,
) -> std::result::Result<Vec<Arc<[u8]>>, String> {
    let mut published = s.published.subscribe();
    let waited = tokio::time::timeout(wait, published.wait_for(|&v| v >= version)).await;
    match waited {
        Err(_) => Err(format!(
            "version {version} was not published within {wait:?}"
        )),
        Ok(Err(_)) => Err("the sender is gone".into()),
        Ok(Ok(_)) => s.find(version).ok_or_else(|| {
            format!("version {version} is no longer kept (a newer one replaced it)")
        }),
    }
}

/// What a receiver pulls from one sender each version.
#[derive(Debug)]
struct Stream {
    /// The sender (its index in the senders given).
    sender: usize,
    /// The pull request's pieces: `(part, offset, bytes)` in the sender's parts.
    pieces: Vec<(u32, u64, u64)>,
    /// The same as runs, what each pull sends ([`Run::of`]).
    request: Vec<Run>,
    /// Where each piece lands: `(part, offset)` in the receiver's parts.
    lands: Vec<(usize, usize)>,
}

/// One version of a receiver's parts, pulled whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    /// The version.
    pub version: Version,
    /// One buffer per wanted part, in the order of the receiver's wants, each the part's
    /// bytes in its row-major layout.
    pub parts: Vec<Vec<u8>>,
}

/// An engine's end: pulls the parts it wants of each version from every sender holding a
/// piece of them.
#[derive(Debug)]
pub struct MeshReceiver {
    token: ClusterToken,
    senders: Vec<MeshEndpoint>,
    /// One stream per sender holding a piece this receiver wants.
    streams: Vec<Stream>,
    lens: Vec<usize>,
    /// What this receiver wants, as given.
    wants: Parts,
    /// Every piece by where it lands ([`landing_order`]), sorted once.
    landing: Vec<Landing>,
    pulled: u64,
    /// Buffers of a version handed back ([`MeshReceiver::recycle`]) or of a failed pull,
    /// which the next pull reads into: memory already touched, so a steady pull pays no
    /// page faults (a fresh buffer of the model's size costs more than the transfer).
    spare: Option<Vec<Vec<u8>>>,
}

impl MeshReceiver {
    /// A receiver of `wants` (parts of the tensors of `manifest`) from `senders`, each
    /// with the parts it holds. Plans the pieces once ([`MeshPlan::compute`]).
    ///
    /// # Errors
    /// [`Error::Mesh`] naming the tensor: a want that does not fit the manifest, or senders
    /// whose parts leave a gap or overlap in a wanted tensor.
    pub fn new(
        manifest: &Manifest,
        senders: Vec<(MeshEndpoint, Parts)>,
        wants: Parts,
        token: ClusterToken,
    ) -> Result<Self> {
        let held: Vec<Parts> = senders.iter().map(|(_, p)| p.clone()).collect();
        let plan = MeshPlan::compute(manifest, &held, std::slice::from_ref(&wants))?;
        let lens = wants
            .iter()
            .map(|(name, part)| refit_runtime::mesh::part_bytes(manifest, name, part))
            .collect::<Result<Vec<_>>>()?;
        let index_of = |parts: &Parts, tensor: usize| {
            let name = &manifest.tensors()[tensor].name;
            parts.iter().position(|(n, _)| n == name)
        };
        let mut streams: Vec<Stream> = (0..senders.len())
            .map(|sender| Stream {
                sender,
                pieces: Vec::new(),
                request: Vec::new(),
                lands: Vec::new(),
            })
            .collect();
        for p in plan.receivers.into_iter().flatten() {
            let (Some(src), Some(dst)) = (
                index_of(&held[p.sender], p.tensor),
                index_of(&wants, p.tensor),
            ) else {
                return Err(Error::State("a planned piece outside both ends' parts"));
            };
            let s = &mut streams[p.sender];
            s.pieces.push((src as u32, p.src as u64, p.len as u64));
            s.lands.push((dst, p.dst));
        }
        streams.retain(|s| !s.pieces.is_empty());
        for s in &mut streams {
            s.request = Run::of(&s.pieces);
        }
        let landing = landing_order(&streams)?;
        Ok(Self {
            token,
            senders: senders.into_iter().map(|(e, _)| e).collect(),
            streams,
            lens,
            wants,
            landing,
            pulled: 0,
            spare: None,
        })
    }

    /// Bytes each pull reads (the wanted parts, plus 8 bytes of checksum per sender).
    pub fn bytes_per_pull(&self) -> u64 {
        self.streams
            .iter()
            .map(|s| s.pieces.iter().map(|p| p.2).sum::<u64>() + 8)
            .sum()
    }

    /// Bytes of each wanted part, in the order of the wants.
    pub fn part_lens(&self) -> &[usize] {
        &self.lens
    }

    /// Bytes pulled so far.
    pub fn bytes_pulled(&self) -> u64 {
        self.pulled
    }

    /// Hands back the buffers of a version no longer needed: the next pull reads into them
    /// instead of into new memory. Buffers of another receiver's layout are dropped.
    pub fn recycle(&mut self, pulled: Pulled) {
        let fits = pulled.parts.len() == self.lens.len()
            && pulled
                .parts
                .iter()
                .zip(&self.lens)
                .all(|(p, &n)| p.len() == n);
        if fits {
            self.spare = Some(pulled.parts);
        }
    }

    /// Pulls `version` of the wanted parts from every sender holding a piece of them, in
    /// parallel, within `timeout`: each sender's publish and every byte of the version
    /// (a sender that has not published waits for it, up to the deadline). The parts
    /// land in the buffers last handed to [`MeshReceiver::recycle`], else in new ones;
    /// every byte of them is overwritten (the plan covers each wanted byte once).
    ///
    /// # Errors
    /// [`Error::Transport`] naming the sender: it cannot be reached, it refused (the
    /// version not published in time, or no longer kept), its stream broke or did not
    /// finish by the deadline, or the bytes it sent do not hash to the checksum it sent.
    /// Nothing of the version is returned then.
    ///
    /// # Cancel safety
    /// Not async; a pull that fails keeps its buffers for the next one.
    pub fn pull(&mut self, version: Version, timeout: Duration) -> Result<Pulled> {
        let deadline = Instant::now() + timeout;
        let mut parts = self
            .spare
            .take()
            .unwrap_or_else(|| self.lens.iter().map(|&n| vec![0u8; n]).collect());
        let mut views: Vec<&mut [u8]> = parts.iter_mut().map(Vec::as_mut_slice).collect();
        let landed = self.pull_into(&mut views, version, deadline);
        match landed {
            Ok(total) => {
                self.pulled += total;
                Ok(Pulled { version, parts })
            }
            Err(e) => {
                self.spare = Some(parts);
                Err(e)
            }
        }
    }

    /// Pulls `version` of the wanted parts straight into `parts`: one buffer per want, in
    /// the order of the wants, each the part's length (the caller's memory, reused from
    /// version to version: no buffer of this receiver's is involved).
    ///
    /// # Errors
    /// As [`MeshReceiver::pull`]; [`Error::Mesh`] naming the tensor when a buffer is
    /// missing, extra, or not its part's length (nothing is pulled then).
    ///
    /// # Cancel safety
    /// Not async; on failure the buffers hold a mix of versions.
    pub fn pull_to(
        &mut self,
        parts: &mut [&mut [u8]],
        version: Version,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        if parts.len() != self.wants.len() {
            let tensor = match self.wants.get(parts.len()) {
                Some((name, _)) => name.clone(),
                None => format!("<buffer {}>", self.wants.len()),
            };
            let reason = format!(
                "{} buffers for {} wanted parts",
                parts.len(),
                self.wants.len()
            );
            return Err(Error::Mesh { tensor, reason });
        }
        for ((p, &len), (name, _)) in parts.iter().zip(&self.lens).zip(&self.wants) {
            if p.len() != len {
                return Err(Error::Mesh {
                    tensor: name.clone(),
                    reason: format!("a buffer of {} bytes for a part of {len}", p.len()),
                });
            }
        }
        self.pulled += self.pull_into(parts, version, deadline)?;
        Ok(())
    }

    /// Pulls `version` of the whole model into `weights`, each tensor straight into its
    /// place in the arena: the receiver must want every tensor of `weights`' manifest
    /// whole ([`wholes`](refit_runtime::mesh::wholes)). On success `weights` carries
    /// `version`; on failure its bytes are a mix of versions and must not be served.
    ///
    /// # Errors
    /// As [`MeshReceiver::pull`]; [`Error::Mesh`] when the receiver's wants are not the
    /// whole of `weights`' tensors; a shared arena ([`WeightSet::bytes_mut`]).
    ///
    /// # Cancel safety
    /// Not async.
    pub fn pull_weights(
        &mut self,
        weights: &mut WeightSet,
        version: Version,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let manifest = Arc::clone(weights.manifest());
        let not_whole = |tensor: String, reason: &str| Error::Mesh {
            tensor,
            reason: format!("pulled into a weight set, {reason}"),
        };
        // each wanted part's byte range in the arena, in the order of the wants
        let mut ranges = Vec::with_capacity(self.wants.len());
        for (name, part) in &self.wants {
            let spec = manifest.get(name).filter(|_| *part == Part::Whole);
            let spec = spec.ok_or_else(|| not_whole(name.clone(), "it must be wanted whole"))?;
            ranges.push(spec.range());
        }
        if let Some(t) = manifest
            .tensors()
            .iter()
            .find(|t| !self.wants.iter().any(|(n, _)| *n == t.name))
        {
            return Err(not_whole(t.name.clone(), "every tensor must be wanted"));
        }
        let mut views = split_ranges(weights.bytes_mut()?, &ranges)?;
        let total = self.pull_into(&mut views, version, deadline)?;
        self.pulled += total;
        weights.set_version(version);
        Ok(())
    }

    /// Pulls every stream of `version` into `parts` in parallel: the bytes read.
    fn pull_into(
        &self,
        parts: &mut [&mut [u8]],
        version: Version,
        deadline: Instant,
    ) -> Result<u64> {
        let dests = destinations(parts, &self.streams, &self.landing)?;
        let results: Vec<Result<u64>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .streams
                .iter()
                .zip(dests)
                .map(
                    |(
                        Stream {
                            sender, request, ..
                        },
                        dst,
                    )| {
                        let (addr, agent) =
                            (self.senders[*sender].addr, self.senders[*sender].agent);
                        let token = &self.token;
                        scope.spawn(move || {
                            pull_one(addr, agent, token, version, request, dst, deadline)
                        })
                    },
                )
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::State("a mesh pull thread panicked")))
                })
                .collect()
        });
        results.into_iter().sum()
    }
}

/// Disjoint slices of `arena`, one per range, in the order of `ranges`.
fn split_ranges<'a>(
    arena: &'a mut [u8],
    ranges: &[std::ops::Range<usize>],
) -> Result<Vec<&'a mut [u8]>> {
    let overlap = || Error::State("tensors of a manifest overlap in its arena");
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_unstable_by_key(|&i| ranges[i].start);
    let mut slots: Vec<Option<&'a mut [u8]>> = (0..ranges.len()).map(|_| None).collect();
    let (mut at, mut rest) = (0usize, arena);
    for i in order {
        let r = &ranges[i];
        let skip = r.start.checked_sub(at).ok_or_else(overlap)?;
        let (_, tail) = rest.split_at_mut_checked(skip).ok_or_else(overlap)?;
        let (piece, tail) = tail.split_at_mut_checked(r.len()).ok_or_else(overlap)?;
        slots[i] = Some(piece);
        (at, rest) = (r.end, tail);
    }
    slots.into_iter().map(|s| s.ok_or_else(overlap)).collect()
}

/// One piece by where it lands: `(part, offset, bytes, stream, piece)`.
type Landing = (usize, usize, usize, usize, usize);

fn outside() -> Error {
    Error::State("a mesh piece outside its part, or overlapping another")
}

/// Every piece of `streams`, in the order they lie in the receiver's parts (made once per
/// receiver, replayed by every pull).
fn landing_order(streams: &[Stream]) -> Result<Vec<Landing>> {
    let mut order = Vec::new();
    for (si, st) in streams.iter().enumerate() {
        for (pi, (&(_, _, len), &(part, dst))) in st.pieces.iter().zip(&st.lands).enumerate() {
            let len = usize::try_from(len).map_err(|_| outside())?;
            order.push((part, dst, len, si, pi));
        }
    }
    order.sort_unstable();
    Ok(order)
}

/// Where each stream's pieces land: per stream, in its pieces' order, the slice of the
/// receiver's parts each fills (the plan gives every wanted byte one piece, so the slices
/// are disjoint and the streams fill them straight from their sockets, in parallel).
/// `order` is [`landing_order`]'s.
fn destinations<'a>(
    parts: &'a mut [&mut [u8]],
    streams: &[Stream],
    order: &[Landing],
) -> Result<Vec<Vec<&'a mut [u8]>>> {
    let mut slots: Vec<Vec<Option<&mut [u8]>>> = streams
        .iter()
        .map(|st| st.pieces.iter().map(|_| None).collect())
        .collect();
    let mut rests: Vec<(usize, &mut [u8])> = parts.iter_mut().map(|p| (0, &mut **p)).collect();
    for &(part, dst, len, si, pi) in order {
        let (at, rest) = rests.get_mut(part).ok_or_else(outside)?;
        let skip = dst.checked_sub(*at).ok_or_else(outside)?;
        let (_, tail) = std::mem::take(rest)
            .split_at_mut_checked(skip)
            .ok_or_else(outside)?;
        let (piece, tail) = tail.split_at_mut_checked(len).ok_or_else(outside)?;
        (*at, *rest) = (dst + len, tail);
        slots[si][pi] = Some(piece);
    }
    slots
        .into_iter()
        .map(|s| s.into_iter().map(|d| d.ok_or_else(outside)).collect())
        .collect()
}

/// Most buffers one vectored read is given (Linux's `IOV_MAX`).
const MAX_IOV: usize = 1024;

/// Fills every buffer of `group`, in order, from `stream` with vectored reads.
fn read_vectored_exact(stream: &mut impl Read, group: &mut [&mut [u8]]) -> std::io::Result<()> {
    let mut iov: Vec<std::io::IoSliceMut<'_>> = group
        .iter_mut()
        .map(|c| std::io::IoSliceMut::new(c))
        .collect();
    let mut left: &mut [std::io::IoSliceMut<'_>] = &mut iov;
    std::io::IoSliceMut::advance_slices(&mut left, 0);
    while !left.is_empty() {
        match stream.read_vectored(left) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => std::io::IoSliceMut::advance_slices(&mut left, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One stream: the pieces `request` names, of `version`, from the sender at `addr`, checked against the
/// checksum it ends with.
fn pull_one(
    addr: SocketAddr,
    agent: Uuid,
    token: &ClusterToken,
    version: Version,
    request: &[Run],
    dst: Vec<&mut [u8]>,
    deadline: Instant,
) -> Result<u64> {
    let named = |what: String| Error::transport(NAME, format!("sender at {addr}: {what}"));
    let left = deadline.saturating_duration_since(Instant::now());
    let req = Pull {
        version,
        pieces: request.to_vec(),
        wait: left,
    };
    let mut s = open_stream(
        addr,
        token,
        Uuid::new_v4(),
        agent,
        PULL,
        &req,
        left + Duration::from_secs(5),
    )
    .map_err(|e| named(e.to_string()))?;
    let want: u64 = request.iter().map(|r| r.len * r.count).sum();
    if s.len != want + 8 {
        return Err(named(format!(
            "announced {} bytes, {} asked",
            s.len,
            want + 8
        )));
    }
    let mut hasher = refit_runtime::hash::Xxh3::new();
    let mut chunks = dst.into_iter().flat_map(|p| p.chunks_mut(CHUNK)).peekable();
    let mut group: Vec<&mut [u8]> = Vec::new();
    while chunks.peek().is_some() {
        // up to CHUNK bytes of pieces, read in one vectored read where the socket has them
        // (a column slice of a row-major tensor is one small piece per row): the bytes land
        // straight in their parts, and are hashed while in cache
        let mut bytes = 0;
        while let Some(c) = chunks.next_if(|_| bytes < CHUNK && group.len() < MAX_IOV) {
            bytes += c.len();
            group.push(c);
        }
        // the pull's deadline holds for the bytes too, not only for the sender's publish
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(named(format!(
                "version {version}: not pulled whole within the pull's deadline"
            )));
        }
        s.stream
            .set_read_timeout(Some(left))
            .map_err(|e| named(e.to_string()))?;
        read_vectored_exact(&mut s.stream, &mut group)
            .map_err(|e| named(format!("stream broke mid-transfer: {e}")))?;
        for c in group.drain(..) {
            hasher.update(c);
        }
    }
    let mut sum = [0u8; 8];
    s.stream
        .read_exact(&mut sum)
        .map_err(|e| named(format!("stream broke before its checksum: {e}")))?;
    if u64::from_le_bytes(sum) != hasher.digest() {
        return Err(named(format!(
            "version {version}: the bytes do not hash to the checksum the sender sent"
        )));
    }
    Ok(want + 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(runs: &[Run], held: usize) -> Vec<(u32, u64, u64)> {
        runs.iter()
            .flat_map(|r| {
                let part = r.part;
                r.ranges(held)
                    .unwrap()
                    .map(move |x| (part, x.start as u64, x.len() as u64))
            })
            .collect()
    }

    #[test]
    fn evenly_spaced_pieces_go_as_one_run_and_come_back_the_same() {
        // a column slice: one 16-byte piece per row of 64 bytes, rows 0..1000
        let mut pieces: Vec<(u32, u64, u64)> = (0..1000).map(|r| (0, r * 64 + 16, 16)).collect();
        // then a whole part, then two pieces of another length, then a gap in the spacing
        pieces.extend([(1, 0, 4096), (2, 0, 8), (2, 8, 8), (2, 100, 8)]);
        let runs = Run::of(&pieces);
        assert_eq!(runs.len(), 4, "{runs:?}");
        assert_eq!((runs[0].count, runs[0].stride), (1000, 64));
        assert_eq!((runs[2].count, runs[2].stride), (2, 8));
        assert_eq!(expand(&runs, 64_000), pieces);
        // whatever falls outside the part it names is refused, and so are empty runs
        let r = runs[0];
        assert!(r.ranges(999 * 64 + 31).is_none());
        assert!(r.ranges(999 * 64 + 32).is_some());
        assert!(Run { len: 0, ..r }.ranges(usize::MAX).is_none());
        assert!(Run { count: 0, ..r }.ranges(usize::MAX).is_none());
        assert!(
            Run {
                stride: u64::MAX,
                ..r
            }
            .ranges(usize::MAX)
            .is_none()
        );
    }
}
