//! GPU support: a probe that says, as an error and never a panic, whether the CUDA driver and
//! NCCL can be loaded, and which devices are present; pinned host staging (`pinned`, with
//! the `cuda` feature) and CUDA IPC between processes on one GPU ([`ipc`]). The NCCL
//! communicator is `collective::nccl`.
//!
//! Built with the `cuda` feature, the probe loads the libraries at run time through cudarc
//! (dynamic loading: the feature compiles on machines without CUDA). Without the feature it
//! reports [`GpuUnavailable::NotCompiled`]. No cudarc call is made before the probe has
//! checked that the libraries exist, because cudarc panics when they are missing.

use serde::{Deserialize, Serialize};

#[cfg(feature = "cuda")]
pub mod device;
pub mod ipc;
#[cfg(feature = "cuda")]
pub mod pinned;
#[cfg(feature = "cuda")]
mod probe_cuda;

/// Why no GPU can be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum GpuUnavailable {
    /// This build has no `cuda` feature.
    NotCompiled,
    /// `libcuda` (the driver) cannot be loaded.
    NoDriver,
    /// The driver loaded but reported an error.
    Driver(String),
    /// The driver works but there is no device.
    NoDevice,
    /// The driver has devices, but not this ordinal.
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// The driver and the device work but `libnccl` cannot be loaded.
    NoNccl,
}

impl std::fmt::Display for GpuUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotCompiled => write!(f, "refit was built without the `cuda` feature"),
            Self::NoDriver => write!(
                f,
                "the CUDA driver library (libcuda.so) cannot be loaded: no NVIDIA driver on this machine"
            ),
            Self::Driver(e) => write!(f, "the CUDA driver reported an error: {e}"),
            Self::NoDevice => write!(f, "the CUDA driver found no device"),
            Self::NoSuchDevice { ordinal, count } => write!(
                f,
                "the CUDA driver has no device {ordinal} ({count} present: 0..{count})"
            ),
            Self::NoNccl => write!(
                f,
                "libnccl cannot be loaded (cudarc looks for libnccl.so: link it to libnccl.so.2 in a directory on LD_LIBRARY_PATH)"
            ),
        }
    }
}

impl std::error::Error for GpuUnavailable {}

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuDevice {
    /// Ordinal.
    pub ordinal: usize,
    /// Name reported by the driver.
    pub name: String,
    /// Total memory in bytes.
    pub total_memory: usize,
}

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuReport {
    /// The devices.
    pub devices: Vec<GpuDevice>,
    /// Whether `libnccl` can be loaded (cudarc looks for `libnccl.so`; link it to
    /// `libnccl.so.2` where only that name is installed).
    pub nccl: bool,
}

/// Looks for the CUDA driver, the devices and NCCL.
///
/// # Errors
/// [`GpuUnavailable`] saying why no GPU can be used; never panics.
pub fn probe() -> Result<GpuReport, GpuUnavailable> {
    #[cfg(feature = "cuda")]
    {
        probe_cuda::probe()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(GpuUnavailable::NotCompiled)
    }
}

/// Checks that device `ordinal` can be used (and NCCL loaded, when `nccl`), never panicking:
/// what the GPU links ask before they open anything.
///
/// # Errors
/// [`GpuUnavailable`] saying why: [`GpuUnavailable::NotCompiled`] without the `cuda`
/// feature, [`GpuUnavailable::NoSuchDevice`] for an ordinal the driver does not have.
pub fn check_device(ordinal: usize, nccl: bool) -> Result<(), GpuUnavailable> {
    #[cfg(feature = "cuda")]
    {
        device::open_device(ordinal)?;
        if nccl && !device::nccl_present() {
            return Err(GpuUnavailable::NoNccl);
        }
        Ok(())
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, nccl);
        Err(GpuUnavailable::NotCompiled)
    }
}

/// Times `iters` device-to-device copies of `len` bytes between two buffers of device
/// `ordinal` (each until its stream is idle, after one untimed copy): the physical baseline
/// `refit bench` sets the GPU links against.
///
/// # Errors
/// [`refit_runtime::Error::Transport`] with [`check_device`]'s reason when the device
/// cannot be used (not compiled with CUDA, no driver, no such device); the driver's errors.
pub fn device_copy_times(
    ordinal: usize,
    len: usize,
    iters: usize,
) -> refit_runtime::Result<Vec<std::time::Duration>> {
    #[cfg(feature = "cuda")]
    {
        device::copy_times(ordinal, len, iters)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, len, iters);
        Err(refit_runtime::Error::transport(
            "cuda",
            GpuUnavailable::NotCompiled.to_string(),
        ))
    }
}

/// The error of GPU link `link` that cannot run here: for [`GpuUnavailable::NotCompiled`],
/// "not compiled with CUDA" with the feature and how to build with it; otherwise the probe's
/// reason.
pub fn link_unavailable(link: &'static str, why: &GpuUnavailable) -> refit_runtime::Error {
    let message = match why {
        GpuUnavailable::NotCompiled => format!(
            "not compiled with CUDA: {why}; build with `--features cuda` (the refit tool: \
             `cargo build --release --features cuda --bin refit`)"
        ),
        other => format!("no usable GPU: {other}"),
    };
    refit_runtime::Error::Transport {
        transport: link,
        message,
    }
}

/// [`crate::LinkFactory::built`] of GPU link `link`: fine with the `cuda` feature, else
/// [`link_unavailable`] with [`GpuUnavailable::NotCompiled`].
pub(crate) fn link_built(link: &'static str) -> refit_runtime::Result<()> {
    if cfg!(feature = "cuda") {
        Ok(())
    } else {
        Err(link_unavailable(link, &GpuUnavailable::NotCompiled))
    }
}

/// [`crate::LinkFactory::usable`] of GPU link `link`: built, and the options' device usable
/// ([`check_device`], NCCL loaded too when `nccl`).
pub(crate) fn link_usable(
    link: &'static str,
    options: &crate::link::LinkOptions,
    nccl: bool,
) -> refit_runtime::Result<()> {
    link_built(link)?;
    check_device(options.cuda_device()?, nccl).map_err(|why| link_unavailable(link, &why))
}

/// An NCCL unique id as it travels between processes (128 bytes; `c_char` is signed on
/// x86-64 and unsigned on aarch64, so the wire form is plain bytes).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NcclUniqueId(#[serde(with = "serde_bytes")] pub Vec<u8>);

impl NcclUniqueId {
    /// Length of an NCCL unique id.
    pub const LEN: usize = 128;

    /// Checks the length after decoding.
    ///
    /// # Errors
    /// [`refit_runtime::Error::Wire`] when the id is not 128 bytes.
    pub fn validate(&self) -> refit_runtime::Result<()> {
        if self.0.len() != Self::LEN {
            return Err(refit_runtime::Error::Wire(format!(
                "nccl unique id has {} bytes, not {}",
                self.0.len(),
                Self::LEN
            )));
        }
        Ok(())
    }
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclUniqueId({} bytes)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On machines without an NVIDIA driver (CI), the probe answers with a clear error.
    #[test]
    fn probe_never_panics_and_explains() {
        match probe() {
            Ok(report) => assert!(!report.devices.is_empty()),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("cuda") || msg.contains("CUDA"), "{msg}");
            }
        }
        #[cfg(not(feature = "cuda"))]
        assert_eq!(probe(), Err(GpuUnavailable::NotCompiled));
    }

    #[test]
    fn nccl_ids_travel_as_bytes() {
        let id = NcclUniqueId((0..128u8).collect());
        let token = refit_runtime::wire::to_token(&id).unwrap();
        let back: NcclUniqueId = refit_runtime::wire::from_token(&token).unwrap();
        assert_eq!(back, id);
        back.validate().unwrap();
        assert!(NcclUniqueId(vec![0; 12]).validate().is_err());
    }
}
