use refit_runtime::Version;

use super::*;
use crate::generation::{Finish, Token};

fn seq(group: u64, tokens: &[Token], reward: f32, token_rewards: Option<Vec<f32>>) -> Sequence {
    Sequence {
        prompt: vec![0, 4, 5, 1],
        tokens: tokens.to_vec(),
        logprobs: vec![-1.0; tokens.len()],
        versions: vec![Version(1); tokens.len()],
        reward,
        token_rewards,
        group,
        finish: Finish::Length,
        worker: 0,
        ref_logprobs: None,
    }
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-4)
}

#[test]
fn advantages_of_hand_made_groups() {
    let seqs = vec![
        seq(7, &[3, 4], 1.0, None),
        seq(7, &[3, 4], 0.0, None),
        seq(7, &[3], 0.5, None),
        seq(9, &[5, 5, 5], 0.3, None), // a group of one: nothing to compare with
    ];
    let a = group_advantages(&seqs, false, true);
    assert!(close(&a[0], &[0.5, 0.5]), "{:?}", a[0]);
    assert!(close(&a[1], &[-0.5, -0.5]));
    assert!(close(&a[2], &[0.0]));
    assert!(close(&a[3], &[0.0, 0.0, 0.0]));
    // Scaled by the group's standard deviation, sqrt(1/6).
    let a = group_advantages(&seqs, true, true);
    let s = (1.0f32 / 6.0).sqrt();
    assert!(close(&a[0], &[0.5 / s, 0.5 / s]), "{:?}", a[0]);
    assert!(close(&a[1], &[-0.5 / s, -0.5 / s]));

    // Per-token credit: each position against the members that reach it.
    let seqs = vec![
        seq(1, &[3, 3, 3], 2.0 / 3.0, Some(vec![1.0, 0.0, 1.0])),
        seq(1, &[3, 3], 0.0, Some(vec![0.0, 0.0])),
        seq(1, &[3, 3, 3], 1.0, Some(vec![1.0, 1.0, 1.0])),
    ];
    let a = group_advantages(&seqs, false, true);
    let (t, o) = (1.0 / 3.0, 2.0 / 3.0);
    assert!(close(&a[0], &[t, -t, 0.0]), "{:?}", a[0]);
    assert!(close(&a[1], &[-o, -t]), "{:?}", a[1]);
    assert!(close(&a[2], &[t, o, 0.0]), "{:?}", a[2]);
    // Without it, the totals decide.
    let a = group_advantages(&seqs, false, false);
    let mean = (2.0 / 3.0 + 1.0) / 3.0;
    assert!(close(&a[1], &[-mean, -mean]), "{:?}", a[1]);
}

fn tiny() -> GrpoConfig {
    let model = TransformerConfig {
        vocab: 13,
        context: 8,
        d_model: 16,
        layers: 1,
        heads: 2,
        mlp_ratio: 2,
    };
    GrpoConfig {
        lr: 1e-2,
        ..GrpoConfig::new(model)
    }
}

/// The learner's current log-probabilities of each sequence's tokens.
fn current(learner: &mut GrpoLearner, seqs: &[Sequence]) -> Vec<Vec<f32>> {
    let ws = learner
        .model()
        .export(learner.config().policy_id.clone())
        .unwrap();
    let mut r = FrozenReference::new(learner.config().model, &ws).unwrap();
    let refs: Vec<&Sequence> = seqs.iter().collect();
    r.logprobs(&refs, learner.config().temperature).unwrap()
}

fn batch(seqs: Vec<Sequence>) -> Batch {
    Batch {
        frames: seqs.len(),
        sequences: seqs,
        ..Batch::default()
    }
}

/// Two completions of one prompt, the first rewarded; behaviour log-probabilities `shift`
/// away from the learner's own.
fn pair(learner: &mut GrpoLearner, shift: f32) -> Vec<Sequence> {
    pair_shifted(learner, shift, shift)
}

/// As [`pair`], each completion shifted by its own amount.
fn pair_shifted(learner: &mut GrpoLearner, first: f32, second: f32) -> Vec<Sequence> {
    let mut seqs = vec![
        seq(0, &[5, 6, 7], 1.0, None),
        seq(0, &[8, 9, 10], 0.0, None),
    ];
    let lp = current(learner, &seqs);
    for ((s, l), shift) in seqs.iter_mut().zip(lp).zip([first, second]) {
        s.logprobs = l.iter().map(|v| (v + shift).min(0.0)).collect();
    }
    seqs
}

fn sum(v: &[f32]) -> f32 {
    v.iter().sum()
}

#[test]
fn the_clipped_objective_raises_the_rewarded_completion() {
    let mut l = GrpoLearner::new(tiny()).unwrap();
    let seqs = pair(&mut l, 0.0);
    let before = current(&mut l, &seqs);
    let stats = l.update(&batch(seqs.clone())).unwrap();
    let after = current(&mut l, &seqs);
    assert!(
        sum(&after[0]) > sum(&before[0]) + 0.01,
        "{before:?} {after:?}"
    );
    assert!(
        sum(&after[1]) < sum(&before[1]) - 0.01,
        "{before:?} {after:?}"
    );
    assert_eq!(stats.get("clip_fraction"), Some(0.0));
    assert_eq!(stats.get("mean_reward"), Some(0.5));
    assert!((stats.get("behaviour_ratio_mean").unwrap() - 1.0).abs() < 1e-4);
}

#[test]
fn stale_tokens_are_clipped_against_the_behaviour_policy_and_weighted_when_truncated() {
    // The rewarded completion had far less probability under the behaviour policy than it has
    // now (ratio e^2 > 1 + ε with A > 0), the other far more (ratio e^-2 < 1 - ε with A < 0):
    // the clipped objective is flat for both, nothing moves.
    let mut l = GrpoLearner::new(tiny()).unwrap();
    let seqs = pair_shifted(&mut l, -2.0, 2.0);
    let before = current(&mut l, &seqs);
    let stats = l.update(&batch(seqs.clone())).unwrap();
    let after = current(&mut l, &seqs);
    assert_eq!(after, before, "a clipped token moved the weights");
    assert_eq!(stats.get("clip_fraction"), Some(1.0));
    let max = stats.get("behaviour_ratio_max").unwrap();
    assert!((max - 2f64.exp()).abs() < 1e-2, "{max}");
    // A ratio past 1 + ε with a negative advantage is not clipped (PPO's pessimistic bound):
    // that completion is pushed down.
    let mut l = GrpoLearner::new(tiny()).unwrap();
    let seqs = pair(&mut l, -2.0);
    let before = current(&mut l, &seqs);
    l.update(&batch(seqs.clone())).unwrap();
    let after = current(&mut l, &seqs);
    assert!(sum(&after[1]) < sum(&before[1]) - 0.01);

    // Truncated: the ratio is against the learner's own policy (inside the clip), each token
    // weighted by min(π_prox / π_behaviour, cap): the rewarded completion rises.
    let cfg = GrpoConfig {
        correction: Correction::Truncated { cap: 2.0 },
        ..tiny()
    };
    let mut l = GrpoLearner::new(cfg).unwrap();
    let seqs = pair_shifted(&mut l, -2.0, 2.0);
    let before = current(&mut l, &seqs);
    let stats = l.update(&batch(seqs.clone())).unwrap();
    let after = current(&mut l, &seqs);
    assert!(sum(&after[0]) > sum(&before[0]) + 0.01);
    assert!(sum(&after[1]) < sum(&before[1]) - 0.01);
    assert_eq!(stats.get("clip_fraction"), Some(0.0));
    assert_eq!(stats.get("truncated_fraction"), Some(0.5));
}

#[test]
fn the_truncated_weight_scales_the_step() {
    // With Adam a constant factor on the loss hardly changes the step, so compare gradient
    // norms: a weight of min(e^-1, 2) = e^-1 scales them by e^-1.
    let norm = |correction: Correction, shift: f32| {
        let cfg = GrpoConfig {
            correction,
            max_grad_norm: None,
            ..tiny()
        };
        let mut l = GrpoLearner::new(cfg).unwrap();
        let seqs = pair(&mut l, shift);
        l.update(&batch(seqs)).unwrap().get("grad_norm").unwrap()
    };
    let plain = norm(Correction::Ignore, 1.0);
    let weighted = norm(Correction::Truncated { cap: 2.0 }, 1.0);
    assert!(
        (weighted / plain - (-1f64).exp()).abs() < 0.02,
        "{weighted} / {plain}"
    );
}

#[test]
fn the_kl_term_pulls_toward_the_reference() {
    let cfg = GrpoConfig {
        kl_coef: 1.0,
        ..tiny()
    };
    let mut l = GrpoLearner::new(cfg.clone()).unwrap();
    // The reference is another model; every reward equal, so only the KL term acts.
    let other = cfg.model.init_weights(cfg.policy_id.clone(), 77).unwrap();
    let mut other_ws = other;
    for v in other_ws.view_mut::<f32>("head.weight").unwrap() {
        *v *= 50.0;
    }
    l.set_reference(Box::new(
        FrozenReference::new(cfg.model, &other_ws).unwrap(),
    ));
    let mut seqs = pair(&mut l, 0.0);
    seqs[1].reward = 1.0;
    let mut kls = Vec::new();
    for _ in 0..5 {
        let b = batch(seqs.clone());
        kls.push(l.update(&b).unwrap().get("kl").unwrap());
        let lp = current(&mut l, &seqs);
        for (s, v) in seqs.iter_mut().zip(lp) {
            s.logprobs = v;
        }
    }
    assert!(kls[0] > 0.01, "{kls:?}");
    assert!(kls[4] < kls[0] * 0.8, "{kls:?}");
    // Without a KL coefficient no kl is reported.
    let mut l = GrpoLearner::new(tiny()).unwrap();
    let seqs = pair(&mut l, 0.0);
    assert_eq!(l.update(&batch(seqs)).unwrap().get("kl"), None);
}

#[test]
fn a_served_reference_reads_the_sequences_scores_and_refuses_a_batch_without() {
    let cfg = GrpoConfig {
        kl_coef: 1.0,
        ..tiny()
    };
    let mut l = GrpoLearner::new(cfg).unwrap();
    l.set_reference(Box::new(ServedReference));
    let mut seqs = pair(&mut l, 0.0);
    seqs[1].reward = 1.0;
    // scores equal to the policy's own: no divergence yet
    let own = current(&mut l, &seqs);
    for (s, lp) in seqs.iter_mut().zip(&own) {
        s.ref_logprobs = Some(lp.clone());
    }
    let kl = l.update(&batch(seqs.clone())).unwrap().get("kl").unwrap();
    assert!(kl.abs() < 1e-4, "{kl}");
    // scores far below the policy's: a positive KL
    for s in &mut seqs {
        s.ref_logprobs = Some(
            s.ref_logprobs
                .as_ref()
                .unwrap()
                .iter()
                .map(|l| l - 2.0)
                .collect(),
        );
    }
    let kl = l.update(&batch(seqs.clone())).unwrap().get("kl").unwrap();
    assert!(kl > 0.5, "{kl}");
    // a sequence without scores, or with the wrong count, is refused naming it
    let mut missing = seqs.clone();
    missing[1].ref_logprobs = None;
    let e = l.update(&batch(missing)).unwrap_err().to_string();
    assert!(
        e.contains("sequence 1") && e.contains("no reference"),
        "{e}"
    );
    let mut short = seqs;
    short[0].ref_logprobs.as_mut().unwrap().pop();
    let e = l.update(&batch(short)).unwrap_err().to_string();
    assert!(e.contains("sequence 0"), "{e}");
}

#[test]
fn several_epochs_of_minibatches_take_that_many_steps() {
    let cfg = GrpoConfig {
        epochs: 2,
        minibatch: 1,
        correction: Correction::Truncated { cap: 2.0 },
        ..tiny()
    };
    let mut l = GrpoLearner::new(cfg).unwrap();
    let seqs = pair(&mut l, 0.0);
    let before = current(&mut l, &seqs);
    let stats = l.update(&batch(seqs.clone())).unwrap();
    assert_eq!(stats.get("steps"), Some(4.0));
    let after = current(&mut l, &seqs);
    assert!(sum(&after[0]) > sum(&before[0]));
}

#[test]
fn malformed_sequences_are_named_and_change_nothing() {
    let mut l = GrpoLearner::new(tiny()).unwrap();
    let good = pair(&mut l, 0.0);
    let before = current(&mut l, &good);
    let mut bad = good.clone();
    bad[1].logprobs.pop();
    let e = l.update(&batch(bad)).unwrap_err().to_string();
    assert!(e.contains("sequence 1") && e.contains("logprobs"), "{e}");
    let mut bad = good.clone();
    bad[0].tokens[1] = 13;
    let e = l.update(&batch(bad)).unwrap_err().to_string();
    assert!(e.contains("sequence 0") && e.contains("vocabulary"), "{e}");
    let mut bad = good.clone();
    bad[0].token_rewards = Some(vec![1.0]);
    let e = l.update(&batch(bad)).unwrap_err().to_string();
    assert!(e.contains("token_rewards"), "{e}");
    let mut bad = good.clone();
    bad[0].tokens = vec![3; 6];
    bad[0].logprobs = vec![-1.0; 6];
    bad[0].versions = vec![Version(1); 6];
    let e = l.update(&batch(bad)).unwrap_err().to_string();
    assert!(e.contains("context"), "{e}");
    let e = l.update(&batch(vec![])).unwrap_err().to_string();
    assert!(e.contains("no generated token"), "{e}");
    assert_eq!(current(&mut l, &good), before);
}

#[test]
fn exports_are_new_versions_of_the_policy() {
    let mut l = GrpoLearner::new(tiny()).unwrap();
    let a = l.export().unwrap();
    let b = l.export().unwrap();
    assert_eq!((a.version().get(), b.version().get()), (1, 2));
    assert_eq!(Learner::version(&l).get(), 2);
    assert_eq!(a.model(), &l.config().policy_id);
    assert_eq!(a.manifest(), &Learner::manifest(&l));
}

#[test]
fn bad_settings_are_named() {
    for (cfg, name) in [
        (GrpoConfig { lr: 0.0, ..tiny() }, "lr"),
        (
            GrpoConfig {
                clip: -0.1,
                ..tiny()
            },
            "clip",
        ),
        (
            GrpoConfig {
                epochs: 0,
                ..tiny()
            },
            "epochs",
        ),
        (
            GrpoConfig {
                temperature: 0.0,
                ..tiny()
            },
            "temperature",
        ),
        (
            GrpoConfig {
                correction: Correction::Truncated { cap: 0.5 },
                ..tiny()
            },
            "is_cap",
        ),
    ] {
        let e = GrpoLearner::new(cfg).unwrap_err().to_string();
        assert!(e.contains(name), "{name}: {e}");
    }
}
