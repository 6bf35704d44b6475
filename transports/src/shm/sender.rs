//! The sending end: creates the board and the data segments, writes each version into a
//! free slot, commits, lends slots for zero-copy publish, frees dead receivers.
//!
//! # Slot policy: a reader that holds a version never slows the others
//!
//! Readers pin the slot of the version they serve (see the receiver's read modes). After
//! every commit the sender looks at the slots of each model it published:
//!
//! - a receiver still pinning a slot older than the one before the version in force (it
//!   holds a version while two newer ones were published) is marked *behind*: it reads its
//!   next version into private memory instead of pinning it, so from its next receive on it
//!   holds no slot (and pins again after that one);
//! - when no slot is left free beyond the version in force and the one before it (the one
//!   receivers that have not yet taken the newest version still read), the sender adds a
//!   slot to the model's segment, up to [`ShmConfig::max_slots`]: the memory is reserved and
//!   mapped then, after the readers were woken for the version just committed, so the next
//!   publish finds a free slot and writes at the usual speed.
//!
//! So a publish never waits for a reader while the model has fewer than `max_slots` slots
//! (each version laggards hold costs one slot of memory, once); at `max_slots`, or when the
//! directory has no room for another slot, a publish waits for a pin to drop, at most until
//! its deadline, and the timeout names the receivers (pids) holding the slots.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use refit_runtime::metrics;
use refit_runtime::wait::{Wait, wait_until};
use refit_runtime::{
    Error, Group, Manifest, Manifests, ModelId, Result, SenderTransport, SharedBytes, Version,
    WeightSet, wire,
};

use super::board::*;
use super::checksum::checksum;
use super::layout::*;
use super::lease::{self, Heartbeat, Identity};
use super::segment::{self, Segment};
use super::{MAX_DEPARTED, NAME, ShmConfig, ShmReceiverSpec, collect, futex};
use crate::cuda_ipc::ExportSlots;
use refit_runtime::copy::copy_threads;

/// A receiver the sender found dead and freed (see [`ShmSender::departed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DepartedReceiver {
    /// Its entry in the receivers' table.
    pub entry: usize,
    /// Its pid, as it saw itself (another pid namespace numbers it differently).
    pub pid: u32,
    /// How its death was told (`process exited`, `no heartbeat for ..`).
    pub reason: String,
}

/// A slot lent to the caller (see [`ShmSender::loan`]).
#[derive(Debug)]
pub(super) struct Loan {
    slot: usize,
    seq: u64,
    off: usize,
    sealed: Arc<AtomicBool>,
}

/// The bytes of a lent slot: writable until the version is published.
pub(super) struct SlotBytes {
    data: Arc<Segment>,
    off: usize,
    len: usize,
    sealed: Arc<AtomicBool>,
}

impl SharedBytes for SlotBytes {
    fn bytes(&self) -> &[u8] {
        self.data.bytes(self.off, self.len).unwrap_or(&[])
    }

    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        if self.sealed.load(Ordering::Acquire) {
            return None;
        }
        let ptr = self.data.ptr_mut(self.off, self.len).ok()?;
        // SAFETY: `ptr..ptr+len` lies in the mapping (checked by `ptr_mut`), which the sender
        // maps writable and `self.data` keeps alive. The slot is claimed (odd sequence) for
        // this loan, so no reader looks at it and the sender writes nothing else there;
        // `&mut self` on the only `SlotBytes` of the loan makes this borrow exclusive. Once
        // published the loan is sealed and no writable borrow is handed out again.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr, self.len) })
    }
}

/// The sending end: owns the segments.
#[derive(Debug)]
pub struct ShmSender {
    pub(super) board: Arc<Segment>,
    heartbeat: Option<Heartbeat>,
    exit_guard: Option<refit_runtime::cleanup::ExitGuard>,
    collected: Vec<PathBuf>,
    lease: Duration,
    departed: Mutex<Vec<DepartedReceiver>>,
    data: Vec<Arc<Segment>>,
    manifests: Vec<Arc<Manifest>>,
    loans: Vec<Option<Loan>>,
    index: BTreeMap<ModelId, usize>,
    /// The models, by index.
    ids: Vec<ModelId>,
    current: Vec<Option<usize>>,
    /// The slot in force before `current`, per model.
    previous: Vec<Option<usize>>,
    /// Slots each data segment has room for.
    capacity: usize,
    /// Slots allocated per model (the first ones of its segment).
    active: Vec<usize>,
    /// Models whose segment could not grow (no room left): they stop trying.
    cannot_grow: Vec<bool>,
    /// Times a receiver was marked behind.
    behind_marks: u64,
    checksum: bool,
    max_receivers: usize,
    expected_receivers: usize,
    closed: bool,
    /// Where the slots' bytes live when not in the data segments (the `cuda-ipc` link).
    exported: Option<Box<dyn ExportSlots>>,
}

/// The models of a new board ([`ShmSender::directory`]).
struct ModelSegments {
    /// The directory's entries, each naming its data segment (and its exported buffers).
    models: Vec<DirModel>,
    /// Each data segment's size: its room for every slot, and the part reserved now.
    sizes: Vec<(usize, usize)>,
    /// Each model's place in the lists.
    index: BTreeMap<ModelId, usize>,
}

/// What a new board's header holds besides the config ([`BoardHeader::write`]).
struct BoardHeader<'a> {
    lease_ms: u32,
    /// Where the directory starts, and its bytes.
    dir_off: usize,
    dir_bytes: &'a [u8],
    /// The models, and the slots each one's segment has room for.
    models: usize,
    capacity: usize,
}

impl BoardHeader<'_> {
    /// Writes the header of a new board: its layout, the sender's lease record, the
    /// directory, the counts and the flags (not the magic: that comes once the data segments
    /// exist).
    fn write(&self, b: &Segment, config: &ShmConfig) -> Result<()> {
        b.u32_at(OFF_LAYOUT)?.store(LAYOUT, Ordering::Relaxed);
        b.u32_at(OFF_SENDER + lease::REC_LEASE_MS)?
            .store(self.lease_ms, Ordering::Relaxed);
        lease::write_record(b, OFF_SENDER, Identity::current())?;
        b.write(self.dir_off, self.dir_bytes)?;
        b.u32_at(OFF_N_MODELS)?
            .store(self.models as u32, Ordering::Relaxed);
        b.u32_at(OFF_N_SLOTS)?
            .store(self.capacity as u32, Ordering::Relaxed);
        b.u32_at(OFF_FLAGS)?.store(
            if config.checksum { FLAG_CHECKSUM } else { 0 },
            Ordering::Relaxed,
        );
        b.u32_at(OFF_MAX_RECEIVERS)?
            .store(config.max_receivers as u32, Ordering::Relaxed);
        b.u64_at(OFF_DIR_LEN)?
            .store(self.dir_bytes.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

impl ShmSender {
    /// Creates the segments for `manifests` (local only: nobody is contacted).
    ///
    /// The data segments have room for [`ShmConfig::max_slots`] slots and start with
    /// [`ShmConfig::slots`] of them reserved and mapped into this process (the first write
    /// into a slot then runs at `memcpy` speed instead of faulting page by page); see the
    /// module docs for when more are added.
    ///
    /// # Errors
    /// Bad configuration (fewer than 2 or more than [`MAX_SLOTS`] slots, `max_slots` above
    /// [`MAX_SLOTS`], more than [`MAX_MODELS`] models, a lease outside 10 ms..=1 h), or the
    /// files cannot be created.
    /// A directory without room for the segments gives, before anything is created, an
    /// [`Error::Path`] whose source is of kind `StorageFull`, naming the sizes and how to
    /// enlarge `/dev/shm` (Docker `--shm-size`, a Kubernetes memory `emptyDir`).
    pub fn create(config: &ShmConfig, manifests: &Manifests) -> Result<Self> {
        Self::create_with(config, manifests, None)
    }

    /// As [`ShmSender::create`], with every slot's bytes in memory `slots` exports (one
    /// buffer per slot and model, handed to receivers by handle in the board's directory):
    /// the `cuda-ipc` link's sender ([`crate::cuda_ipc`]). The board (commit record, pins,
    /// leases) and each slot's header stay in shared memory; the data segments hold the
    /// headers only. Such a sender lends no slots ([`ShmSender::loan`]).
    ///
    /// # Errors
    /// As [`ShmSender::create`]; `slots`' errors exporting the buffers.
    pub fn create_exported(
        config: &ShmConfig,
        manifests: &Manifests,
        slots: Box<dyn ExportSlots>,
    ) -> Result<Self> {
        Self::create_with(config, manifests, Some(slots))
    }

    fn create_with(
        config: &ShmConfig,
        manifests: &Manifests,
        mut exported: Option<Box<dyn ExportSlots>>,
    ) -> Result<Self> {
        let (capacity, lease_ms) = Self::check_config(config, manifests, exported.is_some())?;
        let scheme = uuid::Uuid::new_v4().simple().to_string();
        let ModelSegments {
            models,
            sizes,
            index,
        } = Self::directory(
            config,
            manifests,
            capacity,
            &scheme,
            exported.as_deref_mut(),
        )?;
        let paths: Vec<PathBuf> = models.iter().map(|m| m.data.clone()).collect();
        let dir_bytes = wire::encode(&Directory { models })?;
        let dir_off = directory_offset(config.max_receivers);
        let board_path = config.dir.join(format!("refit-{scheme}-board"));
        let board_len = dir_off + round_up(dir_bytes.len());
        let collected = collect::collect_dead(&config.dir);
        let needed = sizes
            .iter()
            .try_fold(board_len, |a, &(_, b)| a.checked_add(b))
            .ok_or_else(|| shm_err("segment size overflows"))?;
        segment::check_space(&config.dir, &board_path, needed as u64)?;
        // The board comes first and names its owner at once, so that whatever this sender
        // leaves behind if it dies is collected by the next one.
        let board = Arc::new(Segment::create(&board_path, board_len)?);
        let fail = |data: &[Arc<Segment>], e: Error| {
            let _ = board.unlink();
            for d in data {
                let _ = d.unlink();
            }
            e
        };
        let header = BoardHeader {
            lease_ms,
            dir_off,
            dir_bytes: &dir_bytes,
            models: manifests.len(),
            capacity,
        };
        if let Err(e) = header.write(&board, config) {
            return Err(fail(&[], e));
        }
        let heartbeat = match Heartbeat::start(Arc::clone(&board), OFF_SENDER, config.lease) {
            Ok(h) => h,
            Err(e) => return Err(fail(&[], e)),
        };
        let mut data = Vec::with_capacity(paths.len());
        if let Err(e) = Self::create_data(&paths, &sizes, &mut data) {
            return Err(fail(&data, e));
        }
        if let Err(e) = board
            .u64_at(OFF_MAGIC)
            .map(|m| m.store(MAGIC, Ordering::Release))
        {
            return Err(fail(&data, e));
        }
        // SIGINT/SIGTERM (with the handlers installed) release the segments as shutdown does
        let exit_guard = refit_runtime::cleanup::on_exit_signal({
            let (board, data) = (Arc::clone(&board), data.clone());
            move || {
                let _ = release(&board, &data);
            }
        });
        Ok(Self {
            board,
            heartbeat: Some(heartbeat),
            exit_guard: Some(exit_guard),
            collected,
            lease: config.lease,
            departed: Mutex::new(Vec::new()),
            data,
            index,
            ids: manifests.iter().map(|(id, _)| id.clone()).collect(),
            current: vec![None; manifests.len()],
            previous: vec![None; manifests.len()],
            capacity,
            active: vec![config.slots; manifests.len()],
            cannot_grow: vec![false; manifests.len()],
            behind_marks: 0,
            checksum: config.checksum,
            manifests: manifests.iter().map(|(_, m)| Arc::clone(m)).collect(),
            loans: (0..manifests.len()).map(|_| None).collect(),
            max_receivers: config.max_receivers,
            expected_receivers: config.expected_receivers,
            closed: false,
            exported,
        })
    }

    /// Checks a sender's config against the limits of the board: returns the slots each
    /// model's segment has room for and the lease in milliseconds.
    fn check_config(
        config: &ShmConfig,
        manifests: &Manifests,
        exported: bool,
    ) -> Result<(usize, u32)> {
        if !(2..=MAX_SLOTS).contains(&config.slots) {
            return Err(shm_err(format!(
                "slots must be 2..={MAX_SLOTS}, got {}",
                config.slots
            )));
        }
        if config.max_slots > MAX_SLOTS {
            return Err(shm_err(format!(
                "max_slots must be at most {MAX_SLOTS}, got {}",
                config.max_slots
            )));
        }
        // exported slots are exported once, at creation: such a board does not grow
        let capacity = if exported {
            config.slots
        } else {
            config.max_slots.max(config.slots)
        };
        if manifests.is_empty() || manifests.len() > MAX_MODELS {
            return Err(shm_err(format!(
                "a scheme carries 1..={MAX_MODELS} models, got {}",
                manifests.len()
            )));
        }
        if config.max_receivers == 0 || config.max_receivers > 4096 {
            return Err(shm_err("max_receivers must be 1..=4096"));
        }
        let lease_ms = u32::try_from(config.lease.as_millis())
            .ok()
            .filter(|ms| (10..=3_600_000).contains(ms))
            .ok_or_else(|| shm_err(format!("lease must be 10 ms..=1 h, got {:?}", config.lease)))?;
        Ok((capacity, lease_ms))
    }

    /// The board's directory of models (each one's data segment and, for exported slots,
    /// the buffers `exported` exports now), each segment's size (its room for `capacity`
    /// slots, and the part reserved for the slots in use from the start), and each model's
    /// index.
    fn directory(
        config: &ShmConfig,
        manifests: &Manifests,
        capacity: usize,
        scheme: &str,
        mut exported: Option<&mut (dyn ExportSlots + 'static)>,
    ) -> Result<ModelSegments> {
        let mut models = Vec::new();
        let mut sizes = Vec::new();
        let mut index = BTreeMap::new();
        for (i, (id, manifest)) in manifests.iter().enumerate() {
            // exported slots keep their bytes elsewhere: the segment holds their headers
            let stride = match exported {
                Some(_) => PAGE,
                None => slot_stride(manifest.total_len()),
            };
            let room = stride.checked_mul(capacity);
            let reserved = stride.checked_mul(config.slots);
            let (Some(room), Some(reserved)) = (room, reserved) else {
                return Err(shm_err("segment size overflows"));
            };
            sizes.push((room, reserved));
            index.insert(id.clone(), i);
            let handles = match exported.as_mut() {
                Some(e) => e.export(manifest.total_len(), config.slots)?,
                None => Vec::new(),
            };
            models.push(DirModel {
                id: id.clone(),
                manifest: (**manifest).clone(),
                data: config.dir.join(format!("refit-{scheme}-m{i}")),
                exported: handles,
            });
        }
        Ok(ModelSegments {
            models,
            sizes,
            index,
        })
    }

    /// Creates the data segments at `paths`, each with room for `sizes`' first and the
    /// slots in use from the start (the second) reserved and prefaulted; `data` holds every
    /// segment created, for the caller to unlink on failure.
    fn create_data(
        paths: &[PathBuf],
        sizes: &[(usize, usize)],
        data: &mut Vec<Arc<Segment>>,
    ) -> Result<()> {
        for (path, &(room, reserved)) in paths.iter().zip(sizes) {
            // the slots in use from the start are reserved and prefaulted now, before any
            // version is on its way: a first publish then writes as fast as the next one
            let made = Segment::create_sparse(path, room).map(Arc::new);
            if let Ok(s) = &made {
                data.push(Arc::clone(s));
            }
            made.and_then(|s| s.reserve(0, reserved, copy_threads()))?;
        }
        Ok(())
    }

    /// The description a receiver (in any process of this host) attaches with.
    pub fn receiver_spec(&self) -> ShmReceiverSpec {
        ShmReceiverSpec {
            board: self.board.path().to_path_buf(),
        }
    }

    /// Paths of every segment file (board first).
    pub fn segment_paths(&self) -> Vec<PathBuf> {
        std::iter::once(&*self.board)
            .chain(self.data.iter().map(|d| &**d))
            .map(|s| s.path().to_path_buf())
            .collect()
    }

    /// Number of receivers attached now (dead ones are reaped first).
    ///
    /// # Errors
    /// If the board cannot be read.
    pub fn attached(&self) -> Result<usize> {
        self.reap_dead()?;
        let mut n = 0;
        for r in 0..self.max_receivers {
            if self
                .board
                .u32_at(receiver(r) + R_STATE)?
                .load(Ordering::SeqCst)
                == RECEIVER_CLAIMED
            {
                n += 1;
            }
        }
        metrics::receivers_connected(NAME, self.index.keys().map(ModelId::as_str), n);
        Ok(n)
    }

    /// Frees the entries (and pins) of receivers whose process is gone.
    fn reap_dead(&self) -> Result<()> {
        for r in 0..self.max_receivers {
            let state = self.board.u32_at(receiver(r) + R_STATE)?;
            if state.load(Ordering::SeqCst) != RECEIVER_CLAIMED {
                continue;
            }
            let owner = receiver(r) + R_OWNER;
            if lease::dead(&self.board, owner, self.lease)?.is_none() {
                continue;
            }
            // take the entry, then look again: the owner may have freed it and a new
            // receiver claimed it (its fresh beat is written before its claim) since the
            // first look; a live owner gets its entry back untouched
            if state
                .compare_exchange(
                    RECEIVER_CLAIMED,
                    RECEIVER_FREEING,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_err()
            {
                continue;
            }
            let Some(reason) = lease::dead(&self.board, owner, self.lease)? else {
                state.store(RECEIVER_CLAIMED, Ordering::SeqCst);
                continue;
            };
            let pid = lease::record_pid(&self.board, owner);
            tracing::warn!(receiver = r, pid, %reason, "shm receiver died; freeing its pins");
            for m in 0..self.data.len() {
                for s in 0..self.capacity {
                    self.board.u32_at(pin(r, m, s))?.store(0, Ordering::SeqCst);
                }
            }
            lease::clear_record(&self.board, owner)?;
            state.store(RECEIVER_FREE, Ordering::SeqCst);
            if let Ok(mut departed) = self.departed.lock() {
                if departed.len() == MAX_DEPARTED {
                    departed.remove(0);
                }
                departed.push(DepartedReceiver {
                    entry: r,
                    pid,
                    reason,
                });
            }
        }
        Ok(())
    }

    /// Segment files of dead senders this sender removed when it was created (see the
    /// module docs: a sender killed without cleaning up leaves its segments behind).
    pub fn collected(&self) -> &[PathBuf] {
        &self.collected
    }

    /// Receivers found dead and freed so far (the newest 256): a run's report should say
    /// that a consumer vanished, not only the log.
    pub fn departed(&self) -> Vec<DepartedReceiver> {
        self.departed.lock().map(|d| d.clone()).unwrap_or_default()
    }

    /// Slots allocated for `model` now: [`ShmConfig::slots`], plus those added because
    /// readers held old versions (see the module docs), at most [`ShmConfig::max_slots`].
    ///
    /// # Errors
    /// [`Error::UnknownModel`].
    pub fn slots_in_use(&self, model: &ModelId) -> Result<usize> {
        Ok(self.active[self.model_index(model)?])
    }

    /// Times a receiver was marked behind (it held a version while two newer ones were
    /// published, and reads its next version into private memory).
    pub fn behind_marks(&self) -> u64 {
        self.behind_marks
    }

    /// Byte offset of `slot`'s header in `model`'s data segment.
    fn slot_base(&self, model: usize, slot: usize) -> usize {
        slot * (self.data[model].len() / self.capacity)
    }

    /// The receivers (entry, pid) pinning `slot` of `model`.
    fn pinners(&self, model: usize, slot: usize) -> Result<Vec<(usize, u32)>> {
        let mut out = Vec::new();
        for r in 0..self.max_receivers {
            if self
                .board
                .u32_at(pin(r, model, slot))?
                .load(Ordering::SeqCst)
                != 0
            {
                out.push((r, lease::record_pid(&self.board, receiver(r) + R_OWNER)));
            }
        }
        Ok(out)
    }

    fn pinned(&self, model: usize, slot: usize) -> Result<bool> {
        for r in 0..self.max_receivers {
            if self
                .board
                .u32_at(pin(r, model, slot))?
                .load(Ordering::SeqCst)
                != 0
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Adds a slot to `model`'s segment (its memory reserved and mapped); false when it has
    /// `max_slots` already or the directory has no room left (then it stops trying).
    fn grow(&mut self, model: usize) -> Result<bool> {
        if self.active[model] >= self.capacity || self.cannot_grow[model] {
            return Ok(false);
        }
        let slot = self.active[model];
        let base = self.slot_base(model, slot);
        let stride = self.data[model].len() / self.capacity;
        match self.data[model].reserve(base, stride, copy_threads()) {
            Ok(()) => {
                self.active[model] += 1;
                tracing::info!(
                    model = %self.ids[model],
                    slots = self.active[model],
                    "shm: readers hold old versions; added a slot"
                );
                Ok(true)
            }
            Err(e) => {
                tracing::warn!(
                    model = %self.ids[model],
                    "shm: cannot add a slot for readers holding old versions: {e}"
                );
                self.cannot_grow[model] = true;
                Ok(false)
            }
        }
    }

    /// Claims a free slot of `model` for writing, adding one if every slot is pinned and
    /// the segment has room: leaves its sequence odd and returns it.
    fn claim_slot(&mut self, model: usize, deadline: Instant) -> Result<(usize, u64)> {
        let (id, capacity) = (self.ids[model].clone(), self.capacity);
        wait_until(
            deadline,
            (),
            |()| {
                loop {
                    for s in 0..self.active[model] {
                        if self.current[model] == Some(s) {
                            continue;
                        }
                        let seq = self.data[model].u64_at(self.slot_base(model, s) + SLOT_SEQ)?;
                        let was = seq.load(Ordering::SeqCst);
                        seq.store(was | 1, Ordering::SeqCst);
                        if !self.pinned(model, s)? {
                            return Ok(Wait::Done((s, was & !1)));
                        }
                        seq.store(was, Ordering::SeqCst);
                    }
                    // every slot pinned: a slot added now is free (only a slot that was in
                    // force can be pinned)
                    if !self.grow(model)? {
                        break;
                    }
                }
                self.reap_dead()?;
                let mut holders = Vec::new();
                for s in 0..self.active[model] {
                    for h in self.pinners(model, s)? {
                        if !holders.contains(&h) {
                            holders.push(h);
                        }
                    }
                }
                Ok(Wait::Pending(holders))
            },
            |(), left| std::thread::sleep(left.min(Duration::from_micros(100))),
            |holders| {
                format!(
                    "a free shm slot for model `{id}`: all {capacity} slots (max_slots) pinned \
                     by readers holding old versions, receivers (entry, pid) {holders:?}"
                )
            },
        )
    }

    /// After a commit: marks the receivers holding slots older than the one before the
    /// version in force as behind, and adds a slot when none is left free beyond those two
    /// (see the module docs).
    fn after_commit(&mut self, model: usize) -> Result<()> {
        let keep = [self.current[model], self.previous[model]];
        let mut spare = false;
        for s in 0..self.active[model] {
            if keep.contains(&Some(s)) {
                continue;
            }
            let holders = self.pinners(model, s)?;
            spare |= holders.is_empty();
            for (r, pid) in holders {
                let word = self.board.u32_at(behind(r))?;
                if word.swap(1, Ordering::SeqCst) == 0 {
                    self.behind_marks += 1;
                    tracing::debug!(receiver = r, pid, slot = s, "shm: a receiver is behind");
                }
            }
        }
        if !spare {
            self.grow(model)?;
        }
        Ok(())
    }

    fn missing_acks(&self, entries: &[(ModelId, Version)]) -> Result<Vec<(usize, u32)>> {
        let mut missing = Vec::new();
        for r in 0..self.max_receivers {
            if self
                .board
                .u32_at(receiver(r) + R_STATE)?
                .load(Ordering::SeqCst)
                != RECEIVER_CLAIMED
            {
                continue;
            }
            for (id, v) in entries {
                let m = self.model_index(id)?;
                if self.board.u64_at(acked(r, m))?.load(Ordering::SeqCst) < v.get() {
                    missing.push((r, lease::record_pid(&self.board, receiver(r) + R_OWNER)));
                    break;
                }
            }
        }
        Ok(missing)
    }

    /// Lends a free slot of `model` to fill in place (zero-copy publish): the returned weight
    /// set is writable (`bytes_mut`, `view_mut`) and lives in shared memory; publishing it
    /// through the scheme (`Sender::publish_shared`) then costs no copy at all. Writing after
    /// publication is refused (the storage turns read-only). A second loan of the same model
    /// returns the first slot unused.
    ///
    /// # Errors
    /// [`Error::UnknownModel`]; [`Error::Timeout`] if no slot is free by `deadline`.
    pub fn loan(
        &mut self,
        model: &ModelId,
        version: Version,
        deadline: Instant,
    ) -> Result<WeightSet> {
        let m = self.model_index(model)?;
        if let Some(e) = &self.exported {
            return Err(Error::transport(
                e.name(),
                format!(
                    "the slots of `{model}` live in device memory: they are not lent as host weight sets"
                ),
            ));
        }
        self.release_loan(m)?;
        let (slot, seq) = self.claim_slot(m, deadline)?;
        let off = self.slot_base(m, slot) + PAGE;
        let data = &self.data[m];
        let manifest = Arc::clone(&self.manifests[m]);
        let sealed = Arc::new(AtomicBool::new(false));
        let bytes = SlotBytes {
            data: Arc::clone(data),
            off,
            len: manifest.total_len(),
            sealed: Arc::clone(&sealed),
        };
        self.loans[m] = Some(Loan {
            slot,
            seq,
            off,
            sealed,
        });
        WeightSet::from_shared(model.clone(), version, manifest, Arc::new(bytes))
    }

    /// Gives an unpublished loan's slot back.
    fn release_loan(&mut self, m: usize) -> Result<()> {
        if let Some(loan) = self.loans[m].take() {
            loan.sealed.store(true, Ordering::Release);
            let base = self.slot_base(m, loan.slot);
            self.data[m]
                .u64_at(base + SLOT_SEQ)?
                .store(loan.seq, Ordering::SeqCst);
        }
        Ok(())
    }

    fn model_index(&self, id: &ModelId) -> Result<usize> {
        self.index
            .get(id)
            .copied()
            .ok_or_else(|| Error::UnknownModel(id.clone()))
    }
}

#[cfg(test)]
impl ShmSender {
    /// Flips one byte in the middle of the version in force of model #`model`, as a stray
    /// writer would (the checksum tests).
    pub(super) fn damage_current(&self, model: usize) -> Result<()> {
        let slot = self.current[model].ok_or(Error::State("nothing published"))?;
        let len = self.manifests[model].total_len();
        let at = self.slot_base(model, slot) + PAGE + len / 2;
        let byte = self.data[model].bytes(at, 1)?[0];
        self.data[model].write(at, &[byte ^ 0x40])
    }
}

#[cfg(feature = "test-util")]
impl ShmSender {
    /// Test hook (feature `test-util`): claims a slot, writes half of `weights` into it and
    /// aborts the process, as a crash in the middle of a publish would. Used by the crash
    /// tests; never call it otherwise.
    pub fn crash_mid_write(&mut self, weights: &WeightSet) -> ! {
        if let Ok(m) = self.model_index(weights.model())
            && let Ok((slot, _)) = self.claim_slot(m, Instant::now() + Duration::from_secs(5))
        {
            let base = self.slot_base(m, slot);
            let seg = &self.data[m];
            let half = weights.bytes().len() / 2;
            let _ = seg.write(base + PAGE, &weights.bytes()[..half]);
        }
        std::process::abort()
    }
}

/// Test hook (feature `test-util`): writes `pid` into the sender's owner record of the board
/// at `spec`, as if the sender had died and its pid gone to another process. Used by the
/// pid-reuse tests; never call it otherwise.
///
/// # Errors
/// If the board cannot be opened.
#[cfg(feature = "test-util")]
pub fn overwrite_sender_pid(spec: &ShmReceiverSpec, pid: u32) -> Result<()> {
    let board = Segment::open(&spec.board, true)?;
    board
        .u32_at(OFF_SENDER + lease::REC_PID)?
        .store(pid, Ordering::SeqCst);
    Ok(())
}

impl SenderTransport for ShmSender {
    fn name(&self) -> &'static str {
        self.exported.as_ref().map_or(NAME, |e| e.name())
    }

    fn connect(&mut self, initial: &Group, deadline: Instant) -> Result<()> {
        // receivers may attach while the first version is written (they wait for its
        // commit): their setup is off the first delivery's path
        state_word(&self.board)?.store(STATE_LIVE, Ordering::SeqCst);
        futex::wake_all(state_word(&self.board)?);
        self.publish(initial, deadline)?;
        let ack_seq = self.board.u32_at(OFF_ACK_SEQ)?;
        let expected = self.expected_receivers;
        wait_until(
            deadline,
            0,
            |seen| {
                *seen = ack_seq.load(Ordering::SeqCst);
                let n = self.attached()?;
                Ok(if n >= expected {
                    Wait::Done(())
                } else {
                    Wait::Pending(n)
                })
            },
            park_on(ack_seq),
            |n| format!("{expected} shm receivers to attach ({n} did)"),
        )
    }

    fn publish(&mut self, group: &Group, deadline: Instant) -> Result<()> {
        if self.closed {
            return Err(Error::State("shm sender is shut down"));
        }
        let mut placed = Vec::with_capacity(group.len());
        for w in group {
            let m = self.model_index(w.model())?;
            let seg = Arc::clone(&self.data[m]);
            let lent = self.loans[m].as_ref().is_some_and(|l| {
                seg.bytes(l.off, 0)
                    .is_ok_and(|b| b.as_ptr() == w.bytes().as_ptr())
            });
            let (slot, seq, sum) = if lent {
                // the weights were written in place: seal the loan, no copy
                let loan = self.loans[m].take().ok_or(Error::State("loan vanished"))?;
                loan.sealed.store(true, Ordering::Release);
                let sum = self.checksum.then(|| checksum(w.bytes(), copy_threads()));
                (loan.slot, loan.seq, sum)
            } else {
                self.release_loan(m)?;
                let (slot, seq) = self.claim_slot(m, deadline)?;
                let at = self.slot_base(m, slot) + PAGE;
                let sum = match self.exported.as_mut() {
                    // the slot stays claimed (odd) until the bytes are there
                    Some(e) => {
                        e.write(m, slot, w.bytes(), deadline)?;
                        self.checksum.then(|| checksum(w.bytes(), copy_threads()))
                    }
                    None if self.checksum => Some(seg.write_hashed(at, w.bytes())?),
                    None => {
                        seg.write(at, w.bytes())?;
                        None
                    }
                };
                (slot, seq, sum)
            };
            let base = self.slot_base(m, slot);
            if let Some(sum) = sum {
                seg.u64_at(base + SLOT_CHECKSUM)?
                    .store(sum, Ordering::SeqCst);
            }
            seg.u64_at(base + SLOT_VERSION)?
                .store(w.version().get(), Ordering::SeqCst);
            seg.u64_at(base + SLOT_SEQ)?
                .store(seq + 2, Ordering::SeqCst);
            placed.push((m, slot, w.version().get()));
        }
        let commit = self.board.u32_at(OFF_COMMIT_SEQ)?;
        commit.fetch_add(1, Ordering::SeqCst);
        for &(m, slot, v) in &placed {
            self.board
                .u64_at(entry_version(m))?
                .store(v, Ordering::Relaxed);
            self.board
                .u64_at(entry_slot(m))?
                .store(slot as u64, Ordering::Relaxed);
            self.previous[m] = self.current[m].replace(slot);
        }
        commit.fetch_add(1, Ordering::SeqCst);
        self.board
            .u64_at(OFF_GENERATION)?
            .fetch_add(1, Ordering::SeqCst);
        futex::wake_all(commit);
        // the readers are on their way: now the slot policy (laggards, a spare slot)
        for &(m, _, _) in &placed {
            self.after_commit(m)?;
        }
        // the receivers gauge follows the board at every publish (receivers attach on
        // their own, without telling the sender)
        let _ = self.attached();
        Ok(())
    }

    fn wait_acks(&mut self, entries: &[(ModelId, Version)], deadline: Instant) -> Result<()> {
        let ack_seq = self.board.u32_at(OFF_ACK_SEQ)?;
        wait_until(
            deadline,
            0,
            |seen| {
                *seen = ack_seq.load(Ordering::SeqCst);
                self.reap_dead()?;
                let missing = self.missing_acks(entries)?;
                Ok(if missing.is_empty() {
                    Wait::Done(())
                } else {
                    Wait::Pending(missing)
                })
            },
            park_on(ack_seq),
            |missing| format!("shm receivers (slot, pid) {missing:?} to acknowledge {entries:?}"),
        )?;
        let _ = self.attached();
        Ok(())
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.heartbeat = None;
        self.exit_guard = None;
        metrics::receivers_connected(NAME, self.index.keys().map(ModelId::as_str), 0);
        release(&self.board, &self.data)
    }
}

impl Drop for ShmSender {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
