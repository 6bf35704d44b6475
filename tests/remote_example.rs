//! The remote-actor example as a user runs it: a server process and a client process.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

mod common;
use common::example;

#[test]
fn remote_actor_demo_calls_a_server_process_then_sees_it_die() {
    let out = Command::new(example("remote_actor")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "add 5: total 5",
        "add 7: total 12",
        "add 2000: refused: remote actor `tally`, message `tally.add`: the actor failed: invalid configuration: 2000 is over the limit of 1000",
        "add 30: total 42",
        "total: 42",
        "after the server was killed: remote actor `tally`, message `tally.add`: its process is gone",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in\n{stdout}");
    }
}

/// Kills and reaps the server however the test ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn remote_actor_serve_and_call_as_two_processes() {
    let token = "remote-example-test-token";
    let mut server = KillOnDrop(
        Command::new(example("remote_actor"))
            .args(["serve", "--bind", "127.0.0.1:0"])
            .env("REFIT_TOKEN", token)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    let call = |token: &str, target: &str| {
        Command::new(example("remote_actor"))
            .args([
                "call", "--addr", words[1], "--target", target, "4", "5000", "6",
            ])
            .env("REFIT_TOKEN", token)
            .output()
            .unwrap()
    };
    let ok = call(token, words[2]);
    let wrong_token = call("not-the-cluster-token", words[2]);
    let wrong_target = call(token, "00000000-0000-4000-8000-000000000000");
    drop(server);
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{line}\n{stdout}");
    assert!(stdout.contains("add 4: total 4"), "{stdout}");
    assert!(stdout.contains("add 5000: refused"), "{stdout}");
    assert!(stdout.contains("total: 10"), "{stdout}");
    let stderr = String::from_utf8_lossy(&wrong_token.stderr);
    assert!(!wrong_token.status.success());
    assert!(stderr.contains("cluster token"), "{stderr}");
    let stderr = String::from_utf8_lossy(&wrong_target.stderr);
    assert!(!wrong_target.status.success());
    assert!(
        stderr.contains("message `tally.add`: refused by its node"),
        "{stderr}"
    );
}
