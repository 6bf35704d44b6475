//! SIGTERM and SIGINT always end a process that installed Refit's signal handlers, even when
//! a release action never returns or an exit handler hangs: real processes (this test binary
//! started again in a child role), real signals.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use refit_node::signals::install_signal_handlers;
use refit_runtime::cleanup::{on_exit_signal, set_release_bound};

/// The variable that puts this test binary in a child role (its value: the role).
const ROLE: &str = "REFIT_SIGNALS_TEST_ROLE";
/// The file the quick release action creates.
const MARK: &str = "REFIT_SIGNALS_TEST_MARK";
/// What the child prints once it waits for the signal.
const READY: &str = "<signals-test-child-ready>";

/// Never returns: what a release action stuck on a dead peer or a held lock does.
fn block_forever() {
    loop {
        std::thread::park();
    }
}

extern "C" fn exit_handler_that_hangs() {
    block_forever();
}

/// The child's side: handlers installed, a release action that never returns, a quick one
/// that marks a file (it runs first: newest first), then "ready" and a wait for the signal.
fn child(role: &str) -> ! {
    install_signal_handlers().unwrap();
    let _blocking = on_exit_signal(block_forever);
    let mark = std::env::var(MARK).unwrap();
    let _quick = on_exit_signal(move || {
        let _ = std::fs::write(&mark, "released\n");
    });
    match role {
        "bound" => {}
        "second-signal" => set_release_bound(Duration::from_secs(3600)),
        "exit-handler" => {
            // SAFETY: registers a plain `extern "C" fn` taking nothing, as atexit expects
            let rc = unsafe { libc::atexit(exit_handler_that_hangs) };
            assert_eq!(rc, 0);
        }
        other => panic!("unknown role {other}"),
    }
    let mut out = std::io::stdout().lock();
    // libtest may have written `test NAME ... ` on this line already
    writeln!(out, "{READY}").unwrap();
    out.flush().unwrap();
    drop(out);
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A child process, killed if the test ends (or fails) while it runs.
struct Guarded(Child);

impl Drop for Guarded {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts this test binary running only `test` (in the role `role`), waits for it to be
/// ready.
fn start_child(test: &str, role: &str, mark: &std::path::Path) -> Guarded {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(MARK, mark)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let child = Guarded(child);
    let mut lines = BufReader::new(out).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.contains(READY) => break,
            Some(Ok(_)) => {}
            _ => panic!("the child ended before it was ready"),
        }
    }
    // keep draining its stdout, so it never blocks on a full pipe
    std::thread::spawn(move || for _ in lines {});
    child
}

fn signal(child: &Guarded, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Waits for the child to end; fails the test if it still runs after `limit` (a hang: the
/// bounds under test are seconds).
fn ended(child: &mut Guarded, limit: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > limit {
            panic!("the process still runs {limit:?} after the signal");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The role of this process when it was started as a child, for `test`.
fn role(test: &str) -> Option<String> {
    let role = std::env::var(ROLE).ok()?;
    // only the test the child was started for plays it
    std::env::args().any(|a| a == test).then_some(role)
}

#[test]
fn sigterm_ends_the_process_when_a_release_action_blocks() {
    const NAME: &str = "sigterm_ends_the_process_when_a_release_action_blocks";
    if let Some(r) = role(NAME) {
        child(&r);
    }
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("released");
    let mut c = start_child(NAME, "bound", &mark);
    signal(&c, "TERM");
    let status = ended(&mut c, Duration::from_secs(60));
    assert_eq!(status.code(), Some(143), "{status}");
    // the action that could run did
    assert_eq!(std::fs::read_to_string(&mark).unwrap(), "released\n");
}

#[test]
fn a_second_signal_ends_the_process_before_the_bound() {
    const NAME: &str = "a_second_signal_ends_the_process_before_the_bound";
    if let Some(r) = role(NAME) {
        child(&r);
    }
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("released");
    // the child's bound is an hour: only the second signal can end it within the limit
    let mut c = start_child(NAME, "second-signal", &mark);
    signal(&c, "INT");
    // the first signal is being handled once the quick action has run
    let start = Instant::now();
    while !mark.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no release began"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        c.0.try_wait().unwrap().is_none(),
        "it ended before the bound"
    );
    signal(&c, "TERM");
    let status = ended(&mut c, Duration::from_secs(60));
    // the status is the first signal's
    assert_eq!(status.code(), Some(130), "{status}");
}

#[test]
fn an_exit_handler_that_hangs_does_not_keep_the_process_alive() {
    const NAME: &str = "an_exit_handler_that_hangs_does_not_keep_the_process_alive";
    if let Some(r) = role(NAME) {
        child(&r);
    }
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("released");
    let mut c = start_child(NAME, "exit-handler", &mark);
    signal(&c, "INT");
    let status = ended(&mut c, Duration::from_secs(60));
    assert_eq!(status.code(), Some(130), "{status}");
}
