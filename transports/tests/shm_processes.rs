//! Shared memory across real processes: this test binary re-runs itself as the other side
//! (`REFIT_CHILD_ROLE`), so readers and writers live in separate address spaces.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use refit_runtime::{Error, ReceiverInit, SenderInit, Version, wire};
use refit_transports::shm::{ShmConfig, ShmReadMode, ShmReceiver, ShmReceiverSpec, ShmSender};

const ROLE: &str = "REFIT_CHILD_ROLE";
const SPEC: &str = "REFIT_CHILD_SPEC";
const T: Duration = Duration::from_secs(20);

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

#[test]
fn crashed_sender_leaves_readers_whole() {
    let dir = tempfile::tempdir().unwrap();
    let placeholder = ShmReceiverSpec {
        board: dir.path().join("unused"),
    };
    let mut child = spawn_child("crash-sender", &placeholder);
    let spec: ShmReceiverSpec = read_line_where(&mut child, |l| wire::from_token(l).ok());
    let mut r = ReceiverInit::new(ShmReceiver::new(spec.clone()), None)
        .connect(T)
        .unwrap();
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
