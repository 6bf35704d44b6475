//! From the text a sender gave out to a receiver end: a link factory spec
//! (`ReceiverSpec::to_token`, what `refit serve --spec-file` and every `refit` sender
//! write) or, for `refit serve` over TCP, the sender agent's endpoint alone.

use pyo3::prelude::*;
use refit_node::ClusterToken;
use refit_runtime::{ReceiverTransport, wire};
use refit_transports::link::{self, Deltas, LinkOptions, ReceiverSpec};
use refit_transports::tcp::{TcpEndpoint, TcpLink};

use crate::errors::{config, to_py};

/// The names of the transports a spec may name.
#[pyfunction]
pub(crate) fn transports() -> Vec<&'static str> {
    link::LINKS.iter().map(|l| l.name()).collect()
}

/// A receiver end for `text`, and its transport's name. Shared memory is read in place
/// (the arrays handed to Python lie in the sender's slot, pinned while held) unless `copy`.
pub(crate) fn open(
    text: &str,
    token: Option<&str>,
    copy: bool,
    delta: &str,
    streaming: bool,
) -> PyResult<(Box<dyn ReceiverTransport>, String)> {
    let deltas = match delta {
        "off" => Deltas::Off,
        "buckets" => Deltas::Buckets,
        "elements" => Deltas::Elements,
        other => {
            return Err(config(format!(
                "delta = {other:?}: expected \"off\", \"buckets\" or \"elements\""
            )));
        }
    };
    let text = text.trim();
    let text = text.strip_prefix("spec:").unwrap_or(text).trim();
    if text.is_empty() {
        return Err(config("an empty receiver spec"));
    }
    let spec = match ReceiverSpec::from_token(text) {
        Ok(spec) => spec,
        Err(first) => match wire::from_token::<TcpEndpoint>(text) {
            Ok(endpoint) => {
                ReceiverSpec::new(&TcpLink, &endpoint, endpoint.addr.to_string()).map_err(to_py)?
            }
            Err(_) => {
                return Err(config(format!(
                    "not a refit receiver spec (neither a link spec nor a `refit serve` \
                     endpoint): {first}"
                )));
            }
        },
    };
    let name = spec.transport().to_owned();
    let token = match token {
        Some(t) => Some(ClusterToken::new(t).map_err(|e| config(e.to_string()))?),
        None => None,
    };
    let options = LinkOptions {
        token,
        private_copies: copy,
        deltas,
        streaming,
        ..LinkOptions::default()
    };
    let transport = spec.receiver(&options).map_err(to_py)?;
    Ok((transport, name))
}
