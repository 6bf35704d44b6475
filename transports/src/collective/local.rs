//! An in-memory [`Rendezvous`]: a map behind a mutex, for ranks that are threads of one
//! process (tests, single-host setups). Processes use the node runtime's store.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use refit_runtime::{Error, Result};

use super::Rendezvous;

/// A rendezvous store for threads of one process.
#[derive(Debug, Default)]
pub struct LocalRendezvous {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl LocalRendezvous {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Rendezvous for LocalRendezvous {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        // a plain map: a panicking holder leaves it consistent
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.insert(key.to_owned(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn wait_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = refit_runtime::scheme::deadline_in(timeout);
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(v) = map.get(key) {
                return Ok(v.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: format!("store key {key:?}"),
                    after: timeout,
                });
            }
            map = self
                .changed
                .wait_timeout(map, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_for_a_key_and_times_out_without_it() {
        let store = std::sync::Arc::new(LocalRendezvous::new());
        let s = std::sync::Arc::clone(&store);
        let h = std::thread::spawn(move || s.wait_get("k", Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        store.set("k", b"v").unwrap();
        assert_eq!(h.join().unwrap().unwrap(), b"v");
        let e = store
            .wait_get("missing", Duration::from_millis(20))
            .unwrap_err();
        assert!(e.is_timeout(), "{e}");
    }
}
