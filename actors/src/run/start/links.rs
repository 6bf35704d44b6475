//! The weight links' starter: the trainers' senders and the engines' inlets connect
//! together (a broadcast sender waits for its receivers), each on a blocking thread.

use std::sync::Arc;

use refit_runtime::{Manifest, Manifests};
use refit_transports::link::{self, ReceiverSpec};

use crate::error::{Error, Result};
use crate::learner::Learner;
use crate::link::{WeightInlet, WeightOutlet};
use crate::roles::ModelSpec;
use crate::run::ids::{RANK_LOG, weights_key};
use crate::run::mesh::MeshInlet;
use crate::run::weights;

use super::RankCtx;
use super::trainer::OpenedModel;

/// A model this rank trains, connected: its learner and its outlet.
pub(crate) type ModelOutlet = (ModelSpec, Box<dyn Learner>, Box<dyn WeightOutlet>);

/// A model this rank's engine serves, connected: its inlet.
pub(crate) type ModelInlet = (ModelSpec, Box<dyn WeightInlet>);

/// The connected links of a rank.
pub(crate) struct Links {
    /// Per model this rank trains: its learner and its outlet.
    pub(crate) outlets: Vec<ModelOutlet>,
    /// Per model this rank's engine serves: its inlet (wrapped, when the run wraps them).
    pub(crate) inlets: Vec<ModelInlet>,
    /// Per model this rank's engine serves: what its inlet lands and reads off the wire,
    /// where the transport counts it.
    pub(crate) meters: Vec<(
        refit_runtime::ModelId,
        std::sync::Arc<dyn refit_runtime::WireMeter>,
    )>,
}

/// Connects the senders of `opened` and an inlet for every model this rank's engine
/// serves (from the receiver specs its trainer published), all at once.
///
/// # Errors
/// The roles' engine layout; a transport the trainer did not open; a link that does not
/// connect within `run.wait_s`.
pub(crate) async fn connect(ctx: &RankCtx, opened: Vec<OpenedModel>) -> Result<Links> {
    let wait = ctx.wait;
    let mut senders = Vec::new();
    for m in opened {
        senders.push(actix_rt::task::spawn_blocking(move || {
            m.links
                .connect(&m.initial, wait)
                .map(|outlet| (m.spec, m.learner, outlet))
        }));
    }
    let receivers = spawn_inlets(ctx)?;
    let mut outlets = Vec::new();
    for t in senders {
        outlets.push(
            t.await
                .map_err(|e| Error::Actor(format!("{}: connecting a sender: {e}", ctx.who)))??,
        );
    }
    let (mut inlets, mut meters) = (Vec::new(), Vec::new());
    for t in receivers {
        let (spec, inlet) = t
            .await
            .map_err(|e| Error::Actor(format!("{}: connecting an inlet: {e}", ctx.who)))??;
        meters.extend(inlet.meter().map(|m| (spec.id.clone(), m)));
        let inlet = match &ctx.setup.wrap_inlet {
            Some(w) => w(inlet),
            None => inlet,
        };
        inlets.push((spec, inlet));
    }
    Ok(Links {
        outlets,
        inlets,
        meters,
    })
}

/// A connect in flight, on a blocking thread.
type Connecting<T> = actix_rt::task::JoinHandle<Result<T>>;

/// Starts connecting an inlet for every model this rank's engine serves.
fn spawn_inlets(ctx: &RankCtx) -> Result<Vec<Connecting<ModelInlet>>> {
    let (topo, me, wait) = (&ctx.setup.topo, ctx.me, ctx.wait);
    let engines = ctx.setup.specs.iter().filter(|s| {
        ctx.plan
            .serves(refit_runtime::topology::Role::Engine, &s.id)
    });
    let mut receivers = Vec::new();
    for spec in engines {
        let layout = ctx.setup.work.engine_manifest(spec)?;
        if topo.publishes_over_mesh(&spec.id) {
            let shards = topo.trainer_ranks(&spec.id).len();
            receivers.push(spawn_mesh_inlet(ctx, spec, layout, shards));
            continue;
        }
        let expected = Manifests::new([(spec.id.clone(), layout)])?;
        let trainer = topo.trainer_ranks(&spec.id).first().copied().unwrap_or(0);
        let wanted = link::for_kind(&topo.weights_transport(&spec.id, trainer, me))?.name();
        let (rv, node) = (ctx.rv.clone(), ctx.node.clone());
        let (spec, who, deltas) = (spec.clone(), ctx.who.clone(), topo.links.delta);
        let apply = spec.apply;
        receivers.push(actix_rt::task::spawn_blocking(move || {
            let links: Vec<ReceiverSpec> = rv.take(&weights_key(&spec.id), wait)?;
            let link = links
                .iter()
                .find(|l| l.transport() == wanted)
                .ok_or_else(|| {
                    Error::Config(format!(
                        "{who}: the trainer of model `{}` opened no {wanted} link",
                        spec.id
                    ))
                })?;
            let inlet =
                weights::connect_inlet(&spec.id, link, &node, expected, wait, deltas, apply)?;
            tracing::info!(target: RANK_LOG,
                "{who}: pid {}, model `{}` weights over {wanted}, {}",
                std::process::id(),
                spec.id,
                apply.as_str()
            );
            Ok::<_, Error>((spec, inlet))
        }));
    }
    Ok(receivers)
}

/// Starts connecting the mesh inlet of `spec`, published by its `shards` shards.
fn spawn_mesh_inlet(
    ctx: &RankCtx,
    spec: &ModelSpec,
    layout: Arc<Manifest>,
    shards: usize,
) -> Connecting<ModelInlet> {
    let (rv, node, wait) = (ctx.rv.clone(), ctx.node.clone(), ctx.wait);
    let (spec, who) = (spec.clone(), ctx.who.clone());
    actix_rt::task::spawn_blocking(move || {
        let inlet = MeshInlet::connect(&rv, &node, &spec.id, layout, shards, wait)?;
        tracing::info!(target: RANK_LOG,
            "{who}: pid {}, model `{}` weights over the mesh, from all {shards} trainer shards at \
             once",
            std::process::id(),
            spec.id
        );
        Ok::<_, Error>((spec, Box::new(inlet) as Box<dyn WeightInlet>))
    })
}
