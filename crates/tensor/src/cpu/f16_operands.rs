//! The reference of [`ComputePrecision::F16`](crate::ComputePrecision):
//! matmul operands scaled by a power of two per tensor, rounded to f16, and
//! the f32 product unscaled. The GEMM itself is the f32 one, which is what
//! f16 tensor cores with f32 accumulation compute on the rounded operands
//! (up to summation order).

use rayon::prelude::*;

use crate::cpu::Real;
use crate::{f16_scale_exponent, round_f16_scaled};

/// One operand as the tensor cores see it: `round_f16(x · 2^-e)` in the
/// compute type, and `e`.
pub(crate) struct Scaled<F> {
    pub values: Vec<F>,
    pub exponent: i32,
}

/// Largest magnitude of `x`; NaN if any element is NaN, so that a
/// non-finite operand gets exponent 0 and its NaNs and infinities reach the
/// product as they would in f32.
fn max_abs<F: Real>(x: &[F]) -> f32 {
    x.par_iter()
        .map(|v| v.narrow_f32().abs())
        .reduce(|| 0.0, |a, b| if b > a || b.is_nan() { b } else { a })
}

/// Scales and rounds a whole tensor (every batch of it shares one
/// exponent: the scale is per tensor, not per product). For f64 compute
/// the values go through f32 first, exact for the f32 data every caller
/// gives it.
pub(crate) fn scale_round<F: Real>(x: &[F]) -> Scaled<F> {
    let exponent = f16_scale_exponent(max_abs(x));
    let values = x
        .par_iter()
        .map(|v| F::from_f32(round_f16_scaled(v.narrow_f32(), exponent)))
        .collect();
    Scaled { values, exponent }
}

/// Undoes the two operands' scales on a product: `y · 2^e`.
pub(crate) fn unscale<F: Real>(y: &mut [F], e: i32) {
    if e != 0 {
        y.par_iter_mut().for_each(|v| *v = v.mul_pow2(e));
    }
}

/// A tensor's values as an f16 attention operand carries them, at their own
/// magnitude: `round_f16(x · 2^-e) · 2^e`. The power-of-two scale commutes
/// with every f32 product, so an attention computed on these values equals
/// one on the scaled f16 values with the scales undone afterwards.
pub(crate) fn rounded<F: Real>(x: &[F]) -> Vec<F> {
    let s = scale_round(x);
    s.values.into_par_iter().map(|v| v.mul_pow2(s.exponent)).collect()
}
