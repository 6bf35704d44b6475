//! A learner's state for checkpoints: PPO saved, written as safetensors, read back and
//! restored into a fresh learner trains on exactly as the saved one would have (weights,
//! critic and the optimiser's moments all come back); a state of another configuration is
//! refused naming the tensor.
#![allow(clippy::unwrap_used, missing_docs)]

use refit_rl::{
    Batch, CartPole, Collector, Learner, MlpPolicy, PpoConfig, PpoTrainer, UpdatePolicyWeights,
};
use refit_runtime::{HasWeights, Version, WeightSet};

fn cfg(hidden: usize) -> PpoConfig {
    PpoConfig {
        sizes: vec![4, hidden, 2],
        epochs: 2,
        minibatch: 64,
        ..PpoConfig::default()
    }
}

fn batch(weights: WeightSet, seed: u64) -> Batch {
    let envs = (0..2)
        .map(|i| CartPole::new(seed + i).with_index(i as usize))
        .collect();
    let policy = MlpPolicy::new(&[4, 16, 2]).unwrap();
    let mut c = Collector::builder(envs, policy)
        .frames_per_batch(256)
        .build()
        .unwrap();
    c.update_weights(weights).unwrap();
    c.next_batch().unwrap().unwrap()
}

/// Each learner trains on `batch`, then exports.
fn train_and_export<const N: usize>(
    learners: [&mut dyn Learner; N],
    batch: &Batch,
) -> [WeightSet; N] {
    learners.map(|l| {
        l.update(batch).unwrap();
        l.export().unwrap()
    })
}

#[test]
fn a_restored_ppo_learner_trains_on_as_the_saved_one() {
    let mut a = PpoTrainer::new(cfg(16)).unwrap();
    let w1 = a.export().unwrap();
    for seed in [1, 2] {
        let b = batch(w1.clone(), seed);
        Learner::update(&mut a, &b).unwrap();
    }
    let saved = Learner::save(&a).unwrap();
    assert_eq!(saved.version(), Version(1));
    // through a file, as a checkpoint travels
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.safetensors");
    saved.write_safetensors(&path).unwrap();
    let read = WeightSet::read_safetensors(&path, None).unwrap();
    let source = path.display().to_string();
    let restored = |seed_cfg: u64| {
        let mut l = PpoTrainer::new(PpoConfig {
            seed: seed_cfg,
            ..cfg(16)
        })
        .unwrap();
        Learner::restore(&mut l, &read, &source).unwrap();
        l
    };
    // a fresh learner of another seed takes the whole state back
    let (mut b, mut c) = (restored(7), restored(7));
    assert_eq!(Learner::version(&b), Version(1));
    let (eb, ea) = (b.export().unwrap(), a.export().unwrap());
    assert_eq!(eb.version(), Version(2));
    assert_eq!(eb.bytes(), ea.bytes(), "the policy came back");
    assert_eq!(
        Learner::save(&b).unwrap().bytes(),
        Learner::save(&a).unwrap().bytes(),
        "critic and moments came back"
    );
    // two restores train alike; a learner given the policy alone (no critic, no moments)
    // trains differently: the rest of the state matters, and came back
    c.export().unwrap();
    let mut policy_only = PpoTrainer::new(cfg(16)).unwrap();
    policy_only.read_weights(&eb).unwrap();
    let next = batch(eb.clone(), 3);
    let [wb, wc, wp] = train_and_export([&mut b, &mut c, &mut policy_only], &next);
    assert_eq!(wb.bytes(), wc.bytes());
    assert_ne!(wb.bytes(), wp.bytes());
}

#[test]
fn a_state_of_another_configuration_or_model_is_refused_naming_what_differs() {
    let mut a = PpoTrainer::new(cfg(16)).unwrap();
    a.export().unwrap();
    let saved = Learner::save(&a).unwrap();
    let mut wider = PpoTrainer::new(cfg(32)).unwrap();
    let e = Learner::restore(&mut wider, &saved, "ckpt/policy/v1.safetensors")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ckpt/policy/v1.safetensors")
            && e.contains("actor.0.weight")
            && e.contains("[16, 4]")
            && e.contains("[32, 4]"),
        "{e}"
    );
    let other = PpoTrainer::new(PpoConfig {
        policy_id: refit_runtime::ModelId::new("other").unwrap(),
        ..cfg(16)
    })
    .unwrap();
    let e = Learner::restore(
        &mut PpoTrainer::new(cfg(16)).unwrap(),
        &Learner::save(&other).unwrap(),
        "f",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("model `other`, not `policy`"), "{e}");
}

/// GRPO's state (the policy's parameters, the optimiser's moments and step) through a
/// file: a learner restored from it trains on a batch exactly as another restored one
/// does, and differently from one given the policy alone.
#[test]
fn a_restored_grpo_learner_trains_on_as_the_saved_one() {
    use rand::SeedableRng;
    use refit_rl::Generator;
    use refit_rl::grpo::{GrpoConfig, GrpoLearner};
    use refit_rl::local_grpo::{self, LocalConfig};
    use refit_rl::tasks::vocab::VOCAB;
    use refit_rl::tasks::{ReverseConfig, ReverseDigits};
    use refit_rl::transformer::{TransformerConfig, TransformerGenerator};

    let mut task = ReverseDigits::new(ReverseConfig {
        min_len: 2,
        max_len: 2,
        heldout: 8,
        ..ReverseConfig::default()
    })
    .unwrap();
    let model = TransformerConfig {
        vocab: VOCAB,
        context: task.context(),
        d_model: 16,
        layers: 1,
        heads: 2,
        mlp_ratio: 2,
    };
    let cfg = LocalConfig {
        prompts_per_batch: 4,
        group_size: 4,
        ..LocalConfig::default()
    };
    let learner = || {
        GrpoLearner::new(GrpoConfig {
            lr: 3e-3,
            seed: 1,
            ..GrpoConfig::new(model)
        })
        .unwrap()
    };
    let conversion = model.conversion().unwrap();
    let mut generator = TransformerGenerator::new(model, 1).unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
    let mut batch_of = |l: &mut GrpoLearner, task: &mut ReverseDigits| {
        let ws = l.export().unwrap();
        let staged = generator.stage(&conversion.apply(&ws).unwrap()).unwrap();
        local_grpo::sample_batch(
            &mut generator,
            &staged,
            ws.version(),
            task,
            &cfg,
            0,
            &mut rng,
        )
        .unwrap()
    };
    let mut a = learner();
    for _ in 0..2 {
        let b = batch_of(&mut a, &mut task);
        Learner::update(&mut a, &b).unwrap();
    }
    let saved = Learner::save(&a).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("grpo.safetensors");
    saved.write_safetensors(&path).unwrap();
    let read = WeightSet::read_safetensors(&path, None).unwrap();
    let restored = || {
        let mut l = learner();
        Learner::restore(&mut l, &read, "grpo.safetensors").unwrap();
        l
    };
    let (mut b, mut c) = (restored(), restored());
    let next = batch_of(&mut b, &mut task);
    c.export().unwrap();
    let policy = a.model().export(a.config().policy_id.clone()).unwrap();
    let mut policy_only = GrpoLearner::from_weights(a.config().clone(), &policy).unwrap();
    let [wb, wc, wp] = train_and_export([&mut b, &mut c, &mut policy_only], &next);
    assert_eq!(wb.version(), Version(saved.version().0 + 2));
    assert_eq!(wb.bytes(), wc.bytes());
    assert_ne!(wb.bytes(), wp.bytes());
}
