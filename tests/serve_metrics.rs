//! A real `refit serve` process exposes its metrics: after a `refit pull`, its `/metrics`
//! page holds the phase histogram (with buckets) with the sender's phases, and the sender's
//! counters and gauges: version published, updates and bytes, failures, receivers.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit::node::ClusterToken;
use refit::runtime::{DType, Manifest, ModelId, ReceiverInit, Version, WeightSet, wire};
use refit::transports::tcp::{TcpEndpoint, TcpReceiver, TcpReceiverSpec};

const REFIT: &str = env!("CARGO_BIN_EXE_refit");

fn get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Kills the child when the test ends, whatever happens.
struct Killed(std::process::Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn serve_exposes_phase_timings_after_a_pull() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manifest::builder()
        .tensor("w", DType::F32, &[256, 64])
        .tensor("b", DType::F32, &[64])
        .build()
        .unwrap();
    let mut ws = WeightSet::zeroed(ModelId::new("policy").unwrap(), Arc::new(m));
    ws.view_mut::<f32>("w").unwrap().fill(0.5);
    ws.set_version(Version(1));
    let file = dir.path().join("policy.safetensors");
    ws.write_safetensors(&file).unwrap();
    let spec = dir.path().join("spec");
    let token = "serve-metrics-test-token-0123456789abcdef";
    let mut serve = Killed(
        Command::new(REFIT)
            .arg("serve")
            .arg(&file)
            .args(["--metrics-addr", "127.0.0.1:0", "--seconds", "120"])
            .arg("--spec-file")
            .arg(&spec)
            .env("REFIT_TOKEN", token)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(serve.0.stdout.take().unwrap()).lines();
    let metrics_addr = loop {
        let line = lines.next().expect("refit serve closed stdout").unwrap();
        if let Some(url) = line.strip_prefix("metrics: http://") {
            break url.trim_end_matches("/metrics").to_string();
        }
    };
    let t = Instant::now();
    while !spec.exists() {
        assert!(t.elapsed() < Duration::from_secs(60), "no spec file");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(get(&metrics_addr, "/nope").starts_with("HTTP/1.1 404"));
    // a request line that never ends is cut at the size limit, answered, and does not
    // hold the endpoint: the next request is served
    {
        use std::io::{Read, Write};
        let mut junk = std::net::TcpStream::connect(&metrics_addr).unwrap();
        junk.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        // exactly the limit: the server reads all of it, so its close is a clean one
        let _ = junk.write_all(&vec![b'x'; 16 * 1024]);
        let mut answer = String::new();
        let _ = junk.read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 404"), "{answer:?}");
    }
    assert!(get(&metrics_addr, "/nope").starts_with("HTTP/1.1 404"));
    let out = dir.path().join("pulled.safetensors");
    let pull = Command::new(REFIT)
        .arg("pull")
        .arg(&out)
        .arg("--spec-file")
        .arg(&spec)
        .args(["--timeout", "60"])
        .env("REFIT_TOKEN", token)
        .output()
        .unwrap();
    assert!(
        pull.status.success(),
        "pull failed: {}",
        String::from_utf8_lossy(&pull.stderr)
    );
    let back = WeightSet::read_safetensors(&out, None).unwrap();
    assert_eq!(back.bytes(), ws.bytes());
    // the sender records its side of the transfer when the receiver reports it whole
    let t = Instant::now();
    let page = loop {
        let page = get(&metrics_addr, "/metrics");
        if page.contains(r#"phase="wire""#) || t.elapsed() > Duration::from_secs(30) {
            break page;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
    assert!(page.contains("refit_update_phase_seconds"), "{page}");
    assert!(
        page.contains(r#"phase="wire""#)
            && page.contains(r#"model="policy""#)
            && page.contains(r#"transport="tcp""#),
        "{page}"
    );
    // a histogram with buckets (which sum across processes), not a summary
    assert!(
        page.contains("# TYPE refit_update_phase_seconds histogram")
            && page.contains(r#"refit_update_phase_seconds_bucket{phase="wire",model="policy",transport="tcp",le="0.001"}"#)
            && page.contains(r#"le="+Inf""#),
        "{page}"
    );
    // the sender's side: version 1 published once, its bytes, no failure
    let bytes = ws.bytes().len();
    for line in [
        r#"refit_published_version{model="policy",transport="tcp"} 1"#.to_owned(),
        r#"refit_updates_total{side="sender",model="policy",transport="tcp"} 1"#.to_owned(),
        format!(
            r#"refit_update_bytes_total{{side="sender",model="policy",transport="tcp"}} {bytes}"#
        ),
        r#"refit_update_failures_total{side="sender",transport="tcp"} 0"#.to_owned(),
        "# TYPE refit_receivers_connected gauge".to_owned(),
    ] {
        assert!(
            page.lines().any(|l| l == line),
            "{line} missing from:\n{page}"
        );
    }
    // a receiver that stays attached is counted while it is, and no longer once it left
    let endpoint: TcpEndpoint =
        wire::from_token(std::fs::read_to_string(&spec).unwrap().trim()).unwrap();
    let receiver = ReceiverInit::new(
        TcpReceiver::new(TcpReceiverSpec::new(
            endpoint,
            &ClusterToken::new(token).unwrap(),
        )),
        None,
    )
    .connect(Duration::from_secs(60))
    .unwrap();
    wait_for_line(
        &metrics_addr,
        r#"refit_receivers_connected{model="policy",transport="tcp"} 1"#,
    );
    receiver.shutdown().unwrap();
    wait_for_line(
        &metrics_addr,
        r#"refit_receivers_connected{model="policy",transport="tcp"} 0"#,
    );
}

/// Waits up to 30 s for the metrics page at `addr` to hold `line`.
fn wait_for_line(addr: &str, line: &str) {
    let t = Instant::now();
    loop {
        let page = get(addr, "/metrics");
        if page.lines().any(|l| l == line) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{line} missing from:\n{page}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
