use std::sync::Arc;

use super::*;
use crate::{DType, ModelId, Version};

const H: usize = 8; // hidden
const KV: usize = 4; // k/v rows (grouped-query attention)
const F: usize = 12; // MLP width
const V: usize = 10; // vocabulary

/// A two-layer, transformer-shaped trainer manifest.
fn trainer_manifest() -> Manifest {
    let mut b = Manifest::builder().tensor("embed.weight", DType::F32, &[V, H]);
    for i in 0..2 {
        b = b
            .tensor(
                format!("layers.{i}.attn.q_proj.weight"),
                DType::F32,
                &[H, H],
            )
            .tensor(
                format!("layers.{i}.attn.k_proj.weight"),
                DType::F32,
                &[KV, H],
            )
            .tensor(
                format!("layers.{i}.attn.v_proj.weight"),
                DType::F32,
                &[KV, H],
            )
            .tensor(
                format!("layers.{i}.attn.o_proj.weight"),
                DType::F32,
                &[H, H],
            )
            .tensor(
                format!("layers.{i}.mlp.gate_proj.weight"),
                DType::F32,
                &[F, H],
            )
            .tensor(
                format!("layers.{i}.mlp.up_proj.weight"),
                DType::F32,
                &[F, H],
            )
            .tensor(
                format!("layers.{i}.mlp.down_proj.weight"),
                DType::F32,
                &[H, F],
            )
            .tensor(format!("layers.{i}.norm.weight"), DType::F32, &[H]);
    }
    b.tensor("lm_head.weight", DType::F32, &[V, H])
        .build()
        .unwrap()
}

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
        .transpose(
            "layers.{i}.mlp.down_proj.weight",
            "model.layers.{i}.mlp.down_proj.weight_t",
        )
        .rename(
            "layers.{i}.norm.weight",
            "model.layers.{i}.input_layernorm.weight",
        )
        .keep("lm_head.weight")
}

/// Every element is its tensor's position * 1000 + its flat index: each value says where it came from.
fn numbered(m: &Manifest) -> WeightSet {
    let mut ws = WeightSet::zeroed(ModelId::new("policy").unwrap(), Arc::new(m.clone()));
    ws.set_version(Version(7));
    for (t, spec) in m.tensors().iter().enumerate() {
        let v = ws.view_mut::<f32>(&spec.name).unwrap();
        for (i, x) in v.iter_mut().enumerate() {
            *x = (t * 1000 + i) as f32;
        }
    }
    ws
}

#[test]
fn transformer_maps_to_the_hand_built_engine_layout() {
    let src = trainer_manifest();
    let plan = LayoutPlan::new(&src, &engine_rules()).unwrap();
    let mut b = Manifest::builder().tensor("model.embed_tokens.weight", DType::F32, &[V, H]);
    for i in 0..2 {
        b = b
            .tensor(
                format!("model.layers.{i}.self_attn.qkv_proj.weight"),
                DType::F32,
                &[H + 2 * KV, H],
            )
            .tensor(
                format!("model.layers.{i}.self_attn.o_proj.weight"),
                DType::F32,
                &[H, H],
            )
            .tensor(
                format!("model.layers.{i}.mlp.gate_up_proj.weight"),
                DType::F32,
                &[2 * F, H],
            )
            .tensor(
                format!("model.layers.{i}.mlp.down_proj.weight_t"),
                DType::F32,
                &[F, H],
            )
            .tensor(
                format!("model.layers.{i}.input_layernorm.weight"),
                DType::F32,
                &[H],
            );
    }
    let expected = b
        .tensor("lm_head.weight", DType::F32, &[V, H])
        .build()
        .unwrap();
    assert_eq!(**plan.target(), expected);

    let ws = numbered(&src);
    let out = plan.apply(&ws).unwrap();
    assert_eq!(out.version(), Version(7));
    let pos = |n: &str| src.position(n).unwrap() as f32 * 1000.0;
    // qkv: rows 0..8 are q, 8..12 are k, 12..16 are v.
    let qkv = out
        .view::<f32>("model.layers.1.self_attn.qkv_proj.weight")
        .unwrap();
    assert_eq!(qkv[0], pos("layers.1.attn.q_proj.weight"));
    assert_eq!(
        qkv[H * H - 1],
        pos("layers.1.attn.q_proj.weight") + (H * H - 1) as f32
    );
    assert_eq!(qkv[H * H], pos("layers.1.attn.k_proj.weight"));
    assert_eq!(
        qkv[(H + KV) * H + 3],
        pos("layers.1.attn.v_proj.weight") + 3.0
    );
    let gu = out
        .view::<f32>("model.layers.0.mlp.gate_up_proj.weight")
        .unwrap();
    assert_eq!(gu[F * H], pos("layers.0.mlp.up_proj.weight"));
    // down_proj [H, F] -> [F, H]: out[c][r] = in[r][c].
    let d = out
        .view::<f32>("model.layers.0.mlp.down_proj.weight_t")
        .unwrap();
    assert_eq!(
        d[2 * H + 5],
        pos("layers.0.mlp.down_proj.weight") + (5 * F + 2) as f32
    );
    assert_eq!(
        out.view::<f32>("lm_head.weight").unwrap(),
        ws.view::<f32>("lm_head.weight").unwrap()
    );
    assert_eq!(
        out.view::<f32>("model.embed_tokens.weight").unwrap(),
        ws.view::<f32>("embed.weight").unwrap()
    );
    let text = plan.to_string();
    assert!(text.contains("fuse      [layers.0.attn.q_proj.weight, layers.0.attn.k_proj.weight, layers.0.attn.v_proj.weight] -axis 0-> model.layers.0.self_attn.qkv_proj.weight f32 [16, 8]"), "{text}");
    assert_eq!(text.lines().count(), 1 + 2 * 5 + 1);
}

#[test]
fn fuse_then_split_round_trips_exactly_on_any_axis() {
    for axis in 0..3 {
        let mut shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]];
        shapes[1][axis] = 5;
        shapes[2][axis] = 1;
        let src = Manifest::builder()
            .tensor("a.x", DType::BF16, &shapes[0])
            .tensor("a.y", DType::BF16, &shapes[1])
            .tensor("a.z", DType::BF16, &shapes[2])
            .build()
            .unwrap();
        let fuse = LayoutRules::new().fuse(["{p}.x", "{p}.y", "{p}.z"], "{p}.xyz", axis);
        let fused_plan = LayoutPlan::new(&src, &fuse).unwrap();
        let mut ws = WeightSet::zeroed(ModelId::new("m").unwrap(), Arc::new(src.clone()));
        for name in ["a.x", "a.y", "a.z"] {
            for (i, b) in ws.tensor_bytes_mut(name).unwrap().iter_mut().enumerate() {
                *b = (i * 31 % 253) as u8 ^ name.as_bytes()[2];
            }
        }
        let fused = fused_plan.apply(&ws).unwrap();
        let mut sizes = vec![];
        for s in &shapes {
            sizes.push(s[axis]);
        }
        let split = LayoutRules::new().split_sizes(
            "{p}.xyz",
            [
                ("{p}.x", sizes[0]),
                ("{p}.y", sizes[1]),
                ("{p}.z", sizes[2]),
            ],
            axis,
        );
        let split_plan = LayoutPlan::new(fused_plan.target(), &split).unwrap();
        assert_eq!(**split_plan.target(), src);
        let back = split_plan.apply(&fused).unwrap();
        assert_eq!(back.bytes(), ws.bytes(), "axis {axis}");
    }
}

#[test]
fn equal_split_cuts_rows_in_order() {
    let src = Manifest::builder()
        .tensor("l.0.gate_up", DType::U8, &[4, 2])
        .build()
        .unwrap();
    let rules = LayoutRules::new().split("l.{i}.gate_up", ["l.{i}.gate", "l.{i}.up"], 0);
    let plan = LayoutPlan::new(&src, &rules).unwrap();
    let mut ws = WeightSet::zeroed(ModelId::new("m").unwrap(), Arc::new(src));
    ws.view_mut::<u8>("l.0.gate_up")
        .unwrap()
        .copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    let out = plan.apply(&ws).unwrap();
    assert_eq!(out.view::<u8>("l.0.gate").unwrap(), [1, 2, 3, 4]);
    assert_eq!(out.view::<u8>("l.0.up").unwrap(), [5, 6, 7, 8]);
}

fn err(rules: LayoutRules) -> String {
    LayoutPlan::new(&trainer_manifest(), &rules)
        .unwrap_err()
        .to_string()
}

#[test]
fn rules_that_miss_overlap_or_leave_tensors_out_are_refused() {
    let e = err(engine_rules().rename("layers.{i}.attn.rope", "x.{i}"));
    assert_eq!(
        e,
        "layout: rule `rename layers.{i}.attn.rope -> x.{i}`: matches no tensor"
    );
    let e = err(engine_rules().keep("layers.{i}.norm.weight"));
    assert!(
        e.starts_with("layout: tensor `layers.0.norm.weight`: matched by rule `rename layers.{i}.norm.weight -> model.layers.{i}.input_layernorm.weight` and rule `keep layers.{i}.norm.weight`"),
        "{e}"
    );
    let e = err(LayoutRules::new().keep("embed.weight"));
    assert!(
        e.contains("tensor `layers.0.attn.q_proj.weight`: no rule maps it"),
        "{e}"
    );
    let ok = LayoutPlan::new(
        &trainer_manifest(),
        &LayoutRules::new().keep("embed.weight").keep_unmatched(),
    )
    .unwrap();
    assert_eq!(**ok.target(), trainer_manifest());
    let e = err(engine_rules()
        .rename("lm_head.{w}", "model.embed_tokens.{w}")
        .keep_unmatched());
    assert!(e.contains("lm_head.weight"), "{e}");
}

#[test]
fn malformed_groups_and_shapes_are_refused_at_plan_time() {
    let src = Manifest::builder()
        .tensor("l.0.q", DType::F32, &[4, 2])
        .tensor("l.0.k", DType::F32, &[2, 3])
        .tensor("l.1.q", DType::F32, &[4, 2])
        .tensor("b", DType::F32, &[3])
        .build()
        .unwrap();
    let e = |r: LayoutRules| {
        LayoutPlan::new(&src, &r.keep_unmatched())
            .unwrap_err()
            .to_string()
    };
    let s = e(LayoutRules::new().fuse(["l.{i}.q", "l.{i}.k"], "l.{i}.qk", 0));
    assert!(
        s.contains("matches 2 tensors but `l.{i}.k` matches 1"),
        "{s}"
    );
    let s = e(LayoutRules::new().fuse(["l.0.q", "l.0.k"], "qk", 0));
    assert!(
        s.contains("`l.0.k` (f32 [2, 3]) cannot be fused with `l.0.q` (f32 [4, 2]) on axis 0"),
        "{s}"
    );
    let s = e(LayoutRules::new().transpose("b", "bt"));
    assert!(s.contains("tensor `b` has shape [3]; only 2-D"), "{s}");
    let s = e(LayoutRules::new().split("b", ["b0", "b1"], 0));
    assert!(s.contains("does not split into 2 equal parts"), "{s}");
    let s = e(LayoutRules::new().split_sizes("b", [("b0", 1), ("b1", 1)], 0));
    assert!(s.contains("parts [1, 1] do not add up"), "{s}");
    let s = e(LayoutRules::new().rename("l.{i}.q", "q.{j}"));
    assert!(s.contains("uses `{j}`, which no source captures"), "{s}");
    let s = e(LayoutRules::new().rename("l.{i", "x"));
    assert!(s.contains("pattern `l.{i`"), "{s}");
    let s = e(LayoutRules::new().rename("l.{i}.q", "b"));
    assert!(s.contains("produced twice"), "{s}");
}

#[test]
fn apply_refuses_weights_of_another_layout() {
    let plan = LayoutPlan::new(&trainer_manifest(), &engine_rules()).unwrap();
    let other = Manifest::builder()
        .tensor("x", DType::F32, &[1])
        .build()
        .unwrap();
    let ws = WeightSet::zeroed(ModelId::new("m").unwrap(), Arc::new(other));
    assert!(
        plan.apply(&ws)
            .unwrap_err()
            .to_string()
            .contains("tensor `embed.weight`")
    );
}
