//! The topology hosts a user's own roles: an environment that is not CartPole (3 values per
//! observation, 3 actions), a learner that is not PPO, and an MLP of the user's sizes; and it
//! refuses roles that do not fit each other, naming the model.
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use refit_actors::ModelSpec;
use refit_actors::run::{self as topology, RunConfig, StopRule};
use refit_actors::{
    Batch, Env, LearnStats, Learner, MlpPolicy, Roles, StepResult, policy_model_id,
};
use refit_runtime::sync_policy::{SyncConfig, SyncMode};
use refit_runtime::{Manifest, ModelId, Version, WeightSet};

/// A corridor of 6 cells: start in cell 0, reward 1 on reaching cell 5. Actions: left,
/// stay, right. Observation: `[position / 5, 1, steps / 20]`; 20 steps at most.
struct Corridor {
    pos: i32,
    steps: u32,
}

impl Corridor {
    fn obs(&self) -> Vec<f32> {
        vec![self.pos as f32 / 5.0, 1.0, self.steps as f32 / 20.0]
    }
}

impl Env for Corridor {
    fn obs_dim(&self) -> usize {
        3
    }
    fn num_actions(&self) -> usize {
        3
    }
    fn reset(&mut self, _seed: Option<u64>) -> refit_rl::Result<Vec<f32>> {
        self.pos = 0;
        self.steps = 0;
        Ok(self.obs())
    }
    fn step(&mut self, action: usize) -> refit_rl::Result<StepResult> {
        self.pos = match action {
            0 => (self.pos - 1).max(0),
            1 => self.pos,
            2 => self.pos + 1,
            a => {
                return Err(refit_rl::Error::env(
                    0,
                    format!("action {a} is not one of 0, 1, 2"),
                ));
            }
        };
        self.steps += 1;
        let terminated = self.pos >= 5;
        Ok(StepResult {
            obs: self.obs(),
            reward: if terminated { 1.0 } else { 0.0 },
            terminated,
            truncated: !terminated && self.steps >= 20,
        })
    }
}

/// Not PPO: each update raises the bias of "right" by one; the weights are a single linear
/// layer in the `MlpPolicy` layout `[3, 3]`.
struct RightLearner {
    model: ModelId,
    manifest: Arc<Manifest>,
    version: Version,
    frames: usize,
}

impl Learner for RightLearner {
    fn update(&mut self, batch: &Batch) -> refit_rl::Result<LearnStats> {
        self.frames += batch.frames;
        Ok(LearnStats::new().with("frames", self.frames as f64))
    }
    fn export(&mut self) -> refit_rl::Result<WeightSet> {
        let mut ws = WeightSet::zeroed(self.model.clone(), Arc::clone(&self.manifest));
        self.version = self.version.next();
        ws.view_mut::<f32>(&MlpPolicy::bias_name(0))?[2] = self.version.get() as f32;
        ws.set_version(self.version);
        Ok(ws)
    }
    fn manifest(&self) -> Arc<Manifest> {
        Arc::clone(&self.manifest)
    }
    fn version(&self) -> Version {
        self.version
    }
}

// ANCHOR: user_roles
/// The user's factory; `policy_sizes` lets a test make a policy that does not fit.
struct CorridorRoles {
    policy_sizes: Vec<usize>,
}

impl Roles for CorridorRoles {
    type Env = Corridor;
    type Policy = MlpPolicy;
    fn learner(&self, model: &ModelSpec) -> refit_rl::Result<Box<dyn Learner>> {
        Ok(Box::new(RightLearner {
            model: model.id.clone(),
            manifest: Arc::new(MlpPolicy::manifest_for(&[3, 3])?),
            version: Version::ZERO,
            frames: 0,
        }))
    }
    fn policy(&self, _model: &ModelSpec) -> refit_rl::Result<MlpPolicy> {
        Ok(MlpPolicy::new(&self.policy_sizes)?)
    }
    fn env(&self, _model: &ModelSpec, _seed: u64) -> refit_rl::Result<Corridor> {
        Ok(Corridor { pos: 0, steps: 0 })
    }
}
// ANCHOR_END: user_roles

fn config(updates: u64) -> RunConfig {
    let mut sync = SyncConfig::with_mode(SyncMode::BatchAsync);
    sync.validate_freq = 2;
    let mut spec = ModelSpec::new(policy_model_id(), 0);
    spec.workers = 2;
    spec.envs_per_worker = 2;
    spec.fragment_steps = 8;
    spec.batch_frames = 64;
    RunConfig {
        sync,
        models: vec![spec],
        eval_episodes: 3,
        stop: StopRule {
            target_eval: None,
            max_updates: updates,
            target_return: None,
            max_time: Duration::from_secs(120),
        },
        seed: 1,
        wrap_inlet: None,
        wait: Duration::from_secs(60),
    }
}

#[actix_rt::test]
async fn a_users_env_learner_and_policy_sizes_run_in_the_topology() {
    let roles = CorridorRoles {
        policy_sizes: vec![3, 3],
    };
    let report = topology::run(config(6), roles).await.unwrap();
    let r = &report.models[&policy_model_id()];
    assert_eq!(r.updates.len(), 6);
    for (i, u) in r.updates.iter().enumerate() {
        assert!(u.frames >= 64, "update {i} trained on {} frames", u.frames);
        assert_eq!(u.published, Version(u.train_version.get() + 1));
    }
    assert!(r.episodes > 0, "no episode finished in {} frames", r.frames);
    // Evals ran greedy on the served weights: "right" has the largest bias from v1 on, so
    // every eval episode reaches the goal (with zero weights greedy goes left and never does).
    assert!(!r.evals.is_empty());
    for e in &r.evals {
        e.check_versions(e.step).unwrap();
        let m = &e.models[&policy_model_id()];
        assert_eq!(m.mean_return, 1.0, "eval at v{}: {m:?}", e.step);
    }
    // The engine loads each version it is told of, once; a notification that finds a newer
    // version already staged loads that one, so versions published in quick succession
    // (batch-async) may share one load: at least one load, never more than one per version
    // (version 1, loaded at start, and each published one).
    let loads = report.engine.loads as usize;
    assert!(
        (1..=r.updates.len() + 1).contains(&loads),
        "{loads} loads for version 1 and {} published versions",
        r.updates.len()
    );
}

#[actix_rt::test]
async fn a_policy_that_does_not_fit_the_environment_is_refused_naming_the_model() {
    let roles = CorridorRoles {
        policy_sizes: vec![4, 3],
    };
    let e = topology::run(config(1), roles)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("`policy`") && e.contains("4 values"), "{e}");
}

#[actix_rt::test]
async fn a_learner_whose_exports_the_policy_cannot_load_is_refused() {
    let roles = CorridorRoles {
        policy_sizes: vec![3, 8, 3],
    };
    let e = topology::run(config(1), roles)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("policy"), "{e}");
}
