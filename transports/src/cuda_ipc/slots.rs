//! The memory a `cuda-ipc` link's slots live in, as the shm transport's sender and
//! receivers use it: buffers exported by handle on one side, opened by handle on the other.

use std::time::Instant;

use refit_runtime::Result;

use crate::gpu::ipc::IpcHandle;

/// The sender's side: one buffer per slot of every model, exported by handle.
pub trait ExportSlots: Send + std::fmt::Debug {
    /// The link's name (`cuda-ipc`): the sender end's name and the culprit of its errors.
    fn name(&self) -> &'static str;

    /// Allocates `slots` buffers of at least `len` bytes for the next model (models come in
    /// the scheme's order, from 0) and returns the handles receivers open them with.
    ///
    /// # Errors
    /// The memory cannot be allocated or exported.
    fn export(&mut self, len: usize, slots: usize) -> Result<Vec<IpcHandle>>;

    /// Writes `bytes` at the start of slot `slot` of model `model`, returning once every
    /// byte is there (a receiver may read them as soon as the sender commits).
    ///
    /// # Errors
    /// No such slot, `bytes` longer than it, the copy failed or missed `deadline`.
    fn write(&mut self, model: usize, slot: usize, bytes: &[u8], deadline: Instant) -> Result<()>;
}

/// A receiver's side: the sender's buffers, opened once.
pub trait ImportSlots: Send + std::fmt::Debug {
    /// The link's name (`cuda-ipc`).
    fn name(&self) -> &'static str;

    /// Opens every model's slot handles (`handles[model][slot]`), closing whatever was
    /// open before. Called once when the receiver attaches: the handles of one export
    /// generation stay valid as long as their sender.
    ///
    /// # Errors
    /// A malformed handle, or one this process cannot open (another GPU, the sender gone,
    /// the sender's own process for CUDA).
    fn open(&mut self, handles: &[Vec<IpcHandle>]) -> Result<()>;

    /// Copies the first `dst.len()` bytes of slot `slot` of model `model` into `dst`.
    ///
    /// # Errors
    /// Nothing open there, `dst` longer than the slot, the copy failed or missed
    /// `deadline`.
    fn read(&mut self, model: usize, slot: usize, dst: &mut [u8], deadline: Instant) -> Result<()>;
}
