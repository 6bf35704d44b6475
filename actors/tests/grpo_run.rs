//! GRPO through a generating topology in one process (`run::run_generating`): the
//! transformer learns digit reversal from scratch, every completion's per-token versions
//! reach the learner (its staleness statistics see them in `fully-async` mode), and the
//! engine reports its tokens and loads.
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Duration;

use refit_actors::run::{self, RunConfig, StopRule};
use refit_actors::{GrpoRoles, ModelSpec, policy_model_id};
use refit_runtime::sync_policy::{SyncConfig, SyncMode};

#[actix_rt::test]
async fn grpo_learns_reversal_in_one_process_and_sees_per_token_versions() {
    let mut spec = ModelSpec::new(policy_model_id(), 3);
    spec.workers = 2;
    spec.batch_frames = 128;
    spec = spec
        .with_param("min_len", 3)
        .with_param("max_len", 3)
        .with_param("heldout", 64);
    let mut sync = SyncConfig::with_mode(SyncMode::FullyAsync);
    sync.validate_freq = 5;
    let cfg = RunConfig {
        sync,
        models: vec![spec],
        eval_episodes: 0,
        stop: StopRule {
            max_updates: 200,
            target_return: None,
            target_eval: Some(0.6),
            max_time: Duration::from_secs(300),
        },
        seed: 3,
        wrap_inlet: None,
        wait: Duration::from_secs(60),
    };
    let report = run::run_generating(cfg, GrpoRoles::new()).await.unwrap();
    let r = &report.models[&policy_model_id()];
    let first = r.evals.first().unwrap().models[&policy_model_id()].mean_return;
    let last = r.evals.last().unwrap().models[&policy_model_id()].mean_return;
    assert!(
        report.solved,
        "held-out {first} -> {last} in {} updates",
        r.updates.len()
    );
    assert!(first <= 0.3 && last >= 0.6, "{first} -> {last}");
    // rollouts ran ahead of the trainer: the learner saw tokens of older versions
    let stale = r
        .updates
        .iter()
        .filter_map(|u| u.learn.get("staleness_max"))
        .fold(0.0f64, f64::max);
    assert!(stale >= 1.0, "no update saw a stale token ({stale})");
    assert!(
        r.staleness.histogram.keys().any(|s| *s >= 1),
        "{:?}",
        r.staleness
    );
    // the engine generated and loaded versions (their pauses are measured by the bench)
    assert!(
        report.engine.tokens > 0 && report.engine.loads > 0,
        "{:?}",
        report.engine
    );
}

#[actix_rt::test]
async fn grpo_learns_with_a_kl_term_to_a_reference_the_engines_serve() {
    let mut spec = ModelSpec::new(policy_model_id(), 5);
    spec.workers = 2;
    spec.batch_frames = 128;
    spec.reference_every = Some(4);
    spec = spec
        .with_param("min_len", 3)
        .with_param("max_len", 3)
        .with_param("heldout", 64)
        .with_param("kl_coef", 0.02);
    let mut sync = SyncConfig::with_mode(SyncMode::BatchAsync);
    sync.validate_freq = 5;
    let cfg = RunConfig {
        sync,
        models: vec![spec],
        eval_episodes: 0,
        stop: StopRule {
            max_updates: 200,
            target_return: None,
            target_eval: Some(0.6),
            max_time: Duration::from_secs(300),
        },
        seed: 5,
        wrap_inlet: None,
        wait: Duration::from_secs(60),
    };
    let report = run::run_generating(cfg, GrpoRoles::new()).await.unwrap();
    let r = &report.models[&policy_model_id()];
    let last = r.evals.last().unwrap().models[&policy_model_id()].mean_return;
    assert!(
        report.solved,
        "held-out {last} in {} updates",
        r.updates.len()
    );
    // every batch carried the reference's scores (the learner refuses a batch without);
    // the policy moved away from the reference between refreshes
    let kls: Vec<f64> = r.updates.iter().filter_map(|u| u.learn.get("kl")).collect();
    assert_eq!(kls.len(), r.updates.len(), "every update has a KL term");
    assert!(kls.iter().all(|k| k.is_finite()), "{kls:?}");
    assert!(kls.iter().any(|k| *k > 1e-4), "{kls:?}");
}

#[actix_rt::test]
async fn a_served_reference_without_a_kl_term_is_refused_naming_both_keys() {
    let mut spec = ModelSpec::new(policy_model_id(), 5);
    spec.reference_every = Some(4);
    let e = refusal(spec).await;
    assert!(
        e.contains("reference_every") && e.contains("kl_coef"),
        "{e}"
    );
}

/// A generating model whose engines verify what they serve (`verify = "hashes"`): the
/// self-test at the first version passes on the transformer, every later version is read
/// back against its bytes and the weights served are read again at the next version, and
/// nothing is reported damaged.
#[actix_rt::test]
async fn a_generating_run_that_verifies_what_it_serves_reports_no_damage() {
    let mut spec = ModelSpec::new(policy_model_id(), 3);
    spec.verify = refit_runtime::topology::Verify::Hashes;
    let report = run::run_generating(config(spec, 4), GrpoRoles::new())
        .await
        .unwrap();
    let status = &report.controller.models[&policy_model_id()];
    assert!(status.loads >= 4, "{status:?}");
    assert_eq!((status.damaged, status.failed_loads), (0, 0), "{status:?}");
}

/// A sync run of `spec` stopping after `updates` updates.
fn config(spec: ModelSpec, updates: u64) -> RunConfig {
    RunConfig {
        sync: SyncConfig::with_mode(SyncMode::Sync),
        models: vec![spec],
        eval_episodes: 0,
        stop: StopRule {
            max_updates: updates,
            target_return: None,
            target_eval: None,
            max_time: Duration::from_secs(60),
        },
        seed: 5,
        wrap_inlet: None,
        wait: Duration::from_secs(60),
    }
}

/// The error of a one-update generating run of `spec` that must be refused before it starts.
async fn refusal(spec: ModelSpec) -> String {
    run::run_generating(config(spec, 1), GrpoRoles::new())
        .await
        .unwrap_err()
        .to_string()
}
