//! The streaming receive ([`ReceiverTransport::stream_next`] of a
//! [`streaming`](TcpReceiver::streaming) receiver): each version's tensors go to the
//! caller one at a time, as the buckets holding them are verified, and nothing of the
//! version is kept here.

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
use super::super::stream_sink::{QUEUE, StreamSink};
use super::TcpReceiver;

/// What streaming one version gave.
enum Streamed {
    /// Every tensor was applied.
    Applied,
    /// The sender no longer keeps the version.
    Superseded,
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
            let mut done = Vec::with_capacity(want.len());
            for (m, v) in want {
                let wire = metrics::timed(Phase::Wire, NAME, m.as_str());
                match self.stream_one(&m, v, deadline, apply)? {
                    Streamed::Applied => {
                        wire.finish();
                        self.shared
                            .streamed
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .insert(m.clone(), v);
                        let mut ib = self.shared.inbox();
                        if ib.pending.get(&m).is_some_and(|p| *p <= v) {
                            ib.pending.remove(&m);
                        }
                        done.push((m, v));
                    }
                    // the newer version is pending now: wait for it (models streamed
                    // already stay applied, and are returned with the next)
                    Streamed::Superseded if done.is_empty() => continue 'wait,
                    Streamed::Superseded => break,
                }
            }
            return Ok(Some(done));
        }
    }

    /// Streams `version` of `model` into `apply`: a pull thread lands the bytes in a
    /// [`StreamSink`], this thread hands `apply` each tensor it completes. An error of
    /// `apply` stops the pull (the sink's next hand-over fails).
    fn stream_one(
        &self,
        model: &ModelId,
        version: Version,
        deadline: Instant,
        apply: &mut dyn FnMut(WeightSet) -> Result<()>,
    ) -> Result<Streamed> {
        let manifest: Arc<Manifest> = Arc::clone(
            self.manifests
                .as_ref()
                .ok_or(Error::State("tcp receiver used before connect"))?
                .get(model)?,
        );
        let mut progress = StreamProgress::new(model, version, &manifest);
        let (tx, rx) = sync_channel(QUEUE);
        let sink = StreamSink::new(model, version, &manifest, tx, &self.shared.stream_peak);
        let (pulled, applied) = std::thread::scope(|scope| {
            let pull = scope.spawn(move || {
                let r = self.pull(model, version, deadline, Some(&sink));
                drop(sink);
                r
            });
            let mut applied = Ok(());
            for one in rx.iter() {
                if let Err(e) = progress.apply(apply, one) {
                    applied = Err(e);
                    break;
                }
            }
            // dropped, it fails the sink's next hand-over: the pull stops
            drop(rx);
            (pull.join(), applied)
        });
        let pulled =
            pulled.map_err(|_| Error::transport(NAME, "the streaming pull thread panicked"))?;
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
