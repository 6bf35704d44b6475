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
    // the crate's refusal, told in the user's words where the frame says why
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| {
        check_framing(bytes, source)
            .err()
            .unwrap_or_else(|| refused(source, e))
    })?;
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
            let found = crate::hash::xxh3_64(view.data());
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

/// The safetensors crate's limit on a header's length (it refuses longer ones).
const MAX_HEADER: u64 = 100_000_000;

/// Checks the frame of a safetensors buffer the `safetensors` crate refused, so that the two
/// commonest wrong inputs are told in the user's words (a good file is parsed once, by the
/// crate): a file that is not
/// safetensors at all (a text file's first 8 bytes read as a huge header length, which the
/// crate calls "header too large") and a truncated one (the crate: "incomplete metadata,
/// file not fully covered"), which names the bytes the header promises and the bytes there.
fn check_framing(bytes: &[u8], source: &str) -> Result<()> {
    let len = bytes.len();
    let not_safetensors = |why: String| refused(source, format!("not a safetensors file ({why})"));
    let Some(prefix) = bytes.first_chunk::<8>() else {
        return Err(if len == 0 {
            refused(source, "file is empty")
        } else {
            not_safetensors(format!(
                "{len} bytes, fewer than the 8 of a header's length"
            ))
        });
    };
    let n = u64::from_le_bytes(*prefix);
    // a header is a JSON object: its first byte is `{` (a text file's is not, or its length
    // is absurd)
    if !(2..=MAX_HEADER).contains(&n) || bytes.get(8).is_some_and(|b| *b != b'{') {
        return Err(not_safetensors(
            "it does not begin with a header's length and a JSON header".into(),
        ));
    }
    let header_end = 8 + n as usize;
    let Some(header) = bytes.get(8..header_end) else {
        return Err(refused(
            source,
            format!("truncated: header promises at least {header_end} bytes, file has {len}"),
        ));
    };
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| not_safetensors(format!("its header is not a JSON object: {e}")))?;
    // the data's end: the largest end offset any tensor declares (the crate checks the rest)
    let data_end = json
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, v)| v.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    let promised = (header_end as u64).saturating_add(data_end);
    if promised > len as u64 {
        return Err(refused(
            source,
            format!("truncated: header promises {promised} bytes, file has {len}"),
        ));
    }
    if promised < len as u64 {
        return Err(refused(
            source,
            format!(
                "its header describes {promised} bytes, the file has {len}: {} bytes at the end \
                 belong to no tensor",
                len as u64 - promised
            ),
        ));
    }
    Ok(())
}

/// The index of a sharded Hugging Face model folder.
pub const HF_INDEX: &str = "model.safetensors.index.json";
/// The one file of an unsharded Hugging Face model folder.
pub const HF_SINGLE: &str = "model.safetensors";

/// `path` mapped read-only; a folder, an empty file and a file that cannot be opened are
/// refused naming the path.
fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let file = File::open(path).map_err(|source| Error::Path {
        context: "opening",
        path: path.to_path_buf(),
        source,
    })?;
    let meta = file.metadata().map_err(|source| Error::Path {
        context: "reading the metadata of",
        path: path.to_path_buf(),
        source,
    })?;
    if meta.is_dir() {
        return Err(refused(
            &path.display().to_string(),
            "a folder, not a file (a Hugging Face model folder is read by \
             `WeightSet::read_model_path`; `refit serve` takes one)",
        ));
    }
    if meta.len() == 0 {
        return Err(refused(&path.display().to_string(), "file is empty"));
    }
    // SAFETY: the map is read-only and private to its reader; refit writes safetensors by
    // rename, never in place, so the file under the map does not change while we copy out
    // of it. A foreign writer truncating the file could still fault the copy; that is the
    // documented contract of reading mapped files.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|source| Error::Path {
        context: "mapping",
        path: path.to_path_buf(),
        source,
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
        let map = map_file(path)?;
        Self::parse_safetensors(&map, &path.display().to_string(), model)
    }

    /// Reads a model from `path`: a safetensors file ([`WeightSet::read_safetensors`]) or a
    /// Hugging Face model folder ([`WeightSet::read_safetensors_dir`]), what `vllm serve`
    /// takes.
    ///
    /// # Errors
    /// As those two; [`Error::Path`] when `path` does not exist.
    pub fn read_model_path(path: impl AsRef<Path>, model: Option<&ModelId>) -> Result<Self> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|source| Error::Path {
            context: "reading the model",
            path: path.to_path_buf(),
            source,
        })?;
        if meta.is_dir() {
            Self::read_safetensors_dir(path, model)
        } else {
            Self::read_safetensors(path, model)
        }
    }

    /// Reads a Hugging Face model folder as one weight set: the shards its
    /// `model.safetensors.index.json` names (its `weight_map`, tensor name to shard file),
    /// or, without an index, its single `model.safetensors`.
    ///
    /// The manifest lists the shards' tensors shard by shard, the shards in file-name order
    /// (`model-00001-of-00002.safetensors` first), each shard's tensors in its file's order,
    /// as [`WeightSet::read_safetensors`] orders one file. The model id comes from `model`,
    /// else from the first shard's header; the version is 0 unless that header says
    /// otherwise.
    ///
    /// # Errors
    /// [`Error::Safetensors`] naming the index for an index that is not JSON, has no
    /// `weight_map`, or names a shard outside the folder; naming the shard and a tensor for
    /// a shard the index names that is missing, a tensor the index puts in a shard that
    /// does not hold it, or a tensor the index does not list; naming the tensor and both
    /// shards for a tensor held by two shards; as [`WeightSet::read_safetensors`] for each
    /// shard; [`Error::Path`] for a folder with neither an index nor `model.safetensors`.
    pub fn read_safetensors_dir(dir: impl AsRef<Path>, model: Option<&ModelId>) -> Result<Self> {
        let dir = dir.as_ref();
        let index_path = dir.join(HF_INDEX);
        if !index_path.exists() {
            let single = dir.join(HF_SINGLE);
            if single.is_file() {
                return Self::read_safetensors(&single, model);
            }
            return Err(refused(
                &dir.display().to_string(),
                format!(
                    "a folder holding neither {HF_INDEX} nor {HF_SINGLE}: give a safetensors \
                     file, or a Hugging Face model folder"
                ),
            ));
        }
        let index_name = index_path.display().to_string();
        let text = std::fs::read(&index_path).map_err(|source| Error::Path {
            context: "reading",
            path: index_path.clone(),
            source,
        })?;
        let index: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| refused(&index_name, format!("not JSON: {e}")))?;
        let Some(map) = index
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
        else {
            return Err(refused(
                &index_name,
                "no `weight_map` object (tensor name to shard file)",
            ));
        };
        // each shard once, in file-name order, with one tensor it should hold (for errors)
        let mut shards: std::collections::BTreeMap<&str, (&str, usize)> = Default::default();
        for (tensor, shard) in map {
            let shard = shard.as_str().ok_or_else(|| {
                refused(
                    &index_name,
                    format!("tensor `{tensor}`: its shard is not a file name"),
                )
            })?;
            if shard.is_empty() || shard.contains(['/', '\\']) || shard == ".." || shard == "." {
                return Err(refused(
                    &index_name,
                    format!("tensor `{tensor}`: shard `{shard}` is not a file in the folder"),
                ));
            }
            shards.entry(shard).or_insert((tensor.as_str(), 0)).1 += 1;
        }
        if shards.is_empty() {
            return Err(refused(&index_name, "its `weight_map` lists no tensor"));
        }
        let mut builder = Manifest::builder();
        // per tensor: its shard, and the shard's bytes and layout to copy it from
        let mut found: HashMap<String, &str> = HashMap::new();
        let mut read = Vec::with_capacity(shards.len());
        let mut model = model.cloned();
        let mut version = Version::ZERO;
        for (shard, (some_tensor, listed)) in &shards {
            let path = dir.join(shard);
            if !path.is_file() {
                return Err(refused(
                    &index_name,
                    format!(
                        "shard `{shard}` (holding tensor `{some_tensor}`{}) is missing from \
                         the folder",
                        match listed - 1 {
                            0 => String::new(),
                            n => format!(" and {n} more"),
                        }
                    ),
                ));
            }
            let bytes = map_file(&path)?;
            let name = path.display().to_string();
            let layout = inspect_safetensors(&bytes, &name, model.as_ref(), false)?;
            if model.is_none() {
                version = layout.version;
                model = Some(layout.model.clone());
            }
            read.push((*shard, bytes, layout));
        }
        // every tensor once, then each where the index puts it
        for (shard, _, layout) in &read {
            for t in layout.manifest.tensors() {
                if let Some(first) = found.insert(t.name.clone(), *shard) {
                    return Err(refused(
                        &index_name,
                        format!(
                            "tensor `{}` is in two shards: `{first}` and `{shard}`",
                            t.name
                        ),
                    ));
                }
            }
        }
        for (shard, _, layout) in &read {
            for t in layout.manifest.tensors() {
                match map.get(&t.name).and_then(serde_json::Value::as_str) {
                    None => {
                        return Err(refused(
                            &index_name,
                            format!(
                                "shard `{shard}` holds tensor `{}`, which it does not list",
                                t.name
                            ),
                        ));
                    }
                    Some(listed) if listed != *shard => {
                        return Err(refused(
                            &index_name,
                            format!(
                                "tensor `{}` is in shard `{shard}`, not in `{listed}` where it \
                                 is listed",
                                t.name
                            ),
                        ));
                    }
                    Some(_) => builder.push(t.name.clone(), t.dtype, &t.shape),
                }
            }
        }
        if let Some((tensor, shard)) = map.iter().find(|(t, _)| !found.contains_key(t.as_str())) {
            return Err(refused(
                &index_name,
                format!(
                    "tensor `{tensor}` is not in shard `{}`, where the index puts it",
                    shard.as_str().unwrap_or_default()
                ),
            ));
        }
        let model = model.ok_or_else(|| refused(&index_name, "no model id"))?;
        let mut ws = WeightSet::zeroed(model, Arc::new(builder.build()?));
        ws.set_version(version);
        for (_, bytes, layout) in &read {
            for (spec, range) in layout.manifest.tensors().iter().zip(&layout.ranges) {
                let src = bytes.get(range.clone()).ok_or_else(|| {
                    refused(
                        &index_name,
                        format!("tensor `{}` lies outside its shard", spec.name),
                    )
                })?;
                ws.tensor_bytes_mut(&spec.name)?.copy_from_slice(src);
            }
        }
        Ok(ws)
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
    fn wrong_files_are_told_in_the_users_words() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("notes.safetensors");
        std::fs::write(&text, "hello, these are notes, not weights\n").unwrap();
        let err = WeightSet::read_safetensors(&text, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{}: not a safetensors file (", text.display())),
            "{err}"
        );
        let good = sample().to_safetensors_bytes().unwrap();
        let cut = dir.path().join("cut.safetensors");
        std::fs::write(&cut, &good[..good.len() - 10]).unwrap();
        let err = WeightSet::read_safetensors(&cut, None)
            .unwrap_err()
            .to_string();
        let says = format!(
            "{}: truncated: header promises {} bytes, file has {}",
            cut.display(),
            good.len(),
            good.len() - 10
        );
        assert!(err.contains(&says), "{err}");
        // cut inside the header itself
        std::fs::write(&cut, &good[..20]).unwrap();
        let err = WeightSet::read_safetensors(&cut, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("truncated: header promises at least"), "{err}");
        // bytes past the last tensor
        let mut long = good.clone();
        long.extend_from_slice(&[0; 3]);
        let err = WeightSet::from_safetensors_bytes(&long, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("3 bytes at the end belong to no tensor"),
            "{err}"
        );
        // a folder handed to the file reader
        let err = WeightSet::read_safetensors(dir.path(), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("a folder, not a file"), "{err}");
    }

    /// Writes a Hugging Face folder: `ws`'s tensors cut into shards at `cuts` (tensor
    /// indices), each a plain safetensors file, and the index naming them.
    fn hf_folder(dir: &Path, ws: &WeightSet, cuts: &[usize]) -> Vec<String> {
        let tensors: Vec<TensorView<'_>> = ws.tensors().collect();
        let mut bounds = vec![0];
        bounds.extend_from_slice(cuts);
        bounds.push(tensors.len());
        let n = bounds.len() - 1;
        let mut map = serde_json::Map::new();
        let mut names = Vec::new();
        for (i, w) in bounds.windows(2).enumerate() {
            let shard = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            let part = &tensors[w[0]..w[1]];
            let bytes = safetensors::serialize(part.iter().map(|t| (t.name(), *t)), None).unwrap();
            std::fs::write(dir.join(&shard), bytes).unwrap();
            for t in part {
                map.insert(t.name().into(), shard.clone().into());
            }
            names.push(shard);
        }
        let index =
            serde_json::json!({"metadata": {"total_size": ws.bytes().len()}, "weight_map": map});
        std::fs::write(dir.join(HF_INDEX), index.to_string()).unwrap();
        names
    }

    #[test]
    fn a_hugging_face_folder_reads_as_one_model() {
        let ws = sample();
        let id = ModelId::new("hf").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let shards = hf_folder(dir.path(), &ws, &[2]);
        let back = WeightSet::read_model_path(dir.path(), Some(&id)).unwrap();
        assert_eq!(back.model(), &id);
        assert_eq!(back.manifest().len(), ws.manifest().len());
        for t in ws.tensors() {
            let b = back.tensor(t.name()).unwrap();
            assert_eq!(
                (b.bytes(), b.shape(), b.dtype()),
                (t.bytes(), t.shape(), t.dtype())
            );
        }
        // shard by shard, each in its file's order: the same order every time
        let again = WeightSet::read_safetensors_dir(dir.path(), Some(&id)).unwrap();
        assert_eq!(**again.manifest(), **back.manifest());
        let mut first: Vec<&str> = back.manifest().tensors()[..2]
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        first.sort_unstable();
        assert_eq!(
            first,
            ["a.first", "z.last"],
            "the first shard's tensors come first"
        );
        // a foreign folder needs a model id
        assert!(WeightSet::read_model_path(dir.path(), None).is_err());

        // a shard the index names is missing: named with one of its tensors
        std::fs::remove_file(dir.path().join(&shards[1])).unwrap();
        let err = WeightSet::read_model_path(dir.path(), Some(&id))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("shard `{}` (holding tensor `", shards[1]))
                && err.contains("missing"),
            "{err}"
        );

        // a tensor in two shards
        let dir = tempfile::tempdir().unwrap();
        let shards = hf_folder(dir.path(), &ws, &[2]);
        let first = ws.tensors().next().unwrap();
        let mut both: Vec<TensorView<'_>> = ws.tensors().skip(2).collect();
        both.push(first);
        let bytes = safetensors::serialize(both.iter().map(|t| (t.name(), *t)), None).unwrap();
        std::fs::write(dir.path().join(&shards[1]), bytes).unwrap();
        let err = WeightSet::read_model_path(dir.path(), Some(&id))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("tensor `{}` is in two shards", first.name())),
            "{err}"
        );

        // one model.safetensors, no index
        let dir = tempfile::tempdir().unwrap();
        ws.write_safetensors(dir.path().join(HF_SINGLE)).unwrap();
        let back = WeightSet::read_model_path(dir.path(), None).unwrap();
        assert_eq!(**back.manifest(), **ws.manifest());
        // neither
        std::fs::remove_file(dir.path().join(HF_SINGLE)).unwrap();
        let err = WeightSet::read_model_path(dir.path(), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("neither"), "{err}");
        let err = WeightSet::read_model_path(dir.path().join("nope"), None).unwrap_err();
        assert!(matches!(err, Error::Path { .. }), "{err}");
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
