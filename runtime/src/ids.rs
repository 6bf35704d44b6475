//! Model ids and versions.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The name of one synchronised model: `"policy"`, `"critic"`, `"env.transform[0].module"`.
///
/// Cheap to clone. Non-empty, at most 255 bytes, no control characters.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ModelId(Arc<str>);

impl ModelId {
    /// Longest accepted id, in bytes.
    pub const MAX_LEN: usize = 255;

    /// Makes a model id.
    ///
    /// # Errors
    /// [`Error::InvalidModelId`] when the name is empty, too long or holds control characters.
    pub fn new(name: impl AsRef<str>) -> Result<Self> {
        let name = name.as_ref();
        if name.is_empty() {
            return Err(Error::InvalidModelId(name.into(), "empty"));
        }
        if name.len() > Self::MAX_LEN {
            return Err(Error::InvalidModelId(name.into(), "longer than 255 bytes"));
        }
        if name.chars().any(char::is_control) {
            return Err(Error::InvalidModelId(
                name.into(),
                "holds control characters",
            ));
        }
        Ok(Self(name.into()))
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ModelId {
    type Error = Error;
    fn try_from(value: String) -> Result<Self> {
        Self::new(value)
    }
}

impl TryFrom<&str> for ModelId {
    type Error = Error;
    fn try_from(value: &str) -> Result<Self> {
        Self::new(value)
    }
}

impl From<ModelId> for String {
    fn from(value: ModelId) -> Self {
        value.0.to_string()
    }
}

impl fmt::Display for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelId({:?})", &*self.0)
    }
}

/// A per-model version, strictly increasing, stamped on every weight set the trainer publishes.
///
/// Version 0 means "never published"; the first real version is 1.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Version(pub u64);

impl Version {
    /// The version of a weight set that was never published.
    pub const ZERO: Self = Self(0);

    /// The next version.
    #[must_use]
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }

    /// The raw number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Debug for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_are_validated() {
        assert!(ModelId::new("policy").is_ok());
        assert!(ModelId::new("env.transform[0].module").is_ok());
        assert!(ModelId::new("").is_err());
        assert!(ModelId::new("a\nb").is_err());
        assert!(ModelId::new("x".repeat(256)).is_err());
        let bytes = rmp_serde::to_vec(&"".to_string()).unwrap();
        assert!(rmp_serde::from_slice::<ModelId>(&bytes).is_err());
    }
}
