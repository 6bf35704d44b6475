//! Checksums of a Python engine's served tensors, to compare with a version's.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::errors::refused;

/// xxh3-64 of each buffer's bytes (C-contiguous byte buffers: numpy arrays viewed as
/// `uint8`, torch CPU tensors through numpy), as `Update.checksums()` computes a version's:
/// a Python engine hashes what it serves and compares.
///
/// # Errors
/// `Refused` naming the position of a buffer that is not a contiguous byte buffer.
#[pyfunction]
pub(crate) fn checksums(py: Python<'_>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<u64>> {
    let mut out = Vec::with_capacity(buffers.len());
    for (i, obj) in buffers.iter().enumerate() {
        let buf = PyBuffer::<u8>::get(obj)
            .map_err(|e| refused(format!("buffer {i}: not a byte buffer ({e})")))?;
        if !buf.is_c_contiguous() {
            return Err(refused(format!("buffer {i}: not contiguous")));
        }
        if buf.len_bytes() == 0 {
            out.push(refit_runtime::tensor_checksum(&[]));
            continue;
        }
        // SAFETY: `buf` is a C-contiguous buffer of `len_bytes()` bytes (checked above) that
        // the exporter keeps valid and in place while `buf` lives (until the end of this
        // iteration, past the hash); `u8` has no alignment or validity requirement. A Python
        // thread writing the tensor while it is hashed (the GIL is released) changes the hash,
        // not the memory safety of the reads: they are of plain bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts(buf.buf_ptr().cast::<u8>(), buf.len_bytes()) };
        out.push(py.detach(|| refit_runtime::tensor_checksum(bytes)));
    }
    Ok(out)
}
