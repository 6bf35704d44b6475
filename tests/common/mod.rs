//! What the facade's integration tests share.
#![allow(clippy::unwrap_used, dead_code)]

pub(crate) mod launch;

use std::path::PathBuf;
use std::process::Command;

/// The path of a built example. `cargo test` builds examples beside the test binary's
/// `deps` folder before integration tests run; a filtered run (`cargo test --test NAME`)
/// may not, so the example is built here then.
pub(crate) fn example(name: &str) -> PathBuf {
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
    assert!(path.exists(), "{} is not built", path.display());
    path
}
