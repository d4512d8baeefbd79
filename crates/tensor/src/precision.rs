//! Compute precision of matmul operands (ARCHITECTURE.md, "Precision").
//!
//! `F16` defines one function on every executor: each operand X of a matmul
//! (forward and both backward products) is scaled by a power of two 2^-e_X
//! chosen from its largest magnitude, rounded to f16 (nearest, ties to
//! even), multiplied with f32 accumulation, and the f32 result multiplied by
//! 2^(e_A + e_B). Power-of-two scaling changes no mantissa bit, so it only
//! keeps each operand inside f16's range: no overflow to inf, and the most
//! room above f16's subnormals for small values. Per-tensor scaling is
//! chosen over dynamic loss scaling because the optimizer updates a layer
//! as soon as its gradients land: an overflow found in an earlier layer
//! later in the backward could no longer skip the step.
//!
//! Attention under `F16` (the reference every executor matches): Q, K and V
//! — and dO in the backward — are each scaled by their own power of two,
//! rounded to f16 and scaled back exactly as matmul operands are
//! (`round_f16(x · 2^-e) · 2^e`, e from the tensor's max|x|); everything
//! after that is the f32 attention: S = QKᵀ/√D, the softmax and its
//! log-sum-exp, O = PV, D = rowsum(dO ∘ O) and every backward product, all
//! in f32. `out` and `lse` handed to the backward are the forward's f32
//! results. The tensor-core kernels also round P (forward and backward,
//! P ≤ 1 so no scale) and dS (scaled by the power of two that bounds
//! |dS| ≤ 2·D·max|dO|·max|V|, so it cannot overflow) to f16 before their
//! products; the reference does not model those two roundings, whose
//! relative effect (≤ 2^-11 per element, averaging in the sums) the tests'
//! tolerance covers. The SIMT kernels compute the reference exactly (up to
//! summation order).

use half::f16;

/// Precision of matmul operands; accumulation is f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ComputePrecision {
    #[default]
    F32,
    /// Operands rounded to f16 after per-tensor power-of-two scaling.
    F16,
}

impl std::fmt::Display for ComputePrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ComputePrecision::F32 => "f32",
            ComputePrecision::F16 => "f16",
        })
    }
}

/// Largest magnitude an operand is scaled to lie under: 2^15, so that it
/// rounds to at most 2^15 in f16 (max 65504), with headroom.
pub const F16_OPERAND_BOUND_LOG2: i32 = 15;

/// The exponent e with which an operand whose largest magnitude is
/// `max_abs` is scaled (x · 2^-e) before rounding to f16: the scaled
/// maximum lies in [2^14, 2^15). 0 for an all-zero or non-finite operand
/// (non-finite values then propagate as they would in f32).
pub fn f16_scale_exponent(max_abs: f32) -> i32 {
    if max_abs == 0.0 || !max_abs.is_finite() {
        return 0;
    }
    // Exact floor(log2) for normal and subnormal f32.
    let e = if max_abs.is_normal() {
        ((max_abs.to_bits() >> 23) & 0xff) as i32 - 127
    } else {
        -127 - (max_abs.to_bits().leading_zeros() as i32 - 9)
    };
    e - (F16_OPERAND_BOUND_LOG2 - 1)
}

/// 2^e as an f32: exact for e in [-149, 127] (normal and subnormal powers
/// of two), infinity above and zero below.
pub fn pow2(e: i32) -> f32 {
    match e {
        128.. => f32::INFINITY,
        -126..=127 => f32::from_bits(((e + 127) as u32) << 23),
        -149..=-127 => f32::from_bits(1 << (e + 149)),
        _ => 0.0,
    }
}

/// x · 2^e, for any e the scaling can produce (operand exponents span
/// [-163, 113], and a product's unscaling adds two). A single factor 2^e is
/// not an f32 beyond ±127, so large |e| is applied in steps; each step is
/// exact unless the result leaves f32's normal range, which is where the
/// exact product would round anyway.
pub fn mul_pow2(mut x: f32, mut e: i32) -> f32 {
    while e > 127 {
        x *= pow2(127);
        e -= 127;
    }
    while e < -126 {
        x *= pow2(-126);
        e += 126;
    }
    x * pow2(e)
}

/// `f16(x · 2^-e)` widened back to f32: the value the tensor cores see.
pub fn round_f16_scaled(x: f32, e: i32) -> f32 {
    f16::from_f32(mul_pow2(x, -e)).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_max_lies_in_the_bound_for_any_magnitude() {
        for &m in &[
            1e-30f32, 1e-8, 3e-5, 0.1, 1.0, 1.5, 2.0, 1000.0, 65504.0, 1e20, 3e38,
        ] {
            let e = f16_scale_exponent(m);
            let s = m as f64 * 2f64.powi(-e);
            assert!((16384.0..32768.0).contains(&s), "max {m}: e {e}, scaled {s}");
            let r = round_f16_scaled(m, e);
            assert!(r.is_finite() && r > 0.0, "max {m} rounds to {r}");
        }
        let sub = f32::from_bits(5);
        let e = f16_scale_exponent(sub);
        let s = sub as f64 * 2f64.powi(-e);
        assert!((16384.0..32768.0).contains(&s), "subnormal: e {e}, scaled {s}");
        // 2^-e is not an f32 here (e = -161): the scaling must still be exact.
        assert_eq!(round_f16_scaled(sub, e) as f64, s);
        assert_eq!(round_f16_scaled(0.0, e), 0.0);
        assert_eq!(f16_scale_exponent(0.0), 0);
        assert_eq!(f16_scale_exponent(f32::INFINITY), 0);
        assert_eq!(f16_scale_exponent(f32::NAN), 0);
    }

    #[test]
    fn pow2_is_exact_over_the_whole_f32_range() {
        for e in -149..=127 {
            assert_eq!(pow2(e) as f64, 2f64.powi(e), "2^{e}");
        }
        assert_eq!(pow2(128), f32::INFINITY);
        assert_eq!(pow2(-150), 0.0);
        // Unscaling a product of two tiny operands: 2^(-150 + 140) = 2^-10.
        assert_eq!(mul_pow2(3.0, -150 + 140), 3.0 / 1024.0);
        assert_eq!(mul_pow2(2f32.powi(-120) * 1.25, 230), 1.25 * 2f32.powi(110));
        assert_eq!(mul_pow2(1.0, 300), f32::INFINITY);
        assert_eq!(mul_pow2(1.0, -300), 0.0);
    }

    #[test]
    fn scaling_keeps_f16_mantissa_rounding() {
        // A power-of-two scale changes no mantissa bit: rounding x·2^-e to
        // f16 and scaling back equals rounding x in a type with f16's
        // mantissa and f32's range.
        let x = 0.123_456_79_f32;
        let e = f16_scale_exponent(x);
        let back = round_f16_scaled(x, e) * pow2(e);
        assert!(((back - x) / x).abs() < 2f32.powi(-11), "{back} vs {x}");
        assert_ne!(back, x, "f16 rounding must be visible");
    }
}
