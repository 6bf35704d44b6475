//! Streams: a connection that carries one request frame, a [`StreamHead`], then raw bytes.
//! The client side is blocking (`std::net`), so bulk reads land straight in the caller's
//! buffer from plain threads.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::AsyncWrite;
use uuid::Uuid;

use super::frame;
use super::message::{ConnKind, Hello, MAX_HELLO, PROTOCOL_VERSION, StreamHead, Welcome};
use super::token::ClusterToken;
use crate::error::{Error, Result};
use refit_runtime::Error as CoreError;
use refit_runtime::wire;

/// Writes the head of a stream (stream handlers call this first).
///
/// # Errors
/// Socket errors.
///
/// # Cancel safety
/// As [`frame::write_frame`](crate::frame::write_frame): not cancel safe.
pub async fn write_head<W: AsyncWrite + Unpin>(w: &mut W, head: &StreamHead) -> Result<()> {
    frame::send(w, head).await
}

/// An open stream: read exactly `len` raw bytes from `stream`.
#[derive(Debug)]
pub struct OpenStream {
    /// The socket, positioned at the first raw byte; its read timeout is set.
    pub stream: TcpStream,
    /// How many raw bytes follow.
    pub len: u64,
}

/// Opens a stream to `method` of `target` on the node at `addr`, sends `request`, and reads
/// the head. Every step, and every later read on the socket, is bounded by `timeout`.
///
/// # Errors
/// [`Timeout`](refit_runtime::Error::Timeout)/[`Io`](refit_runtime::Error::Io) when unreachable, [`Error::Unauthorized`] when refused,
/// [`Error::Remote`] when the handler answers an error head.
pub fn open_stream<Req: Serialize>(
    addr: SocketAddr,
    token: &ClusterToken,
    me: Uuid,
    target: Uuid,
    method: &str,
    request: &Req,
    timeout: Duration,
) -> Result<OpenStream> {
    let started = Instant::now();
    let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| {
        if e.kind() == std::io::ErrorKind::TimedOut {
            Error::from(CoreError::Timeout {
                what: format!("connecting to node at {addr}"),
                after: timeout,
            })
        } else {
            Error::io(format!("connecting to node at {addr}"), e)
        }
    })?;
    let io = |e| Error::io(format!("configuring a stream to {addr}"), e);
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    let _ = stream.set_nodelay(true);
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        token: token.expose().to_owned(),
        node: me,
        kind: ConnKind::Stream {
            target,
            method: method.to_owned(),
        },
    };
    let timed = |e: Error| match e {
        Error::Core(CoreError::Io { source, .. })
            if matches!(
                source.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Error::from(CoreError::Timeout {
                what: format!("stream `{method}` on node at {addr}"),
                after: started.elapsed(),
            })
        }
        e => e,
    };
    frame::send_blocking(&mut stream, &hello).map_err(timed)?;
    match frame::recv_blocking::<Welcome, _>(&mut stream, MAX_HELLO) {
        Ok(welcome) => {
            welcome.accepted(addr)?;
        }
        Err(e) => {
            return Err(Error::Unauthorized {
                peer: addr.to_string(),
                reason: format!("no welcome: {e}"),
            });
        }
    }
    frame::write_frame_blocking(&mut stream, &wire::encode(request)?).map_err(timed)?;
    match frame::recv_blocking::<StreamHead, _>(&mut stream, MAX_HELLO).map_err(timed)? {
        StreamHead::Ok { len } => Ok(OpenStream { stream, len }),
        StreamHead::Err { reason } => Err(Error::Remote {
            peer: addr.to_string(),
            method: method.to_owned(),
            message: reason,
        }),
    }
}
