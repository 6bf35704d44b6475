//! Collecting what senders that died without cleaning up (SIGKILL, the OOM killer, a crash)
//! left in the segment directory: every new sender looks once, on start.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use super::layout::{LAYOUT, OFF_LAYOUT, OFF_RECEIVERS, OFF_SENDER};
use super::lease;
use super::segment::Segment;

/// A board whose owner never wrote its record (it died within microseconds of creating
/// the file) is collected once it is this old.
const UNNAMED_AFTER: Duration = Duration::from_secs(60);

/// The scheme of a board file name, `refit-<32 hex digits>-board`.
fn scheme_of(name: &str) -> Option<&str> {
    let scheme = name.strip_prefix("refit-")?.strip_suffix("-board")?;
    (scheme.len() == 32 && scheme.bytes().all(|b| b.is_ascii_hexdigit())).then_some(scheme)
}

/// Why the board at `path` belongs to nobody, or `None` while its owner lives (or when it
/// is not ours to judge: another layout version, unreadable).
fn abandoned(path: &Path) -> Option<String> {
    let board = Segment::open(path, false).ok()?;
    if board.len() < OFF_RECEIVERS {
        return None;
    }
    let layout = board.u32_at(OFF_LAYOUT).ok()?.load(Ordering::SeqCst);
    if lease::record_pid(&board, OFF_SENDER) == 0 {
        let age = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())?;
        return (layout == 0 && age > UNNAMED_AFTER)
            .then(|| format!("its owner never named itself ({age:.0?} ago)"));
    }
    if layout != LAYOUT {
        return None;
    }
    let ms = board
        .u32_at(OFF_SENDER + lease::REC_LEASE_MS)
        .ok()?
        .load(Ordering::Relaxed);
    lease::dead(
        &board,
        OFF_SENDER,
        Duration::from_millis(u64::from(ms.max(10))),
    )
    .ok()?
}

/// Removes the segments of every scheme in `dir` whose sender is dead; returns the paths
/// removed. Failures (another user's file, a race with another collector) are skipped.
pub(crate) fn collect_dead(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("refit-"))
        .collect();
    let mut removed = Vec::new();
    for name in &names {
        let Some(scheme) = scheme_of(name) else {
            continue;
        };
        let Some(why) = abandoned(&dir.join(name)) else {
            continue;
        };
        let prefix = format!("refit-{scheme}-");
        // data segments first, the board last: a collector that stops half-way still
        // finds the board next time
        let mut files: Vec<&String> = names.iter().filter(|n| n.starts_with(&prefix)).collect();
        files.sort_by_key(|n| n.ends_with("-board"));
        for f in files {
            let path = dir.join(f);
            match std::fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) => tracing::debug!(path = %path.display(), error = %e, "could not collect"),
            }
        }
        tracing::warn!(scheme, reason = %why, "collected the shm segments of a dead sender");
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_board_names_are_schemes() {
        let s = "0123456789abcdef0123456789abcdef";
        assert_eq!(scheme_of(&format!("refit-{s}-board")), Some(s));
        assert_eq!(scheme_of(&format!("refit-{s}-m0")), None);
        assert_eq!(scheme_of("refit-xyz-board"), None);
        assert_eq!(scheme_of(&format!("other-{s}-board")), None);
    }
}
