//! The weight links of a run, in one process over real shared memory, real TCP sockets and
//! a real broadcast chain: one sender per transport on the trainer's side, inlets connected
//! from specs shipped as bytes, conversions on the send path.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use refit_node::{ClusterToken, Node};
use refit_runtime::topology::{Reach, TransportKind};
use refit_runtime::{Manifests, Version, WeightSet, wire};
use refit_transports::link::ReceiverSpec;

use super::*;
use crate::collector::policy_model_id;
use crate::policy::MlpPolicy;

/// The opened links of `kinds` (counts of 1), connected: the outlet, the specs, the files.
fn open(
    node: &Node,
    initial: &WeightSet,
    kinds: &[TransportKind],
) -> (Box<dyn WeightOutlet>, Vec<ReceiverSpec>, Leftovers) {
    let kinds: Vec<(TransportKind, usize)> = kinds.iter().map(|k| (k.clone(), 0)).collect();
    let opened = open_links(node, initial, None, &kinds, false).unwrap();
    let specs = opened.specs.clone();
    let leftovers = Leftovers(opened.leftovers.clone());
    (opened.connect(initial, WAIT).unwrap(), specs, leftovers)
}

const WAIT: Duration = Duration::from_secs(20);

fn weights(version: u64, fill: f32) -> WeightSet {
    let m = Arc::new(MlpPolicy::manifest_for(&[4, 8, 2]).unwrap());
    refit_runtime::testing::filled(&policy_model_id(), &m, version, fill)
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
    let (mut outlet, specs, leftovers) = open(&trainer_node, &initial, &kinds);
    assert_eq!(specs.len(), 2);
    assert!(!leftovers.0.is_empty());
    assert!(leftovers.0.iter().all(|p| p.exists()));
    // the descriptions travel as bytes (through the rendezvous store in a run)
    let shipped: Vec<ReceiverSpec> =
        wire::decode(&wire::encode(&specs).unwrap(), wire::MAX_CONTROL_MESSAGE).unwrap();
    let model = policy_model_id();
    // two inlets per transport: one sender serves them all
    let mut inlets: Vec<_> = shipped
        .iter()
        .flat_map(|spec| [spec.clone(), spec.clone()])
        .map(|spec| {
            connect_inlet(
                &model,
                &spec,
                &engine_node,
                manifests.clone(),
                WAIT,
                Deltas::default(),
                Apply::Staged,
            )
            .unwrap()
        })
        .collect();
    for inlet in &mut inlets {
        let w = inlet.fetch(&model, Version(1), WAIT).unwrap();
        assert_eq!(w.version(), Version(1));
    }
    for v in 2..=4 {
        outlet.publish(Arc::new(weights(v, v as f32))).unwrap();
        for inlet in &mut inlets {
            let w = inlet.fetch(&model, Version(v), WAIT).unwrap();
            assert_eq!(w.version(), Version(v));
            let first = w.view::<f32>(&w.manifest().tensors()[0].name).unwrap()[0];
            assert_eq!(first, v as f32);
        }
    }
    let segments = leftovers.0.clone();
    drop(inlets);
    drop(outlet);
    drop(leftovers);
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
    let opened = open_links(&trainer_node, &initial, None, &kinds, false).unwrap();
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
                let inlet = connect_inlet(
                    &model,
                    &spec,
                    &node,
                    manifests,
                    WAIT,
                    Deltas::default(),
                    Apply::Staged,
                )
                .unwrap();
                (inlet, node)
            })
        })
        .collect();
    let mut outlet = opened.connect(&initial, WAIT).unwrap();
    let mut inlets: Vec<_> = joining.into_iter().map(|j| j.join().unwrap()).collect();
    for (inlet, _) in &mut inlets {
        let w = inlet.fetch(&model, Version(1), WAIT).unwrap();
        assert_eq!(w.version(), Version(1));
        inlet.applied(&model, Version(1)).unwrap();
    }
    for v in 2..=4 {
        outlet.publish(Arc::new(weights(v, v as f32))).unwrap();
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
    let (_outlet, specs, _leftovers) = open(&node, &initial, &kinds);
    let other = Arc::new(MlpPolicy::manifest_for(&[4, 16, 2]).unwrap());
    let expected = Manifests::new([(policy_model_id(), other)]).unwrap();
    let e = match connect_inlet(
        &policy_model_id(),
        &specs[0],
        &node,
        expected,
        WAIT,
        Deltas::default(),
        Apply::Staged,
    ) {
        Ok(_) => panic!("a sender of another layout was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("policy") && e.contains("shm"), "{e}");
}

/// An engine beside its trainer is fed through the in-process link: the same spec path,
/// no copy.
#[test]
fn an_inproc_link_feeds_an_inlet_of_the_same_process() {
    let initial = weights(1, 1.0);
    let kind = TransportKind::Nearest(Reach::Process);
    let (mut outlet, mut inlet, transport) = joined(&initial, kind, Apply::Staged);
    assert_eq!(transport, "inproc");
    let model = policy_model_id();
    let published = Arc::new(weights(2, 2.0));
    outlet.publish(Arc::clone(&published)).unwrap();
    let got = inlet.fetch(&model, Version(2), WAIT).unwrap();
    assert!(Arc::ptr_eq(&got, &published), "the in-process link copied");
}

/// A model whose engines want another layout (fused, bf16) is converted once on the send
/// path: the engines' inlets expect the converted manifests and read converted values.
#[test]
fn a_wanted_layout_is_converted_on_the_send_path() {
    use refit_runtime::convert::Want;
    use refit_runtime::{CastRules, DType, LayoutRules, cast::CastTo};
    let token = ClusterToken::new("cluster-links-test-token").unwrap();
    let node = Node::loopback(token).unwrap();
    let initial = weights(1, 1.5);
    let want = Want::new()
        .layout(
            LayoutRules::new()
                .fuse(["pi.0.bias", "pi.2.bias"], "pi.biases", 0)
                .keep_unmatched(),
        )
        .cast(CastRules::new().dtype(DType::F32, CastTo::BF16));
    let (engine_side, conversions) = plan(&initial, Some(want)).unwrap();
    let m = engine_side.get(&policy_model_id()).unwrap();
    let fused = m.get("pi.biases").unwrap();
    assert_eq!((fused.dtype, fused.shape.clone()), (DType::BF16, vec![10]));
    let kinds = vec![(TransportKind::Named("shm".into()), 0)];
    let opened = open_links(&node, &initial, conversions.as_ref(), &kinds, false).unwrap();
    let spec = opened.specs[0].clone();
    let leftovers = Leftovers(opened.leftovers.clone());
    let mut outlet = opened.connect(&initial, WAIT).unwrap();
    let model = policy_model_id();
    let mut inlet = connect_inlet(
        &model,
        &spec,
        &node,
        engine_side.clone(),
        WAIT,
        Deltas::default(),
        Apply::Staged,
    )
    .unwrap();
    outlet.publish(Arc::new(weights(2, 2.5))).unwrap();
    let got = inlet.fetch(&model, Version(2), WAIT).unwrap();
    let v = got.view::<half::bf16>("pi.biases").unwrap();
    assert!(v.iter().all(|x| x.to_f32() == 2.5));
    // a want that does not fit the trainer's tensors is refused, naming the model
    let bad = Want::new().layout(LayoutRules::new().rename("nope.weight", "x"));
    let e = plan(&initial, Some(bad)).unwrap_err().to_string();
    assert!(e.contains("`policy`") && e.contains("nope.weight"), "{e}");
    drop((inlet, outlet, leftovers));
}

/// `[links] checksum = true`: a version damaged in shared memory after the trainer wrote it
/// is refused by the engine's inlet, naming the checksum; without it the damage is served
/// (what makes this test able to fail).
#[test]
fn a_checksummed_shm_link_refuses_a_version_damaged_in_its_slot() {
    use std::io::{Seek, SeekFrom, Write};
    for checksum in [true, false] {
        let token = ClusterToken::new("cluster-links-test-token").unwrap();
        let node = Node::loopback(token).unwrap();
        let initial = weights(1, 1.0);
        let manifests =
            Manifests::new([(policy_model_id(), Arc::clone(initial.manifest()))]).unwrap();
        let kinds = vec![(TransportKind::Named("shm".into()), 1)];
        let opened = open_links(&node, &initial, None, &kinds, checksum).unwrap();
        let spec = opened.specs[0].clone();
        let data = opened
            .leftovers
            .iter()
            .find(|p| p.to_string_lossy().ends_with("-m0"))
            .cloned()
            .unwrap();
        let model = policy_model_id();
        let (m2, node2) = (model.clone(), node.clone());
        let joining = std::thread::spawn(move || {
            connect_inlet(
                &m2,
                &spec,
                &node2,
                manifests,
                WAIT,
                Deltas::default(),
                Apply::Staged,
            )
        });
        let mut outlet = opened.connect(&initial, WAIT).unwrap();
        let mut inlet = joining.join().unwrap().unwrap();
        inlet.fetch(&model, Version(1), WAIT).unwrap();
        outlet.publish(Arc::new(weights(2, 7.0))).unwrap();
        // the first bytes of version 2 (every value 7.0), changed in the slot
        let pattern = 7.0f32.to_le_bytes().repeat(8);
        let bytes = std::fs::read(&data).unwrap();
        let at = bytes
            .windows(pattern.len())
            .position(|w| w == pattern)
            .unwrap();
        let mut f = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
        f.seek(SeekFrom::Start(at as u64 + 1)).unwrap();
        f.write_all(&[0x55]).unwrap();
        let got = inlet.fetch(&model, Version(2), Duration::from_secs(2));
        if checksum {
            let e = got.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("checksum"), "{e}");
        } else {
            let w = got.unwrap();
            let first = w.view::<f32>(&w.manifest().tensors()[0].name).unwrap()[0];
            assert_ne!(first, 7.0);
        }
    }
}

/// A model with `apply = "streaming"` over TCP: the inlet holds the version in force until
/// the first stream takes it, then hands each later version over tensor by tensor, every
/// tensor bit-identical, and keeps no copy; acknowledging goes through the same inlet.
#[test]
fn a_streaming_tcp_inlet_hands_each_version_over_tensor_by_tensor() {
    let initial = weights(1, 1.0);
    let kind = TransportKind::Named("tcp".into());
    let (mut outlet, mut inlet, _) = joined(&initial, kind, Apply::Streaming);
    let model = policy_model_id();
    // what the engine's model holds, tensor by tensor
    let mut model_now = WeightSet::zeroed(model.clone(), Arc::clone(initial.manifest()));
    let stream = |inlet: &mut Box<dyn WeightInlet>, at_least: u64, into: &mut WeightSet| {
        let mut count = 0;
        let v = inlet
            .stream(&model, Version(at_least), WAIT, &mut |one| {
                assert_eq!(one.manifest().len(), 1, "one tensor at a time");
                let t = &one.manifest().tensors()[0];
                into.tensor_bytes_mut(&t.name)?
                    .copy_from_slice(&one.bytes()[t.range()]);
                count += 1;
                Ok(())
            })
            .unwrap();
        into.set_version(v);
        (v, count)
    };
    let tensors = initial.manifest().len();
    assert_eq!(stream(&mut inlet, 1, &mut model_now), (Version(1), tensors));
    assert_eq!(model_now.bytes(), initial.bytes());
    // the version in force was handed over: fetch has nothing whole to give any more
    assert!(inlet.fetch(&model, Version(1), WAIT).is_err());
    inlet.applied(&model, Version(1)).unwrap();
    let v2 = weights(2, 2.5);
    outlet.publish(Arc::new(v2.to_owned_copy())).unwrap();
    assert_eq!(stream(&mut inlet, 2, &mut model_now), (Version(2), tensors));
    assert_eq!(model_now.bytes(), v2.bytes(), "v2 landed bit-identical");
    inlet.applied(&model, Version(2)).unwrap();
}

/// A trainer's outlet of `initial` over the transport `kind` and one engine's inlet of it
/// taking versions in by `apply`, each on a node of its own, connected together; the
/// transport's name beside them.
fn joined(
    initial: &WeightSet,
    kind: TransportKind,
    apply: Apply,
) -> (Box<dyn WeightOutlet>, Box<dyn WeightInlet>, &'static str) {
    let token = ClusterToken::new("cluster-links-test-token").unwrap();
    let trainer_node = Node::loopback(token.clone()).unwrap();
    let engine_node = Node::loopback(token).unwrap();
    let manifests = Manifests::new([(policy_model_id(), Arc::clone(initial.manifest()))]).unwrap();
    let opened = open_links(&trainer_node, initial, None, &[(kind, 1)], false).unwrap();
    let spec = opened.specs[0].clone();
    let transport = link::find(spec.transport()).unwrap().name();
    let joining = std::thread::spawn(move || {
        let model = policy_model_id();
        connect_inlet(
            &model,
            &spec,
            &engine_node,
            manifests,
            WAIT,
            Deltas::default(),
            apply,
        )
    });
    let outlet = opened.connect(initial, WAIT).unwrap();
    (outlet, joining.join().unwrap().unwrap(), transport)
}
