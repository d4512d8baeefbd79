//! f32 → bf16 rounding written without branches so that it vectorises
//! inside the fused loop. Bit for bit the same as `half::bf16::from_f32`:
//! round to nearest, ties to even; a NaN stays a NaN (quiet bit forced on,
//! sign and high payload kept); overflow rounds to infinity.

/// Rounds `x` to the nearest bf16 and returns its bits.
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    // Adding 0x7FFF plus the lowest kept bit carries into the kept half
    // exactly when the dropped half is above one half, or equal to it with
    // an odd kept half: round to nearest, ties to even. Finite values at
    // the top of the range carry into the exponent and become infinity,
    // which is the correctly rounded result.
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1))) >> 16;
    // Rounding a NaN by the rule above could carry its payload into the
    // sign bit or clear it to infinity, so NaNs take half's path instead.
    let quiet_nan = (b >> 16) | 0x0040;
    let is_nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

/// Bulk form of [`f32_to_bf16_bits`], for callers that convert outside the
/// optimizer pass.
pub fn f32_to_bf16_slice(src: &[f32], dst: &mut [half::bf16]) -> crate::Result<()> {
    if src.len() != dst.len() {
        return Err(crate::AdamWError::LengthMismatch {
            what: "bf16 destination",
            expected: src.len(),
            got: dst.len(),
        });
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::bf16::from_bits(f32_to_bf16_bits(s));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn check(bits: u32) {
        let x = f32::from_bits(bits);
        assert_eq!(
            f32_to_bf16_bits(x),
            bf16::from_f32(x).to_bits(),
            "input bits {bits:#010x} ({x:e})"
        );
    }

    #[test]
    fn special_values_match_half() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
            f32::EPSILON,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            1.0 + 2f32.powi(-8),       // tie, even below
            1.0 + 3.0 * 2f32.powi(-8), // tie, odd below: rounds up
            f32::from_bits(1),         // smallest subnormal
            f32::from_bits(0x0000_8000),
            f32::from_bits(0x0001_8000),
        ];
        for x in specials {
            check(x.to_bits());
        }
        // NaN payloads whose naive rounding would carry into the sign or
        // exponent, signalling NaNs, and the largest finite values.
        for bits in [
            0x7F80_0001u32,
            0x7FBF_FFFF,
            0x7FFF_FFFF,
            0xFFFF_FFFF,
            0xFF80_0001,
            0x7FC0_0000,
            0x7F7F_FFFF,
            0x7F7F_7FFF,
            0x7F7F_8000,
            0x7F7F_8001,
            0x807F_8000,
            0x3F80_8000,
            0x3F81_8000,
        ] {
            check(bits);
        }
    }

    #[test]
    fn every_rounding_case_of_the_low_half_matches_half() {
        // The rounding only looks at bit 16 and the low 16 bits: sweep all
        // low halves under a few high halves (even, odd, max finite, inf, nan).
        for high in [0x3F80u32, 0x3F81, 0x7F7F, 0x7F80, 0x7FC0, 0xFF7F, 0x0000, 0x8001] {
            for low in 0..=0xFFFFu32 {
                check((high << 16) | low);
            }
        }
    }

    #[test]
    fn random_bit_patterns_match_half() {
        // xorshift: deterministic, no dependency, covers all exponents.
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2_000_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            check(s as u32);
            check((s >> 32) as u32);
        }
    }

    #[test]
    fn slice_form_checks_lengths() {
        let mut out = vec![bf16::ZERO; 2];
        assert!(f32_to_bf16_slice(&[1.0, 2.0, 3.0], &mut out).is_err());
        f32_to_bf16_slice(&[1.5, -2.0], &mut out).unwrap();
        assert_eq!(out, [bf16::from_f32(1.5), bf16::from_f32(-2.0)]);
    }
}
