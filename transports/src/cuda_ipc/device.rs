//! Slots in device memory: exported by CUDA IPC on the sender's side, opened once on each
//! receiver's, with host bytes moving through pinned staging (feature `cuda`).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaStream};
use refit_runtime::{Error, Result};

use super::NAME;
use super::slots::{ExportSlots, ImportSlots};
use crate::gpu::device::{driver_error, open_device};
use crate::gpu::ipc::{ExportedBuffer, IpcHandle, OpenedBuffer};
use crate::gpu::link_unavailable;
use crate::gpu::pinned::{DEFAULT_CHUNK, PinnedStaging};

/// The export generation of a sender's slots: they live as long as the sender.
const GENERATION: u64 = 1;

/// A device's context, a stream for the staging copies, and the staging itself.
#[derive(Debug)]
struct Device {
    // Field order is drop order: staging waits for its copies before the stream goes.
    staging: PinnedStaging,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl Device {
    fn open(ordinal: usize) -> Result<Self> {
        let ctx = open_device(ordinal).map_err(|why| link_unavailable(NAME, &why))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error(NAME, "creating a stream", e))?;
        let staging = PinnedStaging::new(&ctx, DEFAULT_CHUNK)?;
        Ok(Self {
            staging,
            stream,
            ctx,
        })
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error(NAME, "binding the context", e))
    }
}

fn no_slot(model: usize, slot: usize) -> Error {
    Error::transport(NAME, format!("no slot {slot} of model #{model}"))
}

/// The sender's slots: one `cuMemAlloc` buffer per slot and model on device `ordinal`,
/// freed exactly once when this is dropped (with the sender).
#[derive(Debug)]
pub struct CudaExport {
    // the buffers go before the device they live on
    buffers: Vec<Vec<ExportedBuffer>>,
    device: Device,
}

impl CudaExport {
    /// Opens device `ordinal` for exporting.
    ///
    /// # Errors
    /// The probe's reason when the device cannot be used; the driver's errors.
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Self {
            buffers: Vec::new(),
            device: Device::open(ordinal)?,
        })
    }

    /// The device context the slots live in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.device.ctx
    }
}

impl ExportSlots for CudaExport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn export(&mut self, len: usize, slots: usize) -> Result<Vec<IpcHandle>> {
        let mut buffers = Vec::with_capacity(slots);
        let mut handles = Vec::with_capacity(slots);
        for _ in 0..slots {
            let b = ExportedBuffer::new(&self.device.ctx, len.max(1))?;
            handles.push(b.handle(GENERATION)?);
            buffers.push(b);
        }
        self.buffers.push(buffers);
        Ok(handles)
    }

    fn write(&mut self, model: usize, slot: usize, bytes: &[u8], deadline: Instant) -> Result<()> {
        let b = self
            .buffers
            .get(model)
            .and_then(|m| m.get(slot))
            .ok_or_else(|| no_slot(model, slot))?;
        let dst = b.at(0, bytes.len())?;
        self.device.bind()?;
        let d = &mut self.device;
        d.staging.upload(bytes, dst, &d.stream, deadline)
    }
}

/// A receiver's view of the sender's slots: every handle opened once (the mappings closed
/// exactly once, when this is dropped or opens another generation).
#[derive(Debug)]
pub struct CudaImport {
    // the mappings go before the device they live on
    opened: Vec<Vec<OpenedBuffer>>,
    device: Device,
    opens: u64,
}

impl CudaImport {
    /// Opens device `ordinal` for importing (the exporter's GPU, as this process sees it).
    ///
    /// # Errors
    /// The probe's reason when the device cannot be used; the driver's errors.
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Self {
            opened: Vec::new(),
            device: Device::open(ordinal)?,
            opens: 0,
        })
    }

    /// How many times handles were opened (once per generation when used as intended).
    pub fn opens(&self) -> u64 {
        self.opens
    }
}

impl ImportSlots for CudaImport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn open(&mut self, handles: &[Vec<IpcHandle>]) -> Result<()> {
        self.opened.clear();
        let mut opened = Vec::with_capacity(handles.len());
        for model in handles {
            let slots = model
                .iter()
                .map(|h| OpenedBuffer::open(&self.device.ctx, h))
                .collect::<Result<Vec<_>>>()?;
            opened.push(slots);
        }
        self.opened = opened;
        self.opens += 1;
        Ok(())
    }

    fn read(&mut self, model: usize, slot: usize, dst: &mut [u8], deadline: Instant) -> Result<()> {
        let b = self
            .opened
            .get(model)
            .and_then(|m| m.get(slot))
            .ok_or_else(|| no_slot(model, slot))?;
        let src = b.at(0, dst.len())?;
        self.device.bind()?;
        let d = &mut self.device;
        d.staging.download(src, dst, &d.stream, deadline)
    }
}
