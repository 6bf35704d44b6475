//! The sync protocol as plain deterministic code: version rules, validation of an incoming
//! update against the agreed manifests, and the sender's acknowledgement book.
//!
//! Nothing here touches a socket, a clock, a thread or an actor; transports and schemes call
//! into it, and its tests drive it directly.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::{ModelId, Version};
use crate::manifest::Manifest;
use crate::wait::Wait;
use crate::weights::WeightSet;

/// One atomic update: at most one weight set per model, all landing or none.
pub type Group = Vec<Arc<WeightSet>>;

/// `(model id, version)` pairs of one update, as acknowledged by a receiver.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    /// Which receiver acknowledges.
    pub receiver: u32,
    /// What it applied.
    pub applied: Vec<(ModelId, Version)>,
}

/// The entries of a group, in order.
pub fn entries(group: &[Arc<WeightSet>]) -> Vec<(ModelId, Version)> {
    group
        .iter()
        .map(|w| (w.model().clone(), w.version()))
        .collect()
}

/// The agreed manifests of every model of a scheme.
#[derive(Clone, Debug, Default)]
pub struct Manifests(BTreeMap<ModelId, Arc<Manifest>>);

impl Manifests {
    /// From `(model, manifest)` pairs.
    ///
    /// # Errors
    /// [`Error::DuplicateModel`] if a model appears twice.
    pub fn new(items: impl IntoIterator<Item = (ModelId, Arc<Manifest>)>) -> Result<Self> {
        let mut map = BTreeMap::new();
        for (id, m) in items {
            if map.insert(id.clone(), m).is_some() {
                return Err(Error::DuplicateModel(id));
            }
        }
        Ok(Self(map))
    }

    /// The manifest of one model.
    ///
    /// # Errors
    /// [`Error::UnknownModel`].
    pub fn get(&self, model: &ModelId) -> Result<&Arc<Manifest>> {
        self.0
            .get(model)
            .ok_or_else(|| Error::UnknownModel(model.clone()))
    }

    /// Every `(model, manifest)`.
    pub fn iter(&self) -> impl Iterator<Item = (&ModelId, &Arc<Manifest>)> {
        self.0.iter()
    }

    /// The model ids.
    pub fn ids(&self) -> impl Iterator<Item = &ModelId> {
        self.0.keys()
    }

    /// Number of models.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there is no model.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Checks that `other` (what the peer announced) agrees model by model.
    ///
    /// # Errors
    /// [`Error::UnknownModel`] for a model only one side has; a tensor error otherwise.
    pub fn check_agree(&self, other: &Manifests) -> Result<()> {
        for (id, m) in self.iter() {
            m.check_same_schema(id, other.get(id)?)?;
        }
        if let Some(extra) = other.ids().find(|id| !self.0.contains_key(*id)) {
            return Err(Error::UnknownModel(extra.clone()));
        }
        Ok(())
    }
}

/// Checks a whole group before anything of it is applied: known models, each at most once,
/// manifests equal to the agreed ones.
///
/// # Errors
/// The first problem found, naming the model and tensor.
pub fn validate_group(manifests: &Manifests, group: &[Arc<WeightSet>]) -> Result<()> {
    if group.is_empty() {
        return Err(Error::State("an update must carry at least one model"));
    }
    let mut seen = BTreeSet::new();
    for w in group {
        if !seen.insert(w.model()) {
            return Err(Error::DuplicateModel(w.model().clone()));
        }
        manifests
            .get(w.model())?
            .check_same_schema(w.model(), w.manifest())?;
    }
    Ok(())
}

/// Per-model "versions only grow" rule, as held by one end.
#[derive(Clone, Debug, Default)]
pub struct VersionGate {
    applied: BTreeMap<ModelId, Version>,
}

impl VersionGate {
    /// The version in force for a model ([`Version::ZERO`] if none yet).
    pub fn current(&self, model: &ModelId) -> Version {
        self.applied.get(model).copied().unwrap_or(Version::ZERO)
    }

    /// Checks that every entry is newer than what is in force.
    ///
    /// # Errors
    /// [`Error::StaleVersion`] for a stale or repeated version; [`Error::DuplicateModel`].
    pub fn check(&self, entries: &[(ModelId, Version)]) -> Result<()> {
        let mut seen = BTreeSet::new();
        for (model, version) in entries {
            if !seen.insert(model) {
                return Err(Error::DuplicateModel(model.clone()));
            }
            let current = self.current(model);
            if *version <= current {
                return Err(Error::StaleVersion {
                    model: model.clone(),
                    offered: *version,
                    current,
                });
            }
        }
        Ok(())
    }

    /// Records entries that were checked and applied.
    pub fn commit(&mut self, entries: &[(ModelId, Version)]) {
        for (model, version) in entries {
            self.applied.insert(model.clone(), *version);
        }
    }

    /// Check then commit.
    ///
    /// # Errors
    /// As [`VersionGate::check`]; nothing is recorded on error.
    pub fn admit(&mut self, entries: &[(ModelId, Version)]) -> Result<()> {
        self.check(entries)?;
        self.commit(entries);
        Ok(())
    }
}

/// Version admission, the one step every end runs on an update: the group is validated whole
/// against the agreed manifests, its versions are gated (only grow), the caller's `apply` runs,
/// and only if it succeeds are the versions committed. A refused or failed update changes
/// nothing, so the previous versions stay in force.
#[derive(Clone, Debug)]
pub struct Admission {
    manifests: Manifests,
    gate: VersionGate,
}

impl Admission {
    /// Admission against `manifests`, nothing applied yet.
    pub fn new(manifests: Manifests) -> Self {
        Self {
            manifests,
            gate: VersionGate::default(),
        }
    }

    /// The agreed manifests.
    pub fn manifests(&self) -> &Manifests {
        &self.manifests
    }

    /// The version in force for a model ([`Version::ZERO`] if none yet).
    pub fn current(&self, model: &ModelId) -> Version {
        self.gate.current(model)
    }

    /// Admits versions whose bytes went straight into the caller's model (a streaming
    /// receive, which checked every tensor against the manifest as it arrived): each model
    /// must be agreed and its version must grow.
    ///
    /// # Errors
    /// [`Error::UnknownModel`], or as [`VersionGate::check`]; nothing is recorded on error.
    pub fn admit_versions(&mut self, entries: &[(ModelId, Version)]) -> Result<()> {
        for (m, _) in entries {
            self.manifests.get(m)?;
        }
        self.gate.admit(entries)
    }

    /// Validates `group` ([`validate_group`]), checks its versions, runs `apply`, and commits
    /// the versions once `apply` succeeded. Returns the group's entries and `apply`'s value.
    ///
    /// # Errors
    /// The validation or version error naming the model (and tensor); `apply`'s error. In
    /// every error case nothing is committed.
    pub fn admit<R>(
        &mut self,
        group: &[Arc<WeightSet>],
        apply: impl FnOnce(&[(ModelId, Version)]) -> Result<R>,
    ) -> Result<(Vec<(ModelId, Version)>, R)> {
        validate_group(&self.manifests, group)?;
        let entries = entries(group);
        self.gate.check(&entries)?;
        let r = apply(&entries)?;
        self.gate.commit(&entries);
        Ok((entries, r))
    }
}

/// The sender's book of what each receiver has acknowledged.
#[derive(Clone, Debug, Default)]
pub struct AckBook {
    acked: BTreeMap<u32, BTreeMap<ModelId, Version>>,
}

impl AckBook {
    /// Registers a receiver (it owes acks from now on).
    pub fn register(&mut self, receiver: u32) {
        self.acked.entry(receiver).or_default();
    }

    /// Forgets a receiver (it left or died; nobody waits for it).
    pub fn remove(&mut self, receiver: u32) {
        self.acked.remove(&receiver);
    }

    /// The registered receivers.
    pub fn receivers(&self) -> impl Iterator<Item = u32> + '_ {
        self.acked.keys().copied()
    }

    /// Records an ack; versions only grow, an older ack changes nothing.
    pub fn record(&mut self, ack: &Ack) {
        let book = self.acked.entry(ack.receiver).or_default();
        for (model, version) in &ack.applied {
            let v = book.entry(model.clone()).or_insert(Version::ZERO);
            *v = (*v).max(*version);
        }
    }

    /// For [`wait_until`](crate::wait::wait_until): done once every receiver acknowledged
    /// every entry, else pending on the receivers still missing.
    pub fn awaiting(&self, entries: &[(ModelId, Version)]) -> Wait<(), Vec<u32>> {
        let missing = self.missing(entries);
        if missing.is_empty() {
            Wait::Done(())
        } else {
            Wait::Pending(missing)
        }
    }

    /// Receivers that have not yet acknowledged every entry.
    pub fn missing(&self, entries: &[(ModelId, Version)]) -> Vec<u32> {
        self.acked
            .iter()
            .filter(|(_, book)| {
                entries
                    .iter()
                    .any(|(m, v)| book.get(m).copied().unwrap_or(Version::ZERO) < *v)
            })
            .map(|(r, _)| *r)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn id(s: &str) -> ModelId {
        ModelId::new(s).unwrap()
    }

    fn ws(model: &str, m: &Arc<Manifest>, v: u64) -> Arc<WeightSet> {
        let mut w = WeightSet::zeroed(id(model), Arc::clone(m));
        w.set_version(Version(v));
        Arc::new(w)
    }

    #[test]
    fn versions_only_grow() {
        let mut g = VersionGate::default();
        let p = id("policy");
        g.admit(&[(p.clone(), Version(1))]).unwrap();
        g.admit(&[(p.clone(), Version(5))]).unwrap();
        let dup = g.admit(&[(p.clone(), Version(5))]).unwrap_err();
        assert!(matches!(
            dup,
            Error::StaleVersion {
                offered: Version(5),
                current: Version(5),
                ..
            }
        ));
        assert!(g.admit(&[(p.clone(), Version(2))]).is_err());
        assert!(g.admit(&[(p.clone(), Version(0))]).is_err());
        assert_eq!(g.current(&p), Version(5));
        // a group with one stale entry records nothing
        let c = id("critic");
        assert!(
            g.admit(&[(c.clone(), Version(1)), (p.clone(), Version(4))])
                .is_err()
        );
        assert_eq!(g.current(&c), Version::ZERO);
        assert!(
            g.admit(&[(c.clone(), Version(1)), (c.clone(), Version(2))])
                .is_err()
        );
    }

    /// One tensor `x`.
    fn one_tensor(dtype: DType, len: usize) -> Arc<Manifest> {
        Arc::new(
            Manifest::builder()
                .tensor("x", dtype, &[len])
                .build()
                .unwrap(),
        )
    }

    #[test]
    fn groups_are_validated_whole() {
        let a = one_tensor(DType::F32, 4);
        let b = one_tensor(DType::F32, 5);
        let ms = Manifests::new([(id("actor"), a.clone()), (id("critic"), a.clone())]).unwrap();
        validate_group(&ms, &[ws("actor", &a, 1), ws("critic", &a, 1)]).unwrap();
        let e = validate_group(&ms, &[ws("actor", &a, 1), ws("critic", &b, 1)]).unwrap_err();
        assert!(
            e.to_string()
                .contains("model `critic`, tensor `x`: shape [4] expected"),
            "{e}"
        );
        assert!(matches!(
            validate_group(&ms, &[ws("nobody", &a, 1)]),
            Err(Error::UnknownModel(_))
        ));
        assert!(matches!(
            validate_group(&ms, &[ws("actor", &a, 1), ws("actor", &a, 2)]),
            Err(Error::DuplicateModel(_))
        ));
        assert!(validate_group(&ms, &[]).is_err());
        let other = Manifests::new([(id("actor"), a.clone())]).unwrap();
        assert!(ms.check_agree(&other).is_err());
        assert!(other.check_agree(&ms).is_err());
        assert!(ms.check_agree(&ms.clone()).is_ok());
    }

    #[test]
    fn admission_commits_only_what_was_applied() {
        let a = one_tensor(DType::F32, 4);
        let b = one_tensor(DType::F16, 4);
        let p = id("policy");
        let mut adm = Admission::new(Manifests::new([(p.clone(), a.clone())]).unwrap());
        let (e, n) = adm.admit(&[ws("policy", &a, 2)], |e| Ok(e.len())).unwrap();
        assert_eq!((e, n), (vec![(p.clone(), Version(2))], 1));
        assert_eq!(adm.current(&p), Version(2));
        // a failed apply commits nothing
        let err = adm
            .admit(&[ws("policy", &a, 3)], |_| {
                Err::<(), _>(Error::State("no room"))
            })
            .unwrap_err();
        assert!(matches!(err, Error::State("no room")));
        assert_eq!(adm.current(&p), Version(2));
        // refused before apply: wrong dtype names the tensor, stale version
        let mut ran = false;
        let err = adm
            .admit(&[ws("policy", &b, 4)], |_| {
                ran = true;
                Ok(())
            })
            .unwrap_err();
        assert!(err.to_string().contains("tensor `x`"), "{err}");
        assert!(matches!(
            adm.admit(&[ws("policy", &a, 2)], |_| {
                ran = true;
                Ok(())
            }),
            Err(Error::StaleVersion { .. })
        ));
        assert!(!ran);
        assert_eq!(adm.current(&p), Version(2));
        adm.admit(&[ws("policy", &a, 3)], |_| Ok(())).unwrap();
        assert_eq!(adm.current(&p), Version(3));
    }

    #[test]
    fn ack_book_tracks_each_receiver() {
        let mut book = AckBook::default();
        book.register(0);
        book.register(1);
        let e = vec![(id("p"), Version(3))];
        assert_eq!(book.missing(&e), vec![0, 1]);
        book.record(&Ack {
            receiver: 0,
            applied: e.clone(),
        });
        assert_eq!(book.missing(&e), vec![1]);
        assert_eq!(book.awaiting(&e), Wait::Pending(vec![1]));
        book.record(&Ack {
            receiver: 1,
            applied: vec![(id("p"), Version(4))],
        });
        book.record(&Ack {
            receiver: 1,
            applied: vec![(id("p"), Version(2))],
        });
        assert!(book.missing(&e).is_empty());
        assert_eq!(book.awaiting(&e), Wait::Done(()));
        book.remove(1);
        assert_eq!(book.receivers().collect::<Vec<_>>(), vec![0]);
    }
}
