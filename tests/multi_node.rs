//! Runs the `multi_node` example (a trainer process and two worker processes on loopback)
//! and checks what each process reports.
#![allow(clippy::unwrap_used, missing_docs)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::example;

#[test]
fn trainer_and_two_workers_agree_on_every_version() {
    let mut child = Command::new(example("multi_node"))
        .args(["--workers", "2", "--versions", "4"])
        .env_remove("REFIT_TOKEN")
        .env_remove("RANK")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(120) {
            child.kill().unwrap();
            panic!("the example did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for v in 2..=4 {
        assert!(
            stdout.contains(&format!("trainer: version {v} acknowledged by 2 workers")),
            "{stdout}"
        );
    }
    for rank in 1..=2 {
        assert!(
            stdout.contains(&format!("worker {rank}: applied version 1")),
            "{stdout}"
        );
        assert!(
            stdout.contains(&format!("worker {rank}: applied version 4 (head = 4)")),
            "{stdout}"
        );
        assert!(
            stdout.contains(&format!("worker {rank}: trainer gone after version 4")),
            "{stdout}"
        );
    }
    assert!(stdout.contains("trainer: done"), "{stdout}");
}
