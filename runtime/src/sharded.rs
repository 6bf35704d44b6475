//! Sharded writers: several trainer ranks each write their shard of one arena, a barrier
//! closes the version, and the closed version is served while the ranks write the next one.
//!
//! The arena is cut into `world` contiguous shards of equal size (rounded up to [`ALIGN`];
//! the last may be shorter), as FSDP ranks write `offset + rank * shard_size`. Two arenas
//! alternate: the *back* one the ranks write, and the *front* one that was closed last and is
//! served as an `Arc<WeightSet>`. Closing swaps them; the old front is reused as the next back
//! when no reader still holds it, and a fresh arena is allocated otherwise, so a served
//! version never changes under its readers.
//!
//! Writes are copies under a lock on the back arena (no `unsafe`): ranks' copies of the same
//! version are serialised, each being one `memcpy` of the rank's bytes.
//!
//! [`ShardedBuffer::publish`] closes a version and publishes it through any scheme
//! [`Sender`] (shm, TCP, ...) without a copy: this is how sharded trainer ranks publish.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;

use crate::error::{Error, Result};
use crate::ids::{ModelId, Version};
use crate::manifest::{ALIGN, Manifest};
use crate::scheme::{PendingSend, Sender, SenderTransport};
use crate::weights::WeightSet;

#[derive(Debug)]
struct Back {
    arena: WeightSet,
    arrived: Vec<bool>,
}

#[derive(Debug)]
struct Inner {
    model: ModelId,
    manifest: Arc<Manifest>,
    shard_len: usize,
    world: usize,
    back: Mutex<Back>,
    all_arrived: Condvar,
    front: ArcSwapOption<WeightSet>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Back> {
        // A rank that panicked mid-copy leaves bytes the barrier will not close over; the
        // state itself stays consistent, so the poison is not propagated.
        self.back.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn range(&self, rank: usize) -> Range<usize> {
        let total = self.manifest.total_len();
        (rank * self.shard_len).min(total)..((rank + 1) * self.shard_len).min(total)
    }
}

/// One arena written by `world` ranks, double-buffered; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct ShardedBuffer {
    inner: Arc<Inner>,
}

/// The handle one rank writes its shard with; cheap to move to the rank's thread.
#[derive(Debug, Clone)]
pub struct ShardWriter {
    inner: Arc<Inner>,
    rank: usize,
    range: Range<usize>,
}

fn shard_error(rank: usize, reason: impl Into<String>) -> Error {
    Error::Shard {
        rank,
        reason: reason.into(),
    }
}

impl ShardedBuffer {
    /// A buffer for `world` ranks over arenas of `manifest`.
    ///
    /// # Errors
    /// [`Error::Shard`] when `world` is 0.
    pub fn new(model: ModelId, manifest: Arc<Manifest>, world: usize) -> Result<Self> {
        if world == 0 {
            return Err(shard_error(0, "a sharded buffer needs at least one rank"));
        }
        let shard_len = manifest.total_len().div_ceil(world).div_ceil(ALIGN) * ALIGN;
        let arena = WeightSet::zeroed(model.clone(), Arc::clone(&manifest));
        Ok(Self {
            inner: Arc::new(Inner {
                model,
                manifest,
                shard_len,
                world,
                back: Mutex::new(Back {
                    arena,
                    arrived: vec![false; world],
                }),
                all_arrived: Condvar::new(),
                front: ArcSwapOption::empty(),
            }),
        })
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.inner.world
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.inner.world {
            return Err(shard_error(
                rank,
                format!("no such rank, the world has {}", self.inner.world),
            ));
        }
        Ok(())
    }

    /// The writer handle of one rank.
    ///
    /// # Errors
    /// [`Error::Shard`] when `rank` is not below the world size.
    pub fn writer(&self, rank: usize) -> Result<ShardWriter> {
        self.check_rank(rank)?;
        Ok(ShardWriter {
            inner: Arc::clone(&self.inner),
            rank,
            range: self.inner.range(rank),
        })
    }

    /// Waits until every rank arrived at the barrier, at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] naming the ranks still missing.
    pub fn wait_all(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut back = self.inner.lock();
        while back.arrived.iter().any(|a| !a) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: format!("ranks {:?} to finish their shards", missing(&back.arrived)),
                    after: timeout,
                });
            }
            back = self
                .inner
                .all_arrived
                .wait_timeout(back, left)
                .map_or_else(|p| p.into_inner().0, |(g, _)| g);
        }
        Ok(())
    }

    /// Closes the version the ranks wrote: stamps `version`, makes it the served one, and
    /// opens the next version for writing.
    ///
    /// # Errors
    /// [`Error::Shard`] naming the first rank that has not finished its shard;
    /// [`Error::StaleVersion`] when `version` is not newer than the one served.
    pub fn close_version(&self, version: Version) -> Result<Arc<WeightSet>> {
        let mut back = self.inner.lock();
        if let Some(&rank) = missing(&back.arrived).first() {
            return Err(shard_error(
                rank,
                format!(
                    "has not finished its shard of version {version} (missing ranks {:?})",
                    missing(&back.arrived)
                ),
            ));
        }
        let old = self.inner.front.load_full();
        if let Some(cur) = &old
            && version <= cur.version()
        {
            return Err(Error::StaleVersion {
                model: self.inner.model.clone(),
                offered: version,
                current: cur.version(),
            });
        }
        drop(old);
        let fresh = WeightSet::zeroed(self.inner.model.clone(), Arc::clone(&self.inner.manifest));
        let mut closed = std::mem::replace(&mut back.arena, fresh);
        closed.set_version(version);
        let closed = Arc::new(closed);
        let previous = self.inner.front.swap(Some(Arc::clone(&closed)));
        // The front just replaced becomes the next back unless a reader still holds it (then
        // the fresh, lazily zeroed arena stays).
        if let Some(w) = previous.and_then(|p| Arc::try_unwrap(p).ok()) {
            back.arena = w;
        }
        back.arrived.fill(false);
        Ok(closed)
    }

    /// Closes the version the ranks wrote (as [`ShardedBuffer::close_version`]) and
    /// publishes it through `sender` without a copy: the closed arena is the `Arc` that
    /// travels. Returns the update to wait on for acknowledgements.
    ///
    /// The sender's manifest for this model is checked first, so a buffer that does not
    /// fit the scheme closes nothing.
    ///
    /// # Errors
    /// A schema error naming the tensor when the sender's manifest differs;
    /// [`Error::Shard`] naming a rank that has not finished; [`Error::StaleVersion`];
    /// whatever the sender's publish reports (the version is then closed and served here,
    /// but not published).
    pub fn publish<T: SenderTransport>(
        &self,
        version: Version,
        sender: &mut Sender<T>,
    ) -> Result<PendingSend> {
        sender
            .manifests()
            .get(&self.inner.model)?
            .check_same_schema(&self.inner.model, &self.inner.manifest)?;
        let closed = self.close_version(version)?;
        sender.publish_shared(vec![closed])
    }

    /// The version served now (the last one closed), if any.
    pub fn serve(&self) -> Option<Arc<WeightSet>> {
        self.inner.front.load_full()
    }
}

fn missing(arrived: &[bool]) -> Vec<usize> {
    arrived
        .iter()
        .enumerate()
        .filter(|(_, a)| !**a)
        .map(|(r, _)| r)
        .collect()
}

impl ShardWriter {
    /// This writer's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The arena byte range this rank writes.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Copies `bytes` to arena offset `offset`, which must lie inside this rank's shard.
    ///
    /// # Errors
    /// [`Error::Shard`] when the bytes fall outside the shard or this rank already finished
    /// the version being written (it must wait for [`ShardedBuffer::close_version`]).
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        let end = offset.checked_add(bytes.len());
        if offset < self.range.start || end.is_none_or(|e| e > self.range.end) {
            return Err(shard_error(
                self.rank,
                format!(
                    "write of {} bytes at {offset} falls outside its shard {:?}",
                    bytes.len(),
                    self.range
                ),
            ));
        }
        let mut back = self.inner.lock();
        if back.arrived[self.rank] {
            return Err(shard_error(
                self.rank,
                "already finished this version; wait for it to close",
            ));
        }
        back.arena.bytes_mut()?[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    /// Copies this rank's whole shard (`bytes` must be exactly the shard's length).
    ///
    /// # Errors
    /// As [`ShardWriter::write`], and [`Error::Shard`] when the length differs.
    pub fn write_shard(&self, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.range.len() {
            return Err(shard_error(
                self.rank,
                format!("shard is {} bytes, {} given", self.range.len(), bytes.len()),
            ));
        }
        self.write(self.range.start, bytes)
    }

    /// Arrives at the barrier: this rank's shard of the version being written is complete.
    pub fn finish(&self) {
        let mut back = self.inner.lock();
        back.arrived[self.rank] = true;
        if back.arrived.iter().all(|a| *a) {
            self.inner.all_arrived.notify_all();
        }
    }
}

#[cfg(test)]
mod tests;
