//! The broadcast transport with every receiver a real process: this test binary re-runs
//! itself as receivers (`REFIT_BCAST_MEMBER`), which meet rank 0 (the test) through the node
//! runtime's store and the CPU chain over loopback TCP, authenticated by the cluster token.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::{Receiver as Lines, channel};
use std::time::{Duration, Instant};

use common::*;
use refit_runtime::node::{ClusterToken, Node, Store, StoreClient, TOKEN_ENV};
use refit_runtime::{
    BucketPlan, DType, Error, Manifest, ReceiverInit, SenderInit, SenderTransport, Version,
    WeightSet,
};
use refit_transports::broadcast::{BroadcastConfig, BroadcastReceiver, BroadcastSender};
use refit_transports::collective::{CpuConfig, Rendezvous};

const MEMBER: &str = "REFIT_BCAST_MEMBER";
const STORE_ADDR: &str = "REFIT_BCAST_STORE";
const GROUP: &str = "REFIT_BCAST_GROUP";
const BUCKET: &str = "REFIT_BCAST_BUCKET";
const DIE_AT: &str = "REFIT_BCAST_DIE_AT";
const DONE_KEY: &str = "test/done";
const T: Duration = Duration::from_secs(60);

fn config(group: &str, bucket: usize) -> BroadcastConfig {
    BroadcastConfig {
        bucket_size: bucket,
        heartbeat: Duration::from_millis(250),
        idle_timeout: Duration::from_secs(20),
        ..BroadcastConfig::new(group)
    }
}

/// Rank 0's side: a node serving the store, and the sender transport.
struct Root {
    node: Node,
    token: ClusterToken,
    store: Arc<StoreClient>,
    group: String,
    bucket: usize,
}

impl Root {
    fn new(group: &str, bucket: usize) -> Self {
        let token = ClusterToken::random();
        let node = Node::loopback(token.clone()).unwrap();
        Store::serve(&node);
        let store = Arc::new(StoreClient::connect(&node, node.addr(), T).unwrap());
        Self {
            node,
            token,
            store,
            group: group.to_owned(),
            bucket,
        }
    }

    fn sender(&self, members: &[&str]) -> BroadcastSender<CpuConfig> {
        let store: Arc<dyn Rendezvous> = self.store.clone();
        BroadcastSender::new(
            CpuConfig::new(self.token.clone()),
            store,
            config(&self.group, self.bucket),
            members.iter().map(|m| (*m).to_owned()).collect(),
        )
        .unwrap()
    }

    /// A receiver process named `member`; `die_at` = `version:bucket` makes it SIGKILL
    /// itself when that bucket's prepare arrives (before its bytes).
    fn spawn(&self, member: &str, die_at: Option<&str>) -> (Child, Lines<String>) {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
            .env(MEMBER, member)
            .env(STORE_ADDR, self.node.addr().to_string())
            .env(GROUP, &self.group)
            .env(BUCKET, self.bucket.to_string())
            .env(TOKEN_ENV, self.token.expose())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(d) = die_at {
            cmd.env(DIE_AT, d);
        }
        let mut child = cmd.spawn().unwrap();
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
}

/// Waits for a line containing `want`; returns it.
fn expect_line(lines: &Lines<String>, want: &str) -> String {
    let deadline = Instant::now() + T;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no line with {want:?} within {T:?}"));
        if line.contains(want) {
            return line;
        }
    }
}

/// Entry point of the receiver processes; a no-op in a normal test run.
#[test]
fn child_entry() {
    let Ok(member) = std::env::var(MEMBER) else {
        return;
    };
    let token = ClusterToken::from_env().unwrap().unwrap();
    let node = Node::loopback(token.clone()).unwrap();
    let addr = std::env::var(STORE_ADDR).unwrap().parse().unwrap();
    let store = Arc::new(StoreClient::connect(&node, addr, T).unwrap());
    let group = std::env::var(GROUP).unwrap();
    let bucket: usize = std::env::var(BUCKET).unwrap().parse().unwrap();
    let dyn_store: Arc<dyn Rendezvous> = store.clone();
    let mut rx = BroadcastReceiver::new(
        CpuConfig::new(token),
        dyn_store,
        config(&group, bucket),
        member.as_str(),
    )
    .unwrap();
    if let Ok(at) = std::env::var(DIE_AT) {
        let (v, b) = at.split_once(':').unwrap();
        let (v, b): (u64, usize) = (v.parse().unwrap(), b.parse().unwrap());
        rx = rx.with_prepare_hook(Arc::new(move |p| {
            if p.version.get() == v && p.header.index == b {
                println!("dying at version {v} bucket {b}");
                // SAFETY: kill(2) on this very process: a receiver dying mid-broadcast, as a
                // crash would, without unwinding or closing anything first.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
        }));
    }
    let stats = rx.stats();
    let mut r = ReceiverInit::new(rx, None).connect(T).unwrap();
    let report = |r: &refit_runtime::Receiver<BroadcastReceiver<CpuConfig>>| {
        let versions: Vec<String> = r
            .manifests()
            .ids()
            .map(|m| format!("{m}={}", r.version(m).get()))
            .collect();
        versions.join(",")
    };
    for (_, w) in r.served().load().iter() {
        check_stamp(w).unwrap();
    }
    println!("applied {}", report(&r));
    loop {
        match r.receive(Duration::from_millis(500)) {
            Ok(Some(u)) => {
                for w in &u.group {
                    check_stamp(w).unwrap();
                }
                println!("applied {}", report(&r));
            }
            Ok(None) => {}
            Err(e) => {
                println!("error: {e}");
                if store.get(DONE_KEY).unwrap().is_some() {
                    break;
                }
            }
        }
    }
    // the last version stays served whatever happened
    for (_, w) in r.served().load().iter() {
        check_stamp(w).unwrap();
    }
    println!(
        "last {} prepares={} generation={}",
        report(&r),
        stats.prepares(),
        stats.generation()
    );
}

/// Tells the receivers the run is over, shuts the sender down (they see it gone and stop),
/// and returns each one's last line.
fn finish(
    root: &Root,
    sender: refit_runtime::Sender<BroadcastSender<CpuConfig>>,
    children: Vec<(Child, Lines<String>)>,
    want_last: &str,
) -> Vec<String> {
    root.store.set(DONE_KEY, b"1").unwrap();
    sender.shutdown().unwrap();
    children
        .into_iter()
        .map(|(mut child, out)| {
            let line = expect_line(&out, "last ");
            assert!(line.contains(want_last), "{line}");
            assert!(child.wait().unwrap().success());
            line
        })
        .collect()
}

fn prepares_in(line: &str) -> u64 {
    line.split("prepares=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn versions_refusals_and_two_models_across_processes_one_prepare_per_bucket() {
    let root = Root::new("procs-lifecycle", 8192);
    let (ma, mc) = (manifest(1024), manifest(64));
    let ms = manifests(&[("actor", &ma), ("critic", &mc)]);
    let members = ["m1", "m2", "m3"];
    let children: Vec<_> = members.iter().map(|m| root.spawn(m, None)).collect();
    let sender = root.sender(&members);
    let sent = sender.stats();
    let mut s = SenderInit::new(sender, ms)
        .with_ack_timeout(T)
        .connect(vec![stamped("actor", &ma, 1), stamped("critic", &mc, 1)], T)
        .unwrap();
    for (_, out) in &children {
        expect_line(out, "applied actor=1,critic=1");
    }
    for v in 2..=6 {
        s.send_group(vec![stamped("actor", &ma, v), stamped("critic", &mc, v)])
            .unwrap();
    }
    // a version with a wrong dtype, published straight on the transport (past the sender's
    // own checks): every receiver refuses it naming the tensor, keeps version 6, and says so
    let wrong = Arc::new(
        Manifest::builder()
            .tensor("fc1.weight", DType::F16, &[1024, 4])
            .tensor("fc1.bias", DType::F32, &[1024])
            .tensor("head.weight", DType::F32, &[2, 1024])
            .tensor("steps", DType::I64, &[])
            .build()
            .unwrap(),
    );
    let mut bad = WeightSet::zeroed(id("actor"), Arc::clone(&wrong));
    bad.set_version(Version(7));
    let bad_group = vec![Arc::new(bad), Arc::new(stamped("critic", &mc, 7))];
    let far = Instant::now() + T;
    s.transport_mut().publish(&bad_group, far).unwrap();
    for (_, out) in &children {
        let line = expect_line(out, "error:");
        assert!(
            line.contains("tensor `fc1.weight`: dtype f32 expected, found f16"),
            "{line}"
        );
    }
    let refused = s
        .transport_mut()
        .wait_acks(&[(id("actor"), Version(7))], far)
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("receiver `m1` refused actor version 7"),
        "{refused}"
    );
    // the next good version lands everywhere
    for v in 7..=8 {
        s.send_group(vec![stamped("actor", &ma, v), stamped("critic", &mc, v)])
            .unwrap();
    }
    // one prepare message per bucket: 8 good groups and the refused one, every bucket of
    // both models, counted on the sender and on every receiver
    let plan = |m: &Arc<Manifest>, name| BucketPlan::compute(&id(name), m, m, 8192).unwrap().len();
    let per_group = (plan(&ma, "actor") + plan(&mc, "critic")) as u64;
    let wrong_group = (plan(&wrong, "actor") + plan(&mc, "critic")) as u64;
    assert!(plan(&ma, "actor") > 1, "the actor spans several buckets");
    let expected = 8 * per_group + wrong_group;
    assert_eq!(sent.prepares(), expected);
    for line in finish(&root, s, children, "actor=8,critic=8") {
        assert_eq!(prepares_in(&line), expected, "{line}");
    }
}

fn big_manifest() -> Arc<Manifest> {
    let mut b = Manifest::builder();
    for i in 0..8 {
        b.push(format!("layer{i}.weight"), DType::F32, &[2 << 20]); // 8 MiB each
    }
    b.push("steps", DType::I64, &[]);
    Arc::new(b.build().unwrap())
}

#[cfg(target_os = "linux")]
#[test]
fn a_receiver_killed_mid_broadcast_fails_every_rank_and_the_next_generation_completes() {
    let root = Root::new("procs-kill", 4 << 20);
    let m = big_manifest();
    let ms = manifests(&[("policy", &m)]);
    let (m1, m2, m3) = (
        root.spawn("m1", None),
        root.spawn("m2", Some("2:3")),
        root.spawn("m3", None),
    );
    let mut s = SenderInit::new(root.sender(&["m1", "m2", "m3"]), ms)
        .with_ack_timeout(T)
        .connect(vec![stamped("policy", &m, 1)], T)
        .unwrap();
    for (_, out) in [&m1, &m2, &m3] {
        expect_line(out, "applied policy=1");
    }
    // m2 (rank 2, mid-chain) dies at version 2's fourth bucket, with buckets still to come
    let t = Instant::now();
    let err = s.send(stamped("policy", &m, 2)).unwrap_err();
    let failed_after = t.elapsed();
    assert!(failed_after < T, "{failed_after:?}");
    assert!(
        matches!(err, Error::PeerGone { .. } | Error::Collective { .. }),
        "{err}"
    );
    expect_line(&m2.1, "dying at version 2 bucket 3");
    let (mut victim, _) = m2;
    assert!(!victim.wait().unwrap().success());
    // its neighbours fail too, each naming the rank it lost, instead of waiting
    let e1 = expect_line(&m1.1, "error:");
    assert!(e1.contains("rank 2"), "{e1}");
    let e3 = expect_line(&m3.1, "error:");
    assert!(e3.contains("rank 2"), "{e3}");
    assert_eq!(s.version(&id("policy")), Version(1));
    // the next generation without it: the others rejoin, keep version 1, and go on
    let deadline = Instant::now() + T;
    let entries = s
        .transport_mut()
        .regroup(vec!["m1".into(), "m3".into()], deadline)
        .unwrap();
    assert_eq!(entries, vec![(id("policy"), Version(1))]);
    s.transport_mut().wait_acks(&entries, deadline).unwrap();
    assert_eq!(s.transport().generation(), 2);
    for v in 2..=3 {
        s.send(stamped("policy", &m, v)).unwrap();
        for (_, out) in [&m1, &m3] {
            expect_line(out, &format!("applied policy={v}"));
        }
    }
    for line in finish(&root, s, vec![m1, m3], "policy=3") {
        assert!(line.contains("generation=2"), "{line}");
    }
}
