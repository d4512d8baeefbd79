//! GPT-OSS's attention sinks: a learned logit per query head joins every
//! row's softmax without a value vector, which rescales the plain
//! attention's row by `σ(lse − sink)`, the share of the probability the
//! keys keep.

use rayon::prelude::*;

use crate::cpu::Real;

/// `σ(x) = 1 / (1 + e^−x)`.
fn sigmoid<F: Real>(x: F) -> F {
    (F::one() + (-x).exp()).recip()
}

/// The sink's row `r` of `out: [b, t, hq, d]` (rows in that order) reads
/// `lse: [b, hq, t]` at this index.
fn lse_index(r: usize, t: usize, hq: usize) -> usize {
    let (bt, h) = (r / hq, r % hq);
    ((bt / t) * hq + h) * t + bt % t
}

/// Each row of `x: [b, t, hq, d]` times its `σ(lse − sinks[h])`: the sink
/// attention's output from the plain one's, and the gradient the plain
/// attention's backward takes from the sink attention's.
fn scale_rows<F: Real>(x: &[F], lse: &[F], sinks: &[F], [b, t, hq, d]: [usize; 4]) -> Vec<F> {
    assert_eq!(x.len(), b * t * hq * d, "attention_sinks: out length");
    assert_eq!(lse.len(), b * hq * t, "attention_sinks: lse length");
    assert_eq!(sinks.len(), hq, "attention_sinks: sinks length");
    let mut y = x.to_vec();
    if d > 0 {
        y.par_chunks_mut(d).enumerate().for_each(|(r, row)| {
            let s = sigmoid(lse[lse_index(r, t, hq)] - sinks[r % hq]);
            row.iter_mut().for_each(|v| *v = *v * s);
        });
    }
    y
}

/// `O_s = O · σ(lse − sink)`, row by row, of `out: [b, t, hq, d]`.
pub fn attention_sinks<F: Real>(out: &[F], lse: &[F], sinks: &[F], dims: [usize; 4]) -> Vec<F> {
    scale_rows(out, lse, sinks, dims)
}

/// `(σ · dout, dsinks)` of [`attention_sinks`] from its output `out`:
/// `dsinks[h] = −Σ_{b,t} (dout · out)(1 − σ)`, summed over the rows in
/// order. `1 − σ` is taken as `σ(sink − lse)`, which keeps its digits
/// where σ is near 1 (a sink far below the row's scores).
pub fn attention_sinks_backward<F: Real>(
    out: &[F],
    lse: &[F],
    sinks: &[F],
    dout: &[F],
    dims: [usize; 4],
) -> (Vec<F>, Vec<F>) {
    let [_, t, hq, d] = dims;
    assert_eq!(dout.len(), out.len(), "attention_sinks_backward: dout length");
    let dx = scale_rows(dout, lse, sinks, dims);
    let rows = out.len().checked_div(d).unwrap_or(0);
    let terms: Vec<F> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let (o, g) = (&out[r * d..(r + 1) * d], &dout[r * d..(r + 1) * d]);
            let dot = o.iter().zip(g).fold(F::zero(), |s, (&x, &y)| s + x * y);
            -dot * sigmoid(sinks[r % hq] - lse[lse_index(r, t, hq)])
        })
        .collect();
    let mut dsinks = vec![F::zero(); hq];
    for (r, &v) in terms.iter().enumerate() {
        dsinks[r % hq] = dsinks[r % hq] + v;
    }
    (dx, dsinks)
}
