//! Runs the `quick_start` example (the book's first program, built with no optional
//! feature) and checks that the engine applied every version the trainer published.
#![allow(clippy::unwrap_used, missing_docs)]

use std::process::Command;

mod common;
use common::example;

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
