//! The CartPole topology spread over processes, run as a user runs it: the real `refit
//! launch` on `examples/topologies/cartpole-processes.toml` (its command pointed at this
//! build's cartpole example), three processes meeting at rank 0's store on loopback,
//! weights over shared memory, every other message through remote actors. Also: an engine
//! process killed mid-run is reported within 10 s, and the run goes on (`on_failure =
//! "continue"`) or ends (`"abort"`); nothing hangs, no process and no shared-memory segment
//! is left behind. With `--metrics-addr` and `--status-addr`, every rank serves its own
//! metrics (every one Refit defines shows) and `refit status` reports every rank while the
//! run goes on.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

mod common;
use common::launch::{Launch, assert_clean, pid_in, shipped_topology};

/// `cartpole-processes.toml` as shipped, with the command pointed at this build's example
/// and the run's policy, target and budget set by the test.
fn topology_file(dir: &Path, on_failure: &str, target: f64, max_updates: u64) -> PathBuf {
    shipped_topology(
        dir,
        "cartpole-processes.toml",
        "cartpole",
        &[
            ("on_failure", format!("{on_failure:?}")),
            ("target_return", format!("{target:.1}")),
            ("max_updates", max_updates.to_string()),
        ],
    )
}

/// Solves CartPole through `refit launch` in every sync mode: `batch-async` to Gymnasium's
/// threshold (a mean return of 475 over the last 20 episodes), `sync` and `fully-async` to
/// 200 so that CI stays within minutes in a debug build (the book records full release runs
/// of every mode to 475). The update budget is about twice what the runs took here.
#[test]
fn the_cartpole_topology_learns_across_processes_in_every_sync_mode() {
    let dir = tempfile::tempdir().unwrap();
    for (mode, target, budget) in [
        ("batch-async", 475.0, 80),
        ("sync", 200.0, 60),
        ("fully-async", 200.0, 60),
    ] {
        let topo = topology_file(dir.path(), "abort", target, budget);
        let (status, out) = Launch::start(&topo, mode).finish(Duration::from_secs(900));
        assert!(status.success(), "{mode}: {status}\n{out}");
        assert!(
            out.contains(&format!("solved: policy ({mode} mode)")),
            "{mode}\n{out}"
        );
        for r in 1..=2 {
            assert!(
                out.contains(&format!("rank {r} (process `actor`, replica {})", r - 1))
                    && out.contains("weights over shm"),
                "{out}"
            );
        }
        assert!(out.contains("staleness of trained samples"), "{out}");
        assert!(out.contains("refit_actors::run::lead: policy v"), "{out}");
        assert!(out.contains("delivery per update"), "{out}");
        if mode == "sync" {
            // every trained sample came from the version being trained
            assert!(out.contains("mean 0.00, 0 dropped"), "{out}");
        }
        assert_clean(&out);
    }
}

/// `cartpole-512mib.toml`, the weight path at size, as shipped but with a small policy
/// (`--set`, as its comment says any key can be): a run without a target ends well at its
/// budget, and rank 0 reports each update's delivery (the trainer's publish into shared
/// memory and the engines' fetch) beside a memcpy of the same bytes.
#[test]
fn the_weight_path_topology_reports_delivery_per_update() {
    let dir = tempfile::tempdir().unwrap();
    let topo = shipped_topology(dir.path(), "cartpole-512mib.toml", "cartpole", &[]);
    let small = [
        "--set",
        "model.policy.params.hidden=[64, 64]",
        "--set",
        "stop.max_updates=3",
    ];
    let (status, out) = Launch::start_with(&topo, "sync", &small).finish(Duration::from_secs(300));
    assert!(status.success(), "{status}\n{out}");
    assert_eq!(out.matches("weights over shm").count(), 2, "{out}");
    let line = out
        .lines()
        .find(|l| l.contains("weights of policy:"))
        .unwrap_or_else(|| panic!("no delivery line:\n{out}"));
    for part in [
        "KiB per version",
        "delivery per update (median of 3)",
        "publish",
        "engine fetch",
    ] {
        assert!(line.contains(part), "{line}");
    }
    // a copy of a few KiB is too short to time: no ratio is said against it
    assert!(!line.contains("the fastest simple copy"), "{line}");
    assert_clean(&out);
}

/// The same processes with `[links] weights = "tcp"`: each engine registers with rank 0's
/// TCP sender agent (on rank 0's node) and pulls every version over loopback sockets.
#[test]
fn the_cartpole_topology_learns_with_weights_over_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology_file(dir.path(), "abort", 150.0, 40);
    let text = std::fs::read_to_string(&topo)
        .unwrap()
        .replace("weights = \"auto\"", "weights = \"tcp\"");
    std::fs::write(&topo, text).unwrap();
    let (status, out) = Launch::start(&topo, "fully-async").finish(Duration::from_secs(600));
    assert!(status.success(), "{status}\n{out}");
    assert!(out.contains("weights: tcp sender agent"), "{out}");
    assert_eq!(out.matches("weights over tcp").count(), 2, "{out}");
    assert!(out.contains("solved: policy (fully-async mode)"), "{out}");
    assert!(!out.contains("shm board"), "{out}");
}

fn kill(pid: u32) -> Instant {
    let ok = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -9 {pid}");
    Instant::now()
}

/// Kills rank 2's engine process once training is under way; answers when.
fn kill_rank_2(launch: &Launch) -> Instant {
    launch.wait_for(&["rollouts start"], Duration::from_secs(180));
    launch.wait_for(&[" frames, mean return "], Duration::from_secs(180));
    let (_, line) = launch.wait_for(&["rank 2 (process `actor`", ": pid "], Duration::ZERO);
    kill(pid_in(&line).unwrap())
}

#[test]
fn a_killed_engine_is_reported_and_the_run_goes_on_with_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology_file(dir.path(), "continue", 200.0, 60);
    let launch = Launch::start(&topo, "fully-async");
    let killed = kill_rank_2(&launch);
    let (seen, _) = launch.wait_for(
        &["rank 0: rank 2 (process `actor`, replica 1) is gone"],
        Duration::from_secs(10),
    );
    assert!(seen.duration_since(killed) < Duration::from_secs(10));
    let (status, out) = launch.finish(Duration::from_secs(600));
    assert!(status.success(), "{status}\n{out}");
    assert!(out.contains("the run goes on with 1 engines"), "{out}");
    assert!(out.contains("solved: policy (fully-async mode)"), "{out}");
    assert!(out.contains("rank 2 (actor) failed"), "{out}");
    assert_clean(&out);
}

#[test]
fn a_killed_engine_ends_the_run_clearly_under_abort() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology_file(dir.path(), "abort", 475.0, 200);
    let launch = Launch::start(&topo, "batch-async");
    let killed = kill_rank_2(&launch);
    let (seen, line) = launch.wait_for(&["rank 2 (actor) failed"], Duration::from_secs(10));
    assert!(
        seen.duration_since(killed) < Duration::from_secs(10),
        "{line}"
    );
    let (status, out) = launch.finish(Duration::from_secs(60));
    assert!(!status.success(), "{out}");
    assert!(!out.contains("solved: policy"), "{out}");
    assert!(out.contains("on_failure = \"abort\""), "{out}");
    assert_clean(&out);
}

#[test]
fn the_shipped_cartpole_topologies_place_their_links_by_host() {
    use refit::runtime::topology::{Reach, Role, Topology, TransportKind};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/topologies");
    let read = |name: &str| {
        let path = dir.join(name);
        Topology::parse_file(&refit::read_config(&path).unwrap(), &path).unwrap()
    };
    let processes = read("cartpole-processes.toml");
    let hosts = read("cartpole-hosts.toml");
    for (t, kind) in [
        (&processes, TransportKind::Nearest(Reach::Host)),
        (&hosts, TransportKind::Nearest(Reach::Network)),
    ] {
        assert_eq!(t.world_size(), 3);
        assert_eq!(t.engine_ranks(), vec![1, 2]);
        let lead = t.rank(0).unwrap();
        assert!(lead.has(Role::Trainer) && lead.has(Role::Controller));
        let policy = t.model_ids()[0].clone();
        for r in [1, 2] {
            assert_eq!(t.weights_transport(&policy, 0, r), kind);
        }
    }
    assert_eq!(hosts.master_host().unwrap(), "10.77.0.1");
    // the trainer sharded across hosts: a shard on each of `b` and `c`, over the mesh
    let sharded = read("cartpole-sharded-hosts.toml");
    let on: Vec<&str> = sharded
        .ranks()
        .iter()
        .map(|r| r.host.name.as_str())
        .collect();
    assert_eq!(on, ["a", "b", "c", "d"]);
    assert_eq!(sharded.trainer_ranks(&sharded.model_ids()[0]), vec![1, 2]);
    assert_eq!(
        sharded.links.sharded,
        refit::runtime::topology::Sharded::Mesh
    );
    // the scheduler files: the same placement, the hosts' addresses left to the scheduler
    for name in ["cartpole-slurm.toml", "cartpole-k8s.toml"] {
        let t = read(name);
        assert_eq!((t.world_size(), t.hosts.len()), (3, 3), "{name}");
        assert!(t.hosts.iter().all(|h| h.addr.is_none()), "{name}");
        assert!(t.master_host().is_err(), "{name}");
        for r in [1, 2] {
            assert_eq!(
                t.weights_transport(&t.model_ids()[0], 0, r),
                TransportKind::Nearest(Reach::Network),
                "{name}"
            );
        }
    }
    let pods = read("cartpole-k8s.toml");
    for r in pods.ranks() {
        assert_eq!((r.bind, r.port), (Some([0, 0, 0, 0].into()), Some(29500)));
    }
    let broadcast = read("cartpole-broadcast.toml");
    broadcast
        .check_links(refit::transports::link::reach_of)
        .unwrap();
    let policy = broadcast.model_ids()[0].clone();
    for r in [1, 2] {
        assert_eq!(
            broadcast.weights_transport(&policy, 0, r),
            TransportKind::Named("broadcast".into())
        );
    }
    // colocated on one GPU: cuda-ipc, which only a build with `cuda` carries
    let colocated = read("cartpole-colocated.toml");
    for r in [1, 2] {
        assert_eq!(
            colocated.weights_transport(&policy, 0, r),
            TransportKind::Named("cuda-ipc".into())
        );
    }
    let checked = colocated.check_links(refit::transports::link::reach_of);
    assert_eq!(checked.is_ok(), cfg!(feature = "cuda"), "{checked:?}");
    if let Err(e) = checked {
        assert!(e.to_string().contains("not compiled with CUDA"), "{e}");
    }
}

/// The Prometheus configuration the book shows scrapes one target per rank of the shipped
/// `cartpole-processes.toml` launched with `--metrics-addr 127.0.0.1:9100`: port 9100 + r
/// for each rank r, and no other.
#[test]
fn the_shipped_prometheus_config_scrapes_every_rank_of_the_cartpole_topology() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let topo = refit::runtime::topology::Topology::parse_file_with(
        &std::fs::read_to_string(root.join("examples/topologies/cartpole-processes.toml")).unwrap(),
        &root.join("examples/topologies/cartpole-processes.toml"),
        &[],
    )
    .unwrap();
    let config = std::fs::read_to_string(root.join("examples/configs/prometheus.yml")).unwrap();
    let targets: Vec<&str> = config
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- 127.0.0.1:"))
        .map(|t| t.split_whitespace().next().unwrap())
        .collect();
    let want: Vec<String> = (0..topo.world_size())
        .map(|r| (9100 + r).to_string())
        .collect();
    assert_eq!(targets, want, "{config}");
}

/// The first of `n` loopback ports free right now, one after the other.
fn free_ports(n: u16) -> u16 {
    for _ in 0..200 {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = first.local_addr().unwrap().port();
        if base.checked_add(n).is_none() {
            continue;
        }
        let rest: Vec<_> = (1..n)
            .map(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)))
            .collect();
        if rest.iter().all(Result::is_ok) {
            return base;
        }
    }
    panic!("no {n} consecutive free ports");
}

/// The body of `GET /metrics` at `127.0.0.1:port`, `None` while nothing answers there.
fn scrape(port: u16) -> Option<String> {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.starts_with("HTTP/1.1 200").then_some(out)
}

/// `refit launch --metrics-addr 127.0.0.1:P --status-addr 127.0.0.1:0`: rank r serves its
/// own metrics on P+r while the run goes on — the trainer's publishes (`assemble`) on rank
/// 0, each engine's loads (`apply`, `engine_pause`) on ranks 1 and 2 — and between them
/// every metric Refit defines, each with its type, every sample labelled with its rank;
/// `refit status` prints every rank running and healthy with the versions it serves; the
/// run stops cleanly on SIGTERM.
#[test]
fn launch_serves_every_metric_and_its_status_during_the_run() {
    use refit::runtime::metrics::METRICS;
    let dir = tempfile::tempdir().unwrap();
    // a run that goes on until it is stopped: the pages are scraped while it runs
    let topology = topology_file(dir.path(), "abort", 1.0e9, 1_000_000);
    let base = free_ports(3);
    let addr = format!("127.0.0.1:{base}");
    let mut launch = Launch::start_with(
        &topology,
        "batch-async",
        &["--metrics-addr", &addr, "--status-addr", "127.0.0.1:0"],
    );
    let want: [(u16, &[&str]); 3] = [
        (0, &["assemble"]),
        (1, &["apply", "engine_pause"]),
        (2, &["apply", "engine_pause"]),
    ];
    let every_metric = |pages: &[String]| {
        METRICS.iter().all(|m| {
            let typed = format!("# TYPE {} {}", m.name, m.kind.as_str());
            pages.iter().any(|p| p.contains(&typed))
        })
    };
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut pages = vec![String::new(); 3];
    loop {
        for (rank, _) in want {
            pages[rank as usize] = scrape(base + rank).unwrap_or_default();
        }
        let seen = want.iter().all(|(rank, phases)| {
            phases
                .iter()
                .all(|p| pages[*rank as usize].contains(&format!("phase=\"{p}\"")))
        });
        if seen && every_metric(&pages) {
            break;
        }
        assert!(
            launch.child.try_wait().unwrap().is_none(),
            "the run ended before every rank's phases showed:\n{pages:#?}\n{}",
            launch.text()
        );
        assert!(
            Instant::now() < deadline,
            "phases or metrics missing within 240 s:\n{pages:#?}\n{}",
            launch.text()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    for (rank, page) in pages.iter().enumerate() {
        assert!(page.contains("refit_update_phase_seconds_bucket"), "{page}");
        assert!(page.contains(&format!("rank=\"{rank}\"")), "{page}");
    }
    // where each kind of metric comes from: the trainer's sender and controller on rank 0,
    // a receiver and an engine on ranks 1 and 2
    for name in [
        "refit_published_version",
        "refit_receivers_connected",
        "refit_staleness_versions",
    ] {
        assert!(
            pages[0].contains(&format!("{name}{{")),
            "{name}: {}",
            pages[0]
        );
    }
    for page in &pages[1..] {
        for name in [
            "refit_served_version",
            "refit_engine_version",
            "refit_engine_pauses_total",
        ] {
            assert!(page.contains(&format!("{name}{{")), "{name}: {page}");
        }
    }
    // each rank announced its own page
    for rank in 0..3u16 {
        launch.wait_for(
            &[&format!(
                "metrics: http://127.0.0.1:{}/metrics",
                base + rank
            )],
            Duration::from_secs(10),
        );
    }
    // the launch's status, as `refit status` prints it
    let (_, line) = launch.wait_for(&["status: http://"], Duration::from_secs(10));
    let status_addr = line
        .split("status: http://")
        .nth(1)
        .and_then(|s| s.split('/').next())
        .unwrap()
        .to_owned();
    let out = Command::new(env!("CARGO_BIN_EXE_refit"))
        .args(["status", &status_addr])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{table}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = table.lines().collect();
    assert_eq!(rows.len(), 4, "{table}");
    assert!(rows[0].starts_with("RANK  PROCESS"), "{table}");
    for (rank, process, versions) in [
        (0, "learner", "policy: "),
        (1, "actor", "engine "),
        (2, "actor", "engine "),
    ] {
        let row = rows[rank + 1];
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells[0], rank.to_string(), "{table}");
        assert_eq!(cells[1], process, "{table}");
        assert_eq!((cells[3], cells[5]), ("running", "ok"), "{table}");
        assert!(row.contains(versions), "{table}");
    }
    assert!(rows[1].contains("published"), "{table}");
    assert!(rows[2].contains("served"), "{table}");
    // the same as JSON
    let out = Command::new(env!("CARGO_BIN_EXE_refit"))
        .args(["status", "--json", &status_addr])
        .output()
        .unwrap();
    let json = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{json}");
    assert_eq!(json.matches("\"health\": \"ok\"").count(), 3, "{json}");
    // SIGTERM to the launcher stops the run; nothing is left behind
    let pid = launch.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let (_status, out) = launch.finish(Duration::from_secs(60));
    assert_clean(&out);
    assert!(
        scrape(base + 1).is_none(),
        "a rank still serves after the run"
    );
}
