//! Timing samples and their summary.

use std::time::Duration;

use serde::Serialize;

/// min / median / p99 / max of a set of timings, in seconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Summary {
    pub(crate) min: f64,
    pub(crate) median: f64,
    /// The 99th percentile (nearest rank: below 101 samples it is the largest).
    pub(crate) p99: f64,
    pub(crate) max: f64,
    pub(crate) samples: usize,
}

impl Summary {
    pub(crate) fn of(samples: &[Duration]) -> Self {
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
pub(crate) fn fmt_secs(s: f64) -> String {
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
pub(crate) fn fmt_bytes(n: usize) -> String {
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

/// Parses `4MiB`, `2GiB`, `512M`, `1G`, `4096`.
pub(crate) fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
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
        assert_eq!(parse_bytes("64m").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("3 parsecs").is_err());
        assert_eq!(fmt_bytes(512 << 20), "512 MiB");
        assert_eq!(fmt_secs(2.5e-6), "2.50 us");
    }
}
