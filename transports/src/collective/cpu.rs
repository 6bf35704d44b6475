//! The CPU backend: a [`Communicator`] over TCP between the ranks of a group, with host
//! bytes as buffers (`Buf = Vec<u8>`).
//!
//! Setup goes through a [`Rendezvous`] store: every rank listens, publishes its address
//! under [`Membership::key`]`("addr/{rank}")`, connects to every higher rank and accepts
//! every lower one (a full mesh, so send/recv reach any peer). Each connection opens with a
//! hello frame carrying the cluster token (the node runtime's [`ClusterToken`], compared in
//! constant time, framed with its [`frame`] codec), the collective's [`PROTOCOL_VERSION`]
//! and the group, generation and ranks; a connection with another protocol version, a wrong
//! token or from another group is refused (the refusal names both versions, or the token,
//! or both groups) and the rank goes on waiting for the right one.
//!
//! Broadcast is a pipelined chain in rank order starting at the root: the root writes its
//! bytes to the next rank in chunks, every other rank reads a chunk from the previous rank and
//! forwards it to the next while the previous rank already sends the following chunk. Each
//! byte crosses each link once, so N receivers take little more than one on a network whose
//! links are independent.
//!
//! Every socket operation is bounded by the call's deadline; a peer that closes fails the
//! call with [`Error::PeerGone`] naming its rank; any failure aborts the communicator, which
//! shuts down every socket so the neighbours fail at once instead of waiting.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use refit_node::{ClusterToken, frame};
use refit_runtime::{Error, Result, wire};
use serde::{Deserialize, Serialize};

use super::{Communicator, Membership, Rendezvous};

const BACKEND: &str = "cpu";
/// Longest hello frame accepted.
const MAX_HELLO: usize = 4096;

/// How a CPU communicator is set up.
#[derive(Clone, Debug)]
pub struct CpuConfig {
    /// The cluster token every connection presents.
    pub token: ClusterToken,
    /// The address to listen on (and to publish): loopback by default.
    pub bind: IpAddr,
    /// Broadcast chunk: a rank forwards chunk k while it receives chunk k+1 (default 1 MiB).
    pub chunk: usize,
}

impl CpuConfig {
    /// Loopback, 1 MiB chunks, the given token.
    pub fn new(token: ClusterToken) -> Self {
        Self {
            token,
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            chunk: crate::FORWARD_PIECE,
        }
    }

    /// Listens on (and publishes) `bind` instead of loopback.
    #[must_use]
    pub fn with_bind(mut self, bind: IpAddr) -> Self {
        self.bind = bind;
        self
    }

    /// Uses broadcast chunks of `chunk` bytes (at least 4 KiB).
    #[must_use]
    pub fn with_chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk.max(4096);
        self
    }
}

/// The version of the CPU collective's protocol (the hello, the welcome, the chain's
/// framing) this build speaks: each connection's hello and welcome carry it, and a rank of
/// another version is refused naming both.
pub const PROTOCOL_VERSION: u32 = 1;

/// The name of the protocol in errors.
const PROTOCOL_NAME: &str = "cpu collective";

/// The first frame of every connection between two ranks.
#[derive(Serialize, Deserialize)]
struct Hello {
    /// [`PROTOCOL_VERSION`] of the connecting rank (0 from a rank of before protocol
    /// versions); read first, alone.
    #[serde(default)]
    protocol: u32,
    token: String,
    group: String,
    generation: u64,
    rank: u64,
    world: u64,
}

/// The answer to a [`Hello`]: `None` when accepted, the reason otherwise.
#[derive(Serialize, Deserialize)]
struct Welcome {
    refused: Option<String>,
    /// [`PROTOCOL_VERSION`] of the accepting rank (0 from a rank of before protocol
    /// versions).
    #[serde(default)]
    protocol: u32,
}

impl Welcome {
    fn refusing(reason: String) -> Self {
        Self {
            refused: Some(reason),
            protocol: PROTOCOL_VERSION,
        }
    }
}

/// One rank's CPU communicator (see the module docs).
#[derive(Debug)]
pub struct CpuComm {
    membership: Membership,
    /// The connection to each rank (`None` at this rank's own index).
    links: Vec<Option<TcpStream>>,
    chunk: usize,
    aborted: Option<String>,
}

impl CpuComm {
    /// Joins the group of `membership`: listens, publishes the address, connects the mesh and
    /// checks every peer's hello, all before `deadline`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when a rank does not show up in time; [`Error::Io`] for socket
    /// errors; [`Error::Collective`] when a peer refuses this rank.
    pub fn connect(
        membership: Membership,
        store: &dyn Rendezvous,
        config: &CpuConfig,
        deadline: Instant,
    ) -> Result<Self> {
        let m = membership;
        let listener = TcpListener::bind(SocketAddr::new(config.bind, 0))
            .map_err(|e| Error::io(format!("listening on {}", config.bind), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the listening address", e))?;
        store.set(
            &m.key(&format!("addr/{}", m.rank)),
            addr.to_string().as_bytes(),
        )?;
        let mut links: Vec<Option<TcpStream>> = (0..m.world).map(|_| None).collect();
        // lower ranks connect to higher ones: connect out first, then accept what is owed
        for (peer, link) in links.iter_mut().enumerate().skip(m.rank + 1) {
            *link = Some(connect_to(&m, store, config, peer, deadline)?);
        }
        accept_from(&m, &listener, config, &mut links, deadline)?;
        Ok(Self {
            membership: m,
            links,
            chunk: config.chunk.max(4096),
            aborted: None,
        })
    }

    fn check(&self) -> Result<()> {
        match &self.aborted {
            Some(reason) => Err(self
                .membership
                .error(BACKEND, format!("aborted earlier: {reason}"))),
            None => Ok(()),
        }
    }

    /// Runs `f`, aborting the communicator when it fails.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.check()?;
        let out = f(self);
        if let Err(e) = &out {
            self.abort(&e.to_string());
        }
        out
    }

    fn link(&mut self, peer: usize) -> Result<&mut TcpStream> {
        let m = &self.membership;
        if peer >= m.world || peer == m.rank {
            return Err(m.error(
                BACKEND,
                format!("rank {peer} is not a peer in a world of {}", m.world),
            ));
        }
        let err = m.error(BACKEND, format!("no link to rank {peer}"));
        self.links[peer].as_mut().ok_or(err)
    }

    fn read_from(&mut self, peer: usize, dst: &mut [u8], deadline: Instant) -> Result<()> {
        let who = self.peer_name(peer);
        let stream = self.link(peer)?;
        transfer(stream, Dir::In(dst), deadline, &who)
    }

    fn write_to(&mut self, peer: usize, src: &[u8], deadline: Instant) -> Result<()> {
        let who = self.peer_name(peer);
        let stream = self.link(peer)?;
        transfer(stream, Dir::Out(src), deadline, &who)
    }

    fn peer_name(&self, peer: usize) -> String {
        let m = &self.membership;
        format!(
            "rank {peer} of collective `{}` (generation {})",
            m.group, m.generation
        )
    }

    /// The previous and next rank of the broadcast chain from `root`.
    fn chain(&self, root: usize) -> (Option<usize>, Option<usize>) {
        let w = self.membership.world;
        let pos = (self.membership.rank + w - root) % w;
        let prev = (pos > 0).then(|| (root + pos - 1) % w);
        let next = (pos + 1 < w).then(|| (root + pos + 1) % w);
        (prev, next)
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.membership.world {
            return Err(self.membership.error(
                BACKEND,
                format!("root {root} is not in a world of {}", self.membership.world),
            ));
        }
        Ok(())
    }

    /// The root's side of a broadcast: sends `bytes` down the chain.
    fn chain_send(&mut self, bytes: &[u8], deadline: Instant) -> Result<()> {
        let (_, next) = self.chain(self.membership.rank);
        let Some(next) = next else { return Ok(()) };
        let chunk = self.chunk;
        for piece in bytes.chunks(chunk) {
            self.write_to(next, piece, deadline)?;
        }
        Ok(())
    }

    /// A non-root rank's side: receives chunk by chunk into `bytes`, forwarding each.
    fn chain_relay(&mut self, bytes: &mut [u8], root: usize, deadline: Instant) -> Result<()> {
        let (prev, next) = self.chain(root);
        let Some(prev) = prev else { return Ok(()) };
        let chunk = self.chunk;
        for piece in bytes.chunks_mut(chunk) {
            self.read_from(prev, piece, deadline)?;
            if let Some(next) = next {
                self.write_to(next, piece, deadline)?;
            }
        }
        Ok(())
    }
}

impl Communicator for CpuComm {
    type Buf = Vec<u8>;

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn membership(&self) -> &Membership {
        &self.membership
    }

    fn alloc(&mut self, len: usize) -> Result<Vec<u8>> {
        self.check()?;
        Ok(vec![0; len])
    }

    fn upload(&mut self, src: &[u8], dst: &mut Vec<u8>, _deadline: Instant) -> Result<()> {
        self.check()?;
        let have = dst.len();
        let d = dst.get_mut(..src.len()).ok_or_else(|| {
            self.membership.error(
                BACKEND,
                format!("upload of {} bytes into a {have}-byte buffer", src.len()),
            )
        })?;
        d.copy_from_slice(src);
        Ok(())
    }

    fn download(&mut self, src: &Vec<u8>, dst: &mut [u8], _deadline: Instant) -> Result<()> {
        self.check()?;
        let s = src.get(..dst.len()).ok_or_else(|| {
            self.membership.error(
                BACKEND,
                format!(
                    "download of {} bytes from a {}-byte buffer",
                    dst.len(),
                    src.len()
                ),
            )
        })?;
        dst.copy_from_slice(s);
        Ok(())
    }

    fn broadcast(
        &mut self,
        buf: &mut Vec<u8>,
        len: usize,
        root: usize,
        deadline: Instant,
    ) -> Result<()> {
        if len > buf.len() {
            let e = self.membership.error(
                BACKEND,
                format!("broadcast of {len} bytes from a {}-byte buffer", buf.len()),
            );
            self.abort(&e.to_string());
            return Err(e);
        }
        self.broadcast_host(&mut buf[..len], root, deadline)
    }

    fn send(&mut self, buf: &Vec<u8>, len: usize, peer: usize, deadline: Instant) -> Result<()> {
        self.guarded(|c| {
            let bytes = buf.get(..len).ok_or_else(|| {
                c.membership.error(
                    BACKEND,
                    format!("send of {len} bytes from a {}-byte buffer", buf.len()),
                )
            })?;
            c.write_to(peer, bytes, deadline)
        })
    }

    fn recv(&mut self, b: &mut Vec<u8>, len: usize, peer: usize, deadline: Instant) -> Result<()> {
        self.guarded(|c| {
            let have = b.len();
            let bytes = b.get_mut(..len).ok_or_else(|| {
                c.membership.error(
                    BACKEND,
                    format!("recv of {len} bytes into a {have}-byte buffer"),
                )
            })?;
            c.read_from(peer, bytes, deadline)
        })
    }

    /// Moves the caller's bytes straight to and from the sockets (no staging buffer).
    fn broadcast_host(&mut self, bytes: &mut [u8], root: usize, deadline: Instant) -> Result<()> {
        self.guarded(|c| {
            c.check_root(root)?;
            if c.membership.rank == root {
                c.chain_send(bytes, deadline)
            } else {
                c.chain_relay(bytes, root, deadline)
            }
        })
    }

    /// Sends the caller's bytes straight from the shared slice (no staging copy).
    fn broadcast_send(&mut self, bytes: &[u8], deadline: Instant) -> Result<()> {
        self.guarded(|c| c.chain_send(bytes, deadline))
    }

    fn abort(&mut self, reason: &str) {
        if self.aborted.is_none() {
            self.aborted = Some(reason.to_owned());
        }
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn is_aborted(&self) -> bool {
        self.aborted.is_some()
    }
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    (!left.is_zero()).then_some(left)
}

fn timed_out(what: String, started: Instant) -> Error {
    Error::Timeout {
        what,
        after: started.elapsed(),
    }
}

fn gone(who: &str, reason: impl Into<String>) -> Error {
    Error::PeerGone {
        peer: who.to_owned(),
        reason: reason.into(),
    }
}

fn is_wait(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

fn is_gone(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::BrokenPipe
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::NotConnected
            | ErrorKind::UnexpectedEof
    )
}

/// Which way bytes move on a link.
enum Dir<'a> {
    In(&'a mut [u8]),
    Out(&'a [u8]),
}

/// Moves every byte of `dir` over `stream` before `deadline`: a peer that closes is
/// [`Error::PeerGone`] naming `who`, a deadline that passes [`Error::Timeout`].
fn transfer(stream: &mut TcpStream, mut dir: Dir<'_>, deadline: Instant, who: &str) -> Result<()> {
    let started = Instant::now();
    let total = match &dir {
        Dir::In(b) => b.len(),
        Dir::Out(b) => b.len(),
    };
    let mut at = 0;
    while at < total {
        let Some(left) = remaining(deadline) else {
            let what = match dir {
                Dir::In(_) => format!("bytes from {who}"),
                Dir::Out(_) => format!("sending to {who}"),
            };
            return Err(timed_out(what, started));
        };
        let step = match &mut dir {
            Dir::In(b) => stream
                .set_read_timeout(Some(left))
                .and_then(|()| stream.read(&mut b[at..])),
            Dir::Out(b) => stream
                .set_write_timeout(Some(left))
                .and_then(|()| stream.write(&b[at..])),
        };
        match step {
            Ok(0) => return Err(gone(who, format!("closed after {at} of {total} bytes"))),
            Ok(n) => at += n,
            Err(e) if e.kind() == ErrorKind::Interrupted || is_wait(&e) => {}
            Err(e) if is_gone(&e) => return Err(gone(who, e.to_string())),
            Err(e) => return Err(Error::io(format!("moving bytes with {who}"), e)),
        }
    }
    Ok(())
}

fn hello_for(m: &Membership, config: &CpuConfig) -> Hello {
    Hello {
        protocol: PROTOCOL_VERSION,
        token: config.token.expose().to_owned(),
        group: m.group.clone(),
        generation: m.generation,
        rank: m.rank as u64,
        world: m.world as u64,
    }
}

/// Connects to `peer` (a higher rank) and presents this rank's hello.
fn connect_to(
    m: &Membership,
    store: &dyn Rendezvous,
    config: &CpuConfig,
    peer: usize,
    deadline: Instant,
) -> Result<TcpStream> {
    let key = m.key(&format!("addr/{peer}"));
    let left = remaining(deadline).unwrap_or(Duration::from_millis(1));
    let raw = store.wait_get(&key, left)?;
    let addr: SocketAddr = std::str::from_utf8(&raw)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            m.error(
                BACKEND,
                format!("rank {peer} published no address under {key}"),
            )
        })?;
    let left = remaining(deadline).unwrap_or(Duration::from_millis(1));
    let what = || format!("connecting to rank {peer} at {addr}");
    let mut stream = match TcpStream::connect_timeout(&addr, left) {
        Ok(s) => s,
        Err(e) if is_wait(&e) => {
            return Err(Error::Timeout {
                what: what(),
                after: left,
            });
        }
        Err(e) => return Err(Error::io(what(), e)),
    };
    let _ = stream.set_nodelay(true);
    let io = |e| Error::io(format!("configuring the link to rank {peer}"), e);
    let left = remaining(deadline).unwrap_or(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).map_err(io)?;
    stream.set_write_timeout(Some(left)).map_err(io)?;
    frame::send_blocking(&mut stream, &hello_for(m, config))?;
    let welcome: Welcome = frame::recv_blocking(&mut stream, MAX_HELLO).map_err(|e| {
        m.error(
            BACKEND,
            format!("rank {peer} at {addr} sent no welcome: {e}"),
        )
    })?;
    if let Some(reason) = welcome.refused {
        return Err(m.error(
            BACKEND,
            format!("rank {peer} at {addr} refused us: {reason}"),
        ));
    }
    Error::check_protocol(
        format!(
            "rank {peer} at {addr} of collective `{}` (generation {})",
            m.group, m.generation
        ),
        PROTOCOL_NAME,
        PROTOCOL_VERSION,
        welcome.protocol,
    )?;
    Ok(stream)
}

/// Accepts a connection from every lower rank, refusing (and going on past) strangers.
fn accept_from(
    m: &Membership,
    listener: &TcpListener,
    config: &CpuConfig,
    links: &mut [Option<TcpStream>],
    deadline: Instant,
) -> Result<()> {
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("configuring the listener", e))?;
    let started = Instant::now();
    let mut owed = m.rank;
    while owed > 0 {
        let (mut stream, from) = match listener.accept() {
            Ok(pair) => pair,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                if remaining(deadline).is_none() {
                    let missing: Vec<usize> = (0..m.rank).filter(|r| links[*r].is_none()).collect();
                    return Err(timed_out(
                        format!(
                            "ranks {missing:?} of collective `{}` (generation {}) to connect",
                            m.group, m.generation
                        ),
                        started,
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(Error::io("accepting a rank", e)),
        };
        match admit(m, config, &mut stream, links, deadline) {
            Ok(rank) => {
                links[rank] = Some(stream);
                owed -= 1;
            }
            Err(reason) => {
                tracing::warn!(%from, group = %m.group, "refused a collective connection: {reason}");
                let _ = frame::send_blocking(&mut stream, &Welcome::refusing(reason));
            }
        }
    }
    Ok(())
}

/// Reads and checks one hello; the peer's rank, or why it is refused.
fn admit(
    m: &Membership,
    config: &CpuConfig,
    stream: &mut TcpStream,
    links: &[Option<TcpStream>],
    deadline: Instant,
) -> std::result::Result<usize, String> {
    let left = remaining(deadline).unwrap_or(Duration::from_millis(1));
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(left)))
        .and_then(|()| stream.set_write_timeout(Some(left)))
        .map_err(|e| format!("configuring the connection: {e}"))?;
    let _ = stream.set_nodelay(true);
    let body = frame::read_frame_blocking(stream, MAX_HELLO)
        .map_err(|e| format!("no hello: {e}"))?
        .ok_or_else(|| "no hello: the peer closed".to_owned())?;
    // the version first, alone: a rank of another version is named as such
    let theirs = wire::peek_protocol(&body, MAX_HELLO).map_err(|e| format!("bad hello: {e}"))?;
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "a rank".to_owned(), |a| format!("the rank at {a}"));
    Error::check_protocol(peer, PROTOCOL_NAME, PROTOCOL_VERSION, theirs)
        .map_err(|e| e.to_string())?;
    let hello: Hello = wire::decode(&body, MAX_HELLO).map_err(|e| format!("bad hello: {e}"))?;
    if !config.token.matches(&hello.token) {
        return Err("wrong cluster token".into());
    }
    if hello.group != m.group || hello.generation != m.generation || hello.world != m.world as u64 {
        return Err(format!(
            "hello for group `{}` generation {} world {}, this is `{}` generation {} world {}",
            hello.group, hello.generation, hello.world, m.group, m.generation, m.world
        ));
    }
    let rank = usize::try_from(hello.rank).map_err(|_| "rank out of range".to_owned())?;
    if rank >= m.rank || links[rank].is_some() {
        return Err(format!(
            "rank {rank} is not owed a connection by rank {}",
            m.rank
        ));
    }
    let welcome = Welcome {
        refused: None,
        protocol: PROTOCOL_VERSION,
    };
    frame::send_blocking(stream, &welcome).map_err(|e| format!("sending the welcome: {e}"))?;
    Ok(rank)
}

#[cfg(test)]
mod tests;
