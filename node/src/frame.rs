//! Frames: a big-endian `u32` length, then that many bytes of msgpack.
//!
//! The length is checked against the caller's limit *before* anything is allocated, so a
//! peer cannot make us reserve memory by announcing a huge frame. Async (tokio) and blocking
//! (`std::io`) forms share the same rules.

use std::io::{Read, Write};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, Result};
use refit_runtime::Error as CoreError;
use refit_runtime::wire;

/// Bytes of the length prefix.
pub const PREFIX: usize = 4;

fn check_len(len: u32, max: usize) -> Result<usize> {
    let len = usize::try_from(len)
        .map_err(|_| Error::from(CoreError::Wire("frame length overflows".into())))?;
    if len > max {
        return Err(Error::from(CoreError::Wire(format!(
            "frame of {len} bytes exceeds the {max}-byte limit"
        ))));
    }
    Ok(len)
}

fn prefix(len: usize) -> Result<[u8; PREFIX]> {
    u32::try_from(len).map(u32::to_be_bytes).map_err(|_| {
        Error::from(CoreError::Wire(format!(
            "frame of {len} bytes is too long to send"
        )))
    })
}

fn eof_is_truncation(e: std::io::Error, what: &str) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::from(CoreError::Wire(format!(
            "truncated frame: the peer closed mid-{what}"
        )))
    } else {
        Error::io(format!("reading a frame {what}"), e)
    }
}

/// Reads one frame; `Ok(None)` on a clean end of stream before its first byte.
///
/// # Errors
/// [`Wire`](refit_runtime::Error::Wire) for an oversized or truncated frame, [`Io`](refit_runtime::Error::Io) for socket errors.
///
/// # Cancel safety
/// Not cancel safe: dropped mid-frame, the bytes read so far are lost and the stream is
/// out of step. Read a stream's frames from one task that awaits each to the end.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max: usize) -> Result<Option<Vec<u8>>> {
    let mut head = [0u8; PREFIX];
    let mut got = 0;
    while got < PREFIX {
        let n = r
            .read(&mut head[got..])
            .await
            .map_err(|e| Error::io("reading a frame length", e))?;
        if n == 0 {
            return closed_before_length(got);
        }
        got += n;
    }
    let len = check_len(u32::from_be_bytes(head), max)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .await
        .map_err(|e| eof_is_truncation(e, "body"))?;
    Ok(Some(body))
}

/// Writes one frame (length prefix and body) and flushes.
///
/// # Errors
/// [`Wire`](refit_runtime::Error::Wire) for a body over 4 GiB, [`Io`](refit_runtime::Error::Io) for socket errors.
///
/// # Cancel safety
/// Not cancel safe: dropped mid-write, part of the frame may be on the wire and the peer
/// reads a corrupt stream. Write a stream's frames from one task that awaits each.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, body: &[u8]) -> Result<()> {
    let head = prefix(body.len())?;
    let mut buf = Vec::with_capacity(PREFIX + body.len());
    buf.extend_from_slice(&head);
    buf.extend_from_slice(body);
    w.write_all(&buf)
        .await
        .map_err(|e| Error::io("writing a frame", e))?;
    w.flush()
        .await
        .map_err(|e| Error::io("flushing a frame", e))
}

/// Reads one frame and decodes it (async).
///
/// # Errors
/// As [`read_frame`], plus [`Wire`](refit_runtime::Error::Wire) for a malformed message or an early end of stream.
///
/// # Cancel safety
/// As [`read_frame`].
pub async fn recv<T: DeserializeOwned, R: AsyncRead + Unpin>(r: &mut R, max: usize) -> Result<T> {
    match read_frame(r, max).await? {
        Some(body) => Ok(wire::decode(&body, max)?),
        None => Err(Error::from(CoreError::Wire(
            "the peer closed before sending a frame".into(),
        ))),
    }
}

/// Encodes a message and writes it as one frame (async).
///
/// # Errors
/// As [`write_frame`].
///
/// # Cancel safety
/// As [`write_frame`].
pub async fn send<T: Serialize, W: AsyncWrite + Unpin>(w: &mut W, msg: &T) -> Result<()> {
    write_frame(w, &wire::encode(msg)?).await
}

/// Blocking [`read_frame`].
///
/// # Errors
/// As [`read_frame`].
pub fn read_frame_blocking<R: Read>(r: &mut R, max: usize) -> Result<Option<Vec<u8>>> {
    let mut head = [0u8; PREFIX];
    let mut got = 0;
    while got < PREFIX {
        let n = match r.read(&mut head[got..]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io("reading a frame length", e)),
        };
        if n == 0 {
            return closed_before_length(got);
        }
        got += n;
    }
    let len = check_len(u32::from_be_bytes(head), max)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .map_err(|e| eof_is_truncation(e, "body"))?;
    Ok(Some(body))
}

/// Blocking [`write_frame`].
///
/// # Errors
/// As [`write_frame`].
pub fn write_frame_blocking<W: Write>(w: &mut W, body: &[u8]) -> Result<()> {
    let head = prefix(body.len())?;
    let mut buf = Vec::with_capacity(PREFIX + body.len());
    buf.extend_from_slice(&head);
    buf.extend_from_slice(body);
    w.write_all(&buf)
        .map_err(|e| Error::io("writing a frame", e))?;
    w.flush().map_err(|e| Error::io("flushing a frame", e))
}

/// Blocking [`recv`].
///
/// # Errors
/// As [`recv`].
pub fn recv_blocking<T: DeserializeOwned, R: Read>(r: &mut R, max: usize) -> Result<T> {
    match read_frame_blocking(r, max)? {
        Some(body) => Ok(wire::decode(&body, max)?),
        None => Err(Error::from(CoreError::Wire(
            "the peer closed before sending a frame".into(),
        ))),
    }
}

/// Blocking [`send`].
///
/// # Errors
/// As [`write_frame`].
pub fn send_blocking<T: Serialize, W: Write>(w: &mut W, msg: &T) -> Result<()> {
    write_frame_blocking(w, &wire::encode(msg)?)
}

/// The peer closed while `got` bytes of a length prefix had arrived: a clean end between
/// frames when none had, a truncated frame otherwise.
fn closed_before_length(got: usize) -> Result<Option<Vec<u8>>> {
    if got == 0 {
        return Ok(None);
    }
    Err(Error::from(CoreError::Wire(
        "truncated frame: the peer closed mid-length".into(),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_limits_apply_before_allocation() {
        let mut buf = Vec::new();
        write_frame_blocking(&mut buf, b"hello").unwrap();
        write_frame_blocking(&mut buf, b"").unwrap();
        let mut r = &buf[..];
        assert_eq!(read_frame_blocking(&mut r, 16).unwrap().unwrap(), b"hello");
        assert_eq!(read_frame_blocking(&mut r, 16).unwrap().unwrap(), b"");
        assert!(read_frame_blocking(&mut r, 16).unwrap().is_none());
        // a 4 GiB announcement is refused from its prefix alone
        let huge = [0xff, 0xff, 0xff, 0xff];
        let e = read_frame_blocking(&mut &huge[..], 1 << 20).unwrap_err();
        assert!(e.to_string().contains("exceeds"), "{e}");
        // truncated length and truncated body
        let e = read_frame_blocking(&mut &[0u8, 0][..], 16).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        let e = read_frame_blocking(&mut &[0u8, 0, 0, 9, 1, 2][..], 16).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
    }
}
