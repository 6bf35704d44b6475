//! Watching the ranks: a failure is reported at once (rank, process, status or signal) and
//! ends the run or not as `on_failure` says; rank 0 finishing ends the run; SIGINT/SIGTERM
//! to the launcher are passed on to every rank.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use refit::runtime::cleanup;
use refit::runtime::topology::OnFailure;

use super::child::{self, RankSpawn, Running};

const TICK: Duration = Duration::from_millis(25);

/// Runs the ranks to the end.
#[derive(Debug)]
pub(crate) struct Supervisor {
    grace: Duration,
    on_failure: OnFailure,
    ranks: Mutex<Vec<Running>>,
    interrupted: AtomicBool,
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

impl Supervisor {
    pub(crate) fn new(grace: Duration, on_failure: OnFailure) -> Self {
        Self {
            grace,
            on_failure,
            ranks: Mutex::new(Vec::new()),
            interrupted: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Running>> {
        self.ranks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts every rank of `specs` (the first is the lead: the run ends with it) and
    /// supervises them; returns the launcher's exit status: the lead's, or the failed
    /// rank's when a failure aborts the run.
    pub(crate) fn run(self: &Arc<Self>, specs: &[RankSpawn]) -> ExitCode {
        // SIGINT/SIGTERM to the launcher: pass SIGTERM on, give the grace period, then SIGKILL
        // (the process then exits with 128 + the signal, see `cleanup`).
        let me = Arc::clone(self);
        let _forward = cleanup::on_exit_signal(move || {
            me.interrupted.store(true, Ordering::SeqCst);
            eprintln!("refit launch: interrupted; stopping every rank");
            me.stop_all(false);
        });
        let (done_tx, done_rx) = mpsc::channel();
        let mut streams = 0;
        for spec in specs {
            match child::spawn(spec, &done_tx) {
                Ok(running) => {
                    eprintln!(
                        "refit launch: started {} (pid {})",
                        running.label(),
                        running.child.id()
                    );
                    streams += 2;
                    self.lock().push(running);
                }
                Err(e) => {
                    eprintln!(
                        "refit launch: error: rank {} ({}): cannot start `{}`: {e}",
                        spec.rank,
                        spec.name,
                        spec.program.display()
                    );
                    self.stop_all(false);
                    return ExitCode::FAILURE;
                }
            }
        }
        drop(done_tx);
        let code = match self.watch() {
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
        // let the output threads copy what is left (a grandchild holding a pipe open must
        // not keep the launcher waiting)
        let deadline = Instant::now() + Duration::from_secs(2);
        for _ in 0..streams {
            let left = deadline.saturating_duration_since(Instant::now());
            if done_rx.recv_timeout(left).is_err() {
                break;
            }
        }
        ExitCode::from(code)
    }

    /// Polls the ranks until the run ends.
    fn watch(&self) -> End {
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
                            eprintln!("refit launch: cannot wait for {}: {e}", r.label());
                        }
                    }
                }
            }
            if self.interrupted.load(Ordering::SeqCst) {
                // the signal thread stops everything and exits the process
                std::thread::sleep(TICK);
                continue;
            }
            for (i, label, status) in ended {
                let code = child::exit_code(status);
                if status.success() {
                    eprintln!("refit launch: {label} {}", child::describe(status));
                    if i == 0 {
                        return End::LeadDone(0);
                    }
                    continue;
                }
                eprintln!(
                    "refit launch: {label} failed: it {}",
                    child::describe(status)
                );
                if i == 0 {
                    if self.lock().len() > 1 {
                        eprintln!("refit launch: rank 0 ended; stopping the other ranks");
                    }
                    return End::Abort(code);
                }
                match on_failure {
                    OnFailure::Abort => {
                        eprintln!(
                            "refit launch: stopping the run (on_failure = \"abort\") after {label} failed"
                        );
                        return End::Abort(code);
                    }
                    OnFailure::Continue => eprintln!(
                        "refit launch: the run goes on without {label} (on_failure = \"continue\")"
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
            for r in ranks.iter().filter(|r| r.status.is_none()) {
                eprintln!("refit launch: stopping {} (SIGTERM)", r.label());
                r.signal_group(libc::SIGTERM);
            }
        }
        if self.wait_grace() {
            return;
        }
        let mut ranks = self.lock();
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            eprintln!(
                "refit launch: {} still runs {:?} after SIGTERM; SIGKILL",
                r.label(),
                self.grace
            );
            r.signal_group(libc::SIGKILL);
            r.status = r.child.wait().ok();
        }
    }
}
