//! Sizes and durations as a person reads them: `18.3 KiB`, `64.0 MiB`, `0.3 us`, `4.2 ms`.

use std::time::Duration;

/// `n` bytes in the largest binary unit that keeps the number at or above 1: `512 B`,
/// `18.3 KiB`, `64.0 MiB`, `1.50 GiB`.
pub fn bytes(n: u64) -> String {
    const KIB: f64 = 1024.0;
    let x = n as f64;
    if n < 1024 {
        format!("{n} B")
    } else if x < KIB * KIB {
        format!("{:.1} KiB", x / KIB)
    } else if x < KIB * KIB * KIB {
        format!("{:.1} MiB", x / (KIB * KIB))
    } else {
        format!("{:.2} GiB", x / (KIB * KIB * KIB))
    }
}

/// `d` in the unit that fits it: `0.3 us`, `4.2 ms`, `1.25 s`.
pub fn duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1e-3 {
        format!("{:.1} us", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_read_in_the_unit_that_fits() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(18_696), "18.3 KiB");
        assert_eq!(bytes(64 << 20), "64.0 MiB");
        assert_eq!(bytes(3 << 29), "1.50 GiB");
        assert_eq!(duration(Duration::from_nanos(300)), "0.3 us");
        assert_eq!(duration(Duration::from_micros(4_200)), "4.2 ms");
        assert_eq!(duration(Duration::from_millis(1_250)), "1.25 s");
    }
}
