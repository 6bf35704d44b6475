//! An engine with a fused-qkv, bf16 layout receives from an f32 trainer over real shared
//! memory and real TCP, with the conversion on the sender side and on the receiver side;
//! every byte is checked against the conversion written out element by element.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{id, shm_pair, tcp_pair};
use half::bf16;
use refit_runtime::cast::{CastRules, CastTo};
use refit_runtime::convert::{Conversions, ConvertingReceiver, ConvertingSender, Want, Wants};
use refit_runtime::{
    DType, LayoutRules, Manifest, Manifests, Receiver, ReceiverInit, ReceiverTransport, Sender,
    SenderInit, SenderTransport, Version, WeightSet,
};
use refit_transports::shm::{ShmReadMode, ShmReceiver, ShmSender};

const T: Duration = Duration::from_secs(30);
const LAYERS: usize = 2;
const H: usize = 64;
const KV: usize = 16;
const FFN: usize = 128;

/// The trainer's layout: separate q/k/v and gate/up projections, f32.
fn trainer() -> Arc<Manifest> {
    let mut b = Manifest::builder();
    for i in 0..LAYERS {
        let p = format!("layers.{i}");
        for (n, rows, cols) in [
            ("q_proj", H, H),
            ("k_proj", KV, H),
            ("v_proj", KV, H),
            ("o_proj", H, H),
            ("gate_proj", FFN, H),
            ("up_proj", FFN, H),
            ("down_proj", H, FFN),
        ] {
            b.push(format!("{p}.{n}.weight"), DType::F32, &[rows, cols]);
        }
    }
    Arc::new(b.build().unwrap())
}

/// The engine's layout as the engine declares it: fused qkv and gate_up, bf16.
fn engine() -> Arc<Manifest> {
    let mut b = Manifest::builder();
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        for (n, rows, cols) in [
            ("self_attn.qkv_proj", H + 2 * KV, H),
            ("self_attn.o_proj", H, H),
            ("mlp.gate_up_proj", 2 * FFN, H),
            ("mlp.down_proj", H, FFN),
        ] {
            b.push(format!("{p}.{n}.weight"), DType::BF16, &[rows, cols]);
        }
    }
    Arc::new(b.build().unwrap())
}

/// Which trainer tensors make each engine tensor, rows in order.
fn sources(i: usize) -> [(String, Vec<String>); 4] {
    let t = |n: &str| format!("layers.{i}.{n}.weight");
    let e = |n: &str| format!("model.layers.{i}.{n}.weight");
    [
        (
            e("self_attn.qkv_proj"),
            vec![t("q_proj"), t("k_proj"), t("v_proj")],
        ),
        (e("self_attn.o_proj"), vec![t("o_proj")]),
        (e("mlp.gate_up_proj"), vec![t("gate_proj"), t("up_proj")]),
        (e("mlp.down_proj"), vec![t("down_proj")]),
    ]
}

fn want() -> Want {
    Want::new()
        .layout(layout())
        .cast(CastRules::new().dtype(DType::F32, CastTo::BF16))
}

/// The engine's names: q/k/v and gate/up fused along their rows.
fn layout() -> LayoutRules {
    LayoutRules::new()
        .fuse(
            [
                "layers.{i}.q_proj.weight",
                "layers.{i}.k_proj.weight",
                "layers.{i}.v_proj.weight",
            ],
            "model.layers.{i}.self_attn.qkv_proj.weight",
            0,
        )
        .rename(
            "layers.{i}.o_proj.weight",
            "model.layers.{i}.self_attn.o_proj.weight",
        )
        .fuse(
            ["layers.{i}.gate_proj.weight", "layers.{i}.up_proj.weight"],
            "model.layers.{i}.mlp.gate_up_proj.weight",
            0,
        )
        .rename(
            "layers.{i}.down_proj.weight",
            "model.layers.{i}.mlp.down_proj.weight",
        )
}

fn wants() -> Wants {
    Wants::new().model(id("policy"), want())
}

fn of(m: &Arc<Manifest>) -> Manifests {
    Manifests::new([(id("policy"), Arc::clone(m))]).unwrap()
}

/// Trainer weights of `version`: every element different, most needing rounding to bf16.
fn trainer_weights(version: u64) -> WeightSet {
    let m = trainer();
    let mut w = WeightSet::zeroed(id("policy"), Arc::clone(&m));
    let mut x = version.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for t in m.tensors() {
        for v in w.view_mut::<f32>(&t.name).unwrap() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *v = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        }
    }
    w.set_version(Version(version));
    w
}

/// Checks every engine tensor against the trainer's rows, concatenated and rounded to bf16
/// one element at a time.
fn check(engine_w: &WeightSet, trainer_w: &WeightSet) {
    assert_eq!(engine_w.version(), trainer_w.version());
    assert_eq!(engine_w.manifest().len(), 4 * LAYERS);
    for i in 0..LAYERS {
        for (name, parts) in sources(i) {
            let want: Vec<u16> = parts
                .iter()
                .flat_map(|p| trainer_w.view::<f32>(p).unwrap().iter())
                .map(|&x| bf16::from_f32(x).to_bits())
                .collect();
            let got = engine_w.view::<bf16>(&name).unwrap();
            assert_eq!(got.len(), want.len(), "{name}");
            let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == *w);
            assert!(same, "tensor `{name}` differs from the reference");
        }
    }
}

/// Sends versions 2 and 3 and checks the engine's bytes each time; a trainer update of the
/// engine's layout is refused whole and version 3 stays served.
fn exercise<X, Y>(tx: &mut Sender<X>, mut rx: Receiver<Y>) -> Receiver<Y>
where
    X: SenderTransport,
    Y: ReceiverTransport + 'static,
{
    let p = id("policy");
    // the engine's manifests are the converted ones, and version 1 arrived converted
    rx.manifests().check_agree(&of(&engine())).unwrap();
    check(&rx.current(&p).unwrap(), &trainer_weights(1));
    for v in [2, 3] {
        let engine_side = std::thread::spawn(move || {
            let u = rx.receive(T).unwrap().expect("a version arrives");
            assert_eq!(u.entries(), vec![(id("policy"), Version(v))]);
            rx
        });
        tx.send(trainer_weights(v)).unwrap();
        rx = engine_side.join().unwrap();
        check(&rx.current(&p).unwrap(), &trainer_weights(v));
    }
    // weights in the engine's layout are not the trainer's: refused before anything moves
    let mut wrong = WeightSet::zeroed(p.clone(), engine());
    wrong.set_version(Version(4));
    let e = tx.send(wrong).unwrap_err().to_string();
    assert!(e.contains("tensor `"), "{e}");
    assert!(rx.receive(Duration::from_millis(200)).unwrap().is_none());
    assert_eq!(rx.version(&p), Version(3));
    check(&rx.current(&p).unwrap(), &trainer_weights(3));
    rx
}

/// The trainer's sender converts (its transport carries the engine's layout); the engine's
/// receiver is a plain one that expects its own layout.
fn sender_side<S, R>(make: impl FnOnce(&Manifests) -> (S, R))
where
    S: SenderTransport + 'static,
    R: ReceiverTransport + 'static,
{
    let conversions = Conversions::plan(&of(&trainer()), &wants()).unwrap();
    // the plan gives exactly the layout the engine declares
    conversions.target().check_agree(&of(&engine())).unwrap();
    let (s, r) = make(conversions.target());
    let joiner = std::thread::spawn(move || ReceiverInit::new(r, Some(of(&engine()))).connect(T));
    let mut tx = SenderInit::new(ConvertingSender::new(s, conversions), of(&trainer()))
        .with_ack_timeout(T)
        .connect(vec![trainer_weights(1)], T)
        .unwrap();
    let rx = exercise(&mut tx, joiner.join().unwrap().unwrap());
    let stats = tx.transport().stats();
    assert_eq!(stats.groups, 3);
    assert_eq!(stats.source_bytes, 3 * trainer().payload_len() as u64);
    rx.shutdown().unwrap();
    tx.shutdown().unwrap();
}

/// The trainer sends its own layout; the engine's receiver converts to what it wants.
fn receiver_side<S, R>(make: impl FnOnce(&Manifests) -> (S, R))
where
    S: SenderTransport + 'static,
    R: ReceiverTransport + 'static,
{
    let (s, r) = make(&of(&trainer()));
    let r = ConvertingReceiver::new(r, wants());
    let joiner = std::thread::spawn(move || ReceiverInit::new(r, Some(of(&engine()))).connect(T));
    let mut tx = SenderInit::new(s, of(&trainer()))
        .with_ack_timeout(T)
        .connect(vec![trainer_weights(1)], T)
        .unwrap();
    let rx = exercise(&mut tx, joiner.join().unwrap().unwrap());
    assert_eq!(rx.transport().stats().groups, 3);
    rx.shutdown().unwrap();
    tx.shutdown().unwrap();
}

fn shm(mode: ShmReadMode) -> impl FnOnce(&Manifests) -> (ShmSender, ShmReceiver) {
    move |ms| shm_pair(ms, mode)
}

#[test]
fn shm_engine_converts_on_the_receiver_side() {
    receiver_side(shm(ShmReadMode::ZeroCopy));
    receiver_side(shm(ShmReadMode::Copy));
}

#[test]
fn shm_trainer_converts_on_the_sender_side() {
    sender_side(shm(ShmReadMode::ZeroCopy));
}

#[test]
fn tcp_engine_converts_on_the_receiver_side() {
    receiver_side(tcp_pair);
}

#[test]
fn tcp_trainer_converts_on_the_sender_side() {
    sender_side(tcp_pair);
}

/// An engine whose wants do not fit the trainer's manifests is refused at connect, naming
/// the rule; nothing is served.
#[test]
fn wants_that_do_not_fit_are_refused_at_connect() {
    let (s, r) = tcp_pair(&of(&trainer()));
    let bad = Wants::new().model(
        id("policy"),
        Want::new().layout(LayoutRules::new().rename("layers.{i}.rope", "x.{i}")),
    );
    let joiner = std::thread::spawn(move || {
        ReceiverInit::new(ConvertingReceiver::new(r, bad), None).connect(T)
    });
    let sent = SenderInit::new(s, of(&trainer()))
        .connect(vec![trainer_weights(1)], Duration::from_secs(2));
    let e = joiner.join().unwrap().unwrap_err().to_string();
    assert!(
        e.contains("layers.{i}.rope") && e.contains("matches no tensor"),
        "{e}"
    );
    if let Err(e) = sent {
        assert!(
            e.is_timeout() || matches!(e, refit_runtime::Error::PeerGone { .. }),
            "{e}"
        );
    }
}

/// The engine's layout with 8-bit weights: fused qkv and gate_up in e4m3 with one scale
/// each, o_proj in e5m2 with blocks of 16 x 32 scales, down_proj in bf16.
fn fp8_wants() -> Wants {
    use refit_runtime::cast::{Overflow, Scaling};
    let e4m3 = CastTo::E4M3_PER_TENSOR;
    let cast = CastRules::new()
        .tensors("model.layers.{i}.self_attn.qkv_proj.weight", e4m3)
        .tensors("model.layers.{i}.mlp.gate_up_proj.weight", e4m3)
        .tensors(
            "model.layers.{i}.self_attn.o_proj.weight",
            CastTo::E5M2 {
                scaling: Scaling::PerBlock { rows: 16, cols: 32 },
                overflow: Overflow::Saturate,
            },
        )
        .tensors("model.layers.{i}.mlp.down_proj.weight", CastTo::BF16);
    Wants::new().model(id("policy"), Want::new().layout(layout()).cast(cast))
}

/// What a receiver holds against the trainer's weights converted here, byte for byte (the
/// scales included), and a dequantised fp8 tensor against the trainer's values.
fn same_as_converted_here(got: &WeightSet, local: &Conversions, v: u64) {
    let trainer_w = trainer_weights(v);
    let want = local.get(&id("policy")).unwrap().apply(&trainer_w).unwrap();
    assert_eq!(got.version(), Version(v));
    assert_eq!(got.manifest().schema_hash(), want.manifest().schema_hash());
    assert!(
        got.bytes() == want.bytes(),
        "version {v} differs from the local conversion"
    );
    // and the conversion is the trainer's weights: e4m3 within 1/16 of each value
    let name = "model.layers.0.self_attn.qkv_proj.weight";
    let scale = got.view::<f32>(&format!("{name}.scale")).unwrap()[0];
    let codes = got.tensor(name).unwrap().bytes();
    let rows: Vec<f32> = ["q_proj", "k_proj", "v_proj"]
        .iter()
        .flat_map(|p| {
            trainer_w
                .view::<f32>(&format!("layers.0.{p}.weight"))
                .unwrap()
                .to_vec()
        })
        .collect();
    assert_eq!(codes.len(), rows.len());
    for (&c, &x) in codes.iter().zip(&rows) {
        let back = refit_runtime::cast::fp8::e4m3_to_f32(c) * scale;
        assert!(
            (back - x).abs() <= x.abs() / 16.0 + scale / 512.0,
            "{x} came back {back}"
        );
    }
}

/// An fp8 version crosses TCP, from the converting sender down a relay chain of three
/// receivers, and shared memory, converted by the receiver: each receiver holds exactly
/// the trainer's weights converted here.
#[test]
fn fp8_versions_cross_tcp_and_shm_as_the_trainers_weights_converted_here() {
    use refit_transports::tcp::{TcpConfig, TcpReceiver, TcpSender};
    let local = Conversions::plan(&of(&trainer()), &fp8_wants()).unwrap();
    let p = id("policy");
    // over TCP: the trainer converts once, the wire and the relays carry fp8
    let cfg = TcpConfig {
        expected_receivers: 3,
        token: Some(refit_node::ClusterToken::random()),
        ..TcpConfig::default()
    };
    let s = TcpSender::bind(cfg, local.target()).unwrap();
    let spec = s.receiver_spec();
    let joiners: Vec<_> = (0..3)
        .map(|_| {
            let r = TcpReceiver::new(spec.clone());
            let expected = Some(local.target().clone());
            std::thread::spawn(move || ReceiverInit::new(r, expected).connect(T))
        })
        .collect();
    let mut tx = SenderInit::new(ConvertingSender::new(s, local.clone()), of(&trainer()))
        .with_ack_timeout(T)
        .connect(vec![trainer_weights(1)], T)
        .unwrap();
    let mut rxs: Vec<_> = joiners
        .into_iter()
        .map(|j| j.join().unwrap().unwrap())
        .collect();
    for v in 2..=3 {
        let hs: Vec<_> = rxs
            .into_iter()
            .map(|mut rx| {
                std::thread::spawn(move || {
                    rx.receive(T).unwrap().expect("a version arrives");
                    rx
                })
            })
            .collect();
        tx.send(trainer_weights(v)).unwrap();
        rxs = hs.into_iter().map(|h| h.join().unwrap()).collect();
        for rx in &rxs {
            same_as_converted_here(&rx.current(&p).unwrap(), &local, v);
        }
    }
    let relayed: u64 = rxs.iter().map(|r| r.transport().bytes_relayed()).sum();
    assert!(relayed > 0, "the receivers relayed the fp8 bytes");
    for rx in rxs {
        rx.shutdown().unwrap();
    }
    tx.shutdown().unwrap();
    // over shared memory: the trainer's f32 crosses, the engine converts what it received
    let (s, r) = shm_pair(&of(&trainer()), ShmReadMode::ZeroCopy);
    let r = ConvertingReceiver::new(r, fp8_wants());
    let joiner = std::thread::spawn(move || ReceiverInit::new(r, None).connect(T));
    let mut tx = SenderInit::new(s, of(&trainer()))
        .with_ack_timeout(T)
        .connect(vec![trainer_weights(1)], T)
        .unwrap();
    let mut rx = joiner.join().unwrap().unwrap();
    same_as_converted_here(&rx.current(&p).unwrap(), &local, 1);
    let engine_side = std::thread::spawn(move || {
        rx.receive(T).unwrap().expect("a version arrives");
        rx
    });
    tx.send(trainer_weights(2)).unwrap();
    let rx = engine_side.join().unwrap();
    same_as_converted_here(&rx.current(&p).unwrap(), &local, 2);
    rx.shutdown().unwrap();
    tx.shutdown().unwrap();
}
