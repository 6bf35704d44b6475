//! CUDA IPC: a trainer and an engine on one GPU share device memory without a copy
//! (`ExportedBuffer` and `IpcImports` need the `cuda` feature; the handle does not).
//!
//! The trainer allocates an `ExportedBuffer` (plain `cuMemAlloc` memory: the driver
//! refuses to export stream-ordered pool allocations) and hands out its [`IpcHandle`], 64
//! opaque bytes plus the length and the membership generation, which travel like any other
//! control message (serde). The engine, another process on the same GPU, opens the handle
//! through `IpcImports`: once per generation, reusing the mapping for every later version
//! of that generation, and closing it exactly once (when the generation changes or the
//! imports are dropped). The exported memory is freed exactly once, when the trainer drops
//! the `ExportedBuffer`; the trainer keeps it alive for as long as the generation lasts.
//!
//! Every failure is an [`Error`](refit_runtime::Error): a malformed handle is refused before
//! any driver call, and driver errors keep their CUDA result code.

use serde::{Deserialize, Serialize};

/// An exported device allocation as it travels between processes.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcHandle {
    /// The driver's `CUipcMemHandle`, 64 opaque bytes.
    #[serde(with = "serde_bytes")]
    pub handle: Vec<u8>,
    /// Length of the allocation in bytes.
    pub len: usize,
    /// Membership generation the allocation belongs to.
    pub generation: u64,
}

impl IpcHandle {
    /// Length of a `CUipcMemHandle`.
    pub const LEN: usize = 64;

    /// Checks the handle's length after decoding.
    ///
    /// # Errors
    /// [`refit_runtime::Error::Wire`] when the handle is not 64 bytes or the allocation is
    /// empty.
    pub fn validate(&self) -> refit_runtime::Result<()> {
        if self.handle.len() != Self::LEN {
            return Err(refit_runtime::Error::Wire(format!(
                "cuda ipc handle has {} bytes, not {}",
                self.handle.len(),
                Self::LEN
            )));
        }
        if self.len == 0 {
            return Err(refit_runtime::Error::Wire(
                "cuda ipc handle describes an empty allocation".into(),
            ));
        }
        Ok(())
    }
}

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IpcHandle({} bytes, generation {})",
            self.len, self.generation
        )
    }
}

#[cfg(feature = "cuda")]
pub use with_cuda::{DeviceBytes, ExportedBuffer, IpcImports, OpenedBuffer};

#[cfg(feature = "cuda")]
mod with_cuda {
    use cudarc::driver::{CudaContext, result, sys};
    use refit_runtime::{Error, Result};
    use std::mem::MaybeUninit;
    use std::ops::Deref;
    use std::sync::Arc;

    use super::IpcHandle;
    use crate::gpu::device::{driver_error, driver_text};

    const WHAT: &str = "cuda-ipc";

    /// A range of device memory (exported or opened); host bytes go in and out through
    /// [`PinnedStaging`](crate::gpu::pinned::PinnedStaging) at the addresses [`DeviceBytes::at`] checks. Reached through [`ExportedBuffer`] and
    /// [`OpenedBuffer`], which own it.
    #[derive(Debug)]
    pub struct DeviceBytes {
        ctx: Arc<CudaContext>,
        ptr: sys::CUdeviceptr,
        len: usize,
    }

    impl DeviceBytes {
        /// The device address in this process.
        pub fn device_ptr(&self) -> sys::CUdeviceptr {
            self.ptr
        }

        /// Length in bytes.
        pub fn len(&self) -> usize {
            self.len
        }

        /// Always false (empty buffers and handles are refused).
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        /// The device address of bytes `offset..offset + n`, for [`PinnedStaging::upload`](crate::gpu::pinned::PinnedStaging::upload)
        /// and [`PinnedStaging::download`](crate::gpu::pinned::PinnedStaging::download) (or a device copy).
        ///
        /// # Errors
        /// [`Error::Transport`] when the range is outside the buffer.
        pub fn at(&self, offset: usize, n: usize) -> Result<sys::CUdeviceptr> {
            let len = self.len;
            if offset.checked_add(n).is_none_or(|end| end > len) {
                return Err(Error::Transport {
                    transport: WHAT,
                    message: format!("range {offset}..+{n} is outside a {len}-byte buffer"),
                });
            }
            Ok(self.ptr + offset as u64)
        }
    }

    /// Device memory this process allocated and exports to other processes; its
    /// [`DeviceBytes`] methods copy bytes in and out.
    #[derive(Debug)]
    pub struct ExportedBuffer(DeviceBytes);

    impl ExportedBuffer {
        /// Allocates `len` bytes with `cuMemAlloc` in `ctx` (exportable memory).
        ///
        /// # Errors
        /// [`Error::Config`] for zero bytes; [`Error::Transport`] when the driver refuses.
        pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
            if len == 0 {
                return Err(Error::Config(
                    "cuda ipc: cannot export an empty buffer".into(),
                ));
            }
            ctx.bind_to_thread()
                .map_err(|e| driver_error(WHAT, "binding the context", e))?;
            // SAFETY: `malloc_sync` is `cuMemAlloc`: it writes a fresh device address into
            // its out-parameter or fails; the context is bound to this thread above. The
            // address is freed exactly once, in `Drop`.
            let ptr = unsafe { result::malloc_sync(len) }
                .map_err(|e| driver_error(WHAT, "allocating exportable device memory", e))?;
            Ok(Self(DeviceBytes {
                ctx: ctx.clone(),
                ptr,
                len,
            }))
        }

        /// The handle another process opens, tagged with `generation`.
        ///
        /// # Errors
        /// [`Error::Transport`] when the driver refuses to export the allocation.
        pub fn handle(&self, generation: u64) -> Result<IpcHandle> {
            self.0
                .ctx
                .bind_to_thread()
                .map_err(|e| driver_error(WHAT, "binding the context", e))?;
            let mut raw = MaybeUninit::<sys::CUipcMemHandle>::uninit();
            // SAFETY: `raw` is a valid out-parameter for one `CUipcMemHandle`; `self.0.ptr`
            // is the base of a live `cuMemAlloc` allocation owned by `self`.
            unsafe { sys::cuIpcGetMemHandle(raw.as_mut_ptr(), self.0.ptr) }
                .result()
                .map_err(|e| driver_error(WHAT, "exporting the allocation", e))?;
            // SAFETY: the call above succeeded, so the driver initialised the handle.
            let raw = unsafe { raw.assume_init() };
            Ok(IpcHandle {
                handle: raw.reserved.iter().map(|&c| c as u8).collect(),
                len: self.0.len,
                generation,
            })
        }
    }

    impl Deref for ExportedBuffer {
        type Target = DeviceBytes;
        fn deref(&self) -> &DeviceBytes {
            &self.0
        }
    }

    impl Drop for ExportedBuffer {
        fn drop(&mut self) {
            // Errors cannot be returned from drop; the memory is released once either way.
            let _ = self.0.ctx.bind_to_thread();
            // SAFETY: `self.0.ptr` came from `cuMemAlloc` in `new` and is freed only here,
            // once (`cuMemFree` waits for work using it to finish).
            let _ = unsafe { result::free_sync(self.0.ptr) };
        }
    }

    /// Device memory of another process, opened from its [`IpcHandle`]; its
    /// [`DeviceBytes`] methods copy bytes in and out.
    #[derive(Debug)]
    pub struct OpenedBuffer {
        mem: DeviceBytes,
        generation: u64,
        handle: Vec<u8>,
    }

    impl OpenedBuffer {
        /// Opens `handle` in `ctx`. It must come from another process (the driver refuses
        /// handles exported by the opener itself).
        ///
        /// # Errors
        /// [`Error::Wire`] for a malformed handle (before any driver call);
        /// [`Error::Transport`] when the driver refuses to open it.
        pub fn open(ctx: &Arc<CudaContext>, handle: &IpcHandle) -> Result<Self> {
            handle.validate()?;
            let mut raw = sys::CUipcMemHandle {
                reserved: [0; IpcHandle::LEN],
            };
            for (dst, &src) in raw.reserved.iter_mut().zip(&handle.handle) {
                *dst = src as _;
            }
            ctx.bind_to_thread()
                .map_err(|e| driver_error(WHAT, "binding the context", e))?;
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: `ptr` is a valid out-parameter; `raw` is a by-value handle of the
            // driver's layout (64 bytes, validated above). On success the mapping is closed
            // exactly once, in `Drop`.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    raw,
                    sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            }
            .result()
            .map_err(|e| Error::Transport {
                transport: WHAT,
                message: format!(
                    "opening the handle of generation {}: {} (a handle opens only in another process on the same GPU)",
                    handle.generation,
                    driver_text(e)
                ),
            })?;
            Ok(Self {
                mem: DeviceBytes {
                    ctx: ctx.clone(),
                    ptr,
                    len: handle.len,
                },
                generation: handle.generation,
                handle: handle.handle.clone(),
            })
        }

        /// The generation of the handle it was opened from.
        pub fn generation(&self) -> u64 {
            self.generation
        }
    }

    impl Deref for OpenedBuffer {
        type Target = DeviceBytes;
        fn deref(&self) -> &DeviceBytes {
            &self.mem
        }
    }

    impl Drop for OpenedBuffer {
        fn drop(&mut self) {
            let _ = self.mem.ctx.bind_to_thread();
            // SAFETY: `self.mem.ptr` was returned by `cuIpcOpenMemHandle` in `open` and is
            // closed only here, once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.mem.ptr) };
        }
    }

    /// The engine side: at most one opened buffer, opened once per generation.
    #[derive(Debug, Default)]
    pub struct IpcImports {
        current: Option<OpenedBuffer>,
        opens: u64,
    }

    impl IpcImports {
        /// No buffer opened yet.
        pub fn new() -> Self {
            Self::default()
        }

        /// The buffer for `handle`: the one already open when `handle` is the same export
        /// of the same generation, otherwise the old one is closed and `handle` opened.
        ///
        /// # Errors
        /// As [`OpenedBuffer::open`]; after an error nothing is open.
        pub fn get(&mut self, ctx: &Arc<CudaContext>, handle: &IpcHandle) -> Result<&OpenedBuffer> {
            let same = self.current.as_ref().is_some_and(|b| {
                b.generation == handle.generation
                    && b.handle == handle.handle
                    && b.mem.len == handle.len
            });
            if !same {
                self.current = None;
                self.current = Some(OpenedBuffer::open(ctx, handle)?);
                self.opens += 1;
            }
            self.current
                .as_ref()
                .ok_or(Error::State("cuda ipc: no buffer open"))
        }

        /// How many times a handle was opened (once per generation when used as intended).
        pub fn opens(&self) -> u64 {
            self.opens
        }

        /// Closes the open buffer, if any.
        pub fn close(&mut self) {
            self.current = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_travel_as_bytes_and_bad_ones_are_refused() {
        let h = IpcHandle {
            handle: (0..64u8).collect(),
            len: 1 << 30,
            generation: 7,
        };
        let token = refit_runtime::wire::to_token(&h).unwrap();
        let back: IpcHandle = refit_runtime::wire::from_token(&token).unwrap();
        assert_eq!(back, h);
        back.validate().unwrap();
        let short = IpcHandle {
            handle: vec![1; 12],
            ..h.clone()
        };
        let e = short.validate().unwrap_err().to_string();
        assert!(e.contains("12 bytes"), "{e}");
        let empty = IpcHandle { len: 0, ..h };
        assert!(empty.validate().is_err());
    }
}
