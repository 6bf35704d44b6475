//! The streaming receive ([`ReceiverTransport::stream_next`] of a
//! [`streaming`](TcpReceiver::streaming) receiver): each version's tensors go to the
//! caller one at a time, as the buckets holding them are verified, and nothing of the
//! version is kept here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use refit_runtime::metrics::{self, Phase};
use refit_runtime::protocol::entries;
use refit_runtime::{
    Error, Manifest, ModelId, ReceiverTransport, Result, StreamProgress, Version, WeightSet,
    stream_group,
};

use super::super::NAME;
use super::super::stream_sink::{Handover, QUEUE, StreamSink};
use super::TcpReceiver;

/// What streaming one version gave.
enum Streamed {
    /// Every tensor was applied.
    Applied,
    /// The sender no longer keeps the version.
    Superseded,
}

/// An apply under way: the count it bumps is odd from its start to its end (a panic
/// included), and the pull's watchdog counts that as progress.
struct Applying<'a>(&'a AtomicU64);

impl<'a> Applying<'a> {
    fn new(count: &'a AtomicU64) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Applying<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

impl TcpReceiver {
    /// [`ReceiverTransport::stream_next`]: for a [`streaming`](TcpReceiver::streaming)
    /// receiver, waits for newer versions, then streams each model's in turn; for another,
    /// receives the group whole and hands over a copy of each tensor.
    pub(super) fn stream_versions(
        &mut self,
        deadline: Instant,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
    ) -> Result<Option<Vec<(ModelId, Version)>>> {
        if !self.streaming {
            let Some(group) = self.next_group(deadline)? else {
                return Ok(None);
            };
            stream_group(&group, apply)?;
            return Ok(Some(entries(&group)));
        }
        'wait: loop {
            let Some(want) = self.pending(deadline)? else {
                return Ok(None);
            };
            let tensors = want
                .iter()
                .filter_map(|(m, _)| self.manifests.as_ref()?.get(m).ok())
                .map(|m| m.len())
                .sum();
            let mut progress = StreamProgress::new(tensors);
            let mut done = Vec::with_capacity(want.len());
            for (m, v) in want {
                let wire = metrics::timed(Phase::Wire, NAME, m.as_str());
                progress.at(&m, v);
                match self.stream_one(&m, v, deadline, apply, &mut progress)? {
                    Streamed::Applied => {
                        wire.finish();
                        done.push((m, v));
                    }
                    // the newer version is pending now: wait for it (models streamed
                    // already are returned, the rest come with the next call)
                    Streamed::Superseded if done.is_empty() => continue 'wait,
                    Streamed::Superseded => break,
                }
            }
            // only now, every model of the update being in: a failure above leaves them all
            // pending, to be streamed whole again
            // the inbox first, as `pending` takes them
            let mut ib = self.shared.inbox();
            let mut streamed = self
                .shared
                .streamed
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for (m, v) in &done {
                streamed.insert(m.clone(), *v);
                if ib.pending.get(m).is_some_and(|p| p <= v) {
                    ib.pending.remove(m);
                }
            }
            return Ok(Some(done));
        }
    }

    /// Streams `version` of `model` into `apply`: a pull thread lands the bytes in a
    /// [`StreamSink`], this thread hands `apply` each tensor it completes, counting them in
    /// `progress`. An error of `apply` stops the pull at its next bytes.
    fn stream_one(
        &self,
        model: &ModelId,
        version: Version,
        deadline: Instant,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
        progress: &mut StreamProgress,
    ) -> Result<Streamed> {
        let manifest: Arc<Manifest> = Arc::clone(
            self.manifests
                .as_ref()
                .ok_or(Error::State("tcp receiver used before connect"))?
                .get(model)?,
        );
        let (tx, rx) = sync_channel(QUEUE);
        let handover = Arc::new(Handover::default());
        let sink = StreamSink::new(
            model,
            version,
            &manifest,
            tx,
            &handover,
            &self.shared.stream_peak,
        );
        let caller = &self.shared.caller;
        let (pulled, applied) = std::thread::scope(|scope| {
            let pull = scope.spawn(move || {
                let r = self.pull(model, version, deadline, Some(&sink));
                drop(sink);
                r
            });
            let mut applied = Ok(());
            for one in rx.iter() {
                let len = one.manifest().tensors().first().map_or(0, |t| t.len);
                let r = {
                    let _busy = Applying::new(caller);
                    progress.apply(apply, one)
                };
                handover.applied(len);
                if let Err(e) = r {
                    applied = Err(e);
                    break;
                }
            }
            // the pull ends at its next bytes, and at the sink's next hand-over
            handover.stopped.store(true, Ordering::Relaxed);
            drop(rx);
            (pull.join(), applied)
        });
        let pulled = pulled.map_err(|_| {
            progress.fail(Error::transport(NAME, "the streaming pull thread panicked"))
        })?;
        applied?;
        match pulled.map_err(|e| progress.fail(e))? {
            Ok(None) => {
                // tensors of no bytes lie in no bucket
                for spec in manifest.tensors().iter().filter(|t| t.len == 0) {
                    let one = WeightSet::single(model.clone(), version, spec)
                        .map_err(|e| progress.fail(e))?;
                    progress.apply(apply, one)?;
                }
                Ok(Streamed::Applied)
            }
            // a streaming receiver holds no base, so its transfers are full: a sink takes them
            Ok(Some(_)) => Err(progress.fail(Error::State("a streaming pull landed in an arena"))),
            Err(latest) => {
                self.superseded(model, version, latest);
                Ok(Streamed::Superseded)
            }
        }
    }
}
