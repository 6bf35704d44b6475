//! Refit nodes: processes that host handlers and talk over TCP.
//!
//! This crate is the I/O layer above the sans-IO core (`refit-runtime`): it owns the tokio
//! runtime, sockets and signal handling, so that the core does not depend on them.
//!
//! A [`Node`] listens on one address (loopback unless configured) and serves:
//! - **remote calls**: a handler is addressed by `(target uuid, method name)`; a call carries a
//!   deadline; its reply comes back on the same connection ([`Peer::call`]);
//! - **streams**: a connection that, after one request frame, carries raw bytes written by a
//!   stream handler (the data plane of the TCP transport; see [`open_stream`]).
//!
//! Every connection starts with a hello frame holding the node protocol version
//! ([`PROTOCOL_VERSION`]) and the shared [`ClusterToken`]; a peer of another version is
//! refused naming both versions, a peer without the token is refused, and both are logged. Frames are a `u32` length plus named msgpack of typed
//! structs, with the length checked before anything is allocated ([`frame`]).
//!
//! A peer that vanishes turns every pending call on its connection into
//! [`PeerGone`](refit_runtime::Error::PeerGone); a call whose deadline passes is [`Timeout`](refit_runtime::Error::Timeout). Async methods
//! suit tokio code; the `*_blocking`-free names ([`Peer::call`], [`Node::connect`]) block the
//! calling thread and suit plain threads (never call them from inside an async task).

#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

pub mod error;
pub mod frame;
pub mod launch;
pub mod logging;
mod message;
mod peer;
mod server;
pub mod signals;
pub mod slurm;
pub mod store;
mod stream;
mod token;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

pub use crate::error::{Error, Result};
use refit_runtime::Error as CoreError;
use refit_runtime::wire::{self, MAX_CONTROL_MESSAGE};

pub use launch::LaunchEnv;
pub use message::{MAX_HELLO, PROTOCOL_VERSION, StreamHead};
pub use peer::Peer;
pub use store::{Store, StoreClient};
pub use stream::{OpenStream, open_stream, write_head};
pub use token::{ClusterToken, TOKEN_ENV, TOKEN_FILE_ENV};

/// A boxed, sendable future (what raw handlers return).
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

type RawHandler = Arc<dyn Fn(CallInfo, Vec<u8>) -> BoxFuture<Result<Vec<u8>>> + Send + Sync>;
type StreamHandler =
    Arc<dyn Fn(CallInfo, Vec<u8>, tokio::net::TcpStream) -> BoxFuture<Result<()>> + Send + Sync>;
type DisconnectHook = Arc<dyn Fn(ConnId) + Send + Sync>;

/// One accepted connection of a node, as handlers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// Who is calling: handed to every handler.
#[derive(Debug, Clone, Copy)]
pub struct CallInfo {
    /// The connection the call came on (see [`Node::on_disconnect`]).
    pub conn: ConnId,
    /// The caller's address.
    pub peer: SocketAddr,
    /// The calling node's id.
    pub node: Uuid,
    /// When the caller stops waiting.
    pub deadline: Instant,
}

/// How a node is set up.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Where to listen (default `127.0.0.1:0`: loopback, a free port).
    pub bind: SocketAddr,
    /// The cluster token every connection must present.
    pub token: ClusterToken,
    /// Largest frame accepted after the hello (default [`MAX_CONTROL_MESSAGE`], 16 MiB).
    pub max_frame: usize,
    /// How long a new connection has to send its hello, to read the welcome, and (a stream)
    /// to send its request after it (default 5 s).
    pub hello_timeout: Duration,
    /// Runtime worker threads (default 2).
    pub threads: usize,
    /// The address other nodes reach this one at, when it is not `bind` (default `None`:
    /// `bind`, with the port bound). Needed when `bind` is unspecified (`0.0.0.0`, in a
    /// container or a Kubernetes pod): nobody can connect to `0.0.0.0`. Port 0 here means the
    /// port bound.
    pub advertise: Option<SocketAddr>,
}

impl NodeConfig {
    /// Loopback, a free port, the given token.
    pub fn loopback(token: ClusterToken) -> Self {
        Self {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            token,
            max_frame: MAX_CONTROL_MESSAGE,
            hello_timeout: Duration::from_secs(5),
            threads: 2,
            advertise: None,
        }
    }

    /// Listens on `bind` instead.
    #[must_use]
    pub fn with_bind(mut self, bind: SocketAddr) -> Self {
        self.bind = bind;
        self
    }

    /// Tells peers to reach it at `advertise` (port 0: the port bound) instead of the
    /// address it listens on.
    #[must_use]
    pub fn with_advertise(mut self, advertise: SocketAddr) -> Self {
        self.advertise = Some(advertise);
        self
    }
}

pub(crate) struct Shared {
    id: Uuid,
    token: ClusterToken,
    max_frame: usize,
    hello_timeout: Duration,
    handlers: RwLock<HashMap<(Uuid, String), RawHandler>>,
    streams: RwLock<HashMap<(Uuid, String), StreamHandler>>,
    hooks: RwLock<Vec<DisconnectHook>>,
    next_conn: AtomicU64,
    refused: AtomicU64,
    /// Remote calls read and not yet answered (see [`server::Owed`]).
    owed: AtomicUsize,
    /// Set once the node stops: calls still running are dropped unanswered.
    stopping: tokio::sync::watch::Sender<bool>,
}

/// How long a stopping node waits for the replies of calls it already carried out to be
/// written (a peer that reads nothing holds it this long at most).
const ANSWER_GRACE: Duration = Duration::from_millis(500);

/// Stops a node's runtime: no new connection or call is taken, calls still running are
/// dropped (their callers see the connection close), the replies of calls that finished are
/// written first, within [`ANSWER_GRACE`], then every task and connection is dropped. On a
/// thread of a runtime (perhaps this node's own, whose workers write those replies) the wait
/// moves to a thread of its own, so that it holds up nothing.
fn stop(shared: &Arc<Shared>, runtime: tokio::runtime::Runtime) {
    shared.stopping.send_replace(true);
    if tokio::runtime::Handle::try_current().is_err() {
        shared.await_answers();
        runtime.shutdown_background();
        return;
    }
    let slot = Arc::new(Mutex::new(Some(runtime)));
    let take = |s: &Mutex<Option<tokio::runtime::Runtime>>| {
        s.lock().unwrap_or_else(|p| p.into_inner()).take()
    };
    let (waiting, later) = (Arc::clone(shared), Arc::clone(&slot));
    let spawned = std::thread::Builder::new()
        .name("refit-node-stop".into())
        .spawn(move || {
            waiting.await_answers();
            if let Some(rt) = take(&later) {
                rt.shutdown_background();
            }
        });
    if spawned.is_err()
        && let Some(rt) = take(&slot)
    {
        rt.shutdown_background();
    }
}

impl Shared {
    /// Waits (at most [`ANSWER_GRACE`]) until every call taken is answered or dropped.
    fn await_answers(&self) {
        let until = Instant::now() + ANSWER_GRACE;
        while self.owed.load(Ordering::Acquire) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    // poisoned only if a registering thread panicked; the map itself stays consistent
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

struct Inner {
    shared: Arc<Shared>,
    handle: tokio::runtime::Handle,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    addr: SocketAddr,
    advertised: SocketAddr,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let rt = self
            .runtime
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(rt) = rt {
            stop(&self.shared, rt);
        }
    }
}

/// A process's presence on the network: a listener, its handlers, its outgoing peers.
///
/// Cheap to clone; the node stops when [`Node::shutdown`] is called or the last clone drops
/// (do not capture a `Node` inside its own handlers: that keeps it alive forever).
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.inner.shared.id)
            .field("addr", &self.inner.addr)
            .field("advertised", &self.inner.advertised)
            .finish()
    }
}

impl Node {
    /// Starts a node: its own tokio runtime, a listener on `config.bind`, an accept loop.
    ///
    /// # Errors
    /// [`Io`](refit_runtime::Error::Io) when the runtime cannot start or the address cannot be bound.
    pub fn start(config: NodeConfig) -> Result<Self> {
        // the address first: a runtime dropped on a failure here, from async code, would panic
        let listener = std::net::TcpListener::bind(config.bind)
            .map_err(|e| Error::io(format!("binding {}", config.bind), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("configuring the listener", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the listener address", e))?;
        let advertised = match config.advertise {
            Some(a) if a.port() == 0 => SocketAddr::new(a.ip(), addr.port()),
            Some(a) => a,
            None => addr,
        };
        let shared = Arc::new(Shared {
            id: Uuid::new_v4(),
            token: config.token,
            max_frame: config.max_frame,
            hello_timeout: config.hello_timeout,
            handlers: RwLock::default(),
            streams: RwLock::default(),
            hooks: RwLock::default(),
            next_conn: AtomicU64::new(1),
            refused: AtomicU64::new(0),
            owed: AtomicUsize::new(0),
            stopping: tokio::sync::watch::Sender::new(false),
        });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads.max(1))
            .thread_name("refit-node")
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the node runtime", e))?;
        let registered = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(listener)
        };
        let listener = match registered {
            Ok(l) => l,
            Err(e) => {
                // never dropped whole: that panics when this is called from async code
                runtime.shutdown_background();
                return Err(Error::io("registering the listener", e));
            }
        };
        runtime.spawn(server::accept_loop(Arc::clone(&shared), listener));
        tracing::debug!(%addr, %advertised, node = %shared.id, "node listening");
        Ok(Self {
            inner: Arc::new(Inner {
                shared,
                handle: runtime.handle().clone(),
                runtime: Mutex::new(Some(runtime)),
                addr,
                advertised,
            }),
        })
    }

    /// A loopback node on a free port.
    ///
    /// # Errors
    /// As [`Node::start`].
    pub fn loopback(token: ClusterToken) -> Result<Self> {
        Self::start(NodeConfig::loopback(token))
    }

    /// The address the node listens on.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// The address other nodes reach it at: [`NodeConfig::advertise`] when set, else
    /// [`Node::addr`]. What a node hands to peers (an endpoint, a rank's card) is this one.
    pub fn advertised(&self) -> SocketAddr {
        self.inner.advertised
    }

    /// The node's id.
    pub fn id(&self) -> Uuid {
        self.inner.shared.id
    }

    /// The cluster token.
    pub fn token(&self) -> &ClusterToken {
        &self.inner.shared.token
    }

    /// The runtime handle (to spawn work next to the node's tasks).
    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.inner.handle
    }

    /// How many connections were refused so far (bad token, malformed hello).
    pub fn refused(&self) -> u64 {
        self.inner.shared.refused.load(Ordering::Relaxed)
    }

    /// Registers a raw handler (bytes in, bytes out), replacing any with the same address.
    pub fn register_raw(
        &self,
        target: Uuid,
        method: &str,
        handler: impl Fn(CallInfo, Vec<u8>) -> BoxFuture<Result<Vec<u8>>> + Send + Sync + 'static,
    ) {
        write(&self.inner.shared.handlers).insert((target, method.to_owned()), Arc::new(handler));
    }

    /// Registers an async handler of typed requests and responses. The handler may fail
    /// with this crate's error or any that converts into it (the core's); the caller gets
    /// its message as [`Error::Remote`].
    pub fn register<Req, Resp, E, F, Fut>(&self, target: Uuid, method: &str, handler: F)
    where
        Req: DeserializeOwned + Send + 'static,
        Resp: Serialize + Send + 'static,
        E: Into<Error> + Send + 'static,
        F: Fn(CallInfo, Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<Resp, E>> + Send + 'static,
    {
        let max = self.inner.shared.max_frame;
        self.register_raw(target, method, move |info, bytes| {
            let req = wire::decode::<Req>(&bytes, max);
            let fut = req.map(|r| handler(info, r));
            Box::pin(async move {
                let resp = fut?.await.map_err(Into::into)?;
                Ok(wire::encode(&resp)?)
            })
        });
    }

    /// Registers a blocking handler: it runs on the runtime's blocking pool, so it may wait
    /// on locks, files or other nodes.
    pub fn register_blocking<Req, Resp, E, F>(&self, target: Uuid, method: &str, handler: F)
    where
        Req: DeserializeOwned + Send + 'static,
        Resp: Serialize + Send + 'static,
        E: Into<Error> + Send + 'static,
        F: Fn(CallInfo, Req) -> std::result::Result<Resp, E> + Send + Sync + 'static,
    {
        let handler = Arc::new(handler);
        self.register(target, method, move |info, req: Req| {
            let h = Arc::clone(&handler);
            async move {
                tokio::task::spawn_blocking(move || h(info, req).map_err(Into::into))
                    .await
                    .map_err(|e| {
                        Error::from(CoreError::State(if e.is_panic() {
                            "a blocking handler panicked"
                        } else {
                            "a blocking handler was cancelled"
                        }))
                    })?
            }
        });
    }

    /// Registers a stream handler: it receives the request frame and owns the socket; it
    /// writes a [`StreamHead`] (see [`write_head`]) and then raw bytes.
    pub fn register_stream(
        &self,
        target: Uuid,
        method: &str,
        handler: impl Fn(CallInfo, Vec<u8>, tokio::net::TcpStream) -> BoxFuture<Result<()>>
        + Send
        + Sync
        + 'static,
    ) {
        write(&self.inner.shared.streams).insert((target, method.to_owned()), Arc::new(handler));
    }

    /// Removes every handler and stream handler of `target`.
    pub fn unregister(&self, target: Uuid) {
        write(&self.inner.shared.handlers).retain(|(t, _), _| *t != target);
        write(&self.inner.shared.streams).retain(|(t, _), _| *t != target);
    }

    /// Calls `hook` with the id of every remote-call connection that closes (the peer died,
    /// left, or sent garbage).
    pub fn on_disconnect(&self, hook: impl Fn(ConnId) + Send + Sync + 'static) {
        write(&self.inner.shared.hooks).push(Arc::new(hook));
    }

    /// Connects to another node for remote calls (async).
    ///
    /// # Errors
    /// [`Timeout`](refit_runtime::Error::Timeout), [`Io`](refit_runtime::Error::Io) when unreachable, [`Error::Unauthorized`] when the
    /// other node refuses our token.
    ///
    /// # Cancel safety
    /// Cancel safe: dropped before it answers, the half-made connection is closed with it
    /// and nothing stays registered.
    pub async fn connect_async(&self, addr: SocketAddr, timeout: Duration) -> Result<Peer> {
        Peer::connect(
            self.inner.shared.id,
            &self.inner.shared.token,
            self.inner.shared.max_frame,
            addr,
            timeout,
        )
        .await
    }

    /// Connects to another node for remote calls (blocking).
    ///
    /// # Errors
    /// As [`Node::connect_async`].
    pub fn connect(&self, addr: SocketAddr, timeout: Duration) -> Result<Peer> {
        let this = self.clone();
        self.block_on(async move { this.connect_async(addr, timeout).await })
    }

    /// Opens a stream to a stream handler of another node (blocking; see [`open_stream`]).
    ///
    /// # Errors
    /// As [`open_stream`].
    pub fn open_stream<Req: Serialize>(
        &self,
        addr: SocketAddr,
        target: Uuid,
        method: &str,
        request: &Req,
        timeout: Duration,
    ) -> Result<OpenStream> {
        open_stream(
            addr,
            &self.inner.shared.token,
            self.inner.shared.id,
            target,
            method,
            request,
            timeout,
        )
    }

    /// Runs a future on the node's runtime and waits for it on this thread.
    ///
    /// # Errors
    /// The future's error, or [`State`](refit_runtime::Error::State) when the node is shut down.
    pub fn block_on<T: Send + 'static>(
        &self,
        fut: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.inner.handle.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv()
            .map_err(|_| Error::from(CoreError::State("the node is shut down")))?
    }

    /// Stops accepting and drops every connection and task of this node (idempotent; other
    /// clones see a stopped node). Calls still running are dropped unanswered (their callers
    /// get [`PeerGone`](refit_runtime::Error::PeerGone)); a call that already finished is
    /// answered first, so a caller whose call changed this node's state is told it did
    /// (waiting up to half a second for a peer that does not read; called on a thread of a
    /// runtime, the node finishes stopping on a thread of its own). A call that runs on, or
    /// awaits after it stopped its own node, is dropped unanswered like any other.
    pub fn shutdown(&self) {
        let rt = self
            .inner
            .runtime
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(rt) = rt {
            stop(&self.inner.shared, rt);
        }
    }
}

#[cfg(test)]
mod tests;
