//! Many senders to many receivers over real sockets: trainer shards publish the rows they
//! hold, engines pull the columns they serve from every shard at once, bit for bit; bad
//! plans, missing versions and bad buffers are refused naming the culprit.
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use refit_node::{ClusterToken, Node, NodeConfig};
use refit_runtime::mesh::extract;
use refit_runtime::{DType, Manifest, Version};
use refit_transports::mesh::{MeshEndpoint, MeshReceiver, MeshSender, Part, Parts};

const T: Duration = Duration::from_secs(20);

fn manifest() -> Manifest {
    Manifest::builder()
        .tensor("w", DType::F32, &[64, 32])
        .tensor("b", DType::F32, &[32])
        .tensor("e", DType::BF16, &[16, 8])
        .build()
        .unwrap()
}

/// The whole tensor `name` at `version`: bytes that differ per version and position.
fn whole(m: &Manifest, name: &str, version: u64) -> Vec<u8> {
    let len = m.get(name).unwrap().len;
    (0..len)
        .map(|i| (i as u64 * 2_654_435_761 + version * 97 + name.len() as u64) as u8)
        .collect()
}

fn slice(name: &str, dim: usize, rank: usize, world: usize) -> (String, Part) {
    (name.to_owned(), Part::Slice { dim, rank, world })
}

/// Publishes `version` on each sender: its parts, cut from the whole tensors.
fn publish(m: &Manifest, senders: &[MeshSender], version: u64) {
    for s in senders {
        let data = s
            .parts()
            .iter()
            .map(|(n, p)| extract(m, n, p, &whole(m, n, version)).unwrap())
            .collect();
        s.publish(Version(version), data).unwrap();
    }
}

#[test]
fn row_shards_publish_and_column_engines_pull_their_halves() {
    let m = manifest();
    let token = ClusterToken::random();
    let held: Vec<Parts> = (0..2)
        .map(|r| {
            let b = 32 / 2;
            vec![
                slice("w", 0, r, 2),
                (
                    "b".into(),
                    Part::Flat {
                        start: r * b,
                        end: (r + 1) * b,
                    },
                ),
                slice("e", 0, r, 2),
            ]
        })
        .collect();
    let nodes: Vec<Node> = (0..2)
        .map(|_| Node::start(NodeConfig::loopback(token.clone())).unwrap())
        .collect();
    let senders: Vec<MeshSender> = nodes
        .iter()
        .zip(&held)
        .map(|(n, p)| MeshSender::on_node(n, policy(), &m, p.clone()).unwrap())
        .collect();
    let book: Vec<_> = senders
        .iter()
        .map(|s| (s.endpoint(), s.parts().clone()))
        .collect();
    let wants: Vec<Parts> = (0..2)
        .map(|r| {
            vec![
                slice("w", 1, r, 2),
                ("b".into(), Part::Whole),
                slice("e", 1, r, 2),
            ]
        })
        .collect();
    let mut receivers: Vec<MeshReceiver> = wants
        .iter()
        .map(|w| MeshReceiver::new(&m, book.clone(), w.clone(), token.clone()).unwrap())
        .collect();
    // each engine reads half of `w` and `e` and all of `b`, plus a checksum per sender
    let half = (64 * 32 * 4 + 16 * 8 * 2) / 2 + 32 * 4;
    for r in &receivers {
        assert_eq!(r.bytes_per_pull(), half as u64 + 2 * 8);
    }
    let mut last: Vec<*const u8> = Vec::new();
    for v in 1..=3 {
        // the engines start pulling before the shards publish: each waits for its senders
        let pulled: Vec<_> = std::thread::scope(|scope| {
            let hs: Vec<_> = receivers
                .iter_mut()
                .map(|r| scope.spawn(move || r.pull(Version(v), T)))
                .collect();
            std::thread::sleep(Duration::from_millis(50));
            publish(&m, &senders, v);
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        for (got, want) in pulled.iter().zip(&wants) {
            assert_eq!(got.version, Version(v));
            for ((name, part), bytes) in want.iter().zip(&got.parts) {
                let expected = extract(&m, name, part, &whole(&m, name, v)).unwrap();
                assert!(
                    bytes[..] == expected[..],
                    "version {v}, tensor {name}, {part:?}"
                );
            }
        }
        // versions 2 and 3 land in the buffers of the version before, handed back: every
        // byte overwritten (the checks above), no new memory
        let now: Vec<*const u8> = pulled.iter().map(|p| p.parts[0].as_ptr()).collect();
        if v > 1 {
            assert_eq!(now, last, "version {v} did not reuse the recycled buffers");
        }
        last = now;
        for (r, got) in receivers.iter_mut().zip(pulled) {
            r.recycle(got);
        }
    }
    assert_eq!(receivers[0].bytes_pulled(), 3 * (half as u64 + 16));
    // a version one shard never publishes: the pull fails naming that shard's address
    publish(&m, &senders[..1], 4);
    let e = receivers[0]
        .pull(Version(4), Duration::from_millis(300))
        .unwrap_err()
        .to_string();
    let late = senders[1].endpoint().addr.to_string();
    assert!(e.contains(&late) && e.contains("not published"), "{e}");
    // a version no longer kept (two newer ones published since) is refused, not half-served
    publish(&m, &senders[1..], 4);
    publish(&m, &senders, 5);
    publish(&m, &senders, 6);
    let e = receivers[1].pull(Version(4), T).unwrap_err().to_string();
    assert!(e.contains("no longer kept"), "{e}");
    let got = receivers[1].pull(Version(6), T).unwrap();
    assert_eq!(got.parts[1], whole(&m, "b", 6));
}

#[test]
fn bad_plans_and_bad_buffers_are_refused_naming_the_tensor() {
    let m = manifest();
    let token = ClusterToken::random();
    let node = Node::start(NodeConfig::loopback(token.clone())).unwrap();
    // a shard holding only the first rows of `w`: an engine wanting all of it is refused
    let s = MeshSender::on_node(&node, policy(), &m, vec![slice("w", 0, 0, 2)]).unwrap();
    let book = vec![(s.endpoint(), s.parts().clone())];
    let e = MeshReceiver::new(
        &m,
        book.clone(),
        vec![("w".into(), Part::Whole)],
        token.clone(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("`w`") && e.contains("1024..2048") && e.contains("no sender"),
        "{e}"
    );
    // a slice that does not divide its dimension
    let all = MeshSender::on_node(&node, policy(), &m, vec![("w".into(), Part::Whole)]).unwrap();
    let book = vec![(all.endpoint(), all.parts().clone())];
    let e = MeshReceiver::new(&m, book, vec![slice("w", 1, 0, 3)], token)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`w`") && e.contains("divide"), "{e}");
    // a buffer of another length, a version not newer
    let e = s
        .publish(Version(1), vec![Arc::from(vec![0u8; 7])])
        .unwrap_err()
        .to_string();
    assert!(e.contains("`w`") && e.contains("found 7"), "{e}");
    s.publish(Version(2), vec![Arc::from(vec![0u8; 32 * 32 * 4])])
        .unwrap();
    assert!(
        s.publish(Version(2), vec![Arc::from(vec![0u8; 32 * 32 * 4])])
            .is_err()
    );
    assert!(MeshSender::on_node(&node, policy(), &m, vec![("x".into(), Part::Whole)]).is_err());

    // a stream whose bytes do not hash to the checksum it ends with: refused, naming the
    // sender (a node that answers pulls with zeros and a wrong checksum)
    let liar = Node::start(NodeConfig::loopback(token_of(&node))).unwrap();
    let agent = uuid::Uuid::new_v4();
    let want = 64 * 32 * 4;
    liar.register_stream(agent, "mesh.pull", move |_, _, mut stream| {
        Box::pin(async move {
            use tokio::io::AsyncWriteExt;
            refit_node::write_head(&mut stream, &refit_node::StreamHead::Ok { len: want + 8 })
                .await?;
            let _ = stream.write_all(&vec![0u8; want as usize]).await;
            let _ = stream.write_all(&[1u8; 8]).await;
            Ok(())
        })
    });
    let endpoint = refit_transports::mesh::MeshEndpoint {
        addr: liar.addr(),
        agent,
    };
    let mut r = MeshReceiver::new(
        &m,
        vec![(endpoint, vec![("w".into(), Part::Whole)])],
        vec![("w".into(), Part::Whole)],
        token_of(&node),
    )
    .unwrap();
    let e = r.pull(Version(1), T).unwrap_err().to_string();
    assert!(
        e.contains(&liar.addr().to_string()) && e.contains("checksum"),
        "{e}"
    );
    assert_eq!(
        r.bytes_pulled(),
        0,
        "nothing of a refused version counts as pulled"
    );
}

fn policy() -> refit_runtime::ModelId {
    refit_runtime::ModelId::new("policy").unwrap()
}

fn token_of(node: &Node) -> ClusterToken {
    node.token().clone()
}

/// An FSDP-sharded trainer (each shard a flat run of the model's elements) feeds an engine
/// that serves the whole model: the engine pulls every shard's run at once, straight into
/// its weight set's arena, bit for bit; a receiver wanting slices cannot pull into one.
#[test]
fn flat_shards_land_in_a_whole_weight_set() {
    let m = Arc::new(manifest());
    let token = ClusterToken::random();
    let nodes: Vec<Node> = (0..3)
        .map(|_| Node::start(NodeConfig::loopback(token.clone())).unwrap())
        .collect();
    let senders: Vec<MeshSender> = nodes
        .iter()
        .zip(refit_runtime::mesh::flat_shards(&m, 3))
        .map(|(n, p)| MeshSender::on_node(n, policy(), &m, p).unwrap())
        .collect();
    let book: Vec<_> = senders
        .iter()
        .map(|s| (s.endpoint(), s.parts().clone()))
        .collect();
    let wholes = refit_runtime::mesh::wholes(&m);
    let mut r = MeshReceiver::new(&m, book.clone(), wholes, token.clone()).unwrap();
    let mut ws = refit_runtime::WeightSet::zeroed(policy(), Arc::clone(&m));
    for v in 1..=2 {
        publish(&m, &senders, v);
        r.pull_weights(&mut ws, Version(v), T).unwrap();
        assert_eq!(ws.version(), Version(v));
        for t in m.tensors() {
            let got = ws.tensor(&t.name).unwrap().bytes().to_vec();
            assert!(
                got == whole(&m, &t.name, v),
                "version {v}, tensor {}",
                t.name
            );
        }
    }
    let halves = vec![slice("w", 1, 0, 2)];
    let mut r = MeshReceiver::new(&m, book, halves, token).unwrap();
    let e = r
        .pull_weights(&mut ws, Version(2), T)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`w`") || e.contains("w:") || e.contains("wanted whole"),
        "{e}"
    );
}

/// How a fake sender misbehaves once it has written half of what it announced.
#[derive(Clone, Copy)]
enum Halfway {
    /// The process dies: the stream closes.
    Dies,
    /// The process hangs: the stream stays open, silent.
    Stalls,
}

/// A sender on `node` that holds the whole model, announces every byte asked of it, sends
/// half and then misbehaves.
fn sender_breaking_halfway(node: &Node, m: &Manifest, how: Halfway) -> (MeshEndpoint, Parts) {
    use tokio::io::AsyncWriteExt;
    let agent = uuid::Uuid::new_v4();
    let total: u64 = m.tensors().iter().map(|t| t.len as u64).sum();
    node.register_stream(agent, "mesh.pull", move |_, _, mut stream| {
        Box::pin(async move {
            let head = refit_node::StreamHead::Ok { len: total + 8 };
            refit_node::write_head(&mut stream, &head).await?;
            let half = vec![7u8; (total / 2) as usize];
            stream
                .write_all(&half)
                .await
                .map_err(|e| refit_node::Error::io("fake sender", e))?;
            stream
                .flush()
                .await
                .map_err(|e| refit_node::Error::io("fake sender", e))?;
            if let Halfway::Stalls = how {
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
            Ok(())
        })
    });
    let endpoint = MeshEndpoint {
        addr: node.advertised(),
        agent,
    };
    (endpoint, refit_runtime::mesh::wholes(m))
}

/// A shard that dies or hangs in the middle of a version fails that
/// version, naming the shard, within the pull's deadline; the version the receiver held
/// before is still the one its weight set says it holds.
#[test]
fn a_shard_that_dies_or_hangs_mid_version_fails_it_naming_the_shard() {
    let m = Arc::new(manifest());
    for how in [Halfway::Dies, Halfway::Stalls] {
        let node = Node::start(NodeConfig::loopback(ClusterToken::random())).unwrap();
        let (endpoint, parts) = sender_breaking_halfway(&node, &m, how);
        let wholes = refit_runtime::mesh::wholes(&m);
        let mut r =
            MeshReceiver::new(&m, vec![(endpoint, parts)], wholes, token_of(&node)).unwrap();
        let mut ws = refit_runtime::WeightSet::zeroed(policy(), Arc::clone(&m));
        let deadline = Duration::from_secs(2);
        let started = std::time::Instant::now();
        let e = r
            .pull_weights(&mut ws, Version(1), deadline)
            .unwrap_err()
            .to_string();
        let took = started.elapsed();
        assert!(
            e.contains(&endpoint.addr.to_string()),
            "names the shard: {e}"
        );
        assert!(
            e.contains("mid-transfer") || e.contains("deadline"),
            "says the stream broke: {e}"
        );
        assert!(
            took < deadline + Duration::from_secs(3),
            "took {took:?}: {e}"
        );
        assert_eq!(
            ws.version(),
            Version::ZERO,
            "the failed version is not taken"
        );
        assert_eq!(r.bytes_pulled(), 0, "nothing of it counts as pulled");
        let e = r.pull(Version(1), deadline).unwrap_err().to_string();
        assert!(e.contains(&endpoint.addr.to_string()), "{e}");
    }
}
