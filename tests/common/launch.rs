//! `refit launch` as a user runs it, for tests: the real binary, its output lines
//! timestamped as they arrive, and what must be gone once it exits.
#![allow(clippy::unwrap_used, dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running `refit launch`, its output lines timestamped as they arrive.
pub(crate) struct Launch {
    pub(crate) child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Launch {
    pub(crate) fn start(topology: &Path, mode: &str) -> Self {
        Self::start_with(topology, mode, &[])
    }

    /// As `start`, with more arguments for `refit launch`.
    pub(crate) fn start_with(topology: &Path, mode: &str, args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_refit"))
            .arg("launch")
            .arg(topology)
            .args(args)
            .args(["--set", &format!("sync.sync_mode={mode}")])
            .env_remove("REFIT_TOKEN")
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let mut readers = Vec::new();
        let streams: [Box<dyn Read + Send>; 2] = [
            Box::new(child.stdout.take().unwrap()),
            Box::new(child.stderr.take().unwrap()),
        ];
        for s in streams {
            let lines = Arc::clone(&lines);
            readers.push(std::thread::spawn(move || {
                for l in BufReader::new(s).lines() {
                    let Ok(l) = l else { break };
                    lines.lock().unwrap().push((Instant::now(), l));
                }
            }));
        }
        Self {
            child,
            lines,
            readers,
        }
    }

    pub(crate) fn text(&self) -> String {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .map(|(_, l)| l.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The first line containing every one of `parts`, waiting up to `timeout` for it.
    pub(crate) fn wait_for(&self, parts: &[&str], timeout: Duration) -> (Instant, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(found) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|(_, l)| parts.iter().all(|p| l.contains(p)))
            {
                return found.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no line with {parts:?} within {timeout:?}:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The first line containing every part of one of `alternatives`, waiting up to
    /// `timeout` for it.
    #[allow(dead_code)]
    pub(crate) fn wait_for_any(
        &self,
        alternatives: &[&[&str]],
        timeout: Duration,
    ) -> (Instant, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(found) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|(_, l)| alternatives.iter().any(|a| a.iter().all(|p| l.contains(p))))
            {
                return found.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no line with one of {alternatives:?} within {timeout:?}:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the launcher to exit (killing it past `timeout`, which fails the test).
    pub(crate) fn finish(mut self, timeout: Duration) -> (ExitStatus, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "refit launch still running after {timeout:?}:\n{}",
                    self.text()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        for r in self.readers.drain(..) {
            r.join().unwrap();
        }
        (status, self.text())
    }
}

/// The pid a rank printed on `line` (`...: pid N, ...`).
pub(crate) fn pid_in(line: &str) -> Option<u32> {
    let rest = line.split(": pid ").nth(1)?;
    let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
    pid.parse().ok()
}

/// The pids every rank printed, and the shared-memory board rank 0 opened.
pub(crate) fn pids_and_board(out: &str) -> (Vec<u32>, PathBuf) {
    let mut pids = Vec::new();
    let mut board = None;
    for l in out.lines() {
        if let Some(pid) = pid_in(l) {
            pids.push(pid);
        }
        if let Some(b) = l.split("shm board ").nth(1) {
            board = Some(PathBuf::from(b.trim()));
        }
    }
    (
        pids,
        board.unwrap_or_else(|| panic!("no shm board in\n{out}")),
    )
}

/// No rank outlives the launcher, no segment of the run's scheme is left.
pub(crate) fn assert_clean(out: &str) {
    let (pids, board) = pids_and_board(out);
    assert_eq!(pids.len(), 3, "{out}");
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z ")),
            "process {pid} outlived the launcher\n{out}"
        );
    }
    let scheme = board
        .file_name()
        .unwrap()
        .to_string_lossy()
        .trim_end_matches("-board")
        .to_owned();
    let left: Vec<String> = std::fs::read_dir(board.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&scheme))
        .collect();
    assert!(left.is_empty(), "segments left behind: {left:?}\n{out}");
}

/// `examples/topologies/NAME` as shipped, written into `dir` with its `command` pointed at
/// this build's example `example`, and each line that sets a key of `set` setting it to the
/// value given (written as TOML: quote strings yourself).
pub(crate) fn shipped_topology(
    dir: &Path,
    name: &str,
    example: &str,
    set: &[(&str, String)],
) -> PathBuf {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/topologies")
        .join(name);
    let exe = super::example(example);
    let text: Vec<String> = std::fs::read_to_string(shipped)
        .unwrap()
        .lines()
        .map(|l| {
            // the program (the first string) is this build's example; its arguments stay
            if let Some(rest) = l.strip_prefix("command = [") {
                let args = rest.splitn(3, '"').nth(2).unwrap_or("]");
                return format!("command = [{:?}{args}", exe.display().to_string());
            }
            match set.iter().find(|(k, _)| l.starts_with(&format!("{k} = "))) {
                Some((k, v)) => format!("{k} = {v}"),
                None => l.to_owned(),
            }
        })
        .collect();
    let path = dir.join(name);
    std::fs::write(&path, text.join("\n")).unwrap();
    path
}

/// The version of the last `policy vN: ` update line in `out`.
pub(crate) fn last_version(out: &str) -> u64 {
    out.lines()
        .filter_map(|l| l.split("policy v").nth(1)?.split(':').next()?.parse().ok())
        .max()
        .unwrap_or(0)
}
