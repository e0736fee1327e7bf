//! The four dtypes under test and correctly rounded conversions to float16 and bfloat16
//! (round to nearest, ties to even; subnormals, overflow to infinity and NaN included).
//!
//! float16 is IEEE 754 binary16, its raw bits; bfloat16 is the upper 16 bits of a
//! binary32.  Rust has neither type in std, so values of both are held as `f32`
//! (every float16 and bfloat16 value is exactly an `f32`) and put on the wire as bits.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F64,
    F32,
    F16,
    BF16,
}

impl Dtype {
    /// The spec's name (`case.scalars.dtype`).
    pub fn from_name(name: &str) -> Option<Dtype> {
        match name {
            "float64" => Some(Dtype::F64),
            "float32" => Some(Dtype::F32),
            "float16" => Some(Dtype::F16),
            "bfloat16" => Some(Dtype::BF16),
            _ => None,
        }
    }

    /// The safetensors code.
    pub fn code(self) -> &'static str {
        match self {
            Dtype::F64 => "F64",
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
        }
    }

    pub fn item_size(self) -> usize {
        match self {
            Dtype::F64 => 8,
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }
}

/// `x` rounded to a binary format with `man` explicit significand bits and `exp` exponent
/// bits (IEEE layout: sign, exponent, significand; subnormals, infinities, NaN): its bits.
/// One rounding from the exact f64 value, so it is correct from f64 and from f32 alike.
#[inline]
fn round_f64_to_bits(x: f64, man: u32, exp: u32) -> u32 {
    let bits = x.to_bits();
    let sign = ((bits >> 63) as u32) << (man + exp);
    let e = ((bits >> 52) & 0x7ff) as i32;
    let m = bits & ((1u64 << 52) - 1);
    let inf = ((1u32 << exp) - 1) << man;
    if e == 0x7ff {
        return if m != 0 { sign | inf | (1 << (man - 1)) } else { sign | inf }; // NaN (quiet) / inf
    }
    if e == 0 {
        return sign; // zero or an f64 subnormal (< 2^-1022): zero in any narrower format
    }
    let bias = (1i32 << (exp - 1)) - 1;
    let unbiased = e - 1023;
    if unbiased > bias {
        return sign | inf; // at least 2^(emax+1): overflows
    }
    let sig = m | (1u64 << 52); // 53 bits, the implicit one included
    // Shift so that one unit is the format's last place: the normal one, or for a
    // subnormal result the fixed 2^(1 - bias - man).
    let (shift, field) = if unbiased >= 1 - bias {
        (52 - man as i32, ((unbiased + bias) as u32) << man)
    } else {
        (52 - man as i32 + (1 - bias - unbiased), 0)
    };
    if shift > 53 {
        return sign; // below half the smallest subnormal
    }
    let shift = shift as u32;
    let mut keep = sig >> shift;
    let rem = sig & ((1u64 << shift) - 1);
    let half = 1u64 << (shift - 1);
    if rem > half || (rem == half && keep & 1 == 1) {
        keep += 1;
    }
    // For a normal: keep includes the implicit one (1 << man), which the exponent field
    // already counts; a carry out of the significand bumps the exponent (to inf at the top).
    // For a subnormal: keep is the significand, and a carry makes the smallest normal.
    let implicit = if field != 0 { 1u64 << man } else { 0 };
    sign | (field + (keep - implicit) as u32)
}

/// float16 bits of `x`, correctly rounded.
#[inline]
pub fn f16_bits(x: f64) -> u16 {
    round_f64_to_bits(x, 10, 5) as u16
}

/// bfloat16 bits of `x`, correctly rounded.
#[inline]
pub fn bf16_bits(x: f64) -> u16 {
    round_f64_to_bits(x, 7, 8) as u16
}

/// bfloat16 bits of an f32, correctly rounded (the fast path: same exponent range as f32).
#[inline]
pub fn bf16_bits_f32(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16; // quiet
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The float16 with bits `h`, as f32 (exact).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let e = ((h >> 10) & 0x1f) as u32;
    let m = (h & 0x3ff) as u32;
    if e == 0 {
        // zero or subnormal: m · 2^-24, exact in f32
        let magnitude = m as f32 * (1.0 / 16_777_216.0);
        if sign != 0 {
            -magnitude
        } else {
            magnitude
        }
    } else if e == 31 {
        f32::from_bits(sign | 0x7f80_0000 | (m << 13))
    } else {
        f32::from_bits(sign | ((e + 127 - 15) << 23) | (m << 13))
    }
}

/// The bfloat16 with bits `h`, as f32 (exact).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `x` rounded to float16, as f32.
#[inline]
pub fn round_f16(x: f32) -> f32 {
    f16_to_f32(f16_bits(x as f64))
}

/// `x` rounded to bfloat16, as f32.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    bf16_to_f32(bf16_bits_f32(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_known_values() {
        assert_eq!(f16_bits(1.0), 0x3c00);
        assert_eq!(f16_bits(-2.0), 0xc000);
        assert_eq!(f16_bits(65504.0), 0x7bff);
        assert_eq!(f16_bits(65520.0), 0x7c00); // ties to even: overflows
        assert_eq!(f16_bits(65519.99), 0x7bff);
        assert_eq!(f16_bits(2f64.powi(-24)), 0x0001);
        assert_eq!(f16_bits(2f64.powi(-25)), 0x0000); // tie, to even (zero)
        assert_eq!(f16_bits(2f64.powi(-25) * 1.0000001), 0x0001);
        assert_eq!(f16_bits(3.0 * 2f64.powi(-25)), 0x0002); // tie between 1 and 2: even
        assert_eq!(f16_bits(2f64.powi(-14) * (1.0 - 2f64.powi(-12))), 0x0400); // rounds up to the smallest normal
        assert_eq!(f16_bits(f64::INFINITY), 0x7c00);
        assert_eq!(f16_bits(f64::NAN) & 0x7e00, 0x7e00);
        assert_eq!(f16_bits(1.0 + 2f64.powi(-11)), 0x3c00); // tie, to even
        assert_eq!(f16_bits(1.0 + 3.0 * 2f64.powi(-11)), 0x3c02);
        assert_eq!(f16_bits(-0.0), 0x8000);
    }

    #[test]
    fn f16_roundtrip_every_value() {
        for h in 0..=0xffffu16 {
            let x = f16_to_f32(h);
            if x.is_nan() {
                assert!(f16_to_f32(f16_bits(x as f64)).is_nan());
            } else {
                assert_eq!(f16_bits(x as f64), h, "bits {h:#06x}");
            }
        }
    }

    #[test]
    fn bf16_paths_agree() {
        for h in 0..=0xffffu16 {
            let x = bf16_to_f32(h);
            if !x.is_nan() {
                assert_eq!(bf16_bits(x as f64), h);
                assert_eq!(bf16_bits_f32(x), h);
            }
        }
        let mut s = 0x1234_5678u32;
        for _ in 0..2_000_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let x = f32::from_bits(s);
            if !x.is_nan() {
                assert_eq!(bf16_bits(x as f64), bf16_bits_f32(x), "{x:e}");
            }
        }
        assert_eq!(bf16_bits(1.0), 0x3f80);
        assert_eq!(bf16_bits(f64::MAX), 0x7f80);
    }

    #[test]
    fn f16_from_f32_matches_midpoints() {
        // Every midpoint between consecutive positive float16 values rounds to the even one.
        for h in 0..0x7bffu16 {
            let lo = f16_to_f32(h) as f64;
            let hi = f16_to_f32(h + 1) as f64;
            let mid = (lo + hi) / 2.0;
            let even = if h % 2 == 0 { h } else { h + 1 };
            assert_eq!(f16_bits(mid), even);
            assert_eq!(f16_bits(mid * (1.0 + 1e-12)), h + 1);
            assert_eq!(f16_bits(mid * (1.0 - 1e-12)), h);
        }
    }
}
