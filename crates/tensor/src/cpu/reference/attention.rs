//! Causal grouped-query attention, optionally within a sliding window. The
//! forward keeps only the log-sum-exp of each query row; the backward
//! recomputes probabilities from it, one row at a time, so no T×T matrix
//! ever exists.

use rayon::prelude::*;

use super::activation::{capped, capped_slope};
use crate::AttnMask;
use crate::cpu::Real;

/// `q: [b, t, hq, d]`, `k, v: [b, t, hkv, d]`, `hq` a multiple of `hkv`;
/// query `i` of row `b` sees keys `mask.first_key(b, i) ..= i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttnDims {
    pub b: usize,
    pub t: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub mask: AttnMask,
}

impl AttnDims {
    fn check(&self, q: usize, kv: usize) {
        assert!(
            self.hkv > 0 && self.hq.is_multiple_of(self.hkv),
            "attention: hq must be a multiple of hkv"
        );
        assert_eq!(q, self.b * self.t * self.hq * self.d, "attention: q length");
        assert_eq!(kv, self.b * self.t * self.hkv * self.d, "attention: k/v length");
    }

    fn scale<F: Real>(&self) -> F {
        F::from_f64(1.0 / (self.d as f64).sqrt())
    }
}

/// A scaled score as the softmax sees it (soft-capped where the mask says),
/// and the derivative of that with respect to the scaled score.
#[derive(Clone, Copy)]
struct Scores<F> {
    cap: Option<F>,
}

impl<F: Real> Scores<F> {
    fn of(mask: &AttnMask) -> Scores<F> {
        Scores {
            cap: mask.softcap.map(|c| F::from_f64(c.get() as f64)),
        }
    }

    fn shape(self, s: F) -> F {
        self.cap.map_or(s, |c| capped(s, c))
    }

    /// d shape(s) / ds at `y = shape(s)`.
    fn slope(self, y: F) -> F {
        self.cap.map_or(F::one(), |c| capped_slope(y, c))
    }
}

fn dot<F: Real>(a: &[F], b: &[F]) -> F {
    a.iter().zip(b).fold(F::zero(), |s, (&x, &y)| s + x * y)
}

/// Returns `(out [b, t, hq, d], lse [b, hq, t])` of causal
/// `softmax(q kᵀ / sqrt(d)) v` (the scores soft-capped where `mask` says);
/// query head `h` reads kv head `h / (hq / hkv)`.
pub fn attention<F: Real>(q: &[F], k: &[F], v: &[F], dm: &AttnDims) -> (Vec<F>, Vec<F>) {
    dm.check(q.len(), k.len());
    attention_cached(q, k, v, dm, dm.t, dm.t)
}

/// [`attention`] of queries that are the last `dm.t` of `len` positions
/// (generation with a cache of keys and values): `k, v: [b, tk, hkv, d]`,
/// of which the first `len` positions are read (`dm.t ≤ len ≤ tk`); query
/// `i` sits at position `len − dm.t + i` and sees keys
/// `mask.first_key(b, position) ..= position`.
pub fn attention_cached<F: Real>(
    q: &[F],
    k: &[F],
    v: &[F],
    dm: &AttnDims,
    tk: usize,
    len: usize,
) -> (Vec<F>, Vec<F>) {
    let &AttnDims {
        b,
        t,
        hq,
        hkv,
        d,
        ref mask,
    } = dm;
    assert!(
        hkv > 0 && hq.is_multiple_of(hkv),
        "attention: hq must be a multiple of hkv"
    );
    assert!(
        t <= len && len <= tk,
        "attention: {t} queries of {len} positions in {tk}"
    );
    assert_eq!(q.len(), b * t * hq * d, "attention: q length");
    assert_eq!(k.len(), b * tk * hkv * d, "attention: k length");
    assert_eq!(v.len(), k.len(), "attention: v length");
    let group = hq / hkv;
    let scale: F = dm.scale();
    let scores = Scores::<F>::of(mask);
    let drop = dropped(mask, hq, t);
    let first = len - t;
    let qi = |bi: usize, ti: usize, h: usize| ((bi * t + ti) * hq + h) * d;
    let ki = |bi: usize, tj: usize, g: usize| ((bi * tk + tj) * hkv + g) * d;

    let heads: Vec<(Vec<F>, Vec<F>)> = (0..b * hq)
        .into_par_iter()
        .map(|bh| {
            let (bi, h) = (bh / hq, bh % hq);
            let g = h / group;
            let mut out = vec![F::zero(); t * d];
            let mut lse = vec![F::zero(); t];
            let mut p = vec![F::zero(); len];
            for ti in 0..t {
                let pos = first + ti;
                let qr = &q[qi(bi, ti, h)..][..d];
                let j0 = mask.first_key(bi, pos);
                let p = &mut p[j0..=pos];
                for (j, s) in (j0..).zip(p.iter_mut()) {
                    *s = scores.shape(dot(qr, &k[ki(bi, j, g)..][..d]) * scale);
                }
                let mx = p.iter().fold(F::neg_infinity(), |m, &s| m.max(s));
                p.iter_mut().for_each(|s| *s = (*s - mx).exp());
                let l: F = p.iter().copied().sum();
                let o = &mut out[ti * d..(ti + 1) * d];
                for (j, &pj) in (j0..).zip(p.iter()) {
                    let w = pj / l * drop(bi, h, pos, j);
                    o.iter_mut()
                        .zip(&v[ki(bi, j, g)..][..d])
                        .for_each(|(o, &vv)| *o = *o + w * vv);
                }
                lse[ti] = mx + l.ln();
            }
            (out, lse)
        })
        .collect();

    let mut out = vec![F::zero(); q.len()];
    let mut lse = Vec::with_capacity(b * hq * t);
    for (bh, (o, l)) in heads.into_iter().enumerate() {
        let (bi, h) = (bh / hq, bh % hq);
        for ti in 0..t {
            out[qi(bi, ti, h)..][..d].copy_from_slice(&o[ti * d..(ti + 1) * d]);
        }
        lse.extend(l);
    }
    (out, lse)
}

/// The factor key `j`'s weight in query row `i` of head `h` of batch row
/// `b` takes under the mask's dropout (`AttnMask::dropout`): 0 or
/// `1 / (1 − p)`, 1 without one.
fn dropped<F: Real>(
    mask: &AttnMask,
    hq: usize,
    t: usize,
) -> impl Fn(usize, usize, usize, usize) -> F + Sync + '_ {
    let scale = mask.dropout.map_or(F::one(), |d| F::from_f64(d.scale()));
    move |b, h, i, j| match &mask.dropout {
        None => F::one(),
        Some(d) if d.keeps(d.row(b, hq * t, h * t + i), j as u32) => scale,
        Some(_) => F::zero(),
    }
}

/// Returns `(dq, dk, dv)` of [`attention`] given its `out`, `lse` and `dout`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<F: Real>(
    q: &[F],
    k: &[F],
    v: &[F],
    out: &[F],
    lse: &[F],
    dout: &[F],
    dm: &AttnDims,
) -> (Vec<F>, Vec<F>, Vec<F>) {
    let &AttnDims {
        b,
        t,
        hq,
        hkv,
        d,
        ref mask,
    } = dm;
    dm.check(q.len(), k.len());
    assert!(
        v.len() == k.len() && out.len() == q.len() && dout.len() == q.len(),
        "attention_backward: lengths"
    );
    assert_eq!(lse.len(), b * hq * t, "attention_backward: lse length");
    let group = hq / hkv;
    let scale: F = dm.scale();
    let scores = Scores::<F>::of(mask);
    let drop = dropped(mask, hq, t);
    let qi = |bi: usize, ti: usize, h: usize| ((bi * t + ti) * hq + h) * d;
    let ki = |bi: usize, ti: usize, g: usize| ((bi * t + ti) * hkv + g) * d;

    // One task per (batch, kv head): it owns dk/dv of that head and dq of
    // the query heads that read it, so no two tasks write the same element.
    let blocks: Vec<(Vec<F>, Vec<F>, Vec<F>)> = (0..b * hkv)
        .into_par_iter()
        .map(|bg| {
            let (bi, g) = (bg / hkv, bg % hkv);
            let mut dq = vec![F::zero(); group * t * d];
            let mut dk = vec![F::zero(); t * d];
            let mut dv = vec![F::zero(); t * d];
            let mut p = vec![F::zero(); t];
            for hl in 0..group {
                let h = g * group + hl;
                for ti in 0..t {
                    let (qr, orow, gr) = (
                        &q[qi(bi, ti, h)..][..d],
                        &out[qi(bi, ti, h)..][..d],
                        &dout[qi(bi, ti, h)..][..d],
                    );
                    let l = lse[(bi * hq + h) * t + ti];
                    let delta = dot(gr, orow);
                    let dqr = &mut dq[(hl * t + ti) * d..][..d];
                    let j0 = mask.first_key(bi, ti);
                    for (j, pj) in (j0..).zip(p[j0..=ti].iter_mut()) {
                        let (kr, vr) = (&k[ki(bi, j, g)..][..d], &v[ki(bi, j, g)..][..d]);
                        let y = scores.shape(dot(qr, kr) * scale);
                        *pj = (y - l).exp();
                        // Dropout scales dP and the weights of dV; delta,
                        // rowsum(dO ∘ O), is already of the dropped weights.
                        let f = drop(bi, h, ti, j);
                        let ds = *pj * (dot(gr, vr) * f - delta) * scores.slope(y) * scale;
                        *pj = *pj * f;
                        dqr.iter_mut().zip(kr).for_each(|(a, &x)| *a = *a + ds * x);
                        let dkr = &mut dk[j * d..(j + 1) * d];
                        dkr.iter_mut().zip(qr).for_each(|(a, &x)| *a = *a + ds * x);
                        let dvr = &mut dv[j * d..(j + 1) * d];
                        dvr.iter_mut().zip(gr).for_each(|(a, &x)| *a = *a + *pj * x);
                    }
                }
            }
            (dq, dk, dv)
        })
        .collect();

    let mut dq = vec![F::zero(); q.len()];
    let mut dk = vec![F::zero(); k.len()];
    let mut dv = vec![F::zero(); v.len()];
    for (bg, (bq, bk, bv)) in blocks.into_iter().enumerate() {
        let (bi, g) = (bg / hkv, bg % hkv);
        for ti in 0..t {
            dk[ki(bi, ti, g)..][..d].copy_from_slice(&bk[ti * d..(ti + 1) * d]);
            dv[ki(bi, ti, g)..][..d].copy_from_slice(&bv[ti * d..(ti + 1) * d]);
            for hl in 0..group {
                dq[qi(bi, ti, g * group + hl)..][..d].copy_from_slice(&bq[(hl * t + ti) * d..][..d]);
            }
        }
    }
    (dq, dk, dv)
}
