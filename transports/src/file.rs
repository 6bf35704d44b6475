//! The file transport: versions published as safetensors files in a directory, for Refit
//! receivers and for any program with a safetensors reader.
//!
//! The directory holds, for a scheme whose models are `policy` and `critic`:
//!
//! - `policy.v7.safetensors`, `critic.v7.safetensors`: one file per model and version, each
//!   written under a hidden temporary name, fsynced and renamed into place (the runtime's
//!   [`WeightSet::write_safetensors`]), so a named version is always whole. The header's
//!   `__metadata__` carries the model id, the version and the xxh3 of every tensor
//!   (`refit.xxh3`); readers that do not know these keys ignore them.
//! - `CURRENT`: the pointer (JSON, replaced atomically) naming the newest version of every
//!   model. Models published together are named together by one rename, so a receiver
//!   that follows the pointer never mixes versions of one update.
//! - `policy.safetensors`: a symlink to the newest file of each model, for readers that just
//!   want "the newest weights" (`safetensors.safe_open("dir/policy.safetensors")`).
//! - `scheme.refit`: the manifests (written once at connect); `receiver-*.json`: one record
//!   per Refit receiver with its process id and the versions it applied (its acknowledgements).
//!
//! Receivers poll the pointer. A Refit receiver opens a version file, takes a shared
//! `flock` on it, maps it (read-only) and checks every tensor against its checksum; a
//! corrupted or truncated file is refused, naming it, and the previous version stays served.
//! The sender writes the tensors in arena order, back to back after a header padded to
//! [`ALIGN`](refit_runtime::ALIGN), whenever no padding separates them in the arena (tensor
//! sizes that are multiples of 64 bytes, the last one excepted): the receiver then serves
//! the version from the map itself, with no copy, and the map, the file and its lock live as
//! long as anyone holds the weight set. Other files (written by other tools, or with padded
//! tensors, in safetensors' own order) are copied into an arena. A
//! [`FileVersion`] keeps a version mapped and locked for as long as it lives: the sender's
//! collector only removes old files it can lock exclusively, so versions still mapped by a
//! Refit reader stay on disk. The sender keeps the newest [`FileConfig::keep`] versions of
//! every model for readers that do not lock (on Linux, their open mappings would survive the
//! removal anyway).
//!
//! A sender that shuts down marks the pointer so; one that dies is found by its process
//! identity (pid and start time, so a reused pid is not mistaken for it) when it ran on this
//! host and in this pid namespace; elsewhere only the shutdown mark tells. A sender that crashes mid-write leaves only a hidden
//! temporary file, never a named version; the next sender in the directory removes it.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit_runtime::metrics::{self, Phase};
use refit_runtime::wait::{Wait, backoff, poll_until, wait_until};
use refit_runtime::{
    Error, Group, Manifest, Manifests, ModelId, ReceiverTransport, Result, SafetensorsFilePlan,
    SafetensorsLayout, SenderTransport, Version, WeightSet, inspect_safetensors, temp_sibling,
    wire, write_atomically,
};
use serde::{Deserialize, Serialize};

use crate::shm::lease::{self, Identity, Known};

const NAME: &str = "file";
/// The pointer file naming the newest version of every model.
pub const POINTER: &str = "CURRENT";
const SCHEME: &str = "scheme.refit";
const WRITER_LOCK: &str = ".writer.lock";
const RECEIVER_PREFIX: &str = "receiver-";
const EXT: &str = ".safetensors";
/// How often a waiting receiver looks at the sender's pid.
const LIVENESS_EVERY: Duration = Duration::from_millis(100);
/// Longest pause between two looks at the pointer (polls start at 1 ms and double).
const MAX_POLL: Duration = Duration::from_millis(16);

fn file_err(message: impl Into<String>) -> Error {
    Error::transport(NAME, message)
}

fn io_err(context: &'static str, path: &Path, source: std::io::Error) -> Error {
    Error::Path {
        context,
        path: path.to_path_buf(),
        source,
    }
}

/// Where and how versions are published.
#[derive(Debug, Clone)]
pub struct FileConfig {
    /// The directory (created if missing). One sender per directory at a time.
    pub dir: PathBuf,
    /// Versions of each model kept on disk, newest first, even when no Refit reader holds
    /// them (default 2, at least 1): readers that do not lock get that much slack.
    pub keep: usize,
    /// Receivers `connect` waits for before returning (default 0: whoever attaches).
    pub expected_receivers: usize,
}

impl FileConfig {
    /// A configuration for `dir` with the defaults.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            keep: 2,
            expected_receivers: 0,
        }
    }
}

/// What a receiver needs to attach: serialisable, shipped to another process (see
/// [`refit_runtime::wire::to_token`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileReceiverSpec {
    /// The directory the sender publishes into.
    pub dir: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum State {
    Live,
    Shutdown,
}

/// One model's entry in the pointer.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    model: ModelId,
    version: u64,
    file: String,
}

/// The pointer file (`CURRENT`), JSON so that scripts can read it too.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Pointer {
    scheme: String,
    seq: u64,
    state: State,
    sender_pid: u32,
    /// The sender's start time and pid namespace (0 when unknown): a reused pid or
    /// another container's pid is not taken for the sender.
    #[serde(default)]
    sender_start: u64,
    #[serde(default)]
    sender_ns: u64,
    host: String,
    models: Vec<Entry>,
}

impl Pointer {
    fn sender(&self) -> Identity {
        Identity {
            pid: self.sender_pid,
            start: self.sender_start,
            ns: self.sender_ns,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SchemeModel {
    id: ModelId,
    stem: String,
    manifest: Manifest,
}

/// `scheme.refit`: the manifests, written once at connect.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SchemeFile {
    scheme: String,
    models: Vec<SchemeModel>,
}

/// A receiver's record (`receiver-ID.json`): who it is and what it applied.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    scheme: String,
    pid: u32,
    /// The receiver's start time and pid namespace (0 when unknown), as the pointer's.
    #[serde(default)]
    start: u64,
    #[serde(default)]
    ns: u64,
    host: String,
    acked: Vec<(ModelId, u64)>,
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// True unless the process `pid` is known not to exist on this host.
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 sends nothing; it only asks whether the pid exists. No
    // memory is touched.
    let r = unsafe { libc::kill(pid, 0) };
    !(r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH))
}

/// Whether process `who` of `host` may still run: a process on another host, in another
/// pid namespace, or of unknown start time cannot be checked and counts as alive; on this
/// host and namespace a reused pid is told apart by its start time.
fn alive_on(who: Identity, host: &str, here: &str) -> bool {
    host != here || !matches!(lease::exited(who), Known::Exited(_))
}

/// Takes `op` (`LOCK_SH`/`LOCK_EX`, non-blocking) on `file`; false when someone holds a
/// conflicting lock.
fn try_flock(file: &File, op: libc::c_int, path: &Path) -> Result<bool> {
    // SAFETY: flock only reads the descriptor number, which `file` keeps open for the call.
    let r = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(io_err("locking", path, e))
    }
}

/// A file-name stem for a model id: `[A-Za-z0-9._-]` kept, anything else `_`, no leading dot.
fn stem_of(id: &ModelId) -> String {
    let mut s: String = id
        .as_str()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.starts_with('.') {
        s.replace_range(..1, "_");
    }
    s
}

fn version_file(stem: &str, version: Version) -> String {
    format!("{stem}.v{}{EXT}", version.get())
}

/// The version of `name` if it is a version file of `stem`.
fn parse_version_file(stem: &str, name: &str) -> Option<u64> {
    let digits = name
        .strip_prefix(stem)?
        .strip_prefix(".v")?
        .strip_suffix(EXT)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The writer pid of a hidden temporary file (`.NAME.tmp-PID-UUID`).
fn temp_owner(name: &str) -> Option<u32> {
    if !name.starts_with('.') {
        return None;
    }
    let rest = &name[name.rfind(".tmp-")? + 5..];
    rest.split('-').next()?.parse().ok()
}

fn read_pointer(dir: &Path) -> Result<Option<Pointer>> {
    let path = dir.join(POINTER);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| file_err(format!("pointer `{}` is malformed: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err("reading", &path, e)),
    }
}

fn read_scheme(dir: &Path) -> Result<Option<SchemeFile>> {
    let path = dir.join(SCHEME);
    match std::fs::read(&path) {
        Ok(bytes) => wire::decode(&bytes, wire::MAX_CONTROL_MESSAGE).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err("reading", &path, e)),
    }
}

fn list_dir(dir: &Path) -> Result<Vec<String>> {
    let rd = std::fs::read_dir(dir).map_err(|e| io_err("listing", dir, e))?;
    Ok(rd
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect())
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err("syncing directory", dir, e))
}

/// Writes `header` then `data` to `path` atomically (temporary sibling, fsync, rename).
fn write_in_place(path: &Path, header: &[u8], data: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = temp_sibling(path);
    let result = (|| {
        let mut f = File::options()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| io_err("creating", &tmp, e))?;
        f.write_all(header)
            .and_then(|()| f.write_all(data))
            .map_err(|e| io_err("writing", &tmp, e))?;
        f.sync_all().map_err(|e| io_err("syncing", &tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_err("renaming into place", path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// One version file, mapped and held: while this value lives the file keeps a shared lock,
/// so the sender's collector leaves it on disk, and its bytes are checked once at open.
pub struct FileVersion {
    path: PathBuf,
    _file: File,
    map: memmap2::Mmap,
    layout: SafetensorsLayout,
}

impl std::fmt::Debug for FileVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileVersion")
            .field("path", &self.path)
            .field("model", &self.layout.model)
            .field("version", &self.layout.version)
            .finish()
    }
}

impl FileVersion {
    /// Opens, locks (shared), maps and verifies a version file written by a file sender:
    /// every tensor must match the xxh3 in its header. Waits up to `timeout` for a writer's
    /// exclusive lock (held only while the collector removes a file) to go.
    ///
    /// # Errors
    /// [`Error::Path`] if the file cannot be opened (`NotFound` once collected) or mapped;
    /// [`Error::Safetensors`] naming the file for a truncated or corrupted one (and the
    /// tensor, for a checksum mismatch); [`Error::Timeout`] if the lock does not come.
    pub fn open(path: impl AsRef<Path>, timeout: Duration) -> Result<Self> {
        let path = path.as_ref();
        let deadline = refit_runtime::scheme::deadline_in(timeout);
        let file = File::open(path).map_err(|e| io_err("opening", path, e))?;
        wait_until(
            deadline,
            (),
            |()| {
                Ok(if try_flock(&file, libc::LOCK_SH, path)? {
                    Wait::Done(())
                } else {
                    Wait::Pending(())
                })
            },
            |(), left| std::thread::sleep(left.min(Duration::from_millis(1))),
            |()| format!("a shared lock on `{}`", path.display()),
        )?;
        // The collector may have removed the file between our open and our lock: then the
        // name no longer leads to our inode and holding it would keep nothing on disk.
        let same = match (file.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => {
                use std::os::unix::fs::MetadataExt;
                a.ino() == b.ino() && a.dev() == b.dev()
            }
            _ => false,
        };
        if !same {
            return Err(io_err(
                "opening",
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "removed while opening"),
            ));
        }
        if file.metadata().map(|m| m.len()).unwrap_or(0) == 0 {
            return Err(Error::Safetensors {
                source_name: path.display().to_string(),
                reason: "file is empty".into(),
            });
        }
        // SAFETY: the map is read-only. File senders never write a version file in place
        // (they write a temporary name and rename it), and our shared lock keeps their
        // collector from removing it; a foreign process truncating the file could still
        // fault a read, the documented contract of mapped files.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err("mapping", path, e))?;
        let layout = inspect_safetensors(&map, &path.display().to_string(), None, true)?;
        Ok(Self {
            path: path.to_path_buf(),
            _file: file,
            map,
            layout,
        })
    }

    /// Opens the newest version of `model` that the pointer in `dir` names.
    ///
    /// # Errors
    /// [`Error::Transport`] when the directory has no pointer or the pointer does not name
    /// the model; as [`FileVersion::open`].
    pub fn open_newest(dir: impl AsRef<Path>, model: &ModelId, timeout: Duration) -> Result<Self> {
        let dir = dir.as_ref();
        let deadline = refit_runtime::scheme::deadline_in(timeout);
        loop {
            let pointer = read_pointer(dir)?
                .ok_or_else(|| file_err(format!("no {POINTER} in `{}`", dir.display())))?;
            let entry = pointer
                .models
                .iter()
                .find(|e| &e.model == model)
                .ok_or_else(|| Error::UnknownModel(model.clone()))?;
            let left = deadline.saturating_duration_since(Instant::now());
            match Self::open(dir.join(&entry.file), left) {
                // collected between reading the pointer and opening: a newer one is named
                Err(Error::Path { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound
                        && Instant::now() < deadline => {}
                other => return other,
            }
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model, from the header.
    pub fn model(&self) -> &ModelId {
        &self.layout.model
    }

    /// The version, from the header.
    pub fn version(&self) -> Version {
        self.layout.version
    }

    /// The manifest, from the header.
    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.layout.manifest
    }

    /// The mapped bytes of one tensor (no copy).
    pub fn tensor(&self, name: &str) -> Option<&[u8]> {
        self.layout.tensor_bytes(&self.map, name)
    }

    /// Copies the version into a weight set of its own.
    ///
    /// # Errors
    /// Only if the layout and the map disagree (they come from the same file).
    pub fn to_weights(&self) -> Result<WeightSet> {
        WeightSet::from_safetensors_layout(&self.map, &self.layout)
    }

    /// Where the arena starts in the file when the file holds it as it stands: every tensor
    /// at the arena's offset from one [`ALIGN`](refit_runtime::ALIGN)-aligned start (as a
    /// file sender writes versions whose tensors no padding separates). The arena may run
    /// past the file's end by its trailing padding (less than `ALIGN` bytes).
    fn arena_start(&self) -> Option<usize> {
        let m = &self.layout.manifest;
        let first = m.tensors().iter().min_by_key(|t| t.offset)?;
        let start = self
            .layout
            .ranges
            .get(m.position(&first.name)?)?
            .start
            .checked_sub(first.offset)?;
        let placed = m
            .tensors()
            .iter()
            .zip(&self.layout.ranges)
            .all(|(t, r)| r.start == start + t.offset && r.len() == t.len);
        (placed && start.is_multiple_of(refit_runtime::ALIGN)).then_some(start)
    }

    /// The version as a weight set. When the file holds the arena as it stands, the weight
    /// set is served from the map itself (read-only, no copy), and keeps the map, the file
    /// and its shared lock for as long as it (or any clone of it) lives; otherwise the bytes
    /// are copied into an arena of its own ([`FileVersion::to_weights`]). Either way the
    /// checksums were checked when the file was opened.
    ///
    /// # Errors
    /// [`Error::Path`] if the longer map (covering the arena's trailing padding) cannot be
    /// made; as [`FileVersion::to_weights`].
    pub fn into_weights(self) -> Result<WeightSet> {
        /// The bytes past the end of a file's last page cannot be mapped.
        const PAGE: usize = 4096;
        let Some(start) = self.arena_start() else {
            return self.to_weights();
        };
        let total = self.layout.manifest.total_len();
        let end = start + total;
        let file_len = self.map.len();
        if end > file_len.next_multiple_of(PAGE) {
            // the trailing padding would lie on a page past the file's end
            return self.to_weights();
        }
        let (model, version, manifest) = (
            self.layout.model.clone(),
            self.layout.version,
            Arc::clone(&self.layout.manifest),
        );
        let map = if end > file_len {
            // SAFETY: as in `open` (read-only, the file renamed into place whole and locked
            // shared against the collector). The map runs past the end of the file only
            // inside its last page, which the kernel fills with zeros there: the arena's
            // trailing padding reads as the zeros an arena holds.
            unsafe { memmap2::MmapOptions::new().len(end).map(&self._file) }
                .map_err(|e| io_err("mapping", &self.path, e))?
        } else {
            self.map
        };
        let mapped = MappedVersion {
            _file: self._file,
            map,
            start,
            len: total,
        };
        WeightSet::from_shared(model, version, manifest, Arc::new(mapped))
    }
}

/// A version served from its file's map: the arena is the map's bytes from `start`.
#[derive(Debug)]
struct MappedVersion {
    /// Holds the shared lock (the collector leaves the file on disk).
    _file: File,
    map: memmap2::Mmap,
    start: usize,
    len: usize,
}

impl refit_runtime::SharedBytes for MappedVersion {
    fn bytes(&self) -> &[u8] {
        self.map
            .get(self.start..self.start + self.len)
            .unwrap_or_default()
    }
}

/// The sending end: owns the directory while it lives.
#[derive(Debug)]
pub struct FileSender {
    dir: PathBuf,
    keep: usize,
    expected_receivers: usize,
    scheme: String,
    host: String,
    seq: u64,
    stems: BTreeMap<ModelId, String>,
    current: BTreeMap<ModelId, Entry>,
    published: BTreeMap<ModelId, VecDeque<String>>,
    _writer_lock: File,
    closed: bool,
}

impl FileSender {
    /// Takes the directory for a new scheme (local only: nobody is contacted). A previous
    /// sender's pointer is removed (its receivers learn it is gone), and temporary files
    /// left by crashed writers are deleted.
    ///
    /// # Errors
    /// [`Error::Config`] for `keep == 0`; [`Error::Transport`] if another live sender holds
    /// the directory; [`Error::Path`] if it cannot be created.
    pub fn create(config: &FileConfig) -> Result<Self> {
        if config.keep == 0 {
            return Err(Error::Config(
                "file transport: keep must be at least 1".into(),
            ));
        }
        let dir = &config.dir;
        std::fs::create_dir_all(dir).map_err(|e| io_err("creating", dir, e))?;
        let lock_path = dir.join(WRITER_LOCK);
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io_err("opening", &lock_path, e))?;
        if !try_flock(&lock, libc::LOCK_EX, &lock_path)? {
            return Err(file_err(format!(
                "another sender publishes into `{}` (its {WRITER_LOCK} is locked)",
                dir.display()
            )));
        }
        for name in [POINTER, SCHEME] {
            match std::fs::remove_file(dir.join(name)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("removing", &dir.join(name), e)),
            }
        }
        let host = host_name();
        for name in list_dir(dir)? {
            if let Some(pid) = temp_owner(&name)
                && !alive(pid)
            {
                tracing::info!(file = %name, pid, "removing a dead writer's temporary file");
                let _ = std::fs::remove_file(dir.join(&name));
            }
        }
        Ok(Self {
            dir: dir.clone(),
            keep: config.keep,
            expected_receivers: config.expected_receivers,
            scheme: uuid::Uuid::new_v4().simple().to_string(),
            host,
            seq: 0,
            stems: BTreeMap::new(),
            current: BTreeMap::new(),
            published: BTreeMap::new(),
            _writer_lock: lock,
            closed: false,
        })
    }

    /// The description a receiver (in any process that sees the directory) attaches with.
    pub fn receiver_spec(&self) -> FileReceiverSpec {
        FileReceiverSpec {
            dir: self.dir.clone(),
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file `version` of `model` is (or would be) published as.
    pub fn version_path(&self, model: &ModelId, version: Version) -> PathBuf {
        self.dir.join(version_file(&stem_of(model), version))
    }

    /// The symlink that names the newest file of `model` (`DIR/MODEL.safetensors`).
    pub fn newest_path(&self, model: &ModelId) -> PathBuf {
        self.dir.join(format!("{}{EXT}", stem_of(model)))
    }

    /// Number of receivers of this scheme whose record is present (dead ones are removed).
    ///
    /// # Errors
    /// If the directory cannot be listed.
    pub fn attached(&self) -> Result<usize> {
        Ok(self.records()?.len())
    }

    /// Live receivers' records (record path, record); records of dead receivers are removed.
    fn records(&self) -> Result<Vec<(PathBuf, Record)>> {
        let mut out = Vec::new();
        for name in list_dir(&self.dir)? {
            if !(name.starts_with(RECEIVER_PREFIX) && name.ends_with(".json")) {
                continue;
            }
            let path = self.dir.join(&name);
            let Ok(bytes) = std::fs::read(&path) else {
                continue; // removed by its receiver meanwhile
            };
            let rec: Record = match serde_json::from_slice(&bytes) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(file = %path.display(), "ignoring a malformed receiver record: {e}");
                    continue;
                }
            };
            let who = Identity {
                pid: rec.pid,
                start: rec.start,
                ns: rec.ns,
            };
            if !alive_on(who, &rec.host, &self.host) {
                tracing::warn!(pid = rec.pid, "file receiver died; removing its record");
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if rec.scheme == self.scheme {
                out.push((path, rec));
            }
        }
        Ok(out)
    }

    fn write_pointer(&self, state: State) -> Result<()> {
        let me = Identity::current();
        let pointer = Pointer {
            scheme: self.scheme.clone(),
            seq: self.seq,
            state,
            sender_pid: me.pid,
            sender_start: me.start,
            sender_ns: me.ns,
            host: self.host.clone(),
            models: self.current.values().cloned().collect(),
        };
        let bytes = serde_json::to_vec_pretty(&pointer)
            .map_err(|e| file_err(format!("encoding the pointer: {e}")))?;
        write_atomically(&self.dir.join(POINTER), &bytes)
    }

    /// Points `MODEL.safetensors` at `file` (a new symlink renamed over the old one).
    fn link_newest(&self, model: &ModelId, file: &str) -> Result<()> {
        let link = self.newest_path(model);
        let tmp = temp_sibling(&link);
        std::os::unix::fs::symlink(file, &tmp).map_err(|e| io_err("linking", &tmp, e))?;
        std::fs::rename(&tmp, &link).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io_err("renaming", &link, e)
        })
    }

    /// Removes old version files that no reader holds, keeping the newest `keep` per model.
    fn collect(&mut self) -> Result<()> {
        let names = list_dir(&self.dir)?;
        for (model, stem) in &self.stems {
            let kept = self.published.entry(model.clone()).or_default();
            while kept.len() > self.keep {
                kept.pop_front();
            }
            for name in &names {
                if parse_version_file(stem, name).is_none() || kept.contains(name) {
                    continue;
                }
                let path = self.dir.join(name);
                let Ok(f) = File::open(&path) else { continue };
                if try_flock(&f, libc::LOCK_EX, &path)? {
                    // nobody maps it: remove it while we hold the lock, so no reader can
                    // lock it between our check and the unlink
                    match std::fs::remove_file(&path) {
                        Ok(()) => tracing::debug!(file = %name, "collected"),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(io_err("removing", &path, e)),
                    }
                }
            }
        }
        Ok(())
    }

    fn write_version(&self, w: &WeightSet) -> Result<String> {
        let stem = self
            .stems
            .get(w.model())
            .ok_or_else(|| Error::UnknownModel(w.model().clone()))?;
        let name = version_file(stem, w.version());
        let path = self.dir.join(&name);
        let plan = SafetensorsFilePlan::of_weights(w)?;
        match w.bytes().get(..plan.data_len) {
            // the arena as it stands after the header: receivers serve it from their map
            Some(data) if plan.in_place() => write_in_place(&path, &plan.header, data)?,
            _ => w.write_safetensors(&path)?,
        }
        Ok(name)
    }

    /// Test hook (feature `test-util`): writes the first half of `weights`' file under its
    /// temporary name, as [`WeightSet::write_safetensors`] does, and aborts the process, as a
    /// crash in the middle of a publish would. Used by the crash tests; never call it
    /// otherwise.
    #[cfg(feature = "test-util")]
    pub fn crash_mid_write(&mut self, weights: &WeightSet) -> ! {
        if let Ok(bytes) = weights.to_safetensors_bytes() {
            let tmp = temp_sibling(&self.version_path(weights.model(), weights.version()));
            if let Ok(mut f) = File::create(&tmp) {
                use std::io::Write;
                let _ = f.write_all(&bytes[..bytes.len() / 2]);
                let _ = f.sync_all();
            }
        }
        std::process::abort()
    }
}

impl SenderTransport for FileSender {
    fn name(&self) -> &'static str {
        NAME
    }

    fn connect(&mut self, initial: &Group, deadline: Instant) -> Result<()> {
        let mut models = Vec::with_capacity(initial.len());
        let mut by_stem: BTreeMap<String, ModelId> = BTreeMap::new();
        for w in initial {
            let stem = stem_of(w.model());
            if let Some(other) = by_stem.insert(stem.clone(), w.model().clone()) {
                return Err(Error::Config(format!(
                    "file transport: models `{other}` and `{}` would share the file name `{stem}`",
                    w.model()
                )));
            }
            self.stems.insert(w.model().clone(), stem.clone());
            models.push(SchemeModel {
                id: w.model().clone(),
                stem,
                manifest: (**w.manifest()).clone(),
            });
        }
        let scheme = SchemeFile {
            scheme: self.scheme.clone(),
            models,
        };
        write_atomically(&self.dir.join(SCHEME), &wire::encode(&scheme)?)?;
        self.publish(initial, deadline)?;
        wait_until(
            deadline,
            (),
            |()| {
                let n = self.attached()?;
                Ok(if n >= self.expected_receivers {
                    Wait::Done(())
                } else {
                    Wait::Pending(n)
                })
            },
            |(), left| std::thread::sleep(left.min(Duration::from_millis(2))),
            |n| {
                format!(
                    "{} file receivers to attach to `{}` ({n} did)",
                    self.expected_receivers,
                    self.dir.display()
                )
            },
        )
    }

    fn publish(&mut self, group: &Group, _deadline: Instant) -> Result<()> {
        if self.closed {
            return Err(Error::State("file sender is shut down"));
        }
        let mut written = Vec::with_capacity(group.len());
        for w in group {
            written.push((w.model().clone(), w.version(), self.write_version(w)?));
        }
        // every file is whole on disk: name them all in one step
        for (model, version, file) in &written {
            self.current.insert(
                model.clone(),
                Entry {
                    model: model.clone(),
                    version: version.get(),
                    file: file.clone(),
                },
            );
        }
        self.seq += 1;
        self.write_pointer(State::Live)?;
        // The version is published once the pointer names it: what follows is upkeep, and
        // its failures are logged rather than reported as a failed publish.
        for (model, _, file) in &written {
            if let Err(e) = self.link_newest(model, file) {
                tracing::warn!("file transport: newest-version link not updated: {e}");
            }
            self.published
                .entry(model.clone())
                .or_default()
                .push_back(file.clone());
        }
        if let Err(e) = sync_dir(&self.dir) {
            tracing::warn!("file transport: {e}");
        }
        if let Err(e) = self.collect() {
            tracing::warn!("file transport: old versions not collected: {e}");
        }
        Ok(())
    }

    fn wait_acks(&mut self, entries: &[(ModelId, Version)], deadline: Instant) -> Result<()> {
        wait_until(
            deadline,
            (),
            |()| {
                let missing: Vec<(u32, PathBuf)> = self
                    .records()?
                    .into_iter()
                    .filter(|(_, rec)| {
                        entries.iter().any(|(m, v)| {
                            !rec.acked.iter().any(|(am, av)| am == m && *av >= v.get())
                        })
                    })
                    .map(|(path, rec)| (rec.pid, path))
                    .collect();
                Ok(if missing.is_empty() {
                    Wait::Done(())
                } else {
                    Wait::Pending(missing)
                })
            },
            backoff(MAX_POLL),
            |missing| {
                format!("file receivers (pid, record) {missing:?} to acknowledge {entries:?}")
            },
        )?;
        // receivers that acknowledged a version have let go of the one before (they serve
        // versions from their files' maps, which keeps them locked): collect it now rather
        // than at the next publish
        if let Err(e) = self.collect() {
            tracing::warn!("file transport: old versions not collected: {e}");
        }
        Ok(())
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        if self.seq == 0 {
            return Ok(()); // never connected: nothing published
        }
        // the files stay for readers; the pointer says no more will come
        self.write_pointer(State::Shutdown)
    }
}

impl Drop for FileSender {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// A receiving end.
#[derive(Debug)]
pub struct FileReceiver {
    spec: FileReceiverSpec,
    id: String,
    host: String,
    scheme: Option<SchemeFile>,
    seen: BTreeMap<ModelId, u64>,
    refused: BTreeMap<ModelId, u64>,
    acked: BTreeMap<ModelId, u64>,
    record: Option<PathBuf>,
    lock_timeout: Duration,
}

impl FileReceiver {
    /// A receiver for `spec` (local only: nothing is opened until `connect`).
    pub fn new(spec: FileReceiverSpec) -> Self {
        Self {
            spec,
            id: uuid::Uuid::new_v4().simple().to_string(),
            host: host_name(),
            scheme: None,
            seen: BTreeMap::new(),
            refused: BTreeMap::new(),
            acked: BTreeMap::new(),
            record: None,
            lock_timeout: Duration::from_secs(5),
        }
    }

    fn write_record(&self) -> Result<()> {
        let (Some(path), Some(scheme)) = (&self.record, &self.scheme) else {
            return Err(Error::State("file receiver is not connected"));
        };
        let me = Identity::current();
        let rec = Record {
            scheme: scheme.scheme.clone(),
            pid: me.pid,
            start: me.start,
            ns: me.ns,
            host: self.host.clone(),
            acked: self.acked.iter().map(|(m, v)| (m.clone(), *v)).collect(),
        };
        let bytes = serde_json::to_vec(&rec)
            .map_err(|e| file_err(format!("encoding the receiver record: {e}")))?;
        write_atomically(path, &bytes)
    }

    fn gone(pointer: &Pointer, reason: &str) -> Error {
        Error::PeerGone {
            peer: format!(
                "file sender (pid {} on {:?})",
                pointer.sender_pid, pointer.host
            ),
            reason: reason.into(),
        }
    }

    /// Reads every fresh file the pointer names, or none; `Ok(None)` when one was collected
    /// meanwhile (read the pointer again).
    /// Refuses every model of an update one of whose files is bad: the others are not
    /// offered alone later, so a receiver never serves half of an update.
    fn refuse_whole(&mut self, fresh: &[Entry]) {
        for e in fresh {
            self.refused.insert(e.model.clone(), e.version);
        }
    }

    fn read_fresh(&mut self, fresh: &[Entry]) -> Result<Option<Group>> {
        let mut group = Vec::with_capacity(fresh.len());
        for e in fresh {
            let path = self.spec.dir.join(&e.file);
            let verify = metrics::timed(Phase::Verify, NAME, e.model.as_str());
            let v = match FileVersion::open(&path, self.lock_timeout) {
                Ok(v) => {
                    verify.finish();
                    v
                }
                Err(Error::Path { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    return Ok(None);
                }
                Err(err) => {
                    if matches!(err, Error::Safetensors { .. }) {
                        self.refuse_whole(fresh);
                    }
                    return Err(err);
                }
            };
            if v.model() != &e.model || v.version().get() != e.version {
                self.refuse_whole(fresh);
                return Err(Error::Safetensors {
                    source_name: path.display().to_string(),
                    reason: format!(
                        "holds model `{}` version {}, the pointer names `{}` version {}",
                        v.model(),
                        v.version(),
                        e.model,
                        e.version
                    ),
                });
            }
            let wire = metrics::timed(Phase::Wire, NAME, e.model.as_str());
            group.push(Arc::new(v.into_weights()?));
            wire.finish();
        }
        Ok(Some(group))
    }
}

impl ReceiverTransport for FileReceiver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn connect(&mut self, deadline: Instant) -> Result<Manifests> {
        let dir = self.spec.dir.clone();
        let scheme = wait_until(
            deadline,
            (),
            |()| {
                if let (Some(scheme), Some(pointer)) = (read_scheme(&dir)?, read_pointer(&dir)?)
                    && scheme.scheme == pointer.scheme
                {
                    return Ok(Wait::Done(scheme));
                }
                Ok(Wait::Pending(()))
            },
            |(), left| std::thread::sleep(left.min(Duration::from_millis(2))),
            |()| format!("a file sender publishing into `{}`", dir.display()),
        )?;
        let manifests = Manifests::new(
            scheme
                .models
                .iter()
                .map(|m| (m.id.clone(), Arc::new(m.manifest.clone()))),
        )?;
        self.record = Some(dir.join(format!("{RECEIVER_PREFIX}{}.json", self.id)));
        self.scheme = Some(scheme);
        self.write_record()?;
        Ok(manifests)
    }

    fn next_group(&mut self, deadline: Instant) -> Result<Option<Group>> {
        let scheme_id = self
            .scheme
            .as_ref()
            .map(|s| s.scheme.clone())
            .ok_or(Error::State("file receiver is not connected"))?;
        let mut last_check = Instant::now();
        poll_until(
            deadline,
            (),
            |()| {
                let pointer = read_pointer(&self.spec.dir)?.ok_or_else(|| Error::PeerGone {
                    peer: "file sender".into(),
                    reason: format!("{POINTER} was removed from `{}`", self.spec.dir.display()),
                })?;
                if pointer.scheme != scheme_id {
                    return Err(Self::gone(
                        &pointer,
                        "another sender took the directory over",
                    ));
                }
                let fresh: Vec<Entry> = pointer
                    .models
                    .iter()
                    .filter(|e| {
                        self.seen.get(&e.model).is_none_or(|v| e.version > *v)
                            && self.refused.get(&e.model) != Some(&e.version)
                    })
                    .cloned()
                    .collect();
                // a file the pointer names may be gone (`None`): collected under us (the
                // pointer names a newer one by the next look) or removed for good; either way
                // the deadline below still holds
                if !fresh.is_empty()
                    && let Some(group) = self.read_fresh(&fresh)?
                {
                    for e in &fresh {
                        self.seen.insert(e.model.clone(), e.version);
                    }
                    return Ok(Wait::Done(group));
                }
                if pointer.state == State::Shutdown {
                    return Err(Self::gone(&pointer, "shut down"));
                }
                let now = Instant::now();
                if now < deadline && now.duration_since(last_check) >= LIVENESS_EVERY {
                    last_check = now;
                    if !alive_on(pointer.sender(), &pointer.host, &self.host) {
                        return Err(Self::gone(&pointer, "process exited"));
                    }
                }
                Ok(Wait::Pending(()))
            },
            backoff(MAX_POLL),
        )
    }

    fn ack(&mut self, applied: &[(ModelId, Version)]) -> Result<()> {
        for (m, v) in applied {
            self.acked.insert(m.clone(), v.get());
        }
        self.write_record()
    }

    fn shutdown(&mut self) -> Result<()> {
        if let Some(path) = self.record.take() {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("removing", &path, e)),
            }
        }
        Ok(())
    }
}

impl Drop for FileReceiver {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        let id = ModelId::new("env.transform[0]/module").unwrap();
        let stem = stem_of(&id);
        assert_eq!(stem, "env.transform_0__module");
        assert_eq!(stem_of(&ModelId::new(".hidden").unwrap()), "_hidden");
        let f = version_file(&stem, Version(12));
        assert_eq!(parse_version_file(&stem, &f), Some(12));
        assert_eq!(parse_version_file("a", "a.v1.v3.safetensors"), None);
        assert_eq!(parse_version_file("a", "a.safetensors"), None);
        let tmp = temp_sibling(Path::new("/d/policy.v3.safetensors"));
        let name = tmp.file_name().unwrap().to_str().unwrap();
        assert_eq!(temp_owner(name), Some(std::process::id()));
        assert_eq!(temp_owner("policy.v3.safetensors"), None);
    }

    #[test]
    fn liveness_and_locks() {
        assert!(alive(std::process::id()));
        assert!(!alive(0));
        let me = Identity::current();
        assert!(alive_on(me, "here", "here"));
        let nobody = Identity { pid: 0, ..me };
        assert!(alive_on(nobody, "elsewhere", "here"));
        // a live pid with another start time is a process that reused a dead one's pid
        let reused = Identity {
            start: me.start + 1,
            ..me
        };
        assert!(!alive_on(reused, "here", "here"));
        // another pid namespace cannot be checked from here: alive
        let elsewhere = Identity {
            ns: me.ns + 1,
            ..reused
        };
        assert!(alive_on(elsewhere, "here", "here"));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x");
        std::fs::write(&p, b"x").unwrap();
        let a = File::open(&p).unwrap();
        let b = File::open(&p).unwrap();
        assert!(try_flock(&a, libc::LOCK_SH, &p).unwrap());
        assert!(!try_flock(&b, libc::LOCK_EX, &p).unwrap());
        drop(a);
        assert!(try_flock(&b, libc::LOCK_EX, &p).unwrap());
    }
}

/// The file transport in the link factory: the spec is the directory
/// ([`FileReceiverSpec`]); without [`LinkOptions::dir`](crate::link::LinkOptions::dir) the
/// sender writes into a new directory of the system's temporary folder, removed when the
/// sender end drops (and listed in the link's leftovers).
#[derive(Debug, Clone, Copy)]
pub struct FileLink;

impl crate::link::LinkFactory for FileLink {
    fn traits(&self) -> &'static crate::link::LinkTraits {
        &crate::link::LinkTraits {
            name: NAME,
            about: "a directory of safetensors files, one per version, readable by any safetensors reader",
            reach: crate::link::Reach::Host,
            receivers_copy: true,
            memory: crate::link::LinkMemory::Host,
        }
    }
    fn sender_end(
        &self,
        _: &Manifests,
        options: &crate::link::LinkOptions,
    ) -> Result<crate::link::OpenedLink> {
        let (dir, leftovers) = match &options.dir {
            Some(d) => (d.clone(), Vec::new()),
            None => {
                let d = std::env::temp_dir().join(format!("refit-link-{}", uuid::Uuid::new_v4()));
                (d.clone(), vec![d])
            }
        };
        let sender = FileSender::create(&FileConfig {
            expected_receivers: options.expected_receivers,
            ..FileConfig::new(dir)
        })?;
        let spec = sender.receiver_spec();
        let about = format!("directory {}", spec.dir.display());
        Ok(crate::link::OpenedLink {
            spec: crate::link::ReceiverSpec::new(self, &spec, about)?,
            sender: Box::new(crate::link::RemoveOnDrop::new(sender, leftovers.clone())),
            leftovers,
        })
    }
    fn receiver_end(
        &self,
        spec: &crate::link::ReceiverSpec,
        _: &crate::link::LinkOptions,
    ) -> Result<Box<dyn refit_runtime::ReceiverTransport>> {
        let s: FileReceiverSpec = spec.params()?;
        Ok(Box::new(FileReceiver::new(s)))
    }
}
