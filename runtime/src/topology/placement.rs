//! Ranks: processes expanded by their replicas, in file order, and the transport of a link.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::schema::{
    DEFAULT_MAX_RESTARTS, HostSection, LinkTransport, ModelSection, ProcessSection, Reach, Restart,
    Role, RunSection, TransportKind,
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
    /// Its index among the ranks on its host (`LOCAL_RANK`), in rank order.
    pub local_rank: u32,
    /// How many ranks run on its host (`LOCAL_WORLD_SIZE`).
    pub local_world_size: u32,
    /// The program and its arguments: its process's `command`, else `[run] command`.
    pub command: Vec<String>,
    /// The environment variables its process adds (`env`).
    pub env: BTreeMap<String, String>,
    /// Whether the launcher starts it again when it dies with a failure.
    pub restart: Restart,
    /// How many times it may be restarted (0 with `restart = "never"`).
    pub max_restarts: u32,
    /// The address its node listens on, when not its host's `addr` (`bind`).
    pub bind: Option<IpAddr>,
    /// The fixed port of its node (`port + replica`), when its process names one.
    pub port: Option<u16>,
}

impl RankPlan {
    /// True when this rank holds `role`.
    pub fn has(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }

    /// True when the launcher restarts this rank's process after a failure (its process's
    /// `restart = "on-failure"`).
    pub fn restarts(&self) -> bool {
        self.restart == Restart::OnFailure
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
    run: &RunSection,
    processes: &[ProcessSection],
    hosts: &[HostSection],
    models: &[ModelSection],
) -> Vec<RankPlan> {
    let mut ranks: Vec<RankPlan> = Vec::new();
    let mut on_host: BTreeMap<&str, u32> = BTreeMap::new();
    for p in processes {
        let host_of = |replica: u32| {
            hosts
                .iter()
                .find(|h| h.name == p.host_of(replica))
                .cloned()
                .unwrap_or_else(HostSection::local)
        };
        let rollout_workers = if p.has(Role::Rollout) {
            p.rollout_workers.unwrap_or(0)
        } else {
            0
        };
        let served = p
            .models
            .clone()
            .unwrap_or_else(|| models.iter().map(|m| m.id.clone()).collect());
        let max_restarts = match p.restart {
            Restart::Never => 0,
            Restart::OnFailure => p.max_restarts.unwrap_or(DEFAULT_MAX_RESTARTS),
        };
        for replica in 0..p.replicas {
            let host = host_of(replica);
            let local = on_host.entry(p.host_of(replica)).or_insert(0);
            let local_rank = *local;
            *local += 1;
            ranks.push(RankPlan {
                rank: u32::try_from(ranks.len()).unwrap_or(u32::MAX),
                process: p.name.clone(),
                replica,
                host,
                roles: p.roles.clone(),
                rollout_workers,
                models: served.clone(),
                local_rank,
                local_world_size: 0,
                command: p.command.clone().unwrap_or_else(|| run.command.clone()),
                env: p.env.clone(),
                restart: p.restart,
                max_restarts,
                bind: p.bind.as_deref().and_then(|b| b.trim().parse().ok()),
                port: p
                    .port
                    .and_then(|port| u16::try_from(u32::from(port) + replica).ok()),
            });
        }
    }
    for r in &mut ranks {
        r.local_world_size = on_host.get(r.host.name.as_str()).copied().unwrap_or(1);
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
