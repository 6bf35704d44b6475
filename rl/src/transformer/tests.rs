use std::sync::Arc;

use half::bf16;
use refit_runtime::cast::CastTo;
use refit_runtime::{CastRules, Conversion, DType, ModelId, Want, WeightSet};

use super::*;
use crate::generation::{Generator, StepInput, Token};

fn cfg() -> TransformerConfig {
    TransformerConfig {
        vocab: 13,
        context: 16,
        d_model: 32,
        layers: 2,
        heads: 4,
        mlp_ratio: 4,
    }
}

/// Trainer-layout weights with larger values than the initialisation's (so logits are far
/// from uniform and a wrong wiring shows).
fn weights(cfg: &TransformerConfig, seed: u64) -> WeightSet {
    let mut ws = cfg.init_weights(ModelId::new("pi").unwrap(), seed).unwrap();
    let names: Vec<String> = ws
        .manifest()
        .tensors()
        .iter()
        .map(|t| t.name.clone())
        .collect();
    for (i, name) in names.iter().enumerate() {
        let v = ws.view_mut::<f32>(name).unwrap();
        let is_norm = name.contains(".ln") || name.starts_with("ln_f");
        for (j, x) in v.iter_mut().enumerate() {
            if is_norm {
                // Layer norms away from (1, 0) too.
                *x += 0.1 * (((i * 31 + j * 7) % 13) as f32 / 13.0 - 0.5);
            } else {
                *x *= 10.0;
            }
        }
    }
    ws
}

fn serve(cfg: &TransformerConfig, ws: &WeightSet) -> (TransformerGenerator, ServingWeights) {
    let conv = cfg.conversion().unwrap();
    let engine_ws = conv.apply(ws).unwrap();
    let generator = TransformerGenerator::new(*cfg, 1).unwrap();
    let staged = generator.stage(&engine_ws).unwrap();
    (generator, staged)
}

/// Feeds `steps` (token chunks) one call each; answers the logits after each.
fn run(
    generator: &mut TransformerGenerator,
    w: &ServingWeights,
    steps: &[&[Token]],
) -> Vec<Vec<f32>> {
    let mut cache = generator.new_cache();
    let mut logits = Vec::new();
    steps
        .iter()
        .map(|tokens| {
            let mut inputs = [StepInput {
                cache: &mut cache,
                tokens,
            }];
            generator.forward(w, &mut inputs, &mut logits).unwrap();
            logits.clone()
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

const SEQ: [Token; 10] = [0, 5, 9, 3, 12, 7, 1, 8, 8, 2];

#[test]
fn the_generator_serves_what_the_trainer_computes_in_bf16() {
    let c = cfg();
    let ws = weights(&c, 3);
    let trainer = Transformer::from_weights(c, &ws).unwrap();
    let full = trainer.logits(&SEQ).unwrap();
    let v = c.vocab;
    let scale = full.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(scale > 1.0, "logits too flat to compare: {scale}");
    // Prefill of the first 4 tokens, then one token per step.
    let (mut generator, staged) = serve(&c, &ws);
    let mut steps: Vec<&[Token]> = vec![&SEQ[..4]];
    steps.extend(SEQ[4..].chunks(1));
    let got = run(&mut generator, &staged, &steps);
    for (k, g) in got.iter().enumerate() {
        let pos = 3 + k;
        let want = &full[pos * v..(pos + 1) * v];
        let d = max_diff(g, want);
        assert!(
            d < 0.03 * scale,
            "position {pos}: {d} against logits of scale {scale}"
        );
    }

    // On the bf16-rounded weights themselves, the two forwards agree to f32 rounding.
    let round = Want::new().cast(CastRules::new().dtype(DType::F32, CastTo::BF16));
    let back = Want::new().cast(CastRules::new().dtype(DType::BF16, CastTo::F32));
    let m = Arc::clone(ws.manifest());
    let halved = Conversion::new(&m, &round).unwrap().apply(&ws).unwrap();
    let rounded = Conversion::new(halved.manifest(), &back)
        .unwrap()
        .apply(&halved)
        .unwrap();
    let exact = Transformer::from_weights(c, &rounded)
        .unwrap()
        .logits(&SEQ)
        .unwrap();
    for (k, g) in got.iter().enumerate() {
        let pos = 3 + k;
        let d = max_diff(g, &exact[pos * v..(pos + 1) * v]);
        assert!(d < 1e-4 * scale, "position {pos}: {d}");
    }
}

#[test]
fn incremental_decoding_equals_a_full_prefill() {
    let c = cfg();
    let ws = weights(&c, 5);
    let (mut generator, staged) = serve(&c, &ws);
    let whole = run(&mut generator, &staged, &[&SEQ]);
    let one_by_one: Vec<&[Token]> = SEQ.chunks(1).collect();
    let inc = run(&mut generator, &staged, &one_by_one);
    let d = max_diff(&whole[0], inc.last().unwrap());
    assert!(d < 1e-4, "{d}");
    // And each prefix's prefill gives that step's logits.
    for n in [1, 3, 7] {
        let prefix = run(&mut generator, &staged, &[&SEQ[..n]]);
        let d = max_diff(&prefix[0], &inc[n - 1]);
        assert!(d < 1e-4, "prefix {n}: {d}");
    }
}

#[test]
fn a_batched_step_equals_its_sequences_one_by_one() {
    let c = cfg();
    let ws = weights(&c, 7);
    let (mut generator, staged) = serve(&c, &ws);
    // Three sequences: a fresh prefill of 5, one decoding its 4th token, one prefilled with
    // 6 and fed 3 more at once.
    let plans: [(&[Token], &[Token]); 3] = [
        (&[], &SEQ[..5]),
        (&SEQ[2..5], &SEQ[5..6]),
        (&SEQ[..6], &SEQ[6..9]),
    ];
    let mut alone = Vec::new();
    for (history, now) in plans {
        let mut steps = Vec::new();
        if !history.is_empty() {
            steps.push(history);
        }
        steps.push(now);
        alone.push(run(&mut generator, &staged, &steps).pop().unwrap());
    }
    let mut caches: Vec<KvCache> = plans
        .iter()
        .map(|(history, _)| {
            let mut cache = generator.new_cache();
            if !history.is_empty() {
                let mut logits = Vec::new();
                let mut inputs = [StepInput {
                    cache: &mut cache,
                    tokens: history,
                }];
                generator
                    .forward(&staged, &mut inputs, &mut logits)
                    .unwrap();
            }
            cache
        })
        .collect();
    let mut inputs: Vec<StepInput<'_, KvCache>> = caches
        .iter_mut()
        .zip(&plans)
        .map(|(cache, (_, now))| StepInput { cache, tokens: now })
        .collect();
    let mut logits = Vec::new();
    generator
        .forward(&staged, &mut inputs, &mut logits)
        .unwrap();
    drop(inputs);
    assert_eq!(logits.len(), 3 * c.vocab);
    for (i, a) in alone.iter().enumerate() {
        let d = max_diff(&logits[i * c.vocab..(i + 1) * c.vocab], a);
        assert!(d < 1e-4, "sequence {i}: {d}");
    }
    assert_eq!(
        caches.iter().map(KvCache::len).collect::<Vec<_>>(),
        vec![5, 4, 9]
    );
}

#[test]
fn stage_refuses_another_layout_and_non_finite_values() {
    let c = cfg();
    let ws = weights(&c, 1);
    let generator = TransformerGenerator::new(c, 1).unwrap();
    let e = generator.stage(&ws).unwrap_err().to_string();
    assert!(e.contains("tok_emb.weight") && e.contains("bf16"), "{e}");
    let mut engine_ws = c.conversion().unwrap().apply(&ws).unwrap();
    engine_ws
        .view_mut::<bf16>("blocks.1.mlp.fc.weight")
        .unwrap()[17] = bf16::NAN;
    let e = generator.stage(&engine_ws).unwrap_err().to_string();
    assert!(
        e.contains("blocks.1.mlp.fc.weight") && e.contains("element 17"),
        "{e}"
    );
}

#[test]
fn a_bad_step_changes_no_cache() {
    let c = cfg();
    let ws = weights(&c, 2);
    let (mut generator, staged) = serve(&c, &ws);
    let mut a = generator.new_cache();
    let mut b = generator.new_cache();
    let mut logits = Vec::new();
    let mut inputs = [
        StepInput {
            cache: &mut a,
            tokens: &SEQ[..3],
        },
        StepInput {
            cache: &mut b,
            tokens: &SEQ[..4],
        },
    ];
    generator
        .forward(&staged, &mut inputs, &mut logits)
        .unwrap();
    let long = [1; 13];
    for (tokens, field) in [
        (&long[..], "context"),
        (&[13][..], "vocabulary"),
        (&[][..], "no token"),
    ] {
        let mut inputs = [
            StepInput {
                cache: &mut a,
                tokens: &SEQ[..1],
            },
            StepInput {
                cache: &mut b,
                tokens,
            },
        ];
        let e = generator
            .forward(&staged, &mut inputs, &mut logits)
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{e}");
        assert_eq!((a.len(), b.len()), (3, 4));
    }
}

#[test]
fn export_and_load_round_trip() {
    let c = cfg();
    let ws = weights(&c, 4);
    let t = Transformer::from_weights(c, &ws).unwrap();
    let out = t.export(ModelId::new("pi").unwrap()).unwrap();
    assert_eq!(out.bytes(), ws.bytes());
    let mut other = Transformer::new(c, 99).unwrap();
    assert_ne!(other.logits(&SEQ).unwrap(), t.logits(&SEQ).unwrap());
    other.load(&ws).unwrap();
    assert_eq!(other.logits(&SEQ).unwrap(), t.logits(&SEQ).unwrap());
    let wrong = TransformerConfig { d_model: 16, ..c }
        .init_weights(ModelId::new("pi").unwrap(), 0)
        .unwrap();
    assert!(
        other
            .load(&wrong)
            .unwrap_err()
            .to_string()
            .contains("tok_emb.weight")
    );
}

/// What a version stages into reads back as the version's bytes, tensor by tensor (what
/// an engine's `verify` compares); a layout of another model is refused.
#[test]
fn staged_weights_export_as_the_version_staged() {
    let c = cfg();
    let ws = weights(&c, 3);
    let generator = TransformerGenerator::new(c, 1).unwrap();
    let engine_ws = c.conversion().unwrap().apply(&ws).unwrap();
    let staged = generator.stage(&engine_ws).unwrap();
    let mut out = WeightSet::zeroed(engine_ws.model().clone(), generator.manifest());
    generator.export(&staged, &mut out).unwrap();
    assert_eq!(out.tensor_checksums(), engine_ws.tensor_checksums());
    let e = generator.export(&staged, &mut ws.clone()).unwrap_err();
    assert!(e.to_string().contains("tok_emb.weight"), "{e}");
}
