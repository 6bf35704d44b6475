//! The staleness filter: samples older than allowed are dropped, and counted.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::Version;

/// What the filter saw.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StalenessStats {
    /// Samples kept.
    pub kept: u64,
    /// Samples dropped for being too old.
    pub dropped: u64,
    /// The largest staleness among kept samples.
    pub max_kept: u64,
    /// Kept samples by staleness (`trainer version - sample version`).
    pub histogram: BTreeMap<u64, u64>,
}

impl StalenessStats {
    /// Mean staleness of the kept samples.
    pub fn mean_kept(&self) -> f64 {
        if self.kept == 0 {
            return 0.0;
        }
        let sum: u64 = self.histogram.iter().map(|(s, n)| s * n).sum();
        sum as f64 / self.kept as f64
    }

    /// `0 dropped`, or how many samples were dropped and the bound they passed (`allowed`:
    /// [`SyncConfig::allowed_staleness`](super::SyncConfig::allowed_staleness)), as reports
    /// say it.
    pub fn dropped_words(dropped: u64, allowed: Option<u64>) -> String {
        match allowed {
            Some(bound) if dropped > 0 => format!(
                "{dropped} dropped as staler than {bound} version{} (sync.max_staleness, by \
                 default the mode's: 0 in sync, staleness_threshold in batch-async)",
                if bound == 1 { "" } else { "s" }
            ),
            _ => format!("{dropped} dropped"),
        }
    }
}

/// Drops samples whose version is more than `max` behind the version about to train on them.
#[derive(Clone, Debug, Default)]
pub struct StalenessFilter {
    max: Option<u64>,
    stats: StalenessStats,
}

impl StalenessFilter {
    /// A filter allowing `max` versions of staleness (`None`: keep everything, still counted).
    pub fn new(max: Option<u64>) -> Self {
        Self {
            max,
            stats: StalenessStats::default(),
        }
    }

    /// The staleness of a sample produced by `sample` when `train` trains on it.
    pub fn staleness(sample: Version, train: Version) -> u64 {
        train.0.saturating_sub(sample.0)
    }

    /// Counts `n` samples of version `sample` for trainer version `train`; true to keep them.
    pub fn admit(&mut self, sample: Version, train: Version, n: u64) -> bool {
        let s = Self::staleness(sample, train);
        if self.max.is_some_and(|max| s > max) {
            self.stats.dropped += n;
            return false;
        }
        self.stats.kept += n;
        self.stats.max_kept = self.stats.max_kept.max(s);
        *self.stats.histogram.entry(s).or_default() += n;
        true
    }

    /// The allowed staleness.
    pub fn max(&self) -> Option<u64> {
        self.max
    }

    /// What was kept and dropped so far.
    pub fn stats(&self) -> &StalenessStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_only_what_is_too_old_and_counts_it() {
        let mut f = StalenessFilter::new(Some(1));
        assert!(f.admit(Version(5), Version(5), 10));
        assert!(f.admit(Version(4), Version(5), 3));
        assert!(!f.admit(Version(3), Version(5), 7));
        // a sample newer than the trainer (loaded before the trainer's notification) is fresh
        assert!(f.admit(Version(6), Version(5), 1));
        let s = f.stats();
        assert_eq!((s.kept, s.dropped, s.max_kept), (14, 7, 1));
        assert_eq!(s.histogram.get(&0), Some(&11));
        assert!((s.mean_kept() - 3.0 / 14.0).abs() < 1e-12);
        let mut all = StalenessFilter::new(None);
        assert!(all.admit(Version(1), Version(100), 1));
        assert_eq!(all.stats().max_kept, 99);
    }
}
