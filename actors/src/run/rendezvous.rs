//! The rendezvous of a run's ranks: rank 0 serves the store (`refit_node::Store`)
//! at `MASTER_ADDR:MASTER_PORT` on its node; every rank starts a node on its host's address
//! (token from `REFIT_TOKEN`), publishes what others need under well-known keys and waits,
//! with a deadline, for what it needs.
//!
//! Keepalive runs both ways: rank 0 watches every other rank's node and every other rank
//! watches rank 0's ([`watch`]). A peer whose connection closes is dead at once; one that
//! answers no ping for `dead_after` (a frozen process, a host off the network) is dead then.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit_node::{ClusterToken, LaunchEnv, Node, NodeConfig, Store, StoreClient};
use refit_runtime::wire;
use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::error::{Error, Result};

/// The handler target of the liveness ping every rank's node answers.
pub const PING_TARGET: Uuid = Uuid::from_u128(0x7265_6669_745f_7069_6e67_0000_0000_0001);

/// A rank's place in the run: its node, and a connection to the store.
#[derive(Debug, Clone)]
pub(crate) struct Rendezvous {
    node: Node,
    store: StoreClient,
    advertised: SocketAddr,
}

/// Where a rank's node listens and how the others reach it.
#[derive(Debug, Clone)]
pub(crate) struct Place {
    /// The host's address, as the other hosts reach it.
    pub(crate) host_addr: String,
    /// The address to listen on instead of the host's (`[[process]] bind`).
    pub(crate) bind: Option<std::net::IpAddr>,
    /// A fixed port (`[[process]] port`); a free one otherwise.
    pub(crate) port: Option<u16>,
}

/// Resolves `host:port`.
fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::Config(format!("host address {host:?} does not resolve: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("host address {host:?} resolves to nothing")))
}

/// Resolves `host:port`, trying again until `deadline`: a name may resolve only once its
/// host runs (a Kubernetes pod's DNS record appears when the pod has started). `what` names
/// the address in the error.
fn resolve_until(what: &str, host: &str, port: u16, deadline: Instant) -> Result<SocketAddr> {
    loop {
        match resolve(host, port) {
            Ok(a) => return Ok(a),
            Err(e) if Instant::now() >= deadline => {
                return Err(Error::Config(format!("{what}: {e}")));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

impl Rendezvous {
    /// Starts this rank's node and joins the store: rank 0 binds `MASTER_ADDR:MASTER_PORT`
    /// (port 0: any free port, for a run of one process) and serves the store there; the
    /// others bind `host_addr` (a free port, or the fixed one) and connect to the store,
    /// retrying until `wait` passes (rank 0 may start later). A rank with a `bind` address
    /// listens there and advertises its host's address. Names that do not resolve yet are
    /// tried again until `wait` passes.
    ///
    /// # Errors
    /// [`Error::Config`] for an address that does not resolve within `wait` or cannot be
    /// bound; a store that cannot be reached before the deadline (naming it); a refused
    /// token.
    pub(crate) fn join(
        launch: &LaunchEnv,
        place: &Place,
        token: ClusterToken,
        wait: Duration,
    ) -> Result<Self> {
        let deadline = Instant::now() + wait;
        let master = resolve_until(
            &format!("rank {}: MASTER_ADDR", launch.rank),
            &launch.master_addr,
            launch.master_port,
            deadline,
        )?;
        // this rank's host, resolved once (rank 0's is the master address)
        let host = if launch.is_master() {
            master
        } else {
            resolve_until(
                &format!("rank {}: its host's address", launch.rank),
                &place.host_addr,
                place.port.unwrap_or(0),
                deadline,
            )?
        };
        let mut config = NodeConfig::loopback(token);
        config.bind = host;
        if let Some(ip) = place.bind {
            // listen on `bind` (0.0.0.0 in a container), and tell the others the host's
            // address with the port bound
            config.bind = SocketAddr::new(ip, host.port());
            config.advertise = Some(SocketAddr::new(host.ip(), 0));
        }
        let bind = config.bind;
        let node = Node::start(config).map_err(|e| {
            Error::Config(format!(
                "rank {}: starting its node on {bind}: {e}",
                launch.rank
            ))
        })?;
        node.register(PING_TARGET, "ping", |_, (): ()| async {
            Ok::<_, refit_node::Error>(())
        });
        // others reach this node at its host's address (it may listen on another: `bind`);
        // rank 0's is the store's (MASTER_PORT 0: the port bound)
        let advertised = node.advertised();
        let master = if launch.is_master() {
            Store::serve(&node);
            advertised
        } else {
            master
        };
        let store = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match StoreClient::connect(&node, master, left.min(Duration::from_secs(5))) {
                Ok(s) => break s,
                Err(e @ refit_node::Error::Unauthorized { .. }) => {
                    return Err(refit_runtime::Error::from(e).into());
                }
                Err(e) if left.is_zero() => {
                    return Err(Error::Config(format!(
                        "rank {}: the rendezvous store at {master} (MASTER_ADDR:MASTER_PORT) \
                         was not reachable within {wait:?}: {e}",
                        launch.rank
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        };
        Ok(Self {
            node,
            store,
            advertised,
        })
    }

    /// The address the other ranks reach this rank's node at.
    pub(crate) fn advertised(&self) -> SocketAddr {
        self.advertised
    }

    /// This rank's node.
    pub(crate) fn node(&self) -> &Node {
        &self.node
    }

    /// The store.
    pub(crate) fn store(&self) -> &StoreClient {
        &self.store
    }

    /// Sets `key` to `value` (msgpack).
    ///
    /// # Errors
    /// Encoding; the store unreachable.
    pub(crate) fn put<T: Serialize + ?Sized>(&self, key: &str, value: &T) -> Result<()> {
        Ok(self
            .store
            .set(key, &wire::encode(value)?)
            .map_err(refit_runtime::Error::from)?)
    }

    /// Waits (until `wait`) for `key` and decodes it.
    ///
    /// # Errors
    /// A timeout naming the key; the store unreachable; a malformed value.
    pub(crate) fn take<T: DeserializeOwned>(&self, key: &str, wait: Duration) -> Result<T> {
        let bytes = self
            .store
            .wait_get(key, wait)
            .map_err(refit_runtime::Error::from)?;
        wire::decode(&bytes, wire::MAX_CONTROL_MESSAGE)
            .map_err(|e| Error::Config(format!("store key `{key}` holds a bad value: {e}")))
    }

    /// The value of `key` now, if set.
    ///
    /// # Errors
    /// The store unreachable; a malformed value.
    pub(crate) fn peek<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        let Some(bytes) = self.store.get(key).map_err(refit_runtime::Error::from)? else {
            return Ok(None);
        };
        wire::decode(&bytes, wire::MAX_CONTROL_MESSAGE)
            .map(Some)
            .map_err(|e| Error::Config(format!("store key `{key}` holds a bad value: {e}")))
    }
}

/// How a watched rank died.
#[derive(Debug, Clone)]
pub(crate) struct RankDeath {
    /// The rank.
    pub(crate) rank: u32,
    /// Which start of it died (a newer incarnation may already serve).
    pub(crate) incarnation: u32,
    /// How its death was told.
    pub(crate) reason: String,
}

/// Watches `peers` (rank, incarnation, node address): one task per peer pings it every `keepalive`
/// (each ping waits at most `dead_after`); a peer whose connection closes, that cannot be
/// reached, or that answers no ping for `dead_after` is dead, and `on_death` is called once
/// for it. Dropping the guard stops watching.
pub(crate) fn watch(
    node: &Node,
    peers: Vec<(u32, u32, SocketAddr)>,
    keepalive: Duration,
    dead_after: Duration,
    on_death: impl Fn(RankDeath) + Send + Sync + 'static,
) -> WatchGuard {
    let on_death = Arc::new(on_death);
    let mut tasks = Vec::new();
    for (rank, incarnation, addr) in peers {
        let handle = node.handle().clone();
        let node = node.clone();
        let on_death = Arc::clone(&on_death);
        tasks.push(handle.spawn(async move {
            let reason = watch_one(&node, addr, keepalive, dead_after).await;
            on_death(RankDeath {
                rank,
                incarnation,
                reason,
            });
        }));
    }
    WatchGuard { tasks }
}

/// Pings the node at `addr` until it is dead; answers why.
async fn watch_one(
    node: &Node,
    addr: SocketAddr,
    keepalive: Duration,
    dead_after: Duration,
) -> String {
    let peer = match node.connect_async(addr, dead_after).await {
        Ok(p) => p,
        Err(e) => return format!("its node at {addr} cannot be reached: {e}"),
    };
    let mut last_ok = Instant::now();
    loop {
        if peer.is_closed() {
            return "its connection closed (the process exited or was killed)".into();
        }
        let left = dead_after.saturating_sub(last_ok.elapsed());
        if left.is_zero() {
            return format!("it answered no ping for {dead_after:?}");
        }
        let ping: refit_node::Result<()> = peer.call_async(PING_TARGET, "ping", &(), left).await;
        match ping {
            Ok(()) => last_ok = Instant::now(),
            Err(_) if peer.is_closed() => {
                return "its connection closed (the process exited or was killed)".into();
            }
            Err(_) => {}
        }
        let pause = keepalive.min(dead_after.saturating_sub(last_ok.elapsed()));
        // a closed connection is news at once, not at the next ping
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = peer.closed() => {}
        }
    }
}

/// Stops watching when dropped.
#[derive(Debug)]
pub(crate) struct WatchGuard {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
