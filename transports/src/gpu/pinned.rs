//! Pinned host staging: two page-locked host buffers ("slots") through which host bytes
//! reach device memory and come back.
//!
//! Copies between pageable host memory and the device are slow and synchronous; from
//! page-locked memory they are DMA transfers that run asynchronously on a stream. Two slots
//! let the CPU fill (or drain) one while the copy engine moves the other, so the copy of
//! chunk k+1 overlaps the device work on chunk k (an NCCL broadcast, see
//! [`crate::collective::nccl`]). Each slot has an event recording its last copy; a slot is
//! touched by the CPU only after its event completed, and every such wait keeps the
//! caller's deadline.
//!
//! The CPU side of each slot's copy (pageable memory to the slot, or back) is split across
//! threads ([`copy_parallel`]): one core copies about 8-10 GB/s, the copy engine moves 50 GB/s
//! and more, so a single-threaded copy would bound every staged transfer.
//!
//! The slots are allocated with flags 0 (cached, not write-combined): they are read back by
//! the CPU after device-to-host copies, which write-combined memory makes very slow.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice, result, sys};
use refit_runtime::copy::{copy_parallel, copy_threads};
use refit_runtime::{Error, Result};

use super::device::{driver_error, wait_event};

/// Default size of one staging slot (16 MiB): large enough for full-speed DMA and for the
/// host side of a slot's copy to be split across threads ([`copy_parallel`]), small enough
/// that two of them per communicator cost little.
pub const DEFAULT_CHUNK: usize = 16 << 20;

/// One page-locked buffer and the event of its last copy.
#[derive(Debug)]
struct Slot {
    host: PinnedHostSlice<u8>,
    done: CudaEvent,
}

/// Two page-locked host buffers of `chunk` bytes for double-buffered host<->device copies.
#[derive(Debug)]
pub struct PinnedStaging {
    slots: [Slot; 2],
    chunk: usize,
    threads: usize,
}

impl PinnedStaging {
    /// Allocates two page-locked slots of `chunk` bytes in `ctx`.
    ///
    /// # Errors
    /// [`Error::Config`] for a zero chunk; [`Error::Transport`] when the driver cannot
    /// allocate page-locked memory.
    pub fn new(ctx: &Arc<CudaContext>, chunk: usize) -> Result<Self> {
        if chunk == 0 {
            return Err(Error::Config(
                "pinned staging needs a chunk of at least one byte".into(),
            ));
        }
        let slot = || -> Result<Slot> {
            // SAFETY: the allocation is uninitialised; no byte of it is read before a copy
            // (host-side `copy_from_slice` in `push`, or a device-to-host copy in `pull`)
            // wrote it: `take` reads only the first `n` bytes that `pull` filled.
            let host = unsafe { ctx.alloc_pinned_with_flags::<u8>(chunk, 0) }
                .map_err(|e| driver_error("cuda", "allocating pinned host memory", e))?;
            let done = ctx
                .new_event(None)
                .map_err(|e| driver_error("cuda", "creating a staging event", e))?;
            Ok(Slot { host, done })
        };
        Ok(Self {
            slots: [slot()?, slot()?],
            chunk,
            threads: copy_threads(),
        })
    }

    /// Bytes per slot.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Waits (within `deadline`) for slot `i`'s last copy and lends its first `n` bytes
    /// and its event.
    fn ready(&mut self, i: usize, n: usize, deadline: Instant) -> Result<(&mut [u8], &CudaEvent)> {
        let chunk = self.chunk;
        if n > chunk {
            return Err(Error::Config(format!(
                "{n} bytes do not fit a {chunk}-byte staging slot"
            )));
        }
        let Slot { host, done } = &mut self.slots[i % 2];
        wait_event(done, deadline, "a pinned staging slot")?;
        let host = host
            .as_mut_slice()
            .map_err(|e| driver_error("cuda", "mapping a pinned slot", e))?;
        Ok((&mut host[..n], done))
    }

    /// Waits (within `deadline`) for slot `i`'s last copy, copies `src` (at most one chunk)
    /// into it, and enqueues its copy to device address `dst` on `stream`.
    ///
    /// # Errors
    /// [`Error::Config`] when `src` exceeds a chunk; [`Error::Timeout`] past `deadline`;
    /// [`Error::Transport`] for a driver failure.
    pub fn push(
        &mut self,
        i: usize,
        src: &[u8],
        dst: sys::CUdeviceptr,
        stream: &CudaStream,
        deadline: Instant,
    ) -> Result<()> {
        let threads = self.threads;
        let (host, done) = self.ready(i, src.len(), deadline)?;
        copy_parallel(host, src, threads);
        // SAFETY: `host` is page-locked memory owned by this slot; the CPU does not touch it
        // again before `done` (recorded right after on the same stream) completes, and the
        // slot outlives the copy because every later use of the slot, and `Drop`, waits for
        // that event. `dst` is a device address of at least `src.len()` bytes per the
        // caller's contract (checked by every caller in this crate).
        unsafe { result::memcpy_htod_async(dst, host, stream.cu_stream()) }
            .map_err(|e| driver_error("cuda", "copying a chunk to the device", e))?;
        record(done, stream)
    }

    /// Enqueues a copy of `n` bytes (at most one chunk) from device address `src` into slot
    /// `i` on `stream`. The slot must have been drained by [`PinnedStaging::take`] (or never
    /// filled); read it back with [`PinnedStaging::take`].
    ///
    /// # Errors
    /// [`Error::Config`] when `n` exceeds a chunk; [`Error::Transport`] for a driver failure.
    pub fn pull(
        &mut self,
        i: usize,
        src: sys::CUdeviceptr,
        n: usize,
        stream: &CudaStream,
        deadline: Instant,
    ) -> Result<()> {
        let (host, done) = self.ready(i, n, deadline)?;
        // SAFETY: as in `push`, the page-locked destination stays alive and untouched by the
        // CPU until `done` completes (`take` waits for it); `src` holds at least `n` bytes
        // per the caller's contract.
        unsafe { result::memcpy_dtoh_async(host, src, stream.cu_stream()) }
            .map_err(|e| driver_error("cuda", "copying a chunk from the device", e))?;
        record(done, stream)
    }

    /// Waits (within `deadline`) for slot `i`'s copy from the device and copies its first
    /// `dst.len()` bytes into `dst`.
    ///
    /// # Errors
    /// [`Error::Config`] when `dst` exceeds a chunk; [`Error::Timeout`] past `deadline`;
    /// [`Error::Transport`] for a driver failure.
    pub fn take(&mut self, i: usize, dst: &mut [u8], deadline: Instant) -> Result<()> {
        let threads = self.threads;
        let (host, _) = self.ready(i, dst.len(), deadline)?;
        copy_parallel(dst, host, threads);
        Ok(())
    }

    /// Waits for both slots' copies (within `deadline`).
    ///
    /// # Errors
    /// [`Error::Timeout`] past `deadline`; [`Error::Transport`] for a driver failure.
    pub fn wait_idle(&self, deadline: Instant) -> Result<()> {
        for slot in &self.slots {
            wait_event(&slot.done, deadline, "a pinned staging slot")?;
        }
        Ok(())
    }

    /// Copies `src` to device address `dst` chunk by chunk, filling one slot while the other
    /// is in flight, and returns once every byte is on the device.
    ///
    /// # Errors
    /// As [`PinnedStaging::push`].
    pub fn upload(
        &mut self,
        src: &[u8],
        dst: sys::CUdeviceptr,
        stream: &CudaStream,
        deadline: Instant,
    ) -> Result<()> {
        for (k, part) in src.chunks(self.chunk).enumerate() {
            let offset = (k * self.chunk) as u64;
            self.push(k, part, dst + offset, stream, deadline)?;
        }
        self.wait_idle(deadline)
    }

    /// Copies `dst.len()` bytes from device address `src` into `dst`: the copy of chunk k+1
    /// runs while the CPU drains chunk k.
    ///
    /// # Errors
    /// As [`PinnedStaging::pull`] and [`PinnedStaging::take`].
    pub fn download(
        &mut self,
        src: sys::CUdeviceptr,
        dst: &mut [u8],
        stream: &CudaStream,
        deadline: Instant,
    ) -> Result<()> {
        let chunk = self.chunk;
        let mut pending: Option<(usize, &mut [u8])> = None;
        for (k, part) in dst.chunks_mut(chunk).enumerate() {
            self.pull(k, src + (k * chunk) as u64, part.len(), stream, deadline)?;
            if let Some((j, prev)) = pending.take() {
                self.take(j, prev, deadline)?;
            }
            pending = Some((k, part));
        }
        if let Some((j, prev)) = pending {
            self.take(j, prev, deadline)?;
        }
        Ok(())
    }
}

fn record(done: &CudaEvent, stream: &CudaStream) -> Result<()> {
    done.record(stream)
        .map_err(|e| driver_error("cuda", "recording a staging event", e))
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        // A copy still in flight reads or writes a slot: wait for it before the page-locked
        // memory is freed (`PinnedHostSlice` frees it in its own drop, exactly once). The
        // result is ignored: there is nothing left to report it to, and freeing after a
        // failed copy is still correct.
        for slot in &self.slots {
            let _ = slot.done.synchronize();
        }
    }
}
