//! safetensors import and export of weight sets.
//!
//! Files are written to a temporary name beside the target and renamed, so a reader never
//! sees half a file. Reading maps the file and copies each tensor once into a fresh arena.
//! The model id, version and manifest order travel in the header's `__metadata__`, so
//! export then import gives back the same manifest (same schema hash) and the same bytes.
//! So does the xxh3-64 of every tensor (`refit.xxh3`, hex, manifest order): safetensors has
//! no checksum of its own, and readers that do not know the key ignore it. Refit verifies
//! the checksums whenever a file carries them; [`inspect_safetensors`] can require them.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Mismatch, Result};
use crate::ids::{ModelId, Version};
use crate::manifest::Manifest;
use crate::weights::{TensorView, WeightSet};

const KEY_MODEL: &str = "refit.model";
const KEY_VERSION: &str = "refit.version";
const KEY_ORDER: &str = "refit.order";
const KEY_XXH3: &str = "refit.xxh3";

/// What a safetensors buffer holds, checked (see [`inspect_safetensors`]): the model, its
/// version, its manifest, and where each tensor's bytes lie in the buffer.
#[derive(Debug, Clone)]
pub struct SafetensorsLayout {
    /// The model (from the header, or the one given).
    pub model: ModelId,
    /// The version from the header ([`Version::ZERO`] when absent).
    pub version: Version,
    /// The manifest, in the order the header declares (`refit.order`) or the file's.
    pub manifest: Arc<Manifest>,
    /// Byte range of each tensor in the buffer, in manifest order.
    pub ranges: Vec<Range<usize>>,
    /// Whether every tensor's bytes were checked against the header's `refit.xxh3`.
    pub verified: bool,
}

impl SafetensorsLayout {
    /// The bytes of tensor `name` in `bytes` (the buffer this layout was read from).
    pub fn tensor_bytes<'a>(&self, bytes: &'a [u8], name: &str) -> Option<&'a [u8]> {
        let i = self.manifest.position(name)?;
        bytes.get(self.ranges[i].clone())
    }
}

/// Decodes a safetensors header and checks the buffer against it without copying: every
/// tensor lies inside the buffer, dtypes are supported, and, when the header carries
/// `refit.xxh3` (or `require_checksums` is set), every tensor hashes to its declared xxh3.
/// `source_name` (a path) names the buffer in errors.
///
/// # Errors
/// [`Error::Safetensors`] naming `source_name` for a bad or truncated buffer, a missing
/// model id (none in the header and none given), missing checksums when required, or a
/// tensor whose bytes do not match its checksum (naming the tensor).
pub fn inspect_safetensors(
    bytes: &[u8],
    source_name: &str,
    model: Option<&ModelId>,
    require_checksums: bool,
) -> Result<SafetensorsLayout> {
    let source = source_name;
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| refused(source, e))?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| refused(source, e))?;
    let extra = meta.metadata().clone().unwrap_or_default();
    let model = match (extra.get(KEY_MODEL), model) {
        (_, Some(m)) => m.clone(),
        (Some(name), None) => ModelId::new(name).map_err(|e| refused(source, e))?,
        (None, None) => {
            return Err(refused(source, "no model id in the header and none given"));
        }
    };
    let version = match extra.get(KEY_VERSION) {
        Some(v) => Version(
            v.parse()
                .map_err(|_| refused(source, format!("version {v:?} is not a number")))?,
        ),
        None => Version::ZERO,
    };
    let mut order = meta.offset_keys();
    if let Some(json) = extra.get(KEY_ORDER) {
        let declared: Vec<String> = serde_json::from_str(json)
            .map_err(|e| refused(source, format!("bad {KEY_ORDER}: {e}")))?;
        let mut a = declared.clone();
        let mut b = order.clone();
        a.sort();
        b.sort();
        if a != b {
            return Err(refused(
                source,
                format!("{KEY_ORDER} does not list the file's tensors"),
            ));
        }
        order = declared;
    }
    let sums: Option<Vec<String>> = match extra.get(KEY_XXH3) {
        Some(json) => Some(
            serde_json::from_str(json)
                .map_err(|e| refused(source, format!("bad {KEY_XXH3}: {e}")))?,
        ),
        None if require_checksums => {
            return Err(refused(
                source,
                format!("no {KEY_XXH3} checksums in the header"),
            ));
        }
        None => None,
    };
    if let Some(sums) = &sums
        && sums.len() != order.len()
    {
        return Err(refused(
            source,
            format!(
                "{KEY_XXH3} lists {} checksums for {} tensors",
                sums.len(),
                order.len()
            ),
        ));
    }
    let base = bytes.as_ptr() as usize;
    let mut builder = Manifest::builder();
    let mut ranges = Vec::with_capacity(order.len());
    for (i, name) in order.iter().enumerate() {
        let view = st.tensor(name).map_err(|e| refused(source, e))?;
        let dtype = DType::from_safetensors(view.dtype(), name).map_err(|e| match e {
            Error::Safetensors { reason, .. } => refused(source, reason),
            other => other,
        })?;
        builder.push(name.clone(), dtype, view.shape());
        if let Some(sums) = &sums {
            let expected = u64::from_str_radix(&sums[i], 16).map_err(|_| {
                refused(
                    source,
                    format!("tensor `{name}`: checksum {:?} is not hex", sums[i]),
                )
            })?;
            let found = xxhash_rust::xxh3::xxh3_64(view.data());
            if found != expected {
                return Err(refused(
                    source,
                    format!(
                        "tensor `{name}`: {}",
                        Mismatch::Checksum { expected, found }
                    ),
                ));
            }
        }
        let start = view.data().as_ptr() as usize - base;
        ranges.push(start..start + view.data().len());
    }
    let manifest = Arc::new(builder.build()?);
    Ok(SafetensorsLayout {
        model,
        version,
        manifest,
        ranges,
        verified: sums.is_some(),
    })
}

fn refused(source_name: &str, reason: impl std::fmt::Display) -> Error {
    Error::Safetensors {
        source_name: source_name.to_string(),
        reason: reason.to_string(),
    }
}

impl safetensors::View for TensorView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        TensorView::dtype(self).to_safetensors()
    }
    fn shape(&self) -> &[usize] {
        TensorView::shape(self)
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.bytes())
    }
    fn data_len(&self) -> usize {
        self.bytes().len()
    }
}

impl WeightSet {
    /// Encodes this weight set as a safetensors byte buffer.
    ///
    /// # Errors
    /// [`Error::Safetensors`] if the encoder refuses (a header over 100 MB).
    pub fn to_safetensors_bytes(&self) -> Result<Vec<u8>> {
        safetensors::serialize(
            self.tensors().map(|t| (t.name(), t)),
            Some(self.header_metadata()),
        )
        .map_err(|e| refused("<buffer>", e))
    }

    /// Writes this weight set to `path` atomically (temporary file, fsync, rename).
    ///
    /// # Errors
    /// [`Error::Path`] on I/O failure, [`Error::Safetensors`] if encoding fails.
    pub fn write_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let tmp = temp_sibling(path);
        let result = (|| {
            safetensors::serialize_to_file(
                self.tensors().map(|t| (t.name(), t)),
                Some(self.header_metadata()),
                &tmp,
            )
            .map_err(|e| refused(&tmp.display().to_string(), e))?;
            let f = File::open(&tmp).map_err(|source| Error::Path {
                context: "reopening",
                path: tmp.clone(),
                source,
            })?;
            f.sync_all().map_err(|source| Error::Path {
                context: "syncing",
                path: tmp.clone(),
                source,
            })?;
            std::fs::rename(&tmp, path).map_err(|source| Error::Path {
                context: "renaming into place",
                path: path.to_path_buf(),
                source,
            })
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// Reads a safetensors file (memory-mapped) into a new weight set.
    ///
    /// The model id and version come from the header when refit wrote it; otherwise `model`
    /// (required then) and version 0.
    ///
    /// # Errors
    /// [`Error::Path`] if the file cannot be opened or mapped; [`Error::Safetensors`] for a
    /// bad header, truncated data or an unsupported dtype.
    pub fn read_safetensors(path: impl AsRef<Path>, model: Option<&ModelId>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|source| Error::Path {
            context: "opening",
            path: path.to_path_buf(),
            source,
        })?;
        if file.metadata().map(|m| m.len()).unwrap_or(0) == 0 {
            return Err(refused(&path.display().to_string(), "file is empty"));
        }
        // SAFETY: the map is read-only and private to this call; refit writes safetensors by
        // rename, never in place, so the file under the map does not change while we copy
        // out of it. A foreign writer truncating the file could still fault the copy; that is
        // the documented contract of reading mapped files.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| Error::Path {
            context: "mapping",
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse_safetensors(&map, &path.display().to_string(), model)
    }

    /// Decodes a safetensors byte buffer into a new weight set.
    ///
    /// # Errors
    /// As [`WeightSet::read_safetensors`].
    pub fn from_safetensors_bytes(bytes: &[u8], model: Option<&ModelId>) -> Result<Self> {
        Self::parse_safetensors(bytes, "<buffer>", model)
    }

    fn parse_safetensors(bytes: &[u8], source: &str, model: Option<&ModelId>) -> Result<Self> {
        let layout = inspect_safetensors(bytes, source, model, false)?;
        Self::from_safetensors_layout(bytes, &layout)
    }

    /// Copies the tensors of a buffer checked by [`inspect_safetensors`] into a new weight
    /// set (the layout's model, version and manifest).
    ///
    /// # Errors
    /// [`Error::Safetensors`] if `bytes` is not the buffer the layout was read from (a range
    /// falls outside it).
    pub fn from_safetensors_layout(bytes: &[u8], layout: &SafetensorsLayout) -> Result<Self> {
        let mut ws = WeightSet::zeroed(layout.model.clone(), Arc::clone(&layout.manifest));
        ws.set_version(layout.version);
        for (spec, range) in layout.manifest.tensors().iter().zip(&layout.ranges) {
            let src = bytes.get(range.clone()).ok_or_else(|| {
                refused(
                    "<buffer>",
                    format!("tensor `{}` lies outside the buffer", spec.name),
                )
            })?;
            ws.tensor_bytes_mut(&spec.name)?.copy_from_slice(src);
        }
        Ok(ws)
    }

    fn header_metadata(&self) -> HashMap<String, String> {
        let order: Vec<&str> = self
            .manifest()
            .tensors()
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        let sums: Vec<String> = self
            .tensor_checksums()
            .iter()
            .map(|s| format!("{s:016x}"))
            .collect();
        HashMap::from([
            (
                KEY_XXH3.to_string(),
                serde_json::to_string(&sums).unwrap_or_else(|_| "[]".into()),
            ),
            (KEY_MODEL.to_string(), self.model().to_string()),
            (KEY_VERSION.to_string(), self.version().to_string()),
            (
                KEY_ORDER.to_string(),
                serde_json::to_string(&order).unwrap_or_else(|_| "[]".into()),
            ),
        ])
    }
}

/// How a weight set's arena becomes a safetensors file when it is received straight into the
/// file (a writable map of it) rather than copied there afterwards: the file's first bytes,
/// then the arena; tensors the arena pads apart are moved together in place once it is whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsFilePlan {
    /// The file's first bytes: the header's length (8 bytes, little-endian) and the JSON
    /// header, padded with spaces so the data starts at a multiple of
    /// [`ALIGN`](crate::ALIGN).
    pub header: Vec<u8>,
    /// Each tensor's range in the arena and where its bytes start in the file's data, in
    /// arena order. Every move goes toward the front (or nowhere).
    pub moves: Vec<(std::ops::Range<usize>, usize)>,
    /// Bytes of tensor data in the file (the arena without its padding).
    pub data_len: usize,
}

impl SafetensorsFilePlan {
    /// The layout of `model` at `version` cut by `manifest`; the header names the model,
    /// the version and the manifest order, as [`WeightSet::write_safetensors`] does.
    ///
    /// # Errors
    /// [`Error::Safetensors`] when the header cannot be encoded.
    pub fn of(model: &ModelId, version: Version, manifest: &Manifest) -> Result<Self> {
        Self::with_checksums(model, version, manifest, None)
    }

    /// The layout of `weights`' own file, whose header also carries the xxh3 of every
    /// tensor (as [`WeightSet::write_safetensors`] writes it), so a reader can check the
    /// bytes ([`inspect_safetensors`]). When [`in_place`](Self::in_place), the header
    /// followed by the arena's first [`data_len`](Self::data_len) bytes is the whole file.
    ///
    /// # Errors
    /// [`Error::Safetensors`] when the header cannot be encoded.
    pub fn of_weights(weights: &WeightSet) -> Result<Self> {
        let sums = weights.tensor_checksums();
        Self::with_checksums(
            weights.model(),
            weights.version(),
            weights.manifest(),
            Some(&sums),
        )
    }

    fn with_checksums(
        model: &ModelId,
        version: Version,
        manifest: &Manifest,
        sums: Option<&[u64]>,
    ) -> Result<Self> {
        let mut specs: Vec<&crate::TensorSpec> = manifest.tensors().iter().collect();
        specs.sort_by_key(|t| t.offset);
        let mut json = serde_json::Map::new();
        let order: Vec<&str> = manifest.tensors().iter().map(|t| t.name.as_str()).collect();
        let mut meta = HashMap::from([
            (KEY_MODEL, model.to_string()),
            (KEY_VERSION, version.to_string()),
            (
                KEY_ORDER,
                serde_json::to_string(&order).map_err(|e| refused("<header>", e))?,
            ),
        ]);
        if let Some(sums) = sums {
            let hex: Vec<String> = sums.iter().map(|s| format!("{s:016x}")).collect();
            meta.insert(
                KEY_XXH3,
                serde_json::to_string(&hex).map_err(|e| refused("<header>", e))?,
            );
        }
        json.insert(
            "__metadata__".into(),
            serde_json::to_value(meta).map_err(|e| refused("<header>", e))?,
        );
        let mut moves = Vec::with_capacity(specs.len());
        let mut at = 0usize;
        for t in specs {
            let info = serde_json::json!({
                "dtype": t.dtype.to_safetensors(),
                "shape": t.shape,
                "data_offsets": [at, at + t.len],
            });
            json.insert(t.name.clone(), info);
            moves.push((t.range(), at));
            at += t.len;
        }
        let mut text = serde_json::to_vec(&json).map_err(|e| refused("<header>", e))?;
        let pad = (crate::ALIGN - (8 + text.len()) % crate::ALIGN) % crate::ALIGN;
        text.resize(text.len() + pad, b' ');
        let mut header = (text.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(&text);
        Ok(Self {
            header,
            moves,
            data_len: at,
        })
    }

    /// Bytes of the whole file.
    pub fn file_len(&self) -> usize {
        self.header.len() + self.data_len
    }

    /// True when the arena is the file's data as it stands (no padding between tensors):
    /// nothing moves once the bytes are in.
    pub fn in_place(&self) -> bool {
        self.moves.iter().all(|(r, at)| r.start == *at)
    }

    /// Turns `region`, which holds the arena (the bytes after the header), into the file's
    /// data: each tensor after the first gap moves toward the front. Only the tensors behind
    /// padding move; none does when [`in_place`](Self::in_place).
    ///
    /// # Errors
    /// [`Error::State`] when `region` is shorter than the arena.
    pub fn pack(&self, region: &mut [u8]) -> Result<()> {
        if self.moves.iter().any(|(r, _)| r.end > region.len()) {
            return Err(Error::State("the region is shorter than the arena"));
        }
        for (r, at) in &self.moves {
            if r.start != *at {
                region.copy_within(r.clone(), *at);
            }
        }
        Ok(())
    }
}

/// The temporary name [`write_atomically`] and [`WeightSet::write_safetensors`] write to
/// before renaming onto `path`: hidden (`.NAME.tmp-PID-UUID`), beside it, with the writer's
/// process id so a collector can tell a dead writer's leftovers.
pub fn temp_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "weights".into());
    path.with_file_name(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ))
}

/// Writes `bytes` to `path` atomically (temporary sibling, fsync, rename).
///
/// # Errors
/// [`Error::Path`] on I/O failure.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_sibling(path);
    let io = |context, source| Error::Path {
        context,
        path: tmp.clone(),
        source,
    };
    let result = (|| {
        let mut f = File::create(&tmp).map_err(|e| io("creating", e))?;
        f.write_all(bytes).map_err(|e| io("writing", e))?;
        f.sync_all().map_err(|e| io("syncing", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io("renaming", e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WeightSet {
        let m = Manifest::builder()
            .tensor("z.last", DType::F32, &[3, 4])
            .tensor("a.first", DType::BF16, &[5])
            .tensor("mask", DType::Bool, &[7])
            .tensor("q", DType::F8E4M3, &[9])
            .tensor("steps", DType::I64, &[])
            .build()
            .unwrap();
        let mut ws = WeightSet::zeroed(ModelId::new("policy").unwrap(), Arc::new(m));
        for (i, b) in ws.bytes_mut().unwrap().iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        ws.set_version(Version(42));
        ws
    }

    #[test]
    fn round_trip_is_exact_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let ws = sample();
        ws.write_safetensors(&path).unwrap();
        let back = WeightSet::read_safetensors(&path, None).unwrap();
        assert_eq!(back.model().as_str(), "policy");
        assert_eq!(back.version(), Version(42));
        assert_eq!(**back.manifest(), **ws.manifest());
        for (a, b) in ws.tensors().zip(back.tensors()) {
            assert_eq!(a.bytes(), b.bytes(), "{}", a.name());
        }
        // no temporary file left behind
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn bad_headers_are_refused_cleanly() {
        let good = sample().to_safetensors_bytes().unwrap();
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", vec![]),
            ("short", vec![1, 2, 3]),
            ("huge length", u64::MAX.to_le_bytes().to_vec()),
            ("length past end", {
                let mut b = good.clone();
                b[..8].copy_from_slice(&(good.len() as u64).to_le_bytes());
                b
            }),
            ("not json", {
                let mut b = good.clone();
                b[8] = b'#';
                b
            }),
            ("truncated data", good[..good.len() - 5].to_vec()),
        ];
        for (what, bytes) in cases {
            let err = WeightSet::from_safetensors_bytes(&bytes, None).unwrap_err();
            assert!(matches!(err, Error::Safetensors { .. }), "{what}: {err}");
        }
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.safetensors");
        std::fs::write(&empty, b"").unwrap();
        assert!(
            WeightSet::read_safetensors(&empty, None)
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        let missing = WeightSet::read_safetensors(dir.path().join("nope"), None).unwrap_err();
        assert!(matches!(missing, Error::Path { .. }), "{missing}");
    }

    #[test]
    fn a_flipped_byte_is_refused_naming_the_tensor() {
        let ws = sample();
        let good = ws.to_safetensors_bytes().unwrap();
        let layout = inspect_safetensors(&good, "good.safetensors", None, true).unwrap();
        assert!(layout.verified);
        assert_eq!(*layout.manifest, **ws.manifest());
        assert_eq!(
            layout.tensor_bytes(&good, "z.last").unwrap(),
            ws.tensor("z.last").unwrap().bytes()
        );
        // flip one byte inside tensor `mask`
        let mut bad = good.clone();
        let at = layout.ranges[2].start;
        bad[at] ^= 0x40;
        let err = WeightSet::from_safetensors_bytes(&bad, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("tensor `mask`: checksum"), "{err}");
        let err = inspect_safetensors(&bad, "v7.safetensors", None, true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("v7.safetensors") && err.contains("`mask`"),
            "{err}"
        );
        // a file without checksums is read, but refused where they are required
        let bare = safetensors::serialize(ws.tensors().map(|t| (t.name(), t)), None).unwrap();
        let id = ModelId::new("ext").unwrap();
        assert!(
            !inspect_safetensors(&bare, "x", Some(&id), false)
                .unwrap()
                .verified
        );
        let err = inspect_safetensors(&bare, "x", Some(&id), true).unwrap_err();
        assert!(err.to_string().contains("no refit.xxh3"), "{err}");
    }

    #[test]
    fn foreign_files_need_a_model_id() {
        let ws = sample();
        let bytes = safetensors::serialize(ws.tensors().map(|t| (t.name(), t)), None).unwrap();
        assert!(WeightSet::from_safetensors_bytes(&bytes, None).is_err());
        let id = ModelId::new("ext").unwrap();
        let back = WeightSet::from_safetensors_bytes(&bytes, Some(&id)).unwrap();
        assert_eq!(back.version(), Version::ZERO);
        for t in ws.tensors() {
            assert_eq!(back.tensor(t.name()).unwrap().bytes(), t.bytes());
        }
    }

    #[test]
    fn an_arena_written_in_place_reads_back_as_the_weight_set() {
        let padded = sample();
        let m = Manifest::builder()
            .tensor("a", DType::F32, &[64])
            .tensor("b", DType::BF16, &[4, 32])
            .build()
            .unwrap();
        let mut dense = WeightSet::zeroed(ModelId::new("d").unwrap(), Arc::new(m));
        for (i, b) in dense.bytes_mut().unwrap().iter_mut().enumerate() {
            *b = (i * 7 % 253) as u8;
        }
        dense.set_version(Version(3));
        let dir = tempfile::tempdir().unwrap();
        for (ws, in_place) in [(padded, false), (dense, true)] {
            let layout = SafetensorsFilePlan::of(ws.model(), ws.version(), ws.manifest()).unwrap();
            assert_eq!(layout.in_place(), in_place);
            assert_eq!(layout.header.len() % crate::ALIGN, 0);
            let mut file = layout.header.clone();
            file.extend_from_slice(ws.bytes());
            let start = layout.header.len();
            layout.pack(&mut file[start..]).unwrap();
            file.truncate(layout.file_len());
            let path = dir.path().join("in-place.safetensors");
            std::fs::write(&path, &file).unwrap();
            let back = WeightSet::read_safetensors(&path, None).unwrap();
            assert_eq!(back.model(), ws.model());
            assert_eq!(back.version(), ws.version());
            assert_eq!(**back.manifest(), **ws.manifest());
            for (a, b) in ws.tensors().zip(back.tensors()) {
                assert_eq!(a.bytes(), b.bytes(), "{}", a.name());
            }
            assert!(layout.pack(&mut file[start..start + 1]).is_err());
        }
    }

    #[test]
    fn atomic_write_replaces_whole() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x");
        write_atomically(&p, b"one").unwrap();
        write_atomically(&p, b"two!").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two!");
    }
}
