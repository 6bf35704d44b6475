//! Slots in host memory of one process, exported by handle through a process-wide registry:
//! the `cuda-ipc` link's protocol without a GPU, for tests (feature `test-util`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

use refit_runtime::{Error, Result};

use super::slots::{ExportSlots, ImportSlots};
use crate::gpu::ipc::IpcHandle;

type Buffer = Arc<Mutex<Vec<u8>>>;
/// Exported buffers by handle bytes (weak: dropping the exporter frees them).
type Registry = Mutex<HashMap<Vec<u8>, Weak<Mutex<Vec<u8>>>>>;

/// Exported buffers of this process, by handle bytes.
fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Mutex::default)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn err(message: String) -> Error {
    Error::transport(super::NAME, message)
}

/// Host memory standing in for device memory: as a sender's [`ExportSlots`] it allocates
/// and registers a buffer per slot (unregistered when dropped); as a receiver's
/// [`ImportSlots`] it opens them by handle, from any thread of the same process.
#[derive(Debug, Default)]
pub struct HostSlots {
    exported: Vec<Vec<(Vec<u8>, Buffer)>>,
    opened: Vec<Vec<Buffer>>,
    opens: Arc<AtomicU64>,
}

impl HostSlots {
    /// No buffer yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// As [`HostSlots::new`], adding one to `opens` each time handles are opened (a test's
    /// count of opens per generation).
    pub fn counting(opens: Arc<AtomicU64>) -> Self {
        Self {
            exported: Vec::new(),
            opened: Vec::new(),
            opens,
        }
    }

    fn slot(list: &[Vec<Buffer>], model: usize, slot: usize) -> Result<&Buffer> {
        list.get(model)
            .and_then(|m| m.get(slot))
            .ok_or_else(|| err(format!("no slot {slot} of model #{model} is open")))
    }
}

impl ExportSlots for HostSlots {
    fn name(&self) -> &'static str {
        super::NAME
    }

    fn export(&mut self, len: usize, slots: usize) -> Result<Vec<IpcHandle>> {
        let mut handles = Vec::with_capacity(slots);
        let mut buffers = Vec::with_capacity(slots);
        for _ in 0..slots {
            let handle: Vec<u8> = (0..4)
                .flat_map(|_| *uuid::Uuid::new_v4().as_bytes())
                .collect();
            let buf: Buffer = Arc::new(Mutex::new(vec![0u8; len.max(1)]));
            lock(registry()).insert(handle.clone(), Arc::downgrade(&buf));
            handles.push(IpcHandle {
                handle: handle.clone(),
                len: len.max(1),
                generation: 1,
            });
            buffers.push((handle, buf));
        }
        self.exported.push(buffers);
        Ok(handles)
    }

    fn write(&mut self, model: usize, slot: usize, bytes: &[u8], _deadline: Instant) -> Result<()> {
        let (_, buf) = self
            .exported
            .get(model)
            .and_then(|m| m.get(slot))
            .ok_or_else(|| err(format!("no slot {slot} of model #{model} is exported")))?;
        let mut buf = lock(buf);
        let room = buf.len();
        buf.get_mut(..bytes.len())
            .ok_or_else(|| err(format!("{} bytes exceed a {room}-byte slot", bytes.len())))?
            .copy_from_slice(bytes);
        Ok(())
    }
}

impl ImportSlots for HostSlots {
    fn name(&self) -> &'static str {
        super::NAME
    }

    fn open(&mut self, handles: &[Vec<IpcHandle>]) -> Result<()> {
        self.opened.clear();
        let reg = lock(registry());
        for (m, model) in handles.iter().enumerate() {
            let mut opened = Vec::with_capacity(model.len());
            for (s, h) in model.iter().enumerate() {
                h.validate()?;
                let buf = reg.get(&h.handle).and_then(Weak::upgrade).ok_or_else(|| {
                    err(format!(
                        "slot {s} of model #{m}: no exported buffer has this handle (its sender is gone)"
                    ))
                })?;
                opened.push(buf);
            }
            self.opened.push(opened);
        }
        self.opens.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn read(
        &mut self,
        model: usize,
        slot: usize,
        dst: &mut [u8],
        _deadline: Instant,
    ) -> Result<()> {
        let buf = lock(Self::slot(&self.opened, model, slot)?);
        let room = buf.len();
        let src = buf
            .get(..dst.len())
            .ok_or_else(|| err(format!("{} bytes exceed a {room}-byte slot", dst.len())))?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

impl Drop for HostSlots {
    fn drop(&mut self) {
        let mut reg = lock(registry());
        for (handle, _) in self.exported.iter().flatten() {
            reg.remove(handle);
        }
    }
}
