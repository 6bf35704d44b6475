//! The weight links of a topology spread over processes: one sender per transport on the
//! trainer's side, inlets connected from the descriptions shipped through the store, and a
//! new version fetched through each (here in one process, over real shared memory and real
//! TCP sockets).
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use refit_actors::actor::cluster::links;
use refit_actors::{MlpPolicy, policy_model_id};
use refit_node::{ClusterToken, Node};
use refit_runtime::topology::{Reach, TransportKind};
use refit_runtime::{Manifests, Version, WeightSet, wire};
use refit_transports::link::ReceiverSpec;

const WAIT: Duration = Duration::from_secs(20);

fn weights(version: u64, fill: f32) -> WeightSet {
    let m = Arc::new(MlpPolicy::manifest_for(&[4, 8, 2]).unwrap());
    let mut ws = WeightSet::zeroed(policy_model_id(), m.clone());
    for t in m.tensors() {
        ws.view_mut::<f32>(&t.name).unwrap().fill(fill);
    }
    ws.set_version(Version(version));
    ws
}

#[test]
fn one_sender_per_transport_serves_every_inlet_and_leaves_no_segment() {
    let token = ClusterToken::new("cluster-links-test-token").unwrap();
    let trainer_node = Node::loopback(token.clone()).unwrap();
    let engine_node = Node::loopback(token).unwrap();
    let initial = weights(1, 1.0);
    let manifests = Manifests::new([(policy_model_id(), Arc::clone(initial.manifest()))]).unwrap();
    let shm = TransportKind::Named("shm".into());
    let kinds = [shm.clone(), TransportKind::Nearest(Reach::Network), shm];
    let mut out = links::open_outlets(&trainer_node, &initial, &kinds, WAIT).unwrap();
    assert_eq!(out.specs.len(), 2);
    assert!(!out.leftovers.is_empty());
    assert!(out.leftovers.iter().all(|p| p.exists()));
    // the descriptions travel as bytes (through the rendezvous store in a run)
    let shipped: Vec<ReceiverSpec> = wire::decode(
        &wire::encode(&out.specs).unwrap(),
        wire::MAX_CONTROL_MESSAGE,
    )
    .unwrap();
    let model = policy_model_id();
    // two inlets per transport: one sender serves them all
    let mut inlets: Vec<_> = shipped
        .iter()
        .flat_map(|spec| [spec.clone(), spec.clone()])
        .map(|spec| {
            links::connect_inlet(&model, &spec, &engine_node, manifests.clone(), WAIT).unwrap()
        })
        .collect();
    for inlet in &mut inlets {
        let w = inlet.fetch(&model, Version(1), WAIT).unwrap();
        assert_eq!(w.version(), Version(1));
    }
    for v in 2..=4 {
        out.outlet.publish(Arc::new(weights(v, v as f32))).unwrap();
        for inlet in &mut inlets {
            let w = inlet.fetch(&model, Version(v), WAIT).unwrap();
            assert_eq!(w.version(), Version(v));
            let first = w.view::<f32>(&w.manifest().tensors()[0].name).unwrap()[0];
            assert_eq!(first, v as f32);
        }
    }
    let segments = out.leftovers.clone();
    drop(inlets);
    drop(out);
    links::remove_leftovers(&segments);
    assert!(segments.iter().all(|p| !p.exists()), "{segments:?}");
}

/// A broadcast link waits at connect for the receivers it was opened for: rank 0 ships the
/// spec first, the inlets join while the sender connects, and each inlet acknowledges what
/// its engine serves (version 1, already acknowledged at connect, included).
#[test]
fn a_broadcast_link_connects_once_its_engines_join_and_serves_them_every_version() {
    let token = ClusterToken::new("cluster-links-test-token").unwrap();
    let trainer_node = Node::loopback(token.clone()).unwrap();
    let initial = weights(1, 1.0);
    let manifests = Manifests::new([(policy_model_id(), Arc::clone(initial.manifest()))]).unwrap();
    let kinds = [(TransportKind::Named("broadcast".into()), 2)];
    let opened = links::open_links(&trainer_node, &initial, &kinds).unwrap();
    assert_eq!(opened.specs.len(), 1);
    let shipped: Vec<ReceiverSpec> = wire::decode(
        &wire::encode(&opened.specs).unwrap(),
        wire::MAX_CONTROL_MESSAGE,
    )
    .unwrap();
    let model = policy_model_id();
    let joining: Vec<_> = (0..2)
        .map(|_| {
            let (spec, manifests, model) = (shipped[0].clone(), manifests.clone(), model.clone());
            let node = Node::loopback(token.clone()).unwrap();
            std::thread::spawn(move || {
                let inlet = links::connect_inlet(&model, &spec, &node, manifests, WAIT).unwrap();
                (inlet, node)
            })
        })
        .collect();
    let mut out = opened.connect(&initial, WAIT).unwrap();
    let mut inlets: Vec<_> = joining.into_iter().map(|j| j.join().unwrap()).collect();
    for (inlet, _) in &mut inlets {
        let w = inlet.fetch(&model, Version(1), WAIT).unwrap();
        assert_eq!(w.version(), Version(1));
        inlet.applied(&model, Version(1)).unwrap();
    }
    for v in 2..=4 {
        out.outlet.publish(Arc::new(weights(v, v as f32))).unwrap();
        for (inlet, _) in &mut inlets {
            let w = inlet.fetch(&model, Version(v), WAIT).unwrap();
            assert_eq!(w.version(), Version(v));
            let first = w.view::<f32>(&w.manifest().tensors()[0].name).unwrap()[0];
            assert_eq!(first, v as f32);
            inlet.applied(&model, Version(v)).unwrap();
        }
    }
    // a version never delivered cannot be acknowledged
    let e = inlets[0]
        .0
        .applied(&model, Version(9))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("version 9") && e.contains("never received"),
        "{e}"
    );
}

#[test]
fn an_inlet_of_another_layout_is_refused_naming_the_model() {
    let token = ClusterToken::new("cluster-links-test-token").unwrap();
    let node = Node::loopback(token).unwrap();
    let initial = weights(1, 1.0);
    let kinds = [TransportKind::Nearest(Reach::Host)];
    let out = links::open_outlets(&node, &initial, &kinds, WAIT).unwrap();
    let other = Arc::new(MlpPolicy::manifest_for(&[4, 16, 2]).unwrap());
    let expected = Manifests::new([(policy_model_id(), other)]).unwrap();
    let e = match links::connect_inlet(&policy_model_id(), &out.specs[0], &node, expected, WAIT) {
        Ok(_) => panic!("a sender of another layout was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("policy") && e.contains("shm"), "{e}");
    let inproc = [TransportKind::Named("inproc".into())];
    let e = links::open_outlets(&node, &initial, &inproc, WAIT)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("inproc") && e.contains("cannot cross processes"),
        "{e}"
    );
    let segments = out.leftovers.clone();
    drop(out);
    links::remove_leftovers(&segments);
}

fn two_rank_topology(rank0_roles: &str) -> refit_runtime::topology::Topology {
    refit_runtime::topology::Topology::parse(&format!(
        r#"
        [run]
        command = ["x", "topology"]
        [[model]]
        id = "policy"
        [[process]]
        name = "learner"
        roles = [{rank0_roles}]
        [[process]]
        name = "actor"
        roles = ["engine", "rollout"]
        "#
    ))
    .unwrap()
}

fn launch(rank: u32, world_size: u32) -> refit_node::LaunchEnv {
    refit_node::LaunchEnv {
        rank,
        world_size,
        master_addr: "127.0.0.1".into(),
        master_port: 29_999,
    }
}

#[test]
fn join_refuses_launch_variables_and_placements_that_do_not_fit_naming_them() {
    use refit_actors::CartPolePpo;
    use refit_actors::actor::cluster;
    let topo = two_rank_topology(r#""trainer", "controller""#);
    let e = cluster::join(&topo, &launch(0, 3), CartPolePpo::new())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("WORLD_SIZE is 3") && e.contains("2 ranks"),
        "{e}"
    );
    let e = cluster::join(&topo, &launch(2, 2), CartPolePpo::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("RANK"), "{e}");
    // an engine beside the trainer while other ranks hold engines too
    let topo = two_rank_topology(r#""trainer", "controller", "engine", "rollout""#);
    let e = cluster::join(&topo, &launch(0, 2), CartPolePpo::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 0 (process `learner`"), "{e}");
}
