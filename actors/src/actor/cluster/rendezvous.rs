//! The rendezvous of a run's ranks: rank 0 serves the store (`refit_node::Store`)
//! at `MASTER_ADDR:MASTER_PORT` on its node; every rank starts a node on its host's address
//! (token from `REFIT_TOKEN`), publishes what others need under well-known keys and waits,
//! with a deadline, for what it needs. Rank 0 also watches every other rank's node: a rank
//! whose connection closes, or that stops answering pings, is reported at once.

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

/// The store key rank 0 sets when the run is over: the other ranks stop.
pub const STOP_KEY: &str = "refit/run/stop";

/// The store key of rank `r`'s card.
pub fn rank_key(r: u32) -> String {
    format!("refit/rank/{r}")
}

/// A rank's place in the run: its node, and a connection to the store.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    node: Node,
    store: StoreClient,
    launch: LaunchEnv,
}

/// Resolves `host:port`.
fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::Config(format!("host address {host:?} does not resolve: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("host address {host:?} resolves to nothing")))
}

impl Rendezvous {
    /// Starts this rank's node and joins the store: rank 0 binds `MASTER_ADDR:MASTER_PORT`
    /// and serves the store there; the others bind `host_addr` (a free port) and connect to
    /// the store, retrying until `wait` passes (rank 0 may start later).
    ///
    /// # Errors
    /// [`Error::Config`] for an address that does not resolve or cannot be bound; a store
    /// that cannot be reached before the deadline (naming it); a refused token.
    pub fn join(
        launch: &LaunchEnv,
        host_addr: &str,
        token: ClusterToken,
        wait: Duration,
    ) -> Result<Self> {
        let master = launch.master().map_err(refit_runtime::Error::from)?;
        let bind = if launch.is_master() {
            master
        } else {
            resolve(host_addr, 0)?
        };
        let node = Node::start(NodeConfig::loopback(token).with_bind(bind)).map_err(|e| {
            Error::Config(format!(
                "rank {}: starting its node on {bind}: {e}",
                launch.rank
            ))
        })?;
        node.register(PING_TARGET, "ping", |_, (): ()| async {
            Ok::<_, refit_node::Error>(())
        });
        if launch.is_master() {
            Store::serve(&node);
        }
        let deadline = Instant::now() + wait;
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
            launch: launch.clone(),
        })
    }

    /// This rank's node.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// The store.
    pub fn store(&self) -> &StoreClient {
        &self.store
    }

    /// This rank's launch variables.
    pub fn launch(&self) -> &LaunchEnv {
        &self.launch
    }

    /// Sets `key` to `value` (msgpack).
    ///
    /// # Errors
    /// Encoding; the store unreachable.
    pub fn put<T: Serialize + ?Sized>(&self, key: &str, value: &T) -> Result<()> {
        Ok(self
            .store
            .set(key, &wire::encode(value)?)
            .map_err(refit_runtime::Error::from)?)
    }

    /// Waits (until `wait`) for `key` and decodes it.
    ///
    /// # Errors
    /// A timeout naming the key; the store unreachable; a malformed value.
    pub fn take<T: DeserializeOwned>(&self, key: &str, wait: Duration) -> Result<T> {
        let bytes = self
            .store
            .wait_get(key, wait)
            .map_err(refit_runtime::Error::from)?;
        wire::decode(&bytes, wire::MAX_CONTROL_MESSAGE)
            .map_err(|e| Error::Config(format!("store key `{key}` holds a bad value: {e}")))
    }

    /// Blocks until rank 0 sets [`STOP_KEY`] (`Ok(true)`) or goes away (`Ok(false)`).
    ///
    /// # Errors
    /// None in practice: every failure of the store means rank 0 is gone.
    pub fn wait_stop(&self) -> Result<bool> {
        loop {
            match self.store.wait(&[STOP_KEY], Duration::from_secs(1)) {
                Ok(()) => return Ok(true),
                Err(e) if e.is_timeout() && !self.store.peer().is_closed() => {}
                Err(e) => {
                    tracing::warn!(rank = self.launch.rank, "rank 0 is gone: {e}");
                    return Ok(false);
                }
            }
        }
    }
}

/// How a watched rank died.
#[derive(Debug, Clone)]
pub struct RankDeath {
    /// The rank.
    pub rank: u32,
    /// How its death was told.
    pub reason: String,
    /// When it was noticed.
    pub at: Instant,
}

/// Watches ranks' nodes from rank 0: every 250 ms it checks each connection, and every
/// second it pings each node (deadline 3 s). The first failure of a rank calls `on_death`
/// once for it.
///
/// # Errors
/// A rank whose node cannot be reached at the start.
pub fn watch(
    node: &Node,
    ranks: Vec<(u32, SocketAddr)>,
    wait: Duration,
    on_death: impl Fn(RankDeath) + Send + Sync + 'static,
) -> Result<WatchGuard> {
    let mut peers = Vec::new();
    for (rank, addr) in ranks {
        let peer = node.connect(addr, wait).map_err(|e| {
            Error::Config(format!(
                "rank {rank}: its node at {addr} is not reachable: {e}"
            ))
        })?;
        peers.push((rank, peer));
    }
    let on_death = Arc::new(on_death);
    let task = node.handle().spawn(async move {
        let mut alive: Vec<bool> = vec![true; peers.len()];
        let mut tick: u64 = 0;
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            tick += 1;
            for (i, (rank, peer)) in peers.iter().enumerate() {
                if !alive[i] {
                    continue;
                }
                let mut dead = peer.is_closed().then(|| {
                    "its connection closed (the process exited or was killed)".to_string()
                });
                if dead.is_none() && tick.is_multiple_of(4) {
                    let ping: refit_node::Result<()> = peer
                        .call_async(PING_TARGET, "ping", &(), Duration::from_secs(3))
                        .await;
                    if let Err(e) = ping {
                        dead = Some(format!("it does not answer pings: {e}"));
                    }
                }
                if let Some(reason) = dead {
                    alive[i] = false;
                    on_death(RankDeath {
                        rank: *rank,
                        reason,
                        at: Instant::now(),
                    });
                }
            }
            if alive.iter().all(|a| !a) {
                return;
            }
        }
    });
    Ok(WatchGuard { task })
}

/// Stops watching when dropped.
#[derive(Debug)]
pub struct WatchGuard {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}
