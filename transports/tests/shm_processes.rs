//! Shared memory across real processes: this test binary re-runs itself as the other side
//! (`REFIT_CHILD_ROLE`), so readers and writers live in separate address spaces.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use refit_runtime::{Error, Receiver, ReceiverInit, SenderInit, Version, wire};
use refit_transports::shm::{ShmConfig, ShmReadMode, ShmReceiver, ShmReceiverSpec, ShmSender};

const ROLE: &str = "REFIT_CHILD_ROLE";
const SPEC: &str = "REFIT_CHILD_SPEC";
const T: Duration = Duration::from_secs(20);

/// The lease of the pid-namespace tests: death is told by the heartbeat alone.
const NS_LEASE: Duration = Duration::from_millis(500);

/// Runs the child in a new pid namespace (`unshare --pid --fork`; with a user namespace
/// when not root), stdin piped: its pid there (1) means nothing here.
fn spawn_child_in_pid_ns(role: &str, spec: &ShmReceiverSpec) -> Child {
    // SAFETY: geteuid has no preconditions and touches no memory.
    let root = unsafe { libc::geteuid() } == 0;
    let mut cmd = Command::new("unshare");
    if !root {
        cmd.args(["--user", "--map-root-user"]);
    }
    cmd.args(["--pid", "--fork"])
        .arg(std::env::current_exe().unwrap())
        .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(SPEC, wire::to_token(spec).unwrap())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("`unshare` (util-linux) runs the pid-namespace tests")
}

/// Waits (bounded) for a process that is not our child to be gone or a zombie.
fn wait_gone(pid: u32) {
    let t = Instant::now();
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.trim_start().chars().next());
        if state.is_none_or(|c| c == 'Z' || c == 'X') {
            return;
        }
        assert!(t.elapsed() < T, "process {pid} still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn spawn_child(role: &str, spec: &ShmReceiverSpec) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(SPEC, wire::to_token(spec).unwrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Reads the child's stdout lines (libtest prints its own first) until `pick` accepts the last
/// word of one.
fn read_line_where<T>(child: &mut Child, pick: impl Fn(&str) -> Option<T>) -> T {
    use std::io::BufRead;
    let stdout = child.stdout.as_mut().unwrap();
    let mut reader = std::io::BufReader::new(stdout);
    loop {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "child closed stdout"
        );
        // libtest may print "test child_entry ... " on the same line first
        let last = line.split_whitespace().last().unwrap_or("");
        if let Some(v) = pick(last) {
            return v;
        }
    }
}

fn finish(child: Child) -> String {
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "child failed: {text}");
    text
}

/// Entry point of the child processes; a no-op in a normal test run.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let spec: ShmReceiverSpec = wire::from_token(&std::env::var(SPEC).unwrap()).unwrap();
    match role.as_str() {
        "reader-copy" | "reader-zero" => {
            let mode = if role == "reader-copy" {
                ShmReadMode::Copy
            } else {
                ShmReadMode::ZeroCopy
            };
            let mut r = ReceiverInit::new(ShmReceiver::new(spec).with_mode(mode), None)
                .connect(T)
                .unwrap();
            let p = id("policy");
            let mut applied = 1u64;
            let mut checked = 0u64;
            loop {
                match r.receive(T) {
                    Ok(Some(u)) => {
                        for w in &u.group {
                            check_stamp(w).unwrap();
                            checked += w.manifest().len() as u64;
                        }
                        applied += 1;
                    }
                    Ok(None) => panic!("no update within {T:?}"),
                    Err(Error::PeerGone { .. }) => break,
                    Err(e) => panic!("{e}"),
                }
                // the served weights are whole, even while the writer runs ahead
                check_stamp(&r.current(&p).unwrap()).unwrap();
            }
            println!(
                "applied={applied} last={} tensors_checked={checked}",
                r.version(&p).get()
            );
        }
        "reader-hold" => {
            // reads in place (the default) and keeps each version for a while, the two
            // newest alive at once, checking their bytes when taken and when let go
            let mut r = ReceiverInit::new(ShmReceiver::new(spec), None)
                .connect(T)
                .unwrap();
            let p = id("policy");
            let mut kept = std::collections::VecDeque::new();
            let mut applied = 1u64;
            loop {
                match r.receive(T) {
                    Ok(Some(u)) => {
                        let w = std::sync::Arc::clone(&u.group[0]);
                        check_stamp(&w).unwrap();
                        applied += 1;
                        std::thread::sleep(Duration::from_micros(300 * (applied % 4)));
                        kept.push_back(w);
                        if kept.len() > 2 {
                            check_stamp(&kept.pop_front().unwrap()).unwrap();
                        }
                        for w in &kept {
                            check_stamp(w).unwrap();
                        }
                    }
                    Ok(None) => panic!("no update within {T:?}"),
                    Err(Error::PeerGone { .. }) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            println!(
                "applied={applied} copied={} last={}",
                r.transport().versions_copied(),
                r.version(&p).get()
            );
        }
        "reader-count" => {
            // the default read of the link factory; says how many versions it copied
            let mut r = ReceiverInit::new(ShmReceiver::new(spec), None)
                .connect(T)
                .unwrap();
            let p = id("policy");
            loop {
                match r.receive(T) {
                    Ok(Some(u)) => check_stamp(&u.group[0]).unwrap(),
                    Ok(None) => panic!("no update within {T:?}"),
                    Err(Error::PeerGone { .. }) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            println!(
                "copied={} last={}",
                r.transport().versions_copied(),
                r.version(&p).get()
            );
        }
        "crash-sender" => {
            let m = manifest(4096);
            let ms = manifests(&[("policy", &m)]);
            let cfg = ShmConfig {
                dir: spec.board.parent().unwrap().to_path_buf(),
                expected_receivers: 1,
                ..ShmConfig::default()
            };
            let sender = ShmSender::create(&cfg, &ms).unwrap();
            // tell the parent where the board is
            println!("{}", wire::to_token(&sender.receiver_spec()).unwrap());
            let mut s = SenderInit::new(sender, ms)
                .connect(vec![stamped("policy", &m, 1)], T)
                .unwrap();
            for v in 2..=5 {
                s.send(stamped("policy", &m, v)).unwrap();
            }
            s.transport_mut().crash_mid_write(&stamped("policy", &m, 6));
        }
        "pin-and-hang" => {
            let mut r = ReceiverInit::new(
                ShmReceiver::new(spec).with_mode(ShmReadMode::ZeroCopy),
                None,
            )
            .connect(T)
            .unwrap();
            let _ = r.receive(Duration::ZERO);
            println!("pinned");
            std::thread::sleep(Duration::from_secs(60));
        }
        "hold-slots" => {
            // a sender holding 3 slots per model, with a receiver process of its own, until
            // a signal ends it
            refit_node::signals::install_signal_handlers().unwrap();
            let m = manifest(4096);
            let ms = manifests(&[("policy", &m), ("critic", &m)]);
            let cfg = ShmConfig {
                dir: spec.board.parent().unwrap().to_path_buf(),
                slots: 3,
                expected_receivers: 1,
                ..ShmConfig::default()
            };
            let sender = ShmSender::create(&cfg, &ms).unwrap();
            let paths = sender.segment_paths();
            // this process ends on the signal, before it could wait for the reader, which
            // then leaves on its own and is reaped by its new parent
            #[expect(clippy::zombie_processes, reason = "ends on a signal, never waits")]
            let reader = spawn_child("reader-copy", &sender.receiver_spec());
            let mut s = SenderInit::new(sender, ms)
                .connect(vec![stamped("policy", &m, 1), stamped("critic", &m, 1)], T)
                .unwrap();
            for v in 2..=3 {
                s.send_group(vec![stamped("policy", &m, v), stamped("critic", &m, v)])
                    .unwrap();
            }
            let paths: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            println!("held={},{}", reader.id(), paths.join(","));
            std::thread::sleep(T * 3);
            panic!("no signal came");
        }
        "ns-sender" => {
            // a sender that dies without cleaning up when the parent says so
            let m = manifest(4096);
            let ms = manifests(&[("policy", &m)]);
            let cfg = ShmConfig {
                dir: spec.board.parent().unwrap().to_path_buf(),
                expected_receivers: 1,
                lease: NS_LEASE,
                ..ShmConfig::default()
            };
            let sender = ShmSender::create(&cfg, &ms).unwrap();
            println!("{}", wire::to_token(&sender.receiver_spec()).unwrap());
            let mut s = SenderInit::new(sender, ms)
                .connect(vec![stamped("policy", &m, 1)], T)
                .unwrap();
            s.send(stamped("policy", &m, 2)).unwrap();
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            std::process::exit(3);
        }
        "ns-pinner" => {
            let r = ReceiverInit::new(
                ShmReceiver::new(spec).with_mode(ShmReadMode::ZeroCopy),
                None,
            )
            .connect(T)
            .unwrap();
            let _kept = r.current(&id("policy")).unwrap();
            println!("pinned");
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            std::process::exit(3);
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn no_torn_reads_across_processes() {
    let m = manifest(16 * 1024); // ~400 KiB per version
    let ms = manifests(&[("policy", &m)]);
    let cfg = ShmConfig {
        expected_receivers: 2,
        ..ShmConfig::default()
    };
    let sender = ShmSender::create(&cfg, &ms).unwrap();
    let spec = sender.receiver_spec();
    let readers = [
        spawn_child("reader-copy", &spec),
        spawn_child("reader-zero", &spec),
    ];
    let mut s = SenderInit::new(sender, ms)
        .with_ack_timeout(T)
        .connect(vec![stamped("policy", &m, 1)], T)
        .unwrap();
    const VERSIONS: u64 = 1200;
    for v in 2..=VERSIONS {
        // publish without waiting, so the writer races the readers; wait every 100 versions
        let pending = s.send_async(vec![stamped("policy", &m, v)]).unwrap();
        if v % 100 == 0 || v == VERSIONS {
            s.wait(&pending, T).unwrap();
        }
    }
    s.shutdown().unwrap();
    for r in readers {
        let out = finish(r);
        assert!(out.contains(&format!("last={VERSIONS}")), "{out}");
    }
}

/// The last `key=` number a child printed.
fn printed(out: &str, key: &str) -> u64 {
    out.split_whitespace()
        .filter_map(|w| w.strip_prefix(key))
        .next_back()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {out}"))
}

#[test]
fn readers_of_pinned_slots_never_see_a_torn_version_while_the_sender_runs_flat_out() {
    readers_never_see_a_torn_version(16 * 1024, 1500); // ~400 KiB per version
}

/// As above with versions of ~8.8 MiB, which the sender writes with streaming stores across
/// its copy threads (`refit_runtime::copy::STREAM_FROM`): they too are whole when a reader
/// takes them.
#[test]
fn readers_never_see_a_torn_version_of_a_streamed_copy() {
    let hidden = 320 * 1024;
    assert!(28 * hidden >= refit_runtime::copy::STREAM_FROM);
    readers_never_see_a_torn_version(hidden, 60);
}

/// Three readers hold versions while the sender publishes `versions` of a model of
/// `hidden` units as fast as it can; each reader checks every version it holds, when it
/// takes it and when it lets it go.
fn readers_never_see_a_torn_version(hidden: usize, versions: u64) {
    let m = manifest(hidden);
    let ms = manifests(&[("policy", &m)]);
    let cfg = ShmConfig {
        expected_receivers: 3,
        ..ShmConfig::default()
    };
    let sender = ShmSender::create(&cfg, &ms).unwrap();
    let spec = sender.receiver_spec();
    let readers: Vec<Child> = (0..3).map(|_| spawn_child("reader-hold", &spec)).collect();
    let mut s = SenderInit::new(sender, ms)
        .with_ack_timeout(T)
        .connect(vec![stamped("policy", &m, 1)], T)
        .unwrap();
    // never waiting for a reader: every version is written while readers hold older ones
    let mut last = None;
    for v in 2..=versions {
        last = Some(s.send_async(vec![stamped("policy", &m, v)]).unwrap());
    }
    s.wait(&last.unwrap(), T).unwrap();
    let slots = s.transport().slots_in_use(&id("policy")).unwrap();
    s.shutdown().unwrap();
    assert!((3..=5).contains(&slots), "{slots}");
    let mut in_place = 0;
    for r in readers {
        let out = finish(r);
        assert_eq!(printed(&out, "last="), versions, "{out}");
        in_place += printed(&out, "applied=") - printed(&out, "copied=");
    }
    assert!(in_place > 0, "no version was read in place");
}

#[test]
fn a_reader_holding_its_version_delays_no_other_reader() {
    let m = manifest(4096);
    let ms = manifests(&[("policy", &m)]);
    let cfg = ShmConfig {
        expected_receivers: 3,
        ..ShmConfig::default()
    };
    let sender = ShmSender::create(&cfg, &ms).unwrap();
    let spec = sender.receiver_spec();
    // one reader process takes version 1 and holds it (never receives again); two readers,
    // threads here, take every version and say so
    let mut slow = spawn_child("pin-and-hang", &spec);
    let (tx, rx) = std::sync::mpsc::channel();
    const LAST: u64 = 30;
    let fast: Vec<_> = (0..2)
        .map(|i| {
            let (spec, tx) = (spec.clone(), tx.clone());
            std::thread::spawn(move || {
                let mut r = ReceiverInit::new(ShmReceiver::new(spec), None)
                    .connect(T)
                    .unwrap();
                while r.version(&id("policy")) < Version(LAST) {
                    if let Some(u) = r.receive(T).unwrap() {
                        check_stamp(&u.group[0]).unwrap();
                        tx.send((i, u.group[0].version().get())).unwrap();
                    }
                }
            })
        })
        .collect();
    let mut s = SenderInit::new(sender, ms)
        .with_ack_timeout(T)
        .connect(vec![stamped("policy", &m, 1)], T)
        .unwrap();
    read_line_where(&mut slow, |l| (l == "pinned").then_some(()));
    // a publish that waited for the held slot would miss this deadline: the slow reader
    // never lets version 1 go
    s.set_ack_timeout(Duration::from_millis(500));
    let mut longest = Duration::ZERO;
    for v in 2..=LAST {
        let t = Instant::now();
        let _slow_never_acks = s.send_async(vec![stamped("policy", &m, v)]).unwrap();
        let mut got = [false; 2];
        while got != [true; 2] {
            let (i, seen) = rx.recv_timeout(T).expect("a fast reader stalled");
            assert_eq!(seen, v, "fast reader {i}");
            got[i] = true;
        }
        longest = longest.max(t.elapsed());
    }
    for h in fast {
        h.join().unwrap();
    }
    // the held version cost one slot, once; the slow reader was told it is behind
    assert_eq!(s.transport().slots_in_use(&id("policy")).unwrap(), 4);
    assert!(s.transport().behind_marks() >= 1);
    // a liveness bound for a loaded machine, not a speed figure (`refit bench` has those)
    assert!(longest < Duration::from_secs(5), "{longest:?}");
    slow.kill().unwrap();
    slow.wait().unwrap();
    s.shutdown().unwrap();
}

#[test]
fn n_receiver_processes_read_one_copy() {
    let m = manifest(64 * 1024); // ~1.5 MiB per version
    let ms = manifests(&[("policy", &m)]);
    let cfg = ShmConfig {
        expected_receivers: 4,
        ..ShmConfig::default()
    };
    let sender = ShmSender::create(&cfg, &ms).unwrap();
    let spec = sender.receiver_spec();
    let readers: Vec<Child> = (0..4).map(|_| spawn_child("reader-count", &spec)).collect();
    let mut s = SenderInit::new(sender, ms)
        .with_ack_timeout(T)
        .connect(vec![stamped("policy", &m, 1)], T)
        .unwrap();
    for v in 2..=10 {
        s.send(stamped("policy", &m, v)).unwrap();
    }
    s.shutdown().unwrap();
    // the sender wrote each version once; no receiver copied one
    for r in readers {
        let out = finish(r);
        assert_eq!(printed(&out, "last="), 10, "{out}");
        assert_eq!(printed(&out, "copied="), 0, "{out}");
    }
}

/// A `crash-sender` child (it aborts in the middle of a write) and a receiver connected to
/// it, with the folder the child is pointed at (its segments go there).
fn connect_to_crash_sender() -> (
    tempfile::TempDir,
    Child,
    ShmReceiverSpec,
    Receiver<ShmReceiver>,
) {
    let dir = tempfile::tempdir().unwrap();
    let placeholder = ShmReceiverSpec {
        board: dir.path().join("unused"),
    };
    let mut child = spawn_child("crash-sender", &placeholder);
    let spec: ShmReceiverSpec = read_line_where(&mut child, |l| wire::from_token(l).ok());
    let r = ReceiverInit::new(ShmReceiver::new(spec.clone()), None)
        .connect(T)
        .unwrap();
    (dir, child, spec, r)
}

#[test]
fn crashed_sender_leaves_readers_whole() {
    let (dir, mut child, spec, mut r) = connect_to_crash_sender();
    let p = id("policy");
    let t = Instant::now();
    let err = loop {
        match r.receive(T) {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("no word from the sender within {T:?}"),
            Err(e) => break e,
        }
    };
    assert!(matches!(err, Error::PeerGone { .. }), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10));
    let status = child.wait().unwrap();
    assert!(!status.success(), "the sender was meant to crash");
    // the half-written version 6 never became visible: version 5 is served whole
    assert_eq!(r.version(&p), Version(5));
    check_stamp(&r.current(&p).unwrap()).unwrap();
    // a reader attaching after the crash also sees version 5 whole, then learns of the death
    let mut late = ReceiverInit::new(ShmReceiver::new(spec), None)
        .connect(T)
        .unwrap();
    assert_eq!(late.version(&p), Version(5));
    check_stamp(&late.current(&p).unwrap()).unwrap();
    assert!(matches!(late.receive(T), Err(Error::PeerGone { .. })));
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
}

#[test]
fn killed_receiver_does_not_block_the_sender() {
    let m = manifest(64);
    let ms = manifests(&[("policy", &m)]);
    let cfg = ShmConfig {
        expected_receivers: 1,
        ..ShmConfig::default()
    };
    let sender = ShmSender::create(&cfg, &ms).unwrap();
    let spec = sender.receiver_spec();
    let mut child = spawn_child("pin-and-hang", &spec);
    let mut s = SenderInit::new(sender, ms)
        .with_ack_timeout(T)
        .connect(vec![stamped("policy", &m, 1)], T)
        .unwrap();
    read_line_where(&mut child, |l| (l == "pinned").then_some(()));
    child.kill().unwrap();
    child.wait().unwrap();
    let t = Instant::now();
    // the dead reader's pins and ack debt are reaped: sends go through at once
    for v in 2..=10 {
        s.send(stamped("policy", &m, v)).unwrap();
    }
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(s.transport().attached().unwrap(), 0);
}

/// Sends `signal` to a sender holding 3 slots of two models (and a receiver process):
/// it exits with 128 + signal, its segments are gone from `/dev/shm` and its receiver left.
fn signal_releases_everything(signal: i32) {
    let placeholder = ShmReceiverSpec {
        board: std::path::PathBuf::from("/dev/shm/unused"),
    };
    let mut child = spawn_child("hold-slots", &placeholder);
    let held = read_line_where(&mut child, |l| l.strip_prefix("held=").map(str::to_string));
    let mut parts = held.split(',');
    let reader: u32 = parts.next().unwrap().parse().unwrap();
    let paths: Vec<std::path::PathBuf> = parts.map(Into::into).collect();
    assert_eq!(paths.len(), 3, "board and two data segments: {paths:?}");
    for p in &paths {
        assert!(p.starts_with("/dev/shm") && p.exists(), "{}", p.display());
    }
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill only sends a signal to our own child, which we have not reaped yet.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < T,
            "the sender did not exit on signal {signal}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(128 + signal), "{status:?}");
    for p in &paths {
        assert!(!p.exists(), "{} left behind", p.display());
    }
    // its receiver saw the sender leave and exited
    wait_gone(reader);
}

#[test]
fn sigterm_releases_the_segments_and_the_receiver() {
    signal_releases_everything(libc::SIGTERM);
}

#[test]
fn sigint_releases_the_segments_and_the_receiver() {
    signal_releases_everything(libc::SIGINT);
}

#[test]
fn a_dead_sender_whose_pid_was_reused_is_still_dead_and_collected() {
    let (dir, mut child, spec, mut first) = connect_to_crash_sender();
    while let Ok(Some(_)) = first.receive(T) {}
    assert!(!child.wait().unwrap().success());
    // its pid now names a live process started after it died, as a reused pid would: a
    // receiver attaching now still learns that the sender is dead (start times are kept in
    // 10 ms ticks: the stand-in starts well after the sender)
    std::thread::sleep(Duration::from_millis(50));
    let mut stand_in = Command::new("sleep").arg("60").spawn().unwrap();
    refit_transports::shm::overwrite_sender_pid(&spec, stand_in.id()).unwrap();
    let mut late = ReceiverInit::new(ShmReceiver::new(spec.clone()), None)
        .connect(T)
        .unwrap();
    assert_eq!(late.version(&id("policy")), Version(5));
    let err = late.receive(T).unwrap_err();
    let Error::PeerGone { reason, .. } = &err else {
        panic!("{err}")
    };
    assert!(reason.contains("another process"), "{reason}");
    stand_in.kill().unwrap();
    stand_in.wait().unwrap();
    // the next sender in the directory removes the dead one's segments, and only those
    let m = manifest(64);
    let cfg = ShmConfig {
        dir: dir.path().to_path_buf(),
        ..ShmConfig::default()
    };
    let live = ShmSender::create(&cfg, &manifests(&[("policy", &m)])).unwrap();
    let next = ShmSender::create(&cfg, &manifests(&[("policy", &m)])).unwrap();
    assert_eq!(live.collected().len(), 2, "{:?}", live.collected());
    assert!(live.collected().contains(&spec.board));
    assert!(
        next.collected().is_empty(),
        "a live sender's segments were taken"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(left.len(), 4, "two live senders, two segments each");
}

#[test]
fn a_sender_in_another_pid_namespace_is_declared_dead_by_its_heartbeat() {
    let dir = tempfile::tempdir().unwrap();
    let placeholder = ShmReceiverSpec {
        board: dir.path().join("unused"),
    };
    let mut child = spawn_child_in_pid_ns("ns-sender", &placeholder);
    let spec: ShmReceiverSpec = read_line_where(&mut child, |l| wire::from_token(l).ok());
    let mut r = ReceiverInit::new(ShmReceiver::new(spec), None)
        .connect(T)
        .unwrap();
    let p = id("policy");
    while r.version(&p) < Version(2) {
        r.receive(T).unwrap().unwrap();
    }
    // alive and beating: no false alarm over several leases
    assert!(r.receive(NS_LEASE * 4).unwrap().is_none());
    {
        use std::io::Write;
        let stdin = child.stdin.as_mut().unwrap();
        stdin.write_all(b"die\n").unwrap();
    }
    assert_eq!(child.wait().unwrap().code(), Some(3));
    let t = Instant::now();
    let err = r.receive(T).unwrap_err();
    let Error::PeerGone { reason, .. } = &err else {
        panic!("{err}")
    };
    assert!(reason.contains("no heartbeat"), "{reason}");
    assert!(t.elapsed() < T / 2, "{:?}", t.elapsed());
    assert_eq!(r.version(&p), Version(2));
    // and the next sender collects what it left
    let cfg = ShmConfig {
        dir: dir.path().to_path_buf(),
        ..ShmConfig::default()
    };
    let next = ShmSender::create(&cfg, &manifests(&[("policy", &manifest(64))])).unwrap();
    assert_eq!(next.collected().len(), 2, "{:?}", next.collected());
}

#[test]
fn a_receiver_in_another_pid_namespace_is_reaped_by_its_heartbeat() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(64);
    let ms = manifests(&[("policy", &m)]);
    let cfg = ShmConfig {
        dir: dir.path().to_path_buf(),
        expected_receivers: 1,
        lease: NS_LEASE,
        ..ShmConfig::default()
    };
    let sender = ShmSender::create(&cfg, &ms).unwrap();
    let spec = sender.receiver_spec();
    let mut child = spawn_child_in_pid_ns("ns-pinner", &spec);
    let mut s = SenderInit::new(sender, ms)
        .with_ack_timeout(T)
        .connect(vec![stamped("policy", &m, 1)], T)
        .unwrap();
    read_line_where(&mut child, |l| (l == "pinned").then_some(()));
    // beating: kept over several leases
    std::thread::sleep(NS_LEASE * 4);
    assert_eq!(s.transport().attached().unwrap(), 1);
    {
        use std::io::Write;
        child.stdin.as_mut().unwrap().write_all(b"die\n").unwrap();
    }
    assert_eq!(child.wait().unwrap().code(), Some(3));
    let t = Instant::now();
    while s.transport().attached().unwrap() != 0 {
        assert!(t.elapsed() < T, "the dead receiver was never reaped");
        std::thread::sleep(Duration::from_millis(20));
    }
    let departed = s.transport().departed();
    assert_eq!(departed.len(), 1, "{departed:?}");
    assert!(departed[0].reason.contains("no heartbeat"), "{departed:?}");
    // nobody left to wait for: sends go through
    for v in 2..=5 {
        s.send(stamped("policy", &m, v)).unwrap();
    }
}

#[test]
fn a_scheme_larger_than_the_segment_directory_is_refused_with_the_fix() {
    let huge = std::sync::Arc::new(
        refit_runtime::Manifest::builder()
            .tensor("w", refit_runtime::DType::F32, &[1 << 40])
            .build()
            .unwrap(),
    );
    let err =
        ShmSender::create(&ShmConfig::default(), &manifests(&[("policy", &huge)])).unwrap_err();
    let Error::Path { source, path, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(source.kind(), std::io::ErrorKind::StorageFull, "{err}");
    assert!(!path.exists(), "a segment was created: {}", path.display());
    let msg = err.to_string();
    for needle in [
        "/dev/shm",
        "--shm-size",
        "emptyDir",
        "medium: Memory",
        "needed",
    ] {
        assert!(msg.contains(needle), "{msg}");
    }
}
