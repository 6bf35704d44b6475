//! The TCP transport in the link factory.

use refit_runtime::{Error, Manifests, ReceiverTransport, Result};

use super::TransferMode;
use super::{TcpConfig, TcpEndpoint, TcpReceiver, TcpReceiverConfig, TcpReceiverSpec, TcpSender};
use crate::link::{
    Deltas, LinkFactory, LinkMemory, LinkOptions, LinkTraits, OpenedLink, Reach, ReceiverSpec,
};

/// Parallel streams of a streaming receiver: each holds the tensors of the bucket it is
/// pulling until the bucket is verified, so fewer streams bound its memory tighter.
const STREAMING_STREAMS: usize = 2;

/// TCP in the link factory: the spec is the sender agent's [`TcpEndpoint`] (no token); the
/// receiver adds the token of its options, its node or its environment.
#[derive(Debug, Clone, Copy)]
pub struct TcpLink;

impl LinkFactory for TcpLink {
    fn traits(&self) -> &'static LinkTraits {
        &LinkTraits {
            name: super::NAME,
            about: "processes on any hosts: receivers pull over parallel streams and relay to each other",
            reach: Reach::Network,
            receivers_copy: true,
            memory: LinkMemory::Host,
        }
    }
    fn sender_end(&self, manifests: &Manifests, options: &LinkOptions) -> Result<OpenedLink> {
        let config = TcpConfig {
            expected_receivers: options.expected_receivers,
            token: options.token.clone(),
            ..TcpConfig::default()
        };
        let sender = match &options.node {
            Some(node) => TcpSender::on_node(node, config, manifests)?,
            None => TcpSender::bind(config, manifests)?,
        };
        let e = sender.endpoint();
        let about = format!("sender agent {} at {}", e.agent, e.addr);
        Ok(OpenedLink {
            spec: ReceiverSpec::new(self, &e, about)?,
            sender: Box::new(sender),
            leftovers: Vec::new(),
        })
    }
    fn receiver_end(
        &self,
        spec: &ReceiverSpec,
        options: &LinkOptions,
    ) -> Result<Box<dyn ReceiverTransport>> {
        let endpoint: TcpEndpoint = spec.params()?;
        let token = options.token_or_env()?.ok_or_else(|| {
            Error::Config(format!(
                "no cluster token to register with the tcp sender at {}: set {} or {}",
                endpoint.addr,
                refit_node::TOKEN_ENV,
                refit_node::TOKEN_FILE_ENV
            ))
        })?;
        let mut r = TcpReceiver::new(TcpReceiverSpec::new(endpoint, &token));
        if let Some(node) = &options.node {
            r = r.with_node(node.clone());
        }
        if options.streaming {
            r = r.streaming();
        }
        let defaults = TcpReceiverConfig::default();
        r = r.with_config(TcpReceiverConfig {
            call_timeout: options.call_timeout.unwrap_or(defaults.call_timeout),
            streams: if options.streaming {
                STREAMING_STREAMS
            } else {
                defaults.streams
            },
            mode: match options.deltas {
                Deltas::Off => TransferMode::Full,
                Deltas::Buckets => TransferMode::Delta,
                Deltas::Elements => TransferMode::Elements,
            },
            ..defaults
        });
        Ok(Box::new(r))
    }
}
