//! The adapters driven through the core's in-memory transport, bytes checked against a
//! conversion written out element by element.
use std::time::Duration;

use half::bf16;

use super::*;
use crate::cast::CastTo;
use crate::dtype::DType;
use crate::inproc::InProc;
use crate::scheme::{ReceiverInit, SenderInit, deadline_in};

const LONG: Duration = Duration::from_secs(30);
const H: usize = 8;
const KV: usize = 4;
const FF: usize = 16;

fn id(s: &str) -> ModelId {
    ModelId::new(s).unwrap()
}

fn trainer() -> Arc<Manifest> {
    Arc::new(
        Manifest::builder()
            .tensor("layers.0.q", DType::F32, &[H, H])
            .tensor("layers.0.k", DType::F32, &[KV, H])
            .tensor("layers.0.v", DType::F32, &[KV, H])
            .tensor("layers.0.o", DType::F32, &[H, H])
            .tensor("layers.0.gate", DType::F32, &[FF, H])
            .tensor("layers.0.up", DType::F32, &[FF, H])
            .tensor("layers.0.down", DType::F32, &[H, FF])
            .build()
            .unwrap(),
    )
}

/// An engine's wants as vLLM lays out a Llama: fused q/k/v and gate/up, its names, bf16.
fn want() -> Want {
    Want::new()
        .layout(
            LayoutRules::new()
                .fuse(
                    ["layers.{i}.q", "layers.{i}.k", "layers.{i}.v"],
                    "model.layers.{i}.qkv",
                    0,
                )
                .rename("layers.{i}.o", "model.layers.{i}.o")
                .fuse(
                    ["layers.{i}.gate", "layers.{i}.up"],
                    "model.layers.{i}.gate_up",
                    0,
                )
                .rename("layers.{i}.down", "model.layers.{i}.down"),
        )
        .cast(CastRules::new().dtype(DType::F32, CastTo::BF16))
}

fn wants() -> Wants {
    Wants::new().model(id("policy"), want())
}

fn manifests(m: &Arc<Manifest>) -> Manifests {
    crate::testing::manifests(&[("policy", m)])
}

/// Trainer weights whose every element differs (and needs rounding to bf16).
fn weights(m: &Arc<Manifest>, version: u64) -> WeightSet {
    let mut w = WeightSet::zeroed(id("policy"), Arc::clone(m));
    for t in m.tensors() {
        for (i, x) in w.view_mut::<f32>(&t.name).unwrap().iter_mut().enumerate() {
            *x = version as f32 + i as f32 / 3.0 + t.offset as f32 / 7.0;
        }
    }
    w.set_version(Version(version));
    w
}

/// The engine's tensors, written out: q, k, v rows one after the other, each rounded.
fn reference(w: &WeightSet) -> Vec<(String, Vec<u16>)> {
    let bits = |names: &[&str]| -> Vec<u16> {
        names
            .iter()
            .flat_map(|n| w.view::<f32>(n).unwrap().iter())
            .map(|&x| bf16::from_f32(x).to_bits())
            .collect()
    };
    vec![
        (
            "model.layers.0.qkv".into(),
            bits(&["layers.0.q", "layers.0.k", "layers.0.v"]),
        ),
        ("model.layers.0.o".into(), bits(&["layers.0.o"])),
        (
            "model.layers.0.gate_up".into(),
            bits(&["layers.0.gate", "layers.0.up"]),
        ),
        ("model.layers.0.down".into(), bits(&["layers.0.down"])),
    ]
}

fn check(engine: &WeightSet, trainer: &WeightSet) {
    assert_eq!(engine.version(), trainer.version());
    assert_eq!(engine.manifest().len(), 4);
    for (name, want) in reference(trainer) {
        let got: Vec<u16> = engine
            .view::<bf16>(&name)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn a_plan_gives_the_engines_manifest_and_bytes() {
    let m = trainer();
    let c = Conversions::plan(&manifests(&m), &wants()).unwrap();
    let target = c.target().get(&id("policy")).unwrap();
    let qkv = target.get("model.layers.0.qkv").unwrap();
    assert_eq!(
        (qkv.dtype, qkv.shape.clone()),
        (DType::BF16, vec![H + 2 * KV, H])
    );
    let w = Arc::new(weights(&m, 3));
    let out = c.apply_group(&vec![Arc::clone(&w)]).unwrap();
    check(&out[0], &w);
    // a want for a model the trainer does not have, and rules that do not fit, are refused
    let ghost = Wants::new().model(id("ghost"), want());
    let e = Conversions::plan(&manifests(&m), &ghost).unwrap_err();
    assert!(matches!(e, Error::UnknownModel(_)), "{e}");
    let bad = Wants::new().model(
        id("policy"),
        Want::new().layout(LayoutRules::new().rename("layers.{i}.rope", "x.{i}")),
    );
    let e = Conversions::plan(&manifests(&m), &bad).unwrap_err();
    assert!(e.to_string().contains("matches no tensor"), "{e}");
    // no want: the same Arc passes
    let plain = Conversions::plan(&manifests(&m), &Wants::new()).unwrap();
    assert!(Arc::ptr_eq(
        &plain.apply_group(&vec![Arc::clone(&w)]).unwrap()[0],
        &w
    ));
}

#[test]
fn receiver_side_converts_and_refuses_bad_input_whole() {
    let m = trainer();
    let hub = InProc::new();
    let rx = ConvertingReceiver::new(hub.receiver(), wants());
    let joiner = std::thread::spawn(move || ReceiverInit::new(rx, None).connect(LONG));
    let mut tx = SenderInit::new(hub.sender().unwrap(), manifests(&m))
        .with_ack_timeout(LONG)
        .connect(vec![weights(&m, 1)], LONG)
        .unwrap();
    let mut rx = joiner.join().unwrap().unwrap();
    // the receiver's manifests are the converted ones
    let served = rx.manifests().get(&id("policy")).unwrap();
    assert!(served.get("model.layers.0.qkv").is_some());
    check(&rx.current(&id("policy")).unwrap(), &weights(&m, 1));
    let _pending = tx.send_async(vec![weights(&m, 2)]).unwrap();
    rx.receive(LONG).unwrap().unwrap();
    check(&rx.current(&id("policy")).unwrap(), &weights(&m, 2));
    assert_eq!(rx.transport().stats().groups, 2);
    // trainer weights of another shape, published past the sender's checks: refused, naming
    // the tensor; version 2 stays served
    let other = Arc::new(
        Manifest::builder()
            .tensor("layers.0.q", DType::F32, &[H, H + 1])
            .build()
            .unwrap(),
    );
    tx.transport_mut()
        .publish(&vec![Arc::new(weights(&other, 3))], deadline_in(LONG))
        .unwrap();
    let e = rx.receive(LONG).unwrap_err();
    assert!(e.to_string().contains("layers.0.q"), "{e}");
    assert_eq!(rx.version(&id("policy")), Version(2));
    check(&rx.current(&id("policy")).unwrap(), &weights(&m, 2));
    let _pending = tx.send_async(vec![weights(&m, 4)]).unwrap();
    rx.receive(LONG).unwrap().unwrap();
    check(&rx.current(&id("policy")).unwrap(), &weights(&m, 4));
}

#[test]
fn sender_side_converts_once_and_receivers_see_the_engines_layout() {
    let m = trainer();
    let conversions = Conversions::plan(&manifests(&m), &wants()).unwrap();
    let target = conversions.target().clone();
    let source = conversions.source().clone();
    let hub = InProc::new();
    let rx = hub.receiver();
    let expected = target.clone();
    let joiner = std::thread::spawn(move || ReceiverInit::new(rx, Some(expected)).connect(LONG));
    let mut tx = SenderInit::new(
        ConvertingSender::new(hub.sender().unwrap(), conversions),
        source,
    )
    .with_ack_timeout(LONG)
    .connect(vec![weights(&m, 1)], LONG)
    .unwrap();
    let mut rx = joiner.join().unwrap().unwrap();
    check(&rx.current(&id("policy")).unwrap(), &weights(&m, 1));
    let pending = tx.send_async(vec![weights(&m, 2)]).unwrap();
    rx.receive(LONG).unwrap().unwrap();
    tx.wait(&pending, LONG).unwrap();
    check(&rx.current(&id("policy")).unwrap(), &weights(&m, 2));
    let stats = tx.transport().stats();
    assert_eq!(stats.groups, 2);
    assert_eq!(stats.source_bytes, 2 * m.payload_len() as u64);
    // the sender's admission still checks the trainer's layout, before converting
    let mut engine_layout = WeightSet::zeroed(id("policy"), target_of(&target));
    engine_layout.set_version(Version(3));
    let e = tx.send_async(vec![engine_layout]).unwrap_err();
    assert!(e.to_string().contains("tensor"), "{e}");
    assert_eq!(tx.transport().stats().groups, 2);
}

fn target_of(ms: &Manifests) -> Arc<Manifest> {
    Arc::clone(ms.get(&id("policy")).unwrap())
}

#[test]
fn recycled_arenas_never_change_a_version_someone_holds() {
    let m = trainer();
    let c = Conversions::plan(&manifests(&m), &wants()).unwrap();
    let convert = |v| {
        let w = Arc::new(weights(&m, v));
        c.apply_group(&vec![w]).unwrap().remove(0)
    };
    let held = convert(1);
    for v in 2..=8 {
        // every other version is dropped at once, so its arena comes back for the next one
        let w = convert(v);
        check(&w, &weights(&m, v));
        check(&held, &weights(&m, 1));
    }
    let a = convert(9);
    let a_ptr = a.bytes().as_ptr();
    drop(a);
    let b = convert(10);
    assert_eq!(b.bytes().as_ptr(), a_ptr, "a free arena is reused");
    check(&b, &weights(&m, 10));
}

/// A layout then a cast: read in one pass from the trainer's bytes where the layout allows
/// it (renames, fuses and splits along any axis), through a laid-out copy where it does not
/// (a transpose, per-block scales over a fused tensor); either way the bytes are those of
/// the layout applied first and the cast applied to its result.
#[test]
fn a_layout_then_a_cast_in_one_pass_equals_the_two_steps() {
    use crate::cast::{CastRules, Overflow, Scaling};
    let m = Arc::new(
        Manifest::builder()
            .tensor("l.0.q", DType::F32, &[6, 10])
            .tensor("l.0.k", DType::F32, &[3, 10])
            .tensor("l.0.a", DType::F32, &[4, 3])
            .tensor("l.0.b", DType::F32, &[4, 5])
            .tensor("l.0.ab", DType::F32, &[4, 8])
            .tensor("l.0.t", DType::F32, &[5, 7])
            .tensor("l.0.n", DType::BF16, &[9])
            .tensor("steps", DType::I64, &[])
            .build()
            .unwrap(),
    );
    let mut w = WeightSet::zeroed(id("policy"), Arc::clone(&m));
    for t in m.tensors() {
        match t.dtype {
            DType::F32 => {
                for (i, x) in w.view_mut::<f32>(&t.name).unwrap().iter_mut().enumerate() {
                    *x = (i as f32 - 7.5) * (1.0 + t.offset as f32 / 977.0);
                }
            }
            DType::BF16 => {
                for (i, x) in w.view_mut::<bf16>(&t.name).unwrap().iter_mut().enumerate() {
                    *x = bf16::from_f32(i as f32 * -0.3);
                }
            }
            _ => w.view_mut::<i64>(&t.name).unwrap()[0] = 77,
        }
    }
    w.set_version(Version(9));
    let layout = || {
        LayoutRules::new()
            .fuse(["l.{i}.q", "l.{i}.k"], "m.{i}.qk", 0)
            .fuse(["l.{i}.a", "l.{i}.b"], "m.{i}.ab", 1)
            .split("l.{i}.ab", ["m.{i}.x", "m.{i}.y"], 1)
            .rename("l.{i}.n", "m.{i}.n")
            .keep_unmatched()
    };
    let e4 = |scaling| CastTo::E4M3 {
        scaling,
        overflow: Overflow::Saturate,
    };
    let block = Scaling::PerBlock { rows: 2, cols: 3 };
    let casts: Vec<(CastRules, bool)> = vec![
        (CastRules::new().dtype(DType::F32, CastTo::BF16), true),
        (
            CastRules::new()
                .dtype(DType::F32, e4(Scaling::PerTensor))
                .tensors("m.0.n", CastTo::F32),
            true,
        ),
        (
            CastRules::new()
                .tensors("m.0.{p}", e4(Scaling::None))
                .tensors("l.0.t", e4(block)),
            true,
        ),
        // per-block scales over a fused tensor: through the laid-out copy
        (CastRules::new().tensors("m.0.qk", e4(block)), false),
    ];
    for (rules, one_pass) in casts {
        let want = Want::new().layout(layout()).cast(rules);
        let c = Conversion::new(&m, &want).unwrap();
        assert_eq!(c.runs.is_some(), one_pass);
        let two_steps = c
            .cast()
            .unwrap()
            .apply(&c.layout().unwrap().apply(&w).unwrap())
            .unwrap();
        for got in [
            c.apply(&w).unwrap(),
            (*c.apply_shared(&w).unwrap()).clone(),
            (*c.apply_shared(&w).unwrap()).clone(),
        ] {
            assert_eq!(got.version(), Version(9));
            assert!(got.bytes() == two_steps.bytes(), "one pass: {one_pass}");
        }
    }
    // a transpose reorders elements: the laid-out copy again, same bytes
    let want = Want::new()
        .layout(
            LayoutRules::new()
                .transpose("l.0.t", "m.0.t")
                .keep_unmatched(),
        )
        .cast(CastRules::new().dtype(DType::F32, CastTo::F16));
    let c = Conversion::new(&m, &want).unwrap();
    assert!(c.runs.is_none());
    let two_steps = c
        .cast()
        .unwrap()
        .apply(&c.layout().unwrap().apply(&w).unwrap())
        .unwrap();
    assert!(c.apply(&w).unwrap().bytes() == two_steps.bytes());
}
