//! The one async wait of the TCP agent's handlers: re-check a condition each time the state
//! may have changed, until it answers or a deadline passes (the async twin of
//! [`refit_runtime::wait::wait_until`]).

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Calls `ready` until it answers `Some` or `deadline` passes (`Ok(None)`). Before each
/// check, `arm` makes the future that resolves on the next change (armed first, so a
/// change between the check and the wait is not missed); the wait between checks lasts
/// until that change, `deadline`, or `tick` when given (for conditions that also change
/// with time alone, such as leases expiring).
///
/// # Errors
/// `ready`'s error, at once.
pub(crate) async fn wait_changes<T, E, W>(
    deadline: Instant,
    tick: Option<Duration>,
    mut arm: impl FnMut() -> W,
    mut ready: impl FnMut() -> Result<Option<T>, E>,
) -> Result<Option<T>, E>
where
    W: Future<Output = ()>,
{
    loop {
        let changed = arm();
        if let Some(answer) = ready()? {
            return Ok(Some(answer));
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        let until = tick.map_or(deadline, |t| (now + t).min(deadline));
        let _ = tokio::time::timeout_at(until, changed).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use crate::tcp::test_runtime as rt;

    #[test]
    fn a_change_wakes_the_wait_and_a_deadline_ends_it() {
        let notify = Arc::new(tokio::sync::Notify::new());
        let value = Arc::new(AtomicU32::new(0));
        let (n, v) = (Arc::clone(&notify), Arc::clone(&value));
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            v.store(7, Ordering::Release);
            n.notify_waiters();
        });
        let far = Instant::now() + Duration::from_secs(30);
        let arm = || {
            let mut n = Box::pin(notify.notified());
            n.as_mut().enable();
            n
        };
        let check = || Ok::<_, ()>(Some(value.load(Ordering::Acquire)).filter(|v| *v == 7));
        assert_eq!(
            rt().block_on(wait_changes(far, None, arm, check)),
            Ok(Some(7))
        );
        setter.join().unwrap();
        // nothing changes: the deadline ends the wait with no answer
        let soon = Instant::now() + Duration::from_millis(20);
        let never = || Ok::<Option<()>, ()>(None);
        assert_eq!(
            rt().block_on(wait_changes(soon, None, arm, never)),
            Ok(None)
        );
        // an error ends it at once
        let fails = || Err::<Option<()>, _>("bad");
        assert_eq!(
            rt().block_on(wait_changes(far, None, arm, fails)),
            Err("bad")
        );
    }

    #[test]
    fn a_tick_re_checks_a_condition_that_changes_with_time_alone() {
        let start = std::time::Instant::now();
        let far = Instant::now() + Duration::from_secs(30);
        // nothing ever notifies: only the tick lets the check see time pass
        let arm = std::future::pending::<()>;
        let check = || Ok::<_, ()>((start.elapsed() >= Duration::from_millis(40)).then_some(()));
        let tick = Some(Duration::from_millis(10));
        assert_eq!(
            rt().block_on(wait_changes(far, tick, arm, check)),
            Ok(Some(()))
        );
    }
}
