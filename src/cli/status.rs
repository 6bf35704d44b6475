//! The status of a running `refit launch`: the page `refit launch --status-addr` serves at
//! `/status` (JSON: every rank, its process, state, restarts, health and the versions its
//! metrics page shows), and `refit status ADDR...`, which reads it and prints a table.
//!
//! The launcher knows its ranks' processes (the supervisor's view: running, exited, failed,
//! restarted) and where each serves its metrics; at each request it reads every running
//! rank's page (one second each at most) for the versions it serves, publishes or loads and
//! its failed updates. In a per-rank launch (one launcher per host) each launcher reports
//! its own rank: give `refit status` every launcher's address.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit::metrics_page::{Page, serve_pages};
use refit::node::launch::{RankState, Supervisor};
use refit::runtime::metrics as m;
use refit::runtime::{Error, Result};
use serde_json::{Value, json};

/// How long the status page waits for one rank's metrics page.
const SCRAPE_TIME: Duration = Duration::from_secs(1);

/// Arguments of `refit status`.
#[derive(Debug, clap::Args)]
pub(crate) struct StatusArgs {
    /// Where `refit launch --status-addr` serves the status (HOST:PORT; several for a
    /// per-rank launch, one launcher per host).
    #[arg(required = true, value_name = "HOST:PORT")]
    addrs: Vec<String>,
    /// Print the status as JSON: `launches` (each address's topology, world size, uptime)
    /// and `ranks` (every launch's ranks in rank order).
    #[arg(long)]
    json: bool,
    /// Give up on an address after this many seconds.
    #[arg(
        long = "timeout-s",
        visible_alias = "timeout",
        default_value_t = 10.0,
        value_name = "SECONDS"
    )]
    timeout_s: f64,
}

/// What the status page knows of a launch besides its supervisor.
#[derive(Debug, Clone)]
pub(crate) struct LaunchInfo {
    /// The topology file.
    pub(crate) topology: PathBuf,
    /// Ranks in the whole job.
    pub(crate) world_size: u32,
    /// The ranks this launcher starts: rank, process name, metrics address.
    pub(crate) ranks: Vec<(u32, String, Option<SocketAddr>)>,
}

/// Serves the status page of `supervisor`'s launch on `addr`; returns the bound address.
///
/// # Errors
/// The address cannot be bound.
pub(crate) fn serve(
    addr: SocketAddr,
    supervisor: Arc<Supervisor>,
    info: LaunchInfo,
) -> Result<SocketAddr> {
    let started = Instant::now();
    serve_pages(addr, "refit-status", "try GET /status", move |path| {
        (path == "/status").then(|| Page {
            content_type: "application/json",
            body: status(&info, &supervisor.ranks(), started.elapsed()).to_string() + "\n",
        })
    })
}

/// The status page: the launch and each of its ranks.
fn status(info: &LaunchInfo, states: &[RankState], up: Duration) -> Value {
    let ranks: Vec<Value> = info
        .ranks
        .iter()
        .map(|(rank, name, metrics)| {
            let state = states.iter().find(|s| s.rank == *rank);
            rank_status(*rank, name, *metrics, state)
        })
        .collect();
    json!({
        "topology": info.topology.display().to_string(),
        "world_size": info.world_size,
        "uptime_s": up.as_secs_f64(),
        "ranks": ranks,
    })
}

/// One rank's entry: the supervisor's view, and what its metrics page says.
fn rank_status(
    rank: u32,
    name: &str,
    metrics: Option<SocketAddr>,
    state: Option<&RankState>,
) -> Value {
    let (phase, pid, restarts, incarnation, ended) = match state {
        None => ("starting", None, 0, 0, None),
        Some(s) => {
            let phase = match s.succeeded {
                None => "running",
                Some(true) => "exited",
                Some(false) => "failed",
            };
            (
                phase,
                Some(s.pid),
                s.restarts,
                s.incarnation,
                s.ended.clone(),
            )
        }
    };
    let mut entry = json!({
        "rank": rank,
        "process": name,
        "pid": pid,
        "state": phase,
        "ended": ended,
        "restarts": restarts,
        "incarnation": incarnation,
        "metrics": metrics.map(|a| format!("http://{a}/metrics")),
    });
    let health = match (phase, metrics) {
        ("running", Some(addr)) => match get(addr, "/metrics", SCRAPE_TIME) {
            Ok(page) => {
                let seen = RankMetrics::read(&page);
                entry["versions"] = seen.versions();
                entry["failures"] = json!(seen.failures);
                "ok"
            }
            Err(e) => {
                entry["error"] = json!(e.to_string());
                "unreachable"
            }
        },
        ("running", None) => "running",
        (other, _) => other,
    };
    entry["health"] = json!(health);
    entry
}

/// What a status entry takes from a rank's metrics page.
#[derive(Debug, Default, PartialEq)]
struct RankMetrics {
    /// Per model: which version gauge (`served`, `published`, `engine`, `train`,
    /// `rollout`, `staleness`) says what.
    models: BTreeMap<String, BTreeMap<&'static str, u64>>,
    /// Failed updates, every side and transport together.
    failures: u64,
}

impl RankMetrics {
    /// Reads the samples of a Prometheus text page that the status shows.
    fn read(page: &str) -> Self {
        let gauges = [
            (m::SERVED_VERSION, "served"),
            (m::PUBLISHED_VERSION, "published"),
            (m::ENGINE_VERSION, "engine"),
            (m::TRAIN_VERSION, "train"),
            (m::ROLLOUT_VERSION, "rollout"),
            (m::STALENESS_VERSIONS, "staleness"),
        ];
        let mut out = Self::default();
        for (name, labels, value) in page.lines().filter_map(sample) {
            if name == m::UPDATE_FAILURES_TOTAL {
                out.failures += value as u64;
                continue;
            }
            let Some((_, key)) = gauges.iter().find(|(g, _)| *g == name) else {
                continue;
            };
            let Some(model) = label(labels, "model") else {
                continue;
            };
            // several transports of one model: the highest version
            let v = out
                .models
                .entry(model.to_owned())
                .or_default()
                .entry(key)
                .or_insert(0);
            *v = (*v).max(value as u64);
        }
        out
    }

    fn versions(&self) -> Value {
        json!(self.models)
    }
}

/// One sample line of a Prometheus text page: name, labels (without braces), value.
fn sample(line: &str) -> Option<(&str, &str, f64)> {
    if line.starts_with('#') {
        return None;
    }
    let (head, value) = line.rsplit_once(' ')?;
    let value: f64 = value.trim().parse().ok()?;
    match head.split_once('{') {
        Some((name, labels)) => Some((name, labels.strip_suffix('}')?, value)),
        None => Some((head, "", value)),
    }
}

/// The value of label `key` in `labels` (`a="x",b="y"`).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split("\",").find_map(|kv| {
        let (k, v) = kv.split_once("=\"")?;
        (k.trim() == key).then(|| v.trim_end_matches('"'))
    })
}

/// The body of `GET path` at `addr`, within `timeout`.
fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<String> {
    let io = |e| Error::io(format!("GET http://{addr}{path}"), e);
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(io)?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(io)?;
    let mut raw = Vec::new();
    s.take(64 << 20).read_to_end(&mut raw).map_err(io)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| Error::Config(format!("http://{addr}{path} answered no HTTP response")))?;
    if !head.starts_with("HTTP/1.1 200") {
        let line = head.lines().next().unwrap_or_default();
        return Err(Error::Config(format!(
            "http://{addr}{path} answered `{line}`"
        )));
    }
    Ok(body.to_owned())
}

/// Why `refit status` got no status page from `raw`, in the user's words.
fn unreachable(raw: &str, timeout: Duration, e: &Error) -> String {
    use std::io::ErrorKind;
    let why = match e {
        Error::Io { source, .. } => match source.kind() {
            ErrorKind::ConnectionRefused => "connection refused".to_owned(),
            ErrorKind::TimedOut | ErrorKind::WouldBlock => {
                format!("no answer within {:.1} s", timeout.as_secs_f64())
            }
            _ => source.to_string(),
        },
        other => other.to_string(),
    };
    format!(
        "cannot reach the launch's status at {raw} ({why}): is `refit launch --status-addr` \
         running there?"
    )
}

/// `refit status`: reads every address's status page and prints the ranks.
///
/// # Errors
/// A refusal worded for the user: a bad `--timeout-s`, an address that is not one, a
/// launch that cannot be reached, a page that is not JSON.
pub(crate) fn run(args: &StatusArgs) -> std::result::Result<(), Box<dyn std::error::Error>> {
    if !(args.timeout_s.is_finite() && args.timeout_s > 0.0 && args.timeout_s < 1e6) {
        return Err(format!(
            "--timeout-s must be a positive number of seconds, not {}",
            args.timeout_s
        )
        .into());
    }
    let timeout = Duration::from_secs_f64(args.timeout_s);
    let mut ranks = Vec::new();
    let mut launches = Vec::new();
    for raw in &args.addrs {
        let addr = raw
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| format!("`{raw}` is not an address (HOST:PORT)"))?;
        let body = get(addr, "/status", timeout).map_err(|e| unreachable(raw, timeout, &e))?;
        let mut page: Value = serde_json::from_str(&body)
            .map_err(|e| format!("the status page of {raw} is not JSON: {e}"))?;
        // the ranks of every launch in one list; each launch keeps the rest
        if let Some(Value::Array(list)) = page.as_object_mut().and_then(|p| p.remove("ranks")) {
            ranks.extend(list);
        }
        page["status"] = json!(format!("http://{addr}/status"));
        launches.push(page);
    }
    ranks.sort_by_key(|r| r["rank"].as_u64());
    if args.json {
        let merged = json!({ "launches": launches, "ranks": ranks });
        println!("{merged:#}");
        return Ok(());
    }
    print!("{}", table(&ranks));
    Ok(())
}

/// The ranks as a table, one line each.
fn table(ranks: &[Value]) -> String {
    let mut rows = vec![
        [
            "RANK", "PROCESS", "PID", "STATE", "RESTARTS", "HEALTH", "FAILURES", "VERSIONS",
        ]
        .map(str::to_owned),
    ];
    for r in ranks {
        let text = |v: &Value| match v {
            Value::String(s) => s.clone(),
            Value::Null => "-".into(),
            other => other.to_string(),
        };
        let versions = r["versions"].as_object().map_or_else(
            || "-".to_owned(),
            |models| {
                models
                    .iter()
                    .map(|(model, seen)| {
                        let parts: Vec<String> = seen
                            .as_object()
                            .map(|o| o.iter().map(|(k, v)| format!("{k} {v}")).collect())
                            .unwrap_or_default();
                        format!("{model}: {}", parts.join(", "))
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            },
        );
        rows.push([
            text(&r["rank"]),
            text(&r["process"]),
            text(&r["pid"]),
            text(&r["state"]),
            text(&r["restarts"]),
            text(&r["health"]),
            text(&r["failures"]),
            versions,
        ]);
    }
    let widths: Vec<usize> = (0..8)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_page_gives_versions_and_failures() {
        let page = "\
# HELP refit_served_version The version a receiver serves.
# TYPE refit_served_version gauge
refit_served_version{model=\"policy\",transport=\"shm\",rank=\"1\"} 7
refit_engine_version{model=\"policy\",rank=\"1\"} 6
refit_engine_version{model=\"reference\",rank=\"1\"} 2
refit_update_failures_total{side=\"receiver\",transport=\"shm\",rank=\"1\"} 2
refit_update_failures_total{side=\"engine\",transport=\"engine\",rank=\"1\"} 1
refit_update_phase_seconds_bucket{phase=\"apply\",model=\"policy\",transport=\"shm\",le=\"0.001\"} 3
";
        let seen = RankMetrics::read(page);
        assert_eq!(seen.failures, 3);
        assert_eq!(seen.models["policy"]["served"], 7);
        assert_eq!(seen.models["policy"]["engine"], 6);
        assert_eq!(seen.models["reference"]["engine"], 2);
        assert_eq!(seen.models.len(), 2);
        assert_eq!(label("a=\"x\",model=\"p\"", "model"), Some("p"));
        assert_eq!(label("model=\"p\"", "model"), Some("p"));
        assert_eq!(label("a=\"x\"", "model"), None);
    }

    #[test]
    fn the_table_lines_up_every_rank() {
        let ranks = vec![
            json!({"rank": 0, "process": "learner", "pid": 10, "state": "running", "restarts": 0,
                   "health": "ok", "failures": 0, "versions": {"policy": {"published": 3}}}),
            json!({"rank": 1, "process": "actor", "pid": null, "state": "starting",
                   "restarts": 0, "health": "starting"}),
        ];
        let t = table(&ranks);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("RANK  PROCESS"), "{t}");
        assert!(
            lines[1].contains("learner") && lines[1].ends_with("policy: published 3"),
            "{t}"
        );
        assert!(
            lines[2].contains("starting") && lines[2].contains(" - "),
            "{t}"
        );
    }
}
