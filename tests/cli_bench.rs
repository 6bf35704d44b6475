//! `refit bench` takes its transports from the link factory: every registered transport,
//! named on the command line, gets its rows (real receiver processes where the transport
//! crosses processes), and an unknown name is refused naming the known ones.
#![allow(clippy::unwrap_used, missing_docs)]

use std::process::Command;

use refit::transports::link::LINKS;

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
    for name in names {
        let row = rows
            .iter()
            .find(|r| r["transport"] == name && r["metric"] == "end-to-end")
            .unwrap_or_else(|| panic!("no end-to-end row for {name}: {rows:?}"));
        assert_eq!(row["bytes"], 4 << 20);
        assert!(row["seconds"]["median"].as_f64().unwrap() > 0.0, "{row}");
    }
    // receivers in processes: connect+first pull beside a steady update of the same runs,
    // each with its tail
    for metric in ["connect+first pull", "  steady update"] {
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
