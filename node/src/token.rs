//! The shared cluster token every connection presents in its first frame.

use std::fmt;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use refit_runtime::Error as CoreError;

/// Environment variable holding the cluster token.
pub const TOKEN_ENV: &str = "REFIT_TOKEN";

/// Environment variable naming a file that holds the cluster token (a file only its owner
/// can read; see [`ClusterToken::from_file`]).
pub const TOKEN_FILE_ENV: &str = "REFIT_TOKEN_FILE";

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
    /// [`Error::BadToken`] when shorter than [`Self::MIN_LEN`], longer than
    /// [`Self::MAX_LEN`], or holding whitespace or control characters.
    pub fn new(token: impl Into<String>) -> Result<Self> {
        Self::checked(token.into(), "the cluster token")
    }

    /// What a token must be, for errors about one.
    const RULE: &str = "a cluster token is 16 to 256 bytes with no whitespace or control \
                        characters (`refit token FILE` makes one in a new owner-only file)";

    /// `token`, checked; errors name `source` (a variable, a file) and never the token.
    fn checked(token: String, source: &str) -> Result<Self> {
        let bad = |what: String| Error::BadToken {
            source_name: source.into(),
            reason: format!("{what}: {}", Self::RULE),
        };
        if token.is_empty() {
            return Err(bad("is empty".into()));
        }
        if token.len() < Self::MIN_LEN || token.len() > Self::MAX_LEN {
            return Err(bad(format!("is {} bytes long", token.len())));
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("holds whitespace or control characters".into()));
        }
        Ok(Self(token))
    }

    /// The token in `REFIT_TOKEN`, or in the file `REFIT_TOKEN_FILE` names
    /// ([`ClusterToken::from_file`]), if either is set.
    ///
    /// # Errors
    /// As [`ClusterToken::new`] (naming the variable) when the variable holds a bad token or
    /// is not UTF-8; as [`ClusterToken::from_file`] for the file; [`Error::BadToken`] when
    /// both are set, or `REFIT_TOKEN_FILE` is set but empty.
    pub fn from_env() -> Result<Option<Self>> {
        let bad = |var: &str, reason: String| Error::BadToken {
            source_name: var.into(),
            reason,
        };
        let file = std::env::var_os(TOKEN_FILE_ENV);
        let token = std::env::var(TOKEN_ENV);
        // an empty REFIT_TOKEN_FILE beside REFIT_TOKEN is ignored (a variable cleared that
        // way); alone it is a mistake, told as one
        let file = match file {
            Some(f) if f.is_empty() => {
                if matches!(token, Err(std::env::VarError::NotPresent)) {
                    return Err(bad(
                        TOKEN_FILE_ENV,
                        "is set but empty: name a file holding the cluster token (`refit token \
                         FILE` makes one), or unset it"
                            .into(),
                    ));
                }
                None
            }
            other => other,
        };
        match (token, file) {
            (Ok(_) | Err(std::env::VarError::NotUnicode(_)), Some(_)) => Err(bad(
                &format!("both {TOKEN_ENV} and {TOKEN_FILE_ENV}"),
                "are set; keep one".into(),
            )),
            (Ok(v), None) => Self::checked(v, TOKEN_ENV).map(Some),
            (Err(std::env::VarError::NotUnicode(_)), None) => {
                Err(bad(TOKEN_ENV, format!("is not UTF-8: {}", Self::RULE)))
            }
            (Err(std::env::VarError::NotPresent), Some(f)) => {
                Self::from_file(Path::new(&f)).map(Some)
            }
            (Err(std::env::VarError::NotPresent), None) => Ok(None),
        }
    }

    /// `REFIT_TOKEN` (or `REFIT_TOKEN_FILE`) if set, a fresh random token otherwise.
    ///
    /// # Errors
    /// As [`ClusterToken::from_env`].
    pub fn from_env_or_random() -> Result<Self> {
        Ok(Self::from_env()?.unwrap_or_else(Self::random))
    }

    /// The token held in a file (surrounding whitespace, such as a final newline, is
    /// ignored). The file must be readable by its owner only (no group or other permission
    /// bits, e.g. mode `0600` or `0400`): a secret that others can read is refused, not used.
    ///
    /// # Errors
    /// [`Error::InsecureSecretFile`] naming the file and its mode when its group or others
    /// have any permission; [`Path`](refit_runtime::Error::Path) when it cannot be opened or read; as
    /// [`ClusterToken::new`] for what it holds (also when it is not UTF-8).
    pub fn from_file(path: &Path) -> Result<Self> {
        let path_err = |context: &'static str| {
            move |source: std::io::Error| {
                Error::from(CoreError::Path {
                    context,
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        let mut file = std::fs::File::open(path).map_err(path_err("opening the token file"))?;
        // the mode of the file opened, not of whatever the path names a moment later
        let meta = file
            .metadata()
            .map_err(path_err("reading the token file's permissions"))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = meta.permissions().mode() & 0o7777;
            if mode & 0o077 != 0 {
                return Err(Error::InsecureSecretFile {
                    path: path.to_path_buf(),
                    mode,
                });
            }
        }
        let source = format!("token file `{}`", path.display());
        if meta.len() > 4096 {
            return Err(Error::BadToken {
                source_name: source,
                reason: format!("is larger than 4 KiB: {}", Self::RULE),
            });
        }
        let mut text = String::new();
        file.read_to_string(&mut text)
            .map_err(path_err("reading the token file"))?;
        Self::checked(text.trim().to_owned(), &source)
    }

    /// Writes a fresh random token to a new file that only its owner can read and write
    /// (mode `0600`, set as the file is created), and returns it. An existing file is never
    /// overwritten.
    ///
    /// # Errors
    /// [`Path`](refit_runtime::Error::Path) when the file exists or cannot be created or written.
    pub fn create_file(path: &Path) -> Result<Self> {
        use std::io::Write;
        let token = Self::random();
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(path).map_err(|source| {
            Error::from(CoreError::Path {
                context: "creating the token file",
                path: path.to_path_buf(),
                source,
            })
        })?;
        writeln!(file, "{}", token.0)
            .and_then(|()| file.sync_all())
            .map_err(|source| {
                Error::from(CoreError::Path {
                    context: "writing the token file",
                    path: path.to_path_buf(),
                    source,
                })
            })?;
        Ok(token)
    }

    /// The secret itself (to hand to a child process; never log it).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Constant-time comparison with what a peer presented (`subtle`'s `ct_eq`): the time
    /// taken depends only on the lengths, never on where the bytes first differ.
    pub fn matches(&self, presented: &str) -> bool {
        use subtle::ConstantTimeEq;
        self.0.as_bytes().ct_eq(presented.as_bytes()).into()
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

    #[cfg(unix)]
    fn write_with_mode(path: &Path, text: &str, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn token_files_must_be_owner_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        write_with_mode(&path, "0123456789abcdef-secret\n", 0o600);
        let t = ClusterToken::from_file(&path).unwrap();
        assert!(t.matches("0123456789abcdef-secret"));
        write_with_mode(&path, "0123456789abcdef-secret\n", 0o400);
        assert!(ClusterToken::from_file(&path).is_ok());
        for mode in [0o640, 0o604, 0o644, 0o660, 0o610] {
            write_with_mode(&path, "0123456789abcdef-secret\n", mode);
            match ClusterToken::from_file(&path) {
                Err(Error::InsecureSecretFile { path: p, mode: m }) => {
                    assert_eq!((p.as_path(), m), (path.as_path(), mode));
                    let msg = Error::InsecureSecretFile { path: p, mode: m }.to_string();
                    assert!(msg.contains(&format!("{mode:04o}")), "{msg}");
                    assert!(msg.contains(&path.display().to_string()), "{msg}");
                    assert!(!msg.contains("secret\n"), "{msg}");
                }
                other => panic!("mode {mode:o}: {other:?}"),
            }
        }
        write_with_mode(&path, "short\n", 0o600);
        let e = ClusterToken::from_file(&path).unwrap_err();
        assert!(matches!(e, Error::BadToken { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("is 5 bytes long: a cluster token is 16 to 256 bytes")
                && msg.contains(&path.display().to_string())
                && !msg.contains("short"),
            "{msg}"
        );
        assert!(matches!(
            ClusterToken::from_file(&dir.path().join("missing")),
            Err(Error::Core(CoreError::Path { .. }))
        ));
    }

    #[cfg(unix)]
    #[test]
    fn created_token_files_are_owner_only_and_never_overwritten() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.token");
        let t = ClusterToken::create_file(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(ClusterToken::from_file(&path).unwrap(), t);
        assert!(matches!(
            ClusterToken::create_file(&path),
            Err(Error::Core(CoreError::Path { .. }))
        ));
        assert_eq!(ClusterToken::from_file(&path).unwrap(), t);
    }
}
