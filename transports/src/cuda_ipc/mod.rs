//! The `cuda-ipc` link: a trainer and its engines, processes on one GPU, share the
//! versions' device memory through CUDA IPC.
//!
//! It is the shared-memory transport ([`crate::shm`]) with the slots' bytes moved to the
//! GPU. The sender exports one device buffer per slot and model ([`ExportSlots`]); their
//! handles go to receivers in the board's directory, and each receiver opens them once when
//! it attaches ([`ImportSlots`]): the handles belong to one export generation, which lasts
//! as long as the sender. Everything that decides which bytes may be read stays the shm
//! transport's, in shared memory: the commit record under its seqlock, every slot's header
//! (odd while written), the readers' pins, the owners' leases and the futex wake-ups. A
//! version is written once into a slot no reader has pinned; a commit then hands it to every
//! receiver at once, without moving its bytes.
//!
//! What a receiver does with a committed slot today: it pins it, copies the version out
//! into host memory (the runtime's weight sets live in host memory), checks the slot's
//! header again and unpins it. Serving the device slot itself to an engine on the GPU, the
//! version swapped by a pointer and no copy at all, waits for device-resident weight sets.
//!
//! The slot memory is a seam: `CudaExport` and `CudaImport` (feature `cuda`) keep the
//! slots in device memory; `HostSlots` (feature `test-util`) keeps them in host memory of
//! one process, so the scheme suite runs this link's protocol in CI without a GPU.
//!
//! Without the `cuda` feature the link still exists (its name resolves, its reach is one
//! host), but [`LinkFactory::built`], `open` and `receiver` answer "not compiled with CUDA",
//! naming the feature; with it, but without a usable GPU, they answer with the probe's
//! reason. Nothing panics.

#[cfg(feature = "cuda")]
mod device;
#[cfg(any(test, feature = "test-util"))]
mod host;
mod slots;

use refit_runtime::{Manifests, ReceiverTransport, Result};

#[cfg(feature = "cuda")]
pub use device::{CudaExport, CudaImport};
#[cfg(any(test, feature = "test-util"))]
pub use host::HostSlots;
pub use slots::{ExportSlots, ImportSlots};

use crate::link::{
    LinkFactory, LinkMemory, LinkOptions, LinkTraits, OpenedLink, Reach, ReceiverSpec,
};
use crate::shm::{ShmConfig, ShmReceiver, ShmReceiverSpec, ShmSender};

const NAME: &str = "cuda-ipc";

/// CUDA IPC between processes on one GPU, in the link factory.
#[derive(Debug, Clone, Copy)]
pub struct CudaIpcLink;

impl CudaIpcLink {
    /// The sender end over any slot memory: what [`LinkFactory::open`] runs with
    /// `CudaExport`. The spec names `cuda-ipc`; the board's files are the sender's
    /// ([`ShmSender::segment_paths`]).
    ///
    /// # Errors
    /// As [`ShmSender::create_exported`].
    pub fn open_over(
        &self,
        manifests: &Manifests,
        options: &LinkOptions,
        slots: Box<dyn ExportSlots>,
    ) -> Result<(ShmSender, ReceiverSpec)> {
        let mut config = ShmConfig {
            expected_receivers: options.expected_receivers,
            ..ShmConfig::default()
        };
        if let Some(dir) = &options.dir {
            config.dir.clone_from(dir);
        }
        let sender = ShmSender::create_exported(&config, manifests, slots)?;
        let spec = sender.receiver_spec();
        let about = format!("board {} (slots in device memory)", spec.board.display());
        let spec = ReceiverSpec::new(self, &spec, about)?;
        Ok((sender, spec))
    }

    /// A receiver end of a `cuda-ipc` spec over any slot memory: what
    /// [`LinkFactory::receiver`] runs with `CudaImport`. Nothing is opened before
    /// `connect`.
    ///
    /// # Errors
    /// A spec of another transport, or one that does not decode.
    pub fn join_over(
        &self,
        spec: &ReceiverSpec,
        imports: Box<dyn ImportSlots>,
    ) -> Result<ShmReceiver> {
        spec.check_transport(self)?;
        let s: ShmReceiverSpec = spec.params()?;
        Ok(ShmReceiver::new(s).with_imports(imports))
    }
}

impl LinkFactory for CudaIpcLink {
    fn traits(&self) -> &'static LinkTraits {
        &LinkTraits {
            name: NAME,
            about: "processes on one GPU: versions in exported device buffers, one per slot, opened once (feature `cuda`)",
            // IPC handles open on the GPU of the same host only
            reach: Reach::Host,
            // each receiver copies versions out into host arenas of its own
            receivers_copy: true,
            memory: LinkMemory::Gpu { nccl: false },
        }
    }
    fn sender_end(&self, manifests: &Manifests, options: &LinkOptions) -> Result<OpenedLink> {
        let (sender, spec) = self.open_over(manifests, options, with_cuda::export(options)?)?;
        Ok(crate::shm::link::opened(sender, spec))
    }
    fn receiver_end(
        &self,
        spec: &ReceiverSpec,
        options: &LinkOptions,
    ) -> Result<Box<dyn ReceiverTransport>> {
        Ok(Box::new(self.join_over(spec, with_cuda::import(options)?)?))
    }
}

#[cfg(feature = "cuda")]
mod with_cuda {
    use refit_runtime::Result;

    use super::{CudaExport, CudaImport, ExportSlots, ImportSlots};
    use crate::link::LinkOptions;

    pub(super) fn export(options: &LinkOptions) -> Result<Box<dyn ExportSlots>> {
        Ok(Box::new(CudaExport::new(options.cuda_device()?)?))
    }

    pub(super) fn import(options: &LinkOptions) -> Result<Box<dyn ImportSlots>> {
        Ok(Box::new(CudaImport::new(options.cuda_device()?)?))
    }
}

/// The stand-in without the `cuda` feature: every call answers "not compiled with CUDA".
#[cfg(not(feature = "cuda"))]
mod with_cuda {
    use refit_runtime::Result;

    use super::{ExportSlots, ImportSlots, NAME};
    use crate::gpu::{GpuUnavailable, link_unavailable};
    use crate::link::LinkOptions;

    pub(super) fn export(_: &LinkOptions) -> Result<Box<dyn ExportSlots>> {
        Err(link_unavailable(NAME, &GpuUnavailable::NotCompiled))
    }

    pub(super) fn import(_: &LinkOptions) -> Result<Box<dyn ImportSlots>> {
        Err(link_unavailable(NAME, &GpuUnavailable::NotCompiled))
    }
}

#[cfg(test)]
mod tests;
