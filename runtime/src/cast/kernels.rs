//! The element loops of the casts, written for the compiler to vectorise: straight-line
//! integer and float arithmetic with selects instead of branches, over slices. Each gives
//! exactly the bits of the scalar conversion it replaces (`half`'s `bf16::from_f32`,
//! `f16::from_f32`, `to_f32`, and the encoders of [`super::fp8`]); the tests compare them
//! over every 16-bit input and every edge of the `f32` range.
//!
//! On an x86-64 CPU with AVX2 the same loops run compiled for it (eight lanes instead of
//! four), chosen once at run time; elsewhere they run as the target compiles them.

use super::fp8::{self, Overflow};

/// Defines a kernel twice, for the build's target and (on x86-64) for AVX2, and picks the
/// AVX2 one at run time when the CPU has it. The body is one function: both copies compute
/// the same bits.
macro_rules! kernel {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn wide($($arg: $ty),*) {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: `wide` only needs the CPU to have AVX2, checked just above.
                    return unsafe { wide($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

/// `f32` bits to `bf16` bits: round to nearest, ties to even; a NaN keeps its sign and the
/// top of its payload and is made quiet (as `half::bf16::from_f32`).
#[inline(always)]
fn bf16_of(x: u32) -> u16 {
    let nan = (x & 0x7fff_ffff) > 0x7f80_0000;
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    (if nan { (x >> 16) | 0x40 } else { rounded }) as u16
}

/// `bf16` bits to `f32` bits: exact; a NaN is made quiet (as `half::bf16::to_f32`).
#[inline(always)]
fn f32_of_bf16(h: u16) -> u32 {
    let h = u32::from(h);
    let quiet = if (h & 0x7fff) > 0x7f80 { 0x40 } else { 0 };
    (h | quiet) << 16
}

/// `f32` bits to `f16` bits: round to nearest, ties to even, overflow to infinity,
/// subnormals rounded the same way; a NaN keeps its sign and the top of its payload and is
/// made quiet (as `half::f16::from_f32`).
#[inline(always)]
fn f16_of(x: u32) -> u16 {
    let sign = (x >> 16) & 0x8000;
    let abs = x & 0x7fff_ffff;
    // a normal half: rebias the exponent (127 - 15), round at bit 13
    let normal = abs
        .wrapping_sub(112 << 23)
        .wrapping_add(0xfff + ((abs >> 13) & 1))
        >> 13;
    // below the smallest normal half (2^-14): adding 0.5, whose ulp is the smallest
    // subnormal half (2^-24), rounds to nearest even in units of it
    let subnormal = (f32::from_bits(abs) + 0.5)
        .to_bits()
        .wrapping_sub(0x3f00_0000);
    let finite = if abs < 0x3880_0000 {
        subnormal
    } else if abs < 0x4780_0000 {
        normal
    } else {
        0x7c00
    };
    let nan = 0x7e00 | ((abs & 0x7f_ffff) >> 13);
    (sign | if abs > 0x7f80_0000 { nan } else { finite }) as u16
}

/// `f16` bits to `f32` bits: exact; a NaN is made quiet (as `half::f16::to_f32`).
#[inline(always)]
fn f32_of_f16(h: u16) -> u32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let mag = h & 0x7fff;
    let man = mag & 0x3ff;
    let normal = (mag << 13) + (112 << 23);
    // a subnormal half is its mantissa times 2^-24 (exact in f32)
    let subnormal = (mag as f32 * (1.0 / 16_777_216.0)).to_bits();
    let special = 0x7f80_0000 | (man << 13) | if man != 0 { 0x40_0000 } else { 0 };
    sign | if mag >= 0x7c00 {
        special
    } else if mag < 0x400 {
        subnormal
    } else {
        normal
    }
}

kernel! {
    /// `dst[i] = bf16(src[i])` (lengths must agree; the shorter one bounds the loop).
    pub(crate) fn f32_to_bf16(src: &[f32], dst: &mut [u16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16_of(s.to_bits());
        }
    }
}

kernel! {
    /// `dst[i] = f16(src[i])`.
    pub(crate) fn f32_to_f16(src: &[f32], dst: &mut [u16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f16_of(s.to_bits());
        }
    }
}

kernel! {
    /// `dst[i] = f32(src[i])` for `bf16` bits.
    pub(crate) fn bf16_to_f32(src: &[u16], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(f32_of_bf16(s));
        }
    }
}

kernel! {
    /// `dst[i] = f32(src[i])` for `f16` bits.
    pub(crate) fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(f32_of_f16(s));
        }
    }
}

kernel! {
    /// `dst[i] = e4m3(src[i] / scale)`.
    pub(crate) fn f32_to_e4m3(src: &[f32], scale: f32, overflow: Overflow, dst: &mut [u8]) {
        let over = fp8::E4M3.overflow_code(overflow);
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = fp8::E4M3.encode_lanes(s / scale, over);
        }
    }
}

kernel! {
    /// `dst[i] = e5m2(src[i] / scale)`.
    pub(crate) fn f32_to_e5m2(src: &[f32], scale: f32, overflow: Overflow, dst: &mut [u8]) {
        let over = fp8::E5M2.overflow_code(overflow);
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = fp8::E5M2.encode_lanes(s / scale, over);
        }
    }
}

kernel! {
    /// `*out = max(*out, |src[i]|)` as `f32` bits with the sign cleared: ordered as the
    /// magnitudes are; `>= 0x7f80_0000` when a value is infinite or NaN.
    pub(crate) fn f32_amax(src: &[f32], out: &mut u32) {
        // a plain fold: integer max reorders freely, so the compiler keeps one vector of
        // maxima and reads the slice in order
        *out = src
            .iter()
            .fold(*out, |m, x| m.max(x.to_bits() & 0x7fff_ffff));
    }
}

kernel! {
    /// `*out = max(*out, |src[i]|)` over 16-bit floats (`bf16` or `f16`) as their bits
    /// with the sign cleared: ordered as the magnitudes are.
    pub(crate) fn half_amax(src: &[u16], out: &mut u16) {
        *out = src.iter().fold(*out, |m, &x| m.max(x & 0x7fff));
    }
}

/// Elements of 16-bit floats widened at a time on their way to fp8 (16 KiB of `f32`: stays
/// in the L1 cache between the widening and the encoding).
pub(crate) const WIDEN: usize = 4096;

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Every 16-bit pattern.
    fn all_u16() -> Vec<u16> {
        (0..=u16::MAX).collect()
    }

    /// The f32 inputs whose conversions are most likely to differ: every exponent with the
    /// mantissa bits around each rounding position (bf16: bit 16, f16: bit 13 and the
    /// subnormal shifts, fp8: bits 20 and 21 and their subnormal shifts), both signs, the
    /// specials, plus a stride through every bit pattern.
    pub(crate) fn f32_edges() -> Vec<f32> {
        let mut bits = Vec::new();
        for top in 0..=0x1ffu32 {
            let base = top << 23;
            for k in 0..23 {
                let b = 1u32 << k;
                for low in [b - 1, b, b + 1, b | (b >> 1), (b << 1) - 1] {
                    for odd in [0, 1u32 << (k + 1).min(22)] {
                        bits.push(base | ((low | odd) & 0x7f_ffff));
                    }
                }
            }
            bits.extend([base, base | 0x7f_ffff, base | 0x40_0000, base | 1]);
        }
        bits.extend((0..u32::MAX).step_by(65_521));
        bits.into_iter().map(f32::from_bits).collect()
    }

    fn same_bits(a: &[u16], b: &[u16]) {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(x, y, "element {i}: {x:#06x} != {y:#06x}");
        }
    }

    #[test]
    fn widening_every_bf16_and_f16_matches_half() {
        let all = all_u16();
        let mut fast = vec![0f32; all.len()];
        bf16_to_f32(&all, &mut fast);
        for (&h, f) in all.iter().zip(&fast) {
            let want = bf16::from_bits(h).to_f32();
            assert_eq!(f.to_bits(), want.to_bits(), "bf16 {h:#06x}");
        }
        f16_to_f32(&all, &mut fast);
        for (&h, f) in all.iter().zip(&fast) {
            // both half's paths: the CPU's instruction where it has one, and the portable one
            for want in [f16::from_bits(h).to_f32(), f16::from_bits(h).to_f32_const()] {
                assert_eq!(f.to_bits(), want.to_bits(), "f16 {h:#06x}");
            }
        }
    }

    #[test]
    fn narrowing_matches_half_on_every_half_value_and_every_edge() {
        // every bf16 and f16 value widened is exactly representable: it must come back
        let all = all_u16();
        let as_f32 = |wide: fn(&[u16], &mut [f32])| {
            let mut v = vec![0f32; all.len()];
            wide(&all, &mut v);
            v
        };
        let mut inputs = as_f32(bf16_to_f32);
        inputs.extend(as_f32(f16_to_f32));
        inputs.extend(f32_edges());
        let mut fast = vec![0u16; inputs.len()];
        f32_to_bf16(&inputs, &mut fast);
        let want: Vec<u16> = inputs
            .iter()
            .map(|&x| bf16::from_f32(x).to_bits())
            .collect();
        same_bits(&fast, &want);
        f32_to_f16(&inputs, &mut fast);
        let want: Vec<u16> = inputs.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
        same_bits(&fast, &want);
        let portable: Vec<u16> = inputs
            .iter()
            .map(|&x| f16::from_f32_const(x).to_bits())
            .collect();
        same_bits(&fast, &portable);
        // the values that went through unchanged did come back
        f32_to_bf16(&as_f32(bf16_to_f32), &mut fast[..all.len()]);
        for (i, (&h, &back)) in all.iter().zip(&fast).enumerate() {
            let nan = (h & 0x7fff) > 0x7f80;
            assert!(nan || h == back, "bf16 {i:#06x} came back as {back:#06x}");
        }
    }

    #[test]
    fn fp8_matches_the_scalar_encoder_on_every_edge() {
        let mut inputs = f32_edges();
        // every fp8 code's value, each midpoint and its neighbours, through both formats
        for dec in [fp8::e4m3_to_f32 as fn(u8) -> f32, fp8::e5m2_to_f32] {
            let mut codes: Vec<f32> = (0..=255u8).map(dec).filter(|v| v.is_finite()).collect();
            codes.sort_by(f32::total_cmp);
            for w in codes.windows(2) {
                let mid = (w[0] + w[1]) / 2.0;
                inputs.extend([w[0], mid, mid.next_up(), mid.next_down()]);
            }
        }
        let mut fast = vec![0u8; inputs.len()];
        for scale in [1.0f32, 0.37, 3.0e-3, 1.0e5] {
            for overflow in [Overflow::Saturate, Overflow::NonFinite] {
                f32_to_e4m3(&inputs, scale, overflow, &mut fast);
                for (x, &got) in inputs.iter().zip(&fast) {
                    let want = fp8::f32_to_e4m3(x / scale, overflow);
                    assert_eq!(got, want, "e4m3 {x:e} / {scale} ({:#010x})", x.to_bits());
                }
                f32_to_e5m2(&inputs, scale, overflow, &mut fast);
                for (x, &got) in inputs.iter().zip(&fast) {
                    let want = fp8::f32_to_e5m2(x / scale, overflow);
                    assert_eq!(got, want, "e5m2 {x:e} / {scale} ({:#010x})", x.to_bits());
                }
            }
        }
    }

    #[test]
    fn amax_finds_the_largest_magnitude_and_flags_non_finite_values() {
        let mut v: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 0.25).collect();
        let mut m = 0;
        f32_amax(&v, &mut m);
        assert_eq!(f32::from_bits(m), 125.0);
        v[997] = -700.0;
        let mut m = 0;
        f32_amax(&v, &mut m);
        assert_eq!(f32::from_bits(m), 700.0);
        v[3] = f32::NAN;
        let mut m = 0;
        f32_amax(&v, &mut m);
        assert!(m >= 0x7f80_0000);
        let mut m = 0;
        f32_amax(&[], &mut m);
        assert_eq!(m, 0);
        let halves: Vec<u16> = [1.0f32, -3.5, 2.0, -0.0]
            .iter()
            .map(|&x| bf16::from_f32(x).to_bits())
            .collect();
        let mut h = 0;
        half_amax(&halves, &mut h);
        assert_eq!(bf16::from_bits(h).to_f32(), 3.5);
    }
}
