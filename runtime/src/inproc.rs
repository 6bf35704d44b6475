//! The in-process transport: readers share an immutable weight set; publishing is a pointer
//! swap whatever the size.
//!
//! A [`InProc`] hub is created once; `hub.sender()` gives the sending end, each
//! `hub.receiver()` one receiving end (registered at once, so the sender waits for its
//! acknowledgements). The board holds the newest version of every model; it is replaced as a
//! whole, so a receiver that skips versions still sees models published together together.
//!
//! No bytes move, so there are no buckets: a
//! [`BucketPlan`](crate::BucketPlan) cuts bytes that travel, and here a receiver gets
//! the sender's own `Arc` (one control step per *version*, not per bucket).
//!
//! It lives in the core (no IO: a mutex, a condition variable and `Arc`s) so the scheme
//! lifecycle is driven through a real sender/receiver pair in the core's own unit tests;
//! `refit_transports::inproc` re-exports it beside the other transports.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;

use crate::error::{Error, Result};
use crate::ids::{ModelId, Version};
use crate::protocol::{Ack, AckBook, Group, Manifests};
use crate::scheme::{ReceiverTransport, SenderTransport};
use crate::wait::{Wait, poll_until, wait_until};
use crate::weights::WeightSet;

const NAME: &str = "inproc";

#[derive(Debug)]
struct Board {
    seq: u64,
    models: BTreeMap<ModelId, Arc<WeightSet>>,
}

#[derive(Debug, Default)]
struct State {
    seq: u64,
    next_receiver: u32,
    acks: AckBook,
    manifests: Option<Manifests>,
    sender_gone: bool,
}

#[derive(Debug, Default)]
struct Hub {
    board: ArcSwapOption<Board>,
    state: Mutex<State>,
    changed: Condvar,
    sender_taken: AtomicBool,
}

impl Hub {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means another thread panicked while holding it; the state is
        // plain counters and stays consistent, so go on.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on the condition variable for at most `left` (the park of [`wait_until`]).
    fn park<'a>(&self, guard: MutexGuard<'a, State>, left: Duration) -> MutexGuard<'a, State> {
        self.changed
            .wait_timeout(guard, left)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }
}

/// A hub that hands out one sender and any number of receivers.
#[derive(Debug, Clone, Default)]
pub struct InProc {
    hub: Arc<Hub>,
}

impl InProc {
    /// A new hub.
    pub fn new() -> Self {
        Self::default()
    }

    /// The sending end.
    ///
    /// # Errors
    /// [`Error::State`] if this hub already gave out its sender.
    pub fn sender(&self) -> Result<InProcSender> {
        if self.hub.sender_taken.swap(true, Ordering::AcqRel) {
            return Err(Error::State("this in-process hub already has a sender"));
        }
        Ok(InProcSender {
            hub: Arc::clone(&self.hub),
            closed: false,
        })
    }

    /// A receiving end, registered now: the sender waits for its acknowledgements.
    pub fn receiver(&self) -> InProcReceiver {
        let mut st = self.hub.lock();
        let id = st.next_receiver;
        st.next_receiver += 1;
        st.acks.register(id);
        drop(st);
        InProcReceiver {
            hub: Arc::clone(&self.hub),
            id,
            seen: BTreeMap::new(),
            closed: false,
        }
    }
}

/// The sending end of an [`InProc`] hub.
#[derive(Debug)]
pub struct InProcSender {
    hub: Arc<Hub>,
    closed: bool,
}

impl SenderTransport for InProcSender {
    fn name(&self) -> &'static str {
        NAME
    }

    fn connect(&mut self, initial: &Group, _deadline: Instant) -> Result<()> {
        let manifests = Manifests::new(
            initial
                .iter()
                .map(|w| (w.model().clone(), Arc::clone(w.manifest()))),
        )?;
        self.hub.lock().manifests = Some(manifests);
        self.publish(initial, _deadline)
    }

    fn publish(&mut self, group: &Group, _deadline: Instant) -> Result<()> {
        if self.closed {
            return Err(Error::State("in-process sender is shut down"));
        }
        let mut st = self.hub.lock();
        st.seq += 1;
        let mut models = self
            .hub
            .board
            .load()
            .as_ref()
            .map(|b| b.models.clone())
            .unwrap_or_default();
        for w in group {
            models.insert(w.model().clone(), Arc::clone(w));
        }
        self.hub.board.store(Some(Arc::new(Board {
            seq: st.seq,
            models,
        })));
        drop(st);
        self.hub.changed.notify_all();
        Ok(())
    }

    fn wait_acks(&mut self, entries: &[(ModelId, Version)], deadline: Instant) -> Result<()> {
        let hub = &self.hub;
        wait_until(
            deadline,
            hub.lock(),
            |st| Ok(st.acks.awaiting(entries)),
            |st, left| hub.park(st, left),
            |missing| format!("in-process receivers {missing:?} to acknowledge {entries:?}"),
        )
    }

    fn shutdown(&mut self) -> Result<()> {
        if !self.closed {
            self.closed = true;
            self.hub.lock().sender_gone = true;
            self.hub.changed.notify_all();
        }
        Ok(())
    }
}

impl Drop for InProcSender {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// A receiving end of an [`InProc`] hub.
#[derive(Debug)]
pub struct InProcReceiver {
    hub: Arc<Hub>,
    id: u32,
    seen: BTreeMap<ModelId, Version>,
    closed: bool,
}

impl InProcReceiver {
    /// This receiver's number on the hub.
    pub fn id(&self) -> u32 {
        self.id
    }

    fn fresh(&self) -> Option<Group> {
        let board = self.hub.board.load_full()?;
        let group: Group = board
            .models
            .values()
            .filter(|w| self.seen.get(w.model()).is_none_or(|v| w.version() > *v))
            .cloned()
            .collect();
        let _ = board.seq;
        (!group.is_empty()).then_some(group)
    }
}

impl ReceiverTransport for InProcReceiver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn connect(&mut self, deadline: Instant) -> Result<Manifests> {
        let hub = &self.hub;
        wait_until(
            deadline,
            hub.lock(),
            |st| {
                if let Some(m) = &st.manifests {
                    return Ok(Wait::Done(m.clone()));
                }
                if st.sender_gone {
                    return Err(Error::PeerGone {
                        peer: "in-process sender".into(),
                        reason: "shut down before connecting".into(),
                    });
                }
                Ok(Wait::Pending(()))
            },
            |st, left| hub.park(st, left),
            |()| "the in-process sender to connect".into(),
        )
    }

    fn next_group(&mut self, deadline: Instant) -> Result<Option<Group>> {
        let hub = Arc::clone(&self.hub);
        let me = &*self;
        let found = poll_until(
            deadline,
            None,
            |held| {
                // the guard the last park woke up with, if any (never locked twice)
                let prior = held.take();
                if let Some(group) = me.fresh() {
                    return Ok(Wait::Done(group));
                }
                let st = prior.unwrap_or_else(|| hub.lock());
                if st.sender_gone {
                    return Err(Error::PeerGone {
                        peer: "in-process sender".into(),
                        reason: "shut down".into(),
                    });
                }
                // re-check under the lock: publish bumps `seq` under it before notifying
                if let Some(group) = me.fresh() {
                    return Ok(Wait::Done(group));
                }
                *held = Some(st);
                Ok(Wait::Pending(()))
            },
            |held, left| held.map(|st| hub.park(st, left)),
        )?;
        // nothing new before the deadline is not an error here
        let Some(group) = found else {
            return Ok(None);
        };
        for w in &group {
            self.seen.insert(w.model().clone(), w.version());
        }
        Ok(Some(group))
    }

    fn ack(&mut self, applied: &[(ModelId, Version)]) -> Result<()> {
        self.hub.lock().acks.record(&Ack {
            receiver: self.id,
            applied: applied.to_vec(),
        });
        self.hub.changed.notify_all();
        Ok(())
    }

    fn shutdown(&mut self) -> Result<()> {
        if !self.closed {
            self.closed = true;
            self.hub.lock().acks.remove(self.id);
            self.hub.changed.notify_all();
        }
        Ok(())
    }
}

impl Drop for InProcReceiver {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
