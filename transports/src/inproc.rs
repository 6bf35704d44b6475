//! The in-process transport: readers share an immutable weight set; publishing is a pointer
//! swap whatever the size.
//!
//! It is implemented in the core ([`refit_runtime::inproc`], where it drives the scheme's
//! unit tests) and re-exported here beside the other transports; see there for the details.

pub use refit_runtime::inproc::{InProc, InProcReceiver, InProcSender};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use refit_runtime::{
    Error, Group, Manifests, ModelId, ReceiverTransport, Result, SenderTransport, Version,
};
use serde::{Deserialize, Serialize};

use crate::link::{
    LinkFactory, LinkMemory, LinkOptions, LinkTraits, OpenedLink, Reach, ReceiverSpec,
};

/// The in-process transport in the link factory: its spec names a hub of this process,
/// kept in a process-wide table while its sender end lives; another process (or a spec
/// whose sender is gone) is refused.
#[derive(Debug, Clone, Copy)]
pub struct InProcLink;

/// The in-process receiver spec: the process and the hub.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct HubRef {
    pid: u32,
    hub: u64,
}

fn hubs() -> MutexGuard<'static, BTreeMap<u64, InProc>> {
    static HUBS: Mutex<BTreeMap<u64, InProc>> = Mutex::new(BTreeMap::new());
    HUBS.lock().unwrap_or_else(|p| p.into_inner())
}

/// An [`InProcSender`] whose hub leaves the process-wide table when it is dropped.
#[derive(Debug)]
struct TableSender {
    inner: InProcSender,
    hub: u64,
}

impl Drop for TableSender {
    fn drop(&mut self) {
        hubs().remove(&self.hub);
    }
}

impl SenderTransport for TableSender {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn connect(&mut self, initial: &Group, deadline: Instant) -> Result<()> {
        self.inner.connect(initial, deadline)
    }
    fn publish(&mut self, group: &Group, deadline: Instant) -> Result<()> {
        self.inner.publish(group, deadline)
    }
    fn wait_acks(&mut self, entries: &[(ModelId, Version)], deadline: Instant) -> Result<()> {
        self.inner.wait_acks(entries, deadline)
    }
    fn shutdown(&mut self) -> Result<()> {
        hubs().remove(&self.hub);
        self.inner.shutdown()
    }
}

impl LinkFactory for InProcLink {
    fn traits(&self) -> &'static LinkTraits {
        &LinkTraits {
            name: "inproc",
            about: "threads and actors of one process: publishing is a pointer swap",
            reach: Reach::Process,
            receivers_copy: false,
            memory: LinkMemory::Host,
        }
    }
    fn sender_end(&self, _: &Manifests, _: &LinkOptions) -> Result<OpenedLink> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let hub = InProc::new();
        let key = NEXT.fetch_add(1, Ordering::Relaxed);
        let inner = hub.sender()?;
        hubs().insert(key, hub);
        let r = HubRef {
            pid: std::process::id(),
            hub: key,
        };
        Ok(OpenedLink {
            sender: Box::new(TableSender { inner, hub: key }),
            spec: ReceiverSpec::new(self, &r, format!("hub {key} of process {}", r.pid))?,
            leftovers: Vec::new(),
        })
    }
    fn receiver_end(
        &self,
        spec: &ReceiverSpec,
        _: &LinkOptions,
    ) -> Result<Box<dyn ReceiverTransport>> {
        let r: HubRef = spec.params()?;
        if r.pid != std::process::id() {
            return Err(Error::Config(format!(
                "an in-process link of process {} cannot reach process {} (use shm or tcp \
                 across processes)",
                r.pid,
                std::process::id()
            )));
        }
        let hub = hubs().get(&r.hub).cloned().ok_or_else(|| {
            Error::Config(format!(
                "the in-process hub {} has no sender any more",
                r.hub
            ))
        })?;
        Ok(Box::new(hub.receiver()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_from_another_process_is_refused() {
        let other = HubRef {
            pid: std::process::id().wrapping_add(1),
            hub: 1,
        };
        let spec = ReceiverSpec::new(&InProcLink, &other, "elsewhere").unwrap();
        let e = InProcLink
            .receiver(&spec, &LinkOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot reach process"), "{e}");
    }
}
