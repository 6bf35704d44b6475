//! Delta updates: only the tensors (or fixed-size blocks of them) whose bytes changed since a
//! base version, with a full update every K versions.
//!
//! Changes *overwrite* bytes (no XOR), so applying a delta is idempotent; each change carries
//! its xxh3, and the delta carries the xxh3 of the whole resulting arena, which the receiver
//! checks before it exposes the result.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Mismatch, Result};
use crate::ids::{ModelId, Version};
use crate::weights::WeightSet;

mod buckets;
pub mod elements;
pub use buckets::BucketDelta;

/// What a change covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Granularity {
    /// A change is a whole tensor.
    Tensor,
    /// A change is one block of this many bytes of a tensor (the last block of a tensor may be
    /// shorter).
    Block(usize),
}

/// The new bytes of one changed tensor or block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// Position of the tensor in the manifest.
    pub tensor: usize,
    /// Block index inside the tensor (0 with [`Granularity::Tensor`]).
    pub block: usize,
    /// The new bytes.
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
    /// xxh3-64 of `bytes`.
    pub checksum: u64,
}

/// The difference between a base version and a new one of the same model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    /// The model.
    pub model: ModelId,
    /// The version the delta applies to.
    pub base: Version,
    /// The version it produces.
    pub version: Version,
    /// Schema hash of the manifest (both versions share it).
    pub schema_hash: u64,
    /// What one change covers.
    pub granularity: Granularity,
    /// The changed tensors or blocks, in arena order.
    pub changed: Vec<Change>,
    /// xxh3-64 of the whole arena of the new version.
    pub result_checksum: u64,
}

impl Delta {
    /// Computes the delta from `base` to `new`.
    ///
    /// # Errors
    /// A schema error when the manifests differ; [`Error::StaleVersion`] when `new` is not
    /// newer than `base`; [`Error::Strategy`] for a zero block size or another model.
    pub fn encode(base: &WeightSet, new: &WeightSet, granularity: Granularity) -> Result<Self> {
        if base.model() != new.model() {
            return Err(Error::Strategy(format!(
                "delta between model `{}` and model `{}`",
                base.model(),
                new.model()
            )));
        }
        base.manifest()
            .check_same_schema(new.model(), new.manifest())?;
        if new.version() <= base.version() {
            return Err(Error::StaleVersion {
                model: new.model().clone(),
                offered: new.version(),
                current: base.version(),
            });
        }
        if granularity == Granularity::Block(0) {
            return Err(Error::Strategy("delta block size 0".into()));
        }
        let mut changed = Vec::new();
        for (t, (old, cur)) in base.tensors().zip(new.tensors()).enumerate() {
            let block = match granularity {
                Granularity::Tensor => cur.bytes().len().max(1),
                Granularity::Block(n) => n,
            };
            for (b, (o, c)) in old
                .bytes()
                .chunks(block)
                .zip(cur.bytes().chunks(block))
                .enumerate()
            {
                if o != c {
                    changed.push(Change {
                        tensor: t,
                        block: b,
                        bytes: c.to_vec(),
                        checksum: crate::hash::xxh3_64(c),
                    });
                }
            }
        }
        Ok(Self {
            model: new.model().clone(),
            base: base.version(),
            version: new.version(),
            schema_hash: new.manifest().schema_hash(),
            granularity,
            changed,
            result_checksum: crate::hash::xxh3_64(new.bytes()),
        })
    }

    /// Bytes of tensor data the delta carries.
    pub fn carried_bytes(&self) -> usize {
        self.changed.iter().map(|c| c.bytes.len()).sum()
    }

    /// Produces the new version from `base`, checking everything before the result is
    /// returned (`base` itself is not touched).
    ///
    /// # Errors
    /// [`Error::DeltaBase`] when `base` is not the delta's base version; a schema error when
    /// the manifests differ; [`Error::Tensor`] naming the tensor when a change is out of range
    /// or its checksum fails, or (with `<arena>`) when the result does not hash to
    /// `result_checksum` (the base held other bytes than the sender's).
    pub fn apply(&self, base: &WeightSet) -> Result<WeightSet> {
        if base.version() != self.base || base.model() != &self.model {
            return Err(Error::DeltaBase {
                model: self.model.clone(),
                base: self.base,
                version: self.version,
                held: Some(base.version()),
            });
        }
        if base.manifest().schema_hash() != self.schema_hash {
            return Err(Error::Schema {
                model: self.model.clone(),
                expected: base.manifest().schema_hash(),
                found: self.schema_hash,
            });
        }
        let specs = base.manifest().tensors();
        let mut out = base.to_owned_copy();
        let arena = out.bytes_mut()?;
        for c in &self.changed {
            let spec = specs.get(c.tensor).ok_or_else(|| {
                Error::Strategy(format!(
                    "delta names tensor #{}, the manifest has {}",
                    c.tensor,
                    specs.len()
                ))
            })?;
            let block = match self.granularity {
                Granularity::Tensor => spec.len,
                Granularity::Block(n) => n,
            };
            let start = c.block.saturating_mul(block);
            let want = spec.len.saturating_sub(start).min(block);
            if want == 0 && spec.len != 0 || c.bytes.len() != want {
                return Err(Error::tensor(
                    &self.model,
                    &spec.name,
                    Mismatch::Size {
                        expected: want,
                        found: c.bytes.len(),
                    },
                ));
            }
            let found = crate::hash::xxh3_64(&c.bytes);
            if found != c.checksum {
                return Err(Error::tensor(
                    &self.model,
                    &spec.name,
                    Mismatch::Checksum {
                        expected: c.checksum,
                        found,
                    },
                ));
            }
            let at = spec.offset + start;
            arena[at..at + want].copy_from_slice(&c.bytes);
        }
        let found = crate::hash::xxh3_64(arena);
        if found != self.result_checksum {
            return Err(Error::tensor(
                &self.model,
                "<arena>",
                Mismatch::Checksum {
                    expected: self.result_checksum,
                    found,
                },
            ));
        }
        out.set_version(self.version);
        Ok(out)
    }
}

/// Decides, per version, whether a full update or a delta is sent.
///
/// The first update is full, then every `full_every`-th one (an anchor a new or lost receiver
/// can start from); in between, a delta, unless it would carry more than `max_fraction` of
/// the arena (then full is cheaper).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaPolicy {
    /// A full update every this many updates (1 = always full).
    pub full_every: u64,
    /// Largest share of the arena a delta may carry before a full update is sent instead.
    pub max_fraction: f64,
    /// What one change covers.
    pub granularity: Granularity,
}

impl Default for DeltaPolicy {
    fn default() -> Self {
        Self {
            full_every: 10,
            max_fraction: 0.5,
            granularity: Granularity::Block(64 * 1024),
        }
    }
}

impl DeltaPolicy {
    /// True when update number `sent` (0-based, counted since the sender started) is full.
    pub fn is_full(&self, sent: u64) -> bool {
        self.full_every <= 1 || sent.is_multiple_of(self.full_every)
    }
}

/// What the sender ships for one version.
#[derive(Debug, Clone)]
pub enum Outgoing {
    /// The whole weight set.
    Full(Arc<WeightSet>),
    /// Only what changed since the previous version.
    Delta(Delta),
}

impl Outgoing {
    /// Bytes of tensor data this update carries.
    pub fn carried_bytes(&self) -> usize {
        match self {
            Self::Full(w) => w.manifest().payload_len(),
            Self::Delta(d) => d.carried_bytes(),
        }
    }
}

/// Sender side: keeps the last version sent as the base and applies a [`DeltaPolicy`].
#[derive(Debug)]
pub struct DeltaEncoder {
    policy: DeltaPolicy,
    base: Option<Arc<WeightSet>>,
    sent: u64,
    carried: u64,
}

impl DeltaEncoder {
    /// An encoder with no base yet (its first update is full).
    pub fn new(policy: DeltaPolicy) -> Self {
        Self {
            policy,
            base: None,
            sent: 0,
            carried: 0,
        }
    }

    /// The update to send for `new`, which becomes the next base.
    ///
    /// # Errors
    /// As [`Delta::encode`].
    pub fn next(&mut self, new: Arc<WeightSet>) -> Result<Outgoing> {
        let out = match &self.base {
            Some(base) if !self.policy.is_full(self.sent) => {
                let d = Delta::encode(base, &new, self.policy.granularity)?;
                let limit = self.policy.max_fraction * new.manifest().payload_len() as f64;
                if d.carried_bytes() as f64 > limit {
                    Outgoing::Full(Arc::clone(&new))
                } else {
                    Outgoing::Delta(d)
                }
            }
            _ => Outgoing::Full(Arc::clone(&new)),
        };
        self.carried += out.carried_bytes() as u64;
        self.sent += 1;
        self.base = Some(new);
        Ok(out)
    }

    /// Total bytes of tensor data carried so far.
    pub fn carried_bytes(&self) -> u64 {
        self.carried
    }
}

/// Receiver side: holds the current version and applies full updates and deltas.
#[derive(Debug)]
pub struct DeltaReceiver {
    model: ModelId,
    current: Option<Arc<WeightSet>>,
}

impl DeltaReceiver {
    /// A receiver holding nothing yet (it needs a full update first).
    pub fn new(model: ModelId) -> Self {
        Self {
            model,
            current: None,
        }
    }

    /// The version held.
    pub fn current(&self) -> Option<&Arc<WeightSet>> {
        self.current.as_ref()
    }

    /// Applies an update and returns the new current version.
    ///
    /// # Errors
    /// [`Error::DeltaBase`] naming both bases when a delta's base is not the version held;
    /// [`Error::StaleVersion`] when the update is not newer; the errors of [`Delta::apply`].
    /// On error the version held is unchanged.
    pub fn apply(&mut self, update: &Outgoing) -> Result<Arc<WeightSet>> {
        let next = match update {
            Outgoing::Full(w) => Arc::clone(w),
            Outgoing::Delta(d) => {
                let Some(held) = self.current.as_ref().filter(|c| c.version() == d.base) else {
                    return Err(Error::DeltaBase {
                        model: self.model.clone(),
                        base: d.base,
                        version: d.version,
                        held: self.current.as_ref().map(|c| c.version()),
                    });
                };
                Arc::new(d.apply(held)?)
            }
        };
        if let Some(cur) = &self.current
            && next.version() <= cur.version()
        {
            return Err(Error::StaleVersion {
                model: self.model.clone(),
                offered: next.version(),
                current: cur.version(),
            });
        }
        self.current = Some(Arc::clone(&next));
        Ok(next)
    }
}

#[cfg(test)]
mod tests;
