//! The sender agent's decisions, as plain code: which source serves a pull (the sender or a
//! receiver that relays), the leases that hold a source while a pull runs, their expiry, and
//! what a finished or failed pull changes. No socket, lock or clock: every method that
//! depends on time takes `now` (sans-IO, like [`refit_runtime::protocol`]); the agent
//! (`sender.rs`) calls it under its lock and does the IO.
//!
//! Rules:
//! - a receiver that relays may serve a version it holds, or one it is pulling right now
//!   with every bucket the new pull wants, relaying its bytes as they arrive: receivers form a
//!   chain that moves a version in about the time of one hop;
//! - each source serves at most `fanout` pulls at once; a free relay goes before the sender
//!   (each byte leaves the sender about once); with every source busy the pull waits;
//! - a lease expires `lease_time` after it was granted (a stalled pull frees its source);
//! - a receiver that leaves takes its leases with it, as puller and as source; a relay whose
//!   pull failed is no longer offered that version.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit_runtime::{ModelId, Version};

/// Versions of a model a receiver is remembered to hold (the newest ones).
const HOLDS_KEPT: usize = 2;

/// Where a pull gets its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Src {
    /// The sender agent itself.
    Sender,
    /// A registered receiver that relays.
    Receiver(u32),
}

/// A granted pull, holding its source until it is done or expires.
#[derive(Debug, Clone)]
pub(crate) struct Lease {
    pub(crate) source: Src,
    pub(crate) puller: u32,
    pub(crate) model: ModelId,
    pub(crate) version: Version,
    /// The buckets the puller pulls (ascending): while it pulls them, it can relay them.
    pub(crate) buckets: Arc<Vec<u32>>,
    /// The puller relays the buckets as their bytes arrive (false: only once it holds the
    /// version).
    pub(crate) relay_in_flight: bool,
    pub(crate) expires: Instant,
    /// When the pull was granted (the sender side of the `wire` phase).
    pub(crate) granted: Instant,
}

/// A pull asked for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Want<'a> {
    pub(crate) receiver: u32,
    pub(crate) model: &'a ModelId,
    pub(crate) version: Version,
    /// Ascending.
    pub(crate) buckets: &'a [u32],
    pub(crate) relay_in_flight: bool,
}

#[derive(Debug, Default)]
struct Peer {
    relay: bool,
    busy: usize,
    holds: BTreeMap<ModelId, VecDeque<Version>>,
}

/// The leases and relays of one sender agent.
#[derive(Debug)]
pub(crate) struct RelayBook {
    relay: bool,
    fanout: usize,
    lease_time: Duration,
    peers: BTreeMap<u32, Peer>,
    leases: BTreeMap<u64, Lease>,
    next_lease: u64,
    sender_busy: usize,
}

impl RelayBook {
    /// `relay`: receivers may serve each other; `fanout`: pulls one source serves at once
    /// (at least 1); `lease_time`: how long a pull may hold its source.
    pub(crate) fn new(relay: bool, fanout: usize, lease_time: Duration) -> Self {
        Self {
            relay,
            fanout: fanout.max(1),
            lease_time,
            peers: BTreeMap::new(),
            leases: BTreeMap::new(),
            next_lease: 0,
            sender_busy: 0,
        }
    }

    /// A receiver registered; `relay` when it serves others.
    pub(crate) fn join(&mut self, id: u32, relay: bool) {
        self.peers.insert(
            id,
            Peer {
                relay,
                ..Peer::default()
            },
        );
    }

    /// A receiver left: its leases go, as puller and as source. Returns how many.
    pub(crate) fn leave(&mut self, id: u32) -> usize {
        self.peers.remove(&id);
        let gone: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.puller == id || l.source == Src::Receiver(id))
            .map(|(k, _)| *k)
            .collect();
        for k in &gone {
            self.release(*k);
        }
        gone.len()
    }

    /// Frees the leases that expired at `now` (stalled pulls). True when one did.
    pub(crate) fn reap(&mut self, now: Instant) -> bool {
        let expired: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(k, _)| *k)
            .collect();
        for k in &expired {
            self.release(*k);
        }
        !expired.is_empty()
    }

    /// Ends a lease, freeing its source; the lease, if it was still held.
    pub(crate) fn release(&mut self, lease: u64) -> Option<Lease> {
        let l = self.leases.remove(&lease)?;
        match l.source {
            Src::Sender => self.sender_busy = self.sender_busy.saturating_sub(1),
            Src::Receiver(r) => {
                if let Some(p) = self.peers.get_mut(&r) {
                    p.busy = p.busy.saturating_sub(1);
                }
            }
        }
        Some(l)
    }

    /// The pull of `lease` finished: on success its puller holds the version from now on
    /// (it may relay it); on failure a relay that served it is no longer offered the
    /// version. The lease, if it was still held (an expired one changes nothing).
    pub(crate) fn done(&mut self, lease: u64, ok: bool) -> Option<Lease> {
        let l = self.release(lease)?;
        if ok {
            if let Some(p) = self.peers.get_mut(&l.puller) {
                let h = p.holds.entry(l.model.clone()).or_default();
                h.push_back(l.version);
                while h.len() > HOLDS_KEPT {
                    h.pop_front();
                }
            }
        } else if let Src::Receiver(src) = l.source
            && let Some(h) = self
                .peers
                .get_mut(&src)
                .and_then(|p| p.holds.get_mut(&l.model))
        {
            h.retain(|v| *v != l.version);
        }
        Some(l)
    }

    /// Chooses a source for `want` at `now` (expired leases are reaped first) and grants a
    /// lease on it: `None` while every eligible source is busy (ask again when a lease
    /// ends), or for a receiver that is not registered.
    pub(crate) fn grant(&mut self, want: Want<'_>, now: Instant) -> Option<(u64, Src)> {
        self.reap(now);
        if !self.peers.contains_key(&want.receiver) {
            return None;
        }
        let source = if self.relay && !want.buckets.is_empty() {
            self.pick_relay(&want)
                .map(Src::Receiver)
                .or_else(|| (self.sender_busy < self.fanout).then_some(Src::Sender))?
        } else {
            Src::Sender
        };
        match source {
            Src::Sender => self.sender_busy += 1,
            Src::Receiver(r) => self.peers.get_mut(&r)?.busy += 1,
        }
        self.next_lease += 1;
        let lease = self.next_lease;
        self.leases.insert(
            lease,
            Lease {
                source,
                puller: want.receiver,
                model: want.model.clone(),
                version: want.version,
                buckets: Arc::new(want.buckets.to_vec()),
                relay_in_flight: want.relay_in_flight,
                expires: now + self.lease_time,
                granted: now,
            },
        );
        Some((lease, source))
    }

    /// The least busy relay that can serve `want` and has room: one that holds the version,
    /// or pulls every wanted bucket now and relays them as they land.
    fn pick_relay(&self, want: &Want<'_>) -> Option<u32> {
        let pulling: Vec<u32> = self
            .leases
            .values()
            .filter(|l| {
                l.relay_in_flight
                    && l.model == *want.model
                    && l.version == want.version
                    && l.source != Src::Receiver(want.receiver)
                    && is_subset(want.buckets, &l.buckets)
            })
            .map(|l| l.puller)
            .collect();
        self.peers
            .iter()
            .filter(|(id, p)| {
                **id != want.receiver
                    && p.relay
                    && (pulling.contains(id)
                        || p.holds
                            .get(want.model)
                            .is_some_and(|h| h.contains(&want.version)))
            })
            .map(|(id, p)| (*id, p.busy))
            .min_by_key(|(_, busy)| *busy)
            .filter(|(_, busy)| *busy < self.fanout)
            .map(|(id, _)| id)
    }

    /// Leases held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.leases.len()
    }
}

/// True when every element of `small` is in `big` (both strictly ascending).
fn is_subset(small: &[u32], big: &[u32]) -> bool {
    let mut it = big.iter();
    small.iter().all(|x| it.any(|y| y == x))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: &[u32] = &[0, 1, 2, 3];

    fn model() -> ModelId {
        ModelId::new("policy").unwrap()
    }

    fn want<'a>(receiver: u32, model: &'a ModelId, buckets: &'a [u32]) -> Want<'a> {
        Want {
            receiver,
            model,
            version: Version(2),
            buckets,
            relay_in_flight: true,
        }
    }

    fn book(receivers: u32) -> RelayBook {
        let mut b = RelayBook::new(true, 1, Duration::from_secs(10));
        for r in 0..receivers {
            b.join(r, true);
        }
        b
    }

    #[test]
    fn a_chain_forms_while_the_first_pull_runs() {
        let (m, t0) = (model(), Instant::now());
        let mut b = book(4);
        // the first receiver pulls from the sender; each next one from the one before,
        // which relays buckets as they land
        assert!(matches!(
            b.grant(want(0, &m, ALL), t0),
            Some((_, Src::Sender))
        ));
        assert_eq!(b.grant(want(1, &m, ALL), t0).unwrap().1, Src::Receiver(0));
        assert_eq!(b.grant(want(2, &m, ALL), t0).unwrap().1, Src::Receiver(1));
        assert_eq!(b.grant(want(3, &m, ALL), t0).unwrap().1, Src::Receiver(2));
        assert_eq!(b.held(), 4);
    }

    #[test]
    fn a_busy_sender_makes_a_pull_wait_and_a_free_one_serves_it() {
        let (m, t0) = (model(), Instant::now());
        let mut b = book(2);
        // a delta pull of bucket 1 only: nobody pulls it in flight with the whole set
        let (first, _) = b.grant(want(0, &m, &[1]), t0).unwrap();
        let mut other = want(1, &m, ALL);
        other.relay_in_flight = false;
        // receiver 0 pulls only bucket 1, so it cannot relay all four: wait for the sender
        assert!(b.grant(other, t0).is_none());
        b.done(first, true);
        assert!(matches!(b.grant(other, t0), Some((_, Src::Receiver(0)))));
    }

    #[test]
    fn leases_expire_and_free_their_source() {
        let (m, t0) = (model(), Instant::now());
        // relaying on, but neither receiver relays: the sender serves one pull at a time
        let mut b = RelayBook::new(true, 1, Duration::from_secs(10));
        b.join(0, false);
        b.join(1, false);
        let (stalled, _) = b.grant(want(0, &m, ALL), t0).unwrap();
        // 9 s later the sender still serves the stalled pull: the next one waits
        assert!(
            b.grant(want(1, &m, ALL), t0 + Duration::from_secs(9))
                .is_none()
        );
        assert!(!b.reap(t0 + Duration::from_secs(9)));
        // the stalled pull's lease ends at t0 + 10 s: the next pull gets the sender
        assert!(matches!(
            b.grant(want(1, &m, ALL), t0 + Duration::from_secs(10)),
            Some((_, Src::Sender))
        ));
        // its late completion changes nothing
        assert!(b.done(stalled, true).is_none());
    }

    #[test]
    fn a_dead_relay_is_replaced() {
        let (m, t0) = (model(), Instant::now());
        let mut b = book(3);
        let (l0, _) = b.grant(want(0, &m, ALL), t0).unwrap();
        b.done(l0, true);
        // receiver 0 holds v2: it serves receiver 1
        assert_eq!(b.grant(want(1, &m, ALL), t0).unwrap().1, Src::Receiver(0));
        // receiver 0 dies: its lease as a source goes with it, and receiver 1's retry is
        // served by the sender
        assert_eq!(b.leave(0), 1);
        assert_eq!(b.grant(want(1, &m, ALL), t0).unwrap().1, Src::Sender);
        // receiver 2 is chained behind receiver 1's pull, not behind the dead one
        assert_eq!(b.grant(want(2, &m, ALL), t0).unwrap().1, Src::Receiver(1));
    }

    #[test]
    fn a_relay_that_failed_is_not_offered_the_version_again() {
        let (m, t0) = (model(), Instant::now());
        let mut b = book(3);
        let (l0, _) = b.grant(want(0, &m, ALL), t0).unwrap();
        b.done(l0, true);
        let mut w1 = want(1, &m, ALL);
        w1.relay_in_flight = false;
        let (l1, src) = b.grant(w1, t0).unwrap();
        assert_eq!(src, Src::Receiver(0));
        b.done(l1, false);
        let mut w2 = want(2, &m, ALL);
        w2.relay_in_flight = false;
        assert_eq!(b.grant(w2, t0).unwrap().1, Src::Sender);
    }

    #[test]
    fn holds_keep_the_two_newest_versions() {
        let (m, t0) = (model(), Instant::now());
        let mut b = book(2);
        for v in 1..=3 {
            let mut w = want(0, &m, ALL);
            w.version = Version(v);
            let (l, _) = b.grant(w, t0).unwrap();
            b.done(l, true);
        }
        let holds = &b.peers[&0].holds[&m];
        assert_eq!(
            holds.iter().copied().collect::<Vec<_>>(),
            [Version(2), Version(3)]
        );
    }

    #[test]
    fn an_unregistered_receiver_gets_no_lease() {
        let m = model();
        let mut b = book(1);
        assert!(b.grant(want(7, &m, ALL), Instant::now()).is_none());
        assert_eq!(b.held(), 0);
    }
}
