//! The gated delta net's short convolution: a depthwise causal conv1d of
//! K taps over each sequence, then SiLU (Qwen3-Next's and Qwen3.5's
//! `conv1d` without bias, HF's `F.silu(conv1d(x)[..., :T])`). With
//! documents packed in the rows a document is a sequence of its own: its
//! first token's taps before it read 0, as causal-conv1d's `seq_idx` has it.

use rayon::prelude::*;

use crate::Docs;
use crate::cpu::Real;

/// The span `[start, end)` of row `r`'s sequence (its document's, with
/// `docs`) within its batch row of `t`, and `r`'s position `ti` there.
fn span(docs: Option<&Docs>, t: usize, r: usize) -> (usize, usize, usize) {
    let (b, ti) = (r / t, r % t);
    match docs {
        Some(d) => (d.start(b, ti), d.end(b, ti), ti),
        None => (0, t, ti),
    }
}

fn sigmoid<F: Real>(x: F) -> F {
    (F::one() + (-x).exp()).recip()
}

/// The pre-activation of every element of `x: [b, t, c]`, taps in order
/// `i = 0..k` over positions `t − k + 1 + i`, the ones before a sequence's
/// start read as 0 (the left padding of K − 1 zeros).
fn pre<F: Real>(x: &[F], w: &[F], [b, t, c, k]: [usize; 4], docs: Option<&Docs>) -> Vec<F> {
    assert_eq!(x.len(), b * t * c, "causal_conv1d_silu: x length");
    assert_eq!(w.len(), c * k, "causal_conv1d_silu: w length");
    let mut y = vec![F::zero(); x.len()];
    if c == 0 {
        return y;
    }
    y.par_chunks_mut(c).enumerate().for_each(|(r, row)| {
        let (start, _, ti) = span(docs, t, r);
        for (ci, y) in row.iter_mut().enumerate() {
            let mut s = F::zero();
            for i in (k - 1).saturating_sub(ti - start)..k {
                s = s + w[ci * k + i] * x[(r + i + 1 - k) * c + ci];
            }
            *y = s;
        }
    });
    y
}

/// `silu(Σ_i w[c, i] · x[b, t − k + 1 + i, c])` for `x: [b, t, c]`,
/// `w: [c, k]`, within each row, or each of `docs`' documents.
pub fn causal_conv1d_silu<F: Real>(x: &[F], w: &[F], dims: [usize; 4], docs: Option<&Docs>) -> Vec<F> {
    let mut y = pre(x, w, dims, docs);
    y.par_iter_mut().for_each(|z| *z = *z * sigmoid(*z));
    y
}

/// `(dx, dw)` of [`causal_conv1d_silu`], the pre-activation recomputed:
/// with `d = dy · silu'(pre)`, `dx[b, s, c] = Σ_i w[c, i] · d[b, s + k − 1 − i, c]`
/// over the positions inside the sequence, and `dw[c, i]` the sum over
/// rows `(b, t)` in order of `d[b, t, c] · x[b, t − k + 1 + i, c]` where
/// that tap stays inside it.
pub fn causal_conv1d_silu_backward<F: Real>(
    x: &[F],
    w: &[F],
    dy: &[F],
    dims: [usize; 4],
    docs: Option<&Docs>,
) -> (Vec<F>, Vec<F>) {
    let [_, t, c, k] = dims;
    assert_eq!(dy.len(), x.len(), "causal_conv1d_silu_backward: dy length");
    let mut d = pre(x, w, dims, docs);
    d.par_iter_mut().zip(dy.par_iter()).for_each(|(z, &g)| {
        let s = sigmoid(*z);
        *z = g * s * (F::one() + *z * (F::one() - s));
    });
    let mut dx = vec![F::zero(); x.len()];
    if c == 0 {
        return (dx, vec![F::zero(); c * k]);
    }
    dx.par_chunks_mut(c).enumerate().for_each(|(r, row)| {
        let (_, end, ti) = span(docs, t, r);
        for (ci, dx) in row.iter_mut().enumerate() {
            let mut s = F::zero();
            for i in (k - 1).saturating_sub(end - 1 - ti)..k {
                s = s + w[ci * k + i] * d[(r + k - 1 - i) * c + ci];
            }
            *dx = s;
        }
    });
    let rows = x.len() / c;
    let dw: Vec<F> = (0..c * k)
        .into_par_iter()
        .map(|j| {
            let (ci, i) = (j / k, j % k);
            let mut s = F::zero();
            for r in 0..rows {
                let (start, _, ti) = span(docs, t, r);
                if ti - start + i + 1 >= k {
                    s = s + d[r * c + ci] * x[(r + i + 1 - k) * c + ci];
                }
            }
            s
        })
        .collect();
    (dx, dw)
}
