//! The shared cluster token every connection presents in its first frame.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Environment variable holding the cluster token.
pub const TOKEN_ENV: &str = "REFIT_TOKEN";

/// A shared secret: every node of one cluster holds the same one and presents it in its
/// hello frame. Compared in constant time; never printed (`Debug` shows `<redacted>`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClusterToken(String);

impl ClusterToken {
    /// Shortest accepted token, in bytes.
    pub const MIN_LEN: usize = 16;
    /// Longest accepted token, in bytes.
    pub const MAX_LEN: usize = 256;

    /// A fresh random token (244 random bits from the OS generator, as hex).
    pub fn random() -> Self {
        let a = uuid::Uuid::new_v4().simple().to_string();
        let b = uuid::Uuid::new_v4().simple().to_string();
        Self(format!("{a}{b}"))
    }

    /// A token from configuration.
    ///
    /// # Errors
    /// [`Error::Unauthorized`] when shorter than [`Self::MIN_LEN`], longer than
    /// [`Self::MAX_LEN`], or holding whitespace or control characters.
    pub fn new(token: impl Into<String>) -> Result<Self> {
        let token = token.into();
        let bad = |reason: &str| Error::Unauthorized {
            peer: "local configuration".into(),
            reason: format!("cluster token {reason}"),
        };
        if token.len() < Self::MIN_LEN {
            return Err(bad(&format!("shorter than {} bytes", Self::MIN_LEN)));
        }
        if token.len() > Self::MAX_LEN {
            return Err(bad(&format!("longer than {} bytes", Self::MAX_LEN)));
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("holds whitespace or control characters"));
        }
        Ok(Self(token))
    }

    /// The token in `REFIT_TOKEN`, if set.
    ///
    /// # Errors
    /// As [`ClusterToken::new`] when the variable holds a bad token or is not UTF-8.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(TOKEN_ENV) {
            Ok(v) => Self::new(v).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(Error::Unauthorized {
                peer: "local configuration".into(),
                reason: format!("{TOKEN_ENV} is not UTF-8"),
            }),
        }
    }

    /// `REFIT_TOKEN` if set, a fresh random token otherwise.
    ///
    /// # Errors
    /// As [`ClusterToken::from_env`].
    pub fn from_env_or_random() -> Result<Self> {
        Ok(Self::from_env()?.unwrap_or_else(Self::random))
    }

    /// The secret itself (to hand to a child process; never log it).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Constant-time comparison with what a peer presented: the time taken depends only on
    /// the lengths, never on where the bytes first differ.
    pub fn matches(&self, presented: &str) -> bool {
        let a = self.0.as_bytes();
        let b = presented.as_bytes();
        let n = a.len().max(b.len());
        let mut diff = u8::from(a.len() != b.len());
        for i in 0..n {
            let x = a.get(i).copied().unwrap_or(0);
            let y = b.get(i).copied().unwrap_or(0xff);
            diff |= std::hint::black_box(x ^ y);
        }
        std::hint::black_box(diff) == 0
    }
}

impl fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterToken(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole_and_never_print() {
        let t = ClusterToken::new("0123456789abcdef-secret").unwrap();
        assert!(t.matches("0123456789abcdef-secret"));
        assert!(!t.matches("0123456789abcdef-secreT"));
        assert!(!t.matches("0123456789abcdef-secret-and-more"));
        assert!(!t.matches(""));
        assert!(!format!("{t:?}").contains("secret"));
        assert!(ClusterToken::new("short").is_err());
        assert!(ClusterToken::new("has a space in it......").is_err());
        let r = ClusterToken::random();
        assert_eq!(r.expose().len(), 64);
        assert_ne!(r, ClusterToken::random());
    }
}
