//! One rank's process: started in its own process group, killed by the kernel when the
//! launcher dies (`PR_SET_PDEATHSIG`), its output lines prefixed with `[rank N name]`.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};

use super::{INCARNATION_ENV, RankSpawn};
use crate::TOKEN_FILE_ENV;

/// A started rank.
#[derive(Debug)]
pub(crate) struct Running {
    /// What it runs (and runs again on a restart).
    pub(crate) spec: RankSpawn,
    pub(crate) child: Child,
    /// Its exit status, once reaped.
    pub(crate) status: Option<ExitStatus>,
    /// How many times it was restarted so far.
    pub(crate) restarts: u32,
    /// The first cause its current process printed (`error: ...`, or an `ERROR` log line).
    pub(crate) cause: Cause,
}

/// The first failure cause a rank's process printed, shared with its output threads.
pub(crate) type Cause = Arc<Mutex<Option<String>>>;

impl Running {
    /// `rank N (name)`.
    pub(crate) fn label(&self) -> String {
        format!("rank {} ({})", self.spec.rank, self.spec.name)
    }

    /// The process group id (the child's pid: it leads its own group).
    fn pgid(&self) -> libc::pid_t {
        libc::pid_t::try_from(self.child.id()).unwrap_or(libc::pid_t::MAX)
    }

    /// Sends `signal` to the rank's whole process group, if it has not been reaped yet
    /// (a reaped group id could name someone else's processes).
    pub(crate) fn signal_group(&self, signal: libc::c_int) {
        if self.status.is_none() {
            // SAFETY: killpg has no memory-safety preconditions; the group is our unreaped
            // child's, so its id cannot have been reused.
            unsafe {
                libc::killpg(self.pgid(), signal);
            }
        }
    }
}

/// Starts one rank (`incarnation`: its `REFIT_INCARNATION`); its stdout and stderr are
/// copied, line by line and prefixed, to ours by two threads that report on `done` when
/// their stream closes, and that keep the first cause it prints in `cause`. With
/// `log_dir`, its lines are also appended, unprefixed, to `log_dir/rank-N-NAME.log`.
///
/// # Errors
/// When the program cannot be started (not found, not executable), or its log file cannot
/// be opened.
pub(crate) fn spawn(
    spec: &RankSpawn,
    incarnation: u32,
    done: &mpsc::Sender<()>,
    cause: &Cause,
    log_dir: Option<&Path>,
) -> io::Result<Child> {
    let log = match log_dir {
        Some(dir) => Some(Arc::new(Mutex::new(open_log(dir, spec, incarnation)?))),
        None => None,
    };
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .env_remove(TOKEN_FILE_ENV)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env(INCARNATION_ENV, incarnation.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure runs in the forked child before exec and calls only prctl and
    // getppid, both async-signal-safe system calls; it allocates nothing and touches no lock.
    // PR_SET_PDEATHSIG makes the kernel send SIGTERM to the child when the thread that
    // forked it exits, so children are spawned from the launcher's main thread, which lives
    // as long as the launcher. If the launcher died between fork and prctl, getppid no longer
    // names it and the child gives up at once instead of running orphaned.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGTERM as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let prefix = format!("[rank {} {}] ", spec.rank, spec.name);
    let copy = |to_err| Pump {
        prefix: prefix.clone(),
        to_err,
        done: done.clone(),
        cause: Arc::clone(cause),
        log: log.clone(),
    };
    if let Some(out) = child.stdout.take() {
        copy(false).run(out);
    }
    if let Some(err) = child.stderr.take() {
        copy(true).run(err);
    }
    Ok(child)
}

/// The log file of one rank (`rank-N-NAME.log` in `dir`, created with `dir`), opened for
/// appending: a restarted rank's lines follow its first start's, after a line saying so.
fn open_log(dir: &Path, spec: &RankSpawn, incarnation: u32) -> io::Result<File> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(log_name(spec.rank, &spec.name));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    if incarnation > spec.incarnation {
        writeln!(file, "--- restarted: REFIT_INCARNATION={incarnation}")?;
    }
    Ok(file)
}

/// `rank-3-actor.log`: the log file name of rank `rank` of process `name`.
pub(crate) fn log_name(rank: u32, name: &str) -> String {
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("rank-{rank}-{safe}.log")
}

/// Where one output stream of a rank goes.
struct Pump {
    prefix: String,
    to_err: bool,
    done: mpsc::Sender<()>,
    cause: Cause,
    log: Option<Arc<Mutex<File>>>,
}

impl Pump {
    /// Copies `from` to our stdout (or stderr) line by line, each line prefixed and written
    /// whole, so lines of different ranks never mix (and to the rank's log file, as it
    /// came). Keeps draining after a write error, so the child never blocks on a full pipe.
    fn run(self, from: impl Read + Send + 'static) {
        let spawned = std::thread::Builder::new()
            .name("refit-launch-output".into())
            .spawn(move || {
                let mut reader = BufReader::new(from);
                let mut line = Vec::new();
                loop {
                    line.clear();
                    match reader.read_until(b'\n', &mut line) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    self.keep_cause(&line);
                    if let Some(log) = &self.log {
                        let _ = lock(log).write_all(&line);
                    }
                    let mut buf = Vec::with_capacity(self.prefix.len() + line.len());
                    buf.extend_from_slice(self.prefix.as_bytes());
                    buf.extend_from_slice(&line);
                    let _ = if self.to_err {
                        io::stderr().lock().write_all(&buf)
                    } else {
                        let mut out = io::stdout().lock();
                        out.write_all(&buf).and_then(|()| out.flush())
                    };
                }
                let _ = self.done.send(());
            });
        if let Err(e) = spawned {
            tracing::error!("cannot copy the output of a rank ({e}); it is dropped");
        }
    }

    /// Keeps the first cause the rank printed.
    fn keep_cause(&self, line: &[u8]) {
        let text = String::from_utf8_lossy(line);
        if let Some(cause) = super::check::error_cause(&text) {
            let mut first = lock(&self.cause);
            if first.is_none() {
                *first = Some(cause.to_string());
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `exited with status 3` / `was killed by signal 9 (SIGKILL)`.
pub(crate) fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s} ({})", signal_name(s)),
        (None, None) => format!("ended ({status})"),
    }
}

/// The launcher's exit code for a rank's status: its code, or 128 + the signal.
pub(crate) fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => u8::try_from(c & 0xff).unwrap_or(1),
        (None, Some(s)) => u8::try_from((128 + s) & 0xff).unwrap_or(1),
        (None, None) => 1,
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "another signal",
    }
}
