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
