//! Per-model sync state and the rollout status check.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::{ModelId, Version};

use super::config::{SyncConfig, SyncMode};

/// Where a model's rollout service stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutState {
    /// Serving; no sync is pending.
    Running,
    /// A sync is required before the next rollouts (a batch is ready in `sync` mode, or an
    /// eval step's load waits for the barrier's leader).
    NeedSync,
    /// A load is in flight.
    Syncing,
}

impl RolloutState {
    /// `running`, `need_sync` or `syncing`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::NeedSync => "need_sync",
            Self::Syncing => "syncing",
        }
    }
}

/// Why a rollout must wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockReason {
    /// `sync` mode: the trainer's next version has not landed yet.
    AwaitingSync,
    /// `batch-async`: the engine is `threshold` or more versions behind the trainer.
    Staleness {
        /// The trainer's version.
        train: Version,
        /// The version rollouts use.
        rollout: Version,
    },
    /// Data acquisition is paused for an eval step or a validation.
    Validation,
    /// The rollout's engine is fenced: it could not stage or commit the version the fleet
    /// serves (decided by the controller, not by this policy).
    Fenced,
}

/// The answer to a rollout status check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// Go on; `staleness` is `train_version - rollout_version` now.
    Continue {
        /// How many versions the served weights are behind the trainer.
        staleness: u64,
    },
    /// Wait and ask again when woken.
    Block(BlockReason),
}

/// A load to carry out: bring `model` to at least `version` on every engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncOrder {
    /// The model.
    pub model: ModelId,
    /// The version to load.
    pub version: Version,
}

/// One model's sync state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSync {
    /// The newest version the trainer finished.
    pub train_version: Version,
    /// The version every engine serves (the last load that completed).
    pub rollout_version: Version,
    /// The state.
    pub state: RolloutState,
    in_flight: Option<Version>,
    queued: Option<Version>,
    deferred: Option<Version>,
}

impl ModelSync {
    fn new() -> Self {
        Self {
            train_version: Version::ZERO,
            rollout_version: Version::ZERO,
            state: RolloutState::Running,
            in_flight: None,
            queued: None,
            deferred: None,
        }
    }

    fn staleness(&self) -> u64 {
        self.train_version.0.saturating_sub(self.rollout_version.0)
    }

    fn settle(&mut self) {
        let behind_after_batch =
            self.state == RolloutState::NeedSync && self.rollout_version < self.train_version;
        self.state = if self.in_flight.is_some() {
            RolloutState::Syncing
        } else if self.deferred.is_some() || behind_after_batch {
            RolloutState::NeedSync
        } else {
            RolloutState::Running
        };
    }
}

/// The controller's decisions for every model, as plain code.
#[derive(Clone, Debug)]
pub struct SyncPolicy {
    models: BTreeMap<ModelId, ModelSync>,
    acquisition_paused: bool,
    cfg: SyncConfig,
}

impl SyncPolicy {
    /// A policy for `models` (at least one) under `cfg`.
    ///
    /// # Errors
    /// [`Error::Config`] when `models` is empty or `cfg` does not pass its checks.
    pub fn new(cfg: &SyncConfig, models: impl IntoIterator<Item = ModelId>) -> Result<Self> {
        cfg.check()?;
        let models: BTreeMap<_, _> = models.into_iter().map(|m| (m, ModelSync::new())).collect();
        if models.is_empty() {
            return Err(Error::Config(
                "a sync policy needs at least one model".into(),
            ));
        }
        Ok(Self {
            models,
            acquisition_paused: false,
            cfg: cfg.clone(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SyncConfig {
        &self.cfg
    }

    /// The models, sorted (the leader's load order).
    pub fn models(&self) -> impl Iterator<Item = &ModelId> {
        self.models.keys()
    }

    /// One model's state.
    ///
    /// # Errors
    /// [`Error::UnknownModel`].
    pub fn model(&self, model: &ModelId) -> Result<&ModelSync> {
        self.models
            .get(model)
            .ok_or_else(|| Error::UnknownModel(model.clone()))
    }

    fn model_mut(&mut self, model: &ModelId) -> Result<&mut ModelSync> {
        self.models
            .get_mut(model)
            .ok_or_else(|| Error::UnknownModel(model.clone()))
    }

    /// The status check made before each rollout request: `continue` or `block`.
    ///
    /// # Errors
    /// [`Error::UnknownModel`].
    pub fn check_rollout(&self, model: &ModelId) -> Result<Decision> {
        let m = self.model(model)?;
        if self.acquisition_paused {
            return Ok(Decision::Block(BlockReason::Validation));
        }
        let staleness = m.staleness();
        let block = match self.cfg.sync_mode {
            SyncMode::FullyAsync => None,
            SyncMode::Sync => (m.state != RolloutState::Running || staleness > 0)
                .then_some(BlockReason::AwaitingSync),
            SyncMode::BatchAsync => {
                (staleness >= self.cfg.staleness_threshold).then_some(BlockReason::Staleness {
                    train: m.train_version,
                    rollout: m.rollout_version,
                })
            }
        };
        Ok(block.map_or(Decision::Continue { staleness }, Decision::Block))
    }

    /// The trajectory pool has a batch ready for `model`'s trainer. In `sync` mode rollouts
    /// lock until the version trained on it lands; other modes go on.
    ///
    /// # Errors
    /// [`Error::UnknownModel`].
    pub fn batch_ready(&mut self, model: &ModelId) -> Result<()> {
        let mode = self.cfg.sync_mode;
        let m = self.model_mut(model)?;
        if mode == SyncMode::Sync && m.state == RolloutState::Running {
            m.state = RolloutState::NeedSync;
        }
        Ok(())
    }

    /// `model`'s trainer finished `version`. On a non-eval step the answer is the load to
    /// start now, or `None` when a load is already in flight (the newest queued version
    /// follows it; versions in between are skipped). On an eval step the load is deferred to
    /// the barrier's leader ([`SyncPolicy::take_deferred`]).
    ///
    /// # Errors
    /// [`Error::StaleVersion`] when `version` is not newer than the last one finished.
    pub fn trainer_finished(
        &mut self,
        model: &ModelId,
        version: Version,
    ) -> Result<Option<SyncOrder>> {
        let eval = self.cfg.is_eval_step(version);
        let m = self.model_mut(model)?;
        if version <= m.train_version {
            return Err(Error::StaleVersion {
                model: model.clone(),
                offered: version,
                current: m.train_version,
            });
        }
        m.train_version = version;
        let order = if eval {
            m.deferred = Some(version);
            m.queued = None;
            None
        } else if m.in_flight.is_some() {
            m.queued = Some(version);
            None
        } else {
            m.in_flight = Some(version);
            Some(SyncOrder {
                model: model.clone(),
                version,
            })
        };
        m.settle();
        Ok(order)
    }

    /// The leader takes `model`'s deferred eval-step load (and marks it in flight).
    ///
    /// # Errors
    /// [`Error::UnknownModel`].
    pub fn take_deferred(&mut self, model: &ModelId) -> Result<Option<SyncOrder>> {
        let m = self.model_mut(model)?;
        let Some(version) = m.deferred.take() else {
            return Ok(None);
        };
        m.in_flight = Some(version);
        m.settle();
        Ok(Some(SyncOrder {
            model: model.clone(),
            version,
        }))
    }

    /// A load of `ordered` finished: every engine serves `model` at `served` (at least the
    /// ordered version). Answers the next load when a newer version was queued meanwhile.
    ///
    /// # Errors
    /// [`Error::UnknownModel`].
    pub fn sync_done(
        &mut self,
        model: &ModelId,
        ordered: Version,
        served: Version,
    ) -> Result<Option<SyncOrder>> {
        let m = self.model_mut(model)?;
        m.rollout_version = m.rollout_version.max(served);
        if m.in_flight
            .is_some_and(|v| v <= m.rollout_version || v == ordered)
        {
            m.in_flight = None;
        }
        Ok(Self::follow_up(model, m))
    }

    /// A load of `ordered` failed: the previous version stays served. Answers a queued newer
    /// load, if any.
    ///
    /// # Errors
    /// [`Error::UnknownModel`].
    pub fn sync_failed(&mut self, model: &ModelId, ordered: Version) -> Result<Option<SyncOrder>> {
        let m = self.model_mut(model)?;
        if m.in_flight == Some(ordered) {
            m.in_flight = None;
        }
        Ok(Self::follow_up(model, m))
    }

    fn follow_up(model: &ModelId, m: &mut ModelSync) -> Option<SyncOrder> {
        let next = if m.in_flight.is_none() && m.deferred.is_none() {
            match m.queued.take() {
                Some(v) if v > m.rollout_version => {
                    m.in_flight = Some(v);
                    Some(SyncOrder {
                        model: model.clone(),
                        version: v,
                    })
                }
                _ => None,
            }
        } else {
            None
        };
        m.settle();
        next
    }

    /// Pauses data acquisition for every model (eval steps, validation).
    pub fn pause_acquisition(&mut self) {
        self.acquisition_paused = true;
    }

    /// Ends validation: data acquisition resumes.
    pub fn end_validate(&mut self) {
        self.acquisition_paused = false;
    }

    /// True while data acquisition is paused.
    pub fn acquisition_paused(&self) -> bool {
        self.acquisition_paused
    }

    /// `train_version - rollout_version` for `model`.
    ///
    /// # Errors
    /// [`Error::UnknownModel`].
    pub fn staleness(&self, model: &ModelId) -> Result<u64> {
        Ok(self.model(model)?.staleness())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> ModelId {
        ModelId::new(s).unwrap()
    }

    fn policy(mode: SyncMode, threshold: u64, validate_freq: u64) -> SyncPolicy {
        let cfg = SyncConfig {
            sync_mode: mode,
            staleness_threshold: threshold,
            validate_freq,
            ..SyncConfig::default()
        };
        SyncPolicy::new(&cfg, [id("policy")]).unwrap()
    }

    fn go(p: &SyncPolicy) -> bool {
        matches!(
            p.check_rollout(&id("policy")).unwrap(),
            Decision::Continue { .. }
        )
    }

    #[test]
    fn sync_mode_locks_from_batch_ready_until_the_version_lands() {
        let m = id("policy");
        let mut p = policy(SyncMode::Sync, 2, 0);
        assert!(go(&p));
        p.batch_ready(&m).unwrap();
        assert_eq!(p.model(&m).unwrap().state, RolloutState::NeedSync);
        assert_eq!(
            p.check_rollout(&m).unwrap(),
            Decision::Block(BlockReason::AwaitingSync)
        );
        let order = p.trainer_finished(&m, Version(1)).unwrap().unwrap();
        assert_eq!(order.version, Version(1));
        assert_eq!(p.model(&m).unwrap().state, RolloutState::Syncing);
        assert!(!go(&p));
        assert_eq!(p.sync_done(&m, Version(1), Version(1)).unwrap(), None);
        assert_eq!(p.model(&m).unwrap().state, RolloutState::Running);
        assert_eq!(
            p.check_rollout(&m).unwrap(),
            Decision::Continue { staleness: 0 }
        );
    }

    #[test]
    fn batch_async_blocks_at_the_threshold_only() {
        let m = id("policy");
        let mut p = policy(SyncMode::BatchAsync, 2, 0);
        p.batch_ready(&m).unwrap();
        assert!(go(&p), "batch-async does not lock on batch ready");
        let first = p.trainer_finished(&m, Version(1)).unwrap();
        assert!(first.is_some());
        assert_eq!(
            p.check_rollout(&m).unwrap(),
            Decision::Continue { staleness: 1 }
        );
        // a load is in flight: v2 queues, and staleness reaches the threshold
        assert_eq!(p.trainer_finished(&m, Version(2)).unwrap(), None);
        assert_eq!(
            p.check_rollout(&m).unwrap(),
            Decision::Block(BlockReason::Staleness {
                train: Version(2),
                rollout: Version::ZERO
            })
        );
        // v1 lands: the queued v2 is the next load, staleness 1 lets rollouts go
        let next = p.sync_done(&m, Version(1), Version(1)).unwrap().unwrap();
        assert_eq!(next.version, Version(2));
        assert!(go(&p));
        assert_eq!(p.sync_done(&m, Version(2), Version(2)).unwrap(), None);
        assert_eq!(p.staleness(&m).unwrap(), 0);
    }

    #[test]
    fn fully_async_never_blocks_and_skips_to_the_newest() {
        let m = id("policy");
        let mut p = policy(SyncMode::FullyAsync, 1, 0);
        p.batch_ready(&m).unwrap();
        assert!(p.trainer_finished(&m, Version(1)).unwrap().is_some());
        for v in 2..=9 {
            assert_eq!(p.trainer_finished(&m, Version(v)).unwrap(), None);
            assert!(go(&p));
        }
        // only the newest queued version is loaded next; 2..8 are skipped
        assert_eq!(
            p.sync_done(&m, Version(1), Version(1))
                .unwrap()
                .unwrap()
                .version,
            Version(9)
        );
        assert!(go(&p));
    }

    #[test]
    fn eval_steps_defer_the_load_to_the_leader_and_pause_acquisition() {
        let m = id("policy");
        let mut p = policy(SyncMode::FullyAsync, 1, 2);
        assert!(p.trainer_finished(&m, Version(1)).unwrap().is_some());
        p.sync_done(&m, Version(1), Version(1)).unwrap();
        assert_eq!(
            p.trainer_finished(&m, Version(2)).unwrap(),
            None,
            "eval step is deferred"
        );
        assert_eq!(p.model(&m).unwrap().state, RolloutState::NeedSync);
        p.pause_acquisition();
        assert_eq!(
            p.check_rollout(&m).unwrap(),
            Decision::Block(BlockReason::Validation)
        );
        let order = p.take_deferred(&m).unwrap().unwrap();
        assert_eq!(order.version, Version(2));
        assert_eq!(p.take_deferred(&m).unwrap(), None);
        p.sync_done(&m, Version(2), Version(2)).unwrap();
        assert!(!go(&p), "paused until validation ends");
        p.end_validate();
        assert!(go(&p));
    }

    #[test]
    fn stale_versions_unknown_models_and_failures() {
        let m = id("policy");
        let mut p = policy(SyncMode::Sync, 1, 0);
        p.trainer_finished(&m, Version(3)).unwrap();
        let e = p.trainer_finished(&m, Version(3)).unwrap_err().to_string();
        assert!(e.contains("version 3 refused"), "{e}");
        assert!(matches!(
            p.check_rollout(&id("critic")),
            Err(Error::UnknownModel(_))
        ));
        // a failed load keeps the served version; sync mode stays blocked (still behind)
        p.sync_failed(&m, Version(3)).unwrap();
        assert_eq!(p.model(&m).unwrap().rollout_version, Version::ZERO);
        assert!(!go(&p));
        assert!(SyncPolicy::new(&SyncConfig::default(), []).is_err());
    }
}
