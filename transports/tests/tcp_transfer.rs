//! The TCP transport in one process: big models over parallel streams, delta transfers,
//! checksums, relaying, tokens and garbage on the wire.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use refit_node::{ClusterToken, Node, NodeConfig};
use refit_runtime::{
    DType, Error, Manifest, Mismatch, Receiver, ReceiverInit, Sender, SenderInit, Version,
    WeightSet,
};
use refit_transports::tcp::{
    Sink, SinkSlice, TcpConfig, TcpReceiver, TcpReceiverConfig, TcpSender, TransferMode,
};

const T: Duration = Duration::from_secs(60);

/// `tensors` f32 tensors of `mib` MiB each.
fn big_manifest(tensors: usize, mib: usize) -> Arc<Manifest> {
    let mut b = Manifest::builder();
    for i in 0..tensors {
        b.push(format!("layer{i}.weight"), DType::F32, &[mib << 18]);
    }
    Arc::new(b.build().unwrap())
}

fn pair(
    m: &Arc<Manifest>,
    initial: WeightSet,
    n: usize,
    cfg: TcpConfig,
    rcfg: TcpReceiverConfig,
) -> (Sender<TcpSender>, Vec<Receiver<TcpReceiver>>) {
    let ms = manifests(&[("policy", m)]);
    let cfg = TcpConfig {
        expected_receivers: n,
        token: Some(ClusterToken::random()),
        ..cfg
    };
    let s = TcpSender::bind(cfg, &ms).unwrap();
    let spec = s.receiver_spec();
    let hs: Vec<_> = (0..n)
        .map(|_| {
            let r = TcpReceiver::new(spec.clone()).with_config(rcfg.clone());
            std::thread::spawn(move || ReceiverInit::new(r, None).connect(T))
        })
        .collect();
    let sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![initial], T)
        .unwrap();
    let rs = hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    (sender, rs)
}

#[test]
fn a_256_mib_model_arrives_bit_identical_over_4_streams() {
    let m = big_manifest(8, 32);
    assert_eq!(m.total_len(), 256 << 20);
    let v1 = random_set(&m, 1, 1);
    let expected = v1.bytes().to_vec();
    let rcfg = TcpReceiverConfig {
        streams: 4,
        mode: TransferMode::Full,
        ..TcpReceiverConfig::default()
    };
    let t = Instant::now();
    let (sender, rs) = pair(&m, v1, 1, TcpConfig::default(), rcfg);
    let took = t.elapsed();
    let got = rs[0].current(&id("policy")).unwrap();
    assert_eq!(got.version(), Version(1));
    assert!(got.bytes() == &expected[..], "bytes differ");
    assert_eq!(sender.transport().bytes_sent(), 256 << 20);
    eprintln!(
        "256 MiB over 4 streams: {took:?} ({:.0} MiB/s, checksums included)",
        256.0 / took.as_secs_f64()
    );
}

#[test]
fn delta_mode_sends_only_the_buckets_of_changed_tensors() {
    let m = big_manifest(8, 1);
    let v1 = random_set(&m, 1, 7);
    let rcfg = TcpReceiverConfig {
        mode: TransferMode::Delta,
        ..TcpReceiverConfig::default()
    };
    // one 1 MiB tensor per bucket: a delta moves exactly the changed tensors
    let cfg = TcpConfig {
        bucket_size: 1 << 20,
        ..TcpConfig::default()
    };
    let (mut sender, rs) = pair(&m, v1.clone(), 1, cfg, rcfg);
    assert_eq!(
        sender.transport().bucket_plan(&id("policy")).unwrap().len(),
        8
    );
    let full = sender.transport().bytes_sent();
    assert_eq!(full, 8 << 20, "the first version has no base: full");
    // change two tensors, far apart
    let mut v2 = v1.clone();
    v2.set_version(Version(2));
    v2.view_mut::<f32>("layer2.weight").unwrap()[5] = 1.5;
    v2.view_mut::<f32>("layer6.weight").unwrap().fill(-2.0);
    let expected = v2.bytes().to_vec();
    let rs = send_all(&mut sender, rs, v2.clone(), T);
    let delta = sender.transport().bytes_sent() - full;
    assert_eq!(
        delta,
        2 << 20,
        "only the buckets of the two changed tensors travel"
    );
    assert!(rs[0].current(&id("policy")).unwrap().bytes() == &expected[..]);
    // an unchanged version moves no bytes at all, and still lands
    let mut v3 = v2.clone();
    v3.set_version(Version(3));
    let rs = send_all(&mut sender, rs, v3, T);
    assert_eq!(sender.transport().bytes_sent() - full, 2 << 20);
    assert_eq!(rs[0].version(&id("policy")), Version(3));
    // a full-mode receiver of the same sender gets every byte
    let spec = sender.transport().receiver_spec();
    let r_full = TcpReceiver::new(spec).with_config(TcpReceiverConfig {
        mode: TransferMode::Full,
        relay: false,
        ..TcpReceiverConfig::default()
    });
    let pulled = r_full.progress();
    let late = ReceiverInit::new(r_full, None).connect(T).unwrap();
    assert_eq!(late.version(&id("policy")), Version(3));
    // (relayed by the first receiver, which holds version 3)
    assert_eq!(pulled.load(std::sync::atomic::Ordering::Relaxed), 8 << 20);
    assert_eq!(sender.transport().bytes_sent() - full, 2 << 20);
}

/// Adds `step` to every `every`-th element of every tensor of `ws`, as version `version`.
fn nudged(ws: &WeightSet, version: u64, every: usize, step: f32) -> WeightSet {
    let mut out = ws.clone();
    out.set_version(Version(version));
    let m = Arc::clone(ws.manifest());
    for t in m.tensors() {
        for x in out
            .view_mut::<f32>(&t.name)
            .unwrap()
            .iter_mut()
            .step_by(every)
        {
            *x += step;
        }
    }
    out
}

#[test]
fn elements_mode_sends_what_changed_and_lands_bit_identical() {
    let m = big_manifest(8, 1);
    let size = m.total_len() as u64;
    let v1 = random_set(&m, 1, 7);
    let rcfg = TcpReceiverConfig {
        mode: TransferMode::Elements,
        ..TcpReceiverConfig::default()
    };
    let (mut sender, rs) = pair(&m, v1.clone(), 1, TcpConfig::default(), rcfg.clone());
    assert_eq!(sender.transport().bytes_sent(), size, "no base yet: full");
    // 2% of the elements of every tensor changed: every bucket moves, a fraction of it
    // travels
    let v2 = nudged(&v1, 2, 50, 0.25);
    let expected = v2.bytes().to_vec();
    let rs = send_all(&mut sender, rs, v2.clone(), T);
    let sent = sender.transport().bytes_sent() - size;
    let st = rs[0].transport().stats();
    assert!(
        sent * 20 < size,
        "2% changed: {sent} bytes sent of {size}, {st:?}"
    );
    assert!(rs[0].current(&id("policy")).unwrap().bytes() == &expected[..]);
    let st = rs[0].transport().stats();
    assert_eq!((st.full, st.elements, st.delta), (1, 1, 0), "{st:?}");
    assert_eq!(st.bytes_landed, 2 * size, "{st:?}");
    assert_eq!(st.bytes_on_wire, size + sent, "{st:?}");
    // a small step of every element: less than the model, bit-identical
    let mut v3 = v2.clone();
    v3.set_version(Version(3));
    for t in 0..8 {
        for x in v3.view_mut::<f32>(&format!("layer{t}.weight")).unwrap() {
            *x *= 1.0 + 1e-4;
        }
    }
    let expected = v3.bytes().to_vec();
    let before = sender.transport().bytes_sent();
    let rs = send_all(&mut sender, rs, v3, T);
    let dense = sender.transport().bytes_sent() - before;
    assert!(dense < size, "a dense small step sent {dense} of {size}");
    eprintln!("elements: 2% changed sent {sent} of {size} bytes, a dense small step {dense}");
    assert!(rs[0].current(&id("policy")).unwrap().bytes() == &expected[..]);
    // a damaged encoding is refused whole, version 3 stays served, and the retry lands
    let v4 = nudged(&random_set(&m, 4, 7), 4, 50, 0.5);
    let mut rs = rs;
    sender.transport().inject_corruption(1);
    let pending = sender.send_async(vec![v4.clone()]).unwrap();
    let err = rs[0].receive(T).unwrap_err();
    assert!(
        err.to_string().contains("bucket") || err.to_string().contains("checksum"),
        "{err}"
    );
    assert_eq!(rs[0].version(&id("policy")), Version(3));
    rs[0].receive(T).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    assert!(rs[0].current(&id("policy")).unwrap().bytes() == v4.bytes());
}

#[test]
fn a_receiver_whose_base_the_sender_forgot_gets_every_byte_and_says_so() {
    let m = big_manifest(2, 1);
    let size = m.total_len() as u64;
    let v1 = random_set(&m, 1, 9);
    let cfg = TcpConfig {
        keep_versions: 1,
        checksum_history: 1,
        ..TcpConfig::default()
    };
    let rcfg = TcpReceiverConfig {
        mode: TransferMode::Elements,
        ..TcpReceiverConfig::default()
    };
    let (mut sender, rs) = pair(&m, v1.clone(), 1, cfg, rcfg);
    let rs = send_all(&mut sender, rs, nudged(&v1, 2, 50, 1.0), T);
    assert_eq!(sender.transport().bytes_sent(), 2 * size);
    let st = rs[0].transport().stats();
    assert_eq!(
        (st.full, st.full_instead_of_delta, st.elements),
        (2, 1, 0),
        "{st:?}"
    );
    // the base's checksums still known (the default history) but its bytes retired: the
    // sender cannot encode against it, and sends the changed buckets raw, as a delta
    let cfg = TcpConfig {
        keep_versions: 1,
        ..TcpConfig::default()
    };
    let rcfg = TcpReceiverConfig {
        mode: TransferMode::Elements,
        ..TcpReceiverConfig::default()
    };
    let v2 = nudged(&v1, 2, 50, 1.0);
    let (mut sender, rs) = pair(&m, v1, 1, cfg, rcfg);
    let rs = send_all(&mut sender, rs, v2.clone(), T);
    assert_eq!(
        sender.transport().bytes_sent(),
        2 * size,
        "every bucket changed"
    );
    let st = rs[0].transport().stats();
    assert_eq!((st.full, st.delta, st.elements), (1, 1, 0), "{st:?}");
    assert!(rs[0].current(&id("policy")).unwrap().bytes() == v2.bytes());
}

#[test]
fn a_corrupted_chunk_is_caught_and_the_version_not_applied() {
    let m = big_manifest(4, 2);
    let v1 = random_set(&m, 1, 3);
    let (mut sender, mut rs) = pair(
        &m,
        v1,
        1,
        TcpConfig::default(),
        TcpReceiverConfig {
            mode: TransferMode::Full,
            ..TcpReceiverConfig::default()
        },
    );
    let p = id("policy");
    let v2 = random_set(&m, 2, 4);
    let expected = v2.bytes().to_vec();
    sender.transport().inject_corruption(1);
    let pending = sender.send_async(vec![v2]).unwrap();
    let err = rs[0].receive(T).unwrap_err();
    match &err {
        Error::Tensor {
            name,
            problem: Mismatch::Checksum { .. },
            ..
        } => assert!(m.get(name).is_some(), "{name}"),
        other => panic!("expected a checksum error naming the tensor, got {other}"),
    }
    assert!(
        err.to_string().contains("model `policy`, tensor `layer"),
        "{err}"
    );
    assert!(err.to_string().contains("checksum"), "{err}");
    // not applied: version 1 is still served, whole
    assert_eq!(rs[0].version(&p), Version(1));
    assert!(sender.wait(&pending, Duration::from_millis(100)).is_err());
    // the next attempt pulls a clean copy
    rs[0].receive(T).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    assert!(rs[0].current(&p).unwrap().bytes() == &expected[..]);
}

#[test]
fn relays_let_the_sender_send_each_byte_about_once() {
    let m = big_manifest(4, 4);
    let size = m.total_len() as u64;
    for (relay, receivers) in [(true, 4usize), (false, 3)] {
        let cfg = TcpConfig {
            relay,
            ..TcpConfig::default()
        };
        let rcfg = TcpReceiverConfig {
            mode: TransferMode::Full,
            ..TcpReceiverConfig::default()
        };
        let (mut sender, mut rs) = pair(&m, random_set(&m, 1, 1), receivers, cfg, rcfg);
        for v in 2..=3 {
            let ws = random_set(&m, v, v);
            let expected = ws.bytes().to_vec();
            rs = send_all(&mut sender, rs, ws, T);
            for r in &rs {
                assert!(r.current(&id("policy")).unwrap().bytes() == &expected[..]);
            }
        }
        // every receiver holds every version bit-identical; what left the sender tells
        // whether the others got it from a relay (the count follows each write, so it may
        // trail the receivers' acks by a moment: wait for it to settle)
        let want = if relay {
            3 * size
        } else {
            3 * receivers as u64 * size
        };
        let settle = Instant::now() + Duration::from_secs(2);
        while sender.transport().bytes_sent() < want && Instant::now() < settle {
            std::thread::sleep(Duration::from_millis(5));
        }
        // settled, not more: a relay that fell back to the sender would show here
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            sender.transport().bytes_sent(),
            want,
            "relay {relay}: each version left the sender once per direct receiver"
        );
    }
}

#[test]
fn a_peer_without_the_token_is_refused() {
    let m = manifest(4);
    let ms = manifests(&[("policy", &m)]);
    let s = TcpSender::bind(
        TcpConfig {
            token: Some(ClusterToken::random()),
            ..TcpConfig::default()
        },
        &ms,
    )
    .unwrap();
    let mut spec = s.receiver_spec();
    spec.token = ClusterToken::random().expose().to_owned();
    let t = Instant::now();
    let err = ReceiverInit::new(TcpReceiver::new(spec), None)
        .connect(Duration::from_secs(5))
        .unwrap_err();
    assert!(
        matches!(
            refit_node::Error::find(&err),
            Some(refit_node::Error::Unauthorized { .. })
        ),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(2));
    assert_eq!(s.node().refused(), 1);
    assert_eq!(s.receivers(), 0);
}

/// A pull request as the wire carries it (the field names are part of the encoding).
#[derive(Debug, serde::Serialize)]
struct PullReq {
    model: String,
    version: u64,
    plan: u64,
    buckets: Vec<u32>,
}

fn pull_req(model: &str, version: u64, plan: u64, buckets: Vec<u32>) -> PullReq {
    PullReq {
        model: model.into(),
        version,
        plan,
        buckets,
    }
}

#[test]
fn garbage_on_the_wire_is_refused_without_a_panic() {
    use rand::{Rng, SeedableRng};
    let m = manifest(64);
    let ms = manifests(&[("policy", &m)]);
    let token = ClusterToken::random();
    let (mut sender, mut rs) = {
        let s = TcpSender::bind(
            TcpConfig {
                token: Some(token.clone()),
                expected_receivers: 1,
                ..TcpConfig::default()
            },
            &ms,
        )
        .unwrap();
        let r = TcpReceiver::new(s.receiver_spec());
        let h = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T).unwrap());
        let s = SenderInit::new(s, ms)
            .connect(vec![stamped("policy", &m, 1)], T)
            .unwrap();
        (s, vec![h.join().unwrap()])
    };
    let addr = sender.transport().addr();
    let agent = sender.transport().receiver_spec().agent;
    let me = Node::start(NodeConfig::loopback(token.clone())).unwrap();
    let plan = sender.transport().bucket_plan(&id("policy")).unwrap();
    // the request shape hostile pulls use is the real one: a fair request is served
    let mut fair = me
        .open_stream(
            addr,
            agent,
            "pull",
            &pull_req("policy", 1, plan.fingerprint().unwrap(), vec![0]),
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(fair.len, plan.buckets[0].len as u64);
    let mut served = Vec::new();
    fair.stream.read_to_end(&mut served).unwrap();
    assert!(
        served.len() as u64 > fair.len,
        "a header and the bucket's bytes"
    );
    let mut hostile_pulls = 0;
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    for case in 0..200u32 {
        match case % 4 {
            0 => {
                // random bytes instead of a hello
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                let n = rng.random_range(1..300);
                let junk: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                let _ = s.write_all(&junk);
                let _ = s.shutdown(std::net::Shutdown::Write);
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let _ = s.read_to_end(&mut Vec::new());
            }
            1 => {
                // a well-formed, authenticated pull that asks for what the sender must refuse
                let plan_id = plan.fingerprint().unwrap();
                let n = plan.len() as u32;
                let (req, refusal) = match rng.random_range(0..5) {
                    0 => (
                        pull_req("policy", 1, plan_id, vec![rng.random_range(n..=u32::MAX)]),
                        "past the plan",
                    ),
                    1 => (
                        pull_req(
                            "policy",
                            1,
                            plan_id ^ rng.random_range(1..u64::MAX),
                            vec![0],
                        ),
                        "names bucket plan",
                    ),
                    2 => (
                        pull_req("policy", rng.random_range(3..u64::MAX), plan_id, vec![0]),
                        "is not kept by the sender",
                    ),
                    3 => (pull_req("critic", 1, plan_id, vec![0]), "is not kept"),
                    _ => (pull_req("policy", 1, plan_id, vec![0, 0]), "out of order"),
                };
                let err = me
                    .open_stream(addr, agent, "pull", &req, Duration::from_secs(5))
                    .unwrap_err();
                match &err {
                    refit_node::Error::Remote { message, .. } => {
                        assert!(message.contains(refusal), "{req:?}: {message}")
                    }
                    other => panic!("{req:?} refused as {other}, not by the pull handler"),
                }
                hostile_pulls += 1;
            }
            2 => {
                // an authenticated stream whose request is random bytes
                let junk: Vec<u8> = (0..rng.random_range(0..64)).map(|_| rng.random()).collect();
                let _ = me.open_stream(
                    addr,
                    agent,
                    "pull",
                    &serde_bytes::ByteBuf::from(junk),
                    Duration::from_secs(5),
                );
            }
            _ => {
                // remote calls carrying random payloads
                let peer = me.connect(addr, Duration::from_secs(5)).unwrap();
                let junk: Vec<u8> = (0..rng.random_range(0..64)).map(|_| rng.random()).collect();
                for method in ["register", "request_transfer", "transfer_done", "ack"] {
                    let _ = peer.call::<_, serde_bytes::ByteBuf>(
                        agent,
                        method,
                        &serde_bytes::ByteBuf::from(junk.clone()),
                        Duration::from_secs(5),
                    );
                }
            }
        }
    }
    assert_eq!(hostile_pulls, 50);
    // the sender still serves its real receiver, which kept version 1 throughout
    assert_eq!(rs[0].version(&id("policy")), Version(1));
    check_stamp(&rs[0].current(&id("policy")).unwrap()).unwrap();
    let pending = sender.send_async(vec![stamped("policy", &m, 2)]).unwrap();
    rs[0].receive(T).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    check_stamp(&rs[0].current(&id("policy")).unwrap()).unwrap();
    assert!(sender.transport().node().refused() >= 50);
}

/// A TCP forwarder in front of a sender's node. While `stall` is set, each connection
/// forwards at most `budget` more bytes toward the receiver, then holds the rest (a sender
/// that hangs mid-transfer while its sockets stay open).
struct Proxy {
    addr: std::net::SocketAddr,
    stall: Arc<std::sync::atomic::AtomicBool>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    fn bind() -> (Self, std::net::TcpListener) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = Self {
            addr: l.local_addr().unwrap(),
            stall: Arc::default(),
            stop: Arc::default(),
        };
        (p, l)
    }

    fn run(&self, l: std::net::TcpListener, upstream: std::net::SocketAddr, budget: usize) {
        use std::sync::atomic::Ordering::SeqCst;
        let (stall, stop) = (Arc::clone(&self.stall), Arc::clone(&self.stop));
        l.set_nonblocking(true).unwrap();
        let pump = move |mut from: std::net::TcpStream,
                         mut to: std::net::TcpStream,
                         stall: Option<Arc<std::sync::atomic::AtomicBool>>,
                         stop: Arc<std::sync::atomic::AtomicBool>| {
            from.set_read_timeout(Some(Duration::from_millis(50)))
                .unwrap();
            let mut buf = vec![0u8; 64 << 10];
            let mut since_stall = 0;
            while !stop.load(SeqCst) {
                let stalled = stall.as_ref().is_some_and(|s| s.load(SeqCst));
                if !stalled {
                    since_stall = 0;
                } else if since_stall >= budget {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                let room = if stalled {
                    budget - since_stall
                } else {
                    buf.len()
                };
                let room = room.min(buf.len());
                match from.read(&mut buf[..room]) {
                    Ok(0) => break,
                    Ok(n) => {
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        if stalled {
                            since_stall += n;
                        }
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => break,
                }
            }
            let _ = to.shutdown(std::net::Shutdown::Both);
        };
        std::thread::spawn(move || {
            while !stop.load(SeqCst) {
                match l.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        let up = std::net::TcpStream::connect(upstream).unwrap();
                        let (c2, u2) = (client.try_clone().unwrap(), up.try_clone().unwrap());
                        let (s1, s2) = (Arc::clone(&stop), Arc::clone(&stop));
                        std::thread::spawn(move || pump(c2, u2, None, s1));
                        let st = Arc::clone(&stall);
                        std::thread::spawn(move || pump(up, client, Some(st), s2));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn a_pull_stalled_mid_way_is_a_timeout_at_the_callers_deadline() {
    use std::sync::atomic::Ordering::SeqCst;
    let m = big_manifest(2, 4);
    let ms = manifests(&[("policy", &m)]);
    let (proxy, listener) = Proxy::bind();
    let s = TcpSender::bind(
        TcpConfig {
            token: Some(ClusterToken::random()),
            expected_receivers: 1,
            advertise: Some(proxy.addr),
            ..TcpConfig::default()
        },
        &ms,
    )
    .unwrap();
    proxy.run(listener, s.node().addr(), 3 << 20);
    let stall = Duration::from_millis(500);
    let r = TcpReceiver::new(s.receiver_spec()).with_config(TcpReceiverConfig {
        streams: 1,
        mode: TransferMode::Full,
        relay: false,
        stall_timeout: stall,
        ..TcpReceiverConfig::default()
    });
    let h = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T).unwrap());
    let v1 = random_set(&m, 1, 1);
    let mut sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![v1.clone()], T)
        .unwrap();
    let mut rs = h.join().unwrap();
    // the sender hangs mid-transfer: its sockets stay open, bytes stop after 3 of 8 MiB
    proxy.stall.store(true, SeqCst);
    let pending = sender.send_async(vec![random_set(&m, 2, 2)]).unwrap();
    let before = rs.transport().progress().load(SeqCst);
    let deadline = Duration::from_millis(1500);
    let t = Instant::now();
    let err = rs.receive(deadline).unwrap_err();
    let waited = t.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("`policy` v2"), "{err}");
    // bound: the deadline, one stall window to see no byte came, and a loaded machine
    assert!(
        waited >= deadline - Duration::from_millis(50)
            && waited < deadline + 2 * stall + Duration::from_secs(2),
        "{waited:?}"
    );
    let moved = rs.transport().progress().load(SeqCst) - before;
    assert!(
        moved > 0 && moved < m.total_len() as u64,
        "stalled mid-way: {moved} bytes"
    );
    // the previous weights stay served; once the link recovers, the version lands
    assert_eq!(rs.version(&id("policy")), Version(1));
    assert!(rs.current(&id("policy")).unwrap().bytes() == v1.bytes());
    proxy.stall.store(false, SeqCst);
    rs.receive(T).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    assert!(rs.current(&id("policy")).unwrap().bytes() == random_set(&m, 2, 2).bytes());
}

#[test]
fn a_relay_passes_a_bucket_on_before_it_has_all_of_it() {
    use std::sync::atomic::Ordering::SeqCst;
    // one bucket of 8 MiB (the default bucket size holds it whole)
    let m = big_manifest(1, 8);
    let total = m.total_len() as u64;
    let ms = manifests(&[("policy", &m)]);
    let (proxy, listener) = Proxy::bind();
    let s = TcpSender::bind(
        TcpConfig {
            token: Some(ClusterToken::random()),
            expected_receivers: 2,
            advertise: Some(proxy.addr),
            ..TcpConfig::default()
        },
        &ms,
    )
    .unwrap();
    assert_eq!(s.bucket_plan(&id("policy")).unwrap().len(), 1);
    proxy.run(listener, s.node().addr(), 3 << 20);
    let spec = s.receiver_spec();
    let rcfg = TcpReceiverConfig {
        mode: TransferMode::Full,
        ..TcpReceiverConfig::default()
    };
    let hs: Vec<_> = (0..2)
        .map(|_| {
            let r = TcpReceiver::new(spec.clone()).with_config(rcfg.clone());
            std::thread::spawn(move || ReceiverInit::new(r, None).connect(T).unwrap())
        })
        .collect();
    let mut sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![random_set(&m, 1, 1)], T)
        .unwrap();
    let rs: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    // the sender's bytes stop after 3 of the bucket's 8 MiB: the receiver pulling from it
    // cannot complete the bucket, yet the one chained behind it gets its bytes
    proxy.stall.store(true, SeqCst);
    let progress: Vec<_> = rs.iter().map(|r| r.transport().progress()).collect();
    let before: Vec<u64> = progress.iter().map(|p| p.load(SeqCst)).collect();
    let v2 = random_set(&m, 2, 2);
    let pending = sender.send_async(vec![v2.clone()]).unwrap();
    let hs: Vec<_> = rs
        .into_iter()
        .map(|mut r| {
            std::thread::spawn(move || {
                r.receive(T).unwrap().unwrap();
                r
            })
        })
        .collect();
    let moved = || -> Vec<u64> {
        progress
            .iter()
            .zip(&before)
            .map(|(p, b)| p.load(SeqCst) - b)
            .collect()
    };
    let t = Instant::now();
    while moved().contains(&0) && t.elapsed() < T {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    let stalled = moved();
    assert!(
        stalled.iter().all(|&m| m > 0 && m < total),
        "both receivers hold part of the bucket: {stalled:?} of {total}"
    );
    proxy.stall.store(false, SeqCst);
    sender.wait(&pending, T).unwrap();
    let relayed: u64 = hs
        .into_iter()
        .map(|h| {
            let r = h.join().unwrap();
            assert!(r.current(&id("policy")).unwrap().bytes() == v2.bytes());
            r.transport().bytes_relayed()
        })
        .sum();
    // the chain: one receiver relayed the version to the other
    assert!(relayed >= total, "relayed {relayed}");
}

/// A sink that lends its own memory (an anonymous map) bucket by bucket, as `refit pull`'s
/// map of a file in /dev/shm does, counting its claims and finishes.
struct LendingSink {
    map: memmap2::MmapRaw,
    len: usize,
    claimed: std::sync::Mutex<Vec<std::ops::Range<usize>>>,
    counts: Arc<LendCounts>,
}

#[derive(Default)]
struct LendCounts {
    claims: std::sync::atomic::AtomicUsize,
    finished: std::sync::atomic::AtomicUsize,
}

/// The lent memory once every byte is in.
struct Lent(memmap2::MmapRaw, usize);

impl refit_runtime::SharedBytes for Lent {
    fn bytes(&self) -> &[u8] {
        // SAFETY: the map is `self.1` bytes long and lives as long as `self`; the sink that
        // lent its slices was consumed by `finish`, so nothing writes it any more.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr(), self.1) }
    }
}

impl Sink for LendingSink {
    fn write_at(&self, _: usize, _: &[u8]) -> refit_runtime::Result<()> {
        Err(Error::State("every byte of a full transfer is claimed"))
    }

    fn claim(&self, range: std::ops::Range<usize>) -> refit_runtime::Result<Option<SinkSlice<'_>>> {
        let mut claimed = self.claimed.lock().unwrap();
        assert!(range.end <= self.len, "a claim past the end");
        assert!(
            !claimed
                .iter()
                .any(|c| c.start < range.end && range.start < c.end),
            "bytes claimed twice"
        );
        claimed.push(range.clone());
        self.counts
            .claims
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the range lies inside the map (asserted), which lives as long as `self`,
        // and overlaps no range lent before (asserted): the slice is the only reference to
        // its bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(range.start), range.len())
        };
        Ok(Some(SinkSlice::new(bytes)))
    }

    fn finish(self: Box<Self>) -> refit_runtime::Result<Arc<dyn refit_runtime::SharedBytes>> {
        self.counts
            .finished
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Arc::new(Lent(self.map, self.len)))
    }
}

#[test]
fn a_sink_lending_its_memory_refuses_a_corrupt_transfer_whole_then_takes_a_clean_one() {
    use std::sync::atomic::Ordering::Relaxed;
    let m = big_manifest(4, 2);
    let v1 = random_set(&m, 1, 5);
    let expected1 = v1.bytes().to_vec();
    let ms = manifests(&[("policy", &m)]);
    let s = TcpSender::bind(
        TcpConfig {
            expected_receivers: 1,
            token: Some(ClusterToken::random()),
            // eight buckets, each tensor cut across two
            bucket_size: 1 << 20,
            ..TcpConfig::default()
        },
        &ms,
    )
    .unwrap();
    let counts = Arc::new(LendCounts::default());
    let r = {
        let counts = Arc::clone(&counts);
        TcpReceiver::new(s.receiver_spec())
            .with_config(TcpReceiverConfig {
                mode: TransferMode::Full,
                relay: false,
                ..TcpReceiverConfig::default()
            })
            .with_sinks(move |_, _, manifest| {
                let len = manifest.total_len();
                let map = memmap2::MmapMut::map_anon(len).unwrap();
                Ok(Some(Box::new(LendingSink {
                    map: memmap2::MmapRaw::from(map),
                    len,
                    claimed: std::sync::Mutex::new(Vec::new()),
                    counts: Arc::clone(&counts),
                }) as Box<dyn Sink>))
            })
    };
    let h = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T));
    let mut sender = SenderInit::new(s, ms)
        .with_ack_timeout(T)
        .connect(vec![v1], T)
        .unwrap();
    let mut r = h.join().unwrap().unwrap();
    let p = id("policy");
    // the initial weights landed in the lent memory, bucket by bucket
    assert!(r.current(&p).unwrap().bytes() == &expected1[..]);
    assert!(
        counts.claims.load(Relaxed) >= 4,
        "{}",
        counts.claims.load(Relaxed)
    );
    assert_eq!(counts.finished.load(Relaxed), 1);
    let v2 = random_set(&m, 2, 6);
    let expected2 = v2.bytes().to_vec();
    sender.transport().inject_corruption(1);
    let pending = sender.send_async(vec![v2]).unwrap();
    let err = r.receive(T).unwrap_err();
    assert!(err.to_string().contains("checksum"), "{err}");
    // refused whole: the sink was never finished and version 1 is still served, whole
    assert_eq!(counts.finished.load(Relaxed), 1);
    assert_eq!(r.version(&p), Version(1));
    assert!(r.current(&p).unwrap().bytes() == &expected1[..]);
    // the next attempt lands a clean copy in a new sink
    r.receive(T).unwrap().unwrap();
    sender.wait(&pending, T).unwrap();
    assert_eq!(counts.finished.load(Relaxed), 2);
    assert!(r.current(&p).unwrap().bytes() == &expected2[..]);
}
