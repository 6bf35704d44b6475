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
use refit_transports::shm::{ShmConfig, ShmReceiver, ShmReceiverSpec, ShmSender};
use refit_transports::tcp::{
    TcpConfig, TcpEndpoint, TcpReceiver, TcpReceiverConfig, TcpReceiverSpec, TcpSender,
};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::link::{WeightInlet, WeightOutlet};

/// What an engine rank needs to connect its inlet for one model: shipped through the
/// rendezvous store. It holds no secret (a TCP receiver adds the cluster token it was
/// started with).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkSpec {
    /// Attach to this shared-memory board (same host).
    Shm(ShmReceiverSpec),
    /// Register with this TCP sender agent.
    Tcp(TcpEndpoint),
}

impl std::fmt::Display for LinkSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Shm(s) => write!(f, "shm board {}", s.board.display()),
            Self::Tcp(e) => write!(f, "tcp sender agent {} at {}", e.agent, e.addr),
        }
    }
}

impl LinkSpec {
    /// The transport it describes.
    pub fn kind(&self) -> TransportKind {
        match self {
            Self::Shm(_) => TransportKind::Shm,
            Self::Tcp(_) => TransportKind::Tcp,
        }
    }
}

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
    /// One description per transport, for the engine ranks.
    pub specs: Vec<LinkSpec>,
    /// The shared-memory segment files, removed at the end of the run whatever happened
    /// to the trainer that owns the outlet.
    pub segments: Vec<PathBuf>,
}

impl std::fmt::Debug for ModelOutlets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelOutlets")
            .field("specs", &self.specs)
            .field("segments", &self.segments)
            .finish()
    }
}

/// Opens the senders of `initial`'s model for `kinds` (shared memory, TCP on `node`; each
/// once) and
/// makes `initial` available through them; receivers attach later, whenever they come.
///
/// # Errors
/// [`Error::Config`] for the in-process transport (both ends in one process: no link to
/// ship) or no transport; transport errors (a segment that cannot be created, a bad bucket
/// size), naming the model.
pub fn open_outlets(
    node: &Node,
    initial: &WeightSet,
    kinds: &[TransportKind],
    wait: Duration,
) -> Result<ModelOutlets> {
    let model = initial.model().clone();
    let manifests = Manifests::new([(model.clone(), Arc::clone(initial.manifest()))])?;
    let named = |e: refit_runtime::Error, kind: TransportKind| {
        Error::Config(format!("opening the {kind} sender of model `{model}`: {e}"))
    };
    let mut outlets: Vec<Box<dyn WeightOutlet>> = Vec::new();
    let mut specs = Vec::new();
    let mut segments = Vec::new();
    let mut seen: Vec<TransportKind> = Vec::new();
    for kind in kinds {
        if seen.contains(kind) {
            continue;
        }
        seen.push(*kind);
        match kind {
            TransportKind::InProc => {
                return Err(Error::Config(format!(
                    "model `{model}`: an in-process weight link cannot cross processes (put \
                     the engine in the trainer's process, or use shm or tcp)"
                )));
            }
            TransportKind::Shm => {
                let sender = ShmSender::create(&ShmConfig::default(), &manifests)
                    .map_err(|e| named(e, *kind))?;
                specs.push(LinkSpec::Shm(sender.receiver_spec()));
                segments.extend(sender.segment_paths());
                let sender = SenderInit::new(sender, manifests.clone())
                    .connect(vec![initial.clone()], wait)
                    .map_err(|e| named(e, *kind))?;
                outlets.push(Box::new(sender));
            }
            TransportKind::Tcp => {
                let sender = TcpSender::on_node(node, TcpConfig::default(), &manifests)
                    .map_err(|e| named(e, *kind))?;
                specs.push(LinkSpec::Tcp(sender.endpoint()));
                let sender = SenderInit::new(sender, manifests.clone())
                    .connect(vec![initial.clone()], wait)
                    .map_err(|e| named(e, *kind))?;
                outlets.push(Box::new(sender));
            }
        }
    }
    if outlets.is_empty() {
        return Err(Error::Config(format!(
            "model `{model}` has no engine to send weights to"
        )));
    }
    Ok(ModelOutlets {
        outlet: Box::new(FanOut { outlets }),
        specs,
        segments,
    })
}

/// Connects an engine's inlet for `model` from `spec`: attaches to the shared-memory board,
/// or registers with the TCP sender agent from `node` (whose token is the cluster's), and
/// waits (until `wait`) for the version the sender serves now. `expected` is the layout the
/// engine's policy loads; a sender of another layout is refused, naming the tensor.
///
/// # Errors
/// Attaching or registering failing or timing out; a manifest mismatch.
pub fn connect_inlet(
    model: &ModelId,
    spec: &LinkSpec,
    node: &Node,
    expected: Manifests,
    wait: Duration,
) -> Result<Box<dyn WeightInlet>> {
    let named = |e: refit_runtime::Error| {
        Error::Config(format!(
            "connecting the {} inlet of model `{model}`: {e}",
            spec.kind()
        ))
    };
    Ok(match spec {
        LinkSpec::Shm(s) => Box::new(
            ReceiverInit::new(ShmReceiver::new(s.clone()), Some(expected))
                .connect(wait)
                .map_err(named)?,
        ),
        LinkSpec::Tcp(endpoint) => {
            let transport = TcpReceiver::new(TcpReceiverSpec::new(*endpoint, node.token()))
                .with_node(node.clone())
                .with_config(TcpReceiverConfig {
                    call_timeout: wait,
                    ..TcpReceiverConfig::default()
                });
            Box::new(
                ReceiverInit::new(transport, Some(expected))
                    .connect(wait)
                    .map_err(named)?,
            )
        }
    })
}

/// Removes segment files left behind (a trainer thread that has not dropped its sender yet
/// when the run ends); a file already gone is fine.
pub fn remove_segments(paths: &[PathBuf]) {
    for p in paths {
        match std::fs::remove_file(p) {
            Ok(()) => tracing::debug!(path = %p.display(), "removed a shared-memory segment"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %p.display(), "cannot remove a segment: {e}"),
        }
    }
}
