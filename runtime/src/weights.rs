//! Weight sets: one version of one model, every tensor in one contiguous aligned arena.

use std::sync::Arc;

use crate::arena::AlignedBuf;
use crate::dtype::{DType, Element};
use crate::error::{Error, Mismatch, Result};
use crate::ids::{ModelId, Version};
use crate::manifest::{Manifest, TensorSpec};

/// Bytes owned by someone else (a shared-memory slot pinned for a reader, a mapped file).
///
/// The bytes must not change while the value is alive.
pub trait SharedBytes: Send + Sync + 'static {
    /// The bytes.
    fn bytes(&self) -> &[u8];

    /// The bytes, writable, for storage lent to one writer (a shared-memory slot being
    /// filled in place); `None` (the default) for storage that is read-only.
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
}

enum Storage {
    Owned(AlignedBuf),
    Shared(Arc<dyn SharedBytes>),
}

/// One version of one model: a manifest plus one contiguous aligned byte arena.
pub struct WeightSet {
    model: ModelId,
    version: Version,
    manifest: Arc<Manifest>,
    storage: Storage,
}

impl WeightSet {
    /// A weight set of zeroed tensors at version 0.
    pub fn zeroed(model: ModelId, manifest: Arc<Manifest>) -> Self {
        let buf = AlignedBuf::zeroed(manifest.total_len());
        Self {
            model,
            version: Version::ZERO,
            manifest,
            storage: Storage::Owned(buf),
        }
    }

    /// A weight set over an owned copy of `bytes`, which must be exactly the arena.
    ///
    /// # Errors
    /// [`Error::Tensor`] with [`Mismatch::Size`] naming the model's arena when lengths differ.
    pub fn from_bytes(
        model: ModelId,
        version: Version,
        manifest: Arc<Manifest>,
        bytes: &[u8],
    ) -> Result<Self> {
        check_arena_len(&model, &manifest, bytes.len())?;
        Ok(Self {
            model,
            version,
            manifest,
            storage: Storage::Owned(AlignedBuf::copy_from(bytes)),
        })
    }

    /// A read-only weight set over bytes someone else owns (no copy).
    ///
    /// # Errors
    /// As [`WeightSet::from_bytes`].
    pub fn from_shared(
        model: ModelId,
        version: Version,
        manifest: Arc<Manifest>,
        bytes: Arc<dyn SharedBytes>,
    ) -> Result<Self> {
        check_arena_len(&model, &manifest, bytes.bytes().len())?;
        Ok(Self {
            model,
            version,
            manifest,
            storage: Storage::Shared(bytes),
        })
    }

    /// A read-only view of this weight set's arena stamped `version`: the same bytes, no
    /// copy (the arena lives as long as the view). For benchmarks and tests that publish
    /// many versions whose content does not matter to what they measure.
    ///
    /// # Errors
    /// None in practice (the arena already fits the manifest); as
    /// [`WeightSet::from_shared`].
    pub fn view_as(self: &Arc<Self>, version: Version) -> Result<Self> {
        /// Another weight set's arena, shared.
        struct ArenaOf(Arc<WeightSet>);
        impl SharedBytes for ArenaOf {
            fn bytes(&self) -> &[u8] {
                self.0.bytes()
            }
        }
        Self::from_shared(
            self.model.clone(),
            version,
            Arc::clone(&self.manifest),
            Arc::new(ArenaOf(Arc::clone(self))),
        )
    }

    /// The model this weight set belongs to.
    pub fn model(&self) -> &ModelId {
        &self.model
    }

    /// Its version.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Stamps a version (the trainer does this before publishing).
    pub fn set_version(&mut self, version: Version) {
        self.version = version;
    }

    /// The manifest.
    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.manifest
    }

    /// The whole arena.
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Owned(b) => b.as_slice(),
            Storage::Shared(s) => s.bytes(),
        }
    }

    /// The whole arena, writable.
    ///
    /// # Errors
    /// [`Error::ReadOnly`] when the storage is shared with others or read-only.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        match &mut self.storage {
            Storage::Owned(b) => Ok(b.as_mut_slice()),
            Storage::Shared(s) => Arc::get_mut(s)
                .and_then(|s| s.bytes_mut())
                .ok_or_else(|| Error::ReadOnly(self.model.clone())),
        }
    }

    /// True when the bytes belong to someone else (a pinned slot, a mapped file).
    pub fn is_shared(&self) -> bool {
        matches!(self.storage, Storage::Shared(_))
    }

    /// A zeroed weight set of one tensor shaped as `spec` (at offset 0), stamped `version`:
    /// what a streaming receive fills and hands over one tensor at a time
    /// ([`ReceiverTransport::stream_next`](crate::ReceiverTransport::stream_next)).
    ///
    /// # Errors
    /// [`Error::InvalidManifest`] for a shape the manifest refuses.
    pub fn single(model: ModelId, version: Version, spec: &TensorSpec) -> Result<Self> {
        let mut b = Manifest::builder();
        b.push(spec.name.clone(), spec.dtype, &spec.shape);
        let mut ws = Self::zeroed(model, Arc::new(b.build()?));
        ws.version = version;
        Ok(ws)
    }

    /// The name of its first tensor (a streamed weight set's only one; empty for none): what
    /// a failure of the caller's apply names.
    pub fn first_name(&self) -> &str {
        self.manifest
            .tensors()
            .first()
            .map_or("", |t| t.name.as_str())
    }

    /// Tensor `spec` of this weight set (one of its manifest's) as a weight set of its own:
    /// a copy, as [`WeightSet::single`] makes.
    ///
    /// # Errors
    /// As [`WeightSet::single`]; [`Error::NoSuchTensor`] for a spec past the arena.
    pub fn single_copy(&self, spec: &TensorSpec) -> Result<Self> {
        let mut one = Self::single(self.model.clone(), self.version, spec)?;
        let src = self
            .bytes()
            .get(spec.range())
            .ok_or_else(|| Error::NoSuchTensor(spec.name.clone()))?;
        // the arena may be longer than the tensor (padded to the alignment)
        if let Some(dst) = one.bytes_mut()?.get_mut(..src.len()) {
            dst.copy_from_slice(src);
        }
        Ok(one)
    }

    /// An owned copy (detaches shared storage, releasing the pin when the original drops).
    pub fn to_owned_copy(&self) -> Self {
        Self {
            model: self.model.clone(),
            version: self.version,
            manifest: Arc::clone(&self.manifest),
            storage: Storage::Owned(AlignedBuf::copy_from(self.bytes())),
        }
    }

    /// One tensor by name.
    ///
    /// # Errors
    /// [`Error::NoSuchTensor`].
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let spec = self
            .manifest
            .get(name)
            .ok_or_else(|| Error::NoSuchTensor(name.into()))?;
        Ok(TensorView {
            spec,
            bytes: &self.bytes()[spec.range()],
        })
    }

    /// Every tensor, in manifest order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        let bytes = self.bytes();
        self.manifest.tensors().iter().map(move |spec| TensorView {
            spec,
            bytes: &bytes[spec.range()],
        })
    }

    /// A typed view of one tensor.
    ///
    /// # Errors
    /// [`Error::NoSuchTensor`] or [`Error::WrongElement`].
    pub fn view<T: Element>(&self, name: &str) -> Result<&[T]> {
        self.tensor(name)?.as_slice()
    }

    /// A typed, writable view of one tensor.
    ///
    /// # Errors
    /// [`Error::NoSuchTensor`], [`Error::WrongElement`] or [`Error::ReadOnly`].
    pub fn view_mut<T: Element>(&mut self, name: &str) -> Result<&mut [T]> {
        let spec = self
            .manifest
            .get(name)
            .ok_or_else(|| Error::NoSuchTensor(name.into()))?;
        check_element::<T>(spec)?;
        let range = spec.range();
        let bytes = &mut self.bytes_mut()?[range];
        Ok(bytemuck::cast_slice_mut(bytes))
    }

    /// Raw bytes of one tensor, writable.
    ///
    /// # Errors
    /// [`Error::NoSuchTensor`] or [`Error::ReadOnly`].
    pub fn tensor_bytes_mut(&mut self, name: &str) -> Result<&mut [u8]> {
        let range = self
            .manifest
            .get(name)
            .ok_or_else(|| Error::NoSuchTensor(name.into()))?
            .range();
        Ok(&mut self.bytes_mut()?[range])
    }

    /// Copies another weight set's arena into this one (same schema required), and its version.
    ///
    /// # Errors
    /// [`Error::Tensor`] / [`Error::Schema`] if the manifests differ; [`Error::ReadOnly`].
    pub fn copy_from(&mut self, other: &WeightSet) -> Result<()> {
        self.manifest
            .check_same_schema(&self.model, &other.manifest)?;
        crate::copy::copy_parallel(
            self.bytes_mut()?,
            other.bytes(),
            crate::copy::copy_threads(),
        );
        self.version = other.version;
        Ok(())
    }

    /// xxh3-64 of every tensor, in manifest order (what a receiver verifies before apply).
    pub fn tensor_checksums(&self) -> Vec<u64> {
        self.tensors().map(|t| t.checksum()).collect()
    }
}

impl Clone for WeightSet {
    fn clone(&self) -> Self {
        self.to_owned_copy()
    }
}

impl std::fmt::Debug for WeightSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightSet")
            .field("model", &self.model)
            .field("version", &self.version)
            .field("tensors", &self.manifest.len())
            .field("bytes", &self.manifest.total_len())
            .field("shared", &self.is_shared())
            .finish()
    }
}

fn check_arena_len(model: &ModelId, manifest: &Manifest, len: usize) -> Result<()> {
    if len != manifest.total_len() {
        return Err(Error::tensor(
            model,
            "<arena>",
            Mismatch::Size {
                expected: manifest.total_len(),
                found: len,
            },
        ));
    }
    Ok(())
}

fn check_element<T: Element>(spec: &TensorSpec) -> Result<()> {
    if spec.dtype != T::DTYPE {
        return Err(Error::WrongElement {
            name: spec.name.clone(),
            actual: spec.dtype,
            requested: T::DTYPE,
        });
    }
    Ok(())
}

/// A borrowed view of one tensor.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    spec: &'a TensorSpec,
    bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// The tensor's spec.
    pub fn spec(&self) -> &'a TensorSpec {
        self.spec
    }

    /// Its name.
    pub fn name(&self) -> &'a str {
        &self.spec.name
    }

    /// Its dtype.
    pub fn dtype(&self) -> DType {
        self.spec.dtype
    }

    /// Its shape.
    pub fn shape(&self) -> &'a [usize] {
        &self.spec.shape
    }

    /// Its bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Typed elements.
    ///
    /// # Errors
    /// [`Error::WrongElement`] when `T` is not the tensor's dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&'a [T]> {
        check_element::<T>(self.spec)?;
        Ok(bytemuck::cast_slice(self.bytes))
    }

    /// xxh3-64 of the bytes.
    pub fn checksum(&self) -> u64 {
        tensor_checksum(self.bytes)
    }
}

/// The checksum of one tensor's bytes, as [`WeightSet::tensor_checksums`] computes it
/// (xxh3-64): what a receiver verifies before apply, and what an engine compares what it
/// serves with.
pub fn tensor_checksum(bytes: &[u8]) -> u64 {
    crate::hash::xxh3_64(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Arc<Manifest> {
        crate::testing::manifest(&[("w", DType::F32, &[2, 3]), ("b", DType::F64, &[3])])
    }

    struct Fixed(Vec<u8>);
    impl SharedBytes for Fixed {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
    }

    #[test]
    fn a_single_tensor_copy_keeps_its_bytes_name_and_version() {
        let id = ModelId::new("m").unwrap();
        let mut ws = WeightSet::zeroed(id, manifest());
        ws.set_version(Version(4));
        for (i, b) in ws.bytes_mut().unwrap().iter_mut().enumerate() {
            *b = i as u8;
        }
        // `b` is 24 bytes at offset 64: its own arena is padded to the alignment
        let spec = ws.manifest().get("b").unwrap().clone();
        let one = ws.single_copy(&spec).unwrap();
        assert_eq!(one.version(), Version(4));
        assert_eq!(one.manifest().len(), 1);
        assert_eq!(one.tensor("b").unwrap().bytes, &ws.bytes()[spec.range()]);
    }

    #[test]
    fn views_by_name_are_typed() {
        let id = ModelId::new("m").unwrap();
        let mut ws = WeightSet::zeroed(id.clone(), manifest());
        ws.view_mut::<f32>("w")
            .unwrap()
            .copy_from_slice(&[1., 2., 3., 4., 5., 6.]);
        ws.view_mut::<f64>("b").unwrap()[2] = 9.5;
        assert_eq!(ws.view::<f32>("w").unwrap()[4], 5.0);
        assert_eq!(ws.view::<f64>("b").unwrap(), &[0.0, 0.0, 9.5]);
        assert!(matches!(
            ws.view::<f64>("w"),
            Err(Error::WrongElement { .. })
        ));
        assert!(matches!(
            ws.view::<f32>("nope"),
            Err(Error::NoSuchTensor(_))
        ));
        let names: Vec<_> = ws.tensors().map(|t| t.name().to_string()).collect();
        assert_eq!(names, ["w", "b"]);
        let copy = ws.clone();
        assert_eq!(copy.bytes(), ws.bytes());
        assert_eq!(copy.tensor_checksums(), ws.tensor_checksums());
    }

    #[test]
    fn a_view_shares_the_arena_under_another_version_and_is_read_only() {
        let mut ws = WeightSet::zeroed(ModelId::new("m").unwrap(), manifest());
        ws.view_mut::<f32>("w").unwrap()[1] = 7.0;
        ws.set_version(Version(3));
        let ws = Arc::new(ws);
        let mut view = ws.view_as(Version(9)).unwrap();
        assert_eq!(view.version(), Version(9));
        assert_eq!(ws.version(), Version(3));
        assert_eq!(view.bytes().as_ptr(), ws.bytes().as_ptr(), "no copy");
        assert_eq!(view.view::<f32>("w").unwrap()[1], 7.0);
        assert!(view.view_mut::<f32>("w").is_err());
    }

    #[test]
    fn shared_storage_is_read_only_and_length_checked() {
        let id = ModelId::new("m").unwrap();
        let m = manifest();
        let bad = WeightSet::from_shared(
            id.clone(),
            Version(1),
            m.clone(),
            Arc::new(Fixed(vec![0; 3])),
        );
        assert!(bad.unwrap_err().to_string().contains("<arena>"));
        let mut ws = WeightSet::from_shared(
            id,
            Version(1),
            m.clone(),
            Arc::new(Fixed(vec![1; m.total_len()])),
        )
        .unwrap();
        assert!(ws.is_shared());
        assert!(matches!(ws.bytes_mut(), Err(Error::ReadOnly(_))));
        let owned = ws.to_owned_copy();
        assert!(!owned.is_shared());
        assert_eq!(owned.bytes(), ws.bytes());
    }
}
