//! The broadcast transport in the link factory, on the CPU collective: the sender end serves
//! a rendezvous store on a node of its own and names `expected_receivers` members; each
//! receiver end takes the next free member name from the store's counter.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;

use refit_node::{ClusterToken, Node, NodeConfig, Store, StoreClient};
use refit_runtime::{Error, Manifests, ReceiverTransport, Result};
use serde::{Deserialize, Serialize};

use super::{BroadcastConfig, BroadcastReceiver, BroadcastSender};
use crate::collective::{CpuConfig, Rendezvous};
use crate::link::{LinkFactory, LinkOptions, OpenedLink, Reach, ReceiverSpec};

/// Broadcast (CPU chain) in the link factory.
#[derive(Debug, Clone, Copy)]
pub struct BroadcastLink;

/// What a receiver needs: the store and the group (no secret).
#[derive(Debug, Serialize, Deserialize)]
struct Params {
    store: SocketAddr,
    group: String,
    bucket_size: usize,
}

const CONNECT: std::time::Duration = std::time::Duration::from_secs(30);

impl LinkFactory for BroadcastLink {
    fn name(&self) -> &'static str {
        "broadcast"
    }
    fn open(&self, _manifests: &Manifests, options: &LinkOptions) -> Result<OpenedLink> {
        if options.expected_receivers == 0 {
            return Err(Error::Config(
                "the broadcast transport needs its receiver count (expected_receivers)".into(),
            ));
        }
        let token = match options.token_or_env()? {
            Some(t) => t,
            None => ClusterToken::random(),
        };
        // listen where the rank's node is reached (its advertised address: the node itself
        // may listen on 0.0.0.0)
        let ip = options
            .node
            .as_ref()
            .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |n| n.advertised().ip());
        let node =
            Node::start(NodeConfig::loopback(token.clone()).with_bind(SocketAddr::new(ip, 0)))?;
        Store::serve(&node);
        let store: Arc<dyn Rendezvous> =
            Arc::new(StoreClient::connect(&node, node.addr(), CONNECT)?);
        let params = Params {
            store: node.addr(),
            group: format!("link/{}", uuid::Uuid::new_v4().simple()),
            bucket_size: BroadcastConfig::new("").bucket_size,
        };
        let members = (1..=options.expected_receivers)
            .map(|i| format!("b{i}"))
            .collect();
        let config = BroadcastConfig {
            bucket_size: params.bucket_size,
            ..BroadcastConfig::new(params.group.clone())
        };
        let sender =
            BroadcastSender::new(CpuConfig::new(token).with_bind(ip), store, config, members)?;
        let about = format!("group {} with its store at {}", params.group, params.store);
        Ok(OpenedLink {
            spec: ReceiverSpec::new(self, &params, about)?,
            sender: Box::new(sender.keeping(node)),
            leftovers: Vec::new(),
        })
    }
    fn about(&self) -> &'static str {
        "processes on any hosts: rank 0 broadcasts every bucket once down a chain of receivers"
    }
    fn receiver(&self, spec: &ReceiverSpec, o: &LinkOptions) -> Result<Box<dyn ReceiverTransport>> {
        spec.check_transport(self)?;
        Ok(Box::new(join(spec.params()?, o)?))
    }
    fn reach(&self) -> Reach {
        // the chain runs over TCP: ranks on any hosts that reach each other
        Reach::Network
    }
    fn receivers_copy(&self) -> bool {
        // each receiver assembles versions in arenas of its own
        true
    }
}

/// A receiver end of the group `params` names, under the next free member name.
fn join(params: Params, options: &LinkOptions) -> Result<BroadcastReceiver<CpuConfig>> {
    let Some(token) = options.token_or_env()? else {
        return Err(Error::Config(format!(
            "no cluster token to join the broadcast group at {}: set {} or {}",
            params.store,
            refit_node::TOKEN_ENV,
            refit_node::TOKEN_FILE_ENV
        )));
    };
    // listen where the store's host reaches this process
    let (node, ip) = match &options.node {
        Some(n) => (n.clone(), n.advertised().ip()),
        None => (Node::loopback(token.clone())?, route_to(params.store)),
    };
    let client = StoreClient::connect(&node, params.store, CONNECT)?;
    let k = client.add(&format!("refit/coll/{}/next-member", params.group), 1)?;
    let config = BroadcastConfig {
        bucket_size: params.bucket_size,
        ..BroadcastConfig::new(params.group)
    };
    let end = BroadcastReceiver::new(
        CpuConfig::new(token).with_bind(ip),
        Arc::new(client),
        config,
        format!("b{k}"),
    )?;
    Ok(end.keeping(node))
}

/// The local address a packet to `to` would leave from (no packet is sent); loopback when
/// there is no route.
fn route_to(to: SocketAddr) -> IpAddr {
    let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
    UdpSocket::bind(any)
        .and_then(|s| s.connect(to).and_then(|()| s.local_addr()))
        .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip())
}
