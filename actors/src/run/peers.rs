//! How a rank reaches the others: their nodes, from their cards in the store
//! ([`peer_of`]), and the rollout workers an engine rank serves ([`rollout_refs`]); and
//! [`blocking`], which runs the store's waits and the links' connects off the actor
//! threads.

use std::collections::BTreeMap;
use std::time::Duration;

use refit_node::{Node, Peer};
use refit_runtime::ModelId;
use refit_runtime::topology::Topology;

use crate::error::{Error, Result};
use crate::protocol::rollout::RolloutRef;
use crate::remote::RemoteAddr;

use super::ids::{RankCard, Served, actor_id, rank_key};
use super::rendezvous::Rendezvous;

/// Runs blocking work (store waits, link connects) off the actor threads.
pub(crate) async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    actix_rt::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Actor(format!("{what}: {e}")))?
}

/// The rollout workers rank `rank` serves, reached through `remote`'s connection.
pub(crate) fn rollout_refs(
    topo: &Topology,
    rank: u32,
    remote: &RemoteAddr,
) -> Vec<(ModelId, RolloutRef)> {
    let mut out = Vec::new();
    for m in topo.model_ids() {
        let mi = topo.model_index(&m).unwrap_or(0);
        for w in 0..topo.rollout_workers(rank, &m) as usize {
            let r = remote.at(
                actor_id(Served::Rollout, rank, mi, w),
                format!("rollout worker {w} of `{m}` on rank {rank}"),
            );
            out.push((m.clone(), RolloutRef::remote(&r)));
        }
    }
    out
}

/// The connection to rank `r`'s node (from its card), made once.
pub(crate) async fn peer_of(
    rv: &Rendezvous,
    node: &Node,
    peers: &mut BTreeMap<u32, Peer>,
    r: u32,
    wait: Duration,
) -> Result<Peer> {
    if let Some(p) = peers.get(&r) {
        return Ok(p.clone());
    }
    let key = rank_key(r);
    let rv2 = rv.clone();
    let card: RankCard = blocking("waiting for a rank", move || rv2.take(&key, wait)).await?;
    let card = card.checked(r)?;
    let peer = node.connect_async(card.node, wait).await.map_err(|e| {
        Error::Config(format!(
            "rank {r}: its node at {} is not reachable: {e}",
            card.node
        ))
    })?;
    peers.insert(r, peer.clone());
    Ok(peer)
}
