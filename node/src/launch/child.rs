//! One rank's process: started in its own process group, killed by the kernel when the
//! launcher dies (`PR_SET_PDEATHSIG`), its output lines prefixed with `[rank N name]`.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;

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
}

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
/// their stream closes.
///
/// # Errors
/// When the program cannot be started (not found, not executable).
pub(crate) fn spawn(
    spec: &RankSpawn,
    incarnation: u32,
    done: &mpsc::Sender<()>,
) -> io::Result<Child> {
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
    if let Some(out) = child.stdout.take() {
        pump(out, prefix.clone(), false, done.clone());
    }
    if let Some(err) = child.stderr.take() {
        pump(err, prefix, true, done.clone());
    }
    Ok(child)
}

/// Copies `from` to our stdout (or stderr) line by line, each line prefixed and written
/// whole, so lines of different ranks never mix. Keeps draining after a write error, so the
/// child never blocks on a full pipe.
fn pump(from: impl Read + Send + 'static, prefix: String, to_err: bool, done: mpsc::Sender<()>) {
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
                let mut buf = Vec::with_capacity(prefix.len() + line.len());
                buf.extend_from_slice(prefix.as_bytes());
                buf.extend_from_slice(&line);
                let _ = if to_err {
                    io::stderr().lock().write_all(&buf)
                } else {
                    let mut out = io::stdout().lock();
                    out.write_all(&buf).and_then(|()| out.flush())
                };
            }
            let _ = done.send(());
        });
    if let Err(e) = spawned {
        tracing::error!("cannot copy the output of a rank ({e}); it is dropped");
    }
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
