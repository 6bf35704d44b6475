//! A safetensors file a TCP receiver pulls straight into (what `refit pull` writes). Where
//! the platform allows (unix) and the model's tensors lie back to back (no padding between
//! them, as for tensors whose sizes are multiples of 64 bytes), the transfer writes its
//! bytes straight into a temporary file beside the target, at their place after the
//! safetensors header, as they arrive; nothing makes a second pass over them. A file in
//! memory (tmpfs, such as `/dev/shm`, on Linux) is mapped and the socket read straight into
//! the map (`REFIT_PULL_MAP` picks how: `huge`, `map` or `write`); a file elsewhere takes
//! positioned writes. The file is then synced and renamed into place. Otherwise the weights
//! land in memory and are written afterwards.

#[cfg(target_os = "linux")]
mod map;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use refit_runtime::{
    Error, Manifest, ModelId, Result, SafetensorsFilePlan, SharedBytes, Version, WeightSet,
    temp_sibling,
};

use super::{Sink, SinkSlice};
#[cfg(target_os = "linux")]
use map::{FileMap, MapMode};

/// A temporary file a transfer writes.
#[derive(Debug)]
struct Pending {
    model: ModelId,
    version: Version,
    tmp: PathBuf,
    file: Arc<File>,
}

/// The temporary files of one pull into the file `target`, one per transfer; the one
/// committed is renamed onto the target, the others are removed when this is dropped.
///
/// ```no_run
/// use std::sync::Arc;
/// use std::time::Duration;
///
/// use refit_runtime::ReceiverInit;
/// use refit_transports::tcp::{PullFile, TcpReceiver, TcpReceiverSpec};
///
/// # fn pull(spec: TcpReceiverSpec) -> refit_runtime::Result<()> {
/// let file = PullFile::new("model.safetensors".as_ref());
/// let sinks = Arc::clone(&file);
/// let receiver = TcpReceiver::new(spec)
///     .with_sinks(move |model, version, manifest| sinks.sink(model, version, manifest));
/// let receiver = ReceiverInit::new(receiver, None).connect(Duration::from_secs(60))?;
/// let model = receiver.manifests().ids().next().cloned();
/// if let Some(weights) = model.and_then(|m| receiver.current(&m)) {
///     // the bytes went into the file as they arrived: synced and renamed into place
///     file.commit(&weights)?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct PullFile {
    target: PathBuf,
    pending: Mutex<Vec<Pending>>,
}

fn path_err(context: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_path_buf();
    move |source| Error::Path {
        context,
        path,
        source,
    }
}

/// Writes a transfer's bytes into the file, after its header.
struct FileSink {
    file: Arc<File>,
    tmp: PathBuf,
    start: usize,
    len: usize,
    /// The file mapped, when it lives in memory: transfers read the socket into it.
    #[cfg(target_os = "linux")]
    map: Option<FileMap>,
}

/// The bytes of the finished file, mapped read-only (nothing reads them in `refit pull`, so
/// no page of the map is ever touched).
struct Mapped(memmap2::Mmap);

impl SharedBytes for Mapped {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl Sink for FileSink {
    fn write_at(&self, at: usize, bytes: &[u8]) -> Result<()> {
        if at + bytes.len() > self.len {
            return Err(Error::State("a write past the end of the weights"));
        }
        write_at(&self.file, bytes, (self.start + at) as u64)
            .map_err(path_err("writing", &self.tmp))
    }

    fn claim(&self, range: std::ops::Range<usize>) -> Result<Option<SinkSlice<'_>>> {
        #[cfg(target_os = "linux")]
        if let Some(map) = &self.map {
            if range.end > self.len {
                return Err(Error::State("a write past the end of the weights"));
            }
            let at = self.start + range.start..self.start + range.end;
            return map.claim(at);
        }
        let _ = range;
        Ok(None)
    }

    fn finish(self: Box<Self>) -> Result<Arc<dyn SharedBytes>> {
        #[cfg(target_os = "linux")]
        if let Some(map) = self.map {
            let data = self.start..self.start + self.len;
            return Ok(Arc::new(map.into_bytes(data)?));
        }
        // SAFETY: the file was created by this process under a fresh temporary name
        // (`create_new`) and is only renamed, never resized or written, from now on; the map
        // covers bytes inside it.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(self.start as u64)
                .len(self.len)
                .map(&*self.file)
        }
        .map_err(path_err("mapping", &self.tmp))?;
        Ok(Arc::new(Mapped(map)))
    }
}

#[cfg(unix)]
fn write_at(file: &File, bytes: &[u8], at: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(file, bytes, at)
}

#[cfg(not(unix))]
fn write_at(_: &File, _: &[u8], _: u64) -> std::io::Result<()> {
    Err(std::io::Error::other("positioned writes need unix"))
}

impl PullFile {
    /// The temporary files for `target` (none yet).
    pub fn new(target: &Path) -> Arc<Self> {
        Arc::new(Self {
            target: target.to_path_buf(),
            pending: Mutex::new(Vec::new()),
        })
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Vec<Pending>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A sink into a new temporary file for `model` at `version`, sized and with its header
    /// written; `None` when the platform has no positioned writes or the tensors do not lie
    /// back to back (the weights then land in memory and [`PullFile::commit`] writes them).
    /// What [`TcpReceiver::with_sinks`](super::TcpReceiver::with_sinks) asks for.
    ///
    /// # Errors
    /// [`Error::Path`] when the file cannot be created, sized or written.
    pub fn sink(
        &self,
        model: &ModelId,
        version: Version,
        manifest: &Arc<Manifest>,
    ) -> Result<Option<Box<dyn Sink>>> {
        let layout = SafetensorsFilePlan::of(model, version, manifest)?;
        if !cfg!(unix) || !layout.in_place() || layout.data_len != manifest.total_len() {
            return Ok(None);
        }
        let tmp = temp_sibling(&self.target);
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(path_err("creating", &tmp))?;
        let file = Arc::new(file);
        self.pending().push(Pending {
            model: model.clone(),
            version,
            tmp: tmp.clone(),
            file: Arc::clone(&file),
        });
        file.set_len(layout.file_len() as u64)
            .map_err(path_err("sizing", &tmp))?;
        write_at(&file, &layout.header, 0).map_err(path_err("writing", &tmp))?;
        // a file in memory is filled through a map of it; where it cannot be mapped, or
        // lives elsewhere, positioned writes fill it
        #[cfg(target_os = "linux")]
        let map = FileMap::of(&file, layout.file_len(), MapMode::from_env()).unwrap_or(None);
        Ok(Some(Box::new(FileSink {
            file,
            tmp,
            start: layout.header.len(),
            len: layout.data_len,
            #[cfg(target_os = "linux")]
            map,
        })))
    }

    /// Puts `weights` at the target: the file a sink wrote for their version (synced, then
    /// renamed into place), or, when they landed in memory, a new file written from them.
    ///
    /// # Errors
    /// [`Error::Path`] on I/O failure; [`Error::Safetensors`] when encoding fails.
    pub fn commit(&self, weights: &WeightSet) -> Result<()> {
        let found = {
            let mut pending = self.pending();
            pending
                .iter()
                .rposition(|p| &p.model == weights.model() && p.version == weights.version())
                .map(|at| pending.remove(at))
        };
        let Some(p) = found else {
            return weights.write_safetensors(&self.target);
        };
        let result = (|| {
            p.file.sync_all().map_err(path_err("syncing", &p.tmp))?;
            std::fs::rename(&p.tmp, &self.target)
                .map_err(path_err("renaming into place", &self.target))
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&p.tmp);
        }
        result
    }
}

impl Drop for PullFile {
    fn drop(&mut self) {
        for p in self.pending().drain(..) {
            let _ = std::fs::remove_file(&p.tmp);
        }
    }
}
