//! Bulk conversion between f32 and the 16-bit storage types.
//!
//! `half`'s conversions round to nearest, ties to even, and keep NaN a NaN;
//! we only add parallelism over large slices.

use half::{bf16, f16};
use rayon::prelude::*;

/// Below this many elements a single thread is faster than waking rayon.
const PAR_MIN: usize = 1 << 16;
const CHUNK: usize = 1 << 14;

fn par_map<S: Sync, D: Send>(src: &[S], dst: &mut [D], f: impl Fn(&S) -> D + Sync) {
    assert_eq!(src.len(), dst.len(), "conversion length mismatch");
    if src.len() < PAR_MIN {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = f(s));
    } else {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d = f(s)));
    }
}

pub fn f32_to_bf16_into(src: &[f32], dst: &mut [bf16]) {
    par_map(src, dst, |&x| bf16::from_f32(x));
}

pub fn bf16_to_f32_into(src: &[bf16], dst: &mut [f32]) {
    par_map(src, dst, |&x| x.to_f32());
}

pub fn f32_to_f16_into(src: &[f32], dst: &mut [f16]) {
    par_map(src, dst, |&x| f16::from_f32(x));
}

/// Largest finite f16 magnitude, 65504, as bits.
pub const F16_MAX_BITS: u16 = 0x7BFF;

/// Rounds `x` to the nearest f16 (ties to even) and returns its bits, like
/// `half::f16::from_f32`, except that a finite value beyond f16's range
/// saturates at ±65504 instead of becoming infinity: a transport copy of a
/// large master weight then carries a bounded error rather than an
/// infinity that would poison every product it enters. ±inf and NaN stay
/// what they are (quiet, high payload kept, as `half` does).
///
/// Written as selects over both rounding paths, without branches, so that
/// it vectorises inside the fused optimizer loop.
#[inline(always)]
pub fn f32_to_f16_sat_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = (b >> 16) & 0x8000;
    let a = b & 0x7FFF_FFFF;
    // Normal f16 result: rebias the exponent (127 -> 15) and round on the
    // 13 dropped bits; adding 0xFFF plus the lowest kept bit carries
    // exactly when rounding to nearest even goes up.
    let odd = (a >> 13) & 1;
    let normal = a.wrapping_sub(112 << 23).wrapping_add(0xFFF + odd) >> 13;
    // Subnormal result (|x| < 2^-14): adding 0.5 lines the f16 subnormal
    // grid up with the f32 mantissa's last bits, and the float addition
    // rounds to nearest even for us.
    let magic = f32::from_bits(126 << 23);
    let sub = (f32::from_bits(a) + magic).to_bits().wrapping_sub(126 << 23);
    let nan = 0x7E00 | ((a & 0x007F_FFFF) >> 13);
    let r = if a < 113 << 23 { sub } else { normal };
    // 65520 = 0x477FF000 is the first magnitude that rounds to infinity.
    let r = if a >= 0x477F_F000 { F16_MAX_BITS as u32 } else { r };
    let r = if a == 0x7F80_0000 { 0x7C00 } else { r };
    let r = if a > 0x7F80_0000 { nan } else { r };
    (r | sign) as u16
}

/// Bulk [`f32_to_f16_sat_bits`] (the f16 transport copy).
pub fn f32_to_f16_sat_into(src: &[f32], dst: &mut [f16]) {
    par_map(src, dst, |&x| f16::from_bits(f32_to_f16_sat_bits(x)));
}

pub fn f16_to_f32_into(src: &[f16], dst: &mut [f32]) {
    par_map(src, dst, |&x| x.to_f32());
}

pub fn f32_to_bf16(src: &[f32]) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; src.len()];
    f32_to_bf16_into(src, &mut out);
    out
}

pub fn bf16_to_f32(src: &[bf16]) -> Vec<f32> {
    let mut out = vec![0.0; src.len()];
    bf16_to_f32_into(src, &mut out);
    out
}

pub fn f32_to_f16(src: &[f32]) -> Vec<f16> {
    let mut out = vec![f16::ZERO; src.len()];
    f32_to_f16_into(src, &mut out);
    out
}

pub fn f16_to_f32(src: &[f16]) -> Vec<f32> {
    let mut out = vec![0.0; src.len()];
    f16_to_f32_into(src, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_to_nearest_even() {
        // 1 + 2^-8 lies exactly between two bf16 values (1 and 1 + 2^-7): ties go to even (1).
        let tie_down = 1.0f32 + 2f32.powi(-8);
        // 1 + 3*2^-8 lies between 1 + 2^-7 (odd mantissa) and 1 + 2^-6: ties go to 1 + 2^-6.
        let tie_up = 1.0f32 + 3.0 * 2f32.powi(-8);
        let src = vec![tie_down, tie_up, f32::NAN, f32::INFINITY, -0.0];
        let got = f32_to_bf16(&src);
        assert_eq!(got[0].to_f32(), 1.0);
        assert_eq!(got[1].to_f32(), 1.0 + 2f32.powi(-6));
        assert!(got[2].is_nan());
        assert_eq!(got[3].to_f32(), f32::INFINITY);
        assert_eq!(got[4].to_bits(), 0x8000);
    }

    fn check_sat(bits: u32) {
        let x = f32::from_bits(bits);
        let got = f32_to_f16_sat_bits(x);
        let want = if x.is_finite() && x.abs() >= 65520.0 {
            F16_MAX_BITS | if x < 0.0 { 0x8000 } else { 0 }
        } else {
            f16::from_f32(x).to_bits()
        };
        assert_eq!(got, want, "input bits {bits:#010x} ({x:e})");
    }

    #[test]
    fn f16_saturating_rounds_like_half_in_range() {
        // Ties and the edges of each path, exactly.
        let max_ok = 65504.0f32 + 15.99; // below the tie at 65520: rounds to 65504
        for x in [
            0.0f32,
            -0.0,
            1.0,
            1.0 + 2f32.powi(-11),       // tie, even below: 1
            1.0 + 3.0 * 2f32.powi(-11), // tie, odd below: up
            2f32.powi(-14),             // smallest normal f16
            2f32.powi(-14) * (1.0 - 2f32.powi(-11)),
            2f32.powi(-24),       // smallest subnormal
            2f32.powi(-25),       // tie with zero: rounds to 0
            2f32.powi(-25) * 1.5, // above the tie: smallest subnormal
            2f32.powi(-26),
            65504.0,
            max_ok,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
        ] {
            check_sat(x.to_bits());
            check_sat((-x).to_bits());
        }
        assert_eq!(f32_to_f16_sat_bits(max_ok), F16_MAX_BITS);
        // Every low half-pattern (rounding bits plus the lowest kept bit)
        // under every exponent where f16 results are normal or subnormal.
        for exp in 90u32..=145 {
            for high in [0u32, 0x55, 0x3FF] {
                for low in 0..1u32 << 14 {
                    let bits = (exp << 23) | (high << 13) | low;
                    check_sat(bits);
                    check_sat(bits | 0x8000_0000);
                }
            }
        }
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            check_sat(s as u32);
            check_sat((s >> 32) as u32);
        }
    }

    #[test]
    fn f16_saturating_clamps_finite_overflow_and_keeps_inf_and_nan() {
        for x in [65520.0f32, 65536.0, 1e6, f32::MAX] {
            assert_eq!(f16::from_f32(x), f16::INFINITY, "half overflows {x}");
            assert_eq!(f32_to_f16_sat_bits(x), F16_MAX_BITS, "{x}");
            assert_eq!(f32_to_f16_sat_bits(-x), F16_MAX_BITS | 0x8000, "{}", -x);
        }
        assert_eq!(f32_to_f16_sat_bits(f32::INFINITY), 0x7C00);
        assert_eq!(f32_to_f16_sat_bits(f32::NEG_INFINITY), 0xFC00);
        for bits in [0x7FC0_0000u32, 0x7F80_0001, 0xFFFF_FFFF, 0x7FBF_FFFF] {
            let h = f16::from_bits(f32_to_f16_sat_bits(f32::from_bits(bits)));
            assert!(h.is_nan(), "{bits:#010x}");
            check_sat(bits);
        }
        let src = [1.0f32, 70000.0, -1e9, 0.1];
        let mut dst = [f16::ZERO; 4];
        f32_to_f16_sat_into(&src, &mut dst);
        assert_eq!(
            dst.map(f16::to_f32),
            [1.0, 65504.0, -65504.0, f16::from_f32(0.1).to_f32()]
        );
    }

    #[test]
    fn parallel_path_matches_scalar() {
        let n = PAR_MIN * 3 + 17;
        let src: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let b = f32_to_bf16(&src);
        let h = f32_to_f16(&src);
        for i in 0..n {
            assert_eq!(b[i].to_bits(), bf16::from_f32(src[i]).to_bits());
            assert_eq!(h[i].to_bits(), f16::from_f32(src[i]).to_bits());
        }
        let back = bf16_to_f32(&b);
        assert!(back.iter().zip(&b).all(|(x, y)| *x == y.to_f32()));
        let back = f16_to_f32(&h);
        assert!(back.iter().zip(&h).all(|(x, y)| *x == y.to_f32()));
    }
}
