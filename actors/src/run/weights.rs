//! Weight links of a run: on a model's trainer rank one sender per transport in use behind
//! one outlet (converting to the engines' layout when the model declares a conversion); on
//! each engine rank a receiver, connected from a spec shipped through the rendezvous store,
//! as the engine's inlet for that model.
//!
//! One sender serves every receiver of its transport: the in-process sender swaps a pointer
//! for an engine beside the trainer, the shared-memory sender writes each version once for
//! every engine of the host, the TCP sender agent serves (and lets receivers relay) each
//! version to the engines of other hosts.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use refit_node::Node;
use refit_runtime::convert::{Conversions, ConvertingSender, Want, Wants};
use refit_runtime::link::connect_applied;
use refit_runtime::topology::{Apply, Deltas, TransportKind};
use refit_runtime::{Manifests, ModelId, ReceiverInit, SenderInit, Version, WeightSet};
use refit_transports::link::{self, LinkOptions, OpenedLink, ReceiverSpec};

use crate::error::{Error, Result};
use crate::link::{WeightInlet, WeightOutlet};

/// Publishes every version through several outlets (one per transport in use).
struct FanOut {
    outlets: Vec<Box<dyn WeightOutlet>>,
}

impl WeightOutlet for FanOut {
    fn publish(&mut self, weights: Arc<WeightSet>) -> refit_runtime::Result<Version> {
        let mut version = weights.version();
        for o in &mut self.outlets {
            version = o.publish(Arc::clone(&weights))?;
        }
        Ok(version)
    }
}

/// The senders of one model, opened through the link factory but not connected yet: their
/// receiver specs can be shipped first, so transports whose sender waits for its receivers
/// at connect (a broadcast group) find them joining.
pub(crate) struct OpenedLinks {
    model: ModelId,
    /// What the trainer publishes (its own layout).
    source: Manifests,
    senders: Vec<(&'static str, Box<dyn refit_runtime::SenderTransport>)>,
    /// One receiver spec per transport, for the engine ranks (they pick theirs by
    /// [`ReceiverSpec::transport`]).
    pub(crate) specs: Vec<ReceiverSpec>,
    /// Files the links made (shared-memory segments), removed at the end of the run.
    pub(crate) leftovers: Vec<PathBuf>,
    /// An outlet that needs no connect (a sharded trainer's mesh part).
    direct: Option<Box<dyn WeightOutlet>>,
}

impl std::fmt::Debug for OpenedLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedLinks")
            .field("model", &self.model)
            .field("specs", &self.specs)
            .finish_non_exhaustive()
    }
}

/// The manifests engines of `initial`'s model load when `want` converts it (its own when
/// `want` is `None`), with the conversions to apply on the send path.
///
/// # Errors
/// A `want` that does not fit the trainer's tensors, naming the rule or tensor.
pub(crate) fn plan(
    initial: &WeightSet,
    want: Option<Want>,
) -> Result<(Manifests, Option<Conversions>)> {
    let model = initial.model().clone();
    let source = Manifests::new([(model.clone(), Arc::clone(initial.manifest()))])?;
    match want {
        None => Ok((source, None)),
        Some(want) => {
            let conversions = Conversions::plan(&source, &Wants::new().model(model.clone(), want))
                .map_err(|e| {
                    Error::Config(format!(
                        "model `{model}`: the engine's layout does not fit the trainer's: {e}"
                    ))
                })?;
            Ok((conversions.target().clone(), Some(conversions)))
        }
    }
}

/// Opens the senders of `initial`'s model through the link factory, one per transport of
/// `kinds` (each once, with the number of engine ranks it serves; TCP serves on `node`),
/// converting to the engines' layout with `conversions`, without connecting them: see
/// [`OpenedLinks::connect`]. `checksum` (`[links] checksum`) has every sender checksum each
/// version for its receivers to verify.
///
/// # Errors
/// No transport; transport errors (a segment that cannot be created, a bad bucket size, a
/// broadcast without receivers), naming the model.
pub(crate) fn open_links(
    node: &Node,
    initial: &WeightSet,
    conversions: Option<&Conversions>,
    kinds: &[(TransportKind, usize)],
    checksum: bool,
) -> Result<OpenedLinks> {
    let model = initial.model().clone();
    let source = Manifests::new([(model.clone(), Arc::clone(initial.manifest()))])?;
    let wire = conversions.map_or_else(|| source.clone(), |c| c.target().clone());
    let mut senders = Vec::new();
    let mut specs: Vec<ReceiverSpec> = Vec::new();
    let mut leftovers = Vec::new();
    for (kind, receivers) in kinds {
        let factory = link::for_kind(kind)?;
        if specs.iter().any(|s| s.transport() == factory.name()) {
            continue;
        }
        let options = LinkOptions {
            node: Some(node.clone()),
            expected_receivers: *receivers,
            checksum,
            ..LinkOptions::default()
        };
        let opened = factory.open(&wire, &options).map_err(|e| {
            Error::Config(format!(
                "opening the {} sender of model `{model}`: {e}",
                factory.name()
            ))
        })?;
        specs.push(opened.spec);
        leftovers.extend(opened.leftovers);
        let sender: Box<dyn refit_runtime::SenderTransport> = match conversions {
            Some(c) => Box::new(ConvertingSender::new(opened.sender, c.clone())),
            None => opened.sender,
        };
        senders.push((factory.name(), sender));
    }
    if senders.is_empty() {
        return Err(Error::Config(format!(
            "model `{model}` has no engine to send weights to"
        )));
    }
    Ok(OpenedLinks {
        model,
        source,
        senders,
        specs,
        leftovers,
        direct: None,
    })
}

impl OpenedLinks {
    /// The links of a model its engines pull from elsewhere (the shards of a mesh): no
    /// sender, no receiver spec; `outlet` is what the trainer publishes through.
    pub(crate) fn direct(model: ModelId, source: Manifests, outlet: Box<dyn WeightOutlet>) -> Self {
        Self {
            model,
            source,
            senders: Vec::new(),
            specs: Vec::new(),
            leftovers: Vec::new(),
            direct: Some(outlet),
        }
    }

    /// Connects every sender with `initial` (receivers attach whenever they come; a
    /// broadcast sender waits, until `wait`, for the receivers it was opened for); answers
    /// the outlet the model's trainer publishes through.
    ///
    /// # Errors
    /// A sender failing to connect, naming the transport and the model.
    pub(crate) fn connect(
        self,
        initial: &WeightSet,
        wait: Duration,
    ) -> Result<Box<dyn WeightOutlet>> {
        let model = self.model;
        let mut outlets: Vec<Box<dyn WeightOutlet>> = Vec::new();
        for (name, sender) in self.senders {
            let sender = SenderInit::new(sender, self.source.clone())
                .connect(vec![initial.clone()], wait)
                .map_err(|e| {
                    Error::Config(format!(
                        "connecting the {name} sender of model `{model}`: {e}"
                    ))
                })?;
            outlets.push(Box::new(sender));
        }
        outlets.extend(self.direct);
        Ok(match outlets.len() {
            1 => outlets.remove(0),
            _ => Box::new(FanOut { outlets }),
        })
    }
}

/// Connects an engine's inlet for `model` from `spec` through the link factory (TCP
/// registers from `node`, whose token is the cluster's) and waits (until `wait`) for the
/// version the sender serves now. `expected` is the layout the engine loads; a sender of
/// another layout is refused, naming the tensor. With `apply = "streaming"` the inlet
/// streams ([`StreamingInlet`](refit_runtime::link::StreamingInlet)): it holds the version
/// in force at connect until the engine's first commit takes it, and no version after.
///
/// # Errors
/// An unknown transport; attaching or registering failing or timing out; a manifest
/// mismatch.
pub(crate) fn connect_inlet(
    model: &ModelId,
    spec: &ReceiverSpec,
    node: &Node,
    expected: Manifests,
    wait: Duration,
    deltas: Deltas,
    apply: Apply,
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
        deltas,
        streaming: apply == Apply::Streaming,
        ..LinkOptions::default()
    };
    let transport = spec.receiver(&options).map_err(named)?;
    let init = ReceiverInit::new(transport, Some(expected));
    connect_applied(init, apply, wait).map_err(named)
}

/// Removes the links' leftovers when dropped (a trainer thread that has not dropped its
/// sender yet when the run ends); one already gone is fine.
#[derive(Debug, Default)]
pub(crate) struct Leftovers(pub(crate) Vec<PathBuf>);

impl Drop for Leftovers {
    fn drop(&mut self) {
        OpenedLink::cleanup(&self.0);
    }
}

#[cfg(test)]
#[path = "weights_tests.rs"]
mod tests;
