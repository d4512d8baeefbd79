//! OpenAI's MXFP4 experts (the published gpt-oss checkpoints), widened to
//! f32 as transformers' `convert_moe_packed_tensors` widens them.
//!
//! A `[E, C, R]` parameter (GPT-OSS's `x @ w` layout: `gate_up_proj` is
//! `[E, hidden, 2·F]`) is stored transposed, `[E, R, C]`, in blocks of 32
//! along C: `<name>_blocks` (u8, `[E, R, C/32, 16]`, two 4-bit values a
//! byte, the low nibble first) and `<name>_scales` (u8, `[E, R, C/32]`, a
//! power of two biased by 127). A value is `FP4[nibble] · 2^(scale − 127)`,
//! FP4 the e2m1 table below; every such value is exact in f32, as in the
//! bf16 transformers widens to by default.

/// The e2m1 values of the 16 nibbles (sign in the high bit).
const FP4: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Values a block covers.
pub(crate) const BLOCK: usize = 32;

/// Widens `[experts, rows, cols]` stored values into `out`, laid out
/// `[experts, cols, rows]`. `blocks` holds `experts · rows · cols / 2`
/// bytes and `scales` `experts · rows · cols / 32`; the caller checks the
/// shapes (`cols` a multiple of 32).
pub(crate) fn widen_into(blocks: &[u8], scales: &[u8], [experts, rows, cols]: [usize; 3], out: &mut [f32]) {
    debug_assert!(cols.is_multiple_of(BLOCK));
    debug_assert_eq!(blocks.len(), experts * rows * cols / 2);
    debug_assert_eq!(scales.len(), experts * rows * cols / BLOCK);
    debug_assert_eq!(out.len(), experts * rows * cols);
    let per = rows * cols;
    for e in 0..experts {
        let (bytes, out) = (&blocks[e * per / 2..], &mut out[e * per..(e + 1) * per]);
        for r in 0..rows {
            for g in 0..cols / BLOCK {
                let s = scales[(e * rows + r) * (cols / BLOCK) + g];
                // Through f64: 2^128 is past f32, yet 0 · 2^128 must be 0.
                let factor = 2f64.powi(s as i32 - 127);
                let start = (r * cols + g * BLOCK) / 2;
                for (j, &b) in bytes[start..start + BLOCK / 2].iter().enumerate() {
                    let c = g * BLOCK + 2 * j;
                    for (k, nibble) in [b & 0x0f, b >> 4].into_iter().enumerate() {
                        out[(c + k) * rows + r] = (FP4[nibble as usize] as f64 * factor) as f32;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One expert, two rows of 32: the nibbles' order, the scale's bias,
    /// the transposed layout, and the extremes of the scale.
    #[test]
    fn widens_nibbles_low_first_into_the_transposed_layout() {
        let mut blocks = vec![0u8; 32];
        blocks[0] = 0x21; // row 0: values 0.5 (low) then 1.0
        blocks[16] = 0xf9; // row 1: −0.5 then −6
        blocks[31] = 0x07; // row 1, last pair: 6 then 0
        let scales = [128u8, 125]; // ×2 and ×1/4
        let mut out = vec![f32::NAN; 64];
        widen_into(&blocks, &scales, [1, 2, 32], &mut out);
        // out[c][r]
        assert_eq!(out[0], 1.0);
        assert_eq!(out[2], 2.0);
        assert_eq!(out[1], -0.125);
        assert_eq!(out[3], -1.5);
        assert_eq!(out[30 * 2 + 1], 1.5);
        assert_eq!(out[31 * 2 + 1], 0.0);
        assert_eq!(out[4], 0.0);
        let mut big = vec![0.0f32; 32];
        widen_into(&[0x07; 16], &[255], [1, 1, 32], &mut big);
        assert_eq!(
            (big[0], big[1]),
            (f32::INFINITY, 0.0),
            "6 · 2^128 overflows, 0 stays 0"
        );
        widen_into(&[0x01; 16], &[0], [1, 1, 32], &mut big);
        assert_eq!(big[0], 2f32.powi(-128), "a subnormal, exact");
    }
}
