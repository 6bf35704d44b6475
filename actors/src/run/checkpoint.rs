//! Checkpoints of a run's trainers, on disk: `DIR/MODEL/vVERSION.safetensors`, one file per
//! model and version, each the learner's whole state ([`Learner::save`]) written atomically
//! (a temporary file, fsync, rename) with a checksum per tensor. A run resumes from the
//! newest version every model has a checkpoint of; a damaged file (truncated, a checksum
//! that does not match) or one of another model is refused naming it, never skipped.
//!
//! Beside each, `vVERSION.state.toml` carries what the controller had counted of the model
//! by then ([`RunState`]), so that a resumed run's counts go on from them.
//!
//! [`Learner::save`]: crate::learner::Learner::save

use std::path::{Path, PathBuf};

use refit_runtime::topology::{CheckpointSection, Topology};
use refit_runtime::{ModelId, Version, WeightSet};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::learner::Learner;
use crate::protocol::controller::ModelStatus;
use crate::roles::ModelSpec;
use crate::run::ids::RANK_LOG;

/// The file of `model`'s checkpoint at `version` under `dir`.
pub(crate) fn path_of(dir: &Path, model: &ModelId, version: Version) -> PathBuf {
    dir.join(model.as_str())
        .join(format!("v{}.safetensors", version.0))
}

/// The run's state beside `model`'s checkpoint at `version` under `dir`.
pub(crate) fn state_path_of(dir: &Path, model: &ModelId, version: Version) -> PathBuf {
    dir.join(model.as_str())
        .join(format!("v{}.state.toml", version.0))
}

/// What a checkpoint carries of the run besides the learner: the controller's counts of the
/// model ([`ModelStatus`]: admissions, loads, fences...) and the eval steps run, a small
/// versioned TOML file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RunState {
    /// The file's format ([`RunState::FORMAT`]).
    pub(crate) format: u32,
    /// The model.
    pub(crate) model: String,
    /// The version of the checkpoint it sits beside.
    pub(crate) version: u64,
    /// The controller's eval steps by then.
    pub(crate) evals: u64,
    /// What the controller said of the model.
    pub(crate) status: ModelStatus,
}

impl RunState {
    /// The format this build writes and reads.
    pub(crate) const FORMAT: u32 = 1;
}

/// Writes `state` beside its checkpoint (atomically: a temporary file, then a rename).
///
/// # Errors
/// A file that cannot be written.
pub(crate) fn write_state(dir: &Path, model: &ModelId, state: &RunState) -> Result<PathBuf> {
    let path = state_path_of(dir, model, Version(state.version));
    let text = toml::to_string(state)
        .map_err(|e| Error::Config(format!("the run state of model `{model}`: {e}")))?;
    let tmp = path.with_extension("toml.tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| Error::Config(format!("cannot write {}: {e}", path.display())))?;
    Ok(path)
}

/// Reads the run state beside `model`'s checkpoint at `version`; `None` when there is none
/// (a checkpoint written on a signal carries none: the counts start from zero).
///
/// # Errors
/// A file that cannot be read or parsed, of another format, model or version, naming it.
pub(crate) fn read_state(
    dir: &Path,
    model: &ModelId,
    version: Version,
) -> Result<Option<RunState>> {
    let path = state_path_of(dir, model, version);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::Config(format!(
                "resume: cannot read {}: {e}",
                path.display()
            )));
        }
    };
    let state: RunState = toml::from_str(&text)
        .map_err(|e| Error::Config(format!("resume: {} is unusable: {e}", path.display())))?;
    if state.format != RunState::FORMAT
        || state.model != model.as_str()
        || state.version != version.0
    {
        return Err(Error::Config(format!(
            "resume: {} holds format {} of model `{}` v{}, not format {} of `{model}` v{}",
            path.display(),
            state.format,
            state.model,
            state.version,
            RunState::FORMAT,
            version.0
        )));
    }
    Ok(Some(state))
}

/// The versions `model` has a checkpoint file of under `dir`, oldest first (names only:
/// [`read`] checks a file whole).
///
/// # Errors
/// A folder that exists but cannot be listed.
pub(crate) fn versions(dir: &Path, model: &ModelId) -> Result<Vec<Version>> {
    let folder = dir.join(model.as_str());
    let entries = match std::fs::read_dir(&folder) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(Error::Config(format!(
                "checkpoints of model `{model}`: cannot list {}: {e}",
                folder.display()
            )));
        }
    };
    let mut out: Vec<Version> = entries
        .filter_map(|e| {
            let name = e.ok()?.file_name();
            let v = name
                .to_str()?
                .strip_prefix('v')?
                .strip_suffix(".safetensors")?;
            v.parse().ok().map(Version)
        })
        .collect();
    out.sort();
    Ok(out)
}

/// With `[checkpoint] resume`: restores `learner` of `spec` from the newest checkpoint every
/// model of the run has, and answers its version; `None` for a fresh run. Every trainer
/// rank of the model restores the same file (the shards of a sharded trainer each hold the
/// whole state: they train the same batches from the same seed).
///
/// # Errors
/// No usable checkpoint (a run told to resume never starts from zero); a damaged file or
/// one of another model or configuration, naming the file and what differs.
pub(crate) fn restore(
    topo: &Topology,
    who: &str,
    spec: &ModelSpec,
    learner: &mut dyn Learner,
) -> Result<Option<Version>> {
    let Some(cfg) = topo.checkpoint.as_ref().filter(|c| c.resume) else {
        return Ok(None);
    };
    let at = resume_version(cfg, &topo.model_ids())?;
    let (state, path) = read(&cfg.dir, &spec.id, at)?;
    learner.restore(&state, &path.display().to_string())?;
    tracing::info!(target: RANK_LOG,
        "{who}: model `{}` resumed from version {at} ({})",
        spec.id,
        path.display()
    );
    Ok(Some(at))
}

/// The newest version every one of `models` has a checkpoint of (the version barrier keeps
/// models in step, so they are checkpointed at the same versions).
///
/// # Errors
/// No version common to every model (what each has is named): a run told to resume never
/// starts from zero silently; a folder that cannot be listed.
pub fn resume_version(cfg: &CheckpointSection, models: &[ModelId]) -> Result<Version> {
    let mut common: Option<Vec<Version>> = None;
    let mut seen = Vec::new();
    for m in models {
        let vs = versions(&cfg.dir, m)?;
        seen.push(format!("`{m}`: {}", list(&vs)));
        common = Some(match common {
            None => vs,
            Some(c) => c.into_iter().filter(|v| vs.contains(v)).collect(),
        });
    }
    common.and_then(|c| c.last().copied()).ok_or_else(|| {
        Error::Config(format!(
            "resume: no checkpoint version that every model has in {} ({}); to start from \
             zero, run without --resume",
            cfg.dir.display(),
            seen.join("; ")
        ))
    })
}

fn list(vs: &[Version]) -> String {
    if vs.is_empty() {
        return "none".into();
    }
    vs.iter()
        .map(|v| format!("v{}", v.0))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads `model`'s checkpoint at `version`: the whole file, every tensor checked against its
/// checksum, and its header's model and version against the ones asked for.
///
/// # Errors
/// A missing, truncated or damaged file, or one of another model or version, naming the
/// file and what differs.
pub(crate) fn read(dir: &Path, model: &ModelId, version: Version) -> Result<(WeightSet, PathBuf)> {
    let path = path_of(dir, model, version);
    let state = WeightSet::read_safetensors(&path, None).map_err(|e| {
        Error::Config(format!(
            "resume: checkpoint {} is unusable: {e}",
            path.display()
        ))
    })?;
    if state.model() != model || state.version() != version {
        return Err(Error::Config(format!(
            "resume: checkpoint {} holds model `{}` v{}, not `{model}` v{}",
            path.display(),
            state.model(),
            state.version().0,
            version.0
        )));
    }
    Ok((state, path))
}

/// Writes `state` (a learner's, at its version) as `model`'s checkpoint, then removes all
/// but the newest `keep`. Answers the file.
///
/// # Errors
/// A folder that cannot be made, a file that cannot be written (the previous checkpoints
/// stay).
pub(crate) fn write(
    cfg: &CheckpointSection,
    model: &ModelId,
    state: &WeightSet,
) -> Result<PathBuf> {
    let path = path_of(&cfg.dir, model, state.version());
    if let Some(folder) = path.parent() {
        std::fs::create_dir_all(folder).map_err(|e| {
            Error::Config(format!(
                "checkpoint of model `{model}`: cannot make {}: {e}",
                folder.display()
            ))
        })?;
    }
    state.write_safetensors(&path)?;
    let all = versions(&cfg.dir, model)?;
    let keep = usize::try_from(cfg.keep).unwrap_or(usize::MAX);
    for old in all.iter().take(all.len().saturating_sub(keep)) {
        let p = path_of(&cfg.dir, model, *old);
        if let Err(e) = std::fs::remove_file(&p) {
            tracing::warn!(model = %model, "cannot remove the old checkpoint {}: {e}", p.display());
        }
        // its run state, when it has one
        let _ = std::fs::remove_file(state_path_of(&cfg.dir, model, *old));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use refit_runtime::{DType, Manifest};

    use super::*;

    fn id(s: &str) -> ModelId {
        ModelId::new(s).unwrap()
    }

    fn state(model: &str, v: u64) -> WeightSet {
        let m = Manifest::builder()
            .tensor("w", DType::F32, &[64])
            .build()
            .unwrap();
        let mut ws = WeightSet::zeroed(id(model), Arc::new(m));
        ws.set_version(Version(v));
        ws.view_mut::<f32>("w").unwrap()[3] = v as f32;
        ws
    }

    fn cfg(dir: &Path) -> CheckpointSection {
        CheckpointSection {
            dir: dir.to_path_buf(),
            every: 2,
            keep: 2,
            resume: true,
        }
    }

    #[test]
    fn the_newest_common_version_is_resumed_and_old_ones_are_pruned() {
        let tmp = tempfile::tempdir().unwrap();
        let c = cfg(tmp.path());
        let (a, b) = (id("a"), id("b"));
        let e = resume_version(&c, std::slice::from_ref(&a))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`a`: none") && e.contains("without --resume"),
            "{e}"
        );
        for v in [2, 4, 6] {
            write(&c, &a, &state("a", v)).unwrap();
        }
        write(&c, &b, &state("b", 4)).unwrap();
        // keep = 2: v2 of `a` is gone
        assert_eq!(versions(&c.dir, &a).unwrap(), [Version(4), Version(6)]);
        assert_eq!(
            resume_version(&c, std::slice::from_ref(&a)).unwrap(),
            Version(6)
        );
        assert_eq!(
            resume_version(&c, &[a.clone(), b.clone()]).unwrap(),
            Version(4)
        );
        let (ws, _) = read(&c.dir, &a, Version(6)).unwrap();
        assert_eq!(ws.view::<f32>("w").unwrap()[3], 6.0);
    }

    #[test]
    fn a_truncated_damaged_or_misplaced_checkpoint_is_refused_naming_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let c = cfg(tmp.path());
        let a = id("a");
        let path = write(&c, &a, &state("a", 2)).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        // truncated
        std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
        let e = read(&c.dir, &a, Version(2)).unwrap_err().to_string();
        assert!(e.contains(&path.display().to_string()), "{e}");
        // one flipped byte of data: the checksum says so
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last - 100] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        let e = read(&c.dir, &a, Version(2)).unwrap_err().to_string();
        assert!(
            e.contains(&path.display().to_string()) && e.contains("checksum"),
            "{e}"
        );
        // another model's file under this model's name
        std::fs::write(&path, state("b", 2).to_safetensors_bytes().unwrap()).unwrap();
        let e = read(&c.dir, &a, Version(2)).unwrap_err().to_string();
        assert!(e.contains("holds model `b` v2, not `a` v2"), "{e}");
    }

    /// The run state round-trips through its file; one of another model, version or format
    /// is refused naming the file; none is `None`.
    #[test]
    fn the_run_state_round_trips_and_refuses_another_models() {
        let dir = tempfile::tempdir().unwrap();
        let m = id("policy");
        std::fs::create_dir_all(dir.path().join("policy")).unwrap();
        assert_eq!(read_state(dir.path(), &m, Version(4)).unwrap(), None);
        let status = ModelStatus {
            train_version: Version(4),
            rollout_version: Version(4),
            state: refit_runtime::sync_policy::RolloutState::Running,
            admissions: 17,
            blocked: 3,
            waited: std::time::Duration::from_millis(1500),
            max_staleness: 2,
            loads: 8,
            failed_loads: 1,
            damaged: 0,
            fences: 1,
            fenced_for: std::time::Duration::from_millis(20),
            fenced: vec![1],
            last_error: None,
        };
        let state = RunState {
            format: RunState::FORMAT,
            model: "policy".into(),
            version: 4,
            evals: 2,
            status,
        };
        write_state(dir.path(), &m, &state).unwrap();
        assert_eq!(
            read_state(dir.path(), &m, Version(4)).unwrap(),
            Some(state.clone())
        );
        // a file of another model
        let other = RunState {
            model: "critic".into(),
            ..state
        };
        let text = toml::to_string(&other).unwrap();
        std::fs::write(state_path_of(dir.path(), &m, Version(4)), text).unwrap();
        let e = read_state(dir.path(), &m, Version(4))
            .unwrap_err()
            .to_string();
        assert!(e.contains("v4.state.toml") && e.contains("`critic`"), "{e}");
        std::fs::write(state_path_of(dir.path(), &m, Version(4)), "format = ").unwrap();
        let e = read_state(dir.path(), &m, Version(4))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unusable"), "{e}");
    }
}
