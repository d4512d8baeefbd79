//! Batched matmul through a real GEMM (`matrixmultiply`), with transposes
//! expressed as strides so no operand is ever copied.

use rayon::prelude::*;

use crate::cpu::Real;
use crate::{MatmulGrads, MatmulNeeds, Transpose};

/// Sizes of `batch` products `op(a)[m, k] · op(b)[k, n]`. When `b_batched` is
/// false one `b` is shared by every product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulDims {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub b_batched: bool,
}

impl MatmulDims {
    pub(crate) fn b_len(&self) -> usize {
        if self.b_batched {
            self.batch * self.k * self.n
        } else {
            self.k * self.n
        }
    }
}

pub(crate) type Strides = (usize, usize);

/// Strides of op(a) as an `[m, k]` matrix.
pub(crate) fn a_strides(d: &MatmulDims, t: Transpose) -> Strides {
    if t.a { (1, d.m) } else { (d.k, 1) }
}

/// Strides of op(b) as a `[k, n]` matrix.
pub(crate) fn b_strides(d: &MatmulDims, t: Transpose) -> Strides {
    if t.b { (1, d.k) } else { (d.n, 1) }
}

pub(crate) fn swap((r, c): Strides) -> Strides {
    (c, r)
}

/// One past the largest element offset a `rows × cols` strided view reads.
fn span(rows: usize, cols: usize, (rs, cs): Strides) -> usize {
    (rows - 1) * rs + (cols - 1) * cs + 1
}

/// `c = a · b + beta · c` on strided views, bounds-checked so that the
/// unsafe GEMM call can only touch memory inside the slices.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<F: Real>(
    m: usize,
    k: usize,
    n: usize,
    a: &[F],
    sa: Strides,
    b: &[F],
    sb: Strides,
    beta: F,
    c: &mut [F],
    sc: Strides,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(span(m, n, sc) <= c.len(), "gemm: c view out of bounds");
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                let x = &mut c[i * sc.0 + j * sc.1];
                *x = if beta == F::zero() { F::zero() } else { beta * *x };
            }
        }
        return;
    }
    assert!(span(m, k, sa) <= a.len(), "gemm: a view out of bounds");
    assert!(span(k, n, sb) <= b.len(), "gemm: b view out of bounds");
    // SAFETY: the three views were bounds-checked above; `c` is a unique borrow.
    unsafe {
        F::gemm(
            m,
            k,
            n,
            F::one(),
            a.as_ptr(),
            sa.0 as isize,
            sa.1 as isize,
            b.as_ptr(),
            sb.0 as isize,
            sb.1 as isize,
            beta,
            c.as_mut_ptr(),
            sc.0 as isize,
            sc.1 as isize,
        )
    }
}

/// `op(a) · op(b) + bias`, output `[batch, m, n]`. `a` holds `batch` blocks of
/// `[m, k]` (`[k, m]` when `t.a`), `b` one or `batch` blocks of `[k, n]`
/// (`[n, k]` when `t.b`), `bias` is `[n]`.
pub fn matmul<F: Real>(a: &[F], b: &[F], bias: Option<&[F]>, d: MatmulDims, t: Transpose) -> Vec<F> {
    let MatmulDims {
        batch,
        m,
        k,
        n,
        b_batched,
    } = d;
    assert_eq!(a.len(), batch * m * k, "matmul: a length");
    assert_eq!(b.len(), d.b_len(), "matmul: b length");
    let mut c = vec![F::zero(); batch * m * n];
    let (sa, sb) = (a_strides(&d, t), b_strides(&d, t));
    if !t.a && !b_batched {
        // Rows of every batch are contiguous: one large GEMM.
        gemm(batch * m, k, n, a, sa, b, sb, F::zero(), &mut c, (n, 1));
    } else {
        for i in 0..batch {
            let bi = if b_batched {
                &b[i * k * n..(i + 1) * k * n]
            } else {
                b
            };
            let ci = &mut c[i * m * n..(i + 1) * m * n];
            gemm(
                m,
                k,
                n,
                &a[i * m * k..(i + 1) * m * k],
                sa,
                bi,
                sb,
                F::zero(),
                ci,
                (n, 1),
            );
        }
    }
    if let Some(bias) = bias {
        add_bias(&mut c, bias);
    }
    c
}

/// Adds `bias: [n]` to every row of `c: [.., n]`.
pub fn add_bias<F: Real>(c: &mut [F], bias: &[F]) {
    let n = bias.len();
    assert_eq!(c.len() % n.max(1), 0, "add_bias: bias length");
    if n > 0 {
        c.par_chunks_mut(n)
            .for_each(|row| row.iter_mut().zip(bias).for_each(|(y, &b)| *y = *y + b));
    }
}

/// Sum of every `[n]` row of `dout`: the bias gradient.
pub fn bias_grad<F: Real>(dout: &[F], n: usize) -> Vec<F> {
    let mut s = vec![F::zero(); n];
    if n > 0 {
        for row in dout.chunks(n) {
            s.iter_mut().zip(row).for_each(|(s, &g)| *s = *s + g);
        }
    }
    s
}

/// Gradients of [`matmul`] given `dout: [batch, m, n]`. `da` has the layout
/// of `a`, `db` the layout of `b` (summed over the batch when `b` is shared),
/// `dbias` is `[n]`.
pub fn matmul_backward<F: Real>(
    a: &[F],
    b: &[F],
    dout: &[F],
    d: MatmulDims,
    t: Transpose,
    needs: MatmulNeeds,
) -> MatmulGrads<Vec<F>> {
    let MatmulDims { batch, m, k, n, .. } = d;
    assert_eq!(a.len(), batch * m * k, "matmul_backward: a length");
    assert_eq!(b.len(), d.b_len(), "matmul_backward: b length");
    assert_eq!(dout.len(), batch * m * n, "matmul_backward: dout length");
    let da = needs.da.then(|| matmul_da(b, dout, d, t));
    let db = needs.db.then(|| matmul_db(a, dout, d, t));

    let dbias = needs.dbias.then(|| bias_grad(dout, n));

    MatmulGrads { da, db, dbias }
}

/// d op(b) = op(a)ᵀ · dout of [`matmul`], written straight into b's layout
/// (summed over the batch when `b` is shared): the gradient that never
/// reads `b`.
pub(crate) fn matmul_db<F: Real>(a: &[F], dout: &[F], d: MatmulDims, t: Transpose) -> Vec<F> {
    let MatmulDims {
        batch,
        m,
        k,
        n,
        b_batched,
    } = d;
    let sa = a_strides(&d, t);
    let sb = b_strides(&d, t);
    let fold = !t.a && !b_batched;
    let mut db = vec![F::zero(); d.b_len()];
    if fold {
        gemm(k, batch * m, n, a, swap(sa), dout, (n, 1), F::zero(), &mut db, sb);
    } else {
        for i in 0..batch {
            let (dbi, beta) = if b_batched {
                (&mut db[i * k * n..(i + 1) * k * n], F::zero())
            } else {
                (&mut db[..], F::one())
            };
            let (ai, di) = (&a[i * m * k..(i + 1) * m * k], &dout[i * m * n..(i + 1) * m * n]);
            gemm(k, m, n, ai, swap(sa), di, (n, 1), beta, dbi, sb);
        }
    }
    db
}

/// [`matmul_db`] added into `acc` (b's layout): `acc + post(db)` element by
/// element, the bits of `matmul_db`, `post` (the f16 path's unscaling) and
/// an add, but computed `panel_elems` elements of `db` at a time, so no
/// `b`-sized temporary exists. A panel is a run of rows of b's layout (rows
/// of `[n, k]` when `t.b`, of `[k, n]` otherwise); each element's sum runs
/// over the same products in the same order as in `matmul_db`.
pub(crate) fn matmul_db_acc<F: Real>(
    a: &[F],
    dout: &[F],
    d: MatmulDims,
    t: Transpose,
    acc: &mut [F],
    panel_elems: usize,
    post: impl Fn(&mut [F]),
) {
    let MatmulDims {
        batch,
        m,
        k,
        n,
        b_batched,
    } = d;
    assert_eq!(acc.len(), d.b_len(), "matmul_db_acc: acc length");
    let add = |acc: &mut [F], db: &[F]| {
        acc.par_iter_mut().zip(db).for_each(|(x, &y)| *x = *x + y);
    };
    if b_batched {
        // One gradient per product (attention-like): no shared weight to
        // sum into, so no panels.
        let mut db = matmul_db(a, dout, d, t);
        post(&mut db);
        add(acc, &db);
        return;
    }
    let sat = swap(a_strides(&d, t));
    let fold = !t.a;
    let (rows, width) = if t.b { (n, k) } else { (k, n) };
    if rows == 0 || width == 0 {
        return;
    }
    let step = (panel_elems / width).clamp(1, rows);
    let mut tmp = vec![F::zero(); step * width];
    for r0 in (0..rows).step_by(step) {
        let r1 = (r0 + step).min(rows);
        let out = &mut tmp[..(r1 - r0) * width];
        // The panel's product: db rows r0..r1 are dout's columns r0..r1
        // (t.b) or op(a)ᵀ's rows r0..r1.
        let gemm_into = |ai: &[F], di: &[F], beta: F, out: &mut [F]| {
            if t.b {
                gemm(
                    k,
                    ai.len() / k,
                    r1 - r0,
                    ai,
                    sat,
                    &di[r0..],
                    (n, 1),
                    beta,
                    out,
                    (1, k),
                );
            } else {
                let rows_m = ai.len() / k;
                gemm(
                    r1 - r0,
                    rows_m,
                    n,
                    &ai[r0 * sat.0..],
                    sat,
                    di,
                    (n, 1),
                    beta,
                    out,
                    (n, 1),
                );
            }
        };
        if fold {
            gemm_into(a, dout, F::zero(), out);
        } else {
            // As matmul_db: a zeroed sum, every batch added with beta = 1.
            out.fill(F::zero());
            for i in 0..batch {
                let (ai, di) = (&a[i * m * k..(i + 1) * m * k], &dout[i * m * n..(i + 1) * m * n]);
                gemm_into(ai, di, F::one(), out);
            }
        }
        post(out);
        add(&mut acc[r0 * width..r1 * width], out);
    }
}

/// d op(a) = dout · op(b)ᵀ of [`matmul`], written straight into a's layout:
/// the gradient that never reads `a`.
pub(crate) fn matmul_da<F: Real>(b: &[F], dout: &[F], d: MatmulDims, t: Transpose) -> Vec<F> {
    let MatmulDims {
        batch,
        m,
        k,
        n,
        b_batched,
    } = d;
    let (sa, sb) = (a_strides(&d, t), b_strides(&d, t));
    let fold = !t.a && !b_batched;
    let mut da = vec![F::zero(); batch * m * k];
    if fold {
        gemm(batch * m, n, k, dout, (n, 1), b, swap(sb), F::zero(), &mut da, sa);
    } else {
        for i in 0..batch {
            let bi = if b_batched {
                &b[i * k * n..(i + 1) * k * n]
            } else {
                b
            };
            let dai = &mut da[i * m * k..(i + 1) * m * k];
            gemm(
                m,
                n,
                k,
                &dout[i * m * n..(i + 1) * m * n],
                (n, 1),
                bi,
                swap(sb),
                F::zero(),
                dai,
                sa,
            );
        }
    }
    da
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::random_f64;

    /// Panels of a few rows, so that every layout (shared and batched `b`,
    /// folded and per-batch sums) splits into several, the last one short.
    #[test]
    fn db_accumulated_by_panels_has_the_bits_of_db_then_add() {
        let mut seed = 0;
        for t in [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT] {
            for (batch, b_batched) in [(1, false), (3, false), (2, true)] {
                let d = MatmulDims {
                    batch,
                    m: 5,
                    k: 11,
                    n: 13,
                    b_batched,
                };
                seed += 4;
                let a = random_f64(seed, batch * d.m * d.k);
                let dout = random_f64(seed + 1, batch * d.m * d.n);
                let acc0 = random_f64(seed + 2, d.b_len());
                let post = |p: &mut [f64]| p.iter_mut().for_each(|x| *x *= 0.25);
                let mut db = matmul_db(&a, &dout, d, t);
                post(&mut db);
                let want: Vec<f64> = acc0.iter().zip(&db).map(|(x, y)| x + y).collect();
                for panel in [1, 20, 39, 1 << 20] {
                    let mut acc = acc0.clone();
                    matmul_db_acc(&a, &dout, d, t, &mut acc, panel, post);
                    assert!(acc == want, "{t:?} {d:?} panel {panel}");
                }
            }
        }
    }
}
