//! Runs the built examples as a user would and checks what they print.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;
use std::process::Command;

/// Cargo builds examples before integration tests; they sit in `target/<profile>/examples`,
/// beside the `deps` directory holding this test binary.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "example {name} not built at {}",
        path.display()
    );
    path
}

#[test]
fn shm_weights_example_runs_sender_and_two_receiver_processes() {
    let out = Command::new(example("shm_weights"))
        .arg("6")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for r in 0..2 {
        assert!(
            stdout.contains(&format!("receiver {r}: connected at version 1")),
            "{stdout}"
        );
        for v in 2..=6 {
            let line = format!("receiver {r}: applied version {v} (fc1.weight[0] = {v})");
            assert!(stdout.contains(&line), "missing {line:?} in\n{stdout}");
        }
        assert!(
            stdout.contains(&format!(
                "receiver {r}: sender left (shut down); last version 6"
            )),
            "{stdout}"
        );
    }
    assert_eq!(stdout.matches("acknowledged by both receivers").count(), 5);
}

#[test]
fn shm_weights_example_refuses_bad_arguments() {
    let out = Command::new(example("shm_weights"))
        .arg("zero")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage"));
}
