//! The evaluator's protocol: the controller's leader asks for a validation run on eval
//! steps and checks that every model was seen at the round's version.

use std::collections::{BTreeMap, BTreeSet};

use actix::prelude::*;
use refit_runtime::{ModelId, Version};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Runs validation for the eval step `step`.
#[derive(Debug, Clone, Message, Serialize, Deserialize)]
#[rtype(result = "Result<EvalReport>")]
pub struct RunEval {
    /// The round's version.
    pub step: Version,
}

/// One model's validation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelEval {
    /// Every version that answered an evaluation request.
    pub versions: BTreeSet<Version>,
    /// Mean undiscounted return of the episodes.
    pub mean_return: f64,
    /// Episodes run.
    pub episodes: usize,
}

/// A validation run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    /// The eval step.
    pub step: Version,
    /// Per model.
    pub models: BTreeMap<ModelId, ModelEval>,
}

impl EvalReport {
    /// Checks that every model was evaluated at `version` only.
    ///
    /// # Errors
    /// [`Error::Runtime`] with [`refit_runtime::Error::Sync`] naming the model and the
    /// versions it was seen at.
    pub fn check_versions(&self, version: Version) -> Result<()> {
        for (m, e) in &self.models {
            if e.versions.len() != 1 || !e.versions.contains(&version) {
                let seen: Vec<String> = e.versions.iter().map(|v| format!("v{v}")).collect();
                return Err(Error::Runtime(refit_runtime::Error::Sync(format!(
                    "eval step v{version} saw model `{m}` at {} (every model must be at v{version})",
                    seen.join(", ")
                ))));
            }
        }
        Ok(())
    }
}

crate::remote::wire_names! {
    RunEval => "evaluator.run_eval",
}
