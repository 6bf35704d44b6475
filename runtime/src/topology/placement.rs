//! Ranks: processes expanded by their replicas, in file order, and the transport of a link.

use super::schema::{
    HostSection, LinkTransport, ModelSection, ProcessSection, Reach, Role, TransportKind,
};
use crate::ids::ModelId;

/// What one rank runs and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankPlan {
    /// The rank (`0..world_size`).
    pub rank: u32,
    /// The `[[process]]` it is a copy of.
    pub process: String,
    /// Which copy (`0..replicas`).
    pub replica: u32,
    /// The host it runs on.
    pub host: HostSection,
    /// Its roles.
    pub roles: Vec<Role>,
    /// Rollout worker actors per model as the process sets them (0 when it sets none, or
    /// without the `rollout` role); [`Topology::rollout_workers`](super::Topology::rollout_workers)
    /// gives the count a model gets.
    pub rollout_workers: u32,
    /// The models its trainer, engine and rollout roles serve.
    pub models: Vec<ModelId>,
    /// The launcher restarts it after a failure.
    pub restart: bool,
}

impl RankPlan {
    /// True when this rank holds `role`.
    pub fn has(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }

    /// True when the launcher restarts this rank's process after a failure (its process's
    /// `restart = "on-failure"`).
    pub fn restarts(&self) -> bool {
        self.restart
    }

    /// True when this rank holds `role` for `model` (the trainer, engine and rollout roles
    /// serve the process's `models`; the controller and evaluator serve every model).
    pub fn serves(&self, role: Role, model: &ModelId) -> bool {
        self.has(role)
            && match role {
                Role::Trainer | Role::Engine | Role::Rollout => self.models.contains(model),
                Role::Controller | Role::Evaluator => true,
            }
    }
}

/// Every rank, in order.
pub(crate) fn expand(
    processes: &[ProcessSection],
    hosts: &[HostSection],
    models: &[ModelSection],
) -> Vec<RankPlan> {
    let mut ranks = Vec::new();
    for p in processes {
        let host = hosts
            .iter()
            .find(|h| h.name == p.host)
            .cloned()
            .unwrap_or_else(HostSection::local);
        let rollout_workers = if p.has(Role::Rollout) {
            p.rollout_workers.unwrap_or(0)
        } else {
            0
        };
        let served = p
            .models
            .clone()
            .unwrap_or_else(|| models.iter().map(|m| m.id.clone()).collect());
        for replica in 0..p.replicas {
            ranks.push(RankPlan {
                rank: u32::try_from(ranks.len()).unwrap_or(u32::MAX),
                process: p.name.clone(),
                replica,
                host: host.clone(),
                roles: p.roles.clone(),
                rollout_workers,
                models: served.clone(),
                restart: false,
            });
        }
    }
    ranks
}

/// The transport between two ranks: the configured one, or for `auto` the reach the link
/// needs (same rank: one process; same host: one host; else the network).
pub(crate) fn resolve(setting: &LinkTransport, from: &RankPlan, to: &RankPlan) -> TransportKind {
    match setting {
        LinkTransport::Named(n) => TransportKind::Named(n.clone()),
        LinkTransport::Auto if from.rank == to.rank => TransportKind::Nearest(Reach::Process),
        LinkTransport::Auto if from.host.name == to.host.name => {
            TransportKind::Nearest(Reach::Host)
        }
        LinkTransport::Auto => TransportKind::Nearest(Reach::Network),
    }
}
