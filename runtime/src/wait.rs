//! The one "wait until ready or deadline" loop every transport uses.
//!
//! A transport says how to look ([`wait_until`]'s `poll`) and how to sleep until something may
//! have changed (`park`: a condition variable, a futex, a short sleep); this module owns the
//! deadline: it parks at most until the deadline and turns a passed deadline into
//! [`Error::Timeout`] naming what was awaited.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// What one look found: done with a value, or still waiting on something (what is late,
/// formatted into the timeout error only if the deadline passes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wait<T, W> {
    /// The wait is over.
    Done(T),
    /// Not yet; `W` says what is still awaited.
    Pending(W),
}

/// Looks with `poll` until it reports [`Wait::Done`], parking between looks with `park`
/// (given the time left, never more than until `deadline`). `state` is handed to both (a mutex
/// guard a condition variable re-locks, a futex word's last value, or `()`); `poll` runs at
/// least once, even when the deadline has already passed.
///
/// # Errors
/// `poll`'s errors as they come; [`Error::Timeout`] with `what(pending)` as the thing awaited
/// once the deadline passes with `poll` still pending.
pub fn wait_until<S, W, T>(
    deadline: Instant,
    state: S,
    poll: impl FnMut(&mut S) -> Result<Wait<T, W>>,
    park: impl FnMut(S, Duration) -> S,
    what: impl FnOnce(W) -> String,
) -> Result<T> {
    let start = Instant::now();
    run(deadline, state, poll, park)?.map_err(|pending| Error::Timeout {
        what: what(pending),
        after: start.elapsed(),
    })
}

/// As [`wait_until`] for waits where a passed deadline is no error ("the newest update, if
/// one comes in time"): `None` once the deadline passes with `poll` still pending.
///
/// # Errors
/// `poll`'s errors as they come.
pub fn poll_until<S, W, T>(
    deadline: Instant,
    state: S,
    poll: impl FnMut(&mut S) -> Result<Wait<T, W>>,
    park: impl FnMut(S, Duration) -> S,
) -> Result<Option<T>> {
    Ok(run(deadline, state, poll, park)?.ok())
}

/// The loop itself: `Ok(Err(pending))` when the deadline passed.
fn run<S, W, T>(
    deadline: Instant,
    mut state: S,
    mut poll: impl FnMut(&mut S) -> Result<Wait<T, W>>,
    mut park: impl FnMut(S, Duration) -> S,
) -> Result<std::result::Result<T, W>> {
    loop {
        let pending = match poll(&mut state)? {
            Wait::Done(t) => return Ok(Ok(t)),
            Wait::Pending(w) => w,
        };
        let now = Instant::now();
        if now >= deadline {
            return Ok(Err(pending));
        }
        state = park(state, deadline - now);
    }
}

/// Parks by sleeping with a backoff: 1 ms, doubling up to `max` (and never past the time
/// left). For [`wait_until`] where nothing can wake the waiter (files, remote state).
pub fn backoff(max: Duration) -> impl FnMut((), Duration) {
    let mut pause = Duration::from_millis(1).min(max);
    move |(), left| {
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn done_at_once_does_not_park() {
        let got = wait_until(
            Instant::now(),
            (),
            |()| Ok(Wait::<_, ()>::Done(7)),
            |(), _| panic!("parked"),
            |()| unreachable!(),
        )
        .unwrap();
        assert_eq!(got, 7);
    }

    #[test]
    fn parks_until_ready_within_the_time_left() {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut parks = Vec::new();
        let got = wait_until(
            deadline,
            0u32,
            |n| {
                Ok(if *n == 3 {
                    Wait::Done(*n)
                } else {
                    Wait::Pending(*n)
                })
            },
            |n, left| {
                parks.push(left);
                n + 1
            },
            |n| format!("{n}"),
        )
        .unwrap();
        assert_eq!(got, 3);
        assert_eq!(parks.len(), 3);
        assert!(parks.iter().all(|l| *l <= Duration::from_secs(30)));
    }

    #[test]
    fn a_passed_deadline_names_what_is_late() {
        let deadline = Instant::now() + Duration::from_millis(20);
        let err = wait_until(
            deadline,
            (),
            |()| Ok(Wait::<(), _>::Pending(vec![1u32, 4])),
            backoff(Duration::from_millis(5)),
            |late| format!("receivers {late:?} to acknowledge"),
        )
        .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert!(err.to_string().contains("receivers [1, 4]"), "{err}");
        assert!(Instant::now() >= deadline);
    }

    #[test]
    fn poll_until_answers_none_at_the_deadline() {
        let deadline = Instant::now() + Duration::from_millis(10);
        let got = poll_until(
            deadline,
            (),
            |()| Ok(Wait::<u8, ()>::Pending(())),
            backoff(Duration::from_millis(2)),
        )
        .unwrap();
        assert_eq!(got, None);
        assert!(Instant::now() >= deadline);
        let got = poll_until(deadline, (), |()| Ok(Wait::<_, ()>::Done(3u8)), |(), _| ()).unwrap();
        assert_eq!(got, Some(3));
    }

    #[test]
    fn poll_errors_pass_through() {
        let err = wait_until(
            Instant::now() + Duration::from_secs(30),
            (),
            |()| Err::<Wait<(), ()>, _>(Error::State("peer gone")),
            |(), _| (),
            |()| String::new(),
        )
        .unwrap_err();
        assert!(matches!(err, Error::State("peer gone")));
    }
}
