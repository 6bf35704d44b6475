//! The link factory: for every registered transport, a sender end opened by name, its
//! receiver spec shipped through serde (JSON and the hex token), a receiver end connected
//! from the shipped copy, and two versions delivered with their bytes checked.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{manifest, manifests, stamped};
use refit_node::{ClusterToken, Node, NodeConfig};
use refit_runtime::{ReceiverInit, SenderInit, Version};
use refit_transports::broadcast::GroupEnd;
use refit_transports::collective::CpuConfig;
use refit_transports::cuda_ipc::{CudaIpcLink, HostSlots};
use refit_transports::link::{self, LINKS, LinkOptions, OpenedLink, ReceiverSpec};
use refit_transports::nccl::NcclLink;

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

/// The protocol of a GPU link, by its own code over a stand-in for the GPU (the CPU
/// collective for `nccl`, host memory for `cuda-ipc`): its spec shipped through JSON and
/// the hex token, a receiver joining from the shipped copy, v1 and v2 delivered.
fn protocol_round_trip<S, R>(
    open: impl FnOnce(&LinkOptions) -> (S, ReceiverSpec),
    join: impl FnOnce(&ReceiverSpec, &LinkOptions) -> R,
    name: &str,
) where
    S: refit_runtime::SenderTransport + 'static,
    R: refit_runtime::ReceiverTransport + Send + 'static,
{
    let m = manifest(8);
    let ms = manifests(&[("policy", &m)]);
    let options = LinkOptions {
        expected_receivers: 1,
        token: Some(ClusterToken::random()),
        ..LinkOptions::default()
    };
    let (sender, spec) = open(&options);
    assert_eq!(spec.transport(), name);
    let json = serde_json::to_string(&spec).unwrap();
    let shipped: ReceiverSpec = serde_json::from_str(&json).unwrap();
    let shipped = ReceiverSpec::from_token(&shipped.to_token().unwrap()).unwrap();
    assert_eq!(shipped, spec);
    let receiver = ReceiverInit::new(join(&shipped, &options), Some(ms.clone()));
    let r = std::thread::spawn(move || {
        let mut r = receiver.connect(WAIT).unwrap();
        let policy = common::id("policy");
        let got = loop {
            if let Some(u) = r.receive(WAIT).unwrap() {
                break u;
            }
        };
        assert_eq!(got.entries(), vec![(policy.clone(), Version(2))]);
        assert_eq!(
            r.current(&policy).unwrap().bytes(),
            stamped("policy", &manifest(8), 2).bytes()
        );
        r.shutdown().unwrap();
    });
    let mut sender = SenderInit::new(sender, ms)
        .connect(vec![stamped("policy", &m, 1)], WAIT)
        .unwrap();
    sender.send(stamped("policy", &m, 2)).unwrap();
    r.join().unwrap();
    sender.shutdown().unwrap();
}

fn cpu(end: &GroupEnd) -> CpuConfig {
    CpuConfig::new(end.token.clone()).with_bind(end.ip)
}

#[test]
fn nccl_spec_round_trips_and_connects_over_the_cpu_collective() {
    protocol_round_trip(
        |o| NcclLink.open_over(o, cpu).unwrap(),
        |spec, o| NcclLink.join_over(spec, o, cpu).unwrap(),
        "nccl",
    );
}

#[test]
fn cuda_ipc_spec_round_trips_and_connects_over_host_slots() {
    let ms = manifests(&[("policy", &manifest(8))]);
    protocol_round_trip(
        |o| {
            CudaIpcLink
                .open_over(&ms, o, Box::new(HostSlots::new()))
                .unwrap()
        },
        |spec, _| {
            CudaIpcLink
                .join_over(spec, Box::new(HostSlots::new()))
                .unwrap()
        },
        "cuda-ipc",
    );
}

/// Where the GPU links cannot run (CI: no `cuda` feature, or no GPU), the sender's open
/// and the receiver's creation both fail with the reason `usable` gives: "not compiled with
/// CUDA" naming the feature, or the probe's. (Where they can, `scripts/gpu-check.sh` runs
/// them on the GPU.)
#[test]
fn gpu_links_refuse_at_open_and_at_receiver_creation_with_the_reason() {
    let ms = manifests(&[("policy", &manifest(8))]);
    let options = LinkOptions {
        expected_receivers: 1,
        token: Some(ClusterToken::random()),
        ..LinkOptions::default()
    };
    let cpu_spec = NcclLink.open_over(&options, cpu).unwrap().1;
    let host_spec = CudaIpcLink
        .open_over(&ms, &options, Box::new(HostSlots::new()))
        .unwrap()
        .1;
    for (name, spec) in [("nccl", cpu_spec), ("cuda-ipc", host_spec)] {
        let l = link::find(name).unwrap();
        let Err(reason) = l.usable(&options) else {
            assert!(
                refit_transports::gpu::probe().is_ok(),
                "{name} usable without a GPU"
            );
            continue;
        };
        let reason = reason.to_string();
        if cfg!(feature = "cuda") {
            assert!(reason.contains("no usable GPU"), "{reason}");
        } else {
            assert!(
                reason.contains("not compiled with CUDA") && reason.contains("--features cuda"),
                "{reason}"
            );
            assert_eq!(l.built().unwrap_err().to_string(), reason);
        }
        let e = link::open(name, &ms, &options).unwrap_err().to_string();
        assert_eq!(e, reason);
        let e = spec.receiver(&options).map(|_| ()).unwrap_err().to_string();
        assert_eq!(e, reason);
    }
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
    let tested = [
        "inproc",
        "shm",
        "tcp",
        "file",
        "broadcast",
        "nccl",
        "cuda-ipc",
    ];
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

/// `[links] weights = "nccl"` / `"cuda-ipc"` and a model's own `link =` go through the
/// topology's real validation: known names with their reach (cuda-ipc one host, nccl the
/// network); without the `cuda` feature refused on the key that names them, with the
/// reason and how to build with it.
#[test]
fn topology_files_naming_gpu_links_validate_or_say_why_not() {
    use refit_runtime::topology::{Topology, TransportKind};
    let two_hosts = |links: &str, model_link: &str| {
        format!(
            "[run]\ncommand = [\"prog\"]\n[[model]]\nid = \"policy\"\n{model_link}\
             [[host]]\nname = \"a\"\naddr = \"10.0.0.1\"\n\
             [[host]]\nname = \"b\"\naddr = \"10.0.0.2\"\n\
             [[process]]\nname = \"learner\"\nhost = \"a\"\nroles = [\"trainer\", \"controller\"]\n\
             [[process]]\nname = \"near\"\nhost = \"a\"\nroles = [\"engine\", \"rollout\"]\n\
             [[process]]\nname = \"far\"\nhost = \"b\"\nroles = [\"engine\", \"rollout\"]\n\
             [links]\nweights = \"{links}\"\n"
        )
    };
    let one_host = |links: &str| {
        format!(
            "[run]\ncommand = [\"prog\"]\n[[model]]\nid = \"policy\"\n\
             [[process]]\nname = \"learner\"\nroles = [\"trainer\", \"controller\"]\n\
             [[process]]\nname = \"actor\"\nreplicas = 2\nroles = [\"engine\", \"rollout\"]\n\
             [links]\nweights = \"{links}\"\n"
        )
    };
    let not_compiled = |e: &str, key: &str, name: &str| {
        assert!(e.contains(key), "{e}");
        assert!(
            e.contains(&format!("{name} transport: not compiled with CUDA")),
            "{e}"
        );
        assert!(e.contains("--features cuda"), "{e}");
    };
    // trainer and engines on one host: both links reach
    for name in ["nccl", "cuda-ipc"] {
        let t = Topology::parse(&one_host(name)).unwrap();
        let checked = t.check_links(link::reach_of);
        if cfg!(feature = "cuda") {
            checked.unwrap();
            let kind = t.weights_transport(&t.model_ids()[0], 0, 1);
            assert_eq!(kind, TransportKind::Named(name.into()));
            assert_eq!(link::for_kind(&kind).unwrap().name(), name);
        } else {
            not_compiled(&checked.unwrap_err().to_string(), "links.weights", name);
        }
    }
    // engines on two hosts: nccl reaches the network, cuda-ipc one host only
    let t = Topology::parse(&two_hosts("nccl", "")).unwrap();
    let checked = t.check_links(link::reach_of);
    assert_eq!(checked.is_ok(), cfg!(feature = "cuda"), "{checked:?}");
    if let Err(e) = checked {
        not_compiled(&e.to_string(), "links.weights", "nccl");
    }
    let t = Topology::parse(&two_hosts("auto", "link = \"cuda-ipc\"\n")).unwrap();
    let e = t.check_links(link::reach_of).unwrap_err().to_string();
    if cfg!(feature = "cuda") {
        assert!(e.contains("model[policy].link"), "{e}");
        assert!(
            e.contains("`cuda-ipc`") && e.contains("process `far`") && e.contains("another host"),
            "{e}"
        );
    } else {
        not_compiled(&e, "model[policy].link", "cuda-ipc");
    }
}
