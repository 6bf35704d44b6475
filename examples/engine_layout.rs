//! An inference engine that wants its weights fused and in bf16 receives them from an f32
//! trainer that knows nothing of that layout, over shared memory and over TCP:
//!
//! - over **shared memory**, the engine process converts (receiver side): the segment
//!   carries the trainer's layout and the engine's receiver applies its own wants;
//! - over **TCP**, the trainer converts once per version (sender side) and the wire carries
//!   the engine's layout, half the bytes; the trainer is split over two ranks that write
//!   their shards of each version into a sharded buffer, which publishes it.
//!
//! Each engine is a separate process (this program re-run as `engine shm TOKEN` or
//! `engine tcp TOKEN`); it checks every byte against the conversion written out element by
//! element, then the engine's weights are cut into buckets and reassembled.
//!
//! ```text
//! cargo run --release --example engine_layout
//! ```

use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use refit::node::TOKEN_ENV;
use refit::prelude::*;
use refit::runtime::ShardedBuffer;
use refit::runtime::bucket::{BucketAssembler, BucketPlan};
use refit::runtime::cast::{CastRules, CastTo};
use refit::runtime::convert::{Conversions, ConvertingReceiver, ConvertingSender, Want, Wants};
use refit::runtime::layout::LayoutRules;

const WAIT: Duration = Duration::from_secs(60);
const VERSIONS: u64 = 3;
const LAYERS: usize = 2;
const HIDDEN: usize = 64;
const KV: usize = 16;
const FFN: usize = 128;

// ANCHOR: trainer
/// The trainer's layout: embeddings, layers of attention and MLP, a head.
fn trainer_manifest(layers: usize, hidden: usize, kv: usize, ffn: usize) -> Result<Manifest> {
    let mut b = Manifest::builder().tensor("embed.weight", DType::F32, &[1000, hidden]);
    for i in 0..layers {
        let p = format!("layers.{i}");
        b = b
            .tensor(
                format!("{p}.attn.q_proj.weight"),
                DType::F32,
                &[hidden, hidden],
            )
            .tensor(format!("{p}.attn.k_proj.weight"), DType::F32, &[kv, hidden])
            .tensor(format!("{p}.attn.v_proj.weight"), DType::F32, &[kv, hidden])
            .tensor(
                format!("{p}.attn.o_proj.weight"),
                DType::F32,
                &[hidden, hidden],
            )
            .tensor(
                format!("{p}.mlp.gate_proj.weight"),
                DType::F32,
                &[ffn, hidden],
            )
            .tensor(
                format!("{p}.mlp.up_proj.weight"),
                DType::F32,
                &[ffn, hidden],
            )
            .tensor(
                format!("{p}.mlp.down_proj.weight"),
                DType::F32,
                &[hidden, ffn],
            )
            .tensor(format!("{p}.norm.weight"), DType::F32, &[hidden]);
    }
    b.tensor("lm_head.weight", DType::F32, &[1000, hidden])
        .build()
}
// ANCHOR_END: trainer

// ANCHOR: rules
/// What the engine expects: its names, fused projections.
fn engine_rules() -> LayoutRules {
    LayoutRules::new()
        .rename("embed.weight", "model.embed_tokens.weight")
        .fuse(
            [
                "layers.{i}.attn.q_proj.weight",
                "layers.{i}.attn.k_proj.weight",
                "layers.{i}.attn.v_proj.weight",
            ],
            "model.layers.{i}.self_attn.qkv_proj.weight",
            0,
        )
        .rename(
            "layers.{i}.attn.o_proj.weight",
            "model.layers.{i}.self_attn.o_proj.weight",
        )
        .fuse(
            [
                "layers.{i}.mlp.gate_proj.weight",
                "layers.{i}.mlp.up_proj.weight",
            ],
            "model.layers.{i}.mlp.gate_up_proj.weight",
            0,
        )
        .rename(
            "layers.{i}.mlp.down_proj.weight",
            "model.layers.{i}.mlp.down_proj.weight",
        )
        .rename(
            "layers.{i}.norm.weight",
            "model.layers.{i}.input_layernorm.weight",
        )
        .keep("lm_head.weight")
}
// ANCHOR_END: rules

// ANCHOR: want
/// What the engine declares: its layout, then bf16 for every f32 tensor.
fn engine_wants() -> Result<Wants> {
    let want = Want::new()
        .layout(engine_rules())
        .cast(CastRules::new().dtype(DType::F32, CastTo::BF16));
    Ok(Wants::new().model(ModelId::new("policy")?, want))
}
// ANCHOR_END: want

fn trainer_manifests() -> Result<Manifests> {
    let m = trainer_manifest(LAYERS, HIDDEN, KV, FFN)?;
    Manifests::new([(ModelId::new("policy")?, Arc::new(m))])
}

/// What the trainer holds at `version`: every element different, most needing rounding.
fn trainer_weights(manifest: &Arc<Manifest>, version: u64) -> Result<WeightSet> {
    let mut w = WeightSet::zeroed(ModelId::new("policy")?, Arc::clone(manifest));
    for (t, spec) in manifest.tensors().iter().enumerate() {
        for (i, x) in w.view_mut::<f32>(&spec.name)?.iter_mut().enumerate() {
            *x = version as f32 + (t * 131 + i) as f32 / 3.0e4;
        }
    }
    w.set_version(Version(version));
    Ok(w)
}

/// Adapting a trainer's layout to an engine's over shared memory and TCP.
#[derive(clap::Parser, Debug)]
#[command(long_about = None)]
struct Args {
    /// (internal) `engine shm|tcp TOKEN`: run as the engine process.
    #[arg(hide = true, num_args = 0..=3)]
    role: Vec<String>,
}

/// Runs [`run`]; an error is one `error: ...` line.
fn main() -> std::process::ExitCode {
    refit::exit_code(run())
}

fn run() -> Result<()> {
    let args = <Args as clap::Parser>::parse();
    refit::init()?;
    match args.role.as_slice() {
        [] => trainer(),
        [role, link, token] if role == "engine" => engine(link, token),
        other => Err(Error::Config(format!("unknown arguments {other:?}"))),
    }
}

fn spawn_engine(link: &str, token: &str, cluster: Option<&ClusterToken>) -> Result<Child> {
    let exe = std::env::current_exe().map_err(|e| Error::io("locating this program", e))?;
    let mut cmd = Command::new(exe);
    cmd.args(["engine", link, token]);
    if let Some(t) = cluster {
        cmd.env(TOKEN_ENV, t.expose());
    }
    cmd.spawn().map_err(|e| Error::io("spawning an engine", e))
}

fn wait_engine(mut child: Child, link: &str) -> Result<()> {
    let status = child
        .wait()
        .map_err(|e| Error::io("waiting for an engine", e))?;
    if !status.success() {
        return Err(Error::State(if link == "shm" {
            "the shm engine failed"
        } else {
            "the tcp engine failed"
        }));
    }
    Ok(())
}

fn trainer() -> Result<()> {
    let manifests = trainer_manifests()?;
    let policy = ModelId::new("policy")?;
    let manifest = Arc::clone(manifests.get(&policy)?);
    // ANCHOR: plan
    // At connect: check the wants once against the trainer's manifests, get the engine's.
    let conversions = Conversions::plan(&manifests, &engine_wants()?)?;
    if let Some(layout) = conversions.get(&policy).and_then(|c| c.layout()) {
        println!("{layout}");
    }
    // ANCHOR_END: plan

    // ANCHOR: receiver_side
    // Shared memory: the segment holds the trainer's layout; the engine converts.
    let shm = ShmSender::create(
        &ShmConfig {
            expected_receivers: 1,
            ..ShmConfig::default()
        },
        &manifests,
    )?;
    let engine = spawn_engine("shm", &wire::to_token(&shm.receiver_spec())?, None)?;
    let mut sender = SenderInit::new(shm, manifests.clone())
        .with_ack_timeout(WAIT)
        .connect(vec![trainer_weights(&manifest, 1)?], WAIT)?;
    for v in 2..=VERSIONS {
        sender.send(trainer_weights(&manifest, v)?)?; // returns once the engine applied it
    }
    sender.shutdown()?;
    wait_engine(engine, "shm")?;
    // ANCHOR_END: receiver_side

    // ANCHOR: sender_side
    // TCP: the trainer's sender converts once per version; the wire carries bf16.
    let token = ClusterToken::random();
    let tcp = TcpSender::bind(
        TcpConfig {
            token: Some(token.clone()),
            expected_receivers: 1,
            ..TcpConfig::default()
        },
        conversions.target(), // what travels
    )?;
    let engine = spawn_engine("tcp", &wire::to_token(&tcp.endpoint())?, Some(&token))?;
    let converting = ConvertingSender::new(tcp, conversions.clone());
    let mut sender = SenderInit::new(converting, manifests.clone()) // what the trainer publishes
        .with_ack_timeout(WAIT)
        .connect(vec![trainer_weights(&manifest, 1)?], WAIT)?;
    // ANCHOR_END: sender_side

    // ANCHOR: sharded
    // The trainer is split over two ranks: each writes its shard of every version into a
    // sharded buffer, which publishes the assembled version through the sender.
    let buffer = ShardedBuffer::new(policy.clone(), Arc::clone(&manifest), 2)?;
    for v in 2..=VERSIONS {
        let full = trainer_weights(&manifest, v)?; // what the ranks hold between them
        std::thread::scope(|s| -> Result<()> {
            let ranks: Vec<_> = (0..buffer.world())
                .map(|rank| {
                    let (writer, full) = (buffer.writer(rank), &full);
                    s.spawn(move || -> Result<()> {
                        let writer = writer?;
                        writer.write_shard(&full.bytes()[writer.range()])?;
                        writer.finish();
                        Ok(())
                    })
                })
                .collect();
            for r in ranks {
                r.join().map_err(|_| Error::State("a rank panicked"))??;
            }
            Ok(())
        })?;
        buffer.wait_all(WAIT)?;
        let pending = buffer.publish(Version(v), &mut sender)?;
        sender.wait(&pending, WAIT)?;
    }
    // ANCHOR_END: sharded
    let stats = sender.transport().stats();
    println!(
        "trainer (tcp, sender side): {} versions converted, {:.3} s/GB",
        stats.groups,
        stats.s_per_gb()
    );
    sender.shutdown()?;
    wait_engine(engine, "tcp")
}

fn engine(link: &str, token: &str) -> Result<()> {
    let policy = ModelId::new("policy")?;
    // The engine knows its own layout: the plan over the trainer's manifests gives it, and
    // a sender of any other layout is refused at connect, naming the tensor.
    let expected = Conversions::plan(&trainer_manifests()?, &engine_wants()?)?
        .target()
        .clone();
    // ANCHOR: engine
    let (mut receiver, side): (Box<dyn EngineEnd>, &str) = if link == "shm" {
        let transport =
            ConvertingReceiver::new(ShmReceiver::new(wire::from_token(token)?), engine_wants()?);
        let r = ReceiverInit::new(transport, Some(expected)).connect(WAIT)?;
        (Box::new(r), "receiver side")
    } else {
        let cluster = ClusterToken::from_env()?.ok_or(Error::State("REFIT_TOKEN is not set"))?;
        let spec = TcpReceiverSpec::new(wire::from_token(token)?, &cluster);
        let r = ReceiverInit::new(TcpReceiver::new(spec), Some(expected)).connect(WAIT)?;
        (Box::new(r), "sender side")
    };
    // ANCHOR_END: engine
    let manifest = Arc::clone(trainer_manifests()?.get(&policy)?);
    let mut last = receiver.check(&manifest)?;
    println!("engine ({link}, {side}): v{last} matches the reference conversion");
    while last < VERSIONS {
        match receiver.next()? {
            Some(v) => {
                last = receiver.check(&manifest)?;
                println!("engine ({link}, {side}): v{v} matches the reference conversion");
            }
            None => return Err(Error::State("no version in time")),
        }
    }
    let served = receiver.served()?;
    buckets(&served)?;
    Ok(())
}

/// The engine's receiver, whatever its transport.
trait EngineEnd {
    /// Receives one version; its number, `None` when none came in time.
    fn next(&mut self) -> Result<Option<u64>>;
    /// The weights served.
    fn served(&self) -> Result<Arc<WeightSet>>;
    /// Checks the served weights against the reference conversion; their version.
    fn check(&self, trainer: &Arc<Manifest>) -> Result<u64> {
        let served = self.served()?;
        let v = served.version().get();
        check_reference(&served, &trainer_weights(trainer, v)?)?;
        Ok(v)
    }
}

impl<T: refit::runtime::ReceiverTransport> EngineEnd for Receiver<T> {
    fn next(&mut self) -> Result<Option<u64>> {
        Ok(self
            .receive(WAIT)?
            .map(|u| u.group.first().map_or(0, |w| w.version().get())))
    }
    fn served(&self) -> Result<Arc<WeightSet>> {
        self.current(&ModelId::new("policy")?)
            .ok_or(Error::State("nothing served"))
    }
}

// ANCHOR: check
/// The conversion written out: each fused tensor is its parts' rows one after the other,
/// every element rounded to bf16 on its own.
fn check_reference(engine: &WeightSet, trainer: &WeightSet) -> Result<()> {
    for i in 0..LAYERS {
        let parts = |names: &[&str]| -> Result<Vec<u16>> {
            let mut out = Vec::new();
            for n in names {
                let name = format!("layers.{i}.{n}.weight");
                out.extend(
                    trainer
                        .view::<f32>(&name)?
                        .iter()
                        .map(|&x| bf16::from_f32(x).to_bits()),
                );
            }
            Ok(out)
        };
        for (name, from) in [
            (
                "self_attn.qkv_proj",
                &["attn.q_proj", "attn.k_proj", "attn.v_proj"][..],
            ),
            ("mlp.gate_up_proj", &["mlp.gate_proj", "mlp.up_proj"][..]),
        ] {
            let name = format!("model.layers.{i}.{name}.weight");
            let got: Vec<u16> = engine
                .view::<bf16>(&name)?
                .iter()
                .map(|x| x.to_bits())
                .collect();
            if got != parts(from)? {
                return Err(Error::Strategy(format!(
                    "tensor `{name}` differs from the reference"
                )));
            }
        }
    }
    Ok(())
}
// ANCHOR_END: check

fn buckets(engine: &Arc<WeightSet>) -> Result<()> {
    let id = engine.model().clone();
    let manifest = Arc::clone(engine.manifest());
    // ANCHOR: buckets
    // Ship it in 256 KiB buckets; the receiver only sees it once every bucket checked out.
    let plan = BucketPlan::compute(&id, &manifest, &manifest, 256 * 1024)?;
    let mut assembler = BucketAssembler::new(plan.clone(), Arc::clone(&manifest))?;
    for (header, bytes) in plan.buckets(engine)? {
        assembler.accept(&header, bytes)?;
    }
    let received = assembler.take()?;
    assert_eq!(received.bytes(), engine.bytes());
    // ANCHOR_END: buckets
    println!(
        "engine: {} tensors ({} bytes) in {} buckets reassembled",
        received.manifest().len(),
        received.manifest().payload_len(),
        plan.len()
    );
    Ok(())
}
