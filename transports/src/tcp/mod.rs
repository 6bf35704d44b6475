//! The TCP transport, for processes on one host or many.
//!
//! - A **sender agent** ([`TcpSender`]) runs on a [node](refit_node) and serves the
//!   newest versions of its models (the last [`TcpConfig::keep_versions`] of each) and their
//!   checksums (the last [`TcpConfig::checksum_history`]): one xxh3 per piece of the bucket
//!   plan (a tensor a bucket holds whole, or a chunk of a cut one), plus each bucket's
//!   checksum derived from them. Publishing hashes nothing: each bucket is hashed once, when
//!   a pull first asks for it (a stream hashes its next bucket while it writes this one), and
//!   its header declares its pieces' checksums, so a trainer's publish returns at once and
//!   the hashing overlaps the transfer. A delta compares checksums, so a delta's request has
//!   the whole version (and its base) hashed first, within half its deadline (a base a
//!   receiver holds was hashed whole on its way to it).
//! - A **receiver** ([`TcpReceiver`]) registers with it, then for each version it is told
//!   about (the sender calls `_receive_weights_scheme` on the receiver's node) asks for a
//!   transfer in `full` or `delta` mode, pulls the bytes over several parallel streams,
//!   hashes every piece as its bytes land (one pass) and verifies it, naming the tensor, and
//!   each bucket's checksum *before* the version can be applied, signals completion, and
//!   acknowledges once applied.
//! - **Buckets**: bytes move by the sender's [`BucketPlan`](refit_runtime::BucketPlan),
//!   computed once per model with [`TcpConfig::bucket_size`] and shipped with the first
//!   transfer a receiver asks for (later transfers name it by fingerprint; a changed plan is
//!   shipped again). The receiver verifies it against its manifest with
//!   [`BucketPlan::verify`](refit_runtime::BucketPlan::verify) and refuses one that does not
//!   fit, with the error naming the bucket and tensor; nothing is pulled then and the
//!   previous version stays served. Streams take whole buckets (each to the stream with the
//!   fewest bytes so far); each bucket travels as exactly one framed
//!   [`BucketHeader`](refit_runtime::BucketHeader) (index, version, range, pieces, the xxh3
//!   of the bucket and of each piece) followed by its bytes, straight into the new arena. A
//!   tensor larger than a bucket is cut across buckets, never refused.
//! - **Delta**: a delta transfer moves the buckets that hold at least one byte of a changed
//!   tensor, whole, and starts from the version the receiver holds; buckets with no changed
//!   tensor are skipped. One header still describes each bucket, and the delta needs no
//!   second plan; the price is granularity (an unchanged tensor sharing a bucket with a
//!   changed one travels too), so pick a smaller bucket size for sparse updates.
//! - **Relay**: a receiver that holds a version, or is pulling every bucket asked for right
//!   now, serves it to the next one; a version still landing is served as its bytes arrive
//!   (a socket read, 256 KiB, at a time, before its bucket is complete or verified), so
//!   receivers form a pipelined chain whatever the bucket size: the sender writes each byte
//!   once however many receivers there are, and N receivers take about the time of one plus
//!   a piece per hop. Checksums stay per bucket: every receiver of the chain verifies the
//!   bytes it got against the sender's checksums itself (the transfer's terms, or the
//!   sender's bucket headers, which a relay passes on as they were: it never computes them
//!   from its own bytes), so a damaged bucket a relay passed on is refused by every receiver
//!   that got it (the previous version stays served), and a relay whose own pull fails ends
//!   the streams it serves at once.
//! - **First pulls**: a receiver's first pulls land in arenas it has never used. It starts
//!   faulting the first one in on a thread of its own as soon as it has registered (and
//!   knows the models' sizes), while the sender publishes and announces the version; a pull
//!   that finds it not quite ready stops it and a thread of the pull faults the rest in ahead
//!   of the streams (instead of page by page inside the socket reads). After each of its
//!   first pulls the receiver makes the next arena in the background, up to the arenas steady
//!   state keeps (see [`AlignedBuf::huge_pages`](refit_runtime::AlignedBuf::huge_pages) for
//!   the page size). A receiver writing into sinks makes none.
//! - **Sinks**: a receiver can write a transfer into a [`Sink`] (e.g. the file the weights
//!   are bound for) instead of an arena, through a small reused buffer, hashed as the bytes
//!   pass, or straight into memory of the sink's own that it hands out bucket by bucket
//!   ([`Sink::claim`], e.g. a map of the file) ([`TcpReceiver::with_sinks`]); [`PullFile`]
//!   is such a sink for a safetensors file (what `refit pull` writes).
//! - **Security**: nodes bind loopback unless configured, and a node bound to an
//!   unspecified address (`0.0.0.0`) must be given the address to advertise; every
//!   connection presents the cluster token (from the configuration, `REFIT_TOKEN`,
//!   `REFIT_TOKEN_FILE`, or random); what is shipped to receivers is a [`TcpEndpoint`],
//!   which holds no token; nothing on the wire is code.
//! - **Versions**: the node handshake carries the node protocol version
//!   ([`refit_node::PROTOCOL_VERSION`]), and a receiver's registration and the sender's
//!   answer carry this transport's ([`PROTOCOL_VERSION`]); each end refuses another version
//!   with [`Error::Protocol`], naming both.
//!
//! Every wait has a deadline; a vanished sender is [`Error::PeerGone`](refit_runtime::Error),
//! a vanished receiver is dropped from the sender's book (its leases freed, its acks no
//! longer awaited), and a restarted receiver registers anew and gets the newest version.

mod data;
mod encoded;
mod file_sink;
mod inflight;
mod link;
mod messages;
mod receiver;
mod relay;
mod sender;
mod stream_sink;
mod wait;

use std::net::SocketAddr;
use std::time::Duration;

use refit_node::ClusterToken;
use refit_runtime::{Error, Result};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use data::{Sink, SinkSlice};
pub use file_sink::PullFile;
pub use link::TcpLink;
pub use messages::{PROTOCOL_VERSION, RECEIVE_WEIGHTS, TransferMode};
pub use receiver::{SinkSource, TcpReceiver, TcpReceiverConfig, TransferStats};
pub use sender::TcpSender;

const NAME: &str = "tcp";

/// How a sender agent is set up.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Where its own node listens (default `127.0.0.1:0`; use a routable address, or
    /// `0.0.0.0:PORT` with [`TcpConfig::advertise`], for other hosts).
    pub bind: SocketAddr,
    /// The address receivers are told to use (default: the bound address). Required when
    /// the node listens on an unspecified address (`0.0.0.0`, `::`), which no receiver can
    /// connect to; a port of 0 here means the port the node is bound to.
    pub advertise: Option<SocketAddr>,
    /// The cluster token (default: `REFIT_TOKEN` or `REFIT_TOKEN_FILE`, else a random one).
    pub token: Option<ClusterToken>,
    /// Receivers `connect` waits for before publishing the initial weights (default 0).
    pub expected_receivers: usize,
    /// Versions kept per model for receivers still pulling them (default 2).
    pub keep_versions: usize,
    /// Versions whose per-tensor checksums are kept for delta transfers (default 16).
    pub checksum_history: usize,
    /// Let receivers that hold a version serve it to others (default true).
    pub relay: bool,
    /// Pulls one source (the sender or a relaying receiver) serves at once when relaying
    /// (default 1: each byte leaves the sender about once, holders fan out in parallel).
    pub relay_fanout: usize,
    /// How long a transfer may hold its source before the lease is reclaimed (default 120 s).
    pub transfer_timeout: Duration,
    /// Deadline of the sender's own remote calls, e.g. announcements (default 5 s).
    pub call_timeout: Duration,
    /// Bytes per bucket of the bucket plan, a positive multiple of
    /// [`ALIGN`](refit_runtime::ALIGN) (default [`DEFAULT_BUCKET_SIZE`], 16 MiB). Larger
    /// buckets mean fewer control messages; smaller ones spread a model over more parallel
    /// streams and make deltas finer.
    pub bucket_size: usize,
}

/// The default [`TcpConfig::bucket_size`]: 16 MiB, so a 64 MiB model already keeps four
/// streams busy while a 1 GiB model needs only 64 bucket headers.
pub const DEFAULT_BUCKET_SIZE: usize = 16 << 20;

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            token: None,
            expected_receivers: 0,
            keep_versions: 2,
            checksum_history: 16,
            relay: true,
            relay_fanout: 1,
            transfer_timeout: Duration::from_secs(120),
            call_timeout: Duration::from_secs(5),
            bucket_size: DEFAULT_BUCKET_SIZE,
        }
    }
}

/// What a receiver needs to attach: the sender agent's address, its id, and the cluster
/// token. It holds the token, so treat it as a secret: ship the [`TcpEndpoint`] instead
/// ([`TcpReceiverSpec::endpoint`]) and let the receiving side add the token it already has
/// ([`TcpReceiverSpec::new`]).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpReceiverSpec {
    /// The sender's node.
    pub addr: SocketAddr,
    /// The sender agent on that node.
    pub agent: Uuid,
    /// The cluster token.
    pub token: String,
}

impl std::fmt::Debug for TcpReceiverSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpReceiverSpec")
            .field("addr", &self.addr)
            .field("agent", &self.agent)
            .field("token", &"<redacted>")
            .finish()
    }
}

impl TcpReceiverSpec {
    /// The spec of the sender agent at `endpoint`, presenting `token`.
    pub fn new(endpoint: TcpEndpoint, token: &ClusterToken) -> Self {
        Self {
            addr: endpoint.addr,
            agent: endpoint.agent,
            token: token.expose().to_owned(),
        }
    }

    /// Where the sender agent is, without the token.
    pub fn endpoint(&self) -> TcpEndpoint {
        TcpEndpoint {
            addr: self.addr,
            agent: self.agent,
        }
    }
}

/// Where a sender agent is: its node's address and the agent's id. It holds no secret, so
/// it can be printed, logged, stored or passed on a command line (as text with
/// [`refit_runtime::wire::to_token`]); a receiver adds the cluster token it got from its own
/// configuration with [`TcpReceiverSpec::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TcpEndpoint {
    /// The sender's node.
    pub addr: SocketAddr,
    /// The sender agent on that node.
    pub agent: Uuid,
}

/// The address peers are told to use for a node listening on `bound`: `advertise` when
/// given (its port 0 meaning `bound`'s port), else `bound`, which must then be a specified
/// address (nobody can connect to `0.0.0.0` or `::`).
pub(crate) fn advertised(
    who: &str,
    bound: SocketAddr,
    advertise: Option<SocketAddr>,
) -> Result<SocketAddr> {
    match advertise {
        Some(a) if a.ip().is_unspecified() => Err(Error::Config(format!(
            "{who}: advertise address {a} is unspecified; advertise the address peers reach \
             this host at"
        ))),
        Some(a) if a.port() == 0 => Ok(SocketAddr::new(a.ip(), bound.port())),
        Some(a) => Ok(a),
        None if bound.ip().is_unspecified() => Err(Error::Config(format!(
            "{who} listens on the unspecified address {bound}, which peers cannot connect \
             to: set an advertise address (the one peers reach this host at)"
        ))),
        None => Ok(bound),
    }
}

/// A single-threaded runtime with timers, for the unit tests of this module's waits.
#[cfg(test)]
pub(crate) fn test_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unspecified_addresses_need_an_advertised_one() {
        let any: SocketAddr = "0.0.0.0:29600".parse().unwrap();
        let any6: SocketAddr = "[::]:29600".parse().unwrap();
        let lo: SocketAddr = "127.0.0.1:29600".parse().unwrap();
        let host: SocketAddr = "10.0.0.1:29700".parse().unwrap();
        for bound in [any, any6] {
            let e = advertised("the tcp sender", bound, None).unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{e}");
            assert!(e.to_string().contains(&bound.to_string()), "{e}");
            assert!(e.to_string().contains("advertise"), "{e}");
            assert_eq!(advertised("s", bound, Some(host)).unwrap(), host);
        }
        assert_eq!(advertised("s", lo, None).unwrap(), lo);
        assert_eq!(
            advertised("s", any, Some("10.0.0.1:0".parse().unwrap())).unwrap(),
            "10.0.0.1:29600".parse::<SocketAddr>().unwrap()
        );
        assert!(advertised("s", lo, Some(any)).is_err());
    }

    /// A receiver and a sender of another version of the transport's protocol refuse each
    /// other, naming both versions: a registration of version 999 forged on a real sender's
    /// node, and a real receiver registering with a forged sender that answers 999.
    #[test]
    fn registrations_of_another_protocol_version_are_refused_naming_both() {
        use super::messages::{REGISTER, Register, Registered};
        use refit_node::{Node, NodeConfig};
        use refit_runtime::{DType, Manifest, Manifests, ModelId, ReceiverInit};
        use std::sync::Arc;
        use std::time::Duration;
        let token = ClusterToken::new("tcp-protocol-test-token-0123456789").unwrap();
        let policy = ModelId::new("policy").unwrap();
        let manifest = Arc::new(
            Manifest::builder()
                .tensor("w", DType::F32, &[4])
                .build()
                .unwrap(),
        );
        let manifests = Manifests::new([(policy.clone(), Arc::clone(&manifest))]).unwrap();
        let config = TcpConfig {
            token: Some(token.clone()),
            ..TcpConfig::default()
        };
        let sender = TcpSender::bind(config, &manifests).unwrap();
        let endpoint = sender.endpoint();
        let client = Node::start(NodeConfig::loopback(token.clone())).unwrap();
        let ctl = client
            .connect(endpoint.addr, Duration::from_secs(10))
            .unwrap();
        let forged = Register {
            protocol: 999,
            receiver: Uuid::new_v4(),
            node: client.addr(),
            relay: false,
        };
        let e = ctl
            .call::<_, Registered>(endpoint.agent, REGISTER, &forged, Duration::from_secs(10))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tcp transport protocol version 999")
                && e.contains(&format!("speaks version {PROTOCOL_VERSION}")),
            "{e}"
        );
        assert_eq!(sender.receivers(), 0, "a refused receiver joined the book");
        // a forged sender agent answering with version 999
        let fake = Node::start(NodeConfig::loopback(token.clone())).unwrap();
        let agent = Uuid::new_v4();
        let m = (*manifest).clone();
        let id = policy.clone();
        fake.register(agent, REGISTER, move |_, _: Register| {
            let reply = Registered {
                protocol: 999,
                id: 0,
                models: vec![(id.clone(), m.clone())],
                latest: vec![],
            };
            async move { Ok::<_, Error>(reply) }
        });
        let spec = TcpReceiverSpec::new(
            TcpEndpoint {
                addr: fake.addr(),
                agent,
            },
            &token,
        );
        let e = ReceiverInit::new(TcpReceiver::new(spec), None)
            .connect(Duration::from_secs(10))
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Protocol {
                    ours: PROTOCOL_VERSION,
                    theirs: 999,
                    ..
                }
            ),
            "{e}"
        );
        let text = e.to_string();
        assert!(
            text.contains("tcp transport protocol version 999")
                && text.contains(&fake.addr().to_string()),
            "{text}"
        );
    }

    #[test]
    fn endpoints_hold_no_token() {
        let token = ClusterToken::new("0123456789abcdef-secret").unwrap();
        let endpoint = TcpEndpoint {
            addr: "127.0.0.1:29600".parse().unwrap(),
            agent: Uuid::new_v4(),
        };
        let spec = TcpReceiverSpec::new(endpoint, &token);
        assert_eq!(spec.endpoint(), endpoint);
        assert_eq!(spec.token, token.expose());
        let text = refit_runtime::wire::to_token(&spec.endpoint()).unwrap();
        let bytes = refit_runtime::wire::encode(&spec.endpoint()).unwrap();
        assert!(!String::from_utf8_lossy(&bytes).contains("secret"));
        let back: TcpEndpoint = refit_runtime::wire::from_token(&text).unwrap();
        assert_eq!(back, endpoint);
        assert!(!format!("{spec:?}").contains("secret"));
    }
}
