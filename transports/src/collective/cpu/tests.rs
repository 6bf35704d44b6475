//! The chain with ranks as threads of one process, over real loopback sockets.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::thread::JoinHandle;

use super::*;
use crate::collective::LocalRendezvous;

const LONG: Duration = Duration::from_secs(30);

fn token() -> ClusterToken {
    ClusterToken::new("0123456789abcdef-test-token").unwrap()
}

fn deadline(d: Duration) -> Instant {
    Instant::now() + d
}

/// Runs `f(rank, comm)` on `world` threads joined into one group; the results by rank.
fn ranks<T: Send + 'static>(
    world: usize,
    config: CpuConfig,
    f: impl Fn(usize, CpuComm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store = Arc::new(LocalRendezvous::new());
    let f = Arc::new(f);
    let handles: Vec<JoinHandle<T>> = (0..world)
        .map(|rank| {
            let (store, f, config) = (Arc::clone(&store), Arc::clone(&f), config.clone());
            std::thread::spawn(move || {
                let m = Membership::new("test", 1, rank, world).unwrap();
                let comm = CpuComm::connect(m, store.as_ref(), &config, deadline(LONG)).unwrap();
                f(rank, comm)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn the_chain_broadcasts_from_any_root_and_send_recv_pair_up() {
    let len = (5 << 20) + 123; // not a whole number of chunks
    let out = ranks(
        4,
        CpuConfig::new(token()).with_chunk(1 << 20),
        move |rank, mut c| {
            let mut got = Vec::new();
            for root in [0, 2] {
                let mut bytes = if rank == root {
                    pattern(len, root as u8)
                } else {
                    vec![0; len]
                };
                c.broadcast_host(&mut bytes, root, deadline(LONG)).unwrap();
                got.push(bytes == pattern(len, root as u8));
            }
            // the staged form: alloc/upload/broadcast/download
            let mut buf = c.alloc(1000).unwrap();
            if rank == 3 {
                c.upload(&pattern(1000, 9), &mut buf, deadline(LONG))
                    .unwrap();
            }
            c.broadcast(&mut buf, 1000, 3, deadline(LONG)).unwrap();
            got.push(buf == pattern(1000, 9));
            // point to point: 1 -> 3
            if rank == 1 {
                c.send(&pattern(4096, 7), 4096, 3, deadline(LONG)).unwrap();
            }
            if rank == 3 {
                let mut b = vec![0; 4096];
                c.recv(&mut b, 4096, 1, deadline(LONG)).unwrap();
                got.push(b == pattern(4096, 7));
            }
            assert!(!c.is_aborted());
            got
        },
    );
    for (rank, got) in out.iter().enumerate() {
        assert!(got.iter().all(|ok| *ok), "rank {rank}: {got:?}");
    }
}

#[test]
fn a_wrong_token_is_refused_and_named() {
    let store = Arc::new(LocalRendezvous::new());
    let s = Arc::clone(&store);
    let good = std::thread::spawn(move || {
        let m = Membership::new("tok", 1, 1, 2).unwrap();
        CpuComm::connect(
            m,
            s.as_ref(),
            &CpuConfig::new(token()),
            deadline(Duration::from_millis(800)),
        )
    });
    let bad = CpuConfig::new(ClusterToken::new("another-token-of-16-bytes").unwrap());
    let m = Membership::new("tok", 1, 0, 2).unwrap();
    let e = CpuComm::connect(m, store.as_ref(), &bad, deadline(LONG)).unwrap_err();
    assert!(e.to_string().contains("wrong cluster token"), "{e}");
    // the honest rank is still waiting for rank 0 and says so at its deadline
    let e = good.join().unwrap().unwrap_err();
    assert!(e.is_timeout(), "{e}");
    assert!(e.to_string().contains("ranks [0]"), "{e}");
}

/// A forged rank of protocol version 999 is refused by a real one naming both versions,
/// whichever side it takes: connecting with a hello of 999, or accepting with a welcome of
/// 999.
#[test]
fn a_rank_of_another_protocol_version_is_refused_naming_both() {
    let ours = PROTOCOL_VERSION;
    let names_both = |e: &str| {
        e.contains("cpu collective protocol version 999")
            && e.contains(&format!("speaks version {ours}"))
    };
    // a real rank 1 accepts from rank 0: the forged rank 0 presents version 999
    let store = Arc::new(LocalRendezvous::new());
    let s = Arc::clone(&store);
    let real = std::thread::spawn(move || {
        let m = Membership::new("ver", 1, 1, 2).unwrap();
        CpuComm::connect(
            m,
            s.as_ref(),
            &CpuConfig::new(token()),
            deadline(Duration::from_millis(1500)),
        )
    });
    let m = Membership::new("ver", 1, 0, 2).unwrap();
    let raw = store.wait_get(&m.key("addr/1"), LONG).unwrap();
    let addr: SocketAddr = std::str::from_utf8(&raw).unwrap().parse().unwrap();
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(LONG)).unwrap();
    let mut hello = hello_for(&m, &CpuConfig::new(token()));
    hello.protocol = 999;
    frame::send_blocking(&mut stream, &hello).unwrap();
    let welcome: Welcome = frame::recv_blocking(&mut stream, MAX_HELLO).unwrap();
    let reason = welcome
        .refused
        .expect("a hello of version 999 was welcomed");
    assert!(names_both(&reason), "{reason}");
    assert_eq!(welcome.protocol, ours);
    // the real rank went on waiting for a rank 0 of its version, and says so at its deadline
    let e = real.join().unwrap().unwrap_err();
    assert!(e.is_timeout(), "{e}");
    // a real rank 0 connects to a forged rank 1 that welcomes it with version 999
    let store = Arc::new(LocalRendezvous::new());
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let m1 = Membership::new("ver2", 1, 1, 2).unwrap();
    store
        .set(
            &m1.key("addr/1"),
            fake.local_addr().unwrap().to_string().as_bytes(),
        )
        .unwrap();
    let answering = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let _ = frame::read_frame_blocking(&mut s, MAX_HELLO);
        let welcome = Welcome {
            refused: None,
            protocol: 999,
        };
        frame::send_blocking(&mut s, &welcome).unwrap();
    });
    let m0 = Membership::new("ver2", 1, 0, 2).unwrap();
    let e =
        CpuComm::connect(m0, store.as_ref(), &CpuConfig::new(token()), deadline(LONG)).unwrap_err();
    assert!(
        matches!(e, Error::Protocol { theirs: 999, .. }) && names_both(&e.to_string()),
        "{e}"
    );
    answering.join().unwrap();
}

#[test]
fn a_rank_that_leaves_fails_the_broadcast_on_every_rank_with_its_name() {
    let len = 64 << 20;
    let out = ranks(3, CpuConfig::new(token()), move |rank, mut c| {
        if rank == 2 {
            drop(c); // leaves before the broadcast: its sockets close
            return None;
        }
        let started = Instant::now();
        let mut bytes = vec![1u8; len];
        let e = c.broadcast_host(&mut bytes, 0, deadline(LONG)).unwrap_err();
        assert!(c.is_aborted());
        // later calls fail at once
        assert!(
            c.broadcast_host(&mut bytes[..8], 0, deadline(LONG))
                .is_err()
        );
        Some((e.to_string(), started.elapsed()))
    });
    let (e1, t1) = out[1].clone().unwrap();
    assert!(e1.contains("rank 2"), "{e1}");
    let (e0, t0) = out[0].clone().unwrap();
    assert!(e0.contains("rank 1"), "{e0}");
    assert!(t0 < LONG / 2 && t1 < LONG / 2, "{t0:?} {t1:?}");
}

#[test]
fn a_silent_rank_makes_the_root_time_out_at_its_deadline() {
    let out = ranks(2, CpuConfig::new(token()), move |rank, mut c| {
        if rank == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let mut bytes = vec![0u8; 256 << 20]; // more than the socket buffers hold
        let started = Instant::now();
        let e = c
            .broadcast_host(&mut bytes, 0, deadline(Duration::from_millis(300)))
            .unwrap_err();
        Some((e, started.elapsed()))
    });
    let (e, took) = out.into_iter().next().unwrap().unwrap();
    assert!(e.is_timeout(), "{e}");
    // well before the silent rank wakes up
    assert!(took < Duration::from_millis(1400), "{took:?}");
}
