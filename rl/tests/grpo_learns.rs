//! GRPO learns digit reversal from scratch: the learner's exports go to the generator through
//! the engine's layout (fused qkv, bf16), the generator samples groups, the task rewards them,
//! and the held-out greedy reward rises clearly above a random policy's.

use std::time::Duration;

use refit_rl::grpo::{GrpoConfig, GrpoLearner};
use refit_rl::local_grpo::{self, LocalConfig};
use refit_rl::tasks::vocab::VOCAB;
use refit_rl::tasks::{ReverseConfig, ReverseDigits};
use refit_rl::transformer::{TransformerConfig, TransformerGenerator};

#[test]
fn grpo_learns_to_reverse_three_digits() {
    let mut task = ReverseDigits::new(ReverseConfig {
        min_len: 3,
        max_len: 3,
        heldout: 64,
        ..ReverseConfig::default()
    })
    .unwrap();
    let model = TransformerConfig {
        vocab: VOCAB,
        context: task.context(),
        d_model: 32,
        layers: 2,
        heads: 4,
        mlp_ratio: 2,
    };
    let mut learner = GrpoLearner::new(GrpoConfig {
        lr: 3e-3,
        seed: 1,
        ..GrpoConfig::new(model)
    })
    .unwrap();
    let mut generator = TransformerGenerator::new(model, 1).unwrap();
    let conversion = model.conversion().unwrap();
    let cfg = LocalConfig {
        prompts_per_batch: 16,
        group_size: 8,
        max_updates: 150,
        max_time: Duration::from_secs(600),
        eval_every: 10,
        stop_at: Some(0.8),
        seed: 1,
    };
    let curve = local_grpo::run(
        &mut learner,
        &conversion,
        &mut generator,
        &mut task,
        &cfg,
        |p, _| {
            eprintln!(
                "update {:>4} {:>6.1} s held-out {:.3}",
                p.update, p.seconds, p.heldout_reward
            );
        },
    )
    .unwrap();
    let first = curve[0].heldout_reward;
    let best = curve.iter().map(|p| p.heldout_reward).fold(0.0, f32::max);
    assert!(first <= 0.2, "an untrained policy scored {first}");
    assert!(
        best >= 0.6,
        "held-out reward only reached {best} from {first}"
    );
}
