//! The multi-model version barrier and the leader's eval-step sequence.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::{ModelId, Version};

/// A completed barrier round: every model arrived at `version`; the last to arrive leads.
#[derive(Debug)]
pub struct Round<W> {
    /// The version all models reached.
    pub version: Version,
    /// The model whose arrival completed the round.
    pub leader: ModelId,
    /// Every arrival's waiter (the leader's included), in model order.
    pub waiters: Vec<(ModelId, W)>,
}

/// Records each trainer's version; a round completes when every registered model has
/// arrived at the same version. `W` is whatever the caller wakes arrivals with.
#[derive(Debug)]
pub struct VersionBarrier<W> {
    models: BTreeSet<ModelId>,
    pending: BTreeMap<ModelId, (Version, W)>,
    released: BTreeMap<ModelId, Version>,
}

impl<W> VersionBarrier<W> {
    /// A barrier over `models`.
    ///
    /// # Errors
    /// [`Error::Config`] when `models` is empty.
    pub fn new(models: impl IntoIterator<Item = ModelId>) -> Result<Self> {
        let models: BTreeSet<_> = models.into_iter().collect();
        if models.is_empty() {
            return Err(Error::Config(
                "a version barrier needs at least one model".into(),
            ));
        }
        Ok(Self {
            models,
            pending: BTreeMap::new(),
            released: BTreeMap::new(),
        })
    }

    /// `model`'s trainer arrives at `version`. Answers the round when this arrival completes
    /// it (this caller is then the leader), `None` when others are still awaited.
    ///
    /// # Errors
    /// [`Error::UnknownModel`]; [`Error::StaleVersion`] for a version not newer than the
    /// model's last released round; [`Error::Sync`] when a model arrives twice in one round
    /// (its notifications were not serialised) or when all arrived at different versions
    /// (naming each model's version; every waiter of the round is handed back in the error
    /// path through [`VersionBarrier::abort`]).
    pub fn arrive(
        &mut self,
        model: &ModelId,
        version: Version,
        waiter: W,
    ) -> Result<Option<Round<W>>> {
        if !self.models.contains(model) {
            return Err(Error::UnknownModel(model.clone()));
        }
        if let Some(&last) = self.released.get(model)
            && version <= last
        {
            return Err(Error::StaleVersion {
                model: model.clone(),
                offered: version,
                current: last,
            });
        }
        if let Some((v, _)) = self.pending.get(model) {
            return Err(Error::Sync(format!(
                "model `{model}` arrived at the barrier with v{version} while its v{v} is still waiting (notifications of one trainer must be serialised)"
            )));
        }
        self.pending.insert(model.clone(), (version, waiter));
        if self.pending.len() < self.models.len() {
            return Ok(None);
        }
        let versions: BTreeSet<Version> = self.pending.values().map(|(v, _)| *v).collect();
        if versions.len() > 1 {
            let seen = self
                .pending
                .iter()
                .map(|(m, (v, _))| format!("{m} at v{v}"))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(Error::Sync(format!(
                "version barrier cannot release: models arrived at different versions ({seen})"
            )));
        }
        let waiters: Vec<_> = std::mem::take(&mut self.pending)
            .into_iter()
            .map(|(m, (_, w))| (m, w))
            .collect();
        for (m, _) in &waiters {
            self.released.insert(m.clone(), version);
        }
        Ok(Some(Round {
            version,
            leader: model.clone(),
            waiters,
        }))
    }

    /// Takes every waiting arrival out (to fail them after an error or a deadline).
    pub fn abort(&mut self) -> Vec<(ModelId, Version, W)> {
        std::mem::take(&mut self.pending)
            .into_iter()
            .map(|(m, (v, w))| (m, v, w))
            .collect()
    }

    /// Removes one model's waiting arrival at `version` (its deadline passed); `None` when
    /// that arrival was already released.
    pub fn withdraw(&mut self, model: &ModelId, version: Version) -> Option<(Version, W)> {
        if self.pending.get(model).is_some_and(|(v, _)| *v == version) {
            return self.pending.remove(model);
        }
        None
    }

    /// The models still awaited in the current round, with the versions already recorded.
    pub fn waiting_for(&self) -> (Vec<ModelId>, BTreeMap<ModelId, Version>) {
        let missing = self
            .models
            .iter()
            .filter(|m| !self.pending.contains_key(*m))
            .cloned()
            .collect();
        let recorded = self
            .pending
            .iter()
            .map(|(m, (v, _))| (m.clone(), *v))
            .collect();
        (missing, recorded)
    }
}

/// One step of the leader's sequence on an eval step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaderStep {
    /// Stop handing out rollouts.
    PauseAcquisition,
    /// Cancel in-flight episodes so pause/load is not contended.
    CancelInFlight,
    /// Load one model on every engine (in sorted model order, one after the other).
    Load(ModelId),
    /// Run validation with every model at the round's version.
    Eval,
    /// Hand out rollouts again.
    ResumeAcquisition,
    /// Release every trainer waiting at the barrier.
    WakeAll,
}

impl std::fmt::Display for LeaderStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PauseAcquisition => f.write_str("pause data acquisition"),
            Self::CancelInFlight => f.write_str("cancel in-flight episodes"),
            Self::Load(m) => write!(f, "load {m}"),
            Self::Eval => f.write_str("run validation"),
            Self::ResumeAcquisition => f.write_str("resume data acquisition"),
            Self::WakeAll => f.write_str("wake every trainer"),
        }
    }
}

/// The leader's sequence on an eval step (AstraFlow's order); on other steps only
/// [`LeaderStep::WakeAll`] (loads were started when each trainer notified).
pub fn leader_sequence<'a>(
    models: impl IntoIterator<Item = &'a ModelId>,
    eval: bool,
) -> Vec<LeaderStep> {
    if !eval {
        return vec![LeaderStep::WakeAll];
    }
    let mut sorted: Vec<&ModelId> = models.into_iter().collect();
    sorted.sort();
    sorted.dedup();
    let mut steps = vec![LeaderStep::PauseAcquisition, LeaderStep::CancelInFlight];
    steps.extend(sorted.into_iter().map(|m| LeaderStep::Load(m.clone())));
    steps.extend([
        LeaderStep::Eval,
        LeaderStep::ResumeAcquisition,
        LeaderStep::WakeAll,
    ]);
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> ModelId {
        ModelId::new(s).unwrap()
    }

    #[test]
    fn the_last_arrival_leads_and_every_waiter_is_released() {
        let mut b = VersionBarrier::new([id("solver"), id("verifier")]).unwrap();
        assert!(
            b.arrive(&id("verifier"), Version(1), "v")
                .unwrap()
                .is_none()
        );
        assert_eq!(b.waiting_for().0, vec![id("solver")]);
        let round = b.arrive(&id("solver"), Version(1), "s").unwrap().unwrap();
        assert_eq!(round.version, Version(1));
        assert_eq!(round.leader, id("solver"));
        assert_eq!(
            round.waiters,
            vec![(id("solver"), "s"), (id("verifier"), "v")]
        );
        // next round; a repeated version is stale
        let e = b.arrive(&id("solver"), Version(1), "s").unwrap_err();
        assert!(matches!(e, Error::StaleVersion { .. }), "{e}");
        assert!(b.arrive(&id("solver"), Version(2), "s").unwrap().is_none());
        let e = b
            .arrive(&id("solver"), Version(3), "s")
            .unwrap_err()
            .to_string();
        assert!(e.contains("serialised"), "{e}");
        assert!(
            b.arrive(&id("verifier"), Version(2), "v")
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn mismatched_versions_are_named_and_waiters_can_be_aborted() {
        let mut b = VersionBarrier::new([id("a"), id("b")]).unwrap();
        b.arrive(&id("a"), Version(3), 1).unwrap();
        let e = b.arrive(&id("b"), Version(4), 2).unwrap_err().to_string();
        assert!(e.contains("a at v3") && e.contains("b at v4"), "{e}");
        let aborted = b.abort();
        assert_eq!(aborted.len(), 2);
        assert!(matches!(
            b.arrive(&id("c"), Version(1), 3),
            Err(Error::UnknownModel(_))
        ));
        assert!(VersionBarrier::<()>::new([]).is_err());
    }

    #[test]
    fn the_leader_loads_every_model_in_sorted_order_before_eval() {
        let models = [id("verifier"), id("solver")];
        assert_eq!(leader_sequence(&models, false), vec![LeaderStep::WakeAll]);
        assert_eq!(
            leader_sequence(&models, true),
            vec![
                LeaderStep::PauseAcquisition,
                LeaderStep::CancelInFlight,
                LeaderStep::Load(id("solver")),
                LeaderStep::Load(id("verifier")),
                LeaderStep::Eval,
                LeaderStep::ResumeAcquisition,
                LeaderStep::WakeAll,
            ]
        );
    }
}
