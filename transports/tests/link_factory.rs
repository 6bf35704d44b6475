//! The link factory: for every registered transport, a sender end opened by name, its
//! receiver spec shipped through serde (JSON and the hex token), a receiver end connected
//! from the shipped copy, and two versions delivered with their bytes checked.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{manifest, manifests, stamped};
use refit_node::{ClusterToken, Node, NodeConfig};
use refit_runtime::{ReceiverInit, SenderInit, Version};
use refit_transports::link::{self, LINKS, LinkOptions, OpenedLink, ReceiverSpec};

const WAIT: Duration = Duration::from_secs(30);

/// Opens `name`, ships its spec, connects one receiver, delivers v1 and v2.
fn round_trip(name: &str) {
    round_trip_on(name, |_| None);
}

/// As [`round_trip`], each end on the node `node(token)` makes (`None`: no node).
fn round_trip_on(name: &str, node: impl Fn(&ClusterToken) -> Option<Node>) {
    let m = manifest(8);
    let ms = manifests(&[("policy", &m)]);
    let token = ClusterToken::random();
    let options = LinkOptions {
        expected_receivers: 1,
        token: Some(token.clone()),
        node: node(&token),
        ..LinkOptions::default()
    };
    // ANCHOR: open_by_name
    let opened = link::open(name, &ms, &options).unwrap();
    assert_eq!(opened.spec.transport(), name);
    let leftovers = opened.leftovers.clone();
    // the spec travels as JSON and as a token, and comes back equal
    let json = serde_json::to_string(&opened.spec).unwrap();
    assert!(
        !json.contains(token.expose()),
        "a spec holds no secret: {json}"
    );
    assert!(
        !json.contains("0.0.0.0"),
        "a spec names an address peers reach: {json}"
    );
    let shipped: ReceiverSpec = serde_json::from_str(&json).unwrap();
    assert_eq!(shipped, opened.spec);
    let shipped = ReceiverSpec::from_token(&shipped.to_token().unwrap()).unwrap();
    assert_eq!(shipped, opened.spec);
    let receiver_options = LinkOptions {
        node: node(&token),
        token: Some(token),
        ..LinkOptions::default()
    };
    let receiver = ReceiverInit::new(
        shipped.receiver(&receiver_options).unwrap(),
        Some(ms.clone()),
    );
    // ANCHOR_END: open_by_name
    let r = std::thread::spawn(move || {
        let mut r = receiver.connect(WAIT).unwrap();
        let policy = common::id("policy");
        assert_eq!(r.version(&policy), Version(1));
        let got = loop {
            if let Some(u) = r.receive(WAIT).unwrap() {
                break u;
            }
        };
        assert_eq!(got.entries(), vec![(policy.clone(), Version(2))]);
        let v2 = r.current(&policy).unwrap();
        assert_eq!(v2.bytes(), stamped("policy", &manifest(8), 2).bytes());
        r.shutdown().unwrap();
    });
    let mut sender = SenderInit::new(opened.sender, ms)
        .connect(vec![stamped("policy", &m, 1)], WAIT)
        .unwrap();
    sender.send(stamped("policy", &m, 2)).unwrap();
    r.join().unwrap();
    sender.shutdown().unwrap();
    OpenedLink::cleanup(&leftovers);
    for p in &leftovers {
        assert!(!p.exists(), "{} left behind", p.display());
    }
}

#[test]
fn inproc_spec_round_trips_and_connects() {
    round_trip("inproc");
}

#[test]
fn shm_spec_round_trips_and_connects() {
    round_trip("shm");
}

#[test]
fn tcp_spec_round_trips_and_connects() {
    round_trip("tcp");
}

#[test]
fn file_spec_round_trips_and_connects() {
    round_trip("file");
}

#[test]
fn broadcast_spec_round_trips_and_connects() {
    round_trip("broadcast");
}

/// A node that listens on every interface (a rank with `bind = "0.0.0.0"`, in a container)
/// and advertises loopback, the address the other end reaches it at.
fn unspecified_node(token: &ClusterToken) -> Option<Node> {
    let config = NodeConfig::loopback(token.clone())
        .with_bind("0.0.0.0:0".parse().unwrap())
        .with_advertise("127.0.0.1:0".parse().unwrap());
    let node = Node::start(config).unwrap();
    assert!(node.addr().ip().is_unspecified());
    assert_eq!(node.advertised().port(), node.addr().port());
    Some(node)
}

#[test]
fn tcp_links_on_nodes_listening_on_every_interface_advertise_the_nodes_address() {
    // the sender's endpoint and the receiver's registration carry 127.0.0.1, never 0.0.0.0
    round_trip_on("tcp", unspecified_node);
}

#[test]
fn broadcast_links_on_nodes_listening_on_every_interface_listen_where_they_are_reached() {
    round_trip_on("broadcast", unspecified_node);
}

#[test]
fn every_registered_transport_is_tested_here() {
    let tested = ["inproc", "shm", "tcp", "file", "broadcast"];
    for l in LINKS {
        assert!(
            tested.contains(&l.name()),
            "transport {} has no round trip in this file",
            l.name()
        );
    }
}

#[test]
fn an_unknown_transport_is_refused_naming_the_known_ones() {
    let ms = manifests(&[("policy", &manifest(8))]);
    let e = link::open("rdma", &ms, &LinkOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown transport `rdma`"), "{e}");
    for l in LINKS {
        assert!(e.contains(l.name()), "{e}");
    }
}

#[test]
fn an_inproc_spec_whose_sender_is_gone_is_refused() {
    let ms = manifests(&[("policy", &manifest(8))]);
    let opened = link::open("inproc", &ms, &LinkOptions::default()).unwrap();
    let spec = opened.spec.clone();
    drop(opened);
    let e = spec
        .receiver(&LinkOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no sender"), "{e}");
}

#[test]
fn topology_files_name_any_registered_transport() {
    use refit_runtime::topology::{Topology, TransportKind};
    let file = |weights: &str| {
        format!(
            "[run]\ncommand = [\"prog\"]\n[[model]]\nid = \"policy\"\n\
             [[process]]\nname = \"learner\"\nroles = [\"trainer\", \"controller\"]\n\
             [[process]]\nname = \"actor\"\nroles = [\"engine\", \"rollout\"]\n\
             [links]\nweights = \"{weights}\"\n"
        )
    };
    // the file transport was never a topology value before the factory: it is now
    let t = Topology::parse(&file("file")).unwrap();
    t.check_links(link::reach_of).unwrap();
    let policy = t.model_ids()[0].clone();
    let kind = t.weights_transport(&policy, 0, 1);
    assert_eq!(kind, TransportKind::Named("file".into()));
    assert_eq!(link::for_kind(&kind).unwrap().name(), "file");
    // an unknown one is refused on `links.weights`, naming every known transport
    let t = Topology::parse(&file("rdma")).unwrap();
    let e = t.check_links(link::reach_of).unwrap_err().to_string();
    assert!(e.contains("links.weights") && e.contains("`rdma`"), "{e}");
    for l in LINKS {
        assert!(e.contains(l.name()), "{e}");
    }
    // one that stays in a process cannot reach the engine's
    let t = Topology::parse(&file("inproc")).unwrap();
    let e = t.check_links(link::reach_of).unwrap_err().to_string();
    assert!(e.contains("another process"), "{e}");
}
