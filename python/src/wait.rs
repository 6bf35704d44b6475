//! Blocking calls from Python: run with the GIL released, in slices, so that Ctrl-C (a
//! pending signal) interrupts a long wait between two slices.

use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// The longest slice a wait runs before looking at Python's signals.
const SLICE: Duration = Duration::from_millis(100);

/// Calls `step(slice)` with the GIL released until it returns `Some` or `timeout` passes
/// (then `None`), checking Python's signals between calls (a `KeyboardInterrupt` raised by
/// the handler ends the wait with that exception).
pub(crate) fn sliced<T: Send>(
    py: Python<'_>,
    timeout: Duration,
    mut step: impl FnMut(Duration) -> PyResult<Option<T>> + Send,
) -> PyResult<Option<T>> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let slice = left.min(SLICE);
        if let Some(v) = py.detach(|| step(slice))? {
            return Ok(Some(v));
        }
        py.check_signals()?;
        if left <= SLICE {
            return Ok(None);
        }
    }
}

/// A timeout in seconds from Python: finite and not negative.
pub(crate) fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| {
        crate::errors::config(format!(
            "{what} must be a finite number of seconds ≥ 0, got {s}"
        ))
    })
}

/// The result of a call that Ctrl-C interrupted while it ran on its own thread: the next
/// call of the same kind collects it first, so nothing it received is lost.
pub(crate) type Stash<T> = Mutex<Option<mpsc::Receiver<T>>>;

/// Runs `job` on a thread of its own (it may take as long as its own deadline: a transfer
/// is never cut into slices) while this thread waits with the GIL released, checking
/// Python's signals every [`SLICE`]. Interrupted, the job goes on and its result waits in
/// `stash` for [`collect`].
pub(crate) fn in_background<T: Send + 'static>(
    py: Python<'_>,
    stash: &Stash<T>,
    job: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("refit-python".into())
        .spawn(move || {
            let _ = tx.send(job());
        })
        .map_err(|e| crate::errors::config(format!("cannot start a thread: {e}")))?;
    wait_for(py, stash, rx)
}

/// The result an interrupted [`in_background`] call left, waiting for it (checking signals
/// as that call did); `None` when there is none.
pub(crate) fn collect<T: Send>(py: Python<'_>, stash: &Stash<T>) -> PyResult<Option<T>> {
    let taken = stash
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    match taken {
        Some(rx) => wait_for(py, stash, rx).map(Some),
        None => Ok(None),
    }
}

fn wait_for<T: Send>(py: Python<'_>, stash: &Stash<T>, mut rx: mpsc::Receiver<T>) -> PyResult<T> {
    loop {
        let (got, back) = py.detach(move || (rx.recv_timeout(SLICE), rx));
        rx = back;
        match got {
            Ok(v) => return Ok(v),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(crate::errors::config(
                    "a receive thread ended without an answer",
                ));
            }
        }
        if let Err(e) = py.check_signals() {
            *stash
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(rx);
            return Err(e);
        }
    }
}
