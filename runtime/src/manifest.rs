//! Manifests: the ordered list of a model's tensors and where each one lives in the arena.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::{Error, Mismatch, Result};
use crate::ids::ModelId;

/// Alignment, in bytes, of every tensor inside an arena (a cache line; enough for any SIMD load).
pub const ALIGN: usize = 64;

/// One tensor of a manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Name, unique within the manifest.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape (row-major).
    pub shape: Vec<usize>,
    /// Byte offset inside the arena, a multiple of [`ALIGN`].
    pub offset: usize,
    /// Byte length: product of the shape times the element size.
    pub len: usize,
}

impl TensorSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The byte range of this tensor inside the arena.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// The ordered list of one model's tensors, their places in the arena, and a schema hash.
///
/// A manifest is immutable once built; it is exchanged once per connection and compared with
/// [`Manifest::check_same_schema`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(try_from = "ManifestWire", into = "ManifestWire")]
pub struct Manifest {
    tensors: Vec<TensorSpec>,
    total_len: usize,
    schema_hash: u64,
    index: HashMap<String, usize>,
}

/// What travels on the wire; checked whole when decoded.
#[derive(Serialize, Deserialize)]
struct ManifestWire {
    tensors: Vec<TensorSpec>,
    total_len: usize,
    schema_hash: u64,
}

impl TryFrom<ManifestWire> for Manifest {
    type Error = Error;
    fn try_from(w: ManifestWire) -> Result<Self> {
        let m = Manifest::from_specs(w.tensors, w.total_len)?;
        if m.schema_hash != w.schema_hash {
            return Err(Error::InvalidManifest(format!(
                "declared schema hash {:#018x} does not match its tensors ({:#018x})",
                w.schema_hash, m.schema_hash
            )));
        }
        Ok(m)
    }
}

impl From<Manifest> for ManifestWire {
    fn from(m: Manifest) -> Self {
        Self {
            tensors: m.tensors,
            total_len: m.total_len,
            schema_hash: m.schema_hash,
        }
    }
}

impl PartialEq for Manifest {
    fn eq(&self, other: &Self) -> bool {
        self.schema_hash == other.schema_hash && self.tensors == other.tensors
    }
}
impl Eq for Manifest {}

fn align_up(n: usize) -> Option<usize> {
    n.checked_add(ALIGN - 1).map(|v| v / ALIGN * ALIGN)
}

impl Manifest {
    /// Starts a manifest; tensors are laid out in the order they are added.
    pub fn builder() -> ManifestBuilder {
        ManifestBuilder::default()
    }

    /// Builds a manifest from explicit specs, checking every invariant.
    ///
    /// # Errors
    /// [`Error::InvalidManifest`] on duplicate or empty names, misaligned or overlapping
    /// ranges, a length that disagrees with the shape, or a range past `total_len`.
    pub fn from_specs(tensors: Vec<TensorSpec>, total_len: usize) -> Result<Self> {
        let mut index = HashMap::with_capacity(tensors.len());
        let mut by_offset: Vec<(usize, usize, &str)> = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if t.name.is_empty() {
                return Err(Error::InvalidManifest("a tensor has an empty name".into()));
            }
            if index.insert(t.name.clone(), i).is_some() {
                return Err(Error::InvalidManifest(format!(
                    "tensor `{}` appears twice",
                    t.name
                )));
            }
            let expect = t
                .shape
                .iter()
                .try_fold(t.dtype.size(), |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| {
                    Error::InvalidManifest(format!("tensor `{}`: shape overflows", t.name))
                })?;
            if expect != t.len {
                return Err(Error::InvalidManifest(format!(
                    "tensor `{}`: {} bytes declared, shape {:?} of {} needs {expect}",
                    t.name, t.len, t.shape, t.dtype
                )));
            }
            if t.offset % ALIGN != 0 {
                return Err(Error::InvalidManifest(format!(
                    "tensor `{}`: offset {} is not a multiple of {ALIGN}",
                    t.name, t.offset
                )));
            }
            let end = t.offset.checked_add(t.len).filter(|&e| e <= total_len);
            if end.is_none() {
                return Err(Error::InvalidManifest(format!(
                    "tensor `{}`: bytes {}..+{} run past the arena ({total_len} bytes)",
                    t.name, t.offset, t.len
                )));
            }
            by_offset.push((t.offset, t.len, &t.name));
        }
        by_offset.sort_unstable();
        for w in by_offset.windows(2) {
            if w[0].1 > 0 && w[0].0 + w[0].1 > w[1].0 {
                return Err(Error::InvalidManifest(format!(
                    "tensors `{}` and `{}` overlap",
                    w[0].2, w[1].2
                )));
            }
        }
        let schema_hash = schema_hash(&tensors, total_len);
        Ok(Self {
            tensors,
            total_len,
            schema_hash,
            index,
        })
    }

    /// The tensors, in manifest order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when the manifest has no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Size of the arena in bytes (tensors plus alignment padding).
    pub fn total_len(&self) -> usize {
        self.total_len
    }

    /// Sum of the tensors' byte lengths (no padding).
    pub fn payload_len(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }

    /// A stable 64-bit hash of names, dtypes, shapes and offsets.
    pub fn schema_hash(&self) -> u64 {
        self.schema_hash
    }

    /// The spec of one tensor.
    pub fn get(&self, name: &str) -> Option<&TensorSpec> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Position of a tensor in manifest order.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// Checks that `found` describes the same model as `self`, naming the first tensor that
    /// differs.
    ///
    /// # Errors
    /// [`Error::Tensor`] naming a missing, unexpected or different tensor, or [`Error::Schema`]
    /// when only the layout differs.
    pub fn check_same_schema(&self, model: &ModelId, found: &Manifest) -> Result<()> {
        if self.schema_hash == found.schema_hash && self.tensors == found.tensors {
            return Ok(());
        }
        for t in &self.tensors {
            let Some(o) = found.get(&t.name) else {
                return Err(Error::tensor(model, &t.name, Mismatch::Missing));
            };
            if o.dtype != t.dtype {
                return Err(Error::tensor(
                    model,
                    &t.name,
                    Mismatch::DType {
                        expected: t.dtype,
                        found: o.dtype,
                    },
                ));
            }
            if o.shape != t.shape {
                return Err(Error::tensor(
                    model,
                    &t.name,
                    Mismatch::Shape {
                        expected: t.shape.clone(),
                        found: o.shape.clone(),
                    },
                ));
            }
            if o.offset != t.offset || o.len != t.len {
                return Err(Error::tensor(
                    model,
                    &t.name,
                    Mismatch::Size {
                        expected: t.len,
                        found: o.len,
                    },
                ));
            }
        }
        if let Some(extra) = found.tensors.iter().find(|t| self.get(&t.name).is_none()) {
            return Err(Error::tensor(model, &extra.name, Mismatch::Unexpected));
        }
        Err(Error::Schema {
            model: model.clone(),
            expected: self.schema_hash,
            found: found.schema_hash,
        })
    }
}

fn schema_hash(tensors: &[TensorSpec], total_len: usize) -> u64 {
    let mut h = crate::hash::Xxh3::new();
    h.update(b"refit.manifest.v1");
    h.update(&(total_len as u64).to_le_bytes());
    for t in tensors {
        h.update(&(t.name.len() as u64).to_le_bytes());
        h.update(t.name.as_bytes());
        h.update(t.dtype.name().as_bytes());
        h.update(&(t.shape.len() as u64).to_le_bytes());
        for d in &t.shape {
            h.update(&(*d as u64).to_le_bytes());
        }
        h.update(&(t.offset as u64).to_le_bytes());
        h.update(&(t.len as u64).to_le_bytes());
    }
    h.digest()
}

/// Lays tensors out one after the other, each at a multiple of [`ALIGN`].
#[derive(Debug, Default)]
pub struct ManifestBuilder {
    tensors: Vec<TensorSpec>,
    cursor: usize,
    error: Option<Error>,
}

impl ManifestBuilder {
    /// Appends a tensor.
    pub fn tensor(mut self, name: impl Into<String>, dtype: DType, shape: &[usize]) -> Self {
        self.push(name, dtype, shape);
        self
    }

    /// Appends a tensor (by reference, for loops).
    pub fn push(&mut self, name: impl Into<String>, dtype: DType, shape: &[usize]) {
        if self.error.is_some() {
            return;
        }
        let name = name.into();
        let len = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
        let (Some(len), Some(offset)) = (len, align_up(self.cursor)) else {
            self.error = Some(Error::InvalidManifest(format!(
                "tensor `{name}`: size overflows"
            )));
            return;
        };
        self.cursor = offset + len;
        self.tensors.push(TensorSpec {
            name,
            dtype,
            shape: shape.to_vec(),
            offset,
            len,
        });
    }

    /// Finishes the manifest.
    ///
    /// # Errors
    /// [`Error::InvalidManifest`] on duplicate names or sizes that overflow.
    pub fn build(self) -> Result<Manifest> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let total = align_up(self.cursor)
            .ok_or_else(|| Error::InvalidManifest("arena size overflows".into()))?;
        Manifest::from_specs(self.tensors, total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Manifest {
        Manifest::builder()
            .tensor("w", DType::F32, &[3, 5])
            .tensor("b", DType::F16, &[5])
            .tensor("steps", DType::I64, &[])
            .build()
            .unwrap()
    }

    #[test]
    fn layout_is_aligned_and_hash_stable() {
        let m = small();
        for t in m.tensors() {
            assert_eq!(t.offset % ALIGN, 0);
        }
        assert_eq!(m.get("b").unwrap().offset, 64);
        assert_eq!(m.get("steps").unwrap().len, 8);
        assert_eq!(m.total_len(), 192);
        assert_eq!(m.schema_hash(), small().schema_hash());
        let other = Manifest::builder()
            .tensor("w", DType::F32, &[5, 3])
            .tensor("b", DType::F16, &[5])
            .tensor("steps", DType::I64, &[])
            .build()
            .unwrap();
        assert_ne!(m.schema_hash(), other.schema_hash());
    }

    #[test]
    fn mismatches_name_the_tensor() {
        let id = ModelId::new("policy").unwrap();
        let m = small();
        let shape = Manifest::builder()
            .tensor("w", DType::F32, &[5, 3])
            .tensor("b", DType::F16, &[5])
            .tensor("steps", DType::I64, &[])
            .build()
            .unwrap();
        let e = m.check_same_schema(&id, &shape).unwrap_err().to_string();
        assert!(
            e.contains("tensor `w`") && e.contains("shape [3, 5] expected"),
            "{e}"
        );
        let dtype = Manifest::builder()
            .tensor("w", DType::F32, &[3, 5])
            .tensor("b", DType::BF16, &[5])
            .tensor("steps", DType::I64, &[])
            .build()
            .unwrap();
        let e = m.check_same_schema(&id, &dtype).unwrap_err().to_string();
        assert!(
            e.contains("tensor `b`") && e.contains("dtype f16 expected, found bf16"),
            "{e}"
        );
        let missing = Manifest::builder()
            .tensor("w", DType::F32, &[3, 5])
            .tensor("b", DType::F16, &[5])
            .build()
            .unwrap();
        let e = m.check_same_schema(&id, &missing).unwrap_err().to_string();
        assert!(e.contains("tensor `steps`: missing"), "{e}");
        let extra = Manifest::builder()
            .tensor("w", DType::F32, &[3, 5])
            .tensor("b", DType::F16, &[5])
            .tensor("steps", DType::I64, &[])
            .tensor("z", DType::U8, &[1])
            .build()
            .unwrap();
        let e = m.check_same_schema(&id, &extra).unwrap_err().to_string();
        assert!(e.contains("tensor `z`: not in the manifest"), "{e}");
        assert!(m.check_same_schema(&id, &small()).is_ok());
    }

    #[test]
    fn invalid_specs_are_refused() {
        let dup = Manifest::builder()
            .tensor("a", DType::U8, &[1])
            .tensor("a", DType::U8, &[1])
            .build();
        assert!(matches!(dup, Err(Error::InvalidManifest(_))));
        let spec = |name: &str, offset, len| TensorSpec {
            name: name.into(),
            dtype: DType::U8,
            shape: vec![len],
            offset,
            len,
        };
        assert!(Manifest::from_specs(vec![spec("a", 0, 100), spec("b", 64, 10)], 128).is_err());
        assert!(Manifest::from_specs(vec![spec("a", 3, 10)], 128).is_err());
        assert!(Manifest::from_specs(vec![spec("a", 64, 100)], 128).is_err());
        assert!(Manifest::from_specs(vec![spec("a", usize::MAX - 63, 100)], 128).is_err());
        let mut bad_len = spec("a", 0, 10);
        bad_len.len = 11;
        assert!(Manifest::from_specs(vec![bad_len], 128).is_err());
        let overflow = Manifest::builder()
            .tensor("a", DType::F64, &[usize::MAX / 2, 3])
            .build();
        assert!(overflow.is_err());
    }

    #[test]
    fn wire_round_trip_checks_the_hash() {
        let m = small();
        let bytes = rmp_serde::to_vec_named(&m).unwrap();
        let back: Manifest = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.get("b"), m.get("b"));
        let mut wire = ManifestWire::from(m);
        wire.schema_hash ^= 1;
        let bytes = rmp_serde::to_vec_named(&wire).unwrap();
        let err = rmp_serde::from_slice::<Manifest>(&bytes)
            .unwrap_err()
            .to_string();
        assert!(err.contains("schema hash"), "{err}");
    }
}
