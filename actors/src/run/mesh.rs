//! The weight path of a sharded trainer under `links.sharded = "mesh"`: every shard
//! publishes its own part of each version (a flat run of the model's elements,
//! [`flat_shards`]) on a [`MeshSender`] of its rank's node, and every engine pulls each
//! version from all shards at once, straight into its arena ([`MeshInlet`]). Nothing is
//! gathered at shard 0: its outlet (its [`MeshPart`]) publishes shard 0's own part, after
//! every other shard published theirs.
//!
//! A shard's card (its endpoint and parts) goes to the store under
//! [`mesh_card_key`]; the engine ranks read every shard's card to plan their pulls.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use refit_node::Node;
use refit_runtime::mesh::{Parts, extract, flat_shards, wholes};
use refit_runtime::{Manifest, ModelId, Version, WeightSet, WireMeter};
use refit_transports::mesh::{MeshEndpoint, MeshReceiver, MeshSender};

use crate::error::{Error, Result};
use crate::link::{WeightInlet, WeightOutlet};
use crate::run::ids::mesh_card_key;
use crate::run::rendezvous::Rendezvous;

/// One shard's end: serves its part of each version it publishes.
#[derive(Debug)]
pub(crate) struct MeshPart {
    sender: MeshSender,
    manifest: Arc<Manifest>,
    shard: usize,
}

impl MeshPart {
    /// Shard `shard` of `world` of `model` (layout `manifest`): a sender on `node` holding
    /// its flat run of the elements, its card put in the store.
    ///
    /// # Errors
    /// A part that does not fit the manifest; the store failing.
    pub(crate) fn open(
        node: &Node,
        rv: &Rendezvous,
        model: &ModelId,
        manifest: Arc<Manifest>,
        (shard, world): (usize, usize),
    ) -> Result<Self> {
        let parts = flat_shards(&manifest, world)
            .into_iter()
            .nth(shard)
            .unwrap_or_default();
        let sender = MeshSender::on_node(node, model.clone(), &manifest, parts.clone())?;
        rv.put(&mesh_card_key(model, shard), &(sender.endpoint(), parts))?;
        Ok(Self {
            sender,
            manifest,
            shard,
        })
    }

    /// Publishes this shard's part of `export` (cut from the whole export, which every
    /// shard of this trainer computes) under the export's version; answers its bytes.
    ///
    /// # Errors
    /// An export of another layout; a version not newer than the last one published.
    pub(crate) fn publish(&self, export: &WeightSet) -> refit_runtime::Result<u64> {
        if export.manifest().schema_hash() != self.manifest.schema_hash() {
            return Err(refit_runtime::Error::Config(format!(
                "shard {} of model `{}` exported another layout than its mesh part's",
                self.shard,
                export.model()
            )));
        }
        let mut data = Vec::with_capacity(self.sender.parts().len());
        let mut bytes = 0u64;
        for (name, part) in self.sender.parts() {
            let whole = export.tensor(name)?.bytes();
            let cut = extract(&self.manifest, name, part, whole)?;
            bytes += cut.len() as u64;
            data.push(cut);
        }
        self.sender.publish(export.version(), data)?;
        Ok(bytes)
    }
}

/// Shard 0's outlet is its part: it publishes shard 0's part of each version (the other
/// shards published theirs before shard 0 closes the version).
impl WeightOutlet for MeshPart {
    fn publish(&mut self, weights: Arc<WeightSet>) -> refit_runtime::Result<Version> {
        MeshPart::publish(self, &weights)?;
        Ok(weights.version())
    }
}

/// What an engine's mesh inlet pulled: the weight bytes of the versions it landed, and
/// the bytes it read off the wire for them (those, plus a checksum per shard and version).
#[derive(Debug, Default)]
struct Pulled {
    landed: AtomicU64,
    wire: AtomicU64,
}

impl WireMeter for Pulled {
    fn landed(&self) -> u64 {
        self.landed.load(Ordering::Relaxed)
    }
    fn on_wire(&self) -> u64 {
        self.wire.load(Ordering::Relaxed)
    }
}

/// An engine's inlet of a mesh-published model: each version asked for is pulled from
/// every shard at once into an arena of its own, recycled once the engine let it go.
pub(crate) struct MeshInlet {
    model: ModelId,
    manifest: Arc<Manifest>,
    receiver: MeshReceiver,
    /// The version handed out last.
    current: Option<Arc<WeightSet>>,
    /// The one before: its arena is the next pull's once the engine dropped it.
    previous: Option<Arc<WeightSet>>,
    /// An arena of a failed pull (its bytes a mix of versions, never handed out).
    spare: Option<WeightSet>,
    meter: Arc<Pulled>,
}

impl std::fmt::Debug for MeshInlet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshInlet")
            .field("model", &self.model)
            .field("current", &self.current.as_ref().map(|w| w.version()))
            .finish_non_exhaustive()
    }
}

impl MeshInlet {
    /// The inlet of `model` (the engine's layout `manifest`) from its `shards` shards,
    /// whose cards it waits for (until `wait`).
    ///
    /// # Errors
    /// A card that does not come in time; shards whose parts do not cover the engine's
    /// layout exactly once (named by tensor).
    pub(crate) fn connect(
        rv: &Rendezvous,
        node: &Node,
        model: &ModelId,
        manifest: Arc<Manifest>,
        shards: usize,
        wait: Duration,
    ) -> Result<Self> {
        let mut book: Vec<(MeshEndpoint, Parts)> = Vec::with_capacity(shards);
        for s in 0..shards {
            book.push(rv.take(&mesh_card_key(model, s), wait)?);
        }
        let receiver = MeshReceiver::new(&manifest, book, wholes(&manifest), node.token().clone())
            .map_err(|e| Error::Config(format!("the mesh inlet of model `{model}`: {e}")))?;
        Ok(Self {
            model: model.clone(),
            manifest,
            receiver,
            current: None,
            previous: None,
            spare: None,
            meter: Arc::default(),
        })
    }
}

impl WeightInlet for MeshInlet {
    fn fetch(
        &mut self,
        model: &ModelId,
        at_least: Version,
        timeout: Duration,
    ) -> refit_runtime::Result<Arc<WeightSet>> {
        if model != &self.model {
            return Err(refit_runtime::Error::UnknownModel(model.clone()));
        }
        if let Some(c) = self.current.as_ref().filter(|c| c.version() >= at_least) {
            return Ok(Arc::clone(c));
        }
        let mut arena = self
            .previous
            .take()
            .and_then(|a| Arc::try_unwrap(a).ok())
            .or_else(|| self.spare.take())
            .unwrap_or_else(|| WeightSet::zeroed(model.clone(), Arc::clone(&self.manifest)));
        match self.receiver.pull_weights(&mut arena, at_least, timeout) {
            Ok(()) => {
                let payload = self.manifest.payload_len() as u64;
                self.meter.landed.fetch_add(payload, Ordering::Relaxed);
                self.meter
                    .wire
                    .store(self.receiver.bytes_pulled(), Ordering::Relaxed);
                let new = Arc::new(arena);
                self.previous = self.current.replace(Arc::clone(&new));
                Ok(new)
            }
            Err(e) => {
                self.spare = Some(arena);
                Err(e)
            }
        }
    }

    fn applied(&mut self, _: &ModelId, _: Version) -> refit_runtime::Result<()> {
        // the controller tracks what each engine serves; the shards keep their newest
        // versions whatever the engines hold
        Ok(())
    }

    fn meter(&self) -> Option<Arc<dyn WireMeter>> {
        Some(Arc::clone(&self.meter) as Arc<dyn WireMeter>)
    }
}
