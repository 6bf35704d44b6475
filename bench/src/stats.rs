//! Timing samples and their summary.

use std::time::Duration;

use serde::Serialize;

/// min / median / p99 / max of a set of timings, in seconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    /// The smallest sample.
    pub min: f64,
    /// The median (the figure a benchmark quotes: these machines are noisy).
    pub median: f64,
    /// The 99th percentile (nearest rank: below 101 samples it is the largest).
    pub p99: f64,
    /// The largest sample.
    pub max: f64,
    /// How many samples.
    pub samples: usize,
}

impl Summary {
    /// The summary of `samples` (NaN figures when there are none).
    pub fn of(samples: &[Duration]) -> Self {
        let mut s: Vec<f64> = samples.iter().map(Duration::as_secs_f64).collect();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        if n == 0 {
            return Self {
                min: f64::NAN,
                median: f64::NAN,
                p99: f64::NAN,
                max: f64::NAN,
                samples: 0,
            };
        }
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        // nearest rank: the smallest sample with at least 99% of the samples at or below it
        let rank = (n * 99).div_ceil(100).max(1);
        Self {
            min: s[0],
            median,
            p99: s[rank - 1],
            max: s[n - 1],
            samples: n,
        }
    }
}

/// Human form of a duration in seconds.
pub fn fmt_secs(s: f64) -> String {
    if !s.is_finite() {
        "-".into()
    } else if s < 1e-6 {
        format!("{:.0} ns", s * 1e9)
    } else if s < 1e-3 {
        format!("{:.2} us", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.3} s")
    }
}

/// Human form of a byte count.
pub fn fmt_bytes(n: usize) -> String {
    const GIB: usize = 1 << 30;
    const MIB: usize = 1 << 20;
    if n >= GIB && n.is_multiple_of(GIB) {
        format!("{} GiB", n / GIB)
    } else if n >= MIB {
        format!("{} MiB", n / MIB)
    } else {
        format!("{} KiB", n / 1024)
    }
}

/// Parses a byte size with `bytesize`: `4096`, `4MiB`, `2GiB` (binary units: `KiB`, `MiB`,
/// `GiB`, also `Ki`, `Mi`, `Gi`), `64MB`, `1G` (decimal units: `KB` / `K` is 1000 bytes).
///
/// # Errors
/// A string that is not a size, or a size beyond `usize`, as a message naming it.
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let size: bytesize::ByteSize = s
        .trim()
        .parse()
        .map_err(|e| format!("bad size {s:?}: {e}"))?;
    // bytesize saturates instead of overflowing
    if size.as_u64() == u64::MAX {
        return Err(format!("size {s:?} overflows"));
    }
    usize::try_from(size.as_u64()).map_err(|_| format!("size {s:?} overflows"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_and_sizes() {
        let s = Summary::of(&[3, 1, 2, 10].map(Duration::from_secs));
        assert_eq!((s.min, s.median, s.p99, s.max), (1.0, 2.5, 10.0, 10.0));
        let many: Vec<Duration> = (1..=200).map(Duration::from_millis).collect();
        let m = Summary::of(&many);
        assert_eq!((m.p99, m.max), (0.198, 0.2));
        assert_eq!(Summary::of(&[Duration::from_secs(4)]).median, 4.0);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("64mi").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("64MB").unwrap(), 64_000_000);
        assert_eq!(parse_bytes(" 512 KiB ").unwrap(), 512 << 10);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("99999999999EiB").is_err());
        assert_eq!(fmt_bytes(512 << 20), "512 MiB");
        assert_eq!(fmt_secs(2.5e-6), "2.50 us");
    }
}
