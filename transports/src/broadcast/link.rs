//! The broadcast transport in the link factory: the sender end serves a rendezvous store on a
//! node of its own and names `expected_receivers` members; each receiver end takes the next
//! free member name from the store's counter.
//!
//! [`open_group`] and [`join_group`] do this for any [`Connector`]: the `broadcast` link
//! calls them with the CPU collective ([`CpuConfig`]), the `nccl` link
//! ([`crate::nccl::NcclLink`]) with NCCL's options, and the scheme suite runs the `nccl`
//! link's code with the CPU collective.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;

use refit_node::{ClusterToken, Node, NodeConfig, Store, StoreClient};
use refit_runtime::{Error, Manifests, ReceiverTransport, Result};
use serde::{Deserialize, Serialize};

use super::{BroadcastConfig, BroadcastReceiver, BroadcastSender, Connector};
use crate::collective::{CpuConfig, Rendezvous};
use crate::link::{
    LinkFactory, LinkMemory, LinkOptions, LinkTraits, OpenedLink, Reach, ReceiverSpec,
};

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

/// Where an end of a group listens and whom it proves itself to: what a connector is made
/// from ([`open_group`], [`join_group`]).
#[derive(Debug, Clone)]
pub struct GroupEnd {
    /// The cluster token (the CPU collective's hello carries it).
    pub token: ClusterToken,
    /// The local address peers reach this end at.
    pub ip: IpAddr,
}

/// Rank 0 of a broadcast group opened the link factory's way for `link`: a node of its own
/// serving the rendezvous store (on the address of `options.node`, else loopback), members
/// `b1..=bN` for `options.expected_receivers`, buckets of `bucket_size` bytes, and each
/// generation's communicator made by `connector(end)`. The spec names `link`.
///
/// # Errors
/// [`Error::Config`] without a receiver count; the node's and the store's errors.
pub fn open_group<K: Connector>(
    link: &dyn LinkFactory,
    options: &LinkOptions,
    bucket_size: usize,
    connector: impl FnOnce(&GroupEnd) -> K,
) -> Result<(BroadcastSender<K>, ReceiverSpec)> {
    if options.expected_receivers == 0 {
        return Err(Error::Config(format!(
            "the {} transport needs its receiver count (expected_receivers)",
            link.name()
        )));
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
    let node = Node::start(NodeConfig::loopback(token.clone()).with_bind(SocketAddr::new(ip, 0)))?;
    Store::serve(&node);
    let store: Arc<dyn Rendezvous> = Arc::new(StoreClient::connect(&node, node.addr(), CONNECT)?);
    let params = Params {
        store: node.addr(),
        group: format!("link/{}", uuid::Uuid::new_v4().simple()),
        bucket_size,
    };
    let members = (1..=options.expected_receivers)
        .map(|i| format!("b{i}"))
        .collect();
    let config = BroadcastConfig {
        bucket_size: params.bucket_size,
        ..BroadcastConfig::new(params.group.clone())
    };
    let sender = BroadcastSender::new(connector(&GroupEnd { token, ip }), store, config, members)?;
    let about = format!("group {} with its store at {}", params.group, params.store);
    Ok((
        sender.keeping(node),
        ReceiverSpec::new(link, &params, about)?,
    ))
}

/// A receiver end of the group `spec` (made by [`open_group`] for `link`) names, under the
/// next free member name; each generation's communicator is made by `connector(end)`.
/// Nothing but the store's member counter is contacted before `connect`.
///
/// # Errors
/// A spec of another transport or one that does not decode; no cluster token; the store
/// cannot be reached.
pub fn join_group<K: Connector>(
    link: &dyn LinkFactory,
    spec: &ReceiverSpec,
    options: &LinkOptions,
    connector: impl FnOnce(&GroupEnd) -> K,
) -> Result<BroadcastReceiver<K>> {
    spec.check_transport(link)?;
    let params: Params = spec.params()?;
    let Some(token) = options.token_or_env()? else {
        return Err(Error::Config(format!(
            "no cluster token to join the {} group at {}: set {} or {}",
            link.name(),
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
        connector(&GroupEnd { token, ip }),
        Arc::new(client),
        config,
        format!("b{k}"),
    )?;
    Ok(end.keeping(node))
}

/// The CPU collective's connector for an end.
fn cpu(end: &GroupEnd) -> CpuConfig {
    CpuConfig::new(end.token.clone()).with_bind(end.ip)
}

impl LinkFactory for BroadcastLink {
    fn traits(&self) -> &'static LinkTraits {
        &LinkTraits {
            name: "broadcast",
            about: "processes on any hosts: rank 0 broadcasts every bucket once down a chain of receivers",
            // the chain runs over TCP: ranks on any hosts that reach each other
            reach: Reach::Network,
            // each receiver assembles versions in arenas of its own
            receivers_copy: true,
            memory: LinkMemory::Host,
        }
    }
    fn sender_end(&self, _manifests: &Manifests, options: &LinkOptions) -> Result<OpenedLink> {
        let bucket_size = BroadcastConfig::new("").bucket_size;
        let (sender, spec) = open_group(self, options, bucket_size, cpu)?;
        Ok(OpenedLink {
            spec,
            sender: Box::new(sender),
            leftovers: Vec::new(),
        })
    }
    fn receiver_end(
        &self,
        spec: &ReceiverSpec,
        o: &LinkOptions,
    ) -> Result<Box<dyn ReceiverTransport>> {
        Ok(Box::new(join_group(self, spec, o, cpu)?))
    }
}

/// The local address a packet to `to` would leave from (no packet is sent); loopback when
/// there is no route.
fn route_to(to: SocketAddr) -> IpAddr {
    let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
    UdpSocket::bind(any)
        .and_then(|s| s.connect(to).and_then(|()| s.local_addr()))
        .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip())
}
