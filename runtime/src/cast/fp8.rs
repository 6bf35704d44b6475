//! 8-bit floats, encoded and decoded bit-exactly.
//!
//! Two formats (OCP 8-bit floating point specification):
//!
//! | | e4m3 (`e4m3fn`) | e5m2 |
//! | --- | --- | --- |
//! | exponent / mantissa bits, bias | 4 / 3, 7 | 5 / 2, 15 |
//! | largest finite | 448 (`0x7e`) | 57344 (`0x7b`) |
//! | smallest normal | 2^-6 (`0x08`) | 2^-14 (`0x04`) |
//! | smallest subnormal | 2^-9 (`0x01`) | 2^-16 (`0x01`) |
//! | infinity | none | `0x7c` / `0xfc` |
//! | NaN | `0x7f` / `0xff` only | `0x7d..=0x7f` (and negative) |
//!
//! Encoding from `f32` (`bf16` and `f16` inputs are first widened to `f32`, which is exact):
//!
//! - **Rounding**: round to nearest, ties to even, computed once on the exact `f32` bits (no
//!   double rounding). A carry out of the mantissa moves to the next exponent, so a
//!   subnormal can round up to the smallest normal, and a value can round up past the
//!   largest finite (then the overflow rule applies).
//! - **Subnormals**: values below the smallest normal are encoded as subnormals, rounded the
//!   same way; magnitudes at or below half the smallest subnormal round to zero (exactly half
//!   is a tie and goes to the even code, zero). `f32` subnormals become zero.
//! - **Zero**: the sign is kept (`-0.0` gives `0x80`).
//! - **NaN**: every NaN encodes as `0x7f`, or `0xff` when its sign bit is set (for both
//!   formats).
//! - **Overflow** ([`Overflow`]): by default ([`Overflow::Saturate`]) any magnitude that rounds
//!   above the largest finite, infinities included, becomes ± the largest finite (448 or
//!   57344). With [`Overflow::NonFinite`] it becomes NaN in e4m3 (which has no infinity) and
//!   ±infinity in e5m2.
//!
//! The tests cross-check both directions against the `float8` crate (a port of CUDA's
//! `cuda_fp8.hpp` conversions): all 256 codes of each format decode to the same values, and
//! saturating encodes agree on every code value, every tie and its neighbours, and a stride
//! through all `f32` bit patterns; only NaN payloads differ (both sides give a NaN code).

/// What a magnitude beyond the largest finite value encodes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Overflow {
    /// ± the largest finite value (448 in e4m3, 57344 in e5m2). The default.
    #[default]
    Saturate,
    /// NaN in e4m3, ±infinity in e5m2 (what a plain IEEE-style cast does).
    NonFinite,
}

/// One 8-bit format's layout.
pub(crate) struct Format {
    man_bits: u32,
    bias: i32,
    max_code: u32,
    inf: Option<u8>,
}

/// e4m3 (`e4m3fn`).
pub(crate) const E4M3: Format = Format {
    man_bits: 3,
    bias: 7,
    max_code: 0x7e,
    inf: None,
};
/// e5m2.
pub(crate) const E5M2: Format = Format {
    man_bits: 2,
    bias: 15,
    max_code: 0x7b,
    inf: Some(0x7c),
};

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite e5m2 value.
pub const E5M2_MAX: f32 = 57344.0;

/// Round `value >> shift` to nearest, ties to even.
fn round_shift(value: u32, shift: u32) -> u32 {
    let kept = value >> shift;
    let rem = value & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    if rem > half || (rem == half && kept & 1 == 1) {
        kept + 1
    } else {
        kept
    }
}

#[inline(always)]
fn encode(x: f32, f: &Format, overflow: Overflow) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | 0x7f;
    }
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    let code = if exp == 0xff {
        u32::MAX // infinity: past any finite code
    } else if exp == 0 {
        0 // f32 zero or subnormal: far below half the smallest fp8 subnormal
    } else {
        let e = exp - 127;
        let field = e + f.bias;
        if field >= 1 {
            // Normal: keep `man_bits` of the 23; the carry may bump the exponent.
            ((field as u32) << f.man_bits) + round_shift(man, 23 - f.man_bits)
        } else {
            // Subnormal: the significand 1.m in units of the smallest subnormal.
            let shift = (24 - f.bias - f.man_bits as i32 - e) as u32;
            if shift > 25 {
                0
            } else {
                round_shift((1 << 23) | man, shift)
            }
        }
    };
    if code > f.max_code {
        return match (overflow, f.inf) {
            (Overflow::Saturate, _) => sign | f.max_code as u8,
            (Overflow::NonFinite, Some(inf)) => sign | inf,
            (Overflow::NonFinite, None) => sign | 0x7f,
        };
    }
    sign | code as u8
}

impl Format {
    /// The code a magnitude past the largest finite becomes under `overflow` (sign apart).
    pub(crate) const fn overflow_code(&self, overflow: Overflow) -> u32 {
        match (overflow, self.inf) {
            (Overflow::Saturate, _) => self.max_code,
            (Overflow::NonFinite, Some(inf)) => inf as u32,
            (Overflow::NonFinite, None) => 0x7f,
        }
    }

    /// [`encode`] without branches, for loops the compiler vectorises (the kernels of
    /// [`super::kernels`]): the same bits for every input. `over` is
    /// [`Format::overflow_code`].
    #[inline(always)]
    pub(crate) fn encode_lanes(&self, x: f32, over: u32) -> u8 {
        let bits = x.to_bits();
        let sign = (bits >> 24) & 0x80;
        let abs = bits & 0x7fff_ffff;
        // a normal code: rebias the exponent, round to nearest even at the mantissa's end
        // (a carry moves to the next exponent, as in `encode`)
        let shift = 23 - self.man_bits;
        let rebias = ((127 - self.bias) as u32) << 23;
        let normal = abs
            .wrapping_sub(rebias)
            .wrapping_add((1 << (shift - 1)) - 1 + ((abs >> shift) & 1))
            >> shift;
        // below the smallest normal: adding 2^(24 - bias - man), whose ulp is the smallest
        // subnormal, rounds to nearest even in units of it (f32 subnormals give 0)
        let magic = f32::from_bits(((127 + 24 - self.bias - self.man_bits as i32) as u32) << 23);
        let subnormal = (f32::from_bits(abs) + magic)
            .to_bits()
            .wrapping_sub(magic.to_bits());
        let min_normal = ((128 - self.bias) as u32) << 23;
        let code = if abs < min_normal { subnormal } else { normal };
        let code = if code > self.max_code { over } else { code };
        let code = if abs > 0x7f80_0000 { 0x7f } else { code };
        (sign | code) as u8
    }
}

fn decode(b: u8, f: &Format) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp_bits = 7 - f.man_bits;
    let exp = i32::from((b >> f.man_bits) & ((1 << exp_bits) - 1));
    let man = f32::from(b & ((1 << f.man_bits) - 1));
    let steps = (1 << f.man_bits) as f32;
    let top = (1 << exp_bits) - 1;
    if exp == top {
        match f.inf {
            Some(_) if man == 0.0 => return sign * f32::INFINITY,
            Some(_) => return f32::NAN,
            None if man == steps - 1.0 => return f32::NAN,
            None => {}
        }
    }
    if exp == 0 {
        sign * man / steps * 2f32.powi(1 - f.bias)
    } else {
        sign * (1.0 + man / steps) * 2f32.powi(exp - f.bias)
    }
}

/// `x` as e4m3 (OCP `e4m3fn`); see the [module docs](self) for the exact rules.
#[inline]
pub fn f32_to_e4m3(x: f32, overflow: Overflow) -> u8 {
    encode(x, &E4M3, overflow)
}

/// `x` as e5m2; see the [module docs](self) for the exact rules.
#[inline]
pub fn f32_to_e5m2(x: f32, overflow: Overflow) -> u8 {
    encode(x, &E5M2, overflow)
}

/// The exact value of an e4m3 byte (`0x7f` / `0xff` are NaN).
pub fn e4m3_to_f32(b: u8) -> f32 {
    decode(b, &E4M3)
}

/// The exact value of an e5m2 byte.
pub fn e5m2_to_f32(b: u8) -> f32 {
    decode(b, &E5M2)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAT: Overflow = Overflow::Saturate;

    #[test]
    fn e4m3_reference_values() {
        let cases: [(f32, u8); 22] = [
            (1.0, 0x38),
            (-1.0, 0xb8),
            (448.0, 0x7e),
            (-448.0, 0xfe),
            (0.001_953_125, 0x01), // 2^-9, smallest subnormal
            (0.015_625, 0x08),     // 2^-6, smallest normal
            (0.013_671_875, 0x07), // 7 * 2^-9, largest subnormal
            (500.0, 0x7e),         // saturates
            (1e30, 0x7e),
            (f32::INFINITY, 0x7e),
            (f32::NEG_INFINITY, 0xfe),
            (0.0, 0x00),
            (-0.0, 0x80),
            (0.000_976_562_5, 0x00), // 2^-10: tie between 0 and 2^-9, to even (0)
            (0.002_929_687_5, 0x02), // 1.5 * 2^-9: tie between 1 and 2, to even (2)
            (0.000_976_6, 0x01),     // just above half the smallest subnormal
            (1.0625, 0x38),          // tie between 1.0 and 1.125, to even (1.0)
            (1.1875, 0x3a),          // tie between 1.125 and 1.25, to even (1.25)
            (1.06251, 0x39),         // just above the tie
            (464.0, 0x7e),           // tie between 448 and (480), to even: 448
            (0.0147, 0x08),          // past the midpoint 0.01465 of 0.01367 (0x07) and 0.015625
            (3.0, 0x44),
        ];
        for (x, code) in cases {
            assert_eq!(f32_to_e4m3(x, SAT), code, "{x}");
        }
        assert_eq!(f32_to_e4m3(f32::NAN, SAT), 0x7f);
        assert_eq!(f32_to_e4m3(-f32::NAN, SAT), 0xff);
        assert_eq!(f32_to_e4m3(500.0, Overflow::NonFinite), 0x7f);
        assert_eq!(f32_to_e4m3(-f32::INFINITY, Overflow::NonFinite), 0xff);
        assert_eq!(f32_to_e4m3(450.0, Overflow::NonFinite), 0x7e);
        assert_eq!(f32_to_e4m3(f32::from_bits(1), SAT), 0x00);
    }

    #[test]
    fn e5m2_reference_values() {
        let cases: [(f32, u8); 15] = [
            (1.0, 0x3c),
            (448.0, 0x5f),
            (500.0, 0x60),         // 1.953 * 2^8 rounds up into the next binade
            (0.001_953_125, 0x18), // 2^-9 is normal in e5m2
            (57344.0, 0x7b),
            (-57344.0, 0xfb),
            (65536.0, 0x7b),
            (f32::INFINITY, 0x7b),
            (1.0 / 65536.0, 0x01), // 2^-16, smallest subnormal
            (1.0 / 16384.0, 0x04), // 2^-14, smallest normal
            (-0.0, 0x80),
            (1.125, 0x3c), // tie between 1.0 and 1.25, to even (1.0)
            (1.375, 0x3e), // tie between 1.25 and 1.5, to even (1.5)
            (0.5, 0x38),
            (1.0 / 131072.0, 0x00), // 2^-17: tie to zero
        ];
        for (x, code) in cases {
            assert_eq!(f32_to_e5m2(x, SAT), code, "{x}");
        }
        assert_eq!(f32_to_e5m2(f32::NAN, SAT), 0x7f);
        assert_eq!(f32_to_e5m2(65536.0, Overflow::NonFinite), 0x7c);
        assert_eq!(f32_to_e5m2(f32::NEG_INFINITY, Overflow::NonFinite), 0xfc);
        assert_eq!(e5m2_to_f32(0x7c), f32::INFINITY);
        assert!(e5m2_to_f32(0x7d).is_nan());
    }

    #[test]
    fn every_code_round_trips_and_encoding_is_nearest() {
        for (enc, dec, nan_codes) in [
            (
                f32_to_e4m3 as fn(f32, Overflow) -> u8,
                e4m3_to_f32 as fn(u8) -> f32,
                &[0x7f_u8, 0xff][..],
            ),
            (
                f32_to_e5m2,
                e5m2_to_f32,
                &[0x7d, 0x7e, 0x7f, 0xfd, 0xfe, 0xff][..],
            ),
        ] {
            let mut finite = Vec::new();
            for b in 0..=255_u8 {
                let v = dec(b);
                if nan_codes.contains(&b) {
                    assert!(v.is_nan(), "{b:#04x}");
                    continue;
                }
                assert_eq!(enc(v, Overflow::NonFinite), b, "{b:#04x} = {v}");
                if v.is_finite() {
                    finite.push(v);
                }
            }
            // Nearest: for many inputs, no finite code is strictly closer than the chosen one.
            let mut x = -70000.0_f32;
            while x < 70000.0 {
                for v in [x, x / 1024.0, x / 1_048_576.0] {
                    let got = dec(enc(v, Overflow::Saturate));
                    let best = finite
                        .iter()
                        .map(|c| (c - v).abs())
                        .fold(f32::INFINITY, f32::min);
                    assert!(
                        (got - v).abs() <= best,
                        "{v} -> {got}, a code is {best} away"
                    );
                }
                x += 7.37;
            }
        }
    }

    #[test]
    fn decode_reference_values() {
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 0.001_953_125);
        assert_eq!(e4m3_to_f32(0x80), 0.0);
        assert!(e4m3_to_f32(0x80).is_sign_negative());
        assert!(e4m3_to_f32(0xff).is_nan());
        assert_eq!(e4m3_to_f32(0x78), 256.0); // exponent 15 is a normal binade in e4m3fn
        assert_eq!(e5m2_to_f32(0x7b), 57344.0);
        assert_eq!(e5m2_to_f32(0x01), 1.0 / 65536.0);
    }

    /// Cross-check against the `float8` crate (a port of CUDA's `cuda_fp8.hpp`
    /// conversions), which implements the same OCP formats with saturation to the largest
    /// finite value. NaN payloads are not compared (any `S.1111.111` / `S.11111.{01,10,11}`
    /// pattern is a NaN per the OCP spec; `float8` keeps part of the input's payload in
    /// e5m2, we always write `0x7f`), only that both sides give a NaN.
    mod float8_cross_check {
        use super::*;
        use float8::{F8E4M3, F8E5M2};

        fn same(ours: f32, theirs: f32) -> bool {
            (ours.is_nan() && theirs.is_nan()) || ours.to_bits() == theirs.to_bits()
        }

        #[test]
        fn every_code_decodes_as_float8_does() {
            for b in 0..=255_u8 {
                let (ours, theirs) = (e4m3_to_f32(b), F8E4M3::from_bits(b).to_f32());
                assert!(
                    same(ours, theirs),
                    "e4m3 {b:#04x}: ours {ours}, float8 {theirs}"
                );
                let (ours, theirs) = (e5m2_to_f32(b), F8E5M2::from_bits(b).to_f32());
                assert!(
                    same(ours, theirs),
                    "e5m2 {b:#04x}: ours {ours}, float8 {theirs}"
                );
            }
        }

        /// Every code's value, the midpoints between neighbouring codes (ties) and one f32
        /// step either side of each, values past the largest finite, infinities, and a
        /// stride through every f32 bit pattern.
        fn inputs(dec: fn(u8) -> f32) -> Vec<f32> {
            let mut finite: Vec<f32> = (0..=255_u8).map(dec).filter(|v| v.is_finite()).collect();
            finite.sort_by(f32::total_cmp);
            let mut xs = finite.clone();
            for w in finite.windows(2) {
                let mid = (w[0] + w[1]) / 2.0; // exact: both are short binary fractions
                xs.extend([mid, mid.next_up(), mid.next_down()]);
            }
            let max = finite.last().copied().unwrap_or(0.0);
            xs.extend([max * 1.03, max * 1.1, max * 2.0, 1e30, f32::MAX]);
            xs.extend([
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::MIN_POSITIVE,
                f32::from_bits(1),
            ]);
            let negatives: Vec<f32> = xs.iter().map(|x| -x).collect();
            xs.extend(negatives);
            xs.extend((0..u32::MAX).step_by(9_973).map(f32::from_bits));
            xs
        }

        #[test]
        fn encoding_agrees_with_float8_when_saturating() {
            for (name, enc, dec, theirs) in [
                (
                    "e4m3",
                    f32_to_e4m3 as fn(f32, Overflow) -> u8,
                    e4m3_to_f32 as fn(u8) -> f32,
                    (|x| F8E4M3::from_f32(x).to_bits()) as fn(f32) -> u8,
                ),
                ("e5m2", f32_to_e5m2, e5m2_to_f32, |x| {
                    F8E5M2::from_f32(x).to_bits()
                }),
            ] {
                let mut checked = 0;
                for x in inputs(dec) {
                    let (ours, theirs) = (enc(x, Overflow::Saturate), theirs(x));
                    if x.is_nan() {
                        assert!(
                            dec(ours).is_nan() && dec(theirs).is_nan(),
                            "{name} NaN {x:?}"
                        );
                        continue;
                    }
                    assert_eq!(
                        ours,
                        theirs,
                        "{name}: {x:e} ({:#010x}) -> ours {ours:#04x} ({}), float8 {theirs:#04x} ({})",
                        x.to_bits(),
                        dec(ours),
                        dec(theirs)
                    );
                    checked += 1;
                }
                assert!(checked > 400_000, "{name}: only {checked} inputs");
            }
        }
    }
}
