//! A rank's watch on rank 0: every other rank pings rank 0, and stops when it is gone
//! ([`LeadWatch`]); its waits on the store ([`LeadWatch::wait_keys`]) end then too.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use refit_node::Node;
use refit_runtime::topology::Topology;

use crate::error::{Error, Result};

use super::ids::RANK_LOG;
use super::peers::blocking;
use super::rendezvous::{Rendezvous, WatchGuard, watch};

/// How often a wait on the store looks whether the keepalive found rank 0 gone.
const GONE_POLL: Duration = Duration::from_millis(50);

/// What a rank knows of rank 0's life: set once its keepalive found rank 0 gone, and why.
pub(crate) struct LeadWatch {
    gone: Arc<AtomicBool>,
    why: Arc<Mutex<String>>,
    // set once the rank acknowledged rank 0's stop: rank 0 leaving is then the run's end,
    // not a fault, and is logged at debug level
    ended: Arc<AtomicBool>,
    _watch: Option<WatchGuard>,
}

impl LeadWatch {
    /// Rank `me`'s watch on rank 0 (through `rv`'s store connection); rank 0 watches
    /// nothing here.
    pub(crate) fn start(me: u32, rv: &Rendezvous, node: &Node, topo: &Topology) -> Self {
        let gone = Arc::new(AtomicBool::new(false));
        let why = Arc::new(Mutex::new(String::new()));
        let ended = Arc::new(AtomicBool::new(false));
        let guard = (me != 0).then(|| {
            let (gone, why, ended) = (Arc::clone(&gone), Arc::clone(&why), Arc::clone(&ended));
            watch(
                node,
                vec![(0, 0, rv.store().peer().addr())],
                topo.keepalive(),
                topo.dead_after(),
                move |d| {
                    if ended.load(Ordering::SeqCst) {
                        tracing::debug!(target: RANK_LOG, "rank 0 left after the run: {}", d.reason);
                    } else {
                        refit_runtime::unless_stopping!(error, target: RANK_LOG, "rank 0 is gone: {}", d.reason);
                    }
                    *why.lock().unwrap_or_else(PoisonError::into_inner) = d.reason;
                    gone.store(true, Ordering::SeqCst);
                },
            )
        });
        Self {
            gone,
            why,
            ended,
            _watch: guard,
        }
    }

    /// Says the run ended for this rank (it acknowledges rank 0's stop): rank 0 leaving
    /// from now on is logged at debug level, not as an error.
    pub(crate) fn end(&self) {
        self.ended.store(true, Ordering::SeqCst);
    }

    /// Waits (on a blocking thread) until one of `keys` is set in the store, or rank 0 is
    /// gone: answers the key that was set, `None` when rank 0 is gone (within
    /// [`GONE_POLL`] of the keepalive's verdict: a store call to a silent rank 0 in flight
    /// then is left to end on its thread).
    ///
    /// # Cancel safety
    /// Cancel safe: dropped, the store calls in flight end on their thread within their
    /// own deadline.
    pub(crate) async fn wait_keys(
        &self,
        rv: &Rendezvous,
        keys: &'static [&'static str],
    ) -> Result<Option<&'static str>> {
        // short calls: a silent rank 0 must not hold the thread long past the verdict
        let store = rv.store().clone().with_timeout(Duration::from_secs(1));
        let gone = Arc::clone(&self.gone);
        let mut waiting = std::pin::pin!(self.poll_keys(store, keys));
        loop {
            match actix_rt::time::timeout(GONE_POLL, &mut waiting).await {
                Ok(r) => return r,
                Err(_) if gone.load(Ordering::SeqCst) => return Ok(None),
                Err(_) => {}
            }
        }
    }

    /// The store loop of [`LeadWatch::wait_keys`], on a blocking thread.
    async fn poll_keys(
        &self,
        store: refit_node::StoreClient,
        keys: &'static [&'static str],
    ) -> Result<Option<&'static str>> {
        let gone = Arc::clone(&self.gone);
        blocking("waiting for rank 0", move || {
            loop {
                if gone.load(Ordering::SeqCst) || store.peer().is_closed() {
                    return Ok(None);
                }
                for k in keys {
                    if store.get(k).ok().flatten().is_some() {
                        return Ok(Some(*k));
                    }
                }
                match store.wait(keys, Duration::from_millis(500)) {
                    Ok(()) => {}
                    Err(e) if e.is_timeout() => {}
                    Err(_) => return Ok(None),
                }
            }
        })
        .await
    }

    /// The error of rank `who` whose rank 0 went away.
    pub(crate) fn lead_gone(&self, who: &str) -> Error {
        let why = self
            .why
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let why = if why.is_empty() {
            "its connection closed".to_string()
        } else {
            why
        };
        Error::Actor(format!(
            "{who}: rank 0 went away before the end of the run ({why}); this rank stops"
        ))
    }
}
