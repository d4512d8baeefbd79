//! Rotary position embedding, Hugging Face `rotate_half` (half-split) layout
//! over the whole head dimension or its leading `rotary_dim` entries.

use rayon::prelude::*;

use crate::Rope;
use crate::cpu::Real;

/// `(cos, sin)` tables `[t, d/2]` of positions `rope.offset..+t` for `d`
/// rotated entries: the angle
/// of position p and pair i is p·f_i, f_i the scaled inverse frequency
/// ([`RopeScaling::inv_freq`](crate::RopeScaling::inv_freq); θ^(−2i/d)
/// unscaled), and both tables carry the scaling's attention factor.
/// Angles are formed in f64 whatever `F` is, so the f32 reference differs
/// from exact only by the final rounding (an f32 angle would lose ~1e-4 rad
/// at positions in the thousands). The GPU executor builds its device
/// tables with this too.
pub fn rope_tables<F: Real>(t: usize, d: usize, rope: &Rope) -> (Vec<F>, Vec<F>) {
    rope_tables_for(t, d, rope, rope.offset + t)
}

/// [`rope_tables`] with the frequencies of a call whose positions end
/// before `end` (LongRoPE's factors depend on it; a table built past a
/// call's positions must still hold that call's frequencies).
pub fn rope_tables_for<F: Real>(t: usize, d: usize, rope: &Rope, end: usize) -> (Vec<F>, Vec<F>) {
    let half = d / 2;
    let inv_freq = rope.scaling.inv_freq(rope.theta, d, end);
    let gain = rope.scaling.attention_factor();
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for ti in 0..t {
        let pos = (rope.offset + ti) as f64;
        for &f in &inv_freq {
            let (s, c) = (pos * f).sin_cos();
            cos.push(F::from_f64(gain * c));
            sin.push(F::from_f64(gain * s));
        }
    }
    (cos, sin)
}

/// Rotates `x: [b, t, h, d]` (`dims`), token `ti` of row `bi` at position
/// [`rope.position(bi, ti)`](Rope::position) (`offset + ti` where the rows
/// hold no packed documents; the frequencies are those of a row of `t`
/// either way, as for unpacked rows padded to `t`):
/// with `r` the rotated entries ([`Rope::rotated`]), for `i < r/2` and
/// pair `(a, b)` = `(i, i+r/2)` (or `(2i, 2i+1)`, [`Rope::interleaved`]),
/// `y[a] = x[a]·cos − x[b]·sin` and `y[b] = x[b]·cos + x[a]·sin`, and
/// `y[i] = x[i]` from `r` on. With `inverse` the angle is negated, which
/// is the backward: the map is a rotation times the scaling's attention
/// factor, so its transpose is the rotation back times the same factor
/// (and the identity on the entries passed through).
pub fn rope<F: Real>(x: &[F], dims: [usize; 4], rope: &Rope, inverse: bool) -> Vec<F> {
    let [b, t, h, d] = dims;
    let r = rope.rotated("rope", d).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(x.len(), b * t * h * d, "rope: x length");
    let mut y = vec![F::zero(); x.len()];
    if d == 0 {
        return y;
    }
    let half = r / 2;
    let (cos, sin) = rope_tables::<F>(t, r, rope);
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .enumerate()
        .for_each(|(row, (yr, xr))| {
            let (bi, ti) = (row / h / t, (row / h) % t);
            let p = rope.position(bi, ti) - rope.offset;
            let (c, s) = (&cos[p * half..(p + 1) * half], &sin[p * half..(p + 1) * half]);
            for i in 0..half {
                let s = if inverse { -s[i] } else { s[i] };
                let (a, b) = match rope.interleaved {
                    false => (i, i + half),
                    true => (2 * i, 2 * i + 1),
                };
                let (x1, x2) = (xr[a], xr[b]);
                yr[a] = x1 * c[i] - x2 * s;
                yr[b] = x2 * c[i] + x1 * s;
            }
            yr[r..].copy_from_slice(&xr[r..]);
        });
    y
}
