//! A transfer applied as it arrives (a [`streaming`](super::TcpReceiver::streaming)
//! receiver's `stream_next`):
//! each tensor is put together in a buffer of its own from the bytes of the buckets that
//! hold it, handed over once every one of those buckets is verified, and let go of by the
//! receiver then. Nothing of the version stays behind, so a receive holds a few buckets'
//! worth of tensors at a time (those of the buckets in flight, and those waiting for or in
//! the caller's apply; at least the largest tensor), not the model.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use refit_runtime::{Error, Manifest, ModelId, Result, Version, WeightSet};

use super::NAME;
use super::data::Sink;

/// Tensors a stream may hand over before the caller took the first of them: the pull
/// threads go on meanwhile, and wait once this many are queued.
pub(crate) const QUEUE: usize = 2;

/// What a streaming transfer's sink shares with the caller's side.
#[derive(Debug, Default)]
pub(crate) struct Handover {
    /// Bytes of tensors put together and not yet applied by the caller (who takes its
    /// tensors' bytes off once applied).
    pub(crate) held: AtomicU64,
    /// The caller stopped taking tensors: the transfer ends at its next bytes.
    pub(crate) stopped: AtomicBool,
}

impl Handover {
    /// The caller applied a tensor of `len` bytes: they are no longer held.
    pub(crate) fn applied(&self, len: usize) {
        self.held.fetch_sub(len as u64, Ordering::Relaxed);
    }
}

/// One tensor being put together.
struct Partial {
    /// The tensor's own weight set (`None` once handed over).
    one: Option<WeightSet>,
    /// Its bytes verified so far.
    verified: usize,
}

/// The sink of one streaming transfer (see the module doc).
pub(crate) struct StreamSink {
    model: ModelId,
    version: Version,
    manifest: Arc<Manifest>,
    partial: Mutex<BTreeMap<usize, Arc<Mutex<Partial>>>>,
    out: SyncSender<WeightSet>,
    /// Tensors handed over so far.
    handed: AtomicU64,
    handover: Arc<Handover>,
    /// The most [`Handover::held`] was, over this receiver's streaming transfers.
    peak: Arc<AtomicU64>,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StreamSink {
    /// The sink of `version` of `model` (laid out as `manifest`), handing each tensor to
    /// `out` once verified; `peak` keeps the most bytes held at once.
    pub(crate) fn new(
        model: &ModelId,
        version: Version,
        manifest: &Arc<Manifest>,
        out: SyncSender<WeightSet>,
        handover: &Arc<Handover>,
        peak: &Arc<AtomicU64>,
    ) -> Self {
        Self {
            model: model.clone(),
            version,
            manifest: Arc::clone(manifest),
            partial: Mutex::new(BTreeMap::new()),
            out,
            handed: AtomicU64::new(0),
            handover: Arc::clone(handover),
            peak: Arc::clone(peak),
        }
    }

    fn stopped(&self) -> Result<()> {
        if self.handover.stopped.load(Ordering::Relaxed) {
            return Err(Error::transport(
                NAME,
                "the streaming apply stopped taking tensors",
            ));
        }
        Ok(())
    }

    /// The tensors (by manifest index) holding some of the arena's bytes `range`, with the
    /// part of `range` each holds.
    fn overlapping(&self, range: Range<usize>) -> impl Iterator<Item = (usize, Range<usize>)> {
        let tensors = self.manifest.tensors();
        let first = tensors.partition_point(|t| t.offset + t.len <= range.start);
        tensors
            .iter()
            .enumerate()
            .skip(first)
            .take_while(move |(_, t)| t.offset < range.end)
            .filter_map(move |(i, t)| {
                let (start, end) = (range.start.max(t.offset), range.end.min(t.offset + t.len));
                (start < end).then_some((i, start..end))
            })
    }

    /// Tensor `index`'s buffer, made at its first bytes.
    fn buffer(&self, index: usize) -> Result<Arc<Mutex<Partial>>> {
        let mut partial = locked(&self.partial);
        if let Some(p) = partial.get(&index) {
            return Ok(Arc::clone(p));
        }
        let spec = self
            .manifest
            .tensors()
            .get(index)
            .ok_or(Error::State("a streamed tensor past the manifest"))?;
        let one = WeightSet::single(self.model.clone(), self.version, spec)?;
        let held = self
            .handover
            .held
            .fetch_add(spec.len as u64, Ordering::Relaxed)
            + spec.len as u64;
        self.peak.fetch_max(held, Ordering::Relaxed);
        let p = Arc::new(Mutex::new(Partial {
            one: Some(one),
            verified: 0,
        }));
        partial.insert(index, Arc::clone(&p));
        Ok(p)
    }

    /// Tensors handed over so far.
    pub(crate) fn handed(&self) -> u64 {
        self.handed.load(Ordering::Relaxed)
    }

    /// Drops the tensors put together so far (none handed over), for a transfer that
    /// starts again from another source.
    pub(crate) fn reset(&self) {
        let dropped = std::mem::take(&mut *locked(&self.partial));
        for index in dropped.keys() {
            let len = self.manifest.tensors().get(*index).map_or(0, |t| t.len);
            self.handover.applied(len);
        }
    }

    /// Every tensor was handed over: the transfer is whole.
    pub(crate) fn check_done(&self) -> Result<()> {
        let with_bytes = self.manifest.tensors().iter().filter(|t| t.len > 0).count();
        match locked(&self.partial).keys().next() {
            None if self.handed() == with_bytes as u64 => Ok(()),
            None => Err(Error::transport(
                NAME,
                format!(
                    "the transfer of `{}` v{} handed over {} of its {with_bytes} tensors",
                    self.model,
                    self.version,
                    self.handed()
                ),
            )),
            Some(&i) => Err(Error::transport(
                NAME,
                format!(
                    "the transfer of `{}` v{} ended with tensor `{}` incomplete",
                    self.model,
                    self.version,
                    self.manifest
                        .tensors()
                        .get(i)
                        .map_or("?", |t| t.name.as_str())
                ),
            )),
        }
    }
}

impl Sink for StreamSink {
    fn write_at(&self, at: usize, bytes: &[u8]) -> Result<()> {
        self.stopped()?;
        for (index, part) in self.overlapping(at..at + bytes.len()) {
            let p = self.buffer(index)?;
            let mut p = locked(&p);
            let offset = self.manifest.tensors().get(index).map_or(0, |t| t.offset);
            let dst = p
                .one
                .as_mut()
                .ok_or(Error::State("bytes for a tensor already handed over"))?
                .bytes_mut()?
                .get_mut(part.start - offset..part.end - offset)
                .ok_or(Error::State("a streamed piece past its tensor"))?;
            dst.copy_from_slice(
                bytes
                    .get(part.start - at..part.end - at)
                    .unwrap_or_default(),
            );
        }
        Ok(())
    }

    fn verified(&self, range: Range<usize>) -> Result<()> {
        self.stopped()?;
        for (index, part) in self.overlapping(range) {
            let p = locked(&self.partial)
                .get(&index)
                .cloned()
                .ok_or(Error::State(
                    "a verified bucket with a tensor never written",
                ))?;
            let len = self.manifest.tensors().get(index).map_or(0, |t| t.len);
            let done = {
                let mut p = locked(&p);
                p.verified += part.len();
                if p.verified >= len {
                    p.one.take()
                } else {
                    None
                }
            };
            let Some(one) = done else { continue };
            locked(&self.partial).remove(&index);
            // waits while the caller is behind: the pull slows down, memory stays bounded
            self.out.send(one).map_err(|_| {
                Error::transport(NAME, "the streaming apply stopped taking tensors")
            })?;
            self.handed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<Arc<dyn refit_runtime::SharedBytes>> {
        Err(Error::State(
            "a streaming transfer keeps no copy of the version",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use refit_runtime::DType;

    fn manifest() -> Arc<Manifest> {
        let mut b = Manifest::builder();
        b.push("a", DType::U8, &[64]);
        b.push("b", DType::U8, &[192]);
        b.push("c", DType::U8, &[64]);
        Arc::new(b.build().unwrap())
    }

    #[test]
    fn tensors_are_handed_over_whole_once_every_byte_is_verified() {
        let m = manifest();
        let (tx, rx) = std::sync::mpsc::sync_channel(8);
        let peak = Arc::new(AtomicU64::new(0));
        let model = ModelId::new("m").unwrap();
        let handover = Arc::new(Handover::default());
        let sink = StreamSink::new(&model, Version(3), &m, tx, &handover, &peak);
        let (b, c) = (&m.tensors()[1], &m.tensors()[2]);
        // `b` cut across two buckets: its first half, then `a` and... written out of order
        let all: Vec<u8> = (0..m.total_len()).map(|i| (i % 251) as u8).collect();
        let cut = b.offset + 100;
        sink.write_at(cut, &all[cut..c.offset + c.len]).unwrap();
        sink.verified(cut..c.offset + c.len).unwrap();
        // `c` lies whole in the verified range; `b` is still missing its first bytes
        let got = rx.try_recv().unwrap();
        assert_eq!(got.manifest().tensors()[0].name, "c");
        assert_eq!(got.version(), Version(3));
        assert_eq!(got.bytes(), &all[c.range()]);
        assert!(rx.try_recv().is_err());
        assert!(sink.check_done().is_err(), "`b` is incomplete");
        sink.write_at(0, &all[..cut]).unwrap();
        sink.verified(0..cut).unwrap();
        let names: Vec<String> = rx
            .try_iter()
            .map(|w| {
                let t = &w.manifest().tensors()[0];
                assert_eq!(w.bytes(), &all[m.get(&t.name).unwrap().range()]);
                t.name.clone()
            })
            .collect();
        assert_eq!(names, ["a", "b"]);
        sink.check_done().unwrap();
        // a tensor stays held until the caller applied it: none was, so all three are
        assert_eq!(peak.load(Ordering::Relaxed), m.total_len() as u64);
        assert_eq!(handover.held.load(Ordering::Relaxed), m.total_len() as u64);
        for t in m.tensors() {
            handover.applied(t.len);
        }
        assert_eq!(handover.held.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_transfer_started_again_forgets_what_it_put_together() {
        let m = manifest();
        let (tx, rx) = std::sync::mpsc::sync_channel(8);
        let peak = Arc::new(AtomicU64::new(0));
        let handover = Arc::new(Handover::default());
        let sink = StreamSink::new(
            &ModelId::new("m").unwrap(),
            Version(2),
            &m,
            tx,
            &handover,
            &peak,
        );
        let all: Vec<u8> = (0..m.total_len()).map(|i| (i % 7) as u8).collect();
        // half of `b` written and verified, then the source breaks
        sink.write_at(64, &all[64..160]).unwrap();
        sink.verified(64..160).unwrap();
        assert_eq!(sink.handed(), 0);
        sink.reset();
        assert_eq!(handover.held.load(Ordering::Relaxed), 0);
        // from another source, whole: `b` is counted once, not with the first attempt's half
        sink.write_at(0, &all).unwrap();
        sink.verified(0..160).unwrap();
        assert!(rx.try_iter().all(|w| w.manifest().tensors()[0].name == "a"));
        sink.verified(160..m.total_len()).unwrap();
        sink.check_done().unwrap();
        assert_eq!(sink.handed(), 3);
    }

    #[test]
    fn a_caller_that_stops_taking_tensors_stops_the_transfer() {
        let m = manifest();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let peak = Arc::new(AtomicU64::new(0));
        let handover = Arc::new(Handover::default());
        let sink = StreamSink::new(
            &ModelId::new("m").unwrap(),
            Version(1),
            &m,
            tx,
            &handover,
            &peak,
        );
        drop(rx);
        sink.write_at(0, &[0; 64]).unwrap();
        let e = sink.verified(0..64).unwrap_err();
        assert!(e.to_string().contains("stopped taking"), "{e}");
        // a caller that says it stopped ends the transfer at the next bytes
        handover.stopped.store(true, Ordering::Relaxed);
        assert!(sink.write_at(64, &[0; 64]).is_err());
        assert!(Box::new(sink).finish().is_err());
    }
}
