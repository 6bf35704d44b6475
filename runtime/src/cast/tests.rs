use std::sync::Arc;

use half::{bf16, f16};

use super::fp8::{e4m3_to_f32, e5m2_to_f32};
use super::*;
use crate::{ModelId, Version};

fn weights(m: Manifest) -> WeightSet {
    let mut ws = WeightSet::zeroed(ModelId::new("policy").unwrap(), Arc::new(m));
    ws.set_version(Version(4));
    ws
}

#[test]
fn f32_to_bf16_and_f16_round_to_nearest_even() {
    let m = Manifest::builder()
        .tensor("a", DType::F32, &[6])
        .tensor("b", DType::F32, &[4])
        .tensor("steps", DType::I64, &[])
        .build()
        .unwrap();
    let mut ws = weights(m.clone());
    let ulp8 = 2f32.powi(-8); // half a bf16 ulp at 1.0
    ws.view_mut::<f32>("a").unwrap().copy_from_slice(&[
        1.0 + ulp8,       // tie: to even 1.0 (0x3f80)
        1.0 + 3.0 * ulp8, // tie: to even 1.015625 (0x3f82)
        1.0 + 1.5 * ulp8, // above the tie: 0x3f81
        -2.5,             // exact: 0xc020
        f32::NAN,
        f32::MAX, // rounds up past bf16's largest: infinity
    ]);
    let ulp11 = 2f32.powi(-11); // half an f16 ulp at 1.0
    ws.view_mut::<f32>("b").unwrap().copy_from_slice(&[
        1.0 + ulp11,
        1.0 + 3.0 * ulp11,
        65520.0,
        6e-8,
    ]);
    ws.view_mut::<i64>("steps").unwrap()[0] = 42;
    let rules = CastRules::new()
        .tensors("a", CastTo::BF16)
        .tensors("b", CastTo::F16);
    let plan = CastPlan::new(&m, &rules).unwrap();
    let out = plan.apply(&ws).unwrap();
    assert_eq!(out.version(), Version(4));
    let a: Vec<u16> = out
        .view::<bf16>("a")
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert_eq!(a[..4], [0x3f80, 0x3f82, 0x3f81, 0xc020]);
    assert!(out.view::<bf16>("a").unwrap()[4].is_nan());
    assert_eq!(a[5], 0x7f80);
    let b: Vec<u16> = out
        .view::<f16>("b")
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert_eq!(b, [0x3c00, 0x3c02, 0x7c00, 0x0001]); // 65520 overflows; 6e-8 is the smallest subnormal
    assert_eq!(out.view::<i64>("steps").unwrap(), [42]);
    // And back: widening is exact.
    let back = CastPlan::new(
        plan.target(),
        &CastRules::new().dtype(DType::BF16, CastTo::F32),
    )
    .unwrap();
    let wide = back.apply(&out).unwrap();
    assert_eq!(wide.view::<f32>("a").unwrap()[1], 1.015_625);
}

#[test]
fn fp8_per_tensor_scale_is_shipped_beside_the_tensor() {
    let m = Manifest::builder()
        .tensor("w", DType::F32, &[2, 3])
        .tensor("b", DType::F32, &[3])
        .build()
        .unwrap();
    let mut ws = weights(m.clone());
    ws.view_mut::<f32>("w")
        .unwrap()
        .copy_from_slice(&[896.0, -896.0, 2.0, 0.0, -0.0, 1.0 / 256.0]);
    let plan = CastPlan::new(&m, &CastRules::new().tensors("w", CastTo::E4M3_PER_TENSOR)).unwrap();
    let names: Vec<_> = plan
        .target()
        .tensors()
        .iter()
        .map(|t| (t.name.as_str(), t.dtype, t.shape.clone()))
        .collect();
    assert_eq!(
        names,
        [
            ("w", DType::F8E4M3, vec![2, 3]),
            ("w.scale", DType::F32, vec![1]),
            ("b", DType::F32, vec![3]),
        ]
    );
    let out = plan.apply(&ws).unwrap();
    assert_eq!(out.view::<f32>("w.scale").unwrap(), [2.0]); // 896 / 448
    // x / 2 = 448, -448, 1, 0, -0, 2^-9.
    assert!(out.view::<u8>("w").is_err()); // typed views refuse fp8 as u8
    assert_eq!(
        out.tensor("w").unwrap().bytes(),
        [0x7e, 0xfe, 0x38, 0x00, 0x80, 0x01]
    );
}

#[test]
fn fp8_per_block_scales_and_dequantise_within_half_an_ulp() {
    let m = Manifest::builder()
        .tensor("l.0.w", DType::BF16, &[3, 5])
        .build()
        .unwrap();
    let mut ws = weights(m.clone());
    let vals: Vec<f32> = (0..15)
        .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.37 * (1 + i / 5) as f32)
        .collect();
    for (d, v) in ws.view_mut::<bf16>("l.0.w").unwrap().iter_mut().zip(&vals) {
        *d = bf16::from_f32(*v);
    }
    let to = CastTo::E5M2 {
        scaling: Scaling::PerBlock { rows: 2, cols: 2 },
        overflow: Overflow::Saturate,
    };
    let plan = CastPlan::new(&m, &CastRules::new().dtype(DType::BF16, to)).unwrap();
    assert_eq!(plan.target().get("l.0.w.scale").unwrap().shape, [2, 3]);
    let out = plan.apply(&ws).unwrap();
    let src = ws.view::<bf16>("l.0.w").unwrap();
    let scales = out.view::<f32>("l.0.w.scale").unwrap();
    let codes = out.tensor("l.0.w").unwrap().bytes();
    for r in 0..3 {
        for c in 0..5 {
            let block = [(r / 2) * 3 + c / 2];
            let (r0, c0) = ((r / 2) * 2, (c / 2) * 2);
            let amax = (r0..(r0 + 2).min(3))
                .flat_map(|rr| (c0..(c0 + 2).min(5)).map(move |cc| rr * 5 + cc))
                .map(|i| src[i].to_f32().abs())
                .fold(0.0, f32::max);
            let s = scales[block[0]];
            assert_eq!(s, if amax == 0.0 { 1.0 } else { amax / 57344.0 });
            let x = src[r * 5 + c].to_f32();
            let back = e5m2_to_f32(codes[r * 5 + c]) * s;
            assert!((back - x).abs() <= x.abs() / 8.0 + 1e-30, "{x} -> {back}");
        }
    }
}

#[test]
fn unscaled_fp8_saturates_and_keeps_nan() {
    let m = Manifest::builder()
        .tensor("x", DType::F16, &[4])
        .build()
        .unwrap();
    let mut ws = weights(m.clone());
    ws.view_mut::<f16>("x").unwrap().copy_from_slice(&[
        f16::from_f32(1000.0),
        f16::NAN,
        f16::from_f32(-0.0),
        f16::from_f32(1.0),
    ]);
    let to = CastTo::E4M3 {
        scaling: Scaling::None,
        overflow: Overflow::Saturate,
    };
    let out = CastPlan::new(&m, &CastRules::new().tensors("x", to))
        .unwrap()
        .apply(&ws)
        .unwrap();
    assert_eq!(out.tensor("x").unwrap().bytes(), [0x7e, 0x7f, 0x80, 0x38]);
    assert_eq!(out.manifest().len(), 1);
    assert_eq!(e4m3_to_f32(0x7e), 448.0);
}

#[test]
fn bad_rules_and_values_are_refused_naming_the_tensor() {
    let m = Manifest::builder()
        .tensor("w", DType::F32, &[2])
        .tensor("n", DType::I64, &[1])
        .build()
        .unwrap();
    let e = |r: CastRules| CastPlan::new(&m, &r).unwrap_err().to_string();
    assert_eq!(
        e(CastRules::new().tensors("v", CastTo::BF16)),
        "cast of tensor `v`: rule selects no tensor"
    );
    assert_eq!(
        e(CastRules::new()
            .dtype(DType::F32, CastTo::BF16)
            .tensors("w", CastTo::F16)),
        "cast of tensor `w`: selected by rule `every f32 tensor` and rule `w`"
    );
    assert_eq!(
        e(CastRules::new().tensors("n", CastTo::BF16)),
        "cast of tensor `n`: i64 to bf16 is not supported"
    );
    assert!(e(CastRules::new().tensors("w", CastTo::F32)).contains("f32 to f32 is not supported"));
    let mut ws = weights(m.clone());
    ws.view_mut::<f32>("w").unwrap()[1] = f32::INFINITY;
    let plan = CastPlan::new(&m, &CastRules::new().tensors("w", CastTo::E4M3_PER_TENSOR)).unwrap();
    let err = plan.apply(&ws).unwrap_err().to_string();
    assert_eq!(
        err,
        "cast of tensor `w`: element 1 is inf; a scale needs finite values"
    );
}

/// The values a test tensor holds: every rounding edge the kernels' tests use, then a
/// deterministic spread of magnitudes, cycled to `n`; `finite` drops NaN and infinities.
fn values(n: usize, finite: bool) -> Vec<f32> {
    let mut edges: Vec<f32> = super::kernels::tests::f32_edges();
    if finite {
        edges.retain(|x| x.is_finite());
    }
    let mut state = 0x2545_f491_u32;
    (0..n)
        .map(|i| {
            if i % 3 == 0 {
                edges[(i / 3) % edges.len()]
            } else {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let m = (state >> 8) as f32 / (1 << 24) as f32 - 0.5;
                m * 2f32.powi((state % 40) as i32 - 20)
            }
        })
        .collect()
}

/// One element's conversion written out with the scalar conversions (`half`'s and
/// [`super::fp8`]'s), for a tensor of `f32` values `xs` (16-bit sources already widened).
fn reference(xs: &[f32], to: CastTo, shape: &[usize]) -> (Vec<u8>, Vec<f32>) {
    match to {
        CastTo::BF16 => (
            xs.iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
            vec![],
        ),
        CastTo::F16 => (
            xs.iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
            vec![],
        ),
        CastTo::F32 => (xs.iter().flat_map(|x| x.to_le_bytes()).collect(), vec![]),
        CastTo::E4M3 { scaling, overflow } | CastTo::E5M2 { scaling, overflow } => {
            let (enc, max): (fn(f32, Overflow) -> u8, f32) = match to {
                CastTo::E4M3 { .. } => (fp8::f32_to_e4m3, fp8::E4M3_MAX),
                _ => (fp8::f32_to_e5m2, fp8::E5M2_MAX),
            };
            let (rows, cols) = as_matrix(shape);
            let (br, bc) = match scaling {
                Scaling::PerBlock { rows, cols } => (rows, cols),
                _ => (rows.max(1), cols.max(1)),
            };
            let mut codes = vec![0u8; xs.len()];
            let mut scales = Vec::new();
            for r0 in (0..rows).step_by(br) {
                for c0 in (0..cols).step_by(bc) {
                    let cells = || {
                        (r0..(r0 + br).min(rows))
                            .flat_map(move |r| (c0..(c0 + bc).min(cols)).map(move |c| r * cols + c))
                    };
                    let amax = cells().map(|i| xs[i].abs()).fold(0.0, f32::max);
                    let s = match scaling {
                        Scaling::None => 1.0,
                        _ if amax == 0.0 => 1.0,
                        _ => amax / max,
                    };
                    for i in cells() {
                        codes[i] = enc(xs[i] / s, overflow);
                    }
                    if scaling != Scaling::None {
                        scales.push(s);
                    }
                }
            }
            if scales.is_empty() && scaling == Scaling::PerTensor {
                scales.push(1.0); // an empty tensor still ships its one scale
            }
            (codes, scales)
        }
    }
}

/// Every conversion of a plan, on tensors holding every rounding edge (one of them large
/// enough to be split over threads), against the scalar conversions element by element.
#[test]
fn every_conversion_matches_the_scalar_one_element_by_element() {
    let e4 = |scaling| CastTo::E4M3 {
        scaling,
        overflow: Overflow::Saturate,
    };
    let e5 = |scaling| CastTo::E5M2 {
        scaling,
        overflow: Overflow::NonFinite,
    };
    let block = Scaling::PerBlock { rows: 3, cols: 5 };
    let cases: Vec<(&str, DType, Vec<usize>, CastTo)> = vec![
        ("a", DType::F32, vec![70_000], CastTo::BF16),
        ("b", DType::F32, vec![70_001], CastTo::F16),
        ("c", DType::BF16, vec![65_536], CastTo::F32),
        ("d", DType::F16, vec![65_536], CastTo::F32),
        ("e", DType::F32, vec![301, 257], e4(Scaling::PerTensor)),
        ("f", DType::BF16, vec![67, 11], e5(block)),
        ("g", DType::F16, vec![9_999], e4(Scaling::None)),
        ("h", DType::F32, vec![50_000], e5(Scaling::None)),
        ("i", DType::I64, vec![3], CastTo::F32),
        // 12 MB: split over threads where the machine has several cores
        ("j", DType::F32, vec![3_000, 1_024], e5(Scaling::PerTensor)),
        (
            "k",
            DType::F32,
            vec![1_000, 64],
            e4(Scaling::PerBlock {
                rows: 128,
                cols: 48,
            }),
        ),
        ("empty", DType::F32, vec![0, 4], e4(Scaling::PerTensor)),
    ];
    let mut b = Manifest::builder();
    for (name, dtype, shape, _) in &cases {
        b.push(*name, *dtype, shape);
    }
    let m = b.build().unwrap();
    let mut rules = CastRules::new();
    for (name, _, _, to) in &cases {
        if *name != "i" {
            rules = rules.tensors(name, *to);
        }
    }
    let mut ws = weights(m.clone());
    let mut inputs = Vec::new();
    for (name, dtype, _, to) in &cases {
        let n = m.get(name).unwrap().shape.iter().product::<usize>();
        let scaled = matches!(to.fp8(), Some((s, ..)) if s != Scaling::None);
        let xs = values(n, scaled);
        let xs: Vec<f32> = match dtype {
            DType::F32 => {
                ws.view_mut::<f32>(name).unwrap().copy_from_slice(&xs);
                xs
            }
            DType::BF16 => {
                // every bf16 bit pattern for `c`
                let v = ws.view_mut::<bf16>(name).unwrap();
                for (i, (d, x)) in v.iter_mut().zip(&xs).enumerate() {
                    *d = if n == 65_536 {
                        bf16::from_bits(i as u16)
                    } else {
                        bf16::from_f32(*x)
                    };
                }
                v.iter().map(|x| x.to_f32()).collect()
            }
            DType::F16 => {
                let v = ws.view_mut::<f16>(name).unwrap();
                for (i, (d, x)) in v.iter_mut().zip(&xs).enumerate() {
                    *d = if n == 65_536 {
                        f16::from_bits(i as u16)
                    } else {
                        f16::from_f32(*x)
                    };
                }
                v.iter().map(|x| x.to_f32()).collect()
            }
            _ => {
                ws.view_mut::<i64>(name)
                    .unwrap()
                    .copy_from_slice(&[1, -2, 3]);
                Vec::new()
            }
        };
        inputs.push(xs);
    }
    let plan = CastPlan::new(&m, &rules).unwrap();
    let out = plan.apply(&ws).unwrap();
    assert_eq!(out.version(), Version(4));
    for ((name, _, shape, to), xs) in cases.iter().zip(&inputs) {
        if *name == "i" {
            assert_eq!(out.view::<i64>("i").unwrap(), [1, -2, 3]);
            continue;
        }
        let (codes, scales) = reference(xs, *to, shape);
        let got = out.tensor(name).unwrap().bytes();
        assert_eq!(got.len(), codes.len(), "{name}");
        if let Some(i) = (0..codes.len()).find(|&i| got[i] != codes[i]) {
            panic!(
                "{name}: byte {i} is {:#04x}, the scalar conversion gives {:#04x}",
                got[i], codes[i]
            );
        }
        if let Some(spec) = out.manifest().get(&format!("{name}.scale")) {
            assert_eq!(out.view::<f32>(&spec.name).unwrap(), &scales[..], "{name}");
        }
    }
}

/// A NaN or infinity under a scale is refused naming the first such element, whichever way
/// the scale is found: a small tensor scanned and encoded in one piece, a large one
/// scanned in a pass of its own (over threads), per-block scales row-block by row-block.
#[test]
fn a_non_finite_value_under_a_scale_names_its_element_on_every_path() {
    let big = (super::exec::LOCAL / 4) * 3;
    let m = Manifest::builder()
        .tensor("small", DType::F32, &[64])
        .tensor("big", DType::F32, &[big])
        .tensor("blocks", DType::BF16, &[6, 8])
        .build()
        .unwrap();
    let cases: [(&str, usize, CastTo); 3] = [
        ("small", 40, CastTo::E4M3_PER_TENSOR),
        ("big", big - 5, CastTo::E4M3_PER_TENSOR),
        (
            "blocks",
            // row 5, column 2: in the first block of the third row-block; the infinity at
            // row 4, column 6 comes earlier in the tensor but lies in a later block (blocks
            // are scanned row-block by row-block, left to right)
            5 * 8 + 2,
            CastTo::E5M2 {
                scaling: Scaling::PerBlock { rows: 2, cols: 4 },
                overflow: Overflow::Saturate,
            },
        ),
    ];
    for (name, at, to) in cases {
        let mut ws = weights(m.clone());
        let plan = CastPlan::new(&m, &CastRules::new().tensors(name, to)).unwrap();
        assert!(plan.apply(&ws).is_ok(), "{name} holds zeros");
        match name {
            "blocks" => {
                let v = ws.view_mut::<bf16>(name).unwrap();
                v[at] = bf16::NAN;
                v[4 * 8 + 6] = bf16::INFINITY;
            }
            _ => {
                let v = ws.view_mut::<f32>(name).unwrap();
                v[at] = f32::NAN;
                v[at + 2] = f32::INFINITY;
            }
        }
        let e = plan.apply(&ws).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("cast of tensor `{name}`: element {at} is NaN; a scale needs finite values")
        );
    }
}
