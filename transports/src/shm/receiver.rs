//! The receiving end: attaches to the board, pins and reads slots (in place, or copied out
//! when asked to or when the sender marked it behind), verifies the checksum when the board
//! carries one, acknowledges, and holds its table entry for as long as its weight sets live.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use refit_runtime::copy::copy_threads;
use refit_runtime::metrics::{self, Phase};
use refit_runtime::wait::{Wait, poll_until, wait_until};
use refit_runtime::{
    Error, Group, Manifest, Manifests, ModelId, ReceiverTransport, Result, SharedBytes, Version,
    WeightSet, wire,
};

use super::board::*;
use super::checksum::{checksum, copy_hashed};
use super::layout::*;
use super::lease::{self, Heartbeat, Identity};
use super::segment::Segment;
use super::{LIVENESS_EVERY, NAME, ShmReceiverSpec, futex};
use crate::cuda_ipc::ImportSlots;
use crate::gpu::ipc::IpcHandle;
use crate::pool::{BufPool, PooledBuf};

/// The deadline of reading one exported slot into host memory (bounded work: no peer to
/// wait for), whatever the caller's deadline for the next version.
const EXPORTED_READ: Duration = Duration::from_secs(60);

/// How a receiver reads a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShmReadMode {
    /// Serve each version from the slot where the sender wrote it, the slot pinned while
    /// any weight set of it lives (default): N receivers cost one copy, the sender's, and a
    /// receiver has a version as soon as it is committed. A receiver that holds a version
    /// while two newer ones are published is marked behind by the sender and reads its next
    /// version into private memory instead (then pins again); see [`ShmSender`]'s slot
    /// policy for what the sender does meanwhile. Never torn: the sender does not write
    /// into a pinned slot.
    ///
    /// [`ShmSender`]: super::ShmSender
    #[default]
    ZeroCopy,
    /// Copy every version into private memory (arenas recycled), the slot pinned only for
    /// the copy: for a program that keeps many versions alive, or wants its weights in
    /// memory no other process maps. Costs each receiver one `memcpy` per update.
    Copy,
}

/// The receiver's claim on its table entry; freed when the receiver and every zero-copy
/// weight set it handed out are gone.
#[derive(Debug)]
pub(super) struct Lease {
    board: Arc<Segment>,
    idx: usize,
    heartbeat: Option<Heartbeat>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.heartbeat = None;
        // free the entry only while it is still ours: a receiver the sender declared dead
        // (a stall past its lease seen from another pid namespace) may find it reaped and
        // claimed by another receiver, whose record names another identity
        let owner = receiver(self.idx) + R_OWNER;
        if let Ok(state) = self.board.u32_at(receiver(self.idx) + R_STATE)
            && state
                .compare_exchange(
                    RECEIVER_CLAIMED,
                    RECEIVER_FREEING,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok()
        {
            if lease::record_pid(&self.board, owner) == Identity::current().pid {
                let _ = lease::clear_record(&self.board, owner);
                state.store(RECEIVER_FREE, Ordering::SeqCst);
            } else {
                state.store(RECEIVER_CLAIMED, Ordering::SeqCst);
            }
        }
        if let Ok(ack) = self.board.u32_at(OFF_ACK_SEQ) {
            ack.fetch_add(1, Ordering::SeqCst);
            futex::wake_all(ack);
        }
    }
}

/// A pinned slot: served without copying, or held while a copy is taken.
pub(super) struct PinnedSlot {
    lease: Arc<Lease>,
    data: Arc<Segment>,
    pin_off: usize,
    off: usize,
    len: usize,
}

impl SharedBytes for PinnedSlot {
    fn bytes(&self) -> &[u8] {
        // Bounds were checked when the slot was pinned (same offsets); an empty slice is the
        // only fallback and cannot happen for a well-formed directory.
        self.data.bytes(self.off, self.len).unwrap_or(&[])
    }
}

impl Drop for PinnedSlot {
    fn drop(&mut self) {
        if let Ok(p) = self.lease.board.u32_at(self.pin_off) {
            // never below zero: the sender's reaper zeroes the pins of an entry it frees
            let _ = p.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        }
    }
}

pub(super) struct Attached {
    board: Arc<Segment>,
    lease: Arc<Lease>,
    models: Vec<(ModelId, Arc<Manifest>, Arc<Segment>)>,
    n_slots: usize,
    /// The sender's lease.
    lease_len: Duration,
    /// Every version carries a checksum to verify ([`FLAG_CHECKSUM`]).
    checksum: bool,
    /// Per model, the handles of its exported slots (empty on a plain shm board).
    exported: Vec<Vec<IpcHandle>>,
}

/// A receiving end.
pub struct ShmReceiver {
    spec: ShmReceiverSpec,
    mode: ShmReadMode,
    attached: Option<Attached>,
    seen: Vec<u64>,
    pool: Arc<BufPool>,
    /// Versions read into private memory.
    copied: u64,
    /// The exported slots, opened (the `cuda-ipc` link's receiver).
    imports: Option<Box<dyn ImportSlots>>,
}

impl std::fmt::Debug for ShmReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmReceiver")
            .field("spec", &self.spec)
            .field("mode", &self.mode)
            .field("attached", &self.attached.is_some())
            .field("imports", &self.imports)
            .finish()
    }
}

impl ShmReceiver {
    /// A receiver for `spec` (local only: nothing is opened until `connect`).
    pub fn new(spec: ShmReceiverSpec) -> Self {
        Self {
            spec,
            mode: ShmReadMode::default(),
            attached: None,
            seen: Vec::new(),
            pool: Arc::default(),
            copied: 0,
            imports: None,
        }
    }

    /// Versions (one per model per update) this receiver read into private memory: every
    /// one in [`ShmReadMode::Copy`] or from exported slots; in [`ShmReadMode::ZeroCopy`],
    /// those it read while the sender had marked it behind.
    pub fn versions_copied(&self) -> u64 {
        self.copied
    }

    /// A receiver of a board whose slots live in exported memory (a `cuda-ipc` board, see
    /// [`ShmSender::create_exported`](super::ShmSender::create_exported)): `imports` opens
    /// the slots' handles once, at `connect`, and copies each version out of its slot into
    /// host memory (the read mode is then always [`ShmReadMode::Copy`]).
    #[must_use]
    pub fn with_imports(mut self, imports: Box<dyn ImportSlots>) -> Self {
        self.imports = Some(imports);
        self
    }

    /// Chooses how slots are read.
    #[must_use]
    pub fn with_mode(mut self, mode: ShmReadMode) -> Self {
        self.mode = mode;
        self
    }

    fn attach(&self) -> Result<Option<Attached>> {
        let board = match Segment::open(&self.spec.board, true) {
            Ok(b) => Arc::new(b),
            Err(Error::Path { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        if board.len() < OFF_RECEIVERS || board.u64_at(OFF_MAGIC)?.load(Ordering::Acquire) != MAGIC
        {
            return Ok(None);
        }
        let layout = board.u32_at(OFF_LAYOUT)?.load(Ordering::Relaxed);
        Error::check_protocol(
            format!("the shm board {}", self.spec.board.display()),
            LAYOUT_NAME,
            LAYOUT,
            layout,
        )?;
        match state_word(&board)?.load(Ordering::SeqCst) {
            STATE_LIVE => {}
            STATE_SHUTDOWN => {
                return Err(sender_gone(&board, "shut down"));
            }
            STATE_INIT => return Ok(None),
            other => return Err(shm_err(format!("board is in unknown state {other}"))),
        }
        let max_receivers = board.u32_at(OFF_MAX_RECEIVERS)?.load(Ordering::Relaxed) as usize;
        let n_slots = board.u32_at(OFF_N_SLOTS)?.load(Ordering::Relaxed) as usize;
        let checksum = board.u32_at(OFF_FLAGS)?.load(Ordering::Relaxed) & FLAG_CHECKSUM != 0;
        let dir_len = usize::try_from(board.u64_at(OFF_DIR_LEN)?.load(Ordering::Relaxed))
            .map_err(|_| shm_err("directory length overflows"))?;
        let dir: Directory = wire::decode(
            board.bytes(directory_offset(max_receivers), dir_len)?,
            wire::MAX_CONTROL_MESSAGE,
        )?;
        if dir.models.len() > MAX_MODELS || !(2..=MAX_SLOTS).contains(&n_slots) {
            return Err(shm_err("board directory is malformed"));
        }
        let on_device = dir.models.iter().any(|m| !m.exported.is_empty());
        match (on_device, &self.imports) {
            (true, None) => {
                return Err(shm_err(format!(
                    "the board {} keeps its slots in device memory (a cuda-ipc link): open it with the cuda-ipc link",
                    self.spec.board.display()
                )));
            }
            (false, Some(i)) => {
                return Err(shm_err(format!(
                    "the board {} keeps its slots in shared memory: it is not a {} board",
                    self.spec.board.display(),
                    i.name()
                )));
            }
            _ => {}
        }
        let mut models = Vec::with_capacity(dir.models.len());
        let mut exported = Vec::with_capacity(dir.models.len());
        for m in dir.models {
            let seg = Arc::new(Segment::open(&m.data, false)?);
            let stride = if on_device {
                let fits = m.exported.len() == n_slots
                    && m.exported.iter().all(|h| h.len >= m.manifest.total_len());
                if !fits {
                    return Err(shm_err(format!(
                        "the exported slots of `{}` do not match its manifest and {n_slots} slots",
                        m.id
                    )));
                }
                PAGE
            } else {
                slot_stride(m.manifest.total_len())
            };
            if seg.len() < stride * n_slots {
                return Err(shm_err(format!("data segment of `{}` is too small", m.id)));
            }
            models.push((m.id, Arc::new(m.manifest), seg));
            exported.push(m.exported);
        }
        let lease_len = board_lease(&board)?;
        let mut idx = None;
        for r in 0..max_receivers {
            let state = board.u32_at(receiver(r) + R_STATE)?;
            if state.load(Ordering::SeqCst) != RECEIVER_FREE {
                continue;
            }
            // a fresh beat before the claim: the sender's reaper, which may look at the
            // entry before the identity is written, sees a live claimant (and rival
            // claimants only ever write the same kind of value here)
            board
                .u64_at(receiver(r) + R_OWNER + lease::REC_BEAT)?
                .store(lease::now_ns(), Ordering::SeqCst);
            if state
                .compare_exchange(
                    RECEIVER_FREE,
                    RECEIVER_CLAIMED,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok()
            {
                idx = Some(r);
                break;
            }
        }
        let idx =
            idx.ok_or_else(|| shm_err(format!("all {max_receivers} receiver entries are taken")))?;
        // from here on the lease frees the entry whatever fails
        let mut lease = Lease {
            board: Arc::clone(&board),
            idx,
            heartbeat: None,
        };
        lease::write_record(&board, receiver(idx) + R_OWNER, Identity::current())?;
        lease.heartbeat = Some(Heartbeat::start(
            Arc::clone(&board),
            receiver(idx) + R_OWNER,
            lease_len,
        )?);
        for m in 0..MAX_MODELS {
            board.u64_at(acked(idx, m))?.store(0, Ordering::SeqCst);
        }
        board.u32_at(behind(idx))?.store(0, Ordering::SeqCst);
        let lease = Arc::new(lease);
        let ack = board.u32_at(OFF_ACK_SEQ)?;
        ack.fetch_add(1, Ordering::SeqCst);
        futex::wake_all(ack);
        Ok(Some(Attached {
            board,
            lease,
            models,
            n_slots,
            lease_len,
            checksum,
            exported,
        }))
    }

    /// Pins every fresh model's slot, or nothing (a writer raced us: try again).
    fn try_pin(a: &Attached, fresh: &[(usize, u64, usize)]) -> Result<bool> {
        let mut pinned: Vec<&AtomicU32> = Vec::with_capacity(fresh.len());
        for &(m, version, slot) in fresh {
            let p = a.board.u32_at(pin(a.lease.idx, m, slot))?;
            p.fetch_add(1, Ordering::SeqCst);
            pinned.push(p);
            let seg = &a.models[m].2;
            let base = slot * (seg.len() / a.n_slots);
            let seq = seg.u64_at(base)?.load(Ordering::SeqCst);
            let v = seg.u64_at(base + 8)?.load(Ordering::SeqCst);
            if seq % 2 == 1 || v != version {
                for p in pinned {
                    p.fetch_sub(1, Ordering::SeqCst);
                }
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn take_fresh(&mut self, deadline: Instant) -> Result<Option<Group>> {
        let Some(a) = &self.attached else {
            return Err(Error::State("shm receiver is not connected"));
        };
        loop {
            let board = read_board(&a.board, a.models.len(), a.lease_len, deadline)?;
            let fresh: Vec<(usize, u64, usize)> = board
                .iter()
                .enumerate()
                .filter(|(m, (v, _))| *v > self.seen[*m])
                .map(|(m, &(v, s))| (m, v, s as usize))
                .collect();
            if fresh.is_empty() {
                return Ok(None);
            }
            if fresh.iter().any(|&(_, _, s)| s >= a.n_slots) {
                return Err(shm_err("board points at a slot that does not exist"));
            }
            if !Self::try_pin(a, &fresh)? {
                std::thread::yield_now();
                continue;
            }
            // every pin is owned from here on: released when its slot is dropped
            let pinned: Vec<PinnedSlot> = fresh
                .iter()
                .map(|&(m, _, slot)| {
                    let (_, manifest, seg) = &a.models[m];
                    PinnedSlot {
                        lease: Arc::clone(&a.lease),
                        data: Arc::clone(seg),
                        pin_off: pin(a.lease.idx, m, slot),
                        off: slot * (seg.len() / a.n_slots) + PAGE,
                        len: manifest.total_len(),
                    }
                })
                .collect();
            // a reader the sender marked behind takes this version into private memory,
            // so that it holds no slot while it lags (the mark is used up here)
            let marked = a
                .board
                .u32_at(behind(a.lease.idx))?
                .swap(0, Ordering::SeqCst)
                != 0;
            // exported slots are always copied out, by their owner
            let copy = self.mode == ShmReadMode::Copy || marked || self.imports.is_some();
            let mut group = Vec::with_capacity(fresh.len());
            let mut result = Ok(());
            for (&(m, version, index), slot) in fresh.iter().zip(pinned) {
                let imports = self.imports.as_mut();
                let at = (m, version, index);
                let read = Self::read_slot(a, &self.pool, at, slot, copy, imports);
                match read {
                    Ok(ws) => group.push(Arc::new(ws)),
                    Err(e) => result = Err(e),
                }
            }
            // a refused version is not read again: the next one is awaited
            for &(m, v, _) in &fresh {
                self.seen[m] = v;
            }
            result?;
            if copy {
                self.copied += group.len() as u64;
            }
            return Ok(Some(group));
        }
    }

    /// One model's version from its pinned `slot`: served in place, or (`copy`) copied into
    /// a pooled arena and the slot released; its checksum verified when the board has them.
    /// Exported slots (`imports`) are always copied, by their owner.
    fn read_slot(
        a: &Attached,
        pool: &Arc<BufPool>,
        (m, version, index): (usize, u64, usize),
        slot: PinnedSlot,
        copy: bool,
        imports: Option<&mut Box<dyn ImportSlots>>,
    ) -> Result<WeightSet> {
        let (id, manifest, seg) = &a.models[m];
        let base = slot.off - PAGE;
        let declared = if a.checksum {
            Some(seg.u64_at(base + SLOT_CHECKSUM)?.load(Ordering::SeqCst))
        } else {
            None
        };
        let refuse = |found: u64, declared: u64| Error::Damaged {
            model: id.clone(),
            version: Version(version),
            reason: format!(
                "its bytes hash to {found:#018x}, the sender's checksum is {declared:#018x} \
                 (the shared-memory slot was damaged after it was written)"
            ),
        };
        if !copy {
            if let Some(declared) = declared {
                let verify = metrics::timed(Phase::Verify, NAME, id.as_str());
                let found = checksum(slot.bytes(), copy_threads());
                if found != declared {
                    return Err(refuse(found, declared));
                }
                verify.finish();
            }
            return WeightSet::from_shared(
                id.clone(),
                Version(version),
                Arc::clone(manifest),
                Arc::new(slot),
            );
        }
        let wire = metrics::timed(Phase::Wire, NAME, id.as_str());
        let mut buf = pool.take(slot.len);
        let found = match (imports, declared) {
            // exported slots (device memory): copied out by their owner, then hashed
            (Some(i), _) => {
                let deadline = Instant::now() + EXPORTED_READ;
                i.read(m, index, buf.as_mut_slice(), deadline)?;
                declared.map(|_| checksum(buf.as_slice(), copy_threads()))
            }
            (None, Some(_)) => Some(copy_hashed(
                buf.as_mut_slice(),
                slot.bytes(),
                copy_threads(),
            )),
            (None, None) => {
                refit_runtime::copy::copy_parallel(
                    buf.as_mut_slice(),
                    slot.bytes(),
                    copy_threads(),
                );
                None
            }
        };
        // the header after the copy proves the slot was stable throughout
        let stable = seg.u64_at(base + SLOT_SEQ)?.load(Ordering::SeqCst) % 2 == 0
            && seg.u64_at(base + SLOT_VERSION)?.load(Ordering::SeqCst) == version;
        drop(slot);
        let pooled = PooledBuf::new(buf, pool);
        if !stable {
            return Err(shm_err(format!(
                "a slot of `{id}` changed while pinned, reading version {version} \
                 (protocol violation)"
            )));
        }
        if let (Some(found), Some(declared)) = (found, declared)
            && found != declared
        {
            return Err(refuse(found, declared));
        }
        wire.finish();
        WeightSet::from_shared(
            id.clone(),
            Version(version),
            Arc::clone(manifest),
            Arc::new(pooled),
        )
    }
}

impl ReceiverTransport for ShmReceiver {
    fn name(&self) -> &'static str {
        self.imports.as_ref().map_or(NAME, |i| i.name())
    }

    fn connect(&mut self, deadline: Instant) -> Result<Manifests> {
        let board = self.spec.board.clone();
        let attached = wait_until(
            deadline,
            (),
            |()| {
                Ok(match self.attach()? {
                    Some(a) => Wait::Done(a),
                    None => Wait::Pending(()),
                })
            },
            |(), left| std::thread::sleep(left.min(Duration::from_millis(2))),
            |()| format!("shm sender at {}", board.display()),
        )?;
        if let Some(imports) = self.imports.as_mut() {
            // once per generation: the exported slots live as long as their sender
            // (dropping `attached` on an error frees this receiver's entry)
            imports.open(&attached.exported)?;
        }
        let manifests = Manifests::new(
            attached
                .models
                .iter()
                .map(|(id, m, _)| (id.clone(), Arc::clone(m))),
        )?;
        self.seen = vec![0; attached.models.len()];
        self.attached = Some(attached);
        Ok(manifests)
    }

    fn next_group(&mut self, deadline: Instant) -> Result<Option<Group>> {
        // the state both steps share: the receiver, the commit word last seen, the last
        // liveness check of the sender
        poll_until(
            deadline,
            (self, 0u32, Instant::now()),
            |(me, commit_word, last_check)| {
                let state = {
                    let a = me
                        .attached
                        .as_ref()
                        .ok_or(Error::State("shm receiver is not connected"))?;
                    *commit_word = a.board.u32_at(OFF_COMMIT_SEQ)?.load(Ordering::SeqCst);
                    state_word(&a.board)?.load(Ordering::SeqCst)
                };
                let commit_deadline = deadline.max(Instant::now() + COMMIT_GRACE);
                if let Some(g) = me.take_fresh(commit_deadline)? {
                    return Ok(Wait::Done(g));
                }
                let a = me
                    .attached
                    .as_ref()
                    .ok_or(Error::State("shm receiver is not connected"))?;
                if state == STATE_SHUTDOWN {
                    return Err(sender_gone(&a.board, "shut down"));
                }
                let now = Instant::now();
                if now < deadline && now.duration_since(*last_check) >= LIVENESS_EVERY {
                    *last_check = now;
                    if let Some(why) = lease::dead(&a.board, OFF_SENDER, a.lease_len)? {
                        return Err(sender_gone(&a.board, why));
                    }
                }
                Ok(Wait::Pending(()))
            },
            |(me, commit_word, last_check), left| {
                if let Some(word) = me
                    .attached
                    .as_ref()
                    .and_then(|a| a.board.u32_at(OFF_COMMIT_SEQ).ok())
                {
                    futex::wait(word, commit_word, left.min(LIVENESS_EVERY));
                }
                (me, commit_word, last_check)
            },
        )
    }

    fn ack(&mut self, applied: &[(ModelId, Version)]) -> Result<()> {
        let a = self
            .attached
            .as_ref()
            .ok_or(Error::State("shm receiver is not connected"))?;
        for (id, v) in applied {
            let m = a
                .models
                .iter()
                .position(|(mid, _, _)| mid == id)
                .ok_or_else(|| Error::UnknownModel(id.clone()))?;
            a.board
                .u64_at(acked(a.lease.idx, m))?
                .store(v.get(), Ordering::SeqCst);
        }
        let ack = a.board.u32_at(OFF_ACK_SEQ)?;
        ack.fetch_add(1, Ordering::SeqCst);
        futex::wake_all(ack);
        Ok(())
    }

    fn shutdown(&mut self) -> Result<()> {
        self.attached = None;
        Ok(())
    }
}
