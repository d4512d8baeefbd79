//! RMSNorm and LayerNorm over the last dimension, forward and exact backward.
//! Rows are independent; weight gradients are summed over fixed blocks of
//! rows, then the block partials in order, so that the rounding depends on
//! the shape alone and never on rayon's work stealing (exact resume and
//! run-to-run reproducibility rely on it).

use rayon::prelude::*;

use crate::cpu::Real;

fn mean<F: Real>(xs: impl Iterator<Item = F>, n: usize) -> F {
    xs.fold(F::zero(), |a, x| a + x) / F::from_f64(n as f64)
}

fn add_into<F: Real>(mut a: Vec<F>, b: Vec<F>) -> Vec<F> {
    a.iter_mut().zip(b).for_each(|(a, b)| *a = *a + b);
    a
}

const ROWS_PER_BLOCK: usize = 64;

/// Σ over rows of `row(r, acc)`'s contributions into a `width`-vector, in a
/// fixed association: blocks of `ROWS_PER_BLOCK` rows in parallel, then the
/// blocks' partial sums in order.
fn ordered_row_sum<F: Real>(rows: usize, width: usize, row: impl Fn(usize, &mut [F]) + Sync) -> Vec<F> {
    let partials: Vec<Vec<F>> = (0..rows.div_ceil(ROWS_PER_BLOCK))
        .into_par_iter()
        .map(|b| {
            let mut acc = vec![F::zero(); width];
            for r in b * ROWS_PER_BLOCK..((b + 1) * ROWS_PER_BLOCK).min(rows) {
                row(r, &mut acc);
            }
            acc
        })
        .collect();
    partials.into_iter().fold(vec![F::zero(); width], add_into)
}

/// `y = x · rstd · w` for one row; returns `rstd`.
fn rms_row<F: Real>(xr: &[F], w: &[F], eps: F, yr: &mut [F]) -> F {
    let r = (mean(xr.iter().map(|&v| v * v), w.len()) + eps).sqrt().recip();
    for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
        *y = x * r * w;
    }
    r
}

/// `h = x + r` for one row.
fn add_row<F: Real>(xr: &[F], rr: &[F], hr: &mut [F]) {
    for ((h, &x), &r) in hr.iter_mut().zip(xr).zip(rr) {
        *h = x + r;
    }
}

/// Returns `(y, rstd)`: `y = x · rstd · w`, `rstd = 1 / sqrt(mean(x²) + eps)`
/// per row of length `w.len()` (which must be nonzero).
pub fn rmsnorm<F: Real>(x: &[F], w: &[F], eps: F) -> (Vec<F>, Vec<F>) {
    let c = w.len();
    assert!(c > 0 && x.len().is_multiple_of(c), "rmsnorm: x length");
    let mut y = vec![F::zero(); x.len()];
    let mut rstd = vec![F::zero(); x.len() / c];
    y.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .zip(rstd.par_iter_mut())
        .for_each(|((yr, xr), r)| *r = rms_row(xr, w, eps, yr));
    (y, rstd)
}

/// Returns `(h, y, rstd)`: the residual `h = x + r`, then [`rmsnorm`] of `h`,
/// in one pass over each row (the same roundings as the two ops apart).
pub fn add_rmsnorm<F: Real>(x: &[F], r: &[F], w: &[F], eps: F) -> (Vec<F>, Vec<F>, Vec<F>) {
    let c = w.len();
    assert!(
        c > 0 && x.len().is_multiple_of(c) && r.len() == x.len(),
        "add_rmsnorm: lengths"
    );
    let mut h = vec![F::zero(); x.len()];
    let mut y = vec![F::zero(); x.len()];
    let mut rstd = vec![F::zero(); x.len() / c];
    h.par_chunks_mut(c)
        .zip(y.par_chunks_mut(c))
        .zip(x.par_chunks(c).zip(r.par_chunks(c)))
        .zip(rstd.par_iter_mut())
        .for_each(|(((hr, yr), (xr, rr)), s)| {
            add_row(xr, rr, hr);
            *s = rms_row(hr, w, eps, yr);
        });
    (h, y, rstd)
}

/// Returns `(dx, dw)` of [`rmsnorm`].
pub fn rmsnorm_backward<F: Real>(x: &[F], w: &[F], rstd: &[F], dy: &[F]) -> (Vec<F>, Vec<F>) {
    rmsnorm_backward_impl(x, w, rstd, dy, None)
}

/// Returns `(dx, dw)` of [`rmsnorm`] with the residual stream's gradient
/// `dh` added to `dx` in the same pass: the backward of [`add_rmsnorm`],
/// where `dx` is the gradient of both `x` and `r` (`h` is passed as `x`).
pub fn add_rmsnorm_backward<F: Real>(h: &[F], w: &[F], rstd: &[F], dy: &[F], dh: &[F]) -> (Vec<F>, Vec<F>) {
    assert_eq!(dh.len(), h.len(), "add_rmsnorm_backward: dh length");
    rmsnorm_backward_impl(h, w, rstd, dy, Some(dh))
}

fn rmsnorm_backward_impl<F: Real>(
    x: &[F],
    w: &[F],
    rstd: &[F],
    dy: &[F],
    dh: Option<&[F]>,
) -> (Vec<F>, Vec<F>) {
    let c = w.len();
    assert!(
        c > 0 && x.len() == rstd.len() * c && dy.len() == x.len(),
        "rmsnorm_backward: lengths"
    );
    let mut dx = vec![F::zero(); x.len()];
    dx.par_chunks_mut(c)
        .enumerate()
        .zip(x.par_chunks(c))
        .zip(dy.par_chunks(c))
        .zip(rstd.par_iter())
        .for_each(|((((row, dxr), xr), dyr), &r)| {
            // dx = r·w·dy − x · r³ · mean(dy·w·x) (+ dh)
            let m = mean(xr.iter().zip(dyr).zip(w).map(|((&x, &g), &w)| g * w * x), c);
            let r3m = r * r * r * m;
            for (i, dx) in dxr.iter_mut().enumerate() {
                *dx = r * w[i] * dyr[i] - xr[i] * r3m;
            }
            if let Some(dh) = dh {
                for (dx, &d) in dxr.iter_mut().zip(&dh[row * c..][..c]) {
                    *dx = *dx + d;
                }
            }
        });
    let dw = ordered_row_sum(rstd.len(), c, |row, dw: &mut [F]| {
        let (xr, dyr, r) = (&x[row * c..][..c], &dy[row * c..][..c], rstd[row]);
        for i in 0..c {
            dw[i] = dw[i] + dyr[i] * xr[i] * r;
        }
    });
    (dx, dw)
}

/// `y = (x − mean) · rstd · w + b` for one row; returns `(mean, rstd)`.
fn ln_row<F: Real>(xr: &[F], w: &[F], b: &[F], eps: F, yr: &mut [F]) -> (F, F) {
    let c = w.len();
    let mu = mean(xr.iter().copied(), c);
    let var = mean(xr.iter().map(|&v| (v - mu) * (v - mu)), c);
    let r = (var + eps).sqrt().recip();
    for (i, y) in yr.iter_mut().enumerate() {
        *y = (xr[i] - mu) * r * w[i] + b[i];
    }
    (mu, r)
}

/// Returns `(y, mean, rstd)`: `y = (x − mean) · rstd · w + b` per row, with
/// the biased variance, `rstd = 1 / sqrt(var + eps)`.
pub fn layernorm<F: Real>(x: &[F], w: &[F], b: &[F], eps: F) -> (Vec<F>, Vec<F>, Vec<F>) {
    let c = w.len();
    assert!(
        c > 0 && x.len().is_multiple_of(c) && b.len() == c,
        "layernorm: lengths"
    );
    let rows = x.len() / c;
    let mut y = vec![F::zero(); x.len()];
    let mut stats = vec![(F::zero(), F::zero()); rows];
    y.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .zip(stats.par_iter_mut())
        .for_each(|((yr, xr), st)| *st = ln_row(xr, w, b, eps, yr));
    let (mean, rstd) = stats.into_iter().unzip();
    (y, mean, rstd)
}

/// Returns `(h, y, mean, rstd)`: the residual `h = x + r`, then
/// [`layernorm`] of `h`, in one pass over each row.
pub fn add_layernorm<F: Real>(x: &[F], r: &[F], w: &[F], b: &[F], eps: F) -> [Vec<F>; 4] {
    let c = w.len();
    assert!(
        c > 0 && x.len().is_multiple_of(c) && b.len() == c && r.len() == x.len(),
        "add_layernorm: lengths"
    );
    let rows = x.len() / c;
    let mut h = vec![F::zero(); x.len()];
    let mut y = vec![F::zero(); x.len()];
    let mut stats = vec![(F::zero(), F::zero()); rows];
    h.par_chunks_mut(c)
        .zip(y.par_chunks_mut(c))
        .zip(x.par_chunks(c).zip(r.par_chunks(c)))
        .zip(stats.par_iter_mut())
        .for_each(|(((hr, yr), (xr, rr)), st)| {
            add_row(xr, rr, hr);
            *st = ln_row(hr, w, b, eps, yr);
        });
    let (mean, rstd) = stats.into_iter().unzip();
    [h, y, mean, rstd]
}

/// Returns `(dx, dw, db)` of [`layernorm`].
pub fn layernorm_backward<F: Real>(
    x: &[F],
    w: &[F],
    mean_: &[F],
    rstd: &[F],
    dy: &[F],
) -> (Vec<F>, Vec<F>, Vec<F>) {
    layernorm_backward_impl(x, w, mean_, rstd, dy, None)
}

/// Returns `(dx, dw, db)` of [`layernorm`] with the residual stream's
/// gradient `dh` added to `dx` in the same pass (see [`add_rmsnorm_backward`]).
pub fn add_layernorm_backward<F: Real>(
    h: &[F],
    w: &[F],
    mean_: &[F],
    rstd: &[F],
    dy: &[F],
    dh: &[F],
) -> (Vec<F>, Vec<F>, Vec<F>) {
    assert_eq!(dh.len(), h.len(), "add_layernorm_backward: dh length");
    layernorm_backward_impl(h, w, mean_, rstd, dy, Some(dh))
}

fn layernorm_backward_impl<F: Real>(
    x: &[F],
    w: &[F],
    mean_: &[F],
    rstd: &[F],
    dy: &[F],
    dh: Option<&[F]>,
) -> (Vec<F>, Vec<F>, Vec<F>) {
    let c = w.len();
    let rows = rstd.len();
    assert!(
        c > 0 && x.len() == rows * c && mean_.len() == rows && dy.len() == x.len(),
        "layernorm_backward: lengths"
    );
    let mut dx = vec![F::zero(); x.len()];
    dx.par_chunks_mut(c)
        .enumerate()
        .zip(x.par_chunks(c))
        .zip(dy.par_chunks(c))
        .zip(mean_.par_iter().zip(rstd.par_iter()))
        .for_each(|((((row, dxr), xr), dyr), (&mu, &r))| {
            // dx = r · (g − mean(g) − x̂ · mean(g · x̂)) with g = dy · w (+ dh).
            let xhat = |i: usize| (xr[i] - mu) * r;
            let mg = mean((0..c).map(|i| dyr[i] * w[i]), c);
            let mgx = mean((0..c).map(|i| dyr[i] * w[i] * xhat(i)), c);
            for (i, dx) in dxr.iter_mut().enumerate() {
                *dx = r * (dyr[i] * w[i] - mg - xhat(i) * mgx);
            }
            if let Some(dh) = dh {
                for (dx, &d) in dxr.iter_mut().zip(&dh[row * c..][..c]) {
                    *dx = *dx + d;
                }
            }
        });
    // One pass for both: dw in [..c], db in [c..].
    let mut both = ordered_row_sum(rows, 2 * c, |row, acc: &mut [F]| {
        let (xr, dyr) = (&x[row * c..][..c], &dy[row * c..][..c]);
        let (mu, r) = (mean_[row], rstd[row]);
        for i in 0..c {
            acc[i] = acc[i] + dyr[i] * (xr[i] - mu) * r;
            acc[c + i] = acc[c + i] + dyr[i];
        }
    });
    let db = both.split_off(c);
    let dw = both;
    (dx, dw, db)
}
