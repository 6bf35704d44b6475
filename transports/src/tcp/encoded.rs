//! Buckets sent as element-level deltas ([`TransferMode::Elements`](super::TransferMode)):
//! the sender's encodings of one version against one base, made once per bucket and shared
//! by every pull of that pair; the receiver's bound on an encoding's length.

use std::sync::{Arc, OnceLock};

use refit_runtime::bucket::BucketSpec;
use refit_runtime::delta::elements;
use refit_runtime::{Result, Version, WeightSet};

/// The encodings of one version against one base, bucket by bucket, each made at its
/// first pull.
#[derive(Debug)]
pub(crate) struct Encodings {
    base: Arc<WeightSet>,
    version: Version,
    /// Per bucket of the plan: its encoding, or `None` where the raw bytes are no larger.
    buckets: Vec<OnceLock<Option<Arc<[u8]>>>>,
}

impl Encodings {
    /// Encodings of `version` against `base`, for a plan of `buckets` buckets (none made
    /// yet).
    pub(crate) fn new(base: Arc<WeightSet>, version: Version, buckets: usize) -> Self {
        Self {
            base,
            version,
            buckets: (0..buckets).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The version the buckets are encoded against.
    pub(crate) fn base_version(&self) -> Version {
        self.base.version()
    }

    /// The version encoded.
    pub(crate) fn version(&self) -> Version {
        self.version
    }

    /// True for the encodings of `version` against `base`.
    pub(crate) fn is(&self, base: Version, version: Version) -> bool {
        self.base.version() == base && self.version == version
    }

    /// The encoding of bucket `index` (`spec`) of `new`, made now unless it was already;
    /// `None` when it is no smaller than the raw bytes (then they are sent). Pulls of the
    /// same bucket at once wait for the one encoding it: it is made once.
    ///
    /// # Errors
    /// [`refit_runtime::Error::Wire`] when the bucket runs past either arena.
    pub(crate) fn bucket(
        &self,
        index: usize,
        spec: &BucketSpec,
        new: &WeightSet,
    ) -> Result<Option<Arc<[u8]>>> {
        let Some(slot) = self.buckets.get(index) else {
            return Ok(None);
        };
        if let Some(done) = slot.get() {
            return Ok(done.clone());
        }
        let (Some(b), Some(n)) = (
            self.base.bytes().get(spec.range()),
            new.bytes().get(spec.range()),
        ) else {
            return Err(refit_runtime::Error::Wire(format!(
                "bucket {index} runs past an arena"
            )));
        };
        // planes split by the element size of the bucket's first tensor
        let width = spec
            .pieces
            .first()
            .and_then(|p| new.manifest().tensors().get(p.tensor))
            .map_or(1, |t| t.dtype.size());
        let made = slot.get_or_init(|| {
            let mut out = Vec::with_capacity(n.len() / 4);
            // the spans are of one length (checked above) and the width a dtype's size, all
            // that `encode` refuses:
            // were it to refuse, the raw bytes go, as for an encoding that does not shrink
            let encoded = elements::encode(b, n, width, &mut out).is_ok();
            (encoded && out.len() < n.len()).then(|| Arc::from(out))
        });
        Ok(made.clone())
    }
}

/// The longest encoding a receiver reads for a bucket of `len` bytes: the raw bytes plus
/// one tag per chunk and the header (an encoding is never sent when it is larger than the
/// raw bytes, so anything past this is a malformed header).
pub(crate) fn max_encoded(len: usize) -> usize {
    len + len / elements::CHUNK + 16
}
