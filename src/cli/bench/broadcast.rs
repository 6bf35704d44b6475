//! `refit bench --transports broadcast`: the broadcast transport on the CPU collective, rank 0
//! here and N receiver processes forming the chain, against raw loopback TCP.

use std::sync::Arc;

use refit::runtime::node::{ClusterToken, Node, Store, StoreClient};
use refit::runtime::{Manifests, ReceiverInit, WeightSet, wire};
use refit::transports::broadcast::{BroadcastConfig, BroadcastReceiver, BroadcastSender};
use refit::transports::collective::{CpuConfig, Rendezvous};
use serde::{Deserialize, Serialize};

use super::{
    Baselines, BenchArgs, BoxResult, LoanSlots, Row, WAIT, bench_token, drain,
    with_receiver_processes,
};

/// What a receiver process needs: where the store is and which group to join (no secret;
/// the token comes in the environment).
#[derive(Serialize, Deserialize)]
struct Join {
    store: std::net::SocketAddr,
    group: String,
    bucket_size: usize,
}

fn config(group: &str, bucket_size: usize) -> BroadcastConfig {
    BroadcastConfig {
        bucket_size,
        ..BroadcastConfig::new(group)
    }
}

/// One configuration: `n` receiver processes, the timed updates of `weights`.
pub(super) fn bench(
    weights: &mut Arc<WeightSet>,
    n: usize,
    args: &BenchArgs,
    base: &Baselines,
) -> BoxResult<Vec<Row>> {
    let manifest = Arc::clone(weights.manifest());
    let size = manifest.total_len();
    let manifests = Manifests::new([(weights.model().clone(), manifest)])?;
    let node = Node::loopback(bench_token().clone())?;
    Store::serve(&node);
    let store: Arc<dyn Rendezvous> = Arc::new(StoreClient::connect(&node, node.addr(), WAIT)?);
    let join = Join {
        store: node.addr(),
        group: format!("bench/{}/{size}/{n}", std::process::id()),
        bucket_size: 4 << 20,
    };
    let members = (1..=n).map(|i| format!("b{i}")).collect();
    let transport = BroadcastSender::new(
        CpuConfig::new(bench_token().clone()),
        store,
        config(&join.group, join.bucket_size),
        members,
    )?;
    let token = wire::to_token(&join)?;
    let times = with_receiver_processes(
        transport,
        manifests,
        &["bcast-recv", &token],
        n,
        weights,
        false,
        Some(args),
    )?;
    Ok(times.rows("broadcast (cpu chain)", size, n, ("tcp-loopback", base.tcp)))
}

/// The receiver process: takes the next free member name from the store's counter, joins
/// and applies every version until rank 0 leaves.
pub(super) fn child(target: &str) -> BoxResult<()> {
    let join: Join = wire::from_token(target)?;
    let token = ClusterToken::from_env()?.ok_or("REFIT_TOKEN is not set")?;
    let node = Node::loopback(token.clone())?;
    let client = StoreClient::connect(&node, join.store, WAIT)?;
    let k = client.add(&format!("{}/next-member", join.group), 1)?;
    let store: Arc<dyn Rendezvous> = Arc::new(client);
    let r = BroadcastReceiver::new(
        CpuConfig::new(token),
        store,
        config(&join.group, join.bucket_size),
        format!("b{k}"),
    )?;
    drain(ReceiverInit::new(r, None).connect(WAIT)?)
}

impl LoanSlots for BroadcastSender<CpuConfig> {
    fn loan_slot(&mut self, _: &WeightSet, _: std::time::Instant) -> BoxResult<WeightSet> {
        Err("the broadcast transport does not lend slots".into())
    }
}
