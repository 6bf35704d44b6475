//! Weight links of a topology spread over processes: on rank 0 one sender per model and
//! transport (shared memory, TCP) behind one outlet; on each engine rank a receiver,
//! connected from a description shipped as bytes through the rendezvous store, as the
//! engine's inlet for that model.
//!
//! One sender serves every receiver of its transport: the shared-memory sender writes each
//! version once into its segments whatever the number of engines on the host; the TCP sender
//! agent serves (and lets receivers relay) each version to the engines of other hosts.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use refit_node::Node;
use refit_runtime::topology::TransportKind;
use refit_runtime::{Manifests, ModelId, ReceiverInit, SenderInit, Version, WeightSet};
use refit_transports::link::{self, LinkOptions, OpenedLink, Reach, ReceiverSpec};

use crate::error::{Error, Result};
use crate::link::{WeightInlet, WeightOutlet};

/// Publishes every version through several outlets (one per transport in use).
struct FanOut {
    outlets: Vec<Box<dyn WeightOutlet>>,
}

impl WeightOutlet for FanOut {
    fn publish(&mut self, weights: Arc<WeightSet>) -> Result<Version> {
        let mut version = weights.version();
        for o in &mut self.outlets {
            version = o.publish(Arc::clone(&weights))?;
        }
        Ok(version)
    }
}

/// The sending ends of one model on rank 0.
pub struct ModelOutlets {
    /// Publishes to every transport in use (hand it to the model's trainer).
    pub outlet: Box<dyn WeightOutlet>,
    /// One receiver spec per transport, for the engine ranks (they pick theirs by
    /// [`ReceiverSpec::transport`]).
    pub specs: Vec<ReceiverSpec>,
    /// Files the links made (shared-memory segments), removed at the end of the run
    /// whatever happened to the trainer that owns the outlet.
    pub leftovers: Vec<PathBuf>,
}

impl std::fmt::Debug for ModelOutlets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelOutlets")
            .field("specs", &self.specs)
            .field("leftovers", &self.leftovers)
            .finish()
    }
}

/// The senders of one model, opened through the link factory but not connected yet: their
/// receiver specs can be shipped first, so transports whose sender waits for its receivers
/// at connect (a broadcast group) find them joining.
pub struct OpenedLinks {
    model: ModelId,
    manifests: Manifests,
    senders: Vec<(&'static str, Box<dyn refit_runtime::SenderTransport>)>,
    /// One receiver spec per transport, for the engine ranks (they pick theirs by
    /// [`ReceiverSpec::transport`]).
    pub specs: Vec<ReceiverSpec>,
    /// Files the links made (shared-memory segments), removed at the end of the run.
    pub leftovers: Vec<PathBuf>,
}

impl std::fmt::Debug for OpenedLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedLinks")
            .field("model", &self.model)
            .field("specs", &self.specs)
            .finish_non_exhaustive()
    }
}

/// Opens the senders of `initial`'s model through the link factory, one per transport of
/// `kinds` (each once, with the number of engine ranks it serves; TCP serves on `node`),
/// without connecting them: see [`OpenedLinks::connect`].
///
/// # Errors
/// [`Error::Config`] for a transport that cannot cross processes (both ends in one process:
/// no link to ship) or no transport; transport errors (a segment that cannot be created, a
/// bad bucket size, a broadcast without receivers), naming the model.
pub fn open_links(
    node: &Node,
    initial: &WeightSet,
    kinds: &[(TransportKind, usize)],
) -> Result<OpenedLinks> {
    let model = initial.model().clone();
    let manifests = Manifests::new([(model.clone(), Arc::clone(initial.manifest()))])?;
    let mut senders = Vec::new();
    let mut specs: Vec<ReceiverSpec> = Vec::new();
    let mut leftovers = Vec::new();
    for (kind, receivers) in kinds {
        let factory = link::for_kind(kind)?;
        if specs.iter().any(|s| s.transport() == factory.name()) {
            continue;
        }
        if factory.reach() == Reach::Process {
            return Err(Error::Config(format!(
                "model `{model}`: an {} weight link cannot cross processes (put the engine \
                 in the trainer's process, or use a transport that reaches other processes)",
                factory.name()
            )));
        }
        let options = LinkOptions {
            node: Some(node.clone()),
            expected_receivers: *receivers,
            ..LinkOptions::default()
        };
        let opened = factory.open(&manifests, &options).map_err(|e| {
            Error::Config(format!(
                "opening the {} sender of model `{model}`: {e}",
                factory.name()
            ))
        })?;
        specs.push(opened.spec);
        leftovers.extend(opened.leftovers);
        senders.push((factory.name(), opened.sender));
    }
    if senders.is_empty() {
        return Err(Error::Config(format!(
            "model `{model}` has no engine to send weights to"
        )));
    }
    Ok(OpenedLinks {
        model,
        manifests,
        senders,
        specs,
        leftovers,
    })
}

impl OpenedLinks {
    /// Connects every sender with `initial` (receivers attach whenever they come; a
    /// broadcast sender waits, until `wait`, for the receivers it was opened for).
    ///
    /// # Errors
    /// A sender failing to connect, naming the transport and the model.
    pub fn connect(self, initial: &WeightSet, wait: Duration) -> Result<ModelOutlets> {
        let model = self.model;
        let mut outlets: Vec<Box<dyn WeightOutlet>> = Vec::new();
        for (name, sender) in self.senders {
            let sender = SenderInit::new(sender, self.manifests.clone())
                .connect(vec![initial.clone()], wait)
                .map_err(|e| {
                    Error::Config(format!("opening the {name} sender of model `{model}`: {e}"))
                })?;
            outlets.push(Box::new(sender));
        }
        Ok(ModelOutlets {
            outlet: Box::new(FanOut { outlets }),
            specs: self.specs,
            leftovers: self.leftovers,
        })
    }
}

/// Opens and connects the senders of `initial`'s model ([`open_links`] then
/// [`OpenedLinks::connect`]), for transports whose senders need no receiver count.
///
/// # Errors
/// As [`open_links`] and [`OpenedLinks::connect`].
pub fn open_outlets(
    node: &Node,
    initial: &WeightSet,
    kinds: &[TransportKind],
    wait: Duration,
) -> Result<ModelOutlets> {
    let kinds: Vec<(TransportKind, usize)> = kinds.iter().map(|k| (k.clone(), 0)).collect();
    open_links(node, initial, &kinds)?.connect(initial, wait)
}

/// Connects an engine's inlet for `model` from `spec` through the link factory (TCP
/// registers from `node`, whose token is the cluster's) and waits (until `wait`) for the
/// version the sender serves now. `expected` is the layout the engine's policy loads; a
/// sender of another layout is refused, naming the tensor.
///
/// # Errors
/// An unknown transport; attaching or registering failing or timing out; a manifest
/// mismatch.
pub fn connect_inlet(
    model: &ModelId,
    spec: &ReceiverSpec,
    node: &Node,
    expected: Manifests,
    wait: Duration,
) -> Result<Box<dyn WeightInlet>> {
    let named = |e: refit_runtime::Error| {
        Error::Config(format!(
            "connecting the {} inlet of model `{model}`: {e}",
            spec.transport()
        ))
    };
    let options = LinkOptions {
        node: Some(node.clone()),
        call_timeout: Some(wait),
        ..LinkOptions::default()
    };
    let transport = spec.receiver(&options).map_err(named)?;
    Ok(Box::new(
        ReceiverInit::new(transport, Some(expected))
            .connect(wait)
            .map_err(named)?,
    ))
}

/// Removes the links' leftovers (a trainer thread that has not dropped its sender yet
/// when the run ends); one already gone is fine.
pub fn remove_leftovers(paths: &[PathBuf]) {
    OpenedLink::cleanup(paths);
}
