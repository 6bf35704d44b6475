//! Refit's metrics (every one of [`crate::runtime::metrics::METRICS`]: update phases as
//! histograms with buckets, versions, receivers, bytes, failures, engine pauses) rendered
//! by the Prometheus exporter and served as a plain-text page at `/metrics` (feature
//! `cli`): behind `refit serve --metrics-addr`, and in any Refit program whose environment
//! names an address in [`METRICS_ADDR_ENV`] (what `refit launch --metrics-addr` gives each
//! rank; such a page labels every sample with the rank, `rank="N"`, from `RANK`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::runtime::metrics::{self, PHASE_BUCKETS};
use crate::runtime::{Error, Result};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// The variable naming the address a program serves its metrics page on
/// ([`crate::init`] reads it): `HOST:PORT`, port 0 for any free one.
pub const METRICS_ADDR_ENV: &str = "REFIT_METRICS_ADDR";

/// Installs the Prometheus recorder for this process and serves its page on `addr` (from a
/// background thread); returns the bound address.
///
/// # Errors
/// [`Error::Config`] when a recorder is already installed; [`Error::Io`] when `addr`
/// cannot be bound or a thread cannot start.
pub fn serve(addr: SocketAddr) -> Result<SocketAddr> {
    serve_with_labels(addr, &[])
}

/// As [`serve`], with `labels` added to every sample of the page (what tells the pages of
/// several processes apart once scraped together: `refit launch` ranks add `rank`).
///
/// # Errors
/// As [`serve`].
pub fn serve_with_labels(addr: SocketAddr, labels: &[(&str, &str)]) -> Result<SocketAddr> {
    let handle = install(labels)?;
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("refit-metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(5));
                upkeep.run_upkeep();
            }
        })
        .map_err(|e| Error::io("starting the metrics upkeep thread", e))?;
    serve_pages(addr, "refit-metrics", "try GET /metrics", move |path| {
        (path == "/metrics").then(|| Page {
            content_type: "text/plain; version=0.0.4",
            body: handle.render(),
        })
    })
}

/// One page of [`serve_pages`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// Its `Content-Type`.
    pub content_type: &'static str,
    /// Its body.
    pub body: String,
}

/// Serves the pages `route` gives (by request path; `None`: 404 with `hint` as body) over
/// plain HTTP on `addr`, from a background thread named `thread`; returns the bound
/// address. One request at a time, each within 5 s and 16 KiB (a slow or endless client
/// does not hold the thread). The metrics page runs on it, and `refit launch
/// --status-addr`'s status page.
///
/// # Errors
/// [`Error::Io`] when `addr` cannot be bound or the thread cannot start.
pub fn serve_pages(
    addr: SocketAddr,
    thread: &str,
    hint: &'static str,
    route: impl Fn(&str) -> Option<Page> + Send + 'static,
) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr).map_err(|e| Error::io(format!("binding {addr}"), e))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::io(format!("reading the address bound for {addr}"), e))?;
    std::thread::Builder::new()
        .name(thread.into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                if let Err(e) = answer(conn, hint, &route) {
                    tracing::debug!("http request failed: {e}");
                }
            }
        })
        .map_err(|e| Error::io(format!("starting the {thread} thread"), e))?;
    Ok(bound)
}

/// Installs the Prometheus recorder: Refit's histograms with the buckets of
/// [`PHASE_BUCKETS`], every sample with `labels`, every metric described.
fn install(labels: &[(&str, &str)]) -> Result<PrometheusHandle> {
    let config = |e| Error::Config(format!("--metrics-addr: cannot install the recorder: {e}"));
    // ANCHOR: install
    let mut builder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Prefix("refit_".into()), PHASE_BUCKETS)
        .map_err(config)?;
    for (k, v) in labels {
        builder = builder.add_global_label(*k, *v);
    }
    let handle = builder.install_recorder().map_err(config)?;
    metrics::describe();
    // ANCHOR_END: install
    Ok(handle)
}

/// Serves the page on the address [`METRICS_ADDR_ENV`] names, when it names one, with the
/// label `rank` when `RANK` is set, and logs `metrics: http://ADDR/metrics`; returns the
/// bound address.
///
/// # Errors
/// [`Error::Config`] naming the variable when its value is not `HOST:PORT`; as [`serve`].
pub fn serve_from_env() -> Result<Option<SocketAddr>> {
    let Some(raw) = std::env::var(METRICS_ADDR_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())
    else {
        return Ok(None);
    };
    let addr: SocketAddr = raw.trim().parse().map_err(|e| {
        Error::Config(format!(
            "{METRICS_ADDR_ENV}={raw:?} is not an address (HOST:PORT): {e}"
        ))
    })?;
    let rank = std::env::var("RANK").ok().filter(|r| !r.trim().is_empty());
    let labels: Vec<(&str, &str)> = rank.iter().map(|r| ("rank", r.trim())).collect();
    let bound = serve_with_labels(addr, &labels)?;
    tracing::info!("metrics: http://{bound}/metrics");
    Ok(Some(bound))
}

/// The most time one request may take to arrive.
const REQUEST_TIME: Duration = Duration::from_secs(5);
/// The most bytes one request (request line and headers) may hold.
const REQUEST_BYTES: u64 = 16 * 1024;

/// A connection whose reads fail once `deadline` has passed.
struct Deadlined {
    conn: TcpStream,
    deadline: Instant,
}

impl Read for Deadlined {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.conn.set_read_timeout(Some(left))?;
        self.conn.read(buf)
    }
}

/// Answers one HTTP request: `route`'s page for a `GET`, 404 otherwise.
fn answer(
    conn: TcpStream,
    hint: &str,
    route: &dyn Fn(&str) -> Option<Page>,
) -> std::io::Result<()> {
    conn.set_write_timeout(Some(REQUEST_TIME))?;
    // one request may take REQUEST_TIME and REQUEST_BYTES in all, however it trickles in:
    // the page is served by one thread, and a slow client must not hold it
    let mut reader = BufReader::new(
        Deadlined {
            conn: conn.try_clone()?,
            deadline: Instant::now() + REQUEST_TIME,
        }
        .take(REQUEST_BYTES),
    );
    let mut request = String::new();
    reader.read_line(&mut request)?;
    // skip the headers up to the blank line
    let mut line = String::new();
    while reader.read_line(&mut line)? > 2 {
        line.clear();
    }
    let mut parts = request.split_whitespace();
    let page = match (parts.next(), parts.next()) {
        (Some("GET"), Some(path)) => route(path).map(|p| ("200 OK", p)),
        _ => None,
    };
    let (status, page) = page.unwrap_or_else(|| {
        let page = Page {
            content_type: "text/plain",
            body: format!("{hint}\n"),
        };
        ("404 Not Found", page)
    });
    let mut conn = conn;
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        page.content_type,
        page.body.len(),
        page.body
    )?;
    conn.flush()
}
