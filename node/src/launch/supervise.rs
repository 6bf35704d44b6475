//! Watching the ranks: a failure is reported at once (rank, process, status or signal); a
//! rank whose process says `restart = "on-failure"` is started again while it has restarts
//! left; otherwise the failure ends the run or not as `on_failure` says. Rank 0 finishing
//! ends the run; SIGINT/SIGTERM to the launcher are passed on to every rank.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use refit_runtime::cleanup;
use refit_runtime::topology::OnFailure;

use super::RankSpawn;
use super::child::{self, Running};

const TICK: Duration = Duration::from_millis(25);

/// How long a failure that aborts the run waits for the lead to end on its own first: a
/// rank often fails because the lead has just ended (its connections closed as it did),
/// and then the lead's failure, not theirs, is the run's.
const LEAD_SETTLE: Duration = Duration::from_secs(1);

/// Starts the ranks of a launch and runs them to the end (what `refit launch` does once it
/// knows its ranks). Reports (a rank started, failed, restarted, stopped) are `tracing`
/// events of target `refit_node::launch::supervise`, at `info` for the expected ones and
/// `warn` or `error` for failures; each rank's output lines go to our stdout and stderr,
/// prefixed `[rank N process]`.
#[derive(Debug)]
pub struct Supervisor {
    grace: Duration,
    on_failure: OnFailure,
    ranks: Mutex<Vec<Running>>,
    interrupted: AtomicBool,
    /// Output streams opened so far (two per start).
    streams: AtomicUsize,
    /// Where each rank's output is also written (`rank-N-NAME.log`), if anywhere.
    log_dir: Option<PathBuf>,
    /// The first failure that ended or marred the run: who, and its cause.
    failure: Mutex<Option<String>>,
    /// The first failure a restart made good, reported only when no other failure was.
    recovered: Mutex<Option<String>>,
}

/// How the run ends.
enum End {
    /// The lead rank finished: the others get the grace period to exit on their own.
    LeadDone(u8),
    /// Stop the others now.
    Abort(u8),
    /// Every rank has exited.
    AllDone(u8),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One rank as its supervisor sees it now ([`Supervisor::ranks`]): what a status page shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankState {
    /// The rank.
    pub rank: u32,
    /// Its process's name.
    pub name: String,
    /// The pid of its current (or last) process.
    pub pid: u32,
    /// How many times it was restarted so far.
    pub restarts: u32,
    /// How many restarts it may have.
    pub max_restarts: u32,
    /// The `REFIT_INCARNATION` of its current (or last) process.
    pub incarnation: u32,
    /// How it ended (`exited with status 0`, `was killed by signal 9 (SIGKILL)`); `None`
    /// while it runs.
    pub ended: Option<String>,
    /// Whether it ended well (status 0); `None` while it runs.
    pub succeeded: Option<bool>,
}

impl Supervisor {
    /// Every rank started so far, in rank order, as it stands now.
    pub fn ranks(&self) -> Vec<RankState> {
        let mut out: Vec<RankState> = self
            .lock()
            .iter()
            .map(|r| RankState {
                rank: r.spec.rank,
                name: r.spec.name.clone(),
                pid: r.child.id(),
                restarts: r.restarts,
                max_restarts: r.spec.max_restarts,
                incarnation: r.spec.incarnation + r.restarts,
                ended: r.status.map(child::describe),
                succeeded: r.status.map(|s| s.success()),
            })
            .collect();
        out.sort_by_key(|r| r.rank);
        out
    }

    /// A supervisor that gives ranks `grace` to exit (after rank 0 is done, and after
    /// SIGTERM before SIGKILL) and treats a failure past its restarts as `on_failure` says.
    pub fn new(grace: Duration, on_failure: OnFailure) -> Arc<Self> {
        Self::with_log_dir(grace, on_failure, None)
    }

    /// As [`new`](Self::new), each rank's output also appended (unprefixed, as the rank
    /// printed it) to `log_dir/rank-N-NAME.log` (torchrun's `--log-dir` with `--tee`).
    pub fn with_log_dir(
        grace: Duration,
        on_failure: OnFailure,
        log_dir: Option<PathBuf>,
    ) -> Arc<Self> {
        Arc::new(Self {
            grace,
            on_failure,
            ranks: Mutex::new(Vec::new()),
            interrupted: AtomicBool::new(false),
            streams: AtomicUsize::new(0),
            log_dir,
            failure: Mutex::new(None),
            recovered: Mutex::new(None),
        })
    }

    /// The first failure of the run, once [`run`](Self::run) returned: `rank 1 (actor)
    /// failed: CAUSE`, with the first `error:` line the rank printed as its cause (or how
    /// it ended, when it printed none). A failure a restart made good is the run's only
    /// when no other rank failed; a restart that could not start is named by its own
    /// error. `None` when no rank failed.
    pub fn failure(&self) -> Option<String> {
        let failure = lock(&self.failure).clone();
        failure.or_else(|| lock(&self.recovered).clone())
    }

    /// Whether a signal (SIGINT, SIGTERM) stopped the last [`run`](Self::run).
    pub fn interrupted(&self) -> bool {
        self.interrupted.load(Ordering::SeqCst)
    }

    /// Forgets the last [`run`](Self::run)'s ranks and failure, for the next: a run started
    /// again whole (its ranks' restarts and statuses begin anew; the status page shows the
    /// new ranks).
    pub fn clear(&self) {
        self.lock().clear();
        *lock(&self.failure) = None;
        *lock(&self.recovered) = None;
        self.streams.store(0, Ordering::SeqCst);
    }

    /// Keeps `what` as the run's failure unless one came first.
    fn note_failure(&self, what: String) {
        lock(&self.failure).get_or_insert(what);
    }

    /// Starts every rank of `specs` (the first is the lead: the run ends with it) and
    /// supervises them; answers the launcher's exit status: the lead's, the failed rank's
    /// when a failure aborts the run, or 1 when a rank cannot be started. SIGINT/SIGTERM to
    /// this process stop every rank (SIGTERM to each rank's process group, the grace period,
    /// then SIGKILL) and exit with 128 + the signal (with
    /// [`install_signal_handlers`](crate::signals::install_signal_handlers)).
    ///
    /// Call it from the thread that lives as long as the launcher (the main thread): a
    /// rank's parent-death signal fires when the thread that started it exits.
    pub fn run(self: &Arc<Self>, specs: &[RankSpawn]) -> u8 {
        // stopping the ranks on SIGINT/SIGTERM takes up to two grace periods (SIGTERM, then
        // SIGKILL and the reaping): the release must not be cut short before that
        cleanup::set_release_bound(self.grace * 2 + Duration::from_secs(2));
        let me = Arc::clone(self);
        let _forward = cleanup::on_exit_signal(move || {
            me.interrupted.store(true, Ordering::SeqCst);
            tracing::info!("interrupted; stopping every rank");
            me.stop_all(false);
        });
        let (done_tx, done_rx) = mpsc::channel();
        for spec in specs {
            match self.start(spec, spec.incarnation, &done_tx) {
                Ok(child) => {
                    tracing::info!(
                        "started rank {} ({}) (pid {})",
                        spec.rank,
                        spec.name,
                        child.0.id()
                    );
                    lock(&self.ranks).push(Running {
                        spec: spec.clone(),
                        child: child.0,
                        status: None,
                        restarts: 0,
                        cause: child.1,
                    });
                }
                Err(()) => {
                    self.stop_all(false);
                    return 1;
                }
            }
        }
        let code = match self.watch(&done_tx) {
            End::LeadDone(code) => {
                self.stop_all(true);
                code
            }
            End::Abort(code) => {
                self.stop_all(false);
                code
            }
            End::AllDone(code) => code,
        };
        drop(done_tx);
        // let the output threads copy what is left (a grandchild holding a pipe open must
        // not keep the launcher waiting)
        let deadline = Instant::now() + Duration::from_secs(2);
        for _ in 0..self.streams.load(Ordering::SeqCst) {
            let left = deadline.saturating_duration_since(Instant::now());
            if done_rx.recv_timeout(left).is_err() {
                break;
            }
        }
        code
    }

    /// Starts one copy of `spec`, reporting a failure to start.
    fn start(
        &self,
        spec: &RankSpawn,
        incarnation: u32,
        done: &mpsc::Sender<()>,
    ) -> Result<(std::process::Child, child::Cause), ()> {
        let cause = child::Cause::default();
        match child::spawn(spec, incarnation, done, &cause, self.log_dir.as_deref()) {
            Ok(c) => {
                self.streams.fetch_add(2, Ordering::SeqCst);
                Ok((c, cause))
            }
            Err(e) => {
                let why = super::check::cannot_start(spec, &e).to_string();
                tracing::error!("{why}");
                self.note_failure(why);
                Err(())
            }
        }
    }

    /// Starts the rank at `at` again if its spec allows another restart and the run is not
    /// being stopped; true when it runs again.
    fn restart(&self, at: usize, done: &mpsc::Sender<()>) -> bool {
        // under the lock of the ranks: a stop that starts now signals the new process too
        let mut ranks = self.lock();
        let r = &mut ranks[at];
        let max_restarts = r.spec.max_restarts;
        if r.spec.rank == 0 || r.restarts >= max_restarts {
            if max_restarts > 0 {
                tracing::error!(
                    "{} has no restart left (max_restarts = {max_restarts})",
                    r.label(),
                );
            }
            return false;
        }
        if self.interrupted.load(Ordering::SeqCst) {
            return false;
        }
        let incarnation = r.spec.incarnation + r.restarts + 1;
        match self.start(&r.spec, incarnation, done) {
            Ok((child, cause)) => {
                r.restarts += 1;
                r.cause = cause;
                tracing::warn!(
                    "restarted {} (restart {} of {}, REFIT_INCARNATION={incarnation}, pid {})",
                    r.label(),
                    r.restarts,
                    max_restarts,
                    child.id()
                );
                r.child = child;
                r.status = None;
                true
            }
            Err(()) => false,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Running>> {
        lock(&self.ranks)
    }

    /// Polls the ranks until the run ends.
    fn watch(&self, done: &mpsc::Sender<()>) -> End {
        let on_failure = self.on_failure;
        loop {
            let mut ended = Vec::new();
            {
                let mut ranks = self.lock();
                for (i, r) in ranks.iter_mut().enumerate() {
                    if r.status.is_some() {
                        continue;
                    }
                    match r.child.try_wait() {
                        Ok(Some(status)) => {
                            r.status = Some(status);
                            ended.push((i, r.label(), status));
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!("cannot wait for {}: {e}", r.label());
                        }
                    }
                }
            }
            if self.interrupted.load(Ordering::SeqCst) {
                // the signal thread stops everything and exits the process
                std::thread::sleep(TICK);
                continue;
            }
            let mut told = Vec::new();
            if ended.iter().any(|(i, _, s)| *i == 0 && !s.success()) {
                // a lead that failed may have failed because another rank died a moment
                // before (it ends the run at once): every other rank already gone is named
                // before it (the lead's failure stays the run's)
                self.sweep(&mut ended);
                for (i, label, status) in &ended {
                    if *i != 0 && !status.success() {
                        tracing::error!("{label} failed: it {}", child::describe(*status));
                        told.push(*i);
                    }
                }
            }
            for (i, label, status) in ended {
                let code = child::exit_code(status);
                if status.success() {
                    tracing::info!("{label} {}", child::describe(status));
                    if i == 0 {
                        return End::LeadDone(0);
                    }
                    continue;
                }
                if !told.contains(&i) {
                    tracing::error!("{label} failed: it {}", child::describe(status));
                }
                let what = self.failure_of(i, &label, status);
                if self.restart(i, done) {
                    lock(&self.recovered).get_or_insert(what);
                    continue;
                }
                self.note_failure(what);
                if i == 0 {
                    if self.lock().len() > 1 {
                        tracing::warn!("rank 0 ended; stopping the other ranks");
                    }
                    return End::Abort(code);
                }
                match on_failure {
                    OnFailure::Abort => {
                        self.settle_lead();
                        tracing::error!(
                            "stopping the run (on_failure = \"abort\") after {label} failed"
                        );
                        return End::Abort(code);
                    }
                    OnFailure::Continue => tracing::warn!(
                        "the run goes on without {label} (on_failure = \"continue\")"
                    ),
                }
            }
            let ranks = self.lock();
            if ranks.iter().all(|r| r.status.is_some()) {
                return End::AllDone(
                    ranks
                        .first()
                        .and_then(|r| r.status)
                        .map_or(1, child::exit_code),
                );
            }
            drop(ranks);
            std::thread::sleep(TICK);
        }
    }

    /// Waits at most [`LEAD_SETTLE`] for the lead (rank 0, when this launcher runs it) to
    /// end on its own; a lead that failed meanwhile is named, and its failure becomes the
    /// run's (as when the lead fails first: the others may have failed because of it).
    fn settle_lead(&self) {
        let deadline = Instant::now() + LEAD_SETTLE;
        loop {
            let ended = {
                let mut ranks = self.lock();
                let Some(lead) = ranks.first_mut().filter(|r| r.spec.rank == 0) else {
                    return;
                };
                if lead.status.is_some() {
                    return;
                }
                match lead.child.try_wait() {
                    Ok(Some(status)) => {
                        lead.status = Some(status);
                        Some((lead.label(), status))
                    }
                    Ok(None) => None,
                    Err(_) => return,
                }
            };
            if let Some((label, status)) = ended {
                if !status.success() {
                    tracing::error!("{label} failed: it {}", child::describe(status));
                    let what = self.failure_of(0, &label, status);
                    *lock(&self.failure) = Some(what);
                }
                return;
            }
            if Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Adds to `ended` every rank other than 0 that has exited and was not seen yet.
    fn sweep(&self, ended: &mut Vec<(usize, String, std::process::ExitStatus)>) {
        let mut ranks = self.lock();
        for (i, r) in ranks.iter_mut().enumerate().skip(1) {
            if r.status.is_none()
                && let Ok(Some(status)) = r.child.try_wait()
            {
                r.status = Some(status);
                ended.push((i, r.label(), status));
            }
        }
    }

    /// `rank 1 (actor) failed: CAUSE` for the rank at `at`, which ended with `status`: the
    /// first cause it printed, else how it ended. The output threads may still be copying
    /// its last lines: they get a moment to.
    fn failure_of(&self, at: usize, label: &str, status: std::process::ExitStatus) -> String {
        let cause = Arc::clone(&self.lock()[at].cause);
        let deadline = Instant::now() + Duration::from_millis(200);
        loop {
            if let Some(c) = lock(&cause).clone() {
                return format!("{label} failed: {c}");
            }
            if Instant::now() >= deadline {
                return format!("{label} failed: it {}", child::describe(status));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Reaps what has exited; true when every rank has.
    fn reap(&self) -> bool {
        let mut ranks = self.lock();
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                r.status = Some(status);
            }
        }
        ranks.iter().all(|r| r.status.is_some())
    }

    /// Waits up to the grace period for every rank to exit.
    fn wait_grace(&self) -> bool {
        let deadline = Instant::now() + self.grace;
        loop {
            if self.reap() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(TICK);
        }
    }

    /// Stops every rank still running: (after a grace period to exit on their own, when
    /// `wait_first`) SIGTERM to each rank's process group, the grace period, then SIGKILL.
    fn stop_all(&self, wait_first: bool) {
        if wait_first && self.wait_grace() {
            return;
        }
        {
            let ranks = self.lock();
            let asked = self.interrupted.load(Ordering::SeqCst);
            for r in ranks.iter().filter(|r| r.status.is_none()) {
                if asked {
                    tracing::debug!("stopping {} (SIGTERM)", r.label());
                } else {
                    tracing::info!("stopping {} (SIGTERM)", r.label());
                }
                r.signal_group(libc::SIGTERM);
            }
        }
        if self.wait_grace() {
            return;
        }
        let mut ranks = self.lock();
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            tracing::warn!(
                "{} still runs {:?} after SIGTERM; SIGKILL",
                r.label(),
                self.grace
            );
            r.signal_group(libc::SIGKILL);
            r.status = r.child.wait().ok();
        }
    }
}
