//! Ranks: processes expanded by their replicas, in file order, and the transport of a link.

use super::schema::{HostSection, LinkTransport, ProcessSection, Reach, Role, TransportKind};

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
    /// Rollout worker actors per model (0 without the `rollout` role).
    pub rollout_workers: u32,
}

impl RankPlan {
    /// True when this rank holds `role`.
    pub fn has(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }
}

/// Every rank, in order.
pub(crate) fn expand(processes: &[ProcessSection], hosts: &[HostSection]) -> Vec<RankPlan> {
    let mut ranks = Vec::new();
    for p in processes {
        let host = hosts
            .iter()
            .find(|h| h.name == p.host)
            .cloned()
            .unwrap_or_else(HostSection::local);
        let rollout_workers = if p.has(Role::Rollout) {
            p.rollout_workers.unwrap_or(1)
        } else {
            0
        };
        for replica in 0..p.replicas {
            ranks.push(RankPlan {
                rank: u32::try_from(ranks.len()).unwrap_or(u32::MAX),
                process: p.name.clone(),
                replica,
                host: host.clone(),
                roles: p.roles.clone(),
                rollout_workers,
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
