//! Reading configuration files: the workspace's parsers take text
//! ([`Topology::parse_file`](crate::runtime::topology::Topology::parse_file),
//! [`SyncConfig::from_file_text`](crate::runtime::SyncConfig::from_file_text)); programs read
//! the file with [`read_config`].

use std::path::Path;

use crate::runtime::{Error, Result};

/// The text of the configuration file at `path` (a topology file, a sync configuration).
///
/// # Errors
/// [`Error::Path`] naming the file when it cannot be read or is not UTF-8.
pub fn read_config(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Path {
        context: "reading configuration file",
        path: path.to_path_buf(),
        source,
    })
}
