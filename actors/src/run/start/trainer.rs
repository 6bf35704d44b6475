//! The trainer's starter, first half: on the first trainer rank of each model, the
//! learner, its first version and its weight links (one sender per transport the engines
//! need), whose receiver specs go to the store for the engine ranks.

use std::sync::Arc;

use refit_runtime::WeightSet;
use refit_runtime::topology::TransportKind;

use crate::error::{Error, Result};
use crate::learner::Learner;
use crate::roles::ModelSpec;
use crate::run::checkpoint;
use crate::run::ids::{RANK_LOG, first_version_key, weights_key};
use crate::run::mesh::MeshPart;
use crate::run::weights::{self, Leftovers, OpenedLinks};

use super::RankCtx;

/// One model this rank trains: its learner, first version and weight links (not
/// connected yet).
pub(crate) struct OpenedModel {
    /// The model.
    pub(crate) spec: ModelSpec,
    /// Its learner.
    pub(crate) learner: Box<dyn Learner>,
    /// Version 1, as the learner exported it.
    pub(crate) initial: WeightSet,
    /// Its senders, opened.
    pub(crate) links: OpenedLinks,
}

/// What [`open`] opened.
#[derive(Default)]
pub(crate) struct Opened {
    /// The models this rank trains (shard 0 of a sharded trainer included).
    pub(crate) models: Vec<OpenedModel>,
    /// Files the links made, removed at the end of the run.
    pub(crate) leftovers: Leftovers,
}

/// Opens every model this rank is the (first) trainer of, and publishes its receiver
/// specs in the store.
///
/// # Errors
/// A restarted rank that holds a trainer; the roles refusing the model; a learner whose
/// first export is not v1 of its own model; a conversion the engines' layout does not
/// fit; a link that cannot be opened.
pub(crate) fn open(ctx: &RankCtx) -> Result<Opened> {
    let trains: Vec<&ModelSpec> = ctx
        .setup
        .specs
        .iter()
        .filter(|s| ctx.setup.topo.trainer_ranks(&s.id).first() == Some(&ctx.me))
        .collect();
    if ctx.rejoining && !trains.is_empty() {
        return Err(Error::Config(format!(
            "{} holds a trainer and cannot rejoin a running run (incarnation {})",
            ctx.who, ctx.setup.incarnation
        )));
    }
    let mut opened = Opened::default();
    for spec in trains {
        let model = open_model(ctx, spec)?;
        opened
            .leftovers
            .0
            .extend(model.links.leftovers.iter().cloned());
        ctx.rv.put(&weights_key(&spec.id), &model.links.specs)?;
        ctx.rv
            .put(&first_version_key(&spec.id), &model.initial.version())?;
        opened.models.push(model);
    }
    Ok(opened)
}

/// The learner of `spec`, its first version, and its links to every engine rank of it.
fn open_model(ctx: &RankCtx, spec: &ModelSpec) -> Result<OpenedModel> {
    let topo = &ctx.setup.topo;
    ctx.setup.work.check(spec, topo.run.seed)?;
    let mut learner = ctx.setup.work.learner(spec)?;
    let resumed = checkpoint::restore(topo, &ctx.who, spec, learner.as_mut())?;
    let initial = crate::run::workload::first_export(learner.as_mut(), spec, resumed)?;
    let want = match topo.model(&spec.id).and_then(|m| m.convert.as_ref()) {
        Some(c) => Some(c.want(&format!("model[{}].convert", spec.id))?),
        None => ctx.setup.work.want(spec)?,
    };
    let (wire, conversions) = weights::plan(&initial, want)?;
    ctx.setup
        .work
        .engine_manifest(spec)?
        .check_same_schema(&spec.id, wire.get(&spec.id)?)?;
    if topo.publishes_over_mesh(&spec.id) {
        if conversions.is_some() {
            return Err(Error::Config(format!(
                "model `{}`: links.sharded = \"mesh\" serves the trainer's layout, and its \
                 engines want another (a conversion); use links.sharded = \"gather\"",
                spec.id
            )));
        }
        let shards = topo.trainer_ranks(&spec.id).len();
        let links = mesh_links(ctx, spec, &initial, wire, shards)?;
        return Ok(OpenedModel {
            spec: spec.clone(),
            learner,
            initial,
            links,
        });
    }
    let mut kinds: Vec<(TransportKind, usize)> = Vec::new();
    for r in topo.engine_ranks_of(&spec.id) {
        let k = topo.weights_transport(&spec.id, ctx.me, r);
        match kinds.iter_mut().find(|(kind, _)| *kind == k) {
            Some((_, n)) => *n += 1,
            None => kinds.push((k, 1)),
        }
    }
    let links = weights::open_links(
        &ctx.node,
        &initial,
        conversions.as_ref(),
        &kinds,
        topo.links.checksum,
    )?;
    for l in &links.specs {
        tracing::info!(target: RANK_LOG,
            "{}: pid {}, model `{}` weights: {l}",
            ctx.who,
            std::process::id(),
            spec.id
        );
    }
    Ok(OpenedModel {
        spec: spec.clone(),
        learner,
        initial,
        links,
    })
}

/// Shard 0's links of `spec` under a mesh: its own part of the model, published now (the
/// first version) and by every later publish of the trainer; no sender, no receiver spec.
fn mesh_links(
    ctx: &RankCtx,
    spec: &ModelSpec,
    initial: &WeightSet,
    wire: refit_runtime::Manifests,
    shards: usize,
) -> Result<OpenedLinks> {
    let manifest = Arc::clone(initial.manifest());
    let part = MeshPart::open(&ctx.node, &ctx.rv, &spec.id, manifest, (0, shards))?;
    part.publish(initial)?;
    tracing::info!(target: RANK_LOG,
        "{}: pid {}, model `{}` weights: shard 0 of {shards} publishes its part over the mesh; \
         engines pull every version from all {shards} shards",
        ctx.who,
        std::process::id(),
        spec.id
    );
    Ok(OpenedLinks::direct(spec.id.clone(), wire, Box::new(part)))
}
