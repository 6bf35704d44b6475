//! Where each role of a run is served: every actor's uuid on its rank's node follows from
//! its role, rank, model and index, so ranks need only each other's node addresses (their
//! cards in the rendezvous store) to reach any actor; the store keys ranks meet at; and
//! the target of a rank's log lines.

use std::net::SocketAddr;

use refit_runtime::ModelId;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::protocol::CONTRACT_VERSION;

/// The kinds of actors a rank serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Served {
    Engine = 1,
    Controller = 2,
    Gate = 3,
    Pool = 4,
    Rollout = 5,
    Evaluator = 6,
    Lead = 7,
    /// A shard of a sharded trainer (shard 0: its assembly; the others: their updates).
    Shard = 8,
}

/// `refit` in the high bytes: ids no user actor picks by chance.
const TAG: u128 = 0x7265_6669_7400_0000_u128 << 64;

/// The uuid of an actor: its kind, the rank serving it, the model's position in the file
/// and an index (a rollout worker's).
pub(crate) fn actor_id(kind: Served, rank: u32, model: usize, index: usize) -> Uuid {
    let model = (model as u128) & 0xffff;
    let index = (index as u128) & 0xffff;
    Uuid::from_u128(TAG | ((kind as u128) << 56) | (u128::from(rank) << 32) | (model << 16) | index)
}

/// The target of a rank's log lines, wherever in `run` they are written (the one its
/// users filter on: `RUST_LOG=refit_actors::run::rank=debug`).
pub(crate) const RANK_LOG: &str = "refit_actors::run::rank";

/// The key rank 0 sets once every rank joined and version 1 serves everywhere: rollouts
/// and drivers start.
pub(crate) const START_KEY: &str = "refit/run/start";

/// The key rank 0 sets when the run is over: the other ranks stop.
pub(crate) const STOP_KEY: &str = "refit/run/stop";

/// The key of rank `r`'s card.
pub(crate) fn rank_key(r: u32) -> String {
    format!("refit/rank/{r}")
}

/// The key rank `r` sets once it saw the stop and released its roles (rank 0 waits for it
/// before it exits, so that the others read the stop rather than a closed connection).
pub(crate) fn bye_key(r: u32) -> String {
    format!("refit/rank/{r}/bye")
}

/// The key of `model`'s receiver specs (one per transport its trainer opened).
pub(crate) fn weights_key(model: &ModelId) -> String {
    format!("refit/weights/{model}")
}

/// The store key of `model`'s first version in this run (1, or the one after the
/// checkpoint it resumed from), set by its trainer rank before its card.
pub(crate) fn first_version_key(model: &ModelId) -> String {
    format!("refit/first-version/{model}")
}

/// The store key of shard `shard`'s mesh card for `model` (`links.sharded = "mesh"`):
/// where its part is served and what it holds, for the engine ranks.
pub(crate) fn mesh_card_key(model: &ModelId, shard: usize) -> String {
    format!("refit/mesh/{model}/{shard}")
}

/// What a rank publishes once it serves its roles.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RankCard {
    /// Its node, where its actors are served.
    pub(crate) node: SocketAddr,
    /// Its process id.
    pub(crate) pid: u32,
    /// 0 for the first start, n after the nth restart.
    pub(crate) incarnation: u32,
    /// The rank contract it speaks ([`CONTRACT_VERSION`]; 0 from a build of before
    /// contract versions).
    #[serde(default)]
    pub(crate) contract: u32,
}

impl RankCard {
    /// This process's card.
    pub(crate) fn ours(node: SocketAddr, incarnation: u32) -> Self {
        Self {
            node,
            pid: std::process::id(),
            incarnation,
            contract: CONTRACT_VERSION,
        }
    }

    /// The card of rank `rank`, refused when it speaks another rank contract than this
    /// build ([`check_contract`]).
    ///
    /// # Errors
    /// [`Error::Config`] naming the rank and both versions.
    pub(crate) fn checked(self, rank: u32) -> Result<Self> {
        check_contract(rank, self.contract)?;
        Ok(self)
    }
}

/// Refuses rank `rank` when it speaks rank contract `theirs`, not this build's, naming both.
///
/// # Errors
/// [`Error::Config`] naming the rank and both versions.
pub(crate) fn check_contract(rank: u32, theirs: u32) -> Result<()> {
    if theirs == CONTRACT_VERSION {
        return Ok(());
    }
    Err(Error::Config(format!(
        "rank {rank} speaks Refit's rank contract v{theirs}, this build v{CONTRACT_VERSION}: \
         every rank's program must come from one Refit build (the refit binary, the \
         examples, the refit Python package)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_card_of_another_contract_is_refused_naming_both() {
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let ours = RankCard::ours(addr, 2);
        assert_eq!(ours.incarnation, 2);
        assert!(ours.clone().checked(1).is_ok());
        let theirs = RankCard {
            contract: CONTRACT_VERSION + 1,
            ..ours
        };
        let e = theirs.checked(3).unwrap_err().to_string();
        let (v, w) = (CONTRACT_VERSION + 1, CONTRACT_VERSION);
        assert!(
            e.contains(&format!("rank 3 speaks Refit's rank contract v{v}"))
                && e.contains(&format!("this build v{w}")),
            "{e}"
        );
        // a card of a build before contract versions reads as v0, and is refused
        #[derive(Serialize)]
        struct Old {
            node: SocketAddr,
            pid: u32,
            incarnation: u32,
        }
        let old = Old {
            node: addr,
            pid: 7,
            incarnation: 0,
        };
        let bytes = refit_runtime::wire::encode(&old).unwrap();
        let card: RankCard = refit_runtime::wire::decode(&bytes, 1 << 10).unwrap();
        let e = card.checked(1).unwrap_err().to_string();
        assert!(e.contains("rank contract v0"), "{e}");
    }

    #[test]
    fn ids_differ_by_every_part_and_are_stable() {
        let a = actor_id(Served::Rollout, 3, 1, 2);
        assert_eq!(a, actor_id(Served::Rollout, 3, 1, 2));
        for b in [
            actor_id(Served::Engine, 3, 1, 2),
            actor_id(Served::Rollout, 4, 1, 2),
            actor_id(Served::Rollout, 3, 0, 2),
            actor_id(Served::Rollout, 3, 1, 3),
        ] {
            assert_ne!(a, b);
        }
    }
}
