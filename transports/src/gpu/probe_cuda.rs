//! The probe, with cudarc.

use cudarc::driver::{CudaContext, sys};

use super::{GpuDevice, GpuReport, GpuUnavailable};

pub(super) fn probe() -> Result<GpuReport, GpuUnavailable> {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports whether
    // it loaded; it calls no CUDA function. cudarc panics on the first real call when the
    // library is missing, which is why this check comes first.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuUnavailable::NoDriver);
    }
    let count = CudaContext::device_count().map_err(|e| GpuUnavailable::Driver(e.to_string()))?;
    if count <= 0 {
        return Err(GpuUnavailable::NoDevice);
    }
    let mut devices = Vec::new();
    for ordinal in 0..count as usize {
        let ctx = CudaContext::new(ordinal).map_err(|e| GpuUnavailable::Driver(e.to_string()))?;
        let name = ctx
            .name()
            .map_err(|e| GpuUnavailable::Driver(e.to_string()))?;
        let total_memory = ctx
            .total_mem()
            .map_err(|e| GpuUnavailable::Driver(e.to_string()))?;
        devices.push(GpuDevice {
            ordinal,
            name,
            total_memory,
        });
    }
    // SAFETY: as above, for libnccl: a dlopen attempt and nothing else.
    let nccl = unsafe { cudarc::nccl::sys::is_culib_present() };
    Ok(GpuReport { devices, nccl })
}
