//! Runs the `quick_start` example (the book's first program, built with no optional
//! feature) and checks that the engine applied every version the trainer published.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;
use std::process::Command;

/// Examples are built before integration tests, beside this test binary's `deps` folder; a
/// filtered run (`cargo test --test quick_start`) builds it here.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let path = profile_dir.join("examples").join(name);
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--example", name]);
        if profile_dir.ends_with("release") {
            cmd.arg("--release");
        }
        assert!(cmd.status().unwrap().success(), "building example {name}");
    }
    path
}

#[test]
fn quick_start_delivers_every_version_to_the_engine() {
    let out = Command::new(example("quick_start")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("engine: serving version 1"), "{stdout}");
    for v in 2..=3 {
        for line in [
            format!("engine: applied version {v} (fc.bias = {v})"),
            format!("trainer: version {v} applied by the engine"),
        ] {
            assert!(stdout.contains(&line), "missing {line:?} in\n{stdout}");
        }
    }
    assert!(
        stdout.contains("engine: trainer gone, still serving version 3"),
        "{stdout}"
    );
}
