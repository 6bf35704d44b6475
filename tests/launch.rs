//! `refit launch` with real processes: every rank gets the launch variables, a failing rank
//! is reported (rank, process, status) and the others are stopped or go on as the topology
//! says, a bad file is refused naming the key, one rank starts alone from torchrun's or
//! Slurm's variables, and no rank outlives the launcher, even a SIGKILLed one.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

const TOKEN: &str = "launch-test-token-0123456789abcdef";

/// The `refit` binary with no token and no launch variables in its environment.
fn refit() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_refit"));
    for v in [
        "REFIT_TOKEN",
        "REFIT_TOKEN_FILE",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "REFIT_SET",
        "REFIT_INCARNATION",
        "SLURM_RESTART_COUNT",
        "TORCHELASTIC_RESTART_COUNT",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
    ] {
        c.env_remove(v);
    }
    c
}

/// A topology of three ranks (`learner` rank 0, `actor` ranks 1 and 2), each running
/// `sh -c script` (with `$D` the directory), written to `dir/topo.toml`.
fn topology(dir: &Path, on_failure: &str, script: &str) -> PathBuf {
    topology_with(dir, on_failure, script, "")
}

/// As [`topology`], with `actor_keys` added to the `actor` process.
fn topology_with(dir: &Path, on_failure: &str, script: &str, actor_keys: &str) -> PathBuf {
    let script = format!("D='{}'; {script}", dir.display());
    let text = format!(
        r#"
[run]
command = ["sh", "-c", {script:?}]
check = false
on_failure = "{on_failure}"
[[model]]
id = "policy"
[[process]]
name = "learner"
roles = ["trainer", "controller"]
[[process]]
name = "actor"
replicas = 2
roles = ["engine", "rollout"]
{actor_keys}
"#
    );
    let path = dir.join("topo.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `cmd` to the end, failing the test after `limit`.
fn run_within(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        if rx.recv_timeout(limit).is_err() {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
    });
    let out = child.wait_with_output().unwrap();
    let _ = tx.send(());
    out
}

/// True while `pid` is a live (not zombie) process.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // the state follows the parenthesised command name
            let state = stat.rsplit_once(") ").map(|(_, r)| r.chars().next());
            !matches!(state, Some(Some('Z' | 'X')))
        }
        Err(_) => false,
    }
}

/// Waits up to `limit` for `path` to exist; returns its content.
fn wait_file(path: &Path, limit: Duration) -> String {
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && s.ends_with('\n')
        {
            return s;
        }
        assert!(start.elapsed() < limit, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn pid_in(dir: &Path, rank: u32) -> u32 {
    wait_file(&dir.join(format!("pid.{rank}")), Duration::from_secs(30))
        .trim()
        .parse()
        .unwrap()
}

/// Waits up to `limit` for every pid to be gone.
fn all_gone(pids: &[u32], limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if pids.iter().all(|p| !alive(*p)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

const ENV_SCRIPT: &str = r#"echo "$RANK $WORLD_SIZE $MASTER_ADDR $MASTER_PORT $REFIT_TOPOLOGY $REFIT_TOKEN" > "$D/env.tmp.$RANK"; mv "$D/env.tmp.$RANK" "$D/env.$RANK"; echo "hello from $RANK"; echo "warn from $RANK" >&2"#;

#[test]
fn every_rank_gets_the_launch_variables() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(dir.path(), "abort", ENV_SCRIPT);
    let mut cmd = refit();
    cmd.arg("launch")
        .arg(&topo)
        .args(["--master-port", "45123"])
        .env("REFIT_TOKEN", TOKEN);
    let out = run_within(cmd, Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..3 {
        let env = std::fs::read_to_string(dir.path().join(format!("env.{rank}"))).unwrap();
        assert_eq!(
            env.trim(),
            format!("{rank} 3 127.0.0.1 45123 {} {TOKEN}", topo.display()),
            "rank {rank}"
        );
        let name = if rank == 0 { "learner" } else { "actor" };
        assert!(
            stdout.contains(&format!("[rank {rank} {name}] hello from {rank}\n")),
            "{stdout}"
        );
        assert!(
            stderr.contains(&format!("[rank {rank} {name}] warn from {rank}\n")),
            "{stderr}"
        );
    }
    assert!(!stdout.contains(TOKEN) || stdout.matches(TOKEN).count() == 0);
    assert!(!stderr.contains(TOKEN), "the token was printed: {stderr}");

    // no token given: a random one, the same for every rank; a free port
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(dir.path(), "abort", ENV_SCRIPT);
    let mut cmd = refit();
    cmd.current_dir(dir.path()).arg("launch").arg("topo.toml");
    let out = run_within(cmd, Duration::from_secs(60));
    assert!(out.status.success(), "{:?}", text(&out));
    let envs: Vec<Vec<String>> = (0..3)
        .map(|r| {
            std::fs::read_to_string(dir.path().join(format!("env.{r}")))
                .unwrap()
                .split_whitespace()
                .map(str::to_string)
                .collect()
        })
        .collect();
    let topo = std::fs::canonicalize(topo).unwrap();
    for e in &envs {
        assert_eq!(Path::new(&e[4]), topo, "REFIT_TOPOLOGY is absolute");
        assert_eq!(e[5], envs[0][5], "one token for every rank");
        assert_eq!(e[3], envs[0][3], "one port for every rank");
    }
    assert!(envs[0][5].len() >= 32);
    assert_ne!(envs[0][3].parse::<u16>().unwrap(), 0);
}

#[test]
fn a_failing_rank_is_reported_and_the_others_are_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(
        dir.path(),
        "abort",
        r#"echo $$ > "$D/pid.tmp.$RANK"; mv "$D/pid.tmp.$RANK" "$D/pid.$RANK"; if [ "$RANK" = 2 ]; then while [ ! -e "$D/pid.0" ] || [ ! -e "$D/pid.1" ]; do sleep 0.05; done; exit 3; fi; exec sleep 120"#,
    );
    let start = Instant::now();
    let mut launcher = refit()
        .arg("launch")
        .arg(&topo)
        .args(["--grace-s", "2"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr = launcher.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let _ = tx.send(line.unwrap_or_default());
        }
    });
    let pids = [pid_in(dir.path(), 0), pid_in(dir.path(), 1)];
    let mut log = String::new();
    let reported = loop {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(line) => {
                log.push_str(&line);
                log.push('\n');
                if line.contains("rank 2 (actor) failed: it exited with status 3") {
                    break start.elapsed();
                }
            }
            Err(_) => panic!("no report within 10 s: {log}"),
        }
    };
    assert!(reported < Duration::from_secs(30), "{log}");
    let status = launcher.wait().unwrap();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(5)) {
        log.push_str(&line);
        log.push('\n');
    }
    assert_eq!(status.code(), Some(3), "{log}");
    assert!(log.contains("on_failure = \"abort\""), "{log}");
    assert!(
        all_gone(&pids, Duration::from_secs(10)),
        "ranks outlived the run: {log}"
    );
}

#[test]
fn continue_keeps_the_others_running_until_rank_0_finishes() {
    let dir = tempfile::tempdir().unwrap();
    // rank 1 fails; rank 2 waits for that failure, lives on a second, then writes `alive.2`;
    // rank 0 finishes once it sees `alive.2`
    let topo = topology(
        dir.path(),
        "continue",
        r#"echo $$ > "$D/pid.tmp.$RANK"; mv "$D/pid.tmp.$RANK" "$D/pid.$RANK";
case "$RANK" in
  0) while [ ! -e "$D/alive.2" ]; do sleep 0.05; done; echo finished; exit 0 ;;
  1) touch "$D/failing.1"; exit 3 ;;
  2) while [ ! -e "$D/failing.1" ]; do sleep 0.05; done; sleep 1; touch "$D/alive.2"; exec sleep 120 ;;
esac"#,
    );
    let mut cmd = refit();
    cmd.arg("launch").arg(&topo).args(["--grace-s", "1"]);
    let out = run_within(cmd, Duration::from_secs(90));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 1 (actor) failed: it exited with status 3"),
        "{stderr}"
    );
    assert!(stderr.contains("on_failure = \"continue\""), "{stderr}");
    assert!(stdout.contains("[rank 0 learner] finished"), "{stdout}");
    assert!(dir.path().join("alive.2").exists());
    // rank 2 still ran when rank 0 finished: it is stopped after the grace period
    assert!(stderr.contains("stopping rank 2 (actor)"), "{stderr}");
    let pid2 = pid_in(dir.path(), 2);
    assert!(all_gone(&[pid2], Duration::from_secs(10)));
}

#[test]
fn a_bad_topology_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(dir.path(), "abort", "exit 0");
    let text_of = |p: &Path| std::fs::read_to_string(p).unwrap();
    for (from, to, words) in [
        (
            "replicas = 2",
            "replicaz = 2",
            &["process[actor].replicaz", "unknown field"][..],
        ),
        (
            "on_failure = \"abort\"",
            "on_failure = \"abort\"\n[links]\nweights = \"rdma\"",
            &["links.weights", "rdma"][..],
        ),
        (
            "on_failure = \"abort\"",
            "on_failure = \"abort\"\n[links]\nweights = \"inproc\"",
            &["links.weights", "process `actor`"][..],
        ),
    ] {
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, text_of(&topo).replace(from, to)).unwrap();
        let mut cmd = refit();
        cmd.arg("launch").arg(&bad);
        let out = run_within(cmd, Duration::from_secs(30));
        let (_, stderr) = text(&out);
        assert!(!out.status.success());
        for w in words {
            assert!(
                stderr.contains(w) && stderr.contains("bad.toml"),
                "{w}: {stderr}"
            );
        }
        assert!(!stderr.contains("started rank"), "{stderr}");
    }
    let mut cmd = refit();
    cmd.arg("launch").arg(dir.path().join("missing.toml"));
    let out = run_within(cmd, Duration::from_secs(30));
    assert!(!out.status.success());
    assert!(text(&out).1.contains("missing.toml"));
}

/// A topology naming a GPU link (`[links] weights` or a model's `link`) is refused before
/// any rank starts when the binary has no `cuda` feature, with the reason and how to build
/// with it; with the feature it validates and the ranks start.
#[test]
fn a_topology_naming_a_gpu_link_is_refused_without_cuda_saying_how_to_build() {
    let dir = tempfile::tempdir().unwrap();
    let topo = std::fs::read_to_string(topology(dir.path(), "abort", "exit 0")).unwrap();
    for (from, to, key, name) in [
        (
            "on_failure = \"abort\"",
            "on_failure = \"abort\"\n[links]\nweights = \"nccl\"",
            "links.weights",
            "nccl",
        ),
        (
            "id = \"policy\"",
            "id = \"policy\"\nlink = \"cuda-ipc\"",
            "model[policy].link",
            "cuda-ipc",
        ),
    ] {
        let gpu = dir.path().join("gpu.toml");
        std::fs::write(&gpu, topo.replace(from, to)).unwrap();
        let mut cmd = refit();
        cmd.arg("launch").arg(&gpu);
        let out = run_within(cmd, Duration::from_secs(30));
        let (_, stderr) = text(&out);
        if cfg!(feature = "cuda") {
            assert!(out.status.success(), "{stderr}");
            assert!(stderr.contains("started rank"), "{stderr}");
            continue;
        }
        assert!(!out.status.success());
        for w in [
            key,
            &format!("{name} transport: not compiled with CUDA"),
            "--features cuda",
            "gpu.toml",
        ] {
            assert!(stderr.contains(w), "{w}: {stderr}");
        }
        assert!(!stderr.contains("started rank"), "{stderr}");
    }
}

#[test]
fn a_program_that_cannot_start_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(dir.path(), "abort", "exit 0");
    let bad = dir.path().join("bad.toml");
    let toml = std::fs::read_to_string(&topo).unwrap().replacen(
        "[\"sh\", \"-c\",",
        "[\"./no-such-program\",",
        1,
    );
    std::fs::write(&bad, toml).unwrap();
    let mut cmd = refit();
    cmd.current_dir(dir.path()).arg("launch").arg(&bad);
    let out = run_within(cmd, Duration::from_secs(30));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rank 0 (learner): cannot start")
            && stderr.contains(&format!("{}/./no-such-program", dir.path().display())),
        "{stderr}"
    );
}

#[test]
fn one_rank_starts_from_torchrun_variables() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(dir.path(), "abort", &format!("{ENV_SCRIPT}; exit 4"));
    let mut cmd = refit();
    cmd.arg("launch")
        .arg(&topo)
        .env("RANK", "1")
        .env("WORLD_SIZE", "3")
        .env("MASTER_ADDR", "10.9.9.9")
        .env("MASTER_PORT", "4567")
        .env("REFIT_TOKEN", TOKEN);
    let out = run_within(cmd, Duration::from_secs(30));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(4), "the rank's status: {stderr}");
    assert!(stdout.contains("[rank 1 actor] hello from 1"), "{stdout}");
    let env = std::fs::read_to_string(dir.path().join("env.1")).unwrap();
    assert_eq!(
        env.trim(),
        format!("1 3 10.9.9.9 4567 {} {TOKEN}", topo.display())
    );
    assert!(!dir.path().join("env.0").exists() && !dir.path().join("env.2").exists());

    // a world size that is not the topology's is refused, naming the variable
    let mut cmd = refit();
    cmd.arg("launch")
        .arg(&topo)
        .env("RANK", "0")
        .env("WORLD_SIZE", "5");
    let out = run_within(cmd, Duration::from_secs(30));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("`WORLD_SIZE`") && stderr.contains("world size 3"),
        "{stderr}"
    );
    assert!(!dir.path().join("env.0").exists());

    // --rank alone (a per-rank launch needs the shared token: refused without it)
    let mut cmd = refit();
    cmd.arg("launch")
        .arg(&topo)
        .args(["--rank", "2", "--master-port", "999"]);
    let out = run_within(cmd, Duration::from_secs(30));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("`REFIT_TOKEN`") && stderr.contains("REFIT_TOKEN_FILE"),
        "{stderr}"
    );
    assert!(!dir.path().join("env.2").exists());
    let mut cmd = refit();
    cmd.arg("launch")
        .arg(&topo)
        .args(["--rank", "2", "--master-port", "999"])
        .env("REFIT_TOKEN", TOKEN);
    let out = run_within(cmd, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(4));
    let env = std::fs::read_to_string(dir.path().join("env.2")).unwrap();
    assert!(env.starts_with("2 3 127.0.0.1 999 "), "{env}");
}

#[test]
fn one_rank_starts_from_slurm_variables() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(dir.path(), "abort", ENV_SCRIPT);
    let mut cmd = refit();
    cmd.arg("launch")
        .arg(&topo)
        .args(["--master-port", "4000"])
        .env("SLURM_PROCID", "2")
        .env("SLURM_NTASKS", "3")
        .env("SLURM_STEP_NODELIST", "node[07-09],gpu5")
        .env("REFIT_TOKEN", TOKEN);
    let out = run_within(cmd, Duration::from_secs(30));
    assert!(out.status.success(), "{:?}", text(&out));
    let env = std::fs::read_to_string(dir.path().join("env.2")).unwrap();
    assert_eq!(
        env.trim(),
        format!("2 3 node07 4000 {} {TOKEN}", topo.display())
    );

    let mut cmd = refit();
    cmd.arg("launch")
        .arg(&topo)
        .env("SLURM_PROCID", "0")
        .env("SLURM_NTASKS", "3")
        .env("SLURM_STEP_NODELIST", "node[9-1]");
    let out = run_within(cmd, Duration::from_secs(30));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("SLURM_STEP_NODELIST") && stderr.contains("backwards"),
        "{stderr}"
    );
}

/// Starts a launcher whose three ranks write their pid and sleep; returns it and the pids.
fn sleeping_run(dir: &Path) -> (Child, Vec<u32>) {
    let topo = topology(
        dir,
        "abort",
        r#"echo $$ > "$D/pid.tmp.$RANK"; mv "$D/pid.tmp.$RANK" "$D/pid.$RANK"; exec sleep 120"#,
    );
    let launcher = refit()
        .arg("launch")
        .arg(&topo)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pids = (0..3).map(|r| pid_in(dir, r)).collect::<Vec<_>>();
    assert!(pids.iter().all(|p| alive(*p)));
    (launcher, pids)
}

#[test]
fn no_rank_outlives_a_sigkilled_launcher() {
    let dir = tempfile::tempdir().unwrap();
    let (mut launcher, pids) = sleeping_run(dir.path());
    launcher.kill().unwrap(); // SIGKILL: no handler runs; the kernel's parent-death signal does
    launcher.wait().unwrap();
    assert!(
        all_gone(&pids, Duration::from_secs(10)),
        "orphans: {pids:?}"
    );
}

#[test]
fn sigterm_to_the_launcher_stops_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (mut launcher, pids) = sleeping_run(dir.path());
    let status = Command::new("kill")
        .args(["-TERM", &launcher.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = launcher.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the launcher hangs"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(143), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(
        all_gone(&pids, Duration::from_secs(10)),
        "orphans: {pids:?}"
    );
}

#[test]
fn ranks_meet_at_the_store_rank_0_serves() {
    // the example, named by a path relative to the directory `refit launch` runs in
    let exe = common::example("topology_rank");
    let cwd = exe.parent().unwrap().parent().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let topo = dir.path().join("ranks.toml");
    let toml = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/topologies/ranks.toml"),
    )
    .unwrap()
    .replace(
        "target/debug/examples/topology_rank",
        "examples/topology_rank",
    );
    std::fs::write(&topo, toml).unwrap();
    let mut cmd = refit();
    cmd.current_dir(cwd).arg("launch").arg(&topo);
    let out = run_within(cmd, Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for (rank, name) in [(0, "learner"), (1, "actor"), (2, "actor"), (3, "judge")] {
        assert!(
            stdout.contains(&format!("[rank 0 learner] rank {rank}: {name} checked in")),
            "{stdout}"
        );
    }
    assert!(stdout.contains("[rank 0 learner] process `learner` copy 0 on host `local` (127.0.0.1), roles trainer+controller+evaluator; weights from rank 0 over inproc"), "{stdout}");
    assert!(stdout.contains("[rank 2 actor] process `actor` copy 1 on host `local` (127.0.0.1), roles engine+rollout; weights from rank 0 over shm"), "{stdout}");

    // the ranks load the topology with the launch's overrides: a fifth rank, weights over tcp
    let mut cmd = refit();
    cmd.current_dir(cwd).arg("launch").arg(&topo).args([
        "--set",
        "process.judge.replicas=2",
        "--set",
        "links.weights=tcp",
    ]);
    let out = run_within(cmd, Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("[rank 0 learner] rank 4: judge checked in"),
        "{stdout}"
    );
    assert!(stdout.contains("[rank 4 judge] process `judge` copy 1 on host `local` (127.0.0.1), roles engine; weights from rank 0 over tcp"), "{stdout}");
}

/// Each rank writes `$D/vars.$RANK`: the variables the launcher adds beside the four of
/// torchrun, one per line, as `NAME=value`.
const VARS_SCRIPT: &str = r#"{ echo "WORLD_SIZE=$WORLD_SIZE"; echo "LOCAL_RANK=$LOCAL_RANK"; echo "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE"; echo "REFIT_INCARNATION=$REFIT_INCARNATION"; echo "GREETING=$GREETING"; echo "REFIT_SET<<"; printf '%s\n' "$REFIT_SET"; echo ">>"; } > "$D/vars.tmp.$RANK"; mv "$D/vars.tmp.$RANK" "$D/vars.$RANK""#;

fn vars(dir: &Path, rank: u32) -> String {
    std::fs::read_to_string(dir.join(format!("vars.{rank}"))).unwrap()
}

#[test]
fn set_overrides_reach_every_rank_and_local_ranks_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(dir.path(), "abort", VARS_SCRIPT);
    let mut cmd = refit();
    cmd.arg("launch")
        .arg(&topo)
        .args(["--set", "process.actor.replicas=3"])
        .args(["--set", "sync.sync_mode = fully-async"])
        .args(["--set", "stop.max_time_s=30"]);
    let out = run_within(cmd, Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // the override made four ranks out of three
    assert!(stderr.contains("4 ranks from"), "{stderr}");
    for rank in 0..4 {
        let v = vars(dir.path(), rank);
        assert!(v.contains("WORLD_SIZE=4\n"), "rank {rank}: {v}");
        assert!(
            v.contains(&format!("LOCAL_RANK={rank}\n")),
            "rank {rank}: {v}"
        );
        assert!(v.contains("LOCAL_WORLD_SIZE=4\n"), "rank {rank}: {v}");
        assert!(v.contains("REFIT_INCARNATION=0\n"), "rank {rank}: {v}");
        assert!(
            v.contains(
                "REFIT_SET<<\nprocess.actor.replicas=3\nsync.sync_mode=fully-async\nstop.max_time_s=30\n>>"
            ),
            "rank {rank}: {v}"
        );
    }
}

#[test]
fn a_bad_override_is_refused_naming_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(dir.path(), "abort", VARS_SCRIPT);
    for (set, words) in [
        (
            "process.actro.replicas=3",
            &[
                "process.actro.replicas",
                "no entry `actro`",
                "learner, actor",
            ][..],
        ),
        (
            "sync.sync_mode=eventually",
            &["sync.sync_mode", "eventually", "override"][..],
        ),
        (
            "process.actor.replicas=0",
            &["process[actor].replicas", "replicas = 0", "topo.toml"][..],
        ),
        ("links.weights=rdma", &["links.weights", "rdma"][..]),
        ("replicas", &["`replicas`", "not `key=value`"][..]),
    ] {
        let mut cmd = refit();
        cmd.arg("launch").arg(&topo).args(["--set", set]);
        let out = run_within(cmd, Duration::from_secs(30));
        let (_, stderr) = text(&out);
        assert!(!out.status.success(), "{set}: {stderr}");
        for w in words {
            assert!(stderr.contains(w), "{set}: {w}: {stderr}");
        }
        assert!(!stderr.contains("started rank"), "{stderr}");
    }
    assert!(!dir.path().join("vars.0").exists());
}

#[test]
fn a_process_runs_its_own_command_with_its_own_environment() {
    let dir = tempfile::tempdir().unwrap();
    // rank 0 runs `[run] command` (VARS_SCRIPT); the actors their own, which writes a
    // different file
    let own = format!(
        r#"command = ["sh", "-c", "echo \"$GREETING $*\" > '{}'/own.$RANK", "sh", "one", "two"]
env = {{ GREETING = "hi there" }}"#,
        dir.path().display()
    );
    let topo = topology_with(dir.path(), "abort", VARS_SCRIPT, &own);
    let mut cmd = refit();
    cmd.arg("launch").arg(&topo);
    let out = run_within(cmd, Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        vars(dir.path(), 0).contains("GREETING=\n"),
        "the env is the actor's only"
    );
    for rank in [1, 2] {
        let own = std::fs::read_to_string(dir.path().join(format!("own.{rank}"))).unwrap();
        assert_eq!(own, "hi there one two\n", "rank {rank}");
        assert!(!dir.path().join(format!("vars.{rank}")).exists());
    }
}

/// Rank 2 appends its incarnation to `$D/starts.2` and then does what `$D/plan.2` says for
/// that incarnation (`kill`: SIGKILL itself, `fail`: exit 3, else exit 0 and mark
/// `done.2`); rank 1 sleeps; rank 0 waits for `done.2` (or sleeps until stopped).
const RESTART_SCRIPT: &str = r#"echo $$ > "$D/pid.tmp.$RANK"; mv "$D/pid.tmp.$RANK" "$D/pid.$RANK";
case "$RANK" in
  0) while [ ! -e "$D/done.2" ]; do sleep 0.05; done
     if [ -e "$D/lead.fails" ]; then echo "error: the run ended unsolved" >&2; exit 1; fi
     echo finished; exit 0 ;;
  1) exec sleep 120 ;;
  2) echo "$REFIT_INCARNATION" >> "$D/starts.2"
     what=$(sed -n "$((REFIT_INCARNATION + 1))p" "$D/plan.2")
     case "$what" in
       kill) kill -9 $$ ;;
       fail) exit 3 ;;
       *) touch "$D/done.2"; exit 0 ;;
     esac ;;
esac"#;

/// Rank 2 fails saying rank 0 is gone; rank 0 ends with its own error a moment later.
const LEAD_FAILS_LAST: &str = r#"case "$RANK" in
  0) while [ ! -e "$D/gone.2" ]; do sleep 0.02; done; sleep 0.2
     echo "error: the lead's own cause" >&2; exit 1 ;;
  1) exec sleep 120 ;;
  2) sleep 0.3; touch "$D/gone.2"; echo "error: rank 0 is gone" >&2; exit 1 ;;
esac"#;

/// A rank that fails because the lead has just ended is not the run's cause: the launcher
/// gives the lead a moment to end on its own before stopping it, and names it.
#[test]
fn a_lead_that_fails_just_after_another_rank_is_the_runs_cause() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology_with(dir.path(), "abort", LEAD_FAILS_LAST, "");
    let mut cmd = refit();
    cmd.arg("launch").arg(&topo).args(["--grace-s", "1"]);
    let out = run_within(cmd, Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 2 (actor) failed: it exited with status 1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("[rank 0 learner] error: the lead's own cause"),
        "{stderr}"
    );
    assert_eq!(
        stderr.lines().last(),
        Some("refit launch: error: rank 0 (learner) failed: the lead's own cause"),
        "{stderr}"
    );
}

fn starts(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("starts.2"))
        .unwrap()
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect()
}

/// `refit launch` of the restart script, rank 2 restarted on failure up to `max_restarts`
/// times and doing at each start what the next line of `plan` says; the lead fails at the
/// end when `lead_fails`. Answers the run's folder, output, stdout and stderr.
fn launch_restarts(
    plan: &str,
    max_restarts: u32,
    lead_fails: bool,
) -> (tempfile::TempDir, Output, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology_with(
        dir.path(),
        "abort",
        RESTART_SCRIPT,
        &format!("restart = \"on-failure\"\nmax_restarts = {max_restarts}"),
    );
    std::fs::write(dir.path().join("plan.2"), plan).unwrap();
    if lead_fails {
        std::fs::write(dir.path().join("lead.fails"), "").unwrap();
    }
    let mut cmd = refit();
    cmd.arg("launch").arg(&topo).args(["--grace-s", "1"]);
    let out = run_within(cmd, Duration::from_secs(90));
    let (stdout, stderr) = text(&out);
    (dir, out, stdout, stderr)
}

#[test]
fn a_failed_rank_is_restarted_with_the_next_incarnation() {
    // killed by a signal, then a failing exit, then a success: two restarts
    let (dir, out, stdout, stderr) = launch_restarts("kill\nfail\nok\n", 2, false);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_eq!(starts(dir.path()), [0, 1, 2], "{stderr}");
    assert!(
        stderr.contains("rank 2 (actor) failed: it was killed by signal 9 (SIGKILL)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("restarted rank 2 (actor) (restart 1 of 2, REFIT_INCARNATION=1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rank 2 (actor) failed: it exited with status 3"),
        "{stderr}"
    );
    assert!(
        stderr.contains("restarted rank 2 (actor) (restart 2 of 2, REFIT_INCARNATION=2"),
        "{stderr}"
    );
    assert!(stdout.contains("[rank 0 learner] finished"), "{stdout}");
    // rank 1 of the same process never failed: started once
    assert_eq!(
        stderr.matches("started rank 1 (actor)").count(),
        1,
        "{stderr}"
    );
    assert!(!stderr.contains("restarted rank 1"), "{stderr}");
}

/// A run that ends badly names what ended it, not a rank a restart made good before.
#[test]
fn a_failed_run_names_its_cause_not_a_rank_restarted_before() {
    let (dir, out, stdout, stderr) = launch_restarts("kill\nok\n", 1, true);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert_eq!(starts(dir.path()), [0, 1], "{stderr}");
    assert!(
        stderr.contains("refit launch: error: rank 0 (learner) failed: the run ended unsolved"),
        "{stderr}"
    );
    assert!(!stderr.contains("refit launch: error: rank 2"), "{stderr}");
}

#[test]
fn restarts_stop_at_the_limit_and_on_failure_decides() {
    let (dir, out, stdout, stderr) = launch_restarts("fail\nfail\nfail\nok\n", 2, false);
    // the first start and two restarts, no third: the run is aborted with the rank's status
    assert_eq!(starts(dir.path()), [0, 1, 2], "{stderr}");
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 2 (actor) has no restart left (max_restarts = 2)"),
        "{stderr}"
    );
    assert!(stderr.contains("on_failure = \"abort\""), "{stderr}");
    assert!(!dir.path().join("done.2").exists());
    let pids = [pid_in(dir.path(), 0), pid_in(dir.path(), 1)];
    assert!(all_gone(&pids, Duration::from_secs(10)), "{stderr}");
}

#[test]
fn a_per_rank_launch_restarts_its_rank_from_the_schedulers_count() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology_with(
        dir.path(),
        "abort",
        RESTART_SCRIPT,
        "restart = \"on-failure\"\nmax_restarts = 1",
    );
    // the scheduler restarted this task 4 times already: the rank starts as incarnation 4
    std::fs::write(dir.path().join("plan.2"), "\n\n\n\nfail\nok\n").unwrap();
    let mut cmd = refit();
    cmd.arg("launch")
        .arg(&topo)
        .args(["--rank", "2"])
        .env("REFIT_TOKEN", TOKEN)
        .env("SLURM_RESTART_COUNT", "4");
    let out = run_within(cmd, Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_eq!(starts(dir.path()), [4, 5], "{stderr}");
    assert!(stderr.contains("incarnation 4"), "{stderr}");
    assert!(
        stderr.contains("restarted rank 2 (actor) (restart 1 of 1, REFIT_INCARNATION=5"),
        "{stderr}"
    );
}

#[test]
fn launch_help_names_every_flag_and_variable() {
    let out = run_within(
        {
            let mut c = refit();
            c.args(["launch", "--help"]);
            c
        },
        Duration::from_secs(30),
    );
    let (stdout, _) = text(&out);
    assert!(out.status.success());
    for word in [
        "--set <KEY=VALUE>",
        "--master-port",
        "--rank",
        "--grace-s",
        "--metrics-addr",
        "--status-addr",
        "RANK, WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_STEP_NODELIST",
        "REFIT_TOKEN_FILE",
        "SLURM_RESTART_COUNT",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "REFIT_TOPOLOGY",
        "REFIT_SET",
        "REFIT_INCARNATION",
        "REFIT_METRICS_ADDR",
        "REFIT_LOG_FORMAT",
    ] {
        assert!(stdout.contains(word), "{word} missing from: {stdout}");
    }
}

/// The launcher's reports are `tracing` events: with `REFIT_LOG_FORMAT=json` each is one
/// JSON object per line (level, target, message), and `RUST_LOG` filters them by target
/// (at `warn`, the ranks starting and ending well are not reported; a failure still is).
#[test]
fn launcher_reports_follow_rust_log_and_the_json_log_format() {
    let dir = tempfile::tempdir().unwrap();
    // rank 0 ends last: the run ends with it, after rank 2's failure was reported
    let topo = topology(
        dir.path(),
        "continue",
        "[ \"$RANK\" = 2 ] && exit 3; [ \"$RANK\" = 0 ] && sleep 1; exit 0",
    );
    let launch = |vars: &[(&str, &str)]| {
        let mut cmd = refit();
        cmd.arg("launch").arg(&topo).env_remove("RUST_LOG");
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let out = run_within(cmd, Duration::from_secs(60));
        text(&out).1
    };
    let stderr = launch(&[("REFIT_LOG_FORMAT", "json")]);
    let started: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("started rank"))
        .collect();
    assert_eq!(started.len(), 3, "{stderr}");
    for line in started {
        assert!(
            line.starts_with('{')
                && line.ends_with('}')
                && line.contains(r#""level":"INFO""#)
                && line.contains(r#""target":"refit_node::launch::supervise""#)
                && line.contains(r#""message":"started rank "#),
            "{line}"
        );
    }
    let failed = stderr
        .lines()
        .find(|l| l.contains("rank 2 (actor) failed: it exited with status 3"))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(failed.contains(r#""level":"ERROR""#), "{failed}");
    // the default format is text; RUST_LOG at warn for the launcher keeps only the failure
    let stderr = launch(&[("RUST_LOG", "warn,refit_node::launch=warn")]);
    assert!(!stderr.contains("started rank"), "{stderr}");
    assert!(
        stderr.lines().any(|l| l.contains("ERROR")
            && l.contains("rank 2 (actor) failed: it exited with status 3")
            && !l.starts_with('{')),
        "{stderr}"
    );
    // a format that is not known is said, and text is used
    let stderr = launch(&[("REFIT_LOG_FORMAT", "yaml")]);
    assert!(
        stderr.contains("ignoring REFIT_LOG_FORMAT=\"yaml\"") && stderr.contains("started rank"),
        "{stderr}"
    );
}

/// `refit launch --status-addr`: `refit status` lists every rank with its state — a failed
/// one with how it ended, running ones whose metrics page does not answer (these ranks
/// serve none) as unreachable — and names an address where no launch answers.
#[test]
fn status_lists_every_rank_with_its_state_and_health() {
    let dir = tempfile::tempdir().unwrap();
    let topo = topology(
        dir.path(),
        "continue",
        "[ \"$RANK\" = 2 ] && exit 3; sleep 20",
    );
    let mut cmd = refit();
    cmd.arg("launch")
        .arg(&topo)
        .args(["--status-addr", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut addr = None;
    let mut failed = false;
    while addr.is_none() || !failed {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .expect("the launcher said where its status is");
        if let Some(rest) = line.split("status: http://").nth(1) {
            addr = rest.split('/').next().map(str::to_owned);
        }
        failed |= line.contains("rank 2 (actor) failed");
    }
    let addr = addr.unwrap();
    let out = run_within(
        {
            let mut c = refit();
            c.args(["status", &addr]);
            c
        },
        Duration::from_secs(30),
    );
    let (table, err) = text(&out);
    assert!(out.status.success(), "{err}");
    let rows: Vec<Vec<&str>> = table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 3, "{table}");
    for (rank, row) in rows.iter().enumerate() {
        assert_eq!(row[0], rank.to_string(), "{table}");
        let (state, health) = if rank == 2 {
            ("failed", "failed")
        } else {
            ("running", "unreachable")
        };
        assert_eq!((row[3], row[5]), (state, health), "{table}");
    }
    // how rank 2 ended, in the JSON
    let out = run_within(
        {
            let mut c = refit();
            c.args(["status", "--json", &addr]);
            c
        },
        Duration::from_secs(30),
    );
    let (json, err) = text(&out);
    assert!(out.status.success(), "{err}");
    assert!(json.contains("exited with status 3"), "{json}");
    // the ranks die with their launcher
    let _ = child.kill();
    let _ = child.wait();
    // where nothing answers
    let out = run_within(
        {
            let mut c = refit();
            c.args(["status", "127.0.0.1:1", "--timeout", "2"]);
            c
        },
        Duration::from_secs(30),
    );
    let (_, err) = text(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("cannot reach the launch's status at 127.0.0.1:1 (connection refused)")
            && err.contains("--status-addr"),
        "{err}"
    );
}
