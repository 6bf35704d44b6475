//! What every GPU module needs from the driver: a context opened only after the probe said
//! the driver loads, driver errors as text, and waits on CUDA events that keep a deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, DriverError, sys};
use refit_runtime::{Error, Result};

use super::GpuUnavailable;

/// Opens (retains) the primary context of device `ordinal` and binds it to this thread.
///
/// The driver library is looked for first, so a machine without CUDA gets an error, never
/// cudarc's panic.
///
/// # Errors
/// [`GpuUnavailable`] when the driver is missing, reports an error, or has no such device.
pub fn open_device(ordinal: usize) -> std::result::Result<Arc<CudaContext>, GpuUnavailable> {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports whether
    // it loaded; it calls no CUDA function (cudarc panics on a real call when it is missing).
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuUnavailable::NoDriver);
    }
    let count = CudaContext::device_count().map_err(|e| GpuUnavailable::Driver(driver_text(e)))?;
    if count <= 0 {
        return Err(GpuUnavailable::NoDevice);
    }
    if ordinal >= count as usize {
        return Err(GpuUnavailable::NoSuchDevice {
            ordinal,
            count: count as usize,
        });
    }
    CudaContext::new(ordinal).map_err(|e| GpuUnavailable::Driver(driver_text(e)))
}

/// Whether `libnccl` can be loaded (cudarc looks for `libnccl.so`, not `libnccl.so.2`).
pub fn nccl_present() -> bool {
    // SAFETY: a dlopen attempt and nothing else; no NCCL function is called.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// A driver error as lowercase-led text that keeps the CUDA result code.
pub fn driver_text(e: DriverError) -> String {
    match e.error_string() {
        Ok(s) => format!("{:?}: {}", e.0, s.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    }
}

/// A failed driver call as [`Error::Transport`] of transport `what`.
pub fn driver_error(what: &'static str, doing: &str, e: DriverError) -> Error {
    Error::Transport {
        transport: what,
        message: format!("{doing}: {}", driver_text(e)),
    }
}

/// Polls `event` until the work recorded in it is done, or `deadline` passes.
///
/// Spins briefly, then sleeps in short steps, so a wait of a few microseconds stays cheap
/// and a long one does not burn a core.
///
/// # Errors
/// [`Error::Timeout`] naming `what` past `deadline`; [`Error::Transport`] when the driver
/// reports an error for the recorded work.
pub fn wait_event(event: &CudaEvent, deadline: Instant, what: &str) -> Result<()> {
    let start = Instant::now();
    let mut polls = 0u32;
    loop {
        match event.try_is_complete() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(driver_error("cuda", what, e)),
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: what.to_owned(),
                after: start.elapsed(),
            });
        }
        polls = polls.saturating_add(1);
        if polls < 200 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// See [`super::device_copy_times`].
pub(super) fn copy_times(ordinal: usize, len: usize, iters: usize) -> Result<Vec<Duration>> {
    let ctx = open_device(ordinal).map_err(|why| Error::transport("cuda", why.to_string()))?;
    let stream = ctx
        .new_stream()
        .map_err(|e| driver_error("cuda", "creating a stream", e))?;
    let alloc = |what: &str| {
        stream
            .alloc_zeros::<u8>(len.max(1))
            .map_err(|e| driver_error("cuda", &format!("allocating {what} of {len} bytes"), e))
    };
    let (a, mut b) = (alloc("a source")?, alloc("a destination")?);
    let mut times = Vec::with_capacity(iters);
    for i in 0..=iters {
        let t = Instant::now();
        stream
            .memcpy_dtod(&a, &mut b)
            .map_err(|e| driver_error("cuda", "copying device to device", e))?;
        stream
            .synchronize()
            .map_err(|e| driver_error("cuda", "waiting for a device copy", e))?;
        if i > 0 {
            times.push(t.elapsed());
        }
    }
    Ok(times)
}
