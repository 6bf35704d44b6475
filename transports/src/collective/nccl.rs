//! The NCCL backend of [`Communicator`], through cudarc (feature `cuda`).
//!
//! - **Rendezvous.** Rank 0 creates the NCCL unique id and sets it in the [`Rendezvous`]
//!   store under [`Membership::key`]`("nccl-id")` (as a [`NcclUniqueId`], plain bytes); the
//!   other ranks wait for it there, within the deadline.
//! - **Init with a deadline.** The communicator is created non-blocking
//!   (`ncclCommInitRankConfig` with `blocking = 0`) and polled with `ncclCommGetAsyncError`,
//!   so a rank that never shows up makes [`NcclCommunicator::connect`] fail at its
//!   deadline (and `ncclCommAbort` the half-made communicator) instead of hanging.
//! - **One CUDA stream per communicator** for the collectives, plus one for staging copies;
//!   `Buf` is device memory (`CudaSlice<u8>`, stream-ordered allocations).
//! - **Every call has a deadline.** A call enqueues its work, records an event and polls the
//!   event and `ncclCommGetAsyncError` until the work is done, NCCL reports an error, or
//!   the deadline passes. Any failure aborts the communicator (`ncclCommAbort`, exactly
//!   once; later calls fail at once), which also unblocks kernels still waiting for peers.
//! - **Host bytes** go through [`PinnedStaging`]: `upload`/`download` copy chunk by chunk
//!   through two page-locked slots, and [`Communicator::broadcast_host`] pipelines them over
//!   two device chunks, so the copy of chunk k+1 runs while chunk k is broadcast.
//!
//! One GPU hosts at most one rank of a communicator (NCCL refuses duplicates), so on a single
//! GPU only one-rank groups run; trainer and engine sharing a GPU use CUDA IPC
//! ([`crate::gpu::ipc`]).

use std::ffi::{CStr, c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};
use refit_runtime::{Error, Result};

use super::{Communicator, Membership, Rendezvous};
use crate::gpu::NcclUniqueId;
use crate::gpu::device::{driver_text, nccl_present, open_device};
use crate::gpu::pinned::{DEFAULT_CHUNK, PinnedStaging};

const BACKEND: &str = "nccl";
const SUCCESS: u32 = 0;
const IN_PROGRESS: u32 = 7;
/// `NCCL_CONFIG_UNDEF_INT`: a config field NCCL fills with its default.
const UNDEF_INT: c_int = c_int::MIN;

/// Options of an NCCL communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclOptions {
    /// CUDA device ordinal this rank uses.
    pub device: usize,
    /// Bytes per pinned staging slot (and per pipelined broadcast chunk).
    pub chunk: usize,
}

impl Default for NcclOptions {
    fn default() -> Self {
        Self {
            device: 0,
            chunk: DEFAULT_CHUNK,
        }
    }
}

/// The broadcast transport ([`crate::broadcast`]) forms each generation's communicator
/// over NCCL with these options.
impl crate::broadcast::Connector for NcclOptions {
    type Comm = NcclCommunicator;

    fn connect(
        &mut self,
        membership: Membership,
        store: &dyn Rendezvous,
        deadline: Instant,
    ) -> Result<NcclCommunicator> {
        NcclCommunicator::connect(membership, store, *self, deadline)
    }
}

/// The raw NCCL communicator, aborted exactly once (on [`Communicator::abort`] or drop).
#[derive(Debug)]
struct RawComm {
    comm: sys::ncclComm_t,
    ctx: Arc<CudaContext>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `RawComm` is only reached through `&mut NcclCommunicator` (every call binds
// the CUDA context to the calling thread first), so moving it between threads is sound.
unsafe impl Send for RawComm {}

impl RawComm {
    fn is_live(&self) -> bool {
        !self.comm.is_null()
    }

    /// `ncclCommAbort` once; afterwards the handle is null.
    fn abort(&mut self) {
        if self.comm.is_null() {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `self.comm` is a communicator returned by `ncclCommInitRankConfig` and not
        // yet aborted (it is nulled right after, so this runs once per communicator).
        let _ = unsafe { sys::ncclCommAbort(self.comm) };
        self.comm = std::ptr::null_mut();
    }

    /// `ncclCommGetAsyncError` as a raw code (0 success, 7 in progress, else an error).
    fn async_code(&self) -> u32 {
        if self.comm.is_null() {
            return u32::MAX;
        }
        let mut code: u32 = SUCCESS;
        // SAFETY: `self.comm` is live; the out-parameter is written through a `u32` (the
        // enum's representation), so a code this build does not know is not undefined
        // behaviour.
        let r = unsafe {
            sys::ncclCommGetAsyncError(self.comm, (&raw mut code).cast::<sys::ncclResult_t>())
        };
        if r != sys::ncclResult_t::ncclSuccess {
            return r as u32;
        }
        code
    }

    /// NCCL's description of the last error on this communicator.
    fn last_error(&self) -> String {
        if self.comm.is_null() {
            return String::new();
        }
        // SAFETY: `self.comm` is live; NCCL returns a NUL-terminated string it owns (or null).
        let p = unsafe { sys::ncclGetLastError(self.comm) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated, valid until the next NCCL call on this thread;
        // copied out at once.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        self.abort();
    }
}

/// The text NCCL gives for a result code.
fn nccl_text(code: u32) -> String {
    let known = match code {
        0 => Some(sys::ncclResult_t::ncclSuccess),
        1 => Some(sys::ncclResult_t::ncclUnhandledCudaError),
        2 => Some(sys::ncclResult_t::ncclSystemError),
        3 => Some(sys::ncclResult_t::ncclInternalError),
        4 => Some(sys::ncclResult_t::ncclInvalidArgument),
        5 => Some(sys::ncclResult_t::ncclInvalidUsage),
        6 => Some(sys::ncclResult_t::ncclRemoteError),
        7 => Some(sys::ncclResult_t::ncclInProgress),
        _ => None,
    };
    let Some(r) = known else {
        return format!("nccl result {code}");
    };
    // SAFETY: `ncclGetErrorString` takes any result code and returns a static string.
    let p = unsafe { sys::ncclGetErrorString(r) };
    if p.is_null() {
        return format!("{r:?}");
    }
    // SAFETY: non-null, NUL-terminated static string owned by NCCL.
    let text = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    format!("{r:?} ({text})")
}

fn code_of(e: &nccl::NcclError) -> u32 {
    e.0 as u32
}

/// The ring of two device chunks and their events used by the pipelined host broadcast.
#[derive(Debug)]
struct Ring {
    chunks: [CudaSlice<u8>; 2],
    /// Recorded on the NCCL stream after chunk `s` was broadcast.
    sent: [CudaEvent; 2],
    /// Recorded on the copy stream after chunk `s`'s host copy.
    copied: [CudaEvent; 2],
}

/// An NCCL communicator for one membership generation.
#[derive(Debug)]
pub struct NcclCommunicator {
    membership: Membership,
    // Field order is drop order: the communicator is aborted (in `Drop`) before the buffers,
    // events and streams it may still use are released.
    comm: RawComm,
    ring: Option<Ring>,
    staging: PinnedStaging,
    done: CudaEvent,
    copy: Arc<CudaStream>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    aborted: Option<String>,
}

impl NcclCommunicator {
    /// Joins the group of `membership` on device `options.device`: rank 0 publishes the
    /// unique id in `store`, the others read it, and every rank initialises its
    /// communicator, all before `deadline`.
    ///
    /// # Errors
    /// [`Error::Collective`] when no GPU or no `libnccl` can be used (the probe's reason),
    /// or NCCL fails; [`Error::Timeout`] when the id or the other ranks do not arrive by
    /// `deadline` (the half-made communicator is aborted); the store's errors.
    pub fn connect(
        membership: Membership,
        store: &dyn Rendezvous,
        options: NcclOptions,
        deadline: Instant,
    ) -> Result<Self> {
        let ctx = open_device(options.device)
            .map_err(|e| membership.error(BACKEND, format!("no gpu: {e}")))?;
        if !nccl_present() {
            return Err(membership.error(
                BACKEND,
                "libnccl cannot be loaded (cudarc looks for libnccl.so: link it to libnccl.so.2 in a directory on LD_LIBRARY_PATH)",
            ));
        }
        let world = c_int::try_from(membership.world)
            .map_err(|_| membership.error(BACKEND, "world size does not fit a c int"))?;
        let rank = c_int::try_from(membership.rank)
            .map_err(|_| membership.error(BACKEND, "rank does not fit a c int"))?;
        let id = exchange_id(&membership, store, deadline)?;

        let cuda =
            |doing: &str, e| membership.error(BACKEND, format!("{doing}: {}", driver_text(e)));
        let stream = ctx.new_stream().map_err(|e| cuda("creating a stream", e))?;
        let copy = ctx.new_stream().map_err(|e| cuda("creating a stream", e))?;
        let done = ctx
            .new_event(None)
            .map_err(|e| cuda("creating an event", e))?;
        let staging = PinnedStaging::new(&ctx, options.chunk.max(1))?;
        ctx.bind_to_thread()
            .map_err(|e| cuda("binding the context", e))?;

        let mut config = sys::ncclConfig_t {
            size: std::mem::size_of::<sys::ncclConfig_t>(),
            magic: 0xcafe_beef,
            version: 22800,
            blocking: 0,
            cgaClusterSize: UNDEF_INT,
            minCTAs: UNDEF_INT,
            maxCTAs: UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: UNDEF_INT,
            trafficClass: UNDEF_INT,
            commName: std::ptr::null(),
            collnetEnable: UNDEF_INT,
            CTAPolicy: UNDEF_INT,
            shrinkShare: UNDEF_INT,
            nvlsCTAs: UNDEF_INT,
            nChannelsPerNetPeer: UNDEF_INT,
            nvlinkCentricSched: UNDEF_INT,
            graphUsageMode: UNDEF_INT,
            numRmaCtx: UNDEF_INT,
            maxP2pPeers: UNDEF_INT,
        };
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `raw` and `config` are valid for the call (NCCL copies the config; the
        // non-blocking init keeps no pointer to it); `id` is the 128-byte unique id every
        // rank shares; the device context is bound to this thread.
        let init = unsafe { nccl::comm_init_rank_config(&mut raw, world, id, rank, &mut config) };
        let mut comm = RawComm {
            comm: raw,
            ctx: ctx.clone(),
        };
        if let Err(e) = init {
            let reason = format!("ncclCommInitRankConfig: {}", nccl_text(code_of(&e)));
            comm.abort();
            return Err(membership.error(BACKEND, reason));
        }
        if !comm.is_live() {
            return Err(
                membership.error(BACKEND, "ncclCommInitRankConfig returned no communicator")
            );
        }
        let mut this = Self {
            membership,
            comm,
            ring: None,
            staging,
            done,
            copy,
            stream,
            ctx,
            aborted: None,
        };
        let r = this.settle("init (waiting for every rank)", deadline);
        this.guard(r)?;
        Ok(this)
    }

    /// The CUDA context (device) of this rank.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream the collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Broadcasts `len` bytes from `src` on `root` into `dst` on every rank (out of place;
    /// `src` is ignored on the other ranks). With one rank this is NCCL's device copy.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    pub fn broadcast_into(
        &mut self,
        src: Option<&CudaSlice<u8>>,
        dst: &mut CudaSlice<u8>,
        len: usize,
        root: usize,
        deadline: Instant,
    ) -> Result<()> {
        let r = (|| {
            self.check_call(len, dst.len(), root)?;
            let m = &self.membership;
            let src = match src {
                Some(s) if s.len() >= len => Some(s),
                _ if m.rank == root => {
                    let reason = format!("the root needs a source of at least {len} bytes");
                    return Err(m.error(BACKEND, reason));
                }
                _ => None,
            };
            {
                let stream = &self.stream;
                let (dptr, _g) = dst.device_ptr_mut(stream);
                let (sptr, _gs) = match src {
                    Some(s) => {
                        let (p, g) = s.device_ptr(stream);
                        (p, Some(g))
                    }
                    None => (dptr, None),
                };
                enqueue(m, &self.comm, stream, (sptr, dptr), len, root)?;
            }
            self.settle("broadcast enqueue", deadline)?;
            self.finish("broadcast", len, deadline)
        })();
        self.guard(r)
    }

    /// Fails at once when aborted or the arguments cannot work; binds the context to this
    /// thread.
    fn check_call(&self, len: usize, cap: usize, peer: usize) -> Result<()> {
        if let Some(reason) = &self.aborted {
            return Err(self.membership.error(BACKEND, format!("aborted: {reason}")));
        }
        if len > cap {
            return Err(self.membership.error(
                BACKEND,
                format!("{len} bytes do not fit a {cap}-byte buffer"),
            ));
        }
        if peer >= self.membership.world {
            return Err(self.membership.error(
                BACKEND,
                format!("rank {peer} is not in a world of {}", self.membership.world),
            ));
        }
        self.bind()
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| {
            self.membership
                .error(BACKEND, format!("binding the context: {}", driver_text(e)))
        })
    }

    /// Aborts on error (the contract of every call), passing the result through.
    fn guard<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.abort(&e.to_string());
        }
        r
    }

    /// Polls `ncclCommGetAsyncError` until NCCL is no longer in progress (non-blocking
    /// communicators return before their work is enqueued or their init done).
    fn settle(&mut self, what: &str, deadline: Instant) -> Result<()> {
        let start = Instant::now();
        loop {
            match self.comm.async_code() {
                SUCCESS => return Ok(()),
                IN_PROGRESS => {}
                code => {
                    return Err(self.membership.error(
                        BACKEND,
                        format!("{what}: {} {}", nccl_text(code), self.comm.last_error()),
                    ));
                }
            }
            if Instant::now() >= deadline {
                return Err(self.timeout(what, start));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Records `done` on the stream and polls it and NCCL's async error until the enqueued
    /// work finished, NCCL failed, or `deadline` passed.
    fn finish(&mut self, what: &str, len: usize, deadline: Instant) -> Result<()> {
        let start = Instant::now();
        record(&self.membership, &self.done, &self.stream)?;
        let mut polls = 0u32;
        loop {
            match self.done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    return Err(self.membership.error(
                        BACKEND,
                        format!("{what} of {len} bytes: {}", driver_text(e)),
                    ));
                }
            }
            let code = self.comm.async_code();
            if code != SUCCESS && code != IN_PROGRESS {
                return Err(self.membership.error(
                    BACKEND,
                    format!(
                        "{what} of {len} bytes: {} {}",
                        nccl_text(code),
                        self.comm.last_error()
                    ),
                ));
            }
            if Instant::now() >= deadline {
                return Err(self.timeout(&format!("{what} of {len} bytes"), start));
            }
            polls = polls.saturating_add(1);
            if polls < 200 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    fn timeout(&self, what: &str, start: Instant) -> Error {
        let m = &self.membership;
        Error::Timeout {
            what: format!(
                "nccl {what} (group `{}`, generation {}, rank {})",
                m.group, m.generation, m.rank
            ),
            after: start.elapsed(),
        }
    }

    fn ensure_ring(&mut self) -> Result<()> {
        let chunk = self.staging.chunk();
        if self
            .ring
            .as_ref()
            .is_some_and(|r| r.chunks[0].len() >= chunk)
        {
            return Ok(());
        }
        let cuda = |doing: &str, e| {
            self.membership
                .error(BACKEND, format!("{doing}: {}", driver_text(e)))
        };
        let a = self
            .stream
            .alloc_zeros::<u8>(chunk)
            .map_err(|e| cuda("allocating a broadcast chunk", e))?;
        let b = self
            .stream
            .alloc_zeros::<u8>(chunk)
            .map_err(|e| cuda("allocating a broadcast chunk", e))?;
        let ev = || self.ctx.new_event(None);
        let sent = [
            ev().map_err(|e| cuda("creating an event", e))?,
            ev().map_err(|e| cuda("creating an event", e))?,
        ];
        let copied = [
            ev().map_err(|e| cuda("creating an event", e))?,
            ev().map_err(|e| cuda("creating an event", e))?,
        ];
        self.ring = Some(Ring {
            chunks: [a, b],
            sent,
            copied,
        });
        Ok(())
    }

    /// Checks the call and makes the device ring; returns the chunk size.
    fn host_setup(&mut self, root: usize) -> Result<usize> {
        self.check_call(0, 0, root)?;
        self.ensure_ring()?;
        Ok(self.staging.chunk())
    }

    /// Waits for the broadcasts and the staging copies of a host broadcast of `len` bytes.
    fn host_finish(&mut self, len: usize, deadline: Instant) -> Result<()> {
        self.settle("broadcast enqueue", deadline)?;
        self.finish("host broadcast", len, deadline)?;
        self.staging.wait_idle(deadline)
    }

    /// The root's side of a host broadcast: chunk k+1 is copied to the device while chunk
    /// k is broadcast.
    fn root_send(&mut self, bytes: &[u8], deadline: Instant) -> Result<()> {
        let root = self.membership.rank;
        let chunk = self.host_setup(root)?;
        let Some(ring) = self.ring.as_mut() else {
            return Err(Error::State("nccl: broadcast ring missing"));
        };
        let m = &self.membership;
        let (comm, nccl_stream, copy) = (&self.comm, &*self.stream, &*self.copy);
        for (k, part) in bytes.chunks(chunk).enumerate() {
            let s = k % 2;
            // Device chunk `s` is refilled once its previous broadcast is done.
            wait(m, copy, &ring.sent[s])?;
            {
                let (dptr, _g) = ring.chunks[s].device_ptr_mut(copy);
                self.staging.push(k, part, dptr, copy, deadline)?;
            }
            handoff(m, &ring.copied[s], copy, nccl_stream)?;
            let (dptr, _g) = ring.chunks[s].device_ptr_mut(nccl_stream);
            enqueue(m, comm, nccl_stream, (dptr, dptr), part.len(), root)?;
            record(m, &ring.sent[s], nccl_stream)?;
        }
        self.host_finish(bytes.len(), deadline)
    }

    fn broadcast_host_inner(
        &mut self,
        bytes: &mut [u8],
        root: usize,
        deadline: Instant,
    ) -> Result<()> {
        if self.membership.rank == root {
            return self.root_send(bytes, deadline);
        }
        let chunk = self.host_setup(root)?;
        let Some(ring) = self.ring.as_mut() else {
            return Err(Error::State("nccl: broadcast ring missing"));
        };
        let m = &self.membership;
        let (comm, nccl_stream, copy) = (&self.comm, &*self.stream, &*self.copy);
        let mut pending: Option<(usize, &mut [u8])> = None;
        for (k, part) in bytes.chunks_mut(chunk).enumerate() {
            let s = k % 2;
            // Broadcast into device chunk `s` once its previous host copy is done.
            wait(m, nccl_stream, &ring.copied[s])?;
            {
                let (dptr, _g) = ring.chunks[s].device_ptr_mut(nccl_stream);
                enqueue(m, comm, nccl_stream, (dptr, dptr), part.len(), root)?;
            }
            handoff(m, &ring.sent[s], nccl_stream, copy)?;
            {
                let (dptr, _g) = ring.chunks[s].device_ptr(copy);
                self.staging.pull(k, dptr, part.len(), copy, deadline)?;
            }
            record(m, &ring.copied[s], copy)?;
            // While chunk k is broadcast and copied, the CPU drains chunk k-1.
            if let Some((j, prev)) = pending.take() {
                self.staging.take(j, prev, deadline)?;
            }
            pending = Some((k, part));
        }
        if let Some((j, prev)) = pending {
            self.staging.take(j, prev, deadline)?;
        }
        self.host_finish(bytes.len(), deadline)
    }

    /// Checks, enqueues and waits for one send (`send`) or receive of `len` bytes at `ptr`
    /// (a buffer of `cap` bytes) with `peer`.
    fn p2p(
        &mut self,
        ptr: u64,
        len: usize,
        cap: usize,
        peer: usize,
        send: bool,
        deadline: Instant,
    ) -> Result<()> {
        self.check_call(len, cap, peer)?;
        if peer == self.membership.rank {
            return Err(self
                .membership
                .error(BACKEND, "send/recv with itself (use a device copy)"));
        }
        let what = if send { "send" } else { "recv" };
        let (ty, peer, comm) = (
            sys::ncclDataType_t::ncclUint8,
            peer as c_int,
            self.comm.comm,
        );
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        // SAFETY: `ptr` is a live device allocation of at least `len` bytes borrowed by the
        // caller for the whole call (the call waits for the stream before returning);
        // stream and communicator are live and belong to the bound context.
        let r = unsafe {
            if send {
                nccl::send(ptr as *const c_void, len, ty, peer, comm, stream).map(drop)
            } else {
                nccl::recv(ptr as *mut c_void, len, ty, peer, comm, stream).map(drop)
            }
        };
        r.map_err(|e| {
            self.membership
                .error(BACKEND, format!("nccl {what}: {}", nccl_text(code_of(&e))))
        })?;
        self.settle("p2p enqueue", deadline)?;
        self.finish(what, len, deadline)
    }
}

/// Records `event` on `stream`.
fn record(m: &Membership, event: &CudaEvent, stream: &CudaStream) -> Result<()> {
    event
        .record(stream)
        .map_err(|e| m.error(BACKEND, format!("recording an event: {}", driver_text(e))))
}

/// Makes `stream` wait for the work recorded in `event`.
fn wait(m: &Membership, stream: &CudaStream, event: &CudaEvent) -> Result<()> {
    stream
        .wait(event)
        .map_err(|e| m.error(BACKEND, format!("ordering streams: {}", driver_text(e))))
}

/// Records `event` on `from` and makes `to` wait for it.
fn handoff(m: &Membership, event: &CudaEvent, from: &CudaStream, to: &CudaStream) -> Result<()> {
    record(m, event, from)?;
    wait(m, to, event)
}

/// Enqueues a broadcast from `src` (read on the root) into `dst` (in place when equal); a
/// free function so the ring can stay borrowed.
fn enqueue(
    m: &Membership,
    comm: &RawComm,
    stream: &CudaStream,
    (src, dst): (u64, u64),
    len: usize,
    root: usize,
) -> Result<()> {
    if !comm.is_live() {
        return Err(m.error(BACKEND, "aborted"));
    }
    // SAFETY: `src` and `dst` are live device allocations of at least `len` bytes (checked
    // by the callers; `src` is read on the root only) that stays alive until the stream passed this broadcast: either the caller
    // waits for the stream before giving the buffer back, or it is one of the ring's chunks,
    // owned by the communicator, whose drop aborts NCCL before the ring is freed. Stream and
    // communicator are live and belong to the bound context.
    let r = unsafe {
        nccl::broadcast(
            src as *const c_void,
            dst as *mut c_void,
            len,
            sys::ncclDataType_t::ncclUint8,
            root as c_int,
            comm.comm,
            stream.cu_stream() as sys::cudaStream_t,
        )
    };
    r.map(|_| ()).map_err(|e| {
        m.error(
            BACKEND,
            format!("ncclBroadcast: {}", nccl_text(code_of(&e))),
        )
    })
}

/// Rank 0 creates the unique id and publishes it; the others wait for it.
fn exchange_id(
    m: &Membership,
    store: &dyn Rendezvous,
    deadline: Instant,
) -> Result<sys::ncclUniqueId> {
    let key = m.key("nccl-id");
    let wire = if m.rank == 0 {
        let id = nccl::get_uniqueid().map_err(|e| {
            m.error(
                BACKEND,
                format!("ncclGetUniqueId: {}", nccl_text(code_of(&e))),
            )
        })?;
        let wire = NcclUniqueId(id.internal.iter().map(|&c| c as u8).collect());
        store.set(&key, &refit_runtime::wire::encode(&wire)?)?;
        wire
    } else {
        let left = deadline.saturating_duration_since(Instant::now());
        let bytes = store.wait_get(&key, left)?;
        let wire: NcclUniqueId = refit_runtime::wire::decode(&bytes, 4096)?;
        wire.validate()?;
        wire
    };
    let mut internal = [0 as std::ffi::c_char; 128];
    for (dst, &src) in internal.iter_mut().zip(&wire.0) {
        *dst = src as std::ffi::c_char;
    }
    Ok(sys::ncclUniqueId { internal })
}

impl Communicator for NcclCommunicator {
    type Buf = CudaSlice<u8>;

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn membership(&self) -> &Membership {
        &self.membership
    }

    fn alloc(&mut self, len: usize) -> Result<Self::Buf> {
        let r = (|| {
            self.check_call(0, 0, 0)?;
            self.stream.alloc_zeros::<u8>(len).map_err(|e| {
                self.membership.error(
                    BACKEND,
                    format!("allocating {len} device bytes: {}", driver_text(e)),
                )
            })
        })();
        self.guard(r)
    }

    fn upload(&mut self, src: &[u8], dst: &mut Self::Buf, deadline: Instant) -> Result<()> {
        let r = (|| {
            self.check_call(src.len(), dst.len(), 0)?;
            let (dptr, _g) = dst.device_ptr_mut(&self.stream);
            self.staging.upload(src, dptr, &self.stream, deadline)
        })();
        self.guard(r)
    }

    fn download(&mut self, src: &Self::Buf, dst: &mut [u8], deadline: Instant) -> Result<()> {
        let r = (|| {
            self.check_call(dst.len(), src.len(), 0)?;
            let (sptr, _g) = src.device_ptr(&self.stream);
            self.staging.download(sptr, dst, &self.stream, deadline)
        })();
        self.guard(r)
    }

    fn broadcast(
        &mut self,
        buf: &mut Self::Buf,
        len: usize,
        root: usize,
        deadline: Instant,
    ) -> Result<()> {
        let r = (|| {
            self.check_call(len, buf.len(), root)?;
            {
                let (dptr, _g) = buf.device_ptr_mut(&self.stream);
                enqueue(
                    &self.membership,
                    &self.comm,
                    &self.stream,
                    (dptr, dptr),
                    len,
                    root,
                )?;
            }
            self.settle("broadcast enqueue", deadline)?;
            self.finish("broadcast", len, deadline)
        })();
        self.guard(r)
    }

    fn send(&mut self, buf: &Self::Buf, len: usize, peer: usize, deadline: Instant) -> Result<()> {
        let stream = self.stream.clone();
        let (ptr, _g) = buf.device_ptr(&stream);
        let r = self.p2p(ptr, len, buf.len(), peer, true, deadline);
        self.guard(r)
    }

    fn recv(
        &mut self,
        buf: &mut Self::Buf,
        len: usize,
        peer: usize,
        deadline: Instant,
    ) -> Result<()> {
        let cap = buf.len();
        let stream = self.stream.clone();
        let (ptr, _g) = buf.device_ptr_mut(&stream);
        let r = self.p2p(ptr, len, cap, peer, false, deadline);
        self.guard(r)
    }

    fn broadcast_host(&mut self, bytes: &mut [u8], root: usize, deadline: Instant) -> Result<()> {
        let r = self.broadcast_host_inner(bytes, root, deadline);
        self.guard(r)
    }

    fn broadcast_send(&mut self, bytes: &[u8], deadline: Instant) -> Result<()> {
        let r = self.root_send(bytes, deadline);
        self.guard(r)
    }

    fn abort(&mut self, reason: &str) {
        if self.aborted.is_none() {
            self.aborted = Some(reason.to_owned());
            tracing::warn!(
                group = %self.membership.group,
                generation = self.membership.generation,
                rank = self.membership.rank,
                reason,
                "nccl communicator aborted"
            );
        }
        self.comm.abort();
    }

    fn is_aborted(&self) -> bool {
        self.aborted.is_some()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;

    /// A rendezvous store in a map, for one process.
    #[derive(Default)]
    struct MapStore(Mutex<HashMap<String, Vec<u8>>>);

    impl Rendezvous for MapStore {
        fn set(&self, key: &str, value: &[u8]) -> Result<()> {
            self.0
                .lock()
                .map_err(|_| Error::State("poisoned"))?
                .insert(key.to_owned(), value.to_vec());
            Ok(())
        }

        fn wait_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
            let map = self.0.lock().map_err(|_| Error::State("poisoned"))?;
            map.get(key).cloned().ok_or(Error::Timeout {
                what: key.to_owned(),
                after: timeout,
            })
        }
    }

    /// Without a GPU (CI) connecting is an error that carries the probe's reason, never a
    /// panic; with one, a one-rank communicator moves host bytes through device memory and
    /// publishes its id under the membership's key.
    #[test]
    fn nccl_connect_without_gpu_is_an_error_and_with_one_round_trips() {
        let store = MapStore::default();
        let m = Membership::new("gpu-test", 3, 0, 1).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let options = NcclOptions {
            device: 0,
            chunk: 1 << 20,
        };
        match NcclCommunicator::connect(m.clone(), &store, options, deadline) {
            Err(e) => {
                assert!(crate::gpu::probe().is_err() || !nccl_present(), "{e}");
                let msg = e.to_string();
                assert!(msg.contains("nccl collective `gpu-test`"), "{msg}");
                assert!(msg.contains("no gpu") || msg.contains("libnccl"), "{msg}");
            }
            Ok(mut comm) => {
                assert!(store.wait_get(&m.key("nccl-id"), Duration::ZERO).is_ok());
                let mut bytes: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 251) as u8).collect();
                let want = bytes.clone();
                comm.broadcast_host(&mut bytes, 0, deadline).unwrap();
                let mut buf = comm.alloc(bytes.len()).unwrap();
                comm.upload(&bytes, &mut buf, deadline).unwrap();
                let mut back = vec![0u8; bytes.len()];
                comm.download(&buf, &mut back, deadline).unwrap();
                assert_eq!(back, want);
                assert!(comm.send(&buf, 1, 0, deadline).is_err());
                comm.abort("test over");
                assert!(comm.is_aborted());
                assert!(comm.broadcast(&mut buf, 1, 0, deadline).is_err());
            }
        }
    }
}
