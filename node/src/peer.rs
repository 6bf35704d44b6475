//! The calling side: one connection to another node, many calls in flight on it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use super::frame;
use super::message::{
    ConnKind, Hello, MAX_HELLO, Outcome, PROTOCOL_VERSION, Reply, Request, Welcome,
};
use super::token::ClusterToken;
use crate::error::{Error, Result};
use refit_runtime::Error as CoreError;
use refit_runtime::wire;

/// State shared by the handles and the connection's tasks.
struct Conn {
    addr: SocketAddr,
    pending: Mutex<HashMap<u64, oneshot::Sender<Outcome>>>,
    closed: AtomicBool,
    /// Woken when `closed` turns true.
    on_close: tokio::sync::Notify,
    why: Mutex<Option<String>>,
}

impl Conn {
    fn pending(&self) -> MutexGuard<'_, HashMap<u64, oneshot::Sender<Outcome>>> {
        // plain map; a panic elsewhere leaves it consistent
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the connection dead; every pending call then fails with `PeerGone`.
    fn close(&self, why: &str) {
        {
            let mut w = self.why.lock().unwrap_or_else(|p| p.into_inner());
            if w.is_none() {
                *w = Some(why.to_owned());
            }
        }
        self.closed.store(true, Ordering::Release);
        self.on_close.notify_waiters();
        self.pending().clear();
    }

    fn gone(&self) -> Error {
        let why = self
            .why
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| "connection closed".into());
        Error::from(CoreError::PeerGone {
            peer: format!("node at {}", self.addr),
            reason: why,
        })
    }
}

struct Inner {
    conn: Arc<Conn>,
    remote: Uuid,
    next: AtomicU64,
    out: mpsc::UnboundedSender<Vec<u8>>,
    handle: tokio::runtime::Handle,
    tasks: [tokio::task::AbortHandle; 2],
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.conn.close("closed by this side");
    }
}

/// A connection to another node for remote calls. Cheap to clone; the connection closes when
/// the last clone drops or [`Peer::close`] is called.
#[derive(Clone)]
pub struct Peer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("addr", &self.inner.conn.addr)
            .field("node", &self.inner.remote)
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl Peer {
    pub(super) async fn connect(
        me: Uuid,
        token: &ClusterToken,
        max_frame: usize,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<Self> {
        let deadline = tokio::time::Instant::now() + timeout;
        let timed_out = || {
            Error::from(CoreError::Timeout {
                what: format!("connecting to node at {addr}"),
                after: timeout,
            })
        };
        let mut stream = tokio::time::timeout_at(deadline, TcpStream::connect(addr))
            .await
            .map_err(|_| timed_out())?
            .map_err(|e| Error::io(format!("connecting to node at {addr}"), e))?;
        let _ = stream.set_nodelay(true);
        let hello = Hello {
            protocol: PROTOCOL_VERSION,
            token: token.expose().to_owned(),
            node: me,
            kind: ConnKind::Rpc,
        };
        let welcome = tokio::time::timeout_at(deadline, async {
            frame::send(&mut stream, &hello).await?;
            frame::recv::<Welcome, _>(&mut stream, MAX_HELLO).await
        })
        .await
        .map_err(|_| timed_out())?
        .map_err(|e| Error::Unauthorized {
            peer: addr.to_string(),
            reason: format!("no welcome: {e}"),
        })?;
        let remote = welcome.accepted(addr)?;
        let conn = Arc::new(Conn {
            addr,
            pending: Mutex::default(),
            closed: AtomicBool::new(false),
            on_close: tokio::sync::Notify::new(),
            why: Mutex::new(None),
        });
        let (mut rd, mut wr) = stream.into_split();
        let (out, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let wconn = Arc::clone(&conn);
        let writer = tokio::spawn(async move {
            while let Some(body) = rx.recv().await {
                if let Err(e) = frame::write_frame(&mut wr, &body).await {
                    wconn.close(&format!("write failed: {e}"));
                    break;
                }
            }
        });
        let rconn = Arc::clone(&conn);
        let reader = tokio::spawn(async move {
            let why = loop {
                match frame::read_frame(&mut rd, max_frame).await {
                    Ok(Some(body)) => match wire::decode::<Reply>(&body, max_frame) {
                        Ok(reply) => {
                            if let Some(tx) = rconn.pending().remove(&reply.call) {
                                let _ = tx.send(reply.outcome);
                            }
                        }
                        Err(e) => break format!("malformed reply: {e}"),
                    },
                    Ok(None) => break "the connection closed".to_owned(),
                    Err(e) => break e.to_string(),
                }
            };
            rconn.close(&why);
        });
        Ok(Self {
            inner: Arc::new(Inner {
                conn,
                remote,
                next: AtomicU64::new(1),
                out,
                handle: tokio::runtime::Handle::current(),
                tasks: [writer.abort_handle(), reader.abort_handle()],
            }),
        })
    }

    /// The other node's address.
    pub fn addr(&self) -> SocketAddr {
        self.inner.conn.addr
    }

    /// The other node's id.
    pub fn node(&self) -> Uuid {
        self.inner.remote
    }

    /// True once the connection is known to be dead.
    pub fn is_closed(&self) -> bool {
        self.inner.conn.closed.load(Ordering::Acquire)
    }

    /// Resolves once the connection is known to be dead (at once if it already is): a
    /// watcher learns of a closed connection when it happens, not at its next call.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future loses nothing.
    pub async fn closed(&self) {
        let notified = self.inner.conn.on_close.notified();
        tokio::pin!(notified);
        // registered before the check, so a close between the two is not missed
        notified.as_mut().enable();
        if self.is_closed() {
            return;
        }
        notified.await;
    }

    /// Closes the connection for every clone; pending calls fail with [`PeerGone`](refit_runtime::Error::PeerGone).
    pub fn close(&self) {
        for t in &self.inner.tasks {
            t.abort();
        }
        self.inner.conn.close("closed by this side");
    }

    /// Calls a raw handler (async).
    ///
    /// # Errors
    /// [`Timeout`](refit_runtime::Error::Timeout) when no reply comes within `timeout`; [`PeerGone`](refit_runtime::Error::PeerGone) when the
    /// connection dies first; [`Error::Remote`] when the handler fails.
    ///
    /// # Cancel safety
    /// Cancel safe for the connection: dropped after the request left, the handler may
    /// still run on the peer and its answer is discarded when it comes; the call's pending
    /// slot is freed then, or when the connection closes.
    pub async fn call_raw_async(
        &self,
        target: Uuid,
        method: &str,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let conn = &self.inner.conn;
        if self.is_closed() {
            return Err(conn.gone());
        }
        let call = self.inner.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        conn.pending().insert(call, tx);
        if self.is_closed() {
            conn.pending().remove(&call);
            return Err(conn.gone());
        }
        let body = wire::encode(&Request {
            call,
            target,
            method: method.to_owned(),
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            payload,
        })?;
        if self.inner.out.send(body).is_err() {
            conn.pending().remove(&call);
            return Err(conn.gone());
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(Outcome::Ok(bytes))) => Ok(bytes),
            Ok(Ok(Outcome::Err(message))) => Err(Error::Remote {
                peer: conn.addr.to_string(),
                method: method.to_owned(),
                message,
            }),
            Ok(Err(_)) => Err(conn.gone()),
            // the server cut the handler at this call's deadline, or our timer fired first:
            // either way the call timed out
            Ok(Ok(Outcome::TimedOut)) | Err(_) => {
                conn.pending().remove(&call);
                Err(Error::from(CoreError::Timeout {
                    what: format!("`{method}` on node at {}", conn.addr),
                    after: timeout,
                }))
            }
        }
    }

    /// Calls a typed handler (async).
    ///
    /// # Errors
    /// As [`Peer::call_raw_async`], plus [`Wire`](refit_runtime::Error::Wire) for a reply of the wrong type.
    ///
    /// # Cancel safety
    /// As [`Peer::call_raw_async`].
    pub async fn call_async<Req: Serialize + ?Sized, Resp: DeserializeOwned>(
        &self,
        target: Uuid,
        method: &str,
        request: &Req,
        timeout: Duration,
    ) -> Result<Resp> {
        let bytes = self
            .call_raw_async(target, method, wire::encode(request)?, timeout)
            .await?;
        Ok(wire::decode(&bytes, wire::MAX_CONTROL_MESSAGE)?)
    }

    /// Calls a typed handler, blocking this thread (not for use inside async tasks).
    ///
    /// # Errors
    /// As [`Peer::call_async`]; [`State`](refit_runtime::Error::State) when the node running the connection is
    /// shut down.
    pub fn call<Req: Serialize + ?Sized, Resp: DeserializeOwned + Send + 'static>(
        &self,
        target: Uuid,
        method: &str,
        request: &Req,
        timeout: Duration,
    ) -> Result<Resp> {
        let payload = wire::encode(request)?;
        let this = self.clone();
        let method = method.to_owned();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.inner.handle.spawn(async move {
            let r = this.call_raw_async(target, &method, payload, timeout).await;
            let _ = tx.send(r);
        });
        let bytes = rx.recv().map_err(|_| {
            Error::from(CoreError::State(
                "the node running this connection is shut down",
            ))
        })??;
        Ok(wire::decode(&bytes, wire::MAX_CONTROL_MESSAGE)?)
    }
}
