//! The trajectory pool: gathers one model's fragments into batches through the staleness
//! filter, and tells the controller when a batch is ready.

use std::collections::VecDeque;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::{ModelId, StalenessFilter, Version};
use tokio::sync::oneshot;

use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::protocol::controller::{Admission, BatchReady};
use crate::protocol::pool::{AwaitBatch, FragmentInfo, PoolBatch, PushFragment, TakeBatch};

/// A trainer waiting on the pool: to know a batch is there, or to take it.
enum Want {
    Ready(oneshot::Sender<Result<usize>>),
    Take {
        all: bool,
        tx: oneshot::Sender<Result<PoolBatch>>,
    },
}

struct Waiting {
    id: u64,
    want: Want,
}

/// Gathers fragments into batches for one model's trainer; drops samples older than the
/// allowed staleness (counted) and tells the controller when a batch is ready. A sample is a
/// transition, or a generated sequence, whose staleness is its oldest token's (a stale
/// sequence is dropped whole).
pub struct TrajectoryPool {
    model: ModelId,
    batch_frames: usize,
    filter: StalenessFilter,
    train_version: Version,
    fragments: VecDeque<(Batch, Admission)>,
    dropped_since_take: u64,
    evicted_since_take: u64,
    evicted_total: u64,
    capacity: usize,
    controller: Option<Recipient<BatchReady>>,
    ready_sent: bool,
    waiting: Vec<Waiting>,
    next_id: u64,
    next_stream: usize,
}

impl std::fmt::Debug for TrajectoryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrajectoryPool")
            .field("model", &self.model)
            .field("frames", &self.frames())
            .field("stats", self.filter.stats())
            .finish()
    }
}

impl TrajectoryPool {
    /// A pool handing out batches of at least `batch_frames` frames, dropping samples more
    /// than `max_staleness` versions behind the trainer.
    pub fn new(
        model: ModelId,
        batch_frames: usize,
        max_staleness: Option<u64>,
        controller: Option<Recipient<BatchReady>>,
    ) -> Self {
        Self {
            model,
            batch_frames: batch_frames.max(1),
            filter: StalenessFilter::new(max_staleness),
            train_version: Version::ZERO,
            fragments: VecDeque::new(),
            dropped_since_take: 0,
            evicted_since_take: 0,
            evicted_total: 0,
            capacity: batch_frames.max(1) * 2,
            controller,
            ready_sent: false,
            waiting: Vec::new(),
            next_id: 0,
            next_stream: 0,
        }
    }

    /// Holds at most `batches` batches of frames; older fragments are evicted.
    #[must_use]
    pub fn with_capacity_batches(mut self, batches: u64) -> Self {
        let b = usize::try_from(batches.max(1)).unwrap_or(usize::MAX);
        self.capacity = self.batch_frames.saturating_mul(b);
        self
    }

    /// Samples evicted so far because the pool was full.
    pub fn evicted(&self) -> u64 {
        self.evicted_total
    }

    fn evict(&mut self) {
        let mut frames = self.frames();
        while frames > self.capacity && self.fragments.len() > 1 {
            if let Some((b, _)) = self.fragments.pop_front() {
                frames -= b.frames;
                self.evicted_since_take += b.frames as u64;
                self.evicted_total += b.frames as u64;
            }
        }
    }

    fn frames(&self) -> usize {
        self.fragments.iter().map(|(b, _)| b.frames).sum()
    }

    /// Drops (and counts) samples too old for the trainer's version.
    fn prune(&mut self) {
        let Some(max) = self.filter.max() else {
            return;
        };
        let train = self.train_version;
        let Self {
            fragments,
            filter,
            dropped_since_take,
            ..
        } = self;
        for (b, _) in fragments.iter_mut() {
            let before = b.transitions.len();
            b.transitions.retain(|t| {
                let keep = StalenessFilter::staleness(t.version, train) <= max;
                if !keep {
                    filter.admit(t.version, train, 1);
                }
                keep
            });
            // a generated sequence is as stale as its oldest token; it goes whole
            let before_seqs = b.sequences.len();
            b.sequences.retain(|s| {
                let Some(oldest) = s.oldest_version() else {
                    return true;
                };
                let keep = StalenessFilter::staleness(oldest, train) <= max;
                if !keep {
                    filter.admit(oldest, train, 1);
                }
                keep
            });
            let dropped = before - b.transitions.len() + before_seqs - b.sequences.len();
            *dropped_since_take += dropped as u64;
            b.frames = b.frames.saturating_sub(dropped);
        }
        fragments.retain(|(b, _)| b.frames > 0);
    }

    /// Tells the controller, once per batch, that a batch is ready.
    fn announce_ready(&mut self) {
        if self.frames() >= self.batch_frames && !self.ready_sent {
            self.ready_sent = true;
            if let Some(c) = &self.controller {
                c.do_send(BatchReady {
                    model: self.model.clone(),
                });
            }
        }
    }

    fn serve(&mut self) {
        self.prune();
        if self.frames() < self.batch_frames {
            return;
        }
        self.announce_ready();
        for w in std::mem::take(&mut self.waiting) {
            match w.want {
                Want::Ready(tx) => {
                    let _ = tx.send(Ok(self.frames()));
                }
                // an earlier take in this loop may have emptied the pool
                Want::Take { all, tx } if self.frames() >= self.batch_frames => {
                    let _ = tx.send(Ok(self.take(all)));
                }
                want @ Want::Take { .. } => self.waiting.push(Waiting { id: w.id, want }),
            }
        }
    }

    fn take(&mut self, all: bool) -> PoolBatch {
        let train = self.train_version;
        let mut parts = Vec::with_capacity(self.fragments.len());
        let mut fragments = Vec::with_capacity(self.fragments.len());
        let mut max_staleness = 0;
        let mut frames = 0;
        while let Some((mut b, adm)) = self.fragments.pop_front() {
            if !all && frames >= self.batch_frames {
                self.fragments.push_front((b, adm));
                break;
            }
            frames += b.frames;
            let stream = self.next_stream;
            self.next_stream += 1;
            for t in &mut b.transitions {
                let s = StalenessFilter::staleness(t.version, train);
                max_staleness = max_staleness.max(s);
                self.filter.admit(t.version, train, 1);
                t.worker = stream;
            }
            // generated sequences keep their worker index (GRPO groups by `group`)
            for seq in &b.sequences {
                if let Some(oldest) = seq.oldest_version() {
                    let s = StalenessFilter::staleness(oldest, train);
                    max_staleness = max_staleness.max(s);
                    self.filter.admit(oldest, train, 1);
                }
            }
            if let Some(versions) = b.version_range() {
                fragments.push(FragmentInfo {
                    admission: adm,
                    versions,
                    frames: b.frames,
                });
            }
            parts.push(b);
        }
        self.ready_sent = false;
        // after a partial take, a full batch may already be waiting
        self.announce_ready();
        PoolBatch {
            batch: Batch::concat(parts),
            dropped: std::mem::take(&mut self.dropped_since_take),
            evicted: std::mem::take(&mut self.evicted_since_take),
            max_staleness,
            fragments,
            totals: self.filter.stats().clone(),
        }
    }

    /// Queues `want` with a deadline, then serves what can be served now.
    fn enqueue(
        &mut self,
        train_version: Version,
        want: Want,
        timeout: Duration,
        ctx: &mut Context<Self>,
    ) {
        self.train_version = self.train_version.max(train_version);
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push(Waiting { id, want });
        ctx.run_later(timeout, move |act, _| {
            let Some(i) = act.waiting.iter().position(|w| w.id == id) else {
                return;
            };
            let w = act.waiting.swap_remove(i);
            let e = Error::Runtime(refit_runtime::Error::Timeout {
                what: format!(
                    "a batch of {} frames for model `{}` (the pool holds {})",
                    act.batch_frames,
                    act.model,
                    act.frames()
                ),
                after: timeout,
            });
            match w.want {
                Want::Ready(tx) => drop(tx.send(Err(e))),
                Want::Take { tx, .. } => drop(tx.send(Err(e))),
            }
        });
        self.serve();
    }
}

async fn answer<T>(rx: oneshot::Receiver<Result<T>>) -> Result<T> {
    rx.await
        .map_err(|_| Error::Actor("trajectory pool stopped".into()))?
}

impl Actor for TrajectoryPool {
    type Context = Context<Self>;
}

impl Handler<PushFragment> for TrajectoryPool {
    type Result = ();
    fn handle(&mut self, msg: PushFragment, _: &mut Context<Self>) {
        if msg.fragment.frames > 0 {
            self.fragments.push_back((msg.fragment, msg.admission));
        }
        self.evict();
        self.serve();
    }
}

impl Handler<AwaitBatch> for TrajectoryPool {
    type Result = ResponseFuture<Result<usize>>;
    fn handle(&mut self, msg: AwaitBatch, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.enqueue(msg.train_version, Want::Ready(tx), msg.timeout, ctx);
        Box::pin(answer(rx))
    }
}

impl Handler<TakeBatch> for TrajectoryPool {
    type Result = ResponseFuture<Result<PoolBatch>>;
    fn handle(&mut self, msg: TakeBatch, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        let want = Want::Take { all: msg.all, tx };
        self.enqueue(msg.train_version, want, msg.timeout, ctx);
        Box::pin(answer(rx))
    }
}
