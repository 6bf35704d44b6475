//! A version while it is being pulled, shared between the threads that pull it and the relay
//! that serves it on: each pulling thread claims the buckets of its stream one at a time,
//! writes and verifies one, then marks it landed; a relayed pull serves a bucket as soon as it
//! has landed. Relays therefore pipeline bucket by bucket instead of storing and forwarding
//! whole versions, and a chain of receivers moves a version in about the time of one hop.
//!
//! Nobody holds a reference to the whole arena until every bucket has landed: writers get the
//! one bucket they claimed, readers one bucket that landed (never written again).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use refit_runtime::{BucketPlan, Error, Result, WeightSet};

use super::NAME;
use super::wait::wait_changes;

/// Not pulled by this transfer (for a delta: copied from the base before the pull began).
const ABSENT: u8 = 0;
/// To be pulled, not claimed yet.
const EXPECTED: u8 = 1;
/// Claimed by one pulling thread, being written.
const WRITING: u8 = 2;
/// Written and verified; read-only from now on.
const LANDED: u8 = 3;

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
    sums: Vec<AtomicU64>,
    failed: AtomicBool,
    notify: tokio::sync::Notify,
    /// Longest wait of a relayed pull for one bucket to land.
    wait: Duration,
}

// SAFETY: `ptr` points into the arena that `weights` owns (kept alive as long as `self`), and
// every access through it is to one bucket at a time under the claim protocol: a bucket is
// written only by the one thread whose `claim` moved it from EXPECTED to WRITING (through the
// `BucketWriter` it got, consumed by `land`), and read only after it reached LANDED (a
// Release store paired with the readers' Acquire load), after which nobody writes it.
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

/// The one writable view of a claimed bucket; [`BucketWriter::land`] gives it up.
pub(crate) struct BucketWriter<'a> {
    owner: &'a InFlight,
    index: usize,
    bytes: &'a mut [u8],
}

impl std::ops::Deref for BucketWriter<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl std::ops::DerefMut for BucketWriter<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl BucketWriter<'_> {
    /// The bucket is written and verified (its checksum `sum`): relayed pulls may serve it.
    pub(crate) fn land(self, sum: u64) {
        let Self { owner, index, .. } = self;
        if let Some(s) = owner.sums.get(index) {
            s.store(sum, Ordering::Relaxed);
        }
        if let Some(s) = owner.state.get(index) {
            s.store(LANDED, Ordering::Release);
        }
        owner.notify.notify_waiters();
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
            sums: (0..plan.len()).map(|_| AtomicU64::new(0)).collect(),
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

    /// Claims bucket `i` for writing: `None` when it is not expected or already claimed.
    pub(crate) fn claim(&self, i: usize) -> Option<BucketWriter<'_>> {
        let b = self.plan.buckets.get(i)?;
        self.state
            .get(i)?
            .compare_exchange(EXPECTED, WRITING, Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        debug_assert!(b.start + b.len <= self.len);
        // SAFETY: `new` checked that the bucket lies inside the arena (`len` bytes at
        // `ptr`, alive as long as `self.weights`) and overlaps no other expected bucket; the
        // compare-exchange above lets exactly one caller reach here for bucket `i`, and no
        // reader touches it before it is LANDED, which only this writer's `land` sets.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(b.start), b.len) };
        Some(BucketWriter {
            owner: self,
            index: i,
            bytes,
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

    fn landed_now(&self, i: usize) -> std::result::Result<Option<(&[u8], u64)>, String> {
        let state = self
            .state
            .get(i)
            .map(|s| s.load(Ordering::Acquire))
            .unwrap_or(ABSENT);
        match (state, self.plan.buckets.get(i)) {
            (LANDED, Some(b)) => {
                // SAFETY: LANDED is stored (Release) after the bucket's only writer is done,
                // and loaded here with Acquire; nobody writes a landed bucket again. `new`
                // checked the range lies inside the arena, alive as long as `self`.
                let bytes = unsafe { std::slice::from_raw_parts(self.ptr.add(b.start), b.len) };
                let sum = self.sums.get(i).map_or(0, |s| s.load(Ordering::Relaxed));
                Ok(Some((bytes, sum)))
            }
            (ABSENT, _) | (_, None) => Err(format!(
                "bucket {i} is not part of this relay's transfer of version {}",
                self.version()
            )),
            _ if self.failed.load(Ordering::Acquire) => Err(format!(
                "this relay's own pull of version {} failed",
                self.version()
            )),
            _ => Ok(None),
        }
    }

    /// Waits until bucket `i` has landed; its bytes and checksum.
    ///
    /// # Errors
    /// A reason when the bucket is not part of this transfer, the pull failed, or the bucket
    /// did not land within the wait.
    pub(crate) async fn landed(&self, i: usize) -> std::result::Result<(&[u8], u64), String> {
        let deadline = tokio::time::Instant::now() + self.wait;
        let arm = || {
            let mut landing = Box::pin(self.notify.notified());
            landing.as_mut().enable();
            landing
        };
        wait_changes(deadline, None, arm, || self.landed_now(i))
            .await?
            .ok_or_else(|| {
                format!(
                    "bucket {i} of version {} did not land within {:?}",
                    self.version(),
                    self.wait
                )
            })
    }

    /// The weights, once every expected bucket has landed.
    ///
    /// # Errors
    /// [`Error::Transport`] naming a bucket that has not landed.
    pub(crate) fn finish(&self) -> Result<Arc<WeightSet>> {
        if let Some(i) = self.state.iter().position(|s| {
            let s = s.load(Ordering::Acquire);
            s == EXPECTED || s == WRITING
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

    #[test]
    fn buckets_are_written_once_and_served_once_landed() {
        let f = flight(&[0, 2, 3]);
        // a bucket outside the transfer can be neither claimed nor served
        assert!(f.claim(1).is_none());
        assert!(f.landed_now(1).is_err());
        let mut w = f.claim(2).unwrap();
        assert!(f.claim(2).is_none(), "claimed twice");
        w.fill(9);
        assert_eq!(f.landed_now(2), Ok(None));
        w.land(42);
        let (bytes, sum) = f.landed_now(2).unwrap().unwrap();
        assert!(bytes.iter().all(|&b| b == 9));
        assert_eq!((bytes.len(), sum), (256, 42));
        assert!(f.finish().is_err(), "buckets 0 and 3 are missing");
        // a waiting reader is woken by the landing of another thread
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        std::thread::scope(|s| {
            let f = &f;
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                let mut w = f.claim(3).unwrap();
                w.fill(3);
                w.land(3);
            });
            let (bytes, _) = rt.block_on(f.landed(3)).unwrap();
            assert!(bytes.iter().all(|&b| b == 3));
        });
        f.claim(0).unwrap().land(0);
        let ws = f.finish().unwrap();
        assert_eq!(ws.bytes()[2 * 256..3 * 256], [9u8; 256]);
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
                        let mut w = f.claim(i).unwrap();
                        w.fill(i as u8 | 1);
                        w.land(0);
                    }
                });
                for i in (0..n).filter(|i| (n - 1 - i) % 2 == 1) {
                    let mut w = f.claim(i).unwrap();
                    w.fill(i as u8 | 1);
                    w.land(0);
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
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        std::thread::scope(|s| {
            let f = &f;
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                f.fail();
            });
            let e = rt.block_on(f.landed(1)).unwrap_err();
            assert!(e.contains("failed"), "{e}");
        });
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
