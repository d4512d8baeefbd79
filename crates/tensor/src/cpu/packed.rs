//! The ops that read a bf16/f16-stored tensor (a matmul's `b`, an embedding
//! table) without a widened copy of it: `b` is widened one panel of output
//! columns at a time into a small buffer that the f32 GEMM reads, the table
//! one gathered row at a time. A panel splits only the output, never the
//! sum over the inner dimension, and the GEMM's per-element summation does
//! not depend on where an element sits in the output, so results are bit
//! for bit those of the same op on the whole widened tensor (tested).

use half::{bf16, f16};
use rayon::prelude::*;

use crate::cpu::Real;
use crate::cpu::reference::{MatmulDims, Strides, a_strides, check_ids, gemm};
use crate::{Result, Transpose, round_f16_scaled};

/// How much of `b` [`matmul`] and [`matmul_da`] widen at once: `elems`
/// elements, or `min_cols` columns of the output if that is more.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Panel {
    pub elems: usize,
    pub min_cols: usize,
}

impl Panel {
    /// 16 MiB of f32 (against the 262 MB of a 32k × 2048 head widened
    /// whole), and at least 256 columns. Each panel is one handoff between
    /// rayon (widening) and the GEMM's threads, and each GEMM call packs
    /// the other operand whole (all of `dout` for `da`), so narrow panels
    /// cost more than the product: with 2 MiB panels, or 16 columns of a
    /// 32k-vocabulary head in its `da`, the ops ran 1.2-6x slower than on
    /// the widened tensor (`benches/cpu_matmul.rs`, BENCHMARKS.md). The
    /// head's `da` panel is 32.8 MB, freed before its gradient exists.
    pub(crate) const DEFAULT: Panel = Panel {
        elems: 1 << 22,
        min_cols: 256,
    };

    /// Columns per panel for an inner dimension of `inner`.
    fn cols(self, inner: usize) -> usize {
        (self.elems / inner.max(1)).max(self.min_cols).max(1)
    }
}

/// Below this many elements a panel is widened on one thread.
const PAR_MIN: usize = 1 << 15;

/// A bf16/f16 tensor's elements as stored.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Packed<'a> {
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

/// How a stored value becomes a GEMM operand: exactly (f32 compute), or
/// scaled by 2^-e and rounded to f16 (the f16 compute precision).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Widen {
    Exact,
    F16Scaled(i32),
}

impl Widen {
    fn apply<F: Real>(self, x: f32) -> F {
        match self {
            Widen::Exact => F::from_f32(x),
            Widen::F16Scaled(e) => F::from_f32(round_f16_scaled(x, e)),
        }
    }
}

impl Packed<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Packed::BF16(v) => v.len(),
            Packed::F16(v) => v.len(),
        }
    }

    /// Largest magnitude (NaN if any element is NaN), as the f16 operand
    /// scaling measures it on the widened tensor.
    pub(crate) fn max_abs(&self) -> f32 {
        fn fold(a: f32, b: f32) -> f32 {
            if b > a || b.is_nan() { b } else { a }
        }
        match self {
            Packed::BF16(v) => v.par_iter().map(|x| x.to_f32().abs()).reduce(|| 0.0, fold),
            Packed::F16(v) => v.par_iter().map(|x| x.to_f32().abs()).reduce(|| 0.0, fold),
        }
    }

    /// `out[r * cols + c] = w(self[offset + r * stride + c])` for every row
    /// `r` of `out` (read as `[_, cols]`; its last row may be shorter).
    pub(crate) fn widen_block<F: Real>(
        &self,
        offset: usize,
        stride: usize,
        cols: usize,
        out: &mut [F],
        w: Widen,
    ) {
        fn rows<S: Copy + Sync, F: Real>(
            src: &[S],
            offset: usize,
            stride: usize,
            cols: usize,
            out: &mut [F],
            f: impl Fn(S) -> F + Sync,
        ) {
            let row = |(r, o): (usize, &mut [F])| {
                let s = &src[offset + r * stride..][..o.len()];
                o.iter_mut().zip(s).for_each(|(o, &x)| *o = f(x));
            };
            if out.len() < PAR_MIN {
                out.chunks_mut(cols).enumerate().for_each(row);
            } else {
                out.par_chunks_mut(cols).enumerate().for_each(row);
            }
        }
        if cols == 0 {
            return;
        }
        // One loop per case, so that the exact widening (a shift for bf16)
        // vectorises.
        match (*self, w) {
            (Packed::BF16(v), Widen::Exact) => {
                rows(v, offset, stride, cols, out, |x| F::from_f32(x.to_f32()))
            }
            (Packed::F16(v), Widen::Exact) => rows(v, offset, stride, cols, out, |x| F::from_f32(x.to_f32())),
            (Packed::BF16(v), w) => rows(v, offset, stride, cols, out, |x| w.apply(x.to_f32())),
            (Packed::F16(v), w) => rows(v, offset, stride, cols, out, |x| w.apply(x.to_f32())),
        }
    }
}

/// `op(a) · op(w(b))` as [`crate::cpu::reference::matmul`] computes it on the
/// widened `b` (no bias), with `b` widened a `panel` at a time.
pub(crate) fn matmul<F: Real>(
    a: &[F],
    b: Packed<'_>,
    d: MatmulDims,
    t: Transpose,
    w: Widen,
    panel: Panel,
) -> Vec<F> {
    let MatmulDims { batch, m, k, n, .. } = d;
    assert_eq!(a.len(), batch * m * k, "matmul: a length");
    assert_eq!(b.len(), d.b_len(), "matmul: b length");
    let mut c = vec![F::zero(); batch * m * n];
    let p = Product {
        x: a,
        sx: a_strides(&d, t),
        inner: k,
        outer: n,
        b_rows: t.b,
        so: (n, 1),
    };
    p.run(b, d, t, w, panel, &mut c);
    c
}

/// d op(a) = dout · op(w(b))ᵀ as [`crate::cpu::reference::matmul_backward`]
/// computes it on the widened `b`, in a's layout, with `b` widened a panel
/// of op(a)'s columns at a time.
pub(crate) fn matmul_da<F: Real>(
    b: Packed<'_>,
    dout: &[F],
    d: MatmulDims,
    t: Transpose,
    w: Widen,
    panel: Panel,
) -> Vec<F> {
    let MatmulDims { batch, m, k, n, .. } = d;
    assert_eq!(b.len(), d.b_len(), "matmul_backward: b length");
    assert_eq!(dout.len(), batch * m * n, "matmul_backward: dout length");
    let mut da = vec![F::zero(); batch * m * k];
    let p = Product {
        x: dout,
        sx: (n, 1),
        inner: n,
        outer: k,
        b_rows: !t.b,
        so: a_strides(&d, t),
    };
    p.run(b, d, t, w, panel, &mut da);
    da
}

/// What [`matmul`] and [`matmul_da`] both compute: `out = x · B` for each
/// product of the batch, `B` = op(b) (`[k, n]`, the forward) or op(b)ᵀ
/// (`[n, k]`, `da`) as `[inner, outer]`; per product `x` is `[m, inner]`
/// and `out` `[m, outer]`, read through the strides `sx` and `so`.
struct Product<'a, F> {
    x: &'a [F],
    sx: Strides,
    inner: usize,
    outer: usize,
    /// Whether `b` is stored `[outer, inner]`, B's columns being its rows.
    b_rows: bool,
    so: Strides,
}

impl<F: Real> Product<'_, F> {
    /// B widened one panel of `out`'s columns at a time, each panel
    /// multiplied into every product that reads it.
    fn run(&self, b: Packed<'_>, d: MatmulDims, t: Transpose, w: Widen, panel: Panel, out: &mut [F]) {
        let MatmulDims {
            batch, m, b_batched, ..
        } = d;
        let (inner, outer) = (self.inner, self.outer);
        // One GEMM over every product's rows where they share B and a's
        // rows (x in the forward, out in `da`) are contiguous.
        let fold = !t.a && !b_batched;
        let nb = panel.cols(inner);
        let mut buf = vec![F::zero(); inner * nb.min(outer)];
        let b_sets = if b_batched { batch } else { 1 };
        for bi in 0..b_sets {
            let boff = bi * inner * outer;
            for j0 in (0..outer).step_by(nb) {
                let cols = nb.min(outer - j0);
                let p = &mut buf[..inner * cols];
                // B[:, j0..j0 + cols] as an [inner, cols] view `sp`.
                let sp: Strides = if self.b_rows {
                    b.widen_block(boff + j0 * inner, inner, inner, p, w);
                    (1, inner)
                } else {
                    b.widen_block(boff + j0, outer, cols, p, w);
                    (cols, 1)
                };
                let off = j0 * self.so.1;
                if fold {
                    let o = &mut out[off..];
                    gemm(
                        batch * m,
                        inner,
                        cols,
                        self.x,
                        self.sx,
                        p,
                        sp,
                        F::zero(),
                        o,
                        self.so,
                    );
                } else {
                    let (xl, ol) = (m * inner, m * outer);
                    let products = if b_batched { bi..bi + 1 } else { 0..batch };
                    for i in products {
                        let xi = &self.x[i * xl..(i + 1) * xl];
                        let oi = &mut out[i * ol + off..(i + 1) * ol];
                        gemm(m, inner, cols, xi, self.sx, p, sp, F::zero(), oi, self.so);
                    }
                }
            }
        }
    }
}

/// Rows `ids` of `table: [vocab, c]` widened, result `[ids.len(), c]`.
pub(crate) fn embedding<F: Real>(ids: &[u32], table: Packed<'_>, c: usize) -> Result<Vec<F>> {
    let vocab = table.len().checked_div(c).unwrap_or(0);
    assert_eq!(table.len(), vocab * c, "embedding: table length");
    check_ids("embedding", ids, vocab)?;
    let mut out = vec![F::zero(); ids.len() * c];
    if c > 0 {
        for (o, &id) in out.chunks_mut(c).zip(ids) {
            table.widen_block(id as usize * c, c, c, o, Widen::Exact);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::reference as r;
    use crate::testing::random_f32;

    /// Panels of a handful of elements: many panels, most of them ragged,
    /// on shapes small enough to try every layout.
    #[test]
    fn any_panel_size_gives_the_bits_of_the_widened_operand() {
        let mut seed = 0;
        for (batch, m, k, n, b_batched) in [(1, 5, 7, 9, false), (3, 2, 6, 5, false), (2, 3, 4, 7, true)] {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                let t = Transpose { a: ta, b: tb };
                let d = MatmulDims {
                    batch,
                    m,
                    k,
                    n,
                    b_batched,
                };
                seed += 3;
                let a = random_f32(seed, batch * m * k);
                let dout = random_f32(seed + 1, batch * m * n);
                let b16: Vec<bf16> = random_f32(seed + 2, d.b_len())
                    .iter()
                    .map(|&x| bf16::from_f32(x))
                    .collect();
                let wide: Vec<f32> = b16.iter().map(|x| x.to_f32()).collect();
                let (y, da) = (r::matmul(&a, &wide, None, d, t), r::matmul_da(&wide, &dout, d, t));
                for elems in [1, 5, 13, 64, 1 << 20] {
                    let panel = Panel { elems, min_cols: 1 };
                    let what = format!("{d:?} {t:?} panel {panel:?}");
                    let yp = matmul(&a, Packed::BF16(&b16), d, t, Widen::Exact, panel);
                    let dap = matmul_da(Packed::BF16(&b16), &dout, d, t, Widen::Exact, panel);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&yp), bits(&y), "y {what}");
                    assert_eq!(bits(&dap), bits(&da), "da {what}");
                }
            }
        }
    }

    #[test]
    fn widen_block_reads_strided_rows_with_a_short_last_row() {
        let src: Vec<f16> = (0..20).map(|i| f16::from_f32(i as f32)).collect();
        let mut out = vec![0f32; 7];
        Packed::F16(&src).widen_block(2, 5, 3, &mut out, Widen::Exact);
        assert_eq!(out, [2.0, 3.0, 4.0, 7.0, 8.0, 9.0, 12.0]);
    }
}
