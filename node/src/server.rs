//! The accepting side of a node: hello and token check, the remote-call loop, streams.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::message::{
    ConnKind, Hello, MAX_HELLO, Outcome, PROTOCOL_VERSION, Reply, Request, StreamHead, Welcome,
};
use super::{CallInfo, ConnId, Shared, frame, read, stream::write_head};
use crate::error::{Error, Result};
use refit_runtime::Error as CoreError;
use refit_runtime::wire;

pub(super) async fn accept_loop(shared: Arc<Shared>, listener: tokio::net::TcpListener) {
    let mut stopping = shared.stopping.subscribe();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            // a stopping node takes no new connection
            _ = stopping.wait_for(|stop| *stop) => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve_conn(Arc::clone(&shared), stream, peer));
            }
            Err(e) => {
                // out of descriptors and the like: back off instead of spinning
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn refuse(shared: &Shared, peer: SocketAddr, reason: &str) {
    shared.refused.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(%peer, reason, "refused a connection");
}

async fn serve_conn(shared: Arc<Shared>, mut stream: TcpStream, peer: SocketAddr) {
    let conn = ConnId(shared.next_conn.fetch_add(1, Ordering::Relaxed));
    let hello = tokio::time::timeout(
        shared.hello_timeout,
        frame::read_frame(&mut stream, MAX_HELLO),
    )
    .await;
    let body = match hello {
        Ok(Ok(Some(b))) => b,
        Ok(Ok(None)) => return refuse(&shared, peer, "closed before its hello"),
        Ok(Err(e)) => return refuse(&shared, peer, &format!("bad hello: {e}")),
        Err(_) => return refuse(&shared, peer, "no hello in time"),
    };
    let hello = match Hello::decode(&body, peer) {
        Ok(h) => h,
        Err(e @ CoreError::Protocol { .. }) => {
            refuse(&shared, peer, &e.to_string());
            let _ = handshake_send(&shared, &mut stream, &Welcome::wrong_protocol(&e)).await;
            return;
        }
        Err(e) => return refuse(&shared, peer, &format!("bad hello: {e}")),
    };
    if !shared.token.matches(&hello.token) {
        refuse(&shared, peer, "wrong or missing cluster token");
        let _ = handshake_send(
            &shared,
            &mut stream,
            &Welcome::Refused {
                reason: "wrong or missing cluster token".into(),
                protocol: None,
            },
        )
        .await;
        return;
    }
    let welcome = Welcome::Ok {
        node: shared.id,
        protocol: PROTOCOL_VERSION,
    };
    if handshake_send(&shared, &mut stream, &welcome)
        .await
        .is_err()
    {
        return;
    }
    let info = CallInfo {
        conn,
        peer,
        node: hello.node,
        deadline: Instant::now(),
    };
    if *shared.stopping.borrow() {
        // a stopping node starts nothing new
        return;
    }
    match hello.kind {
        ConnKind::Rpc => {
            if let Err(e) = rpc_loop(&shared, stream, info).await {
                refit_runtime::unless_stopping!(warn, %peer, error = %e, "remote-call connection closed on error");
            }
            let hooks = read(&shared.hooks).clone();
            for hook in hooks {
                hook(conn);
            }
        }
        ConnKind::Stream { target, method } => {
            if let Err(e) = serve_stream(&shared, stream, info, target, method).await {
                tracing::debug!(%peer, error = %e, "stream ended on error");
            }
        }
    }
}

/// Writes a handshake answer within the hello deadline: a peer that does not read it does
/// not hold the connection's task.
async fn handshake_send(shared: &Shared, stream: &mut TcpStream, welcome: &Welcome) -> Result<()> {
    match tokio::time::timeout(shared.hello_timeout, frame::send(stream, welcome)).await {
        Ok(sent) => sent,
        Err(_) => Err(Error::from(CoreError::Timeout {
            what: "the peer to read its welcome".into(),
            after: shared.hello_timeout,
        })),
    }
}

async fn serve_stream(
    shared: &Shared,
    mut stream: TcpStream,
    info: CallInfo,
    target: uuid::Uuid,
    method: String,
) -> Result<()> {
    // the request follows the hello at once: a peer that holds it back is dropped at the
    // hello deadline, not kept (with its task and descriptor) for good
    let request = tokio::time::timeout(
        shared.hello_timeout,
        frame::read_frame(&mut stream, shared.max_frame),
    )
    .await;
    let request = match request {
        Ok(read) => read?.ok_or_else(|| {
            Error::from(CoreError::Wire("stream closed before its request".into()))
        })?,
        Err(_) => {
            refuse(shared, info.peer, "no stream request in time");
            return Err(Error::from(CoreError::Timeout {
                what: format!("the request of stream `{method}`"),
                after: shared.hello_timeout,
            }));
        }
    };
    let handler = read(&shared.streams)
        .get(&(target, method.clone()))
        .cloned();
    match handler {
        Some(h) => h(info, request, stream).await,
        None => {
            write_head(
                &mut stream,
                &StreamHead::Err {
                    reason: format!("no stream handler `{method}` for {target}"),
                },
            )
            .await
        }
    }
}

/// A remote call read and not yet answered: counted in [`Shared::owed`] from the moment its
/// frame is read until its reply is written (or the call is dropped), so that a stopping
/// node writes the replies of the calls it carried out before it closes their connections.
pub(super) struct Owed(Arc<Shared>);

impl Owed {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.owed.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(shared))
    }
}

impl Drop for Owed {
    fn drop(&mut self) {
        self.0.owed.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn rpc_loop(shared: &Arc<Shared>, stream: TcpStream, info: CallInfo) -> Result<()> {
    let (mut rd, mut wr) = stream.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<(Vec<u8>, Owed)>();
    let writer = tokio::spawn(async move {
        while let Some((body, owed)) = rx.recv().await {
            let written = frame::write_frame(&mut wr, &body).await;
            drop(owed);
            if written.is_err() {
                break;
            }
        }
    });
    let result = loop {
        let body = match frame::read_frame(&mut rd, shared.max_frame).await {
            Ok(Some(b)) => b,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        let req: Request = match wire::decode(&body, shared.max_frame) {
            Ok(r) => r,
            Err(e) => break Err(e.into()),
        };
        let handler = read(&shared.handlers)
            .get(&(req.target, req.method.clone()))
            .cloned();
        let tx = tx.clone();
        let timeout = Duration::from_millis(req.timeout_ms);
        let info = CallInfo {
            deadline: refit_runtime::scheme::deadline_in(timeout),
            ..info
        };
        if *shared.stopping.borrow() {
            // stopping: the frame is read and dropped (see below)
            continue;
        }
        let owed = Owed::new(shared);
        if *shared.stopping.borrow() {
            // a stopping node carries out no new call (counted first, so that the stop sees
            // either the count or this check sees it stopping). The frame is still read off
            // the socket: unread bytes would turn its close into a reset that loses the
            // replies written just before.
            continue;
        }
        let mut stopping = shared.stopping.subscribe();
        // the handler is called here, as its frame arrives, so that what it does at once
        // (an actor handler enqueues the message) happens in the order the calls were sent
        let call = handler.map(|h| h(info, req.payload));
        let method = req.method;
        let target = req.target;
        tokio::spawn(async move {
            let answer = async {
                match call {
                    None => Outcome::Err(format!("no handler `{method}` for target {target}")),
                    Some(fut) => match tokio::time::timeout(timeout, fut).await {
                        Ok(Ok(bytes)) => Outcome::Ok(bytes),
                        Ok(Err(e)) => Outcome::Err(e.to_string()),
                        Err(_) => Outcome::TimedOut,
                    },
                }
            };
            // a stopping node drops the calls still running (their callers see the
            // connection close) and answers those that finished
            let outcome = tokio::select! {
                biased;
                outcome = answer => outcome,
                _ = stopping.wait_for(|stop| *stop) => return,
            };
            if let Ok(body) = wire::encode(&Reply {
                call: req.call,
                outcome,
            }) {
                let _ = tx.send((body, owed));
            }
        });
    };
    drop(tx);
    if result.is_err() {
        // garbage on the wire: close now rather than after in-flight replies
        writer.abort();
    }
    result
}
