//! A thread of the process's life that runs Python calls for a rank (the engine's and the
//! learner's): see [`Lane`].

use std::sync::{Mutex, PoisonError, mpsc};

use pyo3::PyResult;

use crate::errors::RefitError;

type Job = Box<dyn FnOnce() + Send>;

/// A thread that runs the Python calls sent to it, for the life of the process: it never
/// ends, because a thread that called into an extension such as torch aborts the process
/// in that extension's thread-local teardown when it exits (the runtime's blocking threads
/// end with the rank).
///
/// Nor may a call be running when the interpreter finalizes (a thread taking the GIL then is
/// ended by Python under its Rust frames): [`Lane::close`] lets the calls in flight finish
/// and refuses later ones before `join` returns.
pub(crate) struct Lane {
    /// Where jobs go; `None` once closed (taken under the lock, so no job is sent after
    /// the close's own).
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
}

impl Lane {
    pub(crate) fn start(name: &str) -> PyResult<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                for job in rx {
                    // a job that panics must not end the thread (see the type's doc); its
                    // caller hears the lane is gone
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
                // kept, not ended: see the type's documentation
                loop {
                    std::thread::park();
                }
            })
            .map_err(|e| RefitError::new_err(format!("starting the thread `{name}`: {e}")))?;
        Ok(Self {
            jobs: Mutex::new(Some(tx)),
        })
    }

    /// Queues `job` on the lane without waiting for it: false when the lane is gone or
    /// closed.
    pub(crate) fn post(&self, job: Job) -> bool {
        let jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }

    /// Runs `f` on the lane and answers what it returned (`None`: the lane is gone or
    /// closed, or `f` panicked).
    pub(crate) fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
        });
        if !self.post(job) {
            return None;
        }
        rx.recv().ok()
    }

    /// Refuses calls from now on and waits until the ones sent before have run. Call it
    /// without the GIL: they need it.
    pub(crate) fn close(&self) {
        let (tx, rx) = mpsc::sync_channel(1);
        let last: Job = Box::new(move || {
            let _ = tx.send(());
        });
        let sent = {
            let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
            jobs.take().is_some_and(|j| j.send(last).is_ok())
        };
        if sent {
            let _ = rx.recv();
        }
    }
}
