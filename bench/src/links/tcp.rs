//! The raw loopback TCP baseline of `refit bench`, and the `refit pull` rows timed against it.
//!
//! The baseline is the fastest of a few simple programs that stream the same bytes from one
//! process to another over loopback (a reused source buffer written in chunks of one size,
//! read into a reused buffer of another), tried against each other in alternate rounds once
//! per run; the rows of that search are printed with the `refit pull` rows, and `iperf3`,
//! where it is installed, is timed beside them as a cross-check no figure of Refit's divides
//! by.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use refit_node::{TOKEN_ENV, TOKEN_FILE_ENV};
use refit_runtime::hash::Xxh3;
use refit_runtime::{Manifests, SenderInit, WeightSet, wire};
use refit_transports::tcp::{TcpConfig, TcpSender};

use super::{
    BenchArgs, BoxResult, ChildArgs, Row, WAIT, bench_token, first_touch_baseline, make_weights,
    row, spawn_child,
};
use crate::stats::{Summary, fmt_bytes};

/// Bytes per `write` and per `read` of one stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Chunks {
    write: usize,
    read: usize,
}

impl Chunks {
    const fn kib(write: usize, read: usize) -> Self {
        Self {
            write: write << 10,
            read: read << 10,
        }
    }

    fn name(self) -> String {
        format!(
            "writes {}/reads {}",
            fmt_chunk(self.write),
            fmt_chunk(self.read)
        )
    }
}

fn fmt_chunk(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{}M", n >> 20)
    } else {
        format!("{}K", n >> 10)
    }
}

/// The simple programs tried: `iperf3`'s default (128 KiB both ways), small writes into large
/// reads, `sendall`/`recv_into` of 4 MiB (what a plain Python loop does), and writes of a
/// buffer larger than the last-level cache (what this baseline did before it was tuned).
const CANDIDATES: [Chunks; 6] = [
    Chunks::kib(128, 128),
    Chunks::kib(128, 4096),
    Chunks::kib(1024, 1024),
    Chunks::kib(1024, 4096),
    Chunks::kib(4096, 4096),
    Chunks::kib(64 << 10, 4096),
];
/// Most bytes each candidate streams per round of the search.
const TUNE_SIZE: usize = 256 << 20;
/// Rounds of the search (each runs every candidate once, in turn).
const TUNE_ROUNDS: usize = 5;

/// The search's outcome: every candidate's timings and the fastest (lowest median).
pub(super) struct Tuning {
    /// Bytes per stream of the search.
    size: usize,
    tried: Vec<(Chunks, Summary)>,
    best: Chunks,
}

static TUNING: OnceLock<Tuning> = OnceLock::new();

/// Searches the chunk sizes once per run with streams of `size` bytes (at most
/// [`TUNE_SIZE`]), unless that was done already: the largest size the run measures, so the
/// search costs no more than the run's own streams and small runs stay quick.
pub(super) fn tune(size: usize) -> BoxResult<&'static Tuning> {
    if let Some(t) = TUNING.get() {
        return Ok(t);
    }
    let size = size.clamp(1 << 20, TUNE_SIZE);
    eprintln!(
        "refit bench: tuning the raw loopback TCP baseline ({} candidates, {} rounds of {})",
        CANDIDATES.len(),
        TUNE_ROUNDS,
        fmt_bytes(size)
    );
    let mut streams = CANDIDATES
        .iter()
        .map(|&c| Stream::start(size, TUNE_ROUNDS + 1, c))
        .collect::<BoxResult<Vec<_>>>()?;
    let mut samples = vec![Vec::with_capacity(TUNE_ROUNDS); CANDIDATES.len()];
    for s in &mut streams {
        s.once()?; // warm-up
    }
    for _ in 0..TUNE_ROUNDS {
        for (s, times) in streams.iter_mut().zip(&mut samples) {
            times.push(s.once()?);
        }
    }
    for s in streams {
        s.finish()?;
    }
    let tried: Vec<(Chunks, Summary)> = CANDIDATES
        .iter()
        .zip(&samples)
        .map(|(&c, t)| (c, Summary::of(t)))
        .collect();
    let best = tried
        .iter()
        .min_by(|a, b| a.1.median.total_cmp(&b.1.median))
        .map_or(CANDIDATES[0], |(c, _)| *c);
    Ok(TUNING.get_or_init(|| Tuning { size, tried, best }))
}

/// Raw loopback TCP between two processes with the tuned chunk sizes: the time to stream
/// `size` bytes and get one byte back, `iters` times after one untimed stream.
pub(super) fn baseline(size: usize, iters: usize) -> BoxResult<Summary> {
    timed_streams(size, iters, ReadInto::Buffer)
}

/// Raw loopback TCP as [`baseline`], the writer writing from a buffer of the whole size
/// and the reader reading into one (both touched before the first stream, reused): what a
/// simple program moving a version from one arena to another costs, the memory traffic of
/// both ends included (the [`baseline`] program reads and writes a buffer that stays in
/// cache). The arenas are cut into `conns` contiguous ranges, each streamed over a
/// connection of its own by a thread at each end (as a pull spreads a version over its
/// streams). With `hashed`, both ends also hash every byte with the transports' checksum
/// (xxh3-64, [`refit_runtime::hash`]), a write's or a read's worth at a time as it goes,
/// and the writer sends each range's digest after it, which the reader compares with its
/// own: the simple program that checks every byte it moves end to end, as a pull does.
pub(super) fn baseline_arena_to_arena(
    size: usize,
    iters: usize,
    conns: usize,
    hashed: bool,
) -> BoxResult<Summary> {
    timed_streams(size, iters, ReadInto::Arena { conns, hashed })
}

/// Raw floors measured in this run, by size: a floor is the machine's at that size, the same
/// for every receiver count, so it is measured once.
type Floors<T> = OnceLock<std::sync::Mutex<std::collections::HashMap<usize, T>>>;

/// `measure()`, or what it gave for `size` earlier in this run.
fn once_per_size<T: Copy>(
    floors: &'static Floors<T>,
    size: usize,
    measure: impl FnOnce() -> BoxResult<T>,
) -> BoxResult<T> {
    let cache = floors.get_or_init(Default::default);
    let known = cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&size)
        .copied();
    if let Some(t) = known {
        return Ok(t);
    }
    let t = measure()?;
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(size, t);
    Ok(t)
}

/// [`baseline_into_new_memory`] at `size` (3 streams), once per size in a run.
pub(super) fn floor_into_new_memory(size: usize) -> BoxResult<Summary> {
    static FLOORS: Floors<Summary> = OnceLock::new();
    once_per_size(&FLOORS, size, || baseline_into_new_memory(size, 3))
}

/// [`baseline_arena_to_arena`] at `size` (checked end to end with `hashed`) over one
/// connection and over as many as a pull opens, the faster with its connections, once per
/// size and kind in a run.
pub(super) fn floor_arena_to_arena(
    size: usize,
    iters: usize,
    hashed: bool,
) -> BoxResult<(Summary, usize)> {
    static PLAIN: Floors<(Summary, usize)> = OnceLock::new();
    static HASHED: Floors<(Summary, usize)> = OnceLock::new();
    once_per_size(if hashed { &HASHED } else { &PLAIN }, size, || {
        let streams = refit_transports::tcp::TcpReceiverConfig::default().streams;
        let one = baseline_arena_to_arena(size, iters, 1, hashed)?;
        let several = baseline_arena_to_arena(size, iters, streams, hashed)?;
        Ok(if several.median < one.median {
            (several, streams)
        } else {
            (one, 1)
        })
    })
}

/// The contiguous ranges `size` bytes are cut into for `conns` connections: as equal as
/// bytes allow, the first ones a byte longer.
fn ranges(size: usize, conns: usize) -> Vec<std::ops::Range<usize>> {
    let conns = conns.max(1);
    let (each, extra) = (size / conns, size % conns);
    let mut at = 0;
    (0..conns)
        .map(|i| {
            let len = each + usize::from(i < extra);
            at += len;
            at - len..at
        })
        .collect()
}

/// `buf` cut at `ranges` (contiguous, in order, covering it) into disjoint slices.
fn cut<'b>(mut buf: &'b mut [u8], ranges: &[std::ops::Range<usize>]) -> Vec<&'b mut [u8]> {
    let mut parts = Vec::with_capacity(ranges.len());
    for r in ranges {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(r.len());
        parts.push(head);
        buf = tail;
    }
    parts
}

/// Reads exactly `buf.len()` bytes from `sock` into `buf`, `chunk` at most per read. With
/// `hashed`, hashes each piece as it lands, then reads the writer's digest of the range
/// ([`write_range`]) and refuses one that differs.
fn read_range(sock: &mut TcpStream, buf: &mut [u8], chunk: usize, hashed: bool) -> BoxResult<()> {
    let mut hash = hashed.then(Xxh3::new);
    let mut at = 0;
    while at < buf.len() {
        let end = buf.len().min(at + chunk);
        let n = sock.read(&mut buf[at..end])?;
        if n == 0 {
            return Err("the sender closed the socket early".into());
        }
        if let Some(h) = hash.as_mut() {
            h.update(&buf[at..at + n]);
        }
        at += n;
    }
    if let Some(h) = hash {
        let mut sent = [0u8; 8];
        sock.read_exact(&mut sent)?;
        let (sent, got) = (u64::from_le_bytes(sent), h.digest());
        if sent != got {
            let len = buf.len();
            return Err(
                format!("a range of {len} bytes hashed {got:#x}, its writer's {sent:#x}").into(),
            );
        }
    }
    Ok(())
}

/// Writes `bytes` to `sock` in pieces of `write` bytes. With `hashed`, hashes each piece
/// just before it is written, then writes the digest of the whole (8 bytes, little-endian).
fn write_range(
    sock: &mut TcpStream,
    bytes: &[u8],
    write: usize,
    hashed: bool,
) -> std::io::Result<()> {
    let mut hash = hashed.then(Xxh3::new);
    for piece in bytes.chunks(write.max(1)) {
        if let Some(h) = hash.as_mut() {
            h.update(piece);
        }
        sock.write_all(piece)?;
    }
    if let Some(h) = hash {
        sock.write_all(&h.digest().to_le_bytes())?;
    }
    Ok(())
}

/// Raw loopback TCP as [`baseline`], the reader reading each stream into new memory (a
/// buffer of the whole size, allocated for the stream and freed after it): what a simple
/// program's first receive of a version costs, where fresh memory is dear.
pub(super) fn baseline_into_new_memory(size: usize, iters: usize) -> BoxResult<Summary> {
    timed_streams(size, iters, ReadInto::NewMemory)
}

/// `iters` timed streams of `size` bytes with the tuned chunk sizes, after one untimed, the
/// reader putting them where `into` says.
fn timed_streams(size: usize, iters: usize, into: ReadInto<'_>) -> BoxResult<Summary> {
    let mut s = Stream::start_into(size, iters + 1, tune(size)?.best, into)?;
    s.once()?;
    let samples = (0..iters)
        .map(|_| s.once())
        .collect::<BoxResult<Vec<_>>>()?;
    s.finish()?;
    Ok(Summary::of(&samples))
}

/// Where the reader of a [`Stream`] puts what it reads.
#[derive(Clone, Copy)]
enum ReadInto<'a> {
    /// A buffer of one read's size, reused.
    Buffer,
    /// A new buffer of the whole stream's size per stream.
    NewMemory,
    /// A buffer of the whole stream's size, touched before the first stream and reused;
    /// the writer writes from one too, over `conns` connections (a range each); with
    /// `hashed`, every range checked end to end ([`baseline_arena_to_arena`]).
    Arena { conns: usize, hashed: bool },
    /// A new file at this path per stream (written through a reused buffer, synced,
    /// removed after the stream is timed).
    NewFile(&'a Path),
}

/// One stream of the baseline: this process writes, a child process (`tcp-sink`) reads.
struct Stream {
    child: Child,
    sock: TcpStream,
    /// Further connections of an arena stream over several: `sock` carries the first range
    /// and the acknowledgements, these the other ranges.
    more: Vec<TcpStream>,
    /// What is written: a chunk's worth reused, or the whole size (an arena), walked.
    buf: Vec<u8>,
    /// Bytes per write.
    write: usize,
    size: usize,
    /// An arena stream: the writer walks `buf` once per stream, a range per connection.
    arena: bool,
    /// Each range is checked end to end (an arena stream doing a pull's checks).
    hashed: bool,
}

impl Stream {
    /// Starts the reading process, which expects `rounds` streams of `size` bytes.
    fn start(size: usize, rounds: usize, chunks: Chunks) -> BoxResult<Self> {
        Self::start_into(size, rounds, chunks, ReadInto::Buffer)
    }

    /// As [`Stream::start`], the reader putting each stream where `into` says.
    fn start_into(
        size: usize,
        rounds: usize,
        chunks: Chunks,
        into: ReadInto<'_>,
    ) -> BoxResult<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?.to_string();
        let (size_arg, rounds_arg, read_arg) = (
            size.to_string(),
            rounds.to_string(),
            chunks.read.to_string(),
        );
        let mut child_args = vec!["tcp-sink", &addr, &size_arg, &rounds_arg, &read_arg];
        let (file_arg, conns_arg);
        let mut conns = 1;
        let (mut arena, mut hashed) = (false, false);
        match into {
            ReadInto::Buffer => {}
            ReadInto::NewMemory => child_args.push("--new-memory"),
            ReadInto::Arena {
                conns: c,
                hashed: h,
            } => {
                conns = c.max(1);
                (arena, hashed) = (true, h);
                conns_arg = conns.to_string();
                child_args.extend(["--arena", "--conns", &conns_arg]);
                if hashed {
                    child_args.push("--hash");
                }
            }
            ReadInto::NewFile(f) => {
                file_arg = f.display().to_string();
                child_args.extend(["--file", &file_arg]);
            }
        }
        let child = spawn_child(&child_args)?;
        // the sink connects in order: the first connection is the first range's
        let mut socks = (0..conns)
            .map(|_| {
                let (sock, _) = listener.accept()?;
                sock.set_nodelay(true)?;
                Ok(sock)
            })
            .collect::<BoxResult<Vec<_>>>()?;
        let sock = socks.remove(0);
        Ok(Self {
            child,
            sock,
            more: socks,
            buf: match into {
                ReadInto::Arena { .. } => vec![3u8; size.max(1)],
                _ => vec![3u8; chunks.write.max(1).min(size.max(1))],
            },
            write: chunks.write.max(1),
            size,
            arena,
            hashed,
        })
    }

    /// Streams `size` bytes and waits for the reader's byte: the time it took. Then waits
    /// (untimed) for the reader to be ready for the next stream.
    fn once(&mut self) -> BoxResult<Duration> {
        if self.arena {
            return self.once_from_arena();
        }
        let t = Instant::now();
        let mut left = self.size;
        // from the buffer's start each time it is walked
        let mut at = 0;
        while left > 0 {
            if at == self.buf.len() {
                at = 0;
            }
            let n = left.min(self.write).min(self.buf.len() - at);
            self.sock.write_all(&self.buf[at..at + n])?;
            at += n;
            left -= n;
        }
        let mut ack = [0u8; 1];
        self.sock.read_exact(&mut ack)?;
        let took = t.elapsed();
        self.sock.read_exact(&mut ack)?;
        Ok(took)
    }

    /// [`Stream::once`] of an arena: a thread per connection writes its range (checked end
    /// to end when the stream is hashed).
    fn once_from_arena(&mut self) -> BoxResult<Duration> {
        let t = Instant::now();
        let ranges = ranges(self.size, self.more.len() + 1);
        let (buf, write, hashed) = (&self.buf, self.write, self.hashed);
        let socks = std::iter::once(&mut self.sock).chain(self.more.iter_mut());
        std::thread::scope(|s| {
            let writers: Vec<_> = socks
                .zip(&ranges)
                .map(|(sock, r)| s.spawn(move || write_range(sock, &buf[r.clone()], write, hashed)))
                .collect();
            writers.into_iter().try_for_each(|w| -> BoxResult<()> {
                w.join().map_err(|_| "a writer thread panicked")??;
                Ok(())
            })
        })?;
        let mut ack = [0u8; 1];
        self.sock.read_exact(&mut ack)?;
        let took = t.elapsed();
        self.sock.read_exact(&mut ack)?;
        Ok(took)
    }

    fn finish(mut self) -> BoxResult<()> {
        drop(self.more);
        drop(self.sock);
        if !self.child.wait()?.success() {
            return Err("the tcp sink process failed".into());
        }
        Ok(())
    }
}

/// The reading end of [`Stream`]: reads `rounds` streams of `bytes` bytes, `chunk` bytes
/// at most per read, into a reused buffer (with `--new-memory`, into a new buffer of
/// `bytes` per stream; with `--arena`, into one buffer of `bytes` touched before the first
/// stream, over `--conns` connections, each range checked with `--hash`: [`sink_arena`];
/// with `--file`, writing each into a new file, synced), answering one byte after each,
/// and one more once ready for the next (the file removed).
pub(super) fn sink(args: &ChildArgs) -> BoxResult<()> {
    let mut sock = TcpStream::connect(&args.target)?;
    sock.set_nodelay(true)?;
    let chunk = args.chunk.max(1);
    if args.arena {
        return sink_arena(args, sock, chunk);
    }
    if args.hash {
        return Err("--hash checks arena streams only: add --arena".into());
    }
    let mut buf = vec![1u8; chunk];
    for _ in 0..args.rounds {
        if args.new_memory {
            // calloc: pages the kernel hands out as the reads first write them
            let mut whole = vec![0u8; args.bytes];
            let mut at = 0;
            while at < args.bytes {
                let end = args.bytes.min(at + chunk);
                let n = sock.read(&mut whole[at..end])?;
                if n == 0 {
                    return Err("the sender closed the socket early".into());
                }
                at += n;
            }
            std::hint::black_box(&mut whole);
            sock.write_all(&[1])?;
            drop(whole);
            sock.write_all(&[2])?;
            continue;
        }
        let mut file = match &args.file {
            Some(path) => Some(
                std::fs::File::options()
                    .write(true)
                    .create_new(true)
                    .open(path)
                    .map_err(|e| format!("creating {}: {e}", path.display()))?,
            ),
            None => None,
        };
        let mut left = args.bytes;
        while left > 0 {
            let to = &mut buf[..left.min(chunk)];
            let n = sock.read(to)?;
            if n == 0 {
                return Err("the sender closed the socket early".into());
            }
            if let Some(f) = file.as_mut() {
                f.write_all(&to[..n])?;
            }
            left -= n;
        }
        if let Some(f) = file.take() {
            f.sync_all()?;
        }
        sock.write_all(&[1])?;
        if let Some(path) = &args.file {
            std::fs::remove_file(path)?;
        }
        sock.write_all(&[2])?;
    }
    Ok(())
}

/// [`sink`] of an arena over `args.conns` connections (`first` the first, which carries the
/// acknowledgements): a thread per connection reads its range into the arena, touched
/// before the first stream (with `--hash`, checking it: [`read_range`]).
fn sink_arena(args: &ChildArgs, mut first: TcpStream, chunk: usize) -> BoxResult<()> {
    let mut more = (1..args.conns)
        .map(|_| {
            let sock = TcpStream::connect(&args.target)?;
            sock.set_nodelay(true)?;
            Ok(sock)
        })
        .collect::<BoxResult<Vec<_>>>()?;
    let ranges = ranges(args.bytes, args.conns);
    let mut buf = vec![1u8; args.bytes.max(1)];
    for _ in 0..args.rounds {
        let parts = cut(&mut buf[..args.bytes], &ranges);
        let socks = std::iter::once(&mut first).chain(more.iter_mut());
        std::thread::scope(|s| {
            let readers: Vec<_> = socks
                .zip(parts)
                .map(|(sock, part)| {
                    s.spawn(move || {
                        read_range(sock, part, chunk, args.hash).map_err(|e| e.to_string())
                    })
                })
                .collect();
            readers.into_iter().try_for_each(|r| -> BoxResult<()> {
                r.join().map_err(|_| "a reader thread panicked")??;
                Ok(())
            })
        })?;
        first.write_all(&[1])?;
        first.write_all(&[2])?;
    }
    Ok(())
}

/// `iperf3`'s path, where it is installed.
fn iperf3() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("iperf3"))
        .find(|p| p.is_file())
}

/// An `iperf3` server on loopback (a process), for streams timed one at a time.
struct Iperf3 {
    exe: PathBuf,
    server: Child,
    port: u16,
}

impl Iperf3 {
    fn start(exe: PathBuf) -> BoxResult<Self> {
        // a free port, released just before the server binds it
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let server = Command::new(&exe)
            .args(["-s", "-B", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(Self { exe, server, port })
    }

    /// One stream of `size` bytes from a client process (128 KiB writes and reads, iperf3's
    /// default): the time the server took to receive them at the rate the client's JSON report
    /// gives.
    /// Retried while the server is not listening yet (up to 10 s).
    fn once(&mut self, size: usize) -> BoxResult<Duration> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = Command::new(&self.exe)
                .args(["-c", "127.0.0.1", "-p", &self.port.to_string(), "-J", "-n"])
                .arg(size.to_string())
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .output()?;
            let report: serde_json::Value = serde_json::from_slice(&out.stdout)
                .map_err(|e| format!("iperf3 -c printed no JSON report ({e})"))?;
            if let Some(err) = report.get("error").and_then(|e| e.as_str()) {
                if err.contains("unable to connect") && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                return Err(format!("iperf3: {err}").into());
            }
            // the server's count stops at the client's end of test, a few hundred KiB short
            // of what was sent: its rate, over the whole size
            let received = &report["end"]["sum_received"];
            let bytes = received["bytes"].as_u64().unwrap_or(0);
            if bytes < (size as u64) / 2 {
                return Err(format!("iperf3 received {bytes} of {size} bytes").into());
            }
            let secs = received["seconds"]
                .as_f64()
                .ok_or("iperf3's report has no end.sum_received.seconds")?
                * size as f64
                / bytes as f64;
            return Ok(Duration::from_secs_f64(secs));
        }
    }
}

impl Drop for Iperf3 {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

/// `refit pull` as a user runs it, against the tuned raw TCP baseline of the same bytes and
/// the cost of a new file's pages, all in this run. Two paths, each timed from the `refit
/// pull` process's start to its exit (connect, transfer, the file synced and renamed): a
/// model served from this process's memory, and a safetensors file served by a `refit serve`
/// process started for each pull (its start, which reads the file, timed apart). The
/// baseline streams, `iperf3` (where installed) and the pulls run in alternate rounds, so
/// machine load falls on all of them alike.
pub(super) fn bench_pull(args: &BenchArgs) -> BoxResult<Vec<Row>> {
    let size = args.pull_size.next_multiple_of(4 * refit_runtime::ALIGN);
    let iters = args.iters.max(3);
    let tuning = tune(size)?;
    let baselines = Baselines {
        file_write: file_write_baseline(size, iters, &args.pull_dir)?,
        touch: first_touch_baseline(size, iters, false),
        touch_huge: first_touch_baseline(size, iters, true),
    };
    let ws = Arc::unwrap_or_clone(make_weights(size, 4)?);
    let files = PullFiles::new(&args.pull_dir);
    let result = time_pulls(ws, &files, size, iters, tuning);
    files.remove();
    let t = result?;
    let dir = args.pull_dir.display().to_string();
    Ok(pull_rows(&t, tuning, &baselines, size, &dir))
}

/// The rounds of the pull rows: a sender in this process serves `ws` for `refit pull`, and
/// each round times the tuned stream, the stream into a new file, `iperf3` (where
/// installed), a `refit pull` and a `refit serve FILE` with its pull.
fn time_pulls(
    ws: WeightSet,
    files: &PullFiles,
    size: usize,
    iters: usize,
    tuning: &Tuning,
) -> BoxResult<Times> {
    ws.write_safetensors(&files.source)?;
    let manifests = Manifests::new([(ws.model().clone(), Arc::clone(ws.manifest()))])?;
    let config = TcpConfig {
        token: Some(bench_token().clone()),
        ..TcpConfig::default()
    };
    let transport = TcpSender::bind(config, &manifests)?;
    refit_runtime::write_atomically(
        &files.spec,
        wire::to_token(&transport.endpoint())?.as_bytes(),
    )?;
    let sender = SenderInit::new(transport, manifests).connect(vec![ws], WAIT)?;
    let mut tcp = Stream::start(size, iters + 1, tuning.best)?;
    tcp.once()?;
    let mut into_file =
        Stream::start_into(size, iters, tuning.best, ReadInto::NewFile(&files.sink))?;
    let mut iperf = iperf3().map(Iperf3::start).transpose()?;
    let mut t = Times::default();
    for _ in 0..iters {
        t.tcp.push(tcp.once()?);
        t.into_file.push(into_file.once()?);
        if let Some(i) = iperf.as_mut() {
            // a cross-check only: one that cannot measure (small sizes end before
            // iperf3's report counts them) drops its row, not the run
            match i.once(size) {
                Ok(d) => t.iperf3.push(d),
                Err(e) => {
                    eprintln!("refit bench: no iperf3 row: {e}");
                    iperf = None;
                    t.iperf3.clear();
                }
            }
        }
        t.pull.push(pull_once(&files.spec, &files.out, size)?);
        let (start, pulled) = serve_and_pull(files, size)?;
        t.serve_start.push(start);
        t.serve_pull.push(pulled);
    }
    tcp.finish()?;
    into_file.finish()?;
    sender.shutdown()?;
    Ok(t)
}

/// The costs of new memory and a new file that the pull rows are read against.
struct Baselines {
    /// Writing the pulled size into a new file in the pull directory.
    file_write: Summary,
    /// The first touch of new memory: on the heap, and in an arena (huge pages where the
    /// system has them).
    touch: Summary,
    touch_huge: Summary,
}

/// The rows of the pull comparison: the tuned stream (and each tuning tried, and
/// `iperf3`), the new file's and new memory's costs, the stream into a new file, and the
/// pulls against both the stream and the stream into a file.
fn pull_rows(t: &Times, tuning: &Tuning, base: &Baselines, size: usize, dir: &str) -> Vec<Row> {
    let tcp = Summary::of(&t.tcp);
    let best_try = tuning
        .tried
        .iter()
        .find(|(c, _)| *c == tuning.best)
        .map_or(f64::NAN, |(_, s)| s.median);
    let mut rows = vec![row(
        "tcp-loopback",
        &format!("stream {}", tuning.best.name()),
        size,
        1,
        tcp,
        "-",
        tcp.median,
    )];
    for (c, s) in &tuning.tried {
        rows.push(row(
            "tcp-loopback",
            &format!("  tried {}", c.name()),
            tuning.size,
            1,
            *s,
            "best tried",
            best_try,
        ));
    }
    if !t.iperf3.is_empty() {
        let s = Summary::of(&t.iperf3);
        rows.push(row(
            "iperf3",
            "stream 128K/128K",
            size,
            1,
            s,
            "tcp-loopback",
            tcp.median,
        ));
    }
    let against_tcp = |name: &str, metric: &str, s: Summary| {
        row(name, metric, size, 1, s, "tcp-loopback", tcp.median)
    };
    rows.push(against_tcp(
        "new file",
        &format!("write to {dir}"),
        base.file_write,
    ));
    rows.push(against_tcp("new memory", "first touch", base.touch));
    rows.push(against_tcp(
        "new memory",
        if refit_runtime::AlignedBuf::huge_pages() {
            "  arena (huge pages)"
        } else {
            "  arena (small pages)"
        },
        base.touch_huge,
    ));
    // the same job as `refit pull` done by a simple program: the tuned stream, its reader
    // writing what it reads into a new file there
    let into_file = Summary::of(&t.into_file);
    rows.push(against_tcp(
        "tcp-loopback",
        &format!("  into a new file in {dir}"),
        into_file,
    ));
    let floor = |name: &str, s: Summary| {
        row(
            name,
            "  against tcp into file",
            size,
            1,
            s,
            "tcp into file",
            into_file.median,
        )
    };
    let pull = Summary::of(&t.pull);
    rows.push(against_tcp("refit pull", &format!("to {dir}"), pull));
    rows.push(floor("refit pull", pull));
    let served = Summary::of(&t.serve_pull);
    rows.push(against_tcp(
        "refit serve FILE+pull",
        &format!("to {dir}"),
        served,
    ));
    rows.push(floor("refit serve FILE+pull", served));
    rows.push(against_tcp(
        "refit serve FILE",
        "  start (reads FILE)",
        Summary::of(&t.serve_start),
    ));
    rows
}

/// The files of the pull rows (all removed at the end).
struct PullFiles {
    /// The model as a safetensors file, for `refit serve`.
    source: PathBuf,
    /// The spec of the sender in this process.
    spec: PathBuf,
    /// The spec `refit serve` writes.
    serve_spec: PathBuf,
    /// What `refit pull` writes (removed after each pull).
    out: PathBuf,
    /// What the baseline stream into a file writes.
    sink: PathBuf,
}

impl PullFiles {
    /// This process's files: the model in the temporary folder, the others in `dir`.
    fn new(dir: &Path) -> Self {
        let pid = std::process::id();
        Self {
            source: std::env::temp_dir().join(format!("refit-bench-{pid}-model.safetensors")),
            spec: dir.join(format!(".refit-bench-{pid}.spec")),
            serve_spec: dir.join(format!(".refit-bench-{pid}-serve.spec")),
            out: dir.join(format!("refit-bench-{pid}.safetensors")),
            sink: dir.join(format!(".refit-bench-{pid}.sink")),
        }
    }

    /// Removes every one of the files (those not there are no error).
    fn remove(&self) {
        for f in [
            &self.source,
            &self.spec,
            &self.serve_spec,
            &self.out,
            &self.sink,
        ] {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// Timings of the pull rows, one per round.
#[derive(Default)]
struct Times {
    tcp: Vec<Duration>,
    into_file: Vec<Duration>,
    iperf3: Vec<Duration>,
    pull: Vec<Duration>,
    serve_start: Vec<Duration>,
    serve_pull: Vec<Duration>,
}

/// Runs `refit pull --spec-file SPEC OUT` and checks it wrote at least `size` bytes (then
/// removes the file): the time from the process's start to its exit.
fn pull_once(spec: &Path, out: &Path, size: usize) -> BoxResult<Duration> {
    let t = Instant::now();
    let done = Command::new(std::env::current_exe()?)
        .arg("pull")
        .env(TOKEN_ENV, bench_token().expose())
        .env_remove(TOKEN_FILE_ENV)
        .arg("--spec-file")
        .arg(spec)
        .arg(out)
        .stdin(Stdio::null())
        .output()?;
    let took = t.elapsed();
    if !done.status.success() {
        return Err(format!(
            "refit pull failed: {}",
            String::from_utf8_lossy(&done.stderr).trim()
        )
        .into());
    }
    if std::fs::metadata(out)?.len() < size as u64 {
        return Err("refit pull wrote a short file".into());
    }
    std::fs::remove_file(out)?;
    Ok(took)
}

/// Starts `refit serve SOURCE --spec-file SPEC` (a process), waits for its spec (the time
/// that took: starting and reading the file), then pulls from it ([`pull_once`]) and stops
/// it.
fn serve_and_pull(files: &PullFiles, size: usize) -> BoxResult<(Duration, Duration)> {
    let _ = std::fs::remove_file(&files.serve_spec);
    let t = Instant::now();
    let mut serve = Command::new(std::env::current_exe()?)
        .arg("serve")
        .arg(&files.source)
        .arg("--spec-file")
        .arg(&files.serve_spec)
        .env(TOKEN_ENV, bench_token().expose())
        .env_remove(TOKEN_FILE_ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let result = (|| -> BoxResult<(Duration, Duration)> {
        let deadline = t + WAIT;
        while !files.serve_spec.exists() {
            if let Some(status) = serve.try_wait()? {
                let mut err = String::new();
                if let Some(mut e) = serve.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                return Err(format!("refit serve exited ({status}): {}", err.trim()).into());
            }
            if Instant::now() > deadline {
                return Err("refit serve wrote no spec within the deadline".into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let started = t.elapsed();
        Ok((started, pull_once(&files.serve_spec, &files.out, size)?))
    })();
    // the process this function started, by its handle
    let _ = serve.kill();
    let _ = serve.wait();
    result
}

/// Writing `size` bytes into a new file in `dir` (created, written from a reused buffer,
/// synced, removed): what the file's fresh pages cost without any network.
fn file_write_baseline(size: usize, iters: usize, dir: &Path) -> BoxResult<Summary> {
    let path = dir.join(format!(".refit-bench-{}.write", std::process::id()));
    let buf = vec![5u8; size.min(16 << 20)];
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        let mut f = std::fs::File::create(&path)?;
        let mut left = size;
        while left > 0 {
            let n = left.min(buf.len());
            f.write_all(&buf[..n])?;
            left -= n;
        }
        f.sync_all()?;
        drop(f);
        samples.push(t.elapsed());
        std::fs::remove_file(&path)?;
    }
    Ok(Summary::of(&samples))
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    use super::{cut, ranges, read_range, write_range};

    #[test]
    fn ranges_cover_the_size_in_order_as_equal_as_bytes_allow() {
        assert_eq!(ranges(10, 4), vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(ranges(8, 1), vec![0..8]);
        assert_eq!(ranges(3, 0), vec![0..3]);
        let mut buf: Vec<u8> = (0..10).collect();
        let parts = cut(&mut buf, &ranges(10, 4));
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        assert_eq!(lens, vec![3, 3, 2, 2]);
        assert_eq!(parts[2], &[6, 7]);
    }

    /// The checked raw stream: a range written with its digest reads back whole, in reads
    /// smaller than the writes; a range whose digest does not match is refused naming both.
    #[test]
    fn a_checked_range_reads_back_and_a_wrong_digest_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut reader, _) = listener.accept().unwrap();
        let sent: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let feeder = std::thread::spawn(move || {
            write_range(&mut writer, &sent, 4096, true).unwrap();
            // the same bytes again, then a digest that is not theirs
            write_range(&mut writer, &sent, 4096, false).unwrap();
            writer.write_all(&1u64.to_le_bytes()).unwrap();
            sent
        });
        let mut got = vec![0u8; 100_000];
        read_range(&mut reader, &mut got, 1000, true).unwrap();
        let wrong = read_range(&mut reader, &mut got, 1000, true)
            .unwrap_err()
            .to_string();
        let sent = feeder.join().unwrap();
        assert_eq!(got, sent);
        assert!(
            wrong.contains("a range of 100000 bytes hashed") && wrong.contains("its writer's 0x1"),
            "{wrong}"
        );
    }
}
