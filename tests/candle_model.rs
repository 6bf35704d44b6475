//! Runs the `candle_model` example (the "bring your model" chapter's program): a candle-nn
//! MLP's weights, exported from its `VarMap`, go over TCP to an engine that imports every
//! version into a fresh `VarMap`, and the engine's outputs equal the trainer's.
#![allow(clippy::unwrap_used, missing_docs)]

use std::process::Command;

mod common;
use common::example;

#[test]
fn a_candle_model_round_trips_over_tcp_with_equal_outputs() {
    let out = Command::new(example("candle_model"))
        .args(["--versions", "3", "--steps", "10"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for v in 1..=4 {
        let line = format!("version {v}: the engine's outputs equal the trainer's");
        assert!(stdout.contains(&line), "missing {line:?} in\n{stdout}");
    }
    for v in 2..=4 {
        assert!(
            stdout.contains(&format!("trainer: version {v} published (loss ")),
            "{stdout}"
        );
    }
    // the model learned: the last loss is below the first
    let losses: Vec<f32> = stdout
        .lines()
        .filter_map(|l| l.split("(loss ").nth(1)?.trim_end_matches(')').parse().ok())
        .collect();
    assert_eq!(losses.len(), 3, "{stdout}");
    assert!(losses[2] < losses[0], "{losses:?}");
}
