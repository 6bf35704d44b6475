//! The shared-memory transport, for processes of one host.
//!
//! One *board* segment per scheme holds the commit record (which slot holds which version of
//! each model, under a seqlock), the receivers' table (pins, acknowledgements, pids) and a
//! directory of manifests; one *data* segment per model holds `slots` copies of its arena.
//!
//! - The sender writes a new version once, into a slot no reader has pinned, whatever the
//!   number of receivers; then it flips the board in one seqlock step, so models published
//!   together are seen together.
//! - A reader pins the slots it reads (a per-reader counter the writer checks, Dekker-style
//!   with sequentially consistent atomics), checks the slot header (even sequence, expected
//!   version) before and after, and so proves it saw one whole version.
//! - Receivers sleep on a futex in the board and are woken by each commit; no busy-spinning.
//! - A sender that crashes mid-write leaves its slot odd and the board on the old version:
//!   readers keep the old weights and learn the sender's death from its lease (see below).
//! - Liveness does not trust bare pids: every party keeps an owner record in the board (pid,
//!   start time, pid namespace, heartbeat). In the owner's pid namespace the start time
//!   unmasks a reused pid at once; across namespaces (containers sharing `/dev/shm`) a
//!   heartbeat older than the lease ([`ShmConfig::lease`]) declares the owner dead.
//! - Shutdown removes every segment file; mappings that readers still hold stay valid. So
//!   do SIGINT and SIGTERM once the program installed
//!   [`refit_runtime::cleanup::install_signal_handlers`]. A sender that dies without
//!   cleaning up (SIGKILL, the OOM killer) leaves its files; the next sender created in the
//!   same directory removes them ([`ShmSender::collected`]).
//!
//! # Why there are no bucket control messages here
//!
//! TCP moves bytes by a [`BucketPlan`](refit_runtime::BucketPlan), one header per bucket,
//! because its bytes cross a wire in pieces that can arrive late, damaged, from a relay, or
//! not at all. Shared memory has none of that: the sender writes the arena once into a slot
//! and commits the whole slot with one seqlock step; a reader either maps the slot
//! (`ShmReadMode::ZeroCopy`) or copies it whole in one `memcpy` (`ShmReadMode::Copy`) and
//! proves, by the slot's sequence before and after, that it saw one whole version. There is
//! no channel on which a per-bucket message could travel, nothing for it to checksum that the
//! seqlock does not already prove, and cutting the copy into buckets would only add
//! bookkeeping to a copy that runs at memory bandwidth. The manifest (the layout a plan would
//! describe) is read once at attach from the board's manifest directory and checked by the
//! scheme against the manifests the receiver expects. So the
//! unit of control here is the version, not the bucket; the same holds for the in-process
//! transport, which moves no bytes at all.

mod collect;
mod futex;
mod layout;
pub(crate) mod lease;
mod link;
mod segment;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use refit_runtime::metrics::{self, Phase};
use refit_runtime::wait::{Wait, poll_until, wait_until};
use refit_runtime::{
    Error, Group, Manifest, Manifests, ModelId, ReceiverTransport, Result, SenderTransport,
    SharedBytes, Version, WeightSet, wire,
};
use serde::{Deserialize, Serialize};

use layout::*;
pub use layout::{MAX_MODELS, MAX_SLOTS};
use lease::{Heartbeat, Identity};
pub use link::ShmLink;
use segment::Segment;

use crate::pool::{BufPool, PooledBuf};

const NAME: &str = "shm";
/// How often a waiting party checks the other side's liveness.
const LIVENESS_EVERY: Duration = Duration::from_millis(100);
/// Dead receivers [`ShmSender::departed`] remembers (the newest).
const MAX_DEPARTED: usize = 256;

/// Where and how the segments are made.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// Directory of the segment files (default `/dev/shm`, memory-backed on Linux).
    pub dir: PathBuf,
    /// Slots per model (at least 2; default 3 so a lagging reader never blocks the writer).
    pub slots: usize,
    /// Most receivers that can attach at once (default 64).
    pub max_receivers: usize,
    /// Receivers `connect` waits for before returning (default 0: whoever attaches).
    pub expected_receivers: usize,
    /// How long a party's heartbeat may stay silent before the other side declares it
    /// dead, where the exact check cannot be made (another pid namespace, no `/proc`).
    /// Each party beats 8 times per lease. Default 3 s; 10 ms..=1 h.
    pub lease: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("/dev/shm"),
            slots: 3,
            max_receivers: 64,
            expected_receivers: 0,
            lease: Duration::from_secs(3),
        }
    }
}

/// What a receiver needs to attach: serialisable, shipped to another process (see
/// [`refit_runtime::wire::to_token`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmReceiverSpec {
    /// Path of the board segment.
    pub board: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Directory {
    models: Vec<DirModel>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct DirModel {
    id: ModelId,
    manifest: Manifest,
    data: PathBuf,
}

fn shm_err(message: impl Into<String>) -> Error {
    Error::transport(NAME, message)
}

fn state_word(board: &Segment) -> Result<&AtomicU32> {
    board.u32_at(OFF_STATE)
}

/// The least time a reader waits for a commit in progress, whatever its caller's deadline:
/// a commit is a few stores, but the committing thread may be descheduled in the middle,
/// and a zero-timeout poll must not report that as a hang.
const COMMIT_GRACE: Duration = Duration::from_millis(100);

/// One consistent read of the commit record: `(version, slot)` per model. A commit that
/// stays in progress (odd sequence) past `deadline` while the sender lives (hung, or
/// stopped mid-commit) is [`Error::Timeout`]; a sender whose lease says it died is
/// [`Error::PeerGone`].
fn read_board(
    board: &Segment,
    n_models: usize,
    lease: Duration,
    deadline: Instant,
) -> Result<Vec<(u64, u64)>> {
    let seq = board.u32_at(OFF_COMMIT_SEQ)?;
    let started = Instant::now();
    wait_until(
        deadline,
        (),
        |()| {
            let before = seq.load(Ordering::Acquire);
            if before % 2 == 0 {
                let mut out = Vec::with_capacity(n_models);
                for m in 0..n_models {
                    out.push((
                        board.u64_at(entry_version(m))?.load(Ordering::Relaxed),
                        board.u64_at(entry_slot(m))?.load(Ordering::Relaxed),
                    ));
                }
                fence(Ordering::Acquire);
                if seq.load(Ordering::Relaxed) == before {
                    return Ok(Wait::Done(out));
                }
            } else if started.elapsed() > LIVENESS_EVERY
                && let Some(why) = lease::dead(board, OFF_SENDER, lease)?
            {
                return Err(sender_gone(board, format!("died while committing ({why})")));
            }
            Ok(Wait::Pending(()))
        },
        |(), _| std::thread::yield_now(),
        |()| "the shm sender to finish its commit (the board stayed mid-commit)".into(),
    )
}

/// The park of [`wait_until`] on a futex word: sleeps until the word moves off the value the
/// last look saw, at most the time left and never past the next liveness check.
fn park_on(word: &AtomicU32) -> impl FnMut(u32, Duration) -> u32 + '_ {
    move |seen, left| {
        futex::wait(word, seen, left.min(LIVENESS_EVERY));
        seen
    }
}

fn sender_gone(board: &Segment, reason: impl Into<String>) -> Error {
    Error::PeerGone {
        peer: format!("shm sender (pid {})", lease::record_pid(board, OFF_SENDER)),
        reason: reason.into(),
    }
}

/// The sender's lease as its record states it.
fn board_lease(board: &Segment) -> Result<Duration> {
    let ms = board
        .u32_at(OFF_SENDER + lease::REC_LEASE_MS)?
        .load(Ordering::Relaxed);
    Ok(Duration::from_millis(u64::from(ms.max(10))))
}

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
struct Loan {
    slot: usize,
    seq: u64,
    off: usize,
    sealed: Arc<AtomicBool>,
}

/// The bytes of a lent slot: writable until the version is published.
struct SlotBytes {
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
    board: Arc<Segment>,
    heartbeat: Option<Heartbeat>,
    exit_guard: Option<refit_runtime::cleanup::ExitGuard>,
    collected: Vec<PathBuf>,
    lease: Duration,
    departed: Mutex<Vec<DepartedReceiver>>,
    data: Vec<Arc<Segment>>,
    manifests: Vec<Arc<Manifest>>,
    loans: Vec<Option<Loan>>,
    index: BTreeMap<ModelId, usize>,
    current: Vec<Option<usize>>,
    slots: usize,
    max_receivers: usize,
    expected_receivers: usize,
    closed: bool,
}

impl ShmSender {
    /// Creates the segments for `manifests` (local only: nobody is contacted).
    ///
    /// # Errors
    /// Bad configuration (fewer than 2 or more than [`MAX_SLOTS`] slots, more than
    /// [`MAX_MODELS`] models, a lease outside 10 ms..=1 h), or the files cannot be created.
    /// A directory without room for the segments gives, before anything is created, an
    /// [`Error::Path`] whose source is of kind `StorageFull`, naming the sizes and how to
    /// enlarge `/dev/shm` (Docker `--shm-size`, a Kubernetes memory `emptyDir`).
    pub fn create(config: &ShmConfig, manifests: &Manifests) -> Result<Self> {
        if !(2..=MAX_SLOTS).contains(&config.slots) {
            return Err(shm_err(format!(
                "slots must be 2..={MAX_SLOTS}, got {}",
                config.slots
            )));
        }
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
        let scheme = uuid::Uuid::new_v4().simple().to_string();
        let mut models = Vec::new();
        let mut sizes = Vec::new();
        let mut index = BTreeMap::new();
        for (i, (id, manifest)) in manifests.iter().enumerate() {
            let len = slot_stride(manifest.total_len())
                .checked_mul(config.slots)
                .ok_or_else(|| shm_err("segment size overflows"))?;
            sizes.push(len);
            index.insert(id.clone(), i);
            models.push(DirModel {
                id: id.clone(),
                manifest: (**manifest).clone(),
                data: config.dir.join(format!("refit-{scheme}-m{i}")),
            });
        }
        let paths: Vec<PathBuf> = models.iter().map(|m| m.data.clone()).collect();
        let dir_bytes = wire::encode(&Directory { models })?;
        let dir_off = directory_offset(config.max_receivers);
        let board_path = config.dir.join(format!("refit-{scheme}-board"));
        let board_len = dir_off + round_up(dir_bytes.len());
        let collected = collect::collect_dead(&config.dir);
        let needed = sizes
            .iter()
            .try_fold(board_len, |a, &b| a.checked_add(b))
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
        let init = (|| -> Result<()> {
            let b = &board;
            b.u32_at(OFF_LAYOUT)?.store(LAYOUT, Ordering::Relaxed);
            b.u32_at(OFF_SENDER + lease::REC_LEASE_MS)?
                .store(lease_ms, Ordering::Relaxed);
            lease::write_record(b, OFF_SENDER, Identity::current())?;
            b.write(dir_off, &dir_bytes)?;
            b.u32_at(OFF_N_MODELS)?
                .store(manifests.len() as u32, Ordering::Relaxed);
            b.u32_at(OFF_N_SLOTS)?
                .store(config.slots as u32, Ordering::Relaxed);
            b.u32_at(OFF_MAX_RECEIVERS)?
                .store(config.max_receivers as u32, Ordering::Relaxed);
            b.u64_at(OFF_DIR_LEN)?
                .store(dir_bytes.len() as u64, Ordering::Relaxed);
            Ok(())
        })();
        if let Err(e) = init {
            return Err(fail(&[], e));
        }
        let heartbeat = match Heartbeat::start(Arc::clone(&board), OFF_SENDER, config.lease) {
            Ok(h) => h,
            Err(e) => return Err(fail(&[], e)),
        };
        let mut data = Vec::with_capacity(paths.len());
        for (path, &len) in paths.iter().zip(&sizes) {
            match Segment::create(path, len) {
                Ok(s) => data.push(Arc::new(s)),
                Err(e) => return Err(fail(&data, e)),
            }
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
            current: vec![None; manifests.len()],
            manifests: manifests.iter().map(|(_, m)| Arc::clone(m)).collect(),
            loans: (0..manifests.len()).map(|_| None).collect(),
            slots: config.slots,
            max_receivers: config.max_receivers,
            expected_receivers: config.expected_receivers,
            closed: false,
        })
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
                for s in 0..self.slots {
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

    /// Claims a slot for writing: leaves its sequence odd and returns it.
    fn claim_slot(&self, model: usize, deadline: Instant) -> Result<(usize, u64)> {
        let seg = &self.data[model];
        let stride = seg.len() / self.slots;
        wait_until(
            deadline,
            (),
            |()| {
                for s in 0..self.slots {
                    if self.current[model] == Some(s) {
                        continue;
                    }
                    let seq = seg.u64_at(s * stride)?;
                    let was = seq.load(Ordering::SeqCst);
                    seq.store(was | 1, Ordering::SeqCst);
                    if !self.pinned(model, s)? {
                        return Ok(Wait::Done((s, was & !1)));
                    }
                    seq.store(was, Ordering::SeqCst);
                }
                self.reap_dead()?;
                Ok(Wait::Pending(()))
            },
            |(), left| std::thread::sleep(left.min(Duration::from_micros(100))),
            |()| {
                format!(
                    "a free shm slot for model #{model}: all {} other slots pinned by readers",
                    self.slots - 1
                )
            },
        )
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
        self.release_loan(m)?;
        let (slot, seq) = self.claim_slot(m, deadline)?;
        let data = &self.data[m];
        let off = slot * (data.len() / self.slots) + PAGE;
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
            let data = &self.data[m];
            let base = loan.slot * (data.len() / self.slots);
            data.u64_at(base)?.store(loan.seq, Ordering::SeqCst);
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

impl ShmSender {
    /// Test hook: claims a slot, writes half of `weights` into it and aborts the process, as a
    /// crash in the middle of a publish would. Used by the crash tests; never call it otherwise.
    #[doc(hidden)]
    pub fn crash_mid_write(&mut self, weights: &WeightSet) -> ! {
        if let Ok(m) = self.model_index(weights.model())
            && let Ok((slot, _)) = self.claim_slot(m, Instant::now() + Duration::from_secs(5))
        {
            let seg = &self.data[m];
            let base = slot * (seg.len() / self.slots);
            let half = weights.bytes().len() / 2;
            let _ = seg.write(base + PAGE, &weights.bytes()[..half]);
        }
        std::process::abort()
    }
}

/// Test hook: writes `pid` into the sender's owner record of the board at `spec`, as if the
/// sender had died and its pid gone to another process. Used by the pid-reuse tests; never
/// call it otherwise.
///
/// # Errors
/// If the board cannot be opened.
#[doc(hidden)]
pub fn overwrite_sender_pid(spec: &ShmReceiverSpec, pid: u32) -> Result<()> {
    let board = Segment::open(&spec.board, true)?;
    board
        .u32_at(OFF_SENDER + lease::REC_PID)?
        .store(pid, Ordering::SeqCst);
    Ok(())
}

impl SenderTransport for ShmSender {
    fn name(&self) -> &'static str {
        NAME
    }

    fn connect(&mut self, initial: &Group, deadline: Instant) -> Result<()> {
        self.publish(initial, deadline)?;
        state_word(&self.board)?.store(STATE_LIVE, Ordering::SeqCst);
        futex::wake_all(state_word(&self.board)?);
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
            let (slot, seq) = if lent {
                // the weights were written in place: seal the loan, no copy
                let loan = self.loans[m].take().ok_or(Error::State("loan vanished"))?;
                loan.sealed.store(true, Ordering::Release);
                (loan.slot, loan.seq)
            } else {
                self.release_loan(m)?;
                let (slot, seq) = self.claim_slot(m, deadline)?;
                let base = slot * (seg.len() / self.slots);
                seg.write(base + PAGE, w.bytes())?;
                (slot, seq)
            };
            let base = slot * (seg.len() / self.slots);
            seg.u64_at(base + 8)?
                .store(w.version().get(), Ordering::SeqCst);
            seg.u64_at(base)?.store(seq + 2, Ordering::SeqCst);
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
            self.current[m] = Some(slot);
        }
        commit.fetch_add(1, Ordering::SeqCst);
        self.board
            .u64_at(OFF_GENERATION)?
            .fetch_add(1, Ordering::SeqCst);
        futex::wake_all(commit);
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
        )
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.heartbeat = None;
        self.exit_guard = None;
        release(&self.board, &self.data)
    }
}

/// Tells receivers the sender left and removes every segment file (mappings stay valid).
fn release(board: &Segment, data: &[Arc<Segment>]) -> Result<()> {
    let state = state_word(board)?;
    state.store(STATE_SHUTDOWN, Ordering::SeqCst);
    futex::wake_all(state);
    futex::wake_all(board.u32_at(OFF_COMMIT_SEQ)?);
    let mut first_err = None;
    for s in std::iter::once(board).chain(data.iter().map(|d| &**d)) {
        if let Err(e) = s.unlink() {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

impl Drop for ShmSender {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// How a receiver reads a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShmReadMode {
    /// Copy the slot into private memory, pinning it only for the copy (default): the writer
    /// is never held back by a slow reader.
    #[default]
    Copy,
    /// Serve straight from the slot, pinned while any reader holds the weight set: no copy,
    /// but the sender needs a free slot beyond those pinned.
    ZeroCopy,
}

/// The receiver's claim on its table entry; freed when the receiver and every zero-copy
/// weight set it handed out are gone.
#[derive(Debug)]
struct Lease {
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

/// A pinned slot served without copying.
struct PinnedSlot {
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

struct Attached {
    board: Arc<Segment>,
    lease: Arc<Lease>,
    models: Vec<(ModelId, Arc<Manifest>, Arc<Segment>)>,
    n_slots: usize,
    /// The sender's lease.
    lease_len: Duration,
}

/// A receiving end.
pub struct ShmReceiver {
    spec: ShmReceiverSpec,
    mode: ShmReadMode,
    attached: Option<Attached>,
    seen: Vec<u64>,
    pool: Arc<BufPool>,
}

impl std::fmt::Debug for ShmReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmReceiver")
            .field("spec", &self.spec)
            .field("mode", &self.mode)
            .field("attached", &self.attached.is_some())
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
        }
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
        if board.u32_at(OFF_LAYOUT)?.load(Ordering::Relaxed) != LAYOUT {
            return Err(shm_err("board was written by another layout version"));
        }
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
        let dir_len = usize::try_from(board.u64_at(OFF_DIR_LEN)?.load(Ordering::Relaxed))
            .map_err(|_| shm_err("directory length overflows"))?;
        let dir: Directory = wire::decode(
            board.bytes(directory_offset(max_receivers), dir_len)?,
            wire::MAX_CONTROL_MESSAGE,
        )?;
        if dir.models.len() > MAX_MODELS || !(2..=MAX_SLOTS).contains(&n_slots) {
            return Err(shm_err("board directory is malformed"));
        }
        let mut models = Vec::with_capacity(dir.models.len());
        for m in dir.models {
            let seg = Arc::new(Segment::open(&m.data, false)?);
            if seg.len() < slot_stride(m.manifest.total_len()) * n_slots {
                return Err(shm_err(format!("data segment of `{}` is too small", m.id)));
            }
            models.push((m.id, Arc::new(m.manifest), seg));
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
            let mut group = Vec::with_capacity(fresh.len());
            let mut result = Ok(());
            for &(m, version, slot) in &fresh {
                let (id, manifest, seg) = &a.models[m];
                let base = slot * (seg.len() / a.n_slots);
                let pin_off = pin(a.lease.idx, m, slot);
                let ws = match self.mode {
                    ShmReadMode::Copy => {
                        let wire = metrics::timed(Phase::Wire, NAME, id.as_str());
                        let copy = seg.bytes(base + PAGE, manifest.total_len()).and_then(|b| {
                            let mut buf = self.pool.take(b.len());
                            buf.as_mut_slice().copy_from_slice(b);
                            let pooled = PooledBuf::new(buf, &self.pool);
                            WeightSet::from_shared(
                                id.clone(),
                                Version(version),
                                Arc::clone(manifest),
                                Arc::new(pooled),
                            )
                        });
                        // the header after the copy proves the slot was stable throughout
                        let stable = seg.u64_at(base)?.load(Ordering::SeqCst) % 2 == 0
                            && seg.u64_at(base + 8)?.load(Ordering::SeqCst) == version;
                        a.board.u32_at(pin_off)?.fetch_sub(1, Ordering::SeqCst);
                        if !stable {
                            result = Err(shm_err(format!(
                                "slot {slot} of `{id}` changed while pinned (protocol violation)"
                            )));
                            continue;
                        }
                        wire.finish();
                        copy
                    }
                    ShmReadMode::ZeroCopy => WeightSet::from_shared(
                        id.clone(),
                        Version(version),
                        Arc::clone(manifest),
                        Arc::new(PinnedSlot {
                            lease: Arc::clone(&a.lease),
                            data: Arc::clone(seg),
                            pin_off,
                            off: base + PAGE,
                            len: manifest.total_len(),
                        }),
                    ),
                };
                match ws {
                    Ok(ws) => group.push(Arc::new(ws)),
                    Err(e) => result = Err(e),
                }
            }
            result?;
            for &(m, v, _) in &fresh {
                self.seen[m] = v;
            }
            return Ok(Some(group));
        }
    }
}

impl ReceiverTransport for ShmReceiver {
    fn name(&self) -> &'static str {
        NAME
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
