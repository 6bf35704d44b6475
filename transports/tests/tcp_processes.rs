//! TCP across real processes: this test binary re-runs itself as receivers
//! (`REFIT_CHILD_ROLE`); one is killed mid-transfer, the others keep going, and a restarted
//! one rejoins and gets the newest version.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::{Receiver as Lines, channel};
use std::time::{Duration, Instant};

use common::*;
use refit_node::{ClusterToken, TOKEN_ENV};
use refit_runtime::{
    DType, Error, Manifest, ReceiverInit, SenderInit, SenderTransport, Version, WeightSet, wire,
};
use refit_transports::tcp::{
    TcpConfig, TcpEndpoint, TcpReceiver, TcpReceiverConfig, TcpReceiverSpec, TcpSender,
    TransferMode,
};

const ROLE: &str = "REFIT_CHILD_ROLE";
const SPEC: &str = "REFIT_CHILD_SPEC";
const T: Duration = Duration::from_secs(60);

fn big_manifest() -> Arc<Manifest> {
    let mut b = Manifest::builder();
    for i in 0..8 {
        b.push(format!("layer{i}.weight"), DType::F32, &[4 << 20]); // 16 MiB each
    }
    Arc::new(b.build().unwrap())
}

/// Every f32 equals the version (cheap to make, checkable everywhere).
fn at(m: &Arc<Manifest>, v: u64) -> WeightSet {
    // `repeat` copies by doubling: fast even in a debug build
    let bytes = (v as f32).to_le_bytes().repeat(m.total_len() / 4);
    WeightSet::from_bytes(id("policy"), Version(v), Arc::clone(m), &bytes).unwrap()
}

/// A receiver process: the sender's endpoint and the token in its environment
/// (the token in `REFIT_TOKEN`, as a launcher hands a secret to a process; the endpoint
/// holds none).
fn spawn_child(endpoint: TcpEndpoint, token: &ClusterToken) -> (Child, Lines<String>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, "receiver")
        .env(SPEC, wire::to_token(&endpoint).unwrap())
        .env(TOKEN_ENV, token.expose())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Waits for a line containing `want` (libtest may prefix the first one).
fn expect_line(lines: &Lines<String>, want: &str) {
    let deadline = Instant::now() + T;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no line with {want:?} within {T:?}"));
        if line.contains(want) {
            return;
        }
    }
}

/// Entry point of the child processes; a no-op in a normal test run.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    assert_eq!(role, "receiver");
    let endpoint: TcpEndpoint = wire::from_token(&std::env::var(SPEC).unwrap()).unwrap();
    let token = ClusterToken::from_env().unwrap().unwrap();
    let spec = TcpReceiverSpec::new(endpoint, &token);
    let cfg = TcpReceiverConfig {
        mode: TransferMode::Full,
        ..TcpReceiverConfig::default()
    };
    let mut r = ReceiverInit::new(TcpReceiver::new(spec).with_config(cfg), None)
        .connect(T)
        .unwrap();
    let p = id("policy");
    let check = |w: &WeightSet| {
        let v = w.version().get() as f32;
        // the transport verified every checksum; sample the values too
        for t in w.tensors() {
            let xs = t.as_slice::<f32>().unwrap();
            assert!(xs.iter().step_by(4099).all(|&x| x == v), "torn");
            assert_eq!(xs[xs.len() - 1], v);
        }
    };
    check(&r.current(&p).unwrap());
    println!("applied {}", r.version(&p).get());
    loop {
        match r.receive(T) {
            Ok(Some(u)) => {
                check(&u.group[0]);
                println!("applied {}", u.group[0].version().get());
            }
            Ok(None) => panic!("nothing within {T:?}"),
            Err(Error::PeerGone { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    println!("last={}", r.version(&p).get());
}

#[cfg(target_os = "linux")]
fn signal(child: &Child, sig: i32) {
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: kill(2) on the pid of a child we spawned and have not reaped yet.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

#[cfg(target_os = "linux")]
#[test]
fn a_receiver_killed_mid_transfer_leaves_the_rest_working() {
    let m = big_manifest();
    let size = m.total_len() as u64;
    let ms = manifests(&[("policy", &m)]);
    let token = ClusterToken::random();
    let cfg = TcpConfig {
        token: Some(token.clone()),
        relay: false,
        ..TcpConfig::default()
    };
    let sender = TcpSender::bind(cfg, &ms).unwrap();
    let endpoint = sender.endpoint();
    let mut s = SenderInit::new(sender, ms)
        .with_ack_timeout(T)
        .connect(vec![at(&m, 1)], T)
        .unwrap();
    let p = id("policy");
    let (steady, steady_out) = spawn_child(endpoint, &token);
    let (mut victim, victim_out) = spawn_child(endpoint, &token);
    expect_line(&steady_out, "applied 1");
    expect_line(&victim_out, "applied 1");
    // both registered and hold version 1
    s.transport_mut()
        .wait_acks(
            &[(p.clone(), Version(1))],
            refit_runtime::scheme::deadline_in(T),
        )
        .unwrap();
    assert_eq!(s.transport().receivers(), 2);
    let base = s.transport().bytes_sent();
    let pending = s.send_async(vec![at(&m, 2)]).unwrap();
    // freeze the victim as soon as bytes flow, so it is caught mid-transfer, then kill it
    let t = Instant::now();
    while s.transport().bytes_sent() == base {
        assert!(t.elapsed() < T, "no transfer started");
        std::thread::yield_now();
    }
    signal(&victim, libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(200));
    let sent = s.transport().bytes_sent() - base;
    assert!(
        sent < 2 * size,
        "the victim was not caught mid-transfer ({sent} bytes)"
    );
    victim.kill().unwrap();
    victim.wait().unwrap();
    // the sender drops the dead receiver (its lease and its ack debt) and goes on
    let t = Instant::now();
    s.wait(&pending, T).unwrap();
    expect_line(&steady_out, "applied 2");
    for v in 3..=4 {
        s.send(at(&m, v)).unwrap();
        expect_line(&steady_out, &format!("applied {v}"));
    }
    assert!(t.elapsed() < Duration::from_secs(30));
    assert_eq!(s.transport().receivers(), 1);
    // a restarted receiver rejoins and gets the newest version straight away
    let (reborn, reborn_out) = spawn_child(endpoint, &token);
    expect_line(&reborn_out, "applied 4");
    s.send(at(&m, 5)).unwrap();
    expect_line(&reborn_out, "applied 5");
    assert_eq!(s.transport().receivers(), 2);
    s.shutdown().unwrap();
    for (mut child, out) in [(steady, steady_out), (reborn, reborn_out)] {
        expect_line(&out, "last=5");
        assert!(child.wait().unwrap().success());
    }
}
