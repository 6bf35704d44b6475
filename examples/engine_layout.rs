//! Maps a small transformer-shaped trainer model to an inference engine's layout: separate
//! q/k/v fused into `qkv_proj`, MLP gate/up fused into `gate_up_proj`, names changed, f32 cast
//! to bf16; then cuts the result into buckets and prints the mapping.
//!
//! ```text
//! cargo run --release --example engine_layout
//! ```

use std::sync::Arc;

use refit::prelude::*;
use refit::runtime::bucket::{BucketAssembler, BucketPlan};
use refit::runtime::cast::{CastPlan, CastRules, CastTo};
use refit::runtime::layout::{LayoutPlan, LayoutRules};

// ANCHOR: trainer
/// The trainer's layout: embeddings, two layers of attention and MLP, a head.
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

/// Adapting a trainer's layout to an engine's: a layout plan (renames, fused tensors,
/// shards) and a cast plan, applied to real weights.
#[derive(clap::Parser, Debug)]
#[command(long_about = None)]
struct Args {}

fn main() -> Result<()> {
    <Args as clap::Parser>::parse();
    refit::init()?;
    // ANCHOR: plan
    // At connect: check the rules once, get the engine's manifest.
    let trainer = trainer_manifest(2, 64, 16, 128)?;
    let layout = LayoutPlan::new(&trainer, &engine_rules())?;
    let cast = CastPlan::new(
        layout.target(),
        &CastRules::new().dtype(DType::F32, CastTo::BF16),
    )?;
    println!("{layout}");
    // ANCHOR_END: plan

    // ANCHOR: apply
    // Every version: trainer layout -> engine layout -> bf16.
    let id = ModelId::new("policy")?;
    let mut weights = WeightSet::zeroed(id.clone(), Arc::new(trainer));
    weights
        .view_mut::<f32>("layers.1.attn.k_proj.weight")?
        .fill(0.5);
    weights.set_version(Version(1));
    let engine = cast.apply(&layout.apply(&weights)?)?;
    let qkv = engine.view::<half::bf16>("model.layers.1.self_attn.qkv_proj.weight")?;
    assert_eq!(qkv[64 * 64].to_f32(), 0.5); // the first k row follows the 64 q rows
    // ANCHOR_END: apply

    // ANCHOR: buckets
    // Ship it in 256 KiB buckets; the receiver only sees it once every bucket checked out.
    let plan = BucketPlan::compute(&id, engine.manifest(), cast.target(), 256 * 1024)?;
    let mut assembler = BucketAssembler::new(plan.clone(), Arc::clone(cast.target()))?;
    for (header, bytes) in plan.buckets(&engine)? {
        assembler.accept(&header, bytes)?;
    }
    let received = assembler.take()?;
    assert_eq!(received.bytes(), engine.bytes());
    // ANCHOR_END: buckets
    println!(
        "{} trainer tensors ({} bytes) -> {} engine tensors ({} bytes) in {} buckets",
        weights.manifest().len(),
        weights.manifest().payload_len(),
        received.manifest().len(),
        received.manifest().payload_len(),
        plan.len()
    );
    Ok(())
}
