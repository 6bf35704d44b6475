//! A thread that drops what the decoding loop lets go of (a swapped-out version of the
//! weights may be gigabytes: freeing it must not land in the pause).

use std::sync::mpsc;

use crate::error::{Error, Result};

type Corpse = Box<dyn Send>;

/// Hands values to its own thread to be dropped there.
#[derive(Debug)]
pub(crate) struct Reaper {
    tx: mpsc::Sender<Corpse>,
}

impl Reaper {
    /// Starts the thread (named `name`); it ends when the reaper is dropped, after dropping
    /// what it was handed.
    pub(crate) fn start(name: String) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Corpse>();
        std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                for corpse in rx {
                    drop(corpse);
                }
            })
            .map_err(|e| Error::Config(format!("cannot start thread `{name}`: {e}")))?;
        Ok(Self { tx })
    }

    /// Drops `value` on the reaper's thread (or here, if that thread is gone). O(1): one
    /// small allocation and a channel send.
    pub(crate) fn reap<T: Send + 'static>(&self, value: T) {
        if let Err(mpsc::SendError(back)) = self.tx.send(Box::new(value)) {
            drop(back);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::thread::ThreadId;
    use std::time::Duration;

    struct Tell(mpsc::Sender<ThreadId>);
    impl Drop for Tell {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().id());
        }
    }

    #[test]
    fn values_are_dropped_on_the_reaper_thread() {
        let reaper = Reaper::start("test-reaper".into()).unwrap();
        let (tx, rx) = channel();
        reaper.reap(Tell(tx));
        let on = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_ne!(on, std::thread::current().id());
    }
}
