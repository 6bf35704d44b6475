//! A version while it is being pulled, shared between the threads that pull it and the relay
//! that serves it on: each pulling thread claims the buckets of its stream one at a time and
//! writes one piece after another (a socket read each), publishing how far it got; a relayed
//! pull serves those bytes as soon as they are there, before the bucket is complete or
//! verified. Relays therefore pipeline piece by piece, whatever the bucket size, and a chain
//! of receivers moves a version in about the time of one hop.
//!
//! Checksums stay per bucket: each receiver of a chain hashes the bytes it gets and verifies
//! them itself against the sender's checksums (the transfer's terms, or the header the
//! sender wrote, which relays pass on as it was and never compute from their own bytes), so
//! a damaged bucket that a relay already passed on is refused by every receiver that got it
//! (and the relay's own failure ends the streams it serves).
//!
//! Nobody holds a reference to the whole arena until every bucket has landed: a writer gets
//! the one piece it is about to read into, readers the bytes of a bucket written so far
//! (never written again).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use refit_runtime::{BucketPlan, Error, Result, WeightSet};

use super::NAME;
use super::wait::wait_changes;

/// Not pulled by this transfer (for a delta: copied from the base before the pull began).
const ABSENT: u8 = 0;
/// To be pulled, not claimed yet.
const EXPECTED: u8 = 1;
/// Claimed by one pulling thread; its header's checksum not published yet.
const CLAIMED: u8 = 2;
/// Being written, its header's checksum published: the bytes up to its progress can be
/// served.
const WRITING: u8 = 3;
/// Written and verified; read-only from now on.
const LANDED: u8 = 4;

/// What a bucket's header declared: its checksum and its pieces' (what a relayed pull
/// passes on with the bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Declared {
    pub(crate) checksum: u64,
    /// Its pieces' checksums, as the header declared them (empty from a header that left
    /// them to the transfer's terms).
    pub(crate) pieces: Vec<u64>,
}

/// A version being pulled into its arena.
pub(crate) struct InFlight {
    /// Owns the arena (keeps it alive for readers); never read whole before
    /// [`InFlight::finish`].
    weights: Arc<WeightSet>,
    ptr: *mut u8,
    len: usize,
    pub(crate) plan: Arc<BucketPlan>,
    pub(crate) plan_id: u64,
    state: Vec<AtomicU8>,
    /// What each bucket's header declared (set when its writer starts).
    declared: Vec<OnceLock<Declared>>,
    /// Bytes of each bucket written so far, from its start.
    progress: Vec<AtomicUsize>,
    failed: AtomicBool,
    notify: tokio::sync::Notify,
    /// Longest wait of a relayed pull for the next bytes of a bucket.
    wait: Duration,
}

// SAFETY: `ptr` points into the arena that `weights` owns (kept alive as long as `self`), and
// every access through it follows the claim protocol: a bucket is written only by the one
// thread whose `claim` moved it from EXPECTED to CLAIMED (through the `BucketWriter` it got),
// one piece past its published progress at a time; readers only read the bytes below the
// progress they loaded (a Release store paired with their Acquire load), which nobody
// writes again.
unsafe impl Send for InFlight {}
// SAFETY: as for `Send`: shared access follows the same claim protocol.
unsafe impl Sync for InFlight {}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight")
            .field("model", self.weights.model())
            .field("version", &self.weights.version())
            .field("buckets", &self.state.len())
            .finish()
    }
}

/// The writing end of a claimed bucket: hands out the next piece to fill, publishes each
/// filled piece to relayed pulls ([`BucketWriter::arrived`]), and gives the bucket up once
/// verified ([`BucketWriter::land`]).
pub(crate) struct BucketWriter<'a> {
    owner: &'a InFlight,
    index: usize,
    start: *mut u8,
    len: usize,
    /// Bytes published so far.
    written: usize,
}

impl BucketWriter<'_> {
    /// The bucket's index in the plan.
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// The bucket's length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes `at..end` of the bucket, to be filled: `at` must be the bytes published
    /// so far (the next piece), `end` at most the bucket's length.
    ///
    /// # Errors
    /// [`Error::State`] for a piece that is not the next one or runs past the bucket.
    pub(crate) fn piece(&mut self, at: usize, end: usize) -> Result<&mut [u8]> {
        if at != self.written || end < at || end > self.len {
            return Err(Error::State(
                "a bucket written out of order or past its end",
            ));
        }
        // SAFETY: `claim` made this writer the only one of bucket `index`, whose `len` bytes
        // at `start` lie inside the arena (alive as long as `owner`). Readers only read below
        // the published progress, `written` <= `at`, so the bytes `at..end` are touched by
        // nobody else; the `&mut self` borrow keeps a second piece from being handed out
        // while this one lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.start.add(at), end - at) })
    }

    /// The bytes up to `end` are written: relayed pulls may serve them.
    pub(crate) fn arrived(&mut self, end: usize) {
        self.written = end.clamp(self.written, self.len);
        if let Some(p) = self.owner.progress.get(self.index) {
            p.store(self.written, Ordering::Release);
        }
        self.owner.notify.notify_waiters();
    }

    /// The bytes written so far (all of the bucket once every piece arrived).
    pub(crate) fn written(&self) -> &[u8] {
        // SAFETY: the first `written` bytes were filled through `piece` and published; no
        // `&mut` to them exists any more (`piece`'s borrow of `self` ended), and nobody
        // writes them again, so sharing them with readers is sound.
        unsafe { std::slice::from_raw_parts(self.start, self.written) }
    }

    /// The bucket is written and verified.
    pub(crate) fn land(self) {
        if let Some(s) = self.owner.state.get(self.index) {
            s.store(LANDED, Ordering::Release);
        }
        self.owner.notify.notify_waiters();
    }
}

impl InFlight {
    /// Takes `weights` (its arena uniquely owned, the version set, the buckets a delta does
    /// not pull already copied in) for a transfer of `buckets` (strictly ascending, each
    /// inside the arena) by `plan`.
    ///
    /// # Errors
    /// [`Error::Transport`] for buckets out of order or outside the arena;
    /// [`Error::State`] when the arena is not writable.
    pub(crate) fn new(
        mut weights: WeightSet,
        plan: Arc<BucketPlan>,
        plan_id: u64,
        buckets: &[u32],
        wait: Duration,
    ) -> Result<Self> {
        let arena = weights.bytes_mut()?;
        let (ptr, len) = (arena.as_mut_ptr(), arena.len());
        let state: Vec<AtomicU8> = (0..plan.len()).map(|_| AtomicU8::new(ABSENT)).collect();
        let mut end = 0usize;
        let mut last: Option<u32> = None;
        for &i in buckets {
            let b = plan
                .buckets
                .get(i as usize)
                .ok_or_else(|| Error::transport(NAME, format!("bucket {i} is not in the plan")))?;
            if last.is_some_and(|l| l >= i) || b.start < end || b.start + b.len > len {
                return Err(Error::transport(
                    NAME,
                    format!("bucket {i} is out of order, overlaps another or runs past the arena"),
                ));
            }
            end = b.start + b.len;
            last = Some(i);
            if let Some(s) = state.get(i as usize) {
                s.store(EXPECTED, Ordering::Relaxed);
            }
        }
        Ok(Self {
            declared: (0..plan.len()).map(|_| OnceLock::new()).collect(),
            progress: (0..plan.len()).map(|_| AtomicUsize::new(0)).collect(),
            weights: Arc::new(weights),
            ptr,
            len,
            plan,
            plan_id,
            state,
            failed: AtomicBool::new(false),
            notify: tokio::sync::Notify::new(),
            wait,
        })
    }

    /// The version being pulled.
    pub(crate) fn version(&self) -> refit_runtime::Version {
        self.weights.version()
    }

    /// Claims bucket `i` for writing, its header declaring `declared` (what a relayed pull
    /// passes on with the bytes): `None` when it is not expected or already claimed.
    pub(crate) fn claim(&self, i: usize, declared: Declared) -> Option<BucketWriter<'_>> {
        let b = self.plan.buckets.get(i)?;
        let state = self.state.get(i)?;
        state
            .compare_exchange(EXPECTED, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        debug_assert!(b.start + b.len <= self.len);
        if let Some(d) = self.declared.get(i) {
            // the claim above makes this thread the bucket's only writer: set once
            let _ = d.set(declared);
        }
        state.store(WRITING, Ordering::Release);
        self.notify.notify_waiters();
        Some(BucketWriter {
            owner: self,
            index: i,
            // SAFETY: `new` checked that the bucket lies inside the arena (`len` bytes at
            // `ptr`), so the offset stays inside the same allocation.
            start: unsafe { self.ptr.add(b.start) },
            len: b.len,
            written: 0,
        })
    }

    /// Faults in the pages of every bucket no pulling thread has claimed yet, in plan order
    /// (the order the streams claim them in), until `stop` is set or every bucket is done:
    /// run beside the pulling threads on a fresh arena, it takes the first touch of its
    /// pages (the kernel zeroing them, and on a virtual machine the host backing them) out
    /// of the socket reads, which otherwise fault page by page while they copy. Only whole
    /// pages inside a bucket are advised; contents are never changed (populating a page that
    /// is already there does nothing). A kernel without `MADV_POPULATE_WRITE` (before 5.14)
    /// refuses the advice: the pulling threads then fault the pages in as before.
    pub(crate) fn prefault(&self, stop: &AtomicBool) {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: sysconf only reads a constant of the system.
            let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
                .unwrap_or(4096)
                .max(1);
            for (i, b) in self.plan.buckets.iter().enumerate() {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                if self.state.get(i).map(|s| s.load(Ordering::Acquire)) != Some(EXPECTED) {
                    continue;
                }
                let at = self.ptr as usize + b.start;
                let (first, end) = (at.next_multiple_of(page), (at + b.len) / page * page);
                if end <= first {
                    continue;
                }
                // SAFETY: `new` checked that the bucket lies inside the arena (`len` bytes at
                // `ptr`, mapped as long as `self.weights` lives, which outlives this call);
                // the advised range is the whole pages inside it. MADV_POPULATE_WRITE faults
                // pages in as writable without changing any byte (a page already present is
                // left as it is), so a pulling thread writing the same bucket concurrently
                // loses nothing, and no Rust reference to the bytes is made here.
                let r = unsafe {
                    libc::madvise(
                        first as *mut libc::c_void,
                        end - first,
                        libc::MADV_POPULATE_WRITE,
                    )
                };
                if r != 0 {
                    return;
                }
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = stop;
    }

    /// The pull failed: relayed pulls waiting on a bucket give up.
    pub(crate) fn fail(&self) {
        self.failed.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// What bucket `i`'s header declared, once its writer started (`None` before).
    fn started_now(&self, i: usize) -> std::result::Result<Option<Declared>, String> {
        match self.state(i)? {
            WRITING | LANDED => Ok(self.declared.get(i).and_then(OnceLock::get).cloned()),
            _ => Ok(None),
        }
    }

    /// The bytes of bucket `i` from `from` up to what has arrived, once past `from`.
    fn arrived_now(&self, i: usize, from: usize) -> std::result::Result<Option<&[u8]>, String> {
        let state = self.state(i)?;
        let Some(b) = self.plan.buckets.get(i) else {
            return Err(format!("bucket {i} is not in the plan"));
        };
        if state != WRITING && state != LANDED {
            return Ok(None);
        }
        let upto = self
            .progress
            .get(i)
            .map_or(0, |p| p.load(Ordering::Acquire))
            .min(b.len);
        if upto <= from {
            return Ok(None);
        }
        // SAFETY: the bytes below `upto` were written by the bucket's only writer and
        // published with a Release store of its progress, loaded here with Acquire; nobody
        // writes them again. `new` checked the bucket lies inside the arena, alive as long
        // as `self`.
        Ok(Some(unsafe {
            std::slice::from_raw_parts(self.ptr.add(b.start + from), upto - from)
        }))
    }

    /// Bucket `i`'s state; an error when it is not part of the transfer, or (unless it has
    /// landed) when the pull failed.
    fn state(&self, i: usize) -> std::result::Result<u8, String> {
        let state = self
            .state
            .get(i)
            .map(|s| s.load(Ordering::Acquire))
            .unwrap_or(ABSENT);
        if state == ABSENT {
            return Err(format!(
                "bucket {i} is not part of this relay's transfer of version {}",
                self.version()
            ));
        }
        if state != LANDED && self.failed.load(Ordering::Acquire) {
            return Err(format!(
                "this relay's own pull of version {} failed",
                self.version()
            ));
        }
        Ok(state)
    }

    /// Waits until `check` answers, each landing, piece or failure waking it.
    async fn wait_for<T>(
        &self,
        what: impl FnOnce() -> String,
        mut check: impl FnMut() -> std::result::Result<Option<T>, String>,
    ) -> std::result::Result<T, String> {
        let deadline = tokio::time::Instant::now() + self.wait;
        let arm = || {
            let mut change = Box::pin(self.notify.notified());
            change.as_mut().enable();
            change
        };
        wait_changes(deadline, None, arm, &mut check)
            .await?
            .ok_or_else(|| format!("{} within {:?}", what(), self.wait))
    }

    /// Waits until bucket `i`'s writer has started; what its header declared.
    ///
    /// # Errors
    /// A reason when the bucket is not part of this transfer, the pull failed, or no writer
    /// started within the wait.
    pub(crate) async fn started(&self, i: usize) -> std::result::Result<Declared, String> {
        let what = || format!("bucket {i} of version {} did not start", self.version());
        self.wait_for(what, || self.started_now(i)).await
    }

    /// Waits until bytes of bucket `i` past `from` have arrived; those bytes (up to what has
    /// arrived so far).
    ///
    /// # Errors
    /// A reason when the bucket is not part of this transfer, the pull failed, or no byte
    /// arrived within the wait.
    pub(crate) async fn arrived(
        &self,
        i: usize,
        from: usize,
    ) -> std::result::Result<&[u8], String> {
        let what = || {
            format!(
                "no byte of bucket {i} of version {} past {from} arrived",
                self.version()
            )
        };
        self.wait_for(what, || self.arrived_now(i, from)).await
    }

    /// The weights, once every expected bucket has landed.
    ///
    /// # Errors
    /// [`Error::Transport`] naming a bucket that has not landed.
    pub(crate) fn finish(&self) -> Result<Arc<WeightSet>> {
        if let Some(i) = self.state.iter().position(|s| {
            let s = s.load(Ordering::Acquire);
            s != ABSENT && s != LANDED
        }) {
            return Err(Error::transport(
                NAME,
                format!("bucket {i} of the transfer never landed"),
            ));
        }
        Ok(Arc::clone(&self.weights))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use refit_runtime::{DType, Manifest, ModelId, Version};

    fn sum(checksum: u64) -> Declared {
        Declared {
            checksum,
            pieces: vec![checksum],
        }
    }

    fn flight(buckets: &[u32]) -> InFlight {
        let m = Arc::new({
            let mut b = Manifest::builder();
            for i in 0..4 {
                b.push(format!("t{i}"), DType::U8, &[256]);
            }
            b.build().unwrap()
        });
        let id = ModelId::new("m").unwrap();
        let plan = Arc::new(BucketPlan::compute(&id, &m, &m, 256).unwrap());
        let mut ws = WeightSet::zeroed(id, m);
        ws.set_version(Version(7));
        InFlight::new(ws, plan, 1, buckets, Duration::from_secs(5)).unwrap()
    }

    /// Writes all of `w` with `byte`, in pieces of `step` bytes, publishing each.
    fn fill(w: &mut BucketWriter<'_>, byte: u8, step: usize) {
        let mut at = 0;
        while at < w.len() {
            let end = (at + step).min(w.len());
            w.piece(at, end).unwrap().fill(byte);
            w.arrived(end);
            at = end;
        }
    }

    use crate::tcp::test_runtime as rt;

    #[test]
    fn buckets_are_written_once_and_served_as_their_pieces_arrive() {
        let f = flight(&[0, 2, 3]);
        // a bucket outside the transfer can be neither claimed nor served
        assert!(f.claim(1, sum(0)).is_none());
        assert!(f.started_now(1).is_err());
        assert!(f.arrived_now(1, 0).is_err());
        assert_eq!(f.started_now(2), Ok(None), "not claimed yet");
        let mut w = f.claim(2, sum(42)).unwrap();
        assert!(f.claim(2, sum(42)).is_none(), "claimed twice");
        // the header's checksum is known as soon as the writer starts, before any byte
        assert_eq!(f.started_now(2), Ok(Some(sum(42))));
        assert_eq!(f.arrived_now(2, 0), Ok(None));
        // pieces are handed out in order only
        assert!(w.piece(10, 20).is_err());
        assert!(w.piece(0, 257).is_err());
        w.piece(0, 100).unwrap().fill(9);
        // written but not published: nothing to serve yet
        assert_eq!(f.arrived_now(2, 0), Ok(None));
        w.arrived(100);
        assert_eq!(f.arrived_now(2, 0).unwrap().unwrap(), &[9u8; 100][..]);
        assert_eq!(f.arrived_now(2, 100), Ok(None));
        assert!(
            w.piece(0, 10).is_err(),
            "a published piece is not handed out again"
        );
        w.piece(100, 256).unwrap().fill(8);
        w.arrived(256);
        let rest = f.arrived_now(2, 100).unwrap().unwrap();
        assert_eq!(rest.len(), 156);
        assert!(rest.iter().all(|&b| b == 8));
        assert_eq!(w.written().len(), 256);
        assert!(f.finish().is_err(), "bucket 2 is not verified yet");
        w.land();
        assert!(f.finish().is_err(), "buckets 0 and 3 are missing");
        // a waiting reader is woken by each piece another thread publishes
        std::thread::scope(|s| {
            let f = &f;
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                let mut w = f.claim(3, sum(3)).unwrap();
                std::thread::sleep(Duration::from_millis(20));
                fill(&mut w, 3, 64);
                w.land();
            });
            let rt = rt();
            assert_eq!(rt.block_on(f.started(3)), Ok(sum(3)));
            let mut got = Vec::new();
            while got.len() < 256 {
                let bytes = rt.block_on(f.arrived(3, got.len())).unwrap();
                assert!(!bytes.is_empty());
                got.extend_from_slice(bytes);
            }
            assert_eq!(got, [3u8; 256]);
        });
        let mut w = f.claim(0, sum(0)).unwrap();
        fill(&mut w, 1, 256);
        w.land();
        let ws = f.finish().unwrap();
        assert_eq!(ws.bytes()[2 * 256..2 * 256 + 100], [9u8; 100]);
        assert_eq!(ws.bytes()[2 * 256 + 100..3 * 256], [8u8; 156]);
        assert_eq!(ws.version(), Version(7));
    }

    #[test]
    fn prefaulting_beside_the_writers_loses_no_byte() {
        // a fresh mapped arena (4 MiB: large enough to be an anonymous map), buckets of
        // 64 KiB + 64 bytes so that most bucket edges fall inside a page
        let m = Arc::new({
            let mut b = Manifest::builder();
            for i in 0..62 {
                b.push(format!("t{i}"), DType::U8, &[(64 << 10) + 64]);
            }
            b.build().unwrap()
        });
        let id = ModelId::new("m").unwrap();
        let plan = Arc::new(BucketPlan::compute(&id, &m, &m, (64 << 10) + 64).unwrap());
        let all: Vec<u32> = (0..u32::try_from(plan.len()).unwrap()).collect();
        let n = all.len();
        for round in 0..3 {
            let ws = WeightSet::zeroed(id.clone(), Arc::clone(&m));
            let f = InFlight::new(ws, Arc::clone(&plan), 1, &all, Duration::from_secs(1)).unwrap();
            let stop = AtomicBool::new(false);
            std::thread::scope(|s| {
                let (f, stop) = (&f, &stop);
                s.spawn(move || f.prefault(stop));
                // the writers race the prefault from both ends
                s.spawn(move || {
                    for i in (0..n).rev().step_by(2) {
                        let mut w = f.claim(i, sum(0)).unwrap();
                        fill(&mut w, i as u8 | 1, 4096);
                        w.land();
                    }
                });
                for i in (0..n).filter(|i| (n - 1 - i) % 2 == 1) {
                    let mut w = f.claim(i, sum(0)).unwrap();
                    fill(&mut w, i as u8 | 1, 4096);
                    w.land();
                }
                if round == 2 {
                    stop.store(true, Ordering::Relaxed);
                }
            });
            // and once more after every bucket landed: it advises nothing then
            f.prefault(&AtomicBool::new(false));
            let ws = f.finish().unwrap();
            for (i, b) in plan.buckets.iter().enumerate() {
                let bytes = &ws.bytes()[b.range()];
                assert!(bytes.iter().all(|&x| x == i as u8 | 1), "bucket {i}");
            }
        }
    }

    #[test]
    fn a_failed_pull_releases_waiting_readers() {
        let f = flight(&[0, 1]);
        // a reader waiting for a bucket to start, and one part-way through a bucket whose
        // bytes a relay passed on before its pull failed
        let mut w = f.claim(0, sum(5)).unwrap();
        w.piece(0, 128).unwrap().fill(1);
        w.arrived(128);
        std::thread::scope(|s| {
            let f = &f;
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                f.fail();
            });
            let rt = rt();
            let e = rt.block_on(f.started(1)).unwrap_err();
            assert!(e.contains("failed"), "{e}");
            let e = rt.block_on(f.arrived(0, 128)).unwrap_err();
            assert!(e.contains("failed"), "{e}");
        });
        // nothing of a failed pull is served any more
        assert!(f.arrived_now(0, 0).is_err());
    }

    #[test]
    fn overlapping_or_unordered_buckets_are_refused() {
        let m = Arc::new(
            Manifest::builder()
                .tensor("t", DType::U8, &[1024])
                .build()
                .unwrap(),
        );
        let id = ModelId::new("m").unwrap();
        let plan = Arc::new(BucketPlan::compute(&id, &m, &m, 256).unwrap());
        for bad in [&[1u32, 0][..], &[2, 2], &[9]] {
            let ws = WeightSet::zeroed(id.clone(), Arc::clone(&m));
            let r = InFlight::new(ws, Arc::clone(&plan), 1, bad, Duration::from_secs(1));
            assert!(r.is_err(), "{bad:?}");
        }
    }
}
