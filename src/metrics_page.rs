//! The update phase timings (see [`crate::runtime::metrics`]) rendered by the Prometheus
//! exporter and served as a plain-text page at `/metrics` (feature `cli`): behind
//! `refit serve --metrics-addr`, and in any Refit program whose environment names an
//! address in [`METRICS_ADDR_ENV`] (what `refit launch --metrics-addr` gives each rank).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::runtime::{Error, Result};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

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
    // ANCHOR: install
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| Error::Config(format!("--metrics-addr: cannot install the recorder: {e}")))?;
    // ANCHOR_END: install
    let listener = TcpListener::bind(addr).map_err(|e| Error::io(format!("binding {addr}"), e))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::io("reading the metrics address", e))?;
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
    std::thread::Builder::new()
        .name("refit-metrics".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                if let Err(e) = answer(conn, &handle) {
                    tracing::debug!("metrics request failed: {e}");
                }
            }
        })
        .map_err(|e| Error::io("starting the metrics thread", e))?;
    Ok(bound)
}

/// Serves the page on the address [`METRICS_ADDR_ENV`] names, when it names one, and
/// prints `metrics: http://ADDR/metrics` on stderr; returns the bound address.
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
    let bound = serve(addr)?;
    eprintln!("metrics: http://{bound}/metrics");
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

/// Answers one HTTP request: the page for `GET /metrics`, 404 otherwise.
fn answer(conn: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
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
    let (status, body) = match (parts.next(), parts.next()) {
        (Some("GET"), Some("/metrics")) => ("200 OK", handle.render()),
        _ => ("404 Not Found", "try GET /metrics\n".to_string()),
    };
    let mut conn = conn;
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    conn.flush()
}
