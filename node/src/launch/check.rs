//! The check before the launch: `refit launch` runs each distinct rank program once with
//! `REFIT_CHECK=1` before it starts any rank. A program built on Refit's
//! [`load_topology`](super::load_topology) says `refit-check: started` on its standard
//! output at once, checks what only it can check (its roles' params, the models' layouts:
//! `refit_actors::run::join` does it) and exits: 0 when the file is good, 1 with its
//! `error: ...` line when not. A program that does not say it within [`ANSWER_WITHIN`] does
//! not speak the check: it is stopped and the launch goes on (`[run] check = false` skips
//! the check for such programs).
//!
//! The decision of what a check's output means ([`Verdict::of`]) is plain code, tested
//! without processes.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{INCARNATION_ENV, RankSpawn};
use crate::TOKEN_FILE_ENV;
use crate::error::{Error, Result};

/// Set (to `1`) in the environment of a rank program run as a check.
pub const CHECK_ENV: &str = "REFIT_CHECK";

/// What a program that speaks the check prints first, on its standard output.
pub const CHECK_STARTED: &str = "refit-check: started";

/// What it prints once the file passed every check it makes.
pub const CHECK_PASSED: &str = "refit-check: passed";

/// How long a program has to say [`CHECK_STARTED`] before it is taken for one that does not
/// speak the check.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// True in a rank program run as a check (`REFIT_CHECK` set to anything but `0` or empty).
pub fn checking() -> bool {
    std::env::var(CHECK_ENV).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Says [`CHECK_STARTED`] (what [`load_topology`](super::load_topology) does in a check).
pub fn announce_check() {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{CHECK_STARTED}");
    let _ = out.flush();
}

/// Says [`CHECK_PASSED`]: the program found nothing wrong (what `join` does in a check,
/// before it returns without starting anything).
pub fn announce_passed() {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{CHECK_PASSED}");
    let _ = out.flush();
}

/// The cause a rank printed, from one line of its output: the text after `error: ` (as
/// Refit's programs print a failure: `error: ...`, `refit: error: ...`; a Rust `main`'s
/// `Error: ...` too), or the message of
/// a `tracing` line at level `ERROR`. `None` for any other line.
pub fn error_cause(line: &str) -> Option<&str> {
    let line = line.trim_end();
    // `error: ...`, or a program's name first: `refit: error: ...`, `my_rank: error: ...`
    let unnamed = match line.split_once(": ") {
        Some((name, rest)) if !name.contains(' ') && rest.starts_with("error: ") => rest,
        _ => line,
    };
    for lead in ["error: ", "Error: "] {
        if let Some(rest) = unnamed.strip_prefix(lead) {
            return Some(rest.trim());
        }
    }
    // `2026-11-28T06:53:02.878132Z ERROR target: message` (text log format)
    let (_, after) = line.split_once(" ERROR ")?;
    let (_, message) = after.split_once(": ")?;
    Some(message.trim())
}

/// What one program's check came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The program checked the file and found nothing wrong.
    Passed,
    /// The program refused the file; its cause (the first `error:` line), or how it ended
    /// when it printed none.
    Refused(String),
    /// The program does not speak the check (it never said [`CHECK_STARTED`]).
    NotSpoken,
}

impl Verdict {
    /// The verdict of a check that printed `lines` (standard output and error, in order)
    /// and ended with `status` (`None`: stopped by the launcher).
    pub fn of(lines: &[String], status: Option<ExitStatus>) -> Self {
        if !lines.iter().any(|l| l.trim_end() == CHECK_STARTED) {
            return Self::NotSpoken;
        }
        let passed = lines.iter().any(|l| l.trim_end() == CHECK_PASSED);
        match status {
            Some(s) if s.success() && passed => Self::Passed,
            Some(s) if s.success() => Self::Refused(
                "it exited without saying the file passed (it must call refit's `join` in a check)"
                    .into(),
            ),
            _ => {
                let cause = lines.iter().find_map(|l| error_cause(l)).map_or_else(
                    || match status {
                        Some(s) => format!("it {}", super::child::describe(s)),
                        None => "it said `refit-check: started` but no verdict in time (a \
                                 program that reads the file with `load_topology` and does not \
                                 call refit's `run::join` answers the check itself: \
                                 `announce_passed()` when `checking()`; or set `[run] check = \
                                 false`)"
                            .to_string(),
                    },
                    str::to_string,
                );
                Self::Refused(cause)
            }
        }
    }
}

/// Runs `spec`'s program as a check (see the module's doc) with at most `deadline` for the
/// whole check once the program said it started.
///
/// # Errors
/// [`Error::Start`] when the program cannot be started (saying how `run.command` is
/// resolved, and how to build the program when it is one of a cargo target folder).
pub fn check_rank(spec: &RankSpawn, deadline: Duration) -> Result<Verdict> {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .env_remove(TOKEN_FILE_ENV)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env(INCARNATION_ENV, spec.incarnation.to_string())
        .env(CHECK_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn().map_err(|e| cannot_start(spec, &e))?;
    let (tx, lines) = mpsc::channel();
    // the readers end with their streams: they are not joined (see below)
    if let Some(out) = child.stdout.take() {
        read_lines(out, tx.clone());
    }
    if let Some(err) = child.stderr.take() {
        read_lines(err, tx);
    } else {
        drop(tx);
    }
    let started = Instant::now();
    let mut seen: Vec<String> = Vec::new();
    let mut spoken = false;
    let status = loop {
        while let Ok(line) = lines.try_recv() {
            spoken |= line.trim_end() == CHECK_STARTED;
            seen.push(line);
        }
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!("cannot wait for the check of {}: {e}", spec.name);
                break None;
            }
        }
        let waited = started.elapsed();
        if (!spoken && waited >= ANSWER_WITHIN) || waited >= deadline.max(ANSWER_WITHIN) {
            stop(&mut child);
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // the last lines, until both streams close; a process the program left behind holding
    // them open gets a second, then is not waited for (its reader thread ends with it)
    let drained = Instant::now() + Duration::from_secs(1);
    while let Ok(line) = lines.recv_timeout(drained.saturating_duration_since(Instant::now())) {
        seen.push(line);
    }
    Ok(Verdict::of(&seen, status))
}

/// Stops a check that did not end: SIGKILL to its process group, then reaps it.
fn stop(child: &mut std::process::Child) {
    if let Ok(pgid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: killpg has no memory-safety preconditions; the group is our unreaped
        // child's (it leads its own group), so its id cannot have been reused.
        unsafe {
            libc::killpg(pgid, libc::SIGKILL);
        }
    }
    let _ = child.wait();
}

/// Sends each line of `from` to `to`, on a thread of its own, until either closes.
fn read_lines(from: impl Read + Send + 'static, to: mpsc::Sender<String>) {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            if to.send(line).is_err() {
                break;
            }
        }
    });
}

/// The error for a rank program that cannot be started: what was tried, how a relative
/// `command` is resolved, and how to build it when it lives in a cargo target folder.
pub fn cannot_start(spec: &RankSpawn, e: &std::io::Error) -> Error {
    let program = spec.program.display().to_string();
    let mut reason = format!(
        "rank {} ({}): cannot start `{program}`: {e}",
        spec.rank, spec.name
    );
    if e.kind() == std::io::ErrorKind::NotFound {
        if spec.program.is_absolute() {
            reason.push_str(
                "; a relative `command` (here `run.command` or the process's `command`) is \
                 resolved against the folder `refit launch` runs in: run it from the folder \
                 the path is relative to, or give an absolute path",
            );
        } else {
            reason.push_str("; a bare program name is looked up in PATH");
        }
        if let Some(build) = build_hint(&program) {
            reason.push_str(&format!("; if it is not built yet: `{build}`"));
        }
    }
    Error::Start(reason)
}

/// `cargo build --release --example NAME` for `.../target/release/examples/NAME` (and the
/// same for `debug`, and `--bin NAME` for `.../target/PROFILE/NAME`).
pub fn build_hint(program: &str) -> Option<String> {
    let parts: Vec<&str> = program.rsplit('/').take(4).collect();
    match parts.as_slice() {
        [name, "examples", profile, "target", ..] => {
            let flag = profile_flag(profile)?;
            Some(format!("cargo build{flag} --example {name}"))
        }
        [name, profile, "target", ..] => {
            let flag = profile_flag(profile)?;
            Some(format!("cargo build{flag} --bin {name}"))
        }
        _ => None,
    }
}

fn profile_flag(profile: &str) -> Option<&'static str> {
    match profile {
        "release" => Some(" --release"),
        "debug" => Some(""),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    fn lines(text: &[&str]) -> Vec<String> {
        text.iter().map(|s| (*s).to_string()).collect()
    }

    #[test]
    fn a_check_passes_only_when_the_program_says_so_and_exits_0() {
        let ok = ExitStatus::from_raw(0);
        let failed = ExitStatus::from_raw(1 << 8);
        assert_eq!(
            Verdict::of(&lines(&[CHECK_STARTED, CHECK_PASSED]), Some(ok)),
            Verdict::Passed
        );
        assert_eq!(
            Verdict::of(&lines(&["hello"]), Some(ok)),
            Verdict::NotSpoken
        );
        assert_eq!(Verdict::of(&[], None), Verdict::NotSpoken);
        assert_eq!(
            Verdict::of(
                &lines(&[
                    CHECK_STARTED,
                    "error: model `policy`: params.lr must be a finite number",
                ]),
                Some(failed)
            ),
            Verdict::Refused("model `policy`: params.lr must be a finite number".into())
        );
        let Verdict::Refused(why) = Verdict::of(&lines(&[CHECK_STARTED]), Some(failed)) else {
            panic!("a failed check is a refusal");
        };
        assert_eq!(why, "it exited with status 1");
        let Verdict::Refused(why) = Verdict::of(&lines(&[CHECK_STARTED]), Some(ok)) else {
            panic!("a check that never passed is a refusal");
        };
        assert!(why.contains("without saying"), "{why}");
        let Verdict::Refused(why) = Verdict::of(&lines(&[CHECK_STARTED]), None) else {
            panic!("a check stopped by the launcher is a refusal");
        };
        assert!(why.contains("in time"), "{why}");
    }

    #[test]
    fn the_cause_is_read_from_error_lines_and_error_log_lines() {
        assert_eq!(error_cause("error: bad lr"), Some("bad lr"));
        assert_eq!(error_cause("refit: error: bad lr\n"), Some("bad lr"));
        assert_eq!(error_cause("my_rank: error: bad lr"), Some("bad lr"));
        assert_eq!(
            error_cause(
                "2026-11-28T06:53:02.878132Z ERROR refit_actors::run: rank 0 is gone: closed"
            ),
            Some("rank 0 is gone: closed")
        );
        assert_eq!(error_cause("INFO all is well"), None);
        assert_eq!(error_cause("an error: somewhere in a sentence"), None);
    }

    #[test]
    fn a_missing_program_of_a_cargo_target_folder_says_how_to_build_it() {
        assert_eq!(
            build_hint("/w/target/release/examples/cartpole").as_deref(),
            Some("cargo build --release --example cartpole")
        );
        assert_eq!(
            build_hint("/w/target/debug/refit").as_deref(),
            Some("cargo build --bin refit")
        );
        assert_eq!(build_hint("/usr/bin/python3"), None);
        assert_eq!(build_hint("sh"), None);
        let spec = RankSpawn {
            rank: 0,
            name: "learner".into(),
            program: "/tmp/x/target/release/examples/cartpole".into(),
            args: vec![],
            env: vec![],
            max_restarts: 0,
            incarnation: 0,
        };
        let e = check_rank(&spec, Duration::from_secs(1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot start `/tmp/x/target/release/examples/cartpole`")
                && e.contains("resolved against the folder `refit launch` runs in")
                && e.contains("cargo build --release --example cartpole"),
            "{e}"
        );
    }

    #[test]
    fn a_process_left_holding_the_output_open_does_not_hold_the_check() {
        let spec = RankSpawn {
            rank: 0,
            name: "learner".into(),
            program: "sh".into(),
            args: vec![
                "-c".into(),
                format!("echo '{CHECK_STARTED}'; echo '{CHECK_PASSED}'; sleep 5 & exit 0"),
            ],
            env: vec![],
            max_restarts: 0,
            incarnation: 0,
        };
        let started = Instant::now();
        assert_eq!(
            check_rank(&spec, Duration::from_secs(10)).unwrap(),
            Verdict::Passed
        );
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_program_that_does_not_speak_the_check_is_not_checked() {
        let spec = RankSpawn {
            rank: 0,
            name: "learner".into(),
            program: "sh".into(),
            args: vec!["-c".into(), "echo hello; exit 3".into()],
            env: vec![],
            max_restarts: 0,
            incarnation: 0,
        };
        assert_eq!(
            check_rank(&spec, Duration::from_secs(5)).unwrap(),
            Verdict::NotSpoken
        );
        let refusing = RankSpawn {
            args: vec![
                "-c".into(),
                format!("echo '{CHECK_STARTED}'; echo 'error: params.lr is wrong' >&2; exit 1"),
            ],
            ..spec
        };
        assert_eq!(
            check_rank(&refusing, Duration::from_secs(5)).unwrap(),
            Verdict::Refused("params.lr is wrong".into())
        );
    }
}
