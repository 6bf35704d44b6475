//! The board: the segment every party of one scheme maps — its manifest directory, its
//! commit record read under the seqlock, the sender's state word and lease — and the
//! reads and releases of it that both ends share.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

use refit_runtime::wait::{Wait, wait_until};
use refit_runtime::{Error, Manifest, ModelId, Result};
use serde::{Deserialize, Serialize};

use super::layout::*;
use super::segment::Segment;
use super::{LIVENESS_EVERY, NAME, futex, lease};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Directory {
    pub(super) models: Vec<DirModel>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct DirModel {
    pub(super) id: ModelId,
    pub(super) manifest: Manifest,
    pub(super) data: PathBuf,
    /// The handles of the slots' bytes when they live outside the data segment (a
    /// `cuda-ipc` board: one exported device buffer per slot; the data segment then holds
    /// the slots' headers only). Empty for a plain shm board.
    #[serde(default)]
    pub(super) exported: Vec<crate::gpu::ipc::IpcHandle>,
}

pub(super) fn shm_err(message: impl Into<String>) -> Error {
    Error::transport(NAME, message)
}

pub(super) fn state_word(board: &Segment) -> Result<&AtomicU32> {
    board.u32_at(OFF_STATE)
}

/// The least time a reader waits for a commit in progress, whatever its caller's deadline:
/// a commit is a few stores, but the committing thread may be descheduled in the middle,
/// and a zero-timeout poll must not report that as a hang.
pub(super) const COMMIT_GRACE: Duration = Duration::from_millis(100);

/// One consistent read of the commit record: `(version, slot)` per model. A commit that
/// stays in progress (odd sequence) past `deadline` while the sender lives (hung, or
/// stopped mid-commit) is [`Error::Timeout`]; a sender whose lease says it died is
/// [`Error::PeerGone`].
pub(super) fn read_board(
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
pub(super) fn park_on(word: &AtomicU32) -> impl FnMut(u32, Duration) -> u32 + '_ {
    move |seen, left| {
        futex::wait(word, seen, left.min(LIVENESS_EVERY));
        seen
    }
}

pub(super) fn sender_gone(board: &Segment, reason: impl Into<String>) -> Error {
    Error::PeerGone {
        peer: format!("shm sender (pid {})", lease::record_pid(board, OFF_SENDER)),
        reason: reason.into(),
    }
}

/// The sender's lease as its record states it.
pub(super) fn board_lease(board: &Segment) -> Result<Duration> {
    let ms = board
        .u32_at(OFF_SENDER + lease::REC_LEASE_MS)?
        .load(Ordering::Relaxed);
    Ok(Duration::from_millis(u64::from(ms.max(10))))
}

/// Tells receivers the sender left and removes every segment file (mappings stay valid).
pub(super) fn release(board: &Segment, data: &[Arc<Segment>]) -> Result<()> {
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
