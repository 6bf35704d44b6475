//! Shard 0's assembly of one model's versions: every shard writes its part of the arena
//! (its byte range of a [`ShardedBuffer`]) in chunks, in order; a version closes only once
//! every shard wrote all of its part, and a shard whose chunk carries another version,
//! another layout, or falls outside its part is refused whole (its earlier chunks of the
//! version no longer count), naming it.
//!
//! Plain code: no actors, no sockets.

use std::ops::Range;
use std::sync::Arc;

use refit_runtime::sharded::{ShardWriter, ShardedBuffer};
use refit_runtime::{Manifest, ModelId, Version, WeightSet};

use crate::error::{Error, Result};

/// One chunk of a shard's part.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunk<'a> {
    /// The version of the export the bytes come from.
    pub(crate) version: Version,
    /// The writing shard.
    pub(crate) shard: usize,
    /// The schema hash of the export's manifest.
    pub(crate) schema: u64,
    /// Where the bytes go in the arena.
    pub(crate) offset: usize,
    /// The bytes.
    pub(crate) bytes: &'a [u8],
}

/// Where one shard's part of the open version stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    /// `written` bytes from the start of its range came (`started`: at least one chunk).
    Writing { written: usize, started: bool },
    /// Every byte of its range came.
    Written,
    /// Refused: why.
    Refused(String),
}

/// The versions of one model, assembled from the parts its shards write; see the
/// [module docs](self).
#[derive(Debug)]
pub(crate) struct Assembly {
    model: ModelId,
    /// The rank of each shard (for messages).
    ranks: Vec<u32>,
    buffer: ShardedBuffer,
    writers: Vec<ShardWriter>,
    schema: u64,
    total: usize,
    /// The version being written, if one is open.
    open: Option<Version>,
    parts: Vec<Part>,
    /// The last version closed.
    closed: Version,
}

impl Assembly {
    /// An assembly of `model`'s arenas of `manifest`, one shard per entry of `ranks` (the
    /// ranks holding them, shard 0 first); `closed` is the version already served (the
    /// first one opened must be newer).
    ///
    /// # Errors
    /// No shard.
    pub(crate) fn new(
        model: ModelId,
        manifest: Arc<Manifest>,
        ranks: Vec<u32>,
        closed: Version,
    ) -> Result<Self> {
        let schema = manifest.schema_hash();
        let total = manifest.total_len();
        let buffer = ShardedBuffer::new(model.clone(), manifest, ranks.len())?;
        let writers = (0..ranks.len())
            .map(|s| buffer.writer(s))
            .collect::<refit_runtime::Result<Vec<_>>>()?;
        Ok(Self {
            model,
            parts: vec![
                Part::Writing {
                    written: 0,
                    started: false
                };
                ranks.len()
            ],
            ranks,
            buffer,
            writers,
            schema,
            total,
            open: None,
            closed,
        })
    }

    /// The last version closed (the one served).
    pub(crate) fn closed(&self) -> Version {
        self.closed
    }

    /// The model.
    pub(crate) fn model(&self) -> &ModelId {
        &self.model
    }

    /// How many shards write each version.
    pub(crate) fn world(&self) -> usize {
        self.ranks.len()
    }

    /// The rank holding shard `shard`.
    pub(crate) fn rank(&self, shard: usize) -> u32 {
        self.ranks.get(shard).copied().unwrap_or(u32::MAX)
    }

    /// The arena bytes shard `shard` writes (empty for a shard that does not exist).
    pub(crate) fn range(&self, shard: usize) -> Range<usize> {
        self.writers.get(shard).map_or(0..0, ShardWriter::range)
    }

    /// The version being written, if one is open.
    pub(crate) fn open_version(&self) -> Option<Version> {
        self.open
    }

    /// The error naming shard `shard` of `version`.
    pub(crate) fn blame(&self, version: Version, shard: usize, reason: impl Into<String>) -> Error {
        Error::Shard {
            model: self.model.clone(),
            version,
            shard,
            rank: self.rank(shard),
            reason: reason.into(),
        }
    }

    /// Opens `version` for writing; every shard starts its part over (a version left
    /// open by a failed update is given up).
    ///
    /// # Errors
    /// A version not newer than the last one closed.
    pub(crate) fn open(&mut self, version: Version) -> Result<()> {
        if version <= self.closed {
            return Err(Error::Runtime(refit_runtime::Error::StaleVersion {
                model: self.model.clone(),
                offered: version,
                current: self.closed,
            }));
        }
        self.open = Some(version);
        self.parts.fill(Part::Writing {
            written: 0,
            started: false,
        });
        Ok(())
    }

    /// Takes one chunk of a shard's part of the open version.
    ///
    /// # Errors
    /// [`Error::Shard`] naming the shard and the open version: no version open, a chunk of
    /// another version or layout, out of order, outside the shard's part, or from a shard
    /// already refused (its whole part is refused then); a shard that does not exist.
    pub(crate) fn write(&mut self, c: Chunk<'_>) -> Result<()> {
        let Some(open) = self.open else {
            return Err(self.blame(
                c.version,
                c.shard,
                "wrote a part while no version is being assembled",
            ));
        };
        if c.shard >= self.world() {
            return Err(self.blame(
                open,
                c.shard,
                format!("does not exist: the trainer has {} shards", self.world()),
            ));
        }
        let range = self.range(c.shard);
        let refusal = match &self.parts[c.shard] {
            Part::Refused(why) => Some(why.clone()),
            _ if c.version != open => Some(format!(
                "exported version {} (every shard exports version {open}); its part is refused",
                c.version
            )),
            _ if c.schema != self.schema => Some(format!(
                "exported another layout (schema hash {:#018x}, the model's is {:#018x}); its \
                 part is refused",
                c.schema, self.schema
            )),
            Part::Written => Some(format!(
                "wrote {} bytes at {} after its whole part {range:?}; its part is refused",
                c.bytes.len(),
                c.offset
            )),
            Part::Writing { written, .. } => {
                let expected = range.start + written;
                let end = c.offset.checked_add(c.bytes.len());
                if c.offset != expected {
                    Some(format!(
                        "wrote at {} where its part {range:?} goes on at {expected}; its part is \
                         refused",
                        c.offset
                    ))
                } else if end.is_none_or(|e| e > range.end) {
                    Some(format!(
                        "wrote {} bytes at {} past the end of its part {range:?}; its part is \
                         refused",
                        c.bytes.len(),
                        c.offset
                    ))
                } else {
                    None
                }
            }
        };
        if let Some(why) = refusal {
            self.parts[c.shard] = Part::Refused(why.clone());
            return Err(self.blame(open, c.shard, why));
        }
        if let Err(e) = self.writers[c.shard].write(c.offset, c.bytes) {
            let why = format!("could not be written: {e}");
            self.parts[c.shard] = Part::Refused(why.clone());
            return Err(self.blame(open, c.shard, why));
        }
        if let Part::Writing { written, started } = &mut self.parts[c.shard] {
            *written += c.bytes.len();
            *started = true;
            if *written == range.len() {
                self.parts[c.shard] = Part::Written;
            }
        }
        Ok(())
    }

    /// Writes shard `shard`'s part from a whole export held in this process (shard 0's).
    ///
    /// # Errors
    /// As [`Assembly::write`]; an export of another model or size refuses the part.
    pub(crate) fn write_export(&mut self, shard: usize, export: &WeightSet) -> Result<()> {
        let range = self.range(shard);
        let open = self.open.unwrap_or(export.version());
        if export.model() != &self.model {
            let why = format!("exported model `{}`; its part is refused", export.model());
            if let Some(p) = self.parts.get_mut(shard) {
                *p = Part::Refused(why.clone());
            }
            return Err(self.blame(open, shard, why));
        }
        let Some(bytes) = export.bytes().get(range.clone()) else {
            let why = format!(
                "exported {} bytes, the model's arena holds {}; its part is refused",
                export.bytes().len(),
                self.total
            );
            if let Some(p) = self.parts.get_mut(shard) {
                *p = Part::Refused(why.clone());
            }
            return Err(self.blame(open, shard, why));
        };
        self.write(Chunk {
            version: export.version(),
            shard,
            schema: export.manifest().schema_hash(),
            offset: range.start,
            bytes,
        })
    }

    /// Records that shard `shard` failed this version outside the assembly (it is gone,
    /// missed the deadline, its learner failed): `why`, unless its part was refused first
    /// (that reason stays).
    pub(crate) fn fail(&mut self, shard: usize, why: impl Into<String>) {
        if let Some(p) = self.parts.get_mut(shard)
            && !matches!(p, Part::Refused(_))
        {
            *p = Part::Refused(why.into());
        }
    }

    /// True when every shard wrote its whole part of the open version.
    #[cfg(test)]
    pub(crate) fn complete(&self) -> bool {
        self.open.is_some() && self.parts.iter().all(|p| *p == Part::Written)
    }

    /// Records that shard `shard` published its part of `version` itself (over the mesh:
    /// nothing of it is written here); a part of another version is refused.
    pub(crate) fn published(&mut self, shard: usize, version: Version) {
        let Some(open) = self.open else { return };
        if let Some(p) = self.parts.get_mut(shard)
            && !matches!(p, Part::Refused(_))
        {
            *p = if version == open {
                Part::Written
            } else {
                Part::Refused(format!(
                    "published version {version} (every shard publishes version {open})"
                ))
            };
        }
    }

    /// Closes the open version once every shard published its part itself
    /// ([`Assembly::published`]): it is served from the shards, not from here.
    ///
    /// # Errors
    /// As [`Assembly::close`].
    pub(crate) fn close_published(&mut self) -> Result<Version> {
        let open = self.check_whole()?;
        self.closed = open;
        self.open = None;
        Ok(open)
    }

    /// Closes the open version once every shard wrote its whole part; answers it (served
    /// from now on, until the next one closes).
    ///
    /// # Errors
    /// [`Error::Shard`] naming the first shard refused, else the first one whose part is
    /// not whole (the version stays open, nothing is served in its place); no version open.
    pub(crate) fn close(&mut self) -> Result<Arc<WeightSet>> {
        let open = self.check_whole()?;
        for w in &self.writers {
            w.finish();
        }
        let closed = self.buffer.close_version(open)?;
        self.closed = open;
        self.open = None;
        Ok(closed)
    }

    /// The open version, once every shard's part of it is whole.
    ///
    /// # Errors
    /// As [`Assembly::close`].
    pub(crate) fn check_whole(&self) -> Result<Version> {
        let Some(open) = self.open else {
            return Err(Error::Config(format!(
                "model `{}`: no version is being assembled",
                self.model
            )));
        };
        if let Some((s, Part::Refused(why))) = self
            .parts
            .iter()
            .enumerate()
            .find(|(_, p)| matches!(p, Part::Refused(_)))
        {
            return Err(self.blame(open, s, why.clone()));
        }
        if let Some((s, p)) = self
            .parts
            .iter()
            .enumerate()
            .find(|(_, p)| **p != Part::Written)
        {
            let why = match p {
                Part::Writing { started: false, .. } => "wrote nothing of its part".to_string(),
                Part::Writing { written, .. } => format!(
                    "wrote {written} of the {} bytes of its part {:?}",
                    self.range(s).len(),
                    self.range(s)
                ),
                _ => "did not write its part".to_string(),
            };
            return Err(self.blame(open, s, why));
        }
        Ok(open)
    }

    /// The version served now (the last one closed), if any.
    #[cfg(test)]
    pub(crate) fn served(&self) -> Option<Arc<WeightSet>> {
        self.buffer.serve()
    }
}

#[cfg(test)]
#[path = "assembly_tests.rs"]
mod tests;
