#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

use super::*;

const T: Duration = Duration::from_secs(5);

fn token() -> ClusterToken {
    ClusterToken::new("test-token-0123456789").unwrap()
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Add {
    a: i64,
    b: i64,
}

fn calc_node() -> (Node, Uuid) {
    let node = Node::loopback(token()).unwrap();
    let me = Uuid::new_v4();
    node.register(
        me,
        "add",
        |_, r: Add| async move { Ok::<_, Error>(r.a + r.b) },
    );
    node.register(me, "sleep", |_, ms: u64| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, Error>(ms)
    });
    // a handler may fail with the core's error: it converts
    node.register_blocking(me, "fail", |_, ()| -> refit_runtime::Result<()> {
        Err(CoreError::State("told to fail"))
    });
    node.register_stream(me, "count", |_, req, mut s| {
        Box::pin(async move {
            let n: u64 = wire::decode(&req, 64)?;
            write_head(&mut s, &StreamHead::Ok { len: n }).await?;
            let bytes: Vec<u8> = (0..n).map(|i| i as u8).collect();
            s.write_all(&bytes)
                .await
                .map_err(|e| Error::io("writing", e))
        })
    });
    (node, me)
}

#[test]
fn calls_reply_fail_and_time_out() {
    let (server, me) = calc_node();
    let client = Node::loopback(token()).unwrap();
    let peer = client.connect(server.addr(), T).unwrap();
    assert_eq!(peer.node(), server.id());
    let sum: i64 = peer.call(me, "add", &Add { a: 2, b: 40 }, T).unwrap();
    assert_eq!(sum, 42);
    // many calls in flight on one connection
    let hs: Vec<_> = (0..16)
        .map(|i| {
            let p = peer.clone();
            std::thread::spawn(move || p.call::<_, i64>(me, "add", &Add { a: i, b: i }, T))
        })
        .collect();
    for (i, h) in hs.into_iter().enumerate() {
        assert_eq!(h.join().unwrap().unwrap(), 2 * i as i64);
    }
    let e = peer.call::<_, ()>(me, "fail", &(), T).unwrap_err();
    assert!(e.to_string().contains("told to fail"), "{e}");
    let e = peer.call::<_, ()>(me, "nope", &(), T).unwrap_err();
    assert!(e.to_string().contains("no handler `nope`"), "{e}");
    let t = Instant::now();
    let e = peer
        .call::<_, u64>(me, "sleep", &5000u64, Duration::from_millis(100))
        .unwrap_err();
    assert!(e.is_timeout(), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2));
    // the connection still works after a timeout
    assert_eq!(peer.call::<_, u64>(me, "sleep", &1u64, T).unwrap(), 1);
    // streams carry raw bytes after a head
    let mut s = client
        .open_stream(server.addr(), me, "count", &300u64, T)
        .unwrap();
    assert_eq!(s.len, 300);
    let mut got = Vec::new();
    s.stream.read_to_end(&mut got).unwrap();
    assert_eq!(got.len(), 300);
    assert_eq!(got[299], 43);
    let e = client
        .open_stream(server.addr(), me, "nothing", &1u64, T)
        .unwrap_err();
    assert!(e.to_string().contains("no stream handler"), "{e}");
}

#[test]
fn a_vanishing_peer_fails_pending_calls_at_once() {
    let (server, me) = calc_node();
    let client = Node::loopback(token()).unwrap();
    let peer = client.connect(server.addr(), T).unwrap();
    let p = peer.clone();
    let pending = std::thread::spawn(move || {
        p.call::<_, u64>(me, "sleep", &60_000u64, Duration::from_secs(60))
    });
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    server.shutdown();
    let e = pending.join().unwrap().unwrap_err();
    assert!(matches!(e, Error::Core(CoreError::PeerGone { .. })), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(peer.is_closed());
    let e = peer
        .call::<_, i64>(me, "add", &Add { a: 1, b: 1 }, T)
        .unwrap_err();
    assert!(matches!(e, Error::Core(CoreError::PeerGone { .. })), "{e}");
}

#[test]
fn a_watcher_learns_of_a_closed_connection_when_it_closes() {
    let (server, _) = calc_node();
    let client = Node::loopback(token()).unwrap();
    let peer = client.connect(server.addr(), T).unwrap();
    let p = peer.clone();
    let waiting = client.handle().spawn(async move {
        p.closed().await;
        Instant::now()
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !waiting.is_finished(),
        "closed() resolved on a live connection"
    );
    let t = Instant::now();
    server.shutdown();
    let woke = client
        .handle()
        .block_on(async { tokio::time::timeout(Duration::from_secs(5), waiting).await })
        .expect("closed() did not resolve within 5 s of the peer going away")
        .unwrap();
    assert!(woke.duration_since(t) < Duration::from_secs(2));
    // on an already closed connection it resolves at once
    client.handle().block_on(async {
        tokio::time::timeout(Duration::from_secs(1), peer.closed())
            .await
            .expect("closed() on a closed connection waited");
    });
}

#[test]
fn disconnect_hooks_fire() {
    let (server, _me) = calc_node();
    let (tx, rx) = std::sync::mpsc::channel();
    server.on_disconnect(move |c| {
        let _ = tx.send(c);
    });
    let client = Node::loopback(token()).unwrap();
    let peer = client.connect(server.addr(), T).unwrap();
    drop(peer);
    rx.recv_timeout(T).unwrap();
}

#[test]
fn a_peer_without_the_token_is_refused() {
    let (server, me) = calc_node();
    let intruder = Node::loopback(ClusterToken::new("another-token-0123456789").unwrap()).unwrap();
    let e = intruder.connect(server.addr(), T).unwrap_err();
    assert!(matches!(e, Error::Unauthorized { .. }), "{e}");
    assert!(e.to_string().contains("cluster token"), "{e}");
    let e = intruder
        .open_stream(server.addr(), me, "count", &3u64, T)
        .unwrap_err();
    assert!(matches!(e, Error::Unauthorized { .. }), "{e}");
    assert_eq!(server.refused(), 2);
    // a raw socket that sends nothing is dropped after the hello timeout, not kept
    let mut cfg = NodeConfig::loopback(token());
    cfg.hello_timeout = Duration::from_millis(100);
    let quick = Node::start(cfg).unwrap();
    let mut s = std::net::TcpStream::connect(quick.addr()).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(s.read(&mut buf).unwrap_or(0), 0);
    assert_eq!(quick.refused(), 1);
}

/// A stream connection that is welcomed but never sends its request is dropped at the hello
/// deadline (counted as refused), not kept with its task and descriptor.
#[test]
fn a_stream_that_never_sends_its_request_is_dropped_at_the_hello_deadline() {
    let mut cfg = NodeConfig::loopback(token());
    cfg.hello_timeout = Duration::from_millis(200);
    let quick = Node::start(cfg).unwrap();
    let body = wire::encode(&message::Hello {
        protocol: PROTOCOL_VERSION,
        token: token().expose().into(),
        node: Uuid::new_v4(),
        kind: message::ConnKind::Stream {
            target: Uuid::new_v4(),
            method: "count".into(),
        },
    })
    .unwrap();
    let mut s = std::net::TcpStream::connect(quick.addr()).unwrap();
    frame::write_frame_blocking(&mut s, &body).unwrap();
    // the outer bound (T) only keeps a failing test from hanging
    s.set_read_timeout(Some(T)).unwrap();
    let welcome: message::Welcome = frame::recv_blocking(&mut s, MAX_HELLO).unwrap();
    assert!(
        matches!(welcome, message::Welcome::Ok { .. }),
        "{welcome:?}"
    );
    let started = Instant::now();
    let mut buf = [0u8; 1];
    let read = s.read(&mut buf);
    assert!(
        matches!(read, Ok(0)),
        "the server must close the stream at its deadline: {read:?}"
    );
    assert!(
        started.elapsed() < T,
        "closed after {:?}",
        started.elapsed()
    );
    assert_eq!(quick.refused(), 1);
}

/// A hello of protocol version `protocol` with the right token, as a frame.
fn forged_hello(protocol: u32) -> Vec<u8> {
    let body = wire::encode(&message::Hello {
        protocol,
        token: token().expose().into(),
        node: Uuid::new_v4(),
        kind: message::ConnKind::Rpc,
    })
    .unwrap();
    let mut bytes = Vec::new();
    frame::write_frame_blocking(&mut bytes, &body).unwrap();
    bytes
}

#[test]
fn a_peer_of_another_protocol_version_is_refused_naming_both() {
    let (server, me) = calc_node();
    // a forged hello of version 999 (with the right token) is refused, and the welcome
    // names both versions
    for theirs in [999, 0] {
        let mut s = std::net::TcpStream::connect(server.addr()).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s.write_all(&forged_hello(theirs)).unwrap();
        let welcome: message::Welcome = frame::recv_blocking(&mut s, MAX_HELLO).unwrap();
        let message::Welcome::Refused { reason, protocol } = welcome else {
            panic!("a hello of version {theirs} was welcomed");
        };
        assert_eq!(protocol, Some(PROTOCOL_VERSION));
        assert!(
            reason.contains(&format!("node protocol version {theirs}"))
                && reason.contains(&format!("speaks version {PROTOCOL_VERSION}")),
            "{reason}"
        );
    }
    assert_eq!(server.refused(), 2);
    // a forged node that welcomes us with version 999: both connecting paths refuse it,
    // naming both versions
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = fake.local_addr().unwrap();
    let answering = std::thread::spawn(move || {
        for _ in 0..2 {
            let (mut s, _) = fake.accept().unwrap();
            let _ = frame::read_frame_blocking(&mut s, MAX_HELLO);
            frame::send_blocking(
                &mut s,
                &message::Welcome::Ok {
                    node: Uuid::new_v4(),
                    protocol: 999,
                },
            )
            .unwrap();
        }
    });
    let client = Node::loopback(token()).unwrap();
    let named = |e: &Error| {
        let text = e.to_string();
        assert!(
            matches!(
                e.core(),
                Some(CoreError::Protocol {
                    ours: PROTOCOL_VERSION,
                    theirs: 999,
                    ..
                })
            ),
            "{text}"
        );
        assert!(
            text.contains("node protocol version 999")
                && text.contains(&format!("speaks version {PROTOCOL_VERSION}"))
                && text.contains(&addr.to_string()),
            "{text}"
        );
    };
    named(&client.connect(addr, T).unwrap_err());
    named(&client.open_stream(addr, me, "count", &3u64, T).unwrap_err());
    answering.join().unwrap();
    // and a peer of the same version still gets in
    let peer = client.connect(server.addr(), T).unwrap();
    let sum: i64 = peer.call(me, "add", &Add { a: 1, b: 1 }, T).unwrap();
    assert_eq!(sum, 2);
}

#[test]
fn malformed_frames_are_refused_without_a_panic() {
    use rand::{Rng, SeedableRng};
    let (server, me) = calc_node();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let good_hello = wire::encode(&message::Hello {
        protocol: PROTOCOL_VERSION,
        token: token().expose().into(),
        node: Uuid::new_v4(),
        kind: message::ConnKind::Rpc,
    })
    .unwrap();
    for case in 0..300 {
        let mut s = std::net::TcpStream::connect(server.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut bytes = Vec::new();
        let authed = case % 2 == 1;
        if authed {
            // a valid hello, then garbage on the remote-call channel
            frame::write_frame_blocking(&mut bytes, &good_hello).unwrap();
        }
        match case % 6 {
            0 | 1 => {
                let n = rng.random_range(0..512);
                bytes.extend((0..n).map(|_| rng.random::<u8>()));
            }
            2 | 3 => {
                // an oversized length prefix, with a little body
                bytes.extend_from_slice(&rng.random_range(17u32 << 20..=u32::MAX).to_be_bytes());
                bytes.extend_from_slice(&[0; 8]);
            }
            _ => {
                // a truncated message: a length larger than what follows
                let body: Vec<u8> = (0..rng.random_range(1..64)).map(|_| rng.random()).collect();
                bytes.extend_from_slice(&(body.len() as u32 + 10).to_be_bytes());
                bytes.extend_from_slice(&body);
            }
        }
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        // the server closes the connection (possibly after a welcome): never hangs
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    // and still serves well-formed peers
    let client = Node::loopback(token()).unwrap();
    let peer = client.connect(server.addr(), T).unwrap();
    let sum: i64 = peer.call(me, "add", &Add { a: 1, b: 2 }, T).unwrap();
    assert_eq!(sum, 3);
    // decoding random frames of every message type never panics
    for _ in 0..2000 {
        let n = rng.random_range(0..96);
        let b: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        let _ = wire::decode::<message::Hello>(&b, 4096);
        let _ = wire::decode::<message::Request>(&b, 4096);
        let _ = wire::decode::<message::Reply>(&b, 4096);
        let _ = wire::decode::<StreamHead>(&b, 4096);
        let _ = frame::read_frame_blocking(&mut &b[..], 64);
    }
}

#[test]
fn store_sets_counts_and_waits() {
    let server = Node::loopback(token()).unwrap();
    Store::serve(&server);
    let a = Node::loopback(token()).unwrap();
    let sa = StoreClient::connect(&a, server.addr(), T).unwrap();
    let sb = StoreClient::connect(&a, server.addr(), T).unwrap();
    assert_eq!(sa.get("k").unwrap(), None);
    let waiter = {
        let sb = sb.clone();
        std::thread::spawn(move || sb.wait_get("k", T))
    };
    std::thread::sleep(Duration::from_millis(50));
    sa.set("k", b"v1").unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), b"v1");
    let hs: Vec<_> = (0..8)
        .map(|_| {
            let s = sb.clone();
            std::thread::spawn(move || s.add("n", 1).unwrap())
        })
        .collect();
    let mut seen: Vec<i64> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    seen.sort_unstable();
    assert_eq!(seen, (1..=8).collect::<Vec<_>>());
    assert_eq!(sa.get("n").unwrap().unwrap(), b"8");
    assert!(
        sa.add("k", 1)
            .unwrap_err()
            .to_string()
            .contains("not a counter")
    );
    let t = Instant::now();
    let e = sa
        .wait(&["k", "never"], Duration::from_millis(300))
        .unwrap_err();
    assert!(e.is_timeout() && e.to_string().contains("never"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(sa.set("", b"x").is_err());
}

/// A node that shuts down answers the calls it already carried out: a caller whose call
/// changed the node's state is told so, not that the node is gone (a receiver's last ack,
/// written to the sender's store as the sender closes, is the case met in practice). The
/// reply is large, so that without the wait it would still be on its way when the node
/// stopped. Then: shut down from inside its own runtime, the node still answers, and a call
/// sent after the stop is not carried out.
#[test]
fn a_node_that_shuts_down_answers_the_calls_it_carried_out() {
    for round in 0..50u8 {
        let server = Node::loopback(token()).unwrap();
        let me = Uuid::new_v4();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = Arc::clone(&done);
        server.register(me, "mark", move |_, ()| {
            let d = Arc::clone(&d);
            async move {
                d.store(true, Ordering::Release);
                Ok::<_, Error>(serde_bytes::ByteBuf::from(vec![round; 4 << 20]))
            }
        });
        let client = Node::loopback(token()).unwrap();
        let peer = client.connect(server.addr(), T).unwrap();
        let call =
            std::thread::spawn(move || peer.call::<_, serde_bytes::ByteBuf>(me, "mark", &(), T));
        let deadline = Instant::now() + T;
        while !done.load(Ordering::Acquire) && !call.is_finished() && Instant::now() < deadline {
            std::hint::spin_loop();
        }
        server.shutdown();
        let reply = call.join().unwrap().unwrap();
        assert_eq!(reply.len(), 4 << 20, "round {round}");
        assert!(reply.iter().all(|&b| b == round), "round {round}");
    }
}

#[test]
fn a_node_stopped_from_its_own_runtime_still_answers_and_takes_no_new_call() {
    let server = Node::loopback(token()).unwrap();
    let me = Uuid::new_v4();
    let calls = Arc::new(AtomicU64::new(0));
    // taken by the handler, so that no clone of the node stays inside its own handlers
    let own = Arc::new(Mutex::new(Some(server.clone())));
    let c = Arc::clone(&calls);
    // the handler stops its own node, on a worker of the node's runtime
    server.register(me, "stop", move |_, ()| {
        c.fetch_add(1, Ordering::AcqRel);
        let node = own.lock().unwrap().take();
        if let Some(node) = node {
            node.shutdown();
        }
        async move { Ok::<_, Error>(7u32) }
    });
    let client = Node::loopback(token()).unwrap();
    let peer = client.connect(server.addr(), T).unwrap();
    let t = Instant::now();
    assert_eq!(peer.call::<_, u32>(me, "stop", &(), T).unwrap(), 7);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // the node is gone (or going): a later call fails and is not carried out
    assert!(peer.call::<_, u32>(me, "stop", &(), T).is_err());
    assert_eq!(calls.load(Ordering::Acquire), 1);
    drop(server);
}
