//! `refit bench` takes its transports from the link factory: every registered transport,
//! named on the command line, gets its rows (real receiver processes where the transport
//! crosses processes) or, where this build or machine cannot open it (a GPU link without
//! `cuda` or a GPU), a line saying why it is skipped; an unknown name is refused naming the
//! known ones.
#![allow(clippy::unwrap_used, missing_docs)]

use std::process::Command;

use refit::transports::link::{LINKS, LinkOptions};

fn refit() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_refit"));
    c.env_remove("REFIT_TOKEN").env_remove("REFIT_TOKEN_FILE");
    c
}

#[test]
fn every_registered_transport_gets_its_rows() {
    let names: Vec<&str> = LINKS.iter().map(|l| l.name()).collect();
    let out = refit()
        .args([
            "bench",
            "--max-size",
            "4MiB",
            "--receivers",
            "1",
            "--iters",
            "1",
        ])
        .args([
            "--warmup",
            "1",
            "--connect-runs",
            "1",
            "--strategies-size",
            "0",
        ])
        .args([
            "--pull-size",
            "0",
            "--json",
            "--transports",
            &names.join(","),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    // a transport's rows carry its name, or its name and a read mode: `shm (zero-copy)`
    let named = |r: &serde_json::Value, name: &str| {
        let t = r["transport"].as_str().unwrap_or_default();
        t == name || t.starts_with(&format!("{name} ("))
    };
    for l in LINKS {
        let name = l.name();
        if let Err(why) = l.usable(&LinkOptions::default()) {
            // a GPU link this build or machine cannot open: skipped, saying why
            let said = format!("refit bench: skipping {name}: {why}");
            assert!(stderr.contains(&said), "{said}: {stderr}");
            assert!(!rows.iter().any(|r| named(r, name)), "{rows:?}");
            continue;
        }
        let row = rows
            .iter()
            .find(|r| named(r, name) && r["metric"] == "end-to-end")
            .unwrap_or_else(|| panic!("no end-to-end row for {name}: {rows:?}"));
        assert_eq!(row["bytes"], 4 << 20);
        assert!(row["seconds"]["median"].as_f64().unwrap() > 0.0, "{row}");
    }
    // shared memory: the default path (the link factory's receivers, zero-copy) first, with
    // its connect and steady rows, then every other read mode under its own name
    let shm: Vec<&str> = rows
        .iter()
        .filter(|r| named(r, "shm"))
        .map(|r| r["transport"].as_str().unwrap())
        .collect();
    assert_eq!(shm.first(), Some(&"shm (zero-copy)"), "{shm:?}");
    for mode in ["shm (loaned)", "shm (checksum)", "shm (copy)"] {
        assert!(shm.contains(&mode), "no {mode} rows: {shm:?}");
    }
    for metric in ["connect+first pull", "  steady update", "end-to-end"] {
        assert!(
            rows.iter()
                .any(|r| r["transport"] == "shm (zero-copy)" && r["metric"] == metric),
            "no shm (zero-copy) {metric:?} row"
        );
    }
    // receivers in processes: connect+first pull beside a steady update of the same runs,
    // each with its tail
    for metric in [
        "connect+first pull",
        "  steady update",
        "  (process start+)",
    ] {
        let row = rows
            .iter()
            .find(|r| r["transport"] == "tcp" && r["metric"] == metric)
            .unwrap_or_else(|| panic!("no tcp {metric:?} row: {rows:?}"));
        let s = &row["seconds"];
        let (median, p99, max) = (
            s["median"].as_f64().unwrap(),
            s["p99"].as_f64().unwrap(),
            s["max"].as_f64().unwrap(),
        );
        assert!(median > 0.0 && median <= p99 && p99 <= max, "{row}");
        assert_eq!(row["baseline"], "tcp-loopback", "{row}");
    }
    // and against a simple program's first receive: the raw stream into new memory
    let floor = rows
        .iter()
        .find(|r| r["transport"] == "tcp" && r["metric"] == "  (raw, new memory)")
        .unwrap_or_else(|| panic!("no raw-into-new-memory row: {rows:?}"));
    let against = rows
        .iter()
        .find(|r| r["transport"] == "tcp" && r["baseline"] == "raw into new memory")
        .unwrap_or_else(|| panic!("no first pull against new memory: {rows:?}"));
    assert_eq!(against["metric"], "  connect+first pull");
    assert_eq!(against["baseline_median"], floor["seconds"]["median"]);
    // and against two simple programs moving the bytes between two arenas, one of them also
    // hashing every byte at both ends (the checks a pull makes): the steady update
    for (hashed, floor) in [
        (false, "raw arena to arena"),
        (true, "raw arena to arena, hashed"),
    ] {
        let raw = rows
            .iter()
            .find(|r| {
                r["transport"] == "tcp"
                    && r["metric"].as_str().is_some_and(|m| {
                        m.starts_with("  (raw, arenas, ") && (m.ends_with(", hashed)") == hashed)
                    })
            })
            .unwrap_or_else(|| panic!("no raw arena-to-arena row (hashed: {hashed}): {rows:?}"));
        assert!(raw["seconds"]["median"].as_f64().unwrap() > 0.0, "{raw}");
        let steady = rows
            .iter()
            .find(|r| r["transport"] == "tcp" && r["baseline"] == floor)
            .unwrap_or_else(|| panic!("no steady update against {floor:?}: {rows:?}"));
        assert_eq!(steady["metric"], "  steady update");
        assert_eq!(steady["baseline_median"], raw["seconds"]["median"]);
    }
    // the memcpy baseline is the faster of the simple copies tried, each shown against it
    let copies: Vec<_> = rows
        .iter()
        .filter(|r| r["transport"] == "memcpy" && r["bytes"] == 4 << 20)
        .collect();
    let best = copies
        .iter()
        .find(|r| r["baseline"] == "-")
        .unwrap_or_else(|| panic!("no memcpy baseline row: {copies:?}"));
    let median = best["seconds"]["median"].as_f64().unwrap();
    let tried: Vec<_> = copies
        .iter()
        .filter(|r| r["metric"].as_str().unwrap().starts_with("  tried "))
        .collect();
    assert_eq!(tried.len(), 2, "{copies:?}");
    for t in &tried {
        assert_eq!(t["baseline_median"].as_f64(), Some(median), "{t}");
        assert!(t["seconds"]["median"].as_f64().unwrap() >= median, "{t}");
    }
    let name = best["metric"].as_str().unwrap();
    assert!(
        tried
            .iter()
            .any(|t| t["metric"].as_str().unwrap()["  tried ".len()..]
                == name["copy (".len()..name.len() - 1]),
        "{name} is not among {tried:?}"
    );
}

/// The pull rows: the raw TCP baseline with the chunk sizes its search tried (the fastest
/// kept), `iperf3` where it is installed, a stream into a new file, and `refit pull` of a
/// model served from memory and of a file served by a `refit serve` process, each against
/// the baseline measured in the same run.
#[test]
fn pull_rows_time_both_paths_against_the_tuned_tcp_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let out = refit()
        .args(["bench", "--max-size", "4MiB", "--receivers", "1"])
        .args(["--iters", "1", "--warmup", "1", "--connect-runs", "1"])
        .args(["--strategies-size", "0", "--transports", "tcp", "--json"])
        .args(["--pull-size", "8MiB", "--pull-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let find = |transport: &str, metric: &str| {
        rows.iter()
            .find(|r| {
                r["transport"] == transport && r["metric"].as_str().unwrap().starts_with(metric)
            })
            .unwrap_or_else(|| panic!("no {transport} {metric:?} row: {rows:?}"))
    };
    let median = |r: &serde_json::Value| r["seconds"]["median"].as_f64().unwrap();
    let stream = find("tcp-loopback", "stream writes");
    assert_eq!(stream["bytes"], 8 << 20, "{stream}");
    let tried: Vec<_> = rows
        .iter()
        .filter(|r| r["metric"].as_str().unwrap().starts_with("  tried writes"))
        .collect();
    assert_eq!(tried.len(), 6, "{rows:?}");
    // the kept chunk sizes are those of the fastest try
    let best = tried
        .iter()
        .min_by(|a, b| median(a).total_cmp(&median(b)))
        .unwrap();
    let kept = stream["metric"]
        .as_str()
        .unwrap()
        .trim_start_matches("stream ");
    assert!(
        best["metric"].as_str().unwrap().ends_with(kept),
        "{best} {stream}"
    );
    assert!(
        (best["ratio"].as_f64().unwrap() - 1.0).abs() < 1e-9,
        "{best}"
    );
    for (transport, metric) in [
        ("tcp-loopback", "  into a new file"),
        ("refit pull", "to "),
        ("refit serve FILE+pull", "to "),
        ("refit serve FILE", "  start"),
    ] {
        let r = find(transport, metric);
        assert!(median(r) > 0.0, "{r}");
        assert_eq!(r["baseline"], "tcp-loopback", "{r}");
        assert!(r["ratio"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert_eq!(find("refit pull", "  against")["baseline"], "tcp into file");
    // iperf3 is a cross-check: a row only where it is installed (and could measure: at
    // small sizes its report may end before the bytes do, and the bench says so instead)
    let iperf3 = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .any(|d| d.join("iperf3").is_file());
    let iperf3_row = rows.iter().any(|r| r["transport"] == "iperf3");
    assert!(
        !iperf3_row || iperf3,
        "an iperf3 row without iperf3 installed: {rows:?}"
    );
    // every file the rows wrote is gone
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// The mesh rows: per shape, M shards publishing to N engines that each pull their 1/N,
/// timed against the raw stream of the same bytes measured beside them; a shape that is
/// not `MxN` is refused.
#[test]
fn mesh_rows_time_each_shape_against_the_raw_stream_beside_them() {
    let out = refit()
        .args(["bench", "--max-size", "4MiB", "--receivers", "1"])
        .args(["--iters", "2", "--warmup", "1", "--connect-runs", "1"])
        .args(["--strategies-size", "0", "--pull-size", "0"])
        .args(["--transports", "inproc", "--mesh", "1x1,2x2", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let stream = rows
        .iter()
        .find(|r| r["metric"] == "stream (beside the mesh)")
        .unwrap_or_else(|| panic!("no raw stream beside the mesh: {rows:?}"));
    let base = stream["seconds"]["median"].as_f64().unwrap();
    assert!(base > 0.0, "{stream}");
    let mesh: Vec<_> = rows.iter().filter(|r| r["transport"] == "mesh").collect();
    assert_eq!(mesh.len(), 2, "{rows:?}");
    for (r, (n, each)) in mesh.iter().zip([(1, "4 MiB"), (2, "2 MiB")]) {
        assert_eq!(r["metric"], format!("{n}->{n}, {each} each"), "{r}");
        assert_eq!(r["receivers"], n, "{r}");
        assert_eq!(r["bytes"], stream["bytes"], "{r}");
        assert_eq!(r["baseline"], "tcp-loopback", "{r}");
        assert_eq!(r["seconds"]["samples"], 2, "{r}");
        let ratio = r["ratio"].as_f64().unwrap();
        let median = r["seconds"]["median"].as_f64().unwrap();
        assert!((ratio - median / base).abs() < 1e-9, "{r}");
    }
    let out = refit().args(["bench", "--mesh", "2x0"]).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad mesh shape \"2x0\""), "{stderr}");
}

#[test]
fn an_unknown_transport_is_refused_naming_the_known_ones() {
    let out = refit()
        .args(["bench", "--transports", "tcp,rdma"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unknown transport `rdma`"), "{stderr}");
    for l in LINKS {
        assert!(stderr.contains(l.name()), "{stderr}");
    }
}

/// `refit bench --engine-pause` on a small model: for every link and pause mode the rows of
/// the pause, the staging and a decoding step, over the timed updates, with their ratios to
/// the step and to the link's own time for the same bytes; the transport-alone rows beside
/// memcpy; requests decoding when every load was asked.
#[test]
#[cfg(feature = "actors")]
fn engine_pause_rows_exist_for_every_link_and_mode() {
    let out = refit()
        .args(["bench", "--engine-pause", "--engine-sizes", "256KiB"])
        .args([
            "--iters",
            "2",
            "--engine-warmup",
            "0",
            "--engine-requests",
            "2",
        ])
        .args([
            "--engine-transports",
            "shm,inproc",
            "--engine-modes",
            "keep,abort",
        ])
        .arg("--json")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let find = |link: &str, mode: &str, metric: &str| {
        rows.iter()
            .find(|r| r["link"] == link && r["mode"] == mode && r["metric"] == metric)
            .unwrap_or_else(|| panic!("no {link} {mode} {metric:?} row: {rows:?}"))
    };
    let ordered = |row: &serde_json::Value| {
        let s = &row["seconds"];
        let (min, median, max) = (
            s["min"].as_f64().unwrap(),
            s["median"].as_f64().unwrap(),
            s["max"].as_f64().unwrap(),
        );
        assert!(0.0 <= min && min <= median && median <= max, "{row}");
        assert_eq!(s["samples"], 2, "{row}");
    };
    let ratio = |row: &serde_json::Value, to: &str| {
        row["ratios"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["to"] == to)
            .and_then(|r| r["ratio"].as_f64())
            .unwrap_or_else(|| panic!("no ratio to {to}: {row}"))
    };
    for link in ["shm", "inproc"] {
        let moved = find(link, "-", "transport: moved");
        ordered(moved);
        assert!(ratio(moved, "memcpy").is_finite(), "{moved}");
        for mode in ["keep", "abort"] {
            let pause = find(link, mode, "pause");
            ordered(pause);
            let (step, transport) = (ratio(pause, "step"), ratio(pause, "transport"));
            assert!(step.is_finite() && transport.is_finite(), "{pause}");
            ordered(find(link, mode, "staging (fetch+stage)"));
            ordered(find(link, mode, "decode step"));
        }
    }
    let engines = report["engines"].as_array().unwrap();
    assert_eq!(engines.len(), 4, "{engines:?}");
    for e in engines {
        let running = e["running"].as_array().unwrap();
        assert_eq!(running.len(), 2, "{e}");
        assert!(running.iter().all(|n| n.as_u64().unwrap() >= 1), "{e}");
    }
}
