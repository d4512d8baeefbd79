//! Matmul forward and backward on top of one tiled kernel (f32 or packed-bf16
//! B operand). Operands larger than one storage binding are processed as a
//! grid of sub-blocks, each bound as its own range.

use megatrain_tensor::{DType, Error, MatmulGrads, MatmulNeeds, Result, Shape, Transpose};

use super::{GpuExecutor, Op, need_f32, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// Multiple that chunk sizes are rounded to (the larger tile).
const TILE: usize = 128;

/// One (possibly batched) product C = op(A) @ op(B), all sizes in elements.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub ta: bool,
    pub tb: bool,
    /// Store C transposed: C is [N, M].
    pub tc: bool,
    pub a_bstride: usize,
    pub b_bstride: usize,
    /// 0 with batch > 1 sums the batch into one C.
    pub c_bstride: usize,
    pub accumulate: bool,
}

fn halve(x: usize) -> usize {
    let h = x / 2;
    if h >= 2 * TILE {
        h.div_ceil(TILE) * TILE
    } else {
        h.max(1)
    }
}

impl GpuExecutor {
    pub(crate) fn matmul_raw(
        &self,
        op: &mut Op<'_>,
        a: &GpuTensor,
        b: &GpuTensor,
        bias: Option<&GpuTensor>,
        c: &GpuTensor,
        d: Mm,
    ) -> Result<()> {
        if d.m == 0 || d.n == 0 {
            return Ok(());
        }
        if d.k == 0 {
            // An empty sum: C is the bias (or stays as it is when accumulating).
            return Err(Error::invalid("matmul", "inner dimension K is 0"));
        }
        // 128-wide tiles once there are enough of them to fill a large GPU;
        // below that, 64-wide tiles keep more workgroups in flight.
        let tile = self
            .matmul_tile
            .unwrap_or(if d.m >= 512 && d.n >= 512 { 128 } else { 64 }) as usize;
        let kernel = match (b.dtype == DType::BF16, tile == 128) {
            (false, false) => Kernel::MatmulF32,
            (true, false) => Kernel::MatmulBf16,
            (false, true) => Kernel::MatmulF32Big,
            (true, true) => Kernel::MatmulBf16Big,
        };
        let (lda, ldb, ldc) = (
            if d.ta { d.m } else { d.k },
            if d.tb { d.k } else { d.n },
            if d.tc { d.m } else { d.n },
        );
        let sum_batch = d.batch > 1 && d.c_bstride == 0;
        // Counting the inner loops in case the driver does not unroll them,
        // an invocation runs up to ~9 loop iterations per unit of K; past the
        // loop budget K is split over dispatches (accumulating into C).
        let k_cap = (self.loop_budget / 10).max(TILE);
        let fits = a.byte_len() <= self.max_binding
            && b.byte_len() <= self.max_binding
            && c.byte_len() <= self.max_binding;
        let bias_view = match bias {
            Some(t) => self.full(t)?,
            None => self.dummy(),
        };
        let flags = |acc: bool| -> u32 {
            (d.ta as u32)
                | (d.tb as u32) << 1
                | (bias.is_some() as u32) << 2
                | (acc as u32) << 3
                | (d.tc as u32) << 4
        };
        if fits && !sum_batch && d.k <= k_cap {
            let (av, bv, cv) = (self.full(a)?, self.full(b)?, self.full(c)?);
            let params = [
                u(d.m),
                u(d.n),
                u(d.k),
                flags(d.accumulate),
                av.elem_off,
                bv.elem_off,
                cv.elem_off,
                0,
                u(d.a_bstride),
                u(d.b_bstride),
                u(d.c_bstride),
                u(lda),
                u(ldb),
                u(ldc),
                0,
                0,
            ];
            let grid = [
                d.n.div_ceil(tile) as u32,
                d.m.div_ceil(tile) as u32,
                d.batch as u32,
            ];
            op.dispatch(kernel, &params, &[av, bv, bias_view, cv], grid);
            return Ok(());
        }
        // Chunked path: shrink the block until every operand's range fits.
        let lim = (self.max_binding.saturating_sub(self.align) / 4) as usize;
        let span = |rows: usize, ld: usize, cols: usize| (rows - 1) * ld + cols;
        let (mut mc, mut nc, mut kc) = (d.m, d.n, d.k.min(k_cap / TILE * TILE));
        loop {
            // b's span is in elements of its dtype: bf16 counts half.
            let bscale = if b.dtype == DType::BF16 { 2 } else { 1 };
            let a_span = if d.ta {
                span(kc, lda, mc)
            } else {
                span(mc, lda, kc)
            };
            let b_span = if d.tb {
                span(nc, ldb, kc)
            } else {
                span(kc, ldb, nc)
            } / bscale;
            let c_span = if d.tc {
                span(nc, ldc, mc)
            } else {
                span(mc, ldc, nc)
            };
            let before = (mc, nc, kc);
            if a_span > lim {
                if d.ta { kc = halve(kc) } else { mc = halve(mc) }
            } else if b_span > lim {
                if d.tb { nc = halve(nc) } else { kc = halve(kc) }
            } else if c_span > lim {
                if d.tc { nc = halve(nc) } else { mc = halve(mc) }
            } else {
                break;
            }
            if before == (mc, nc, kc) {
                return Err(Error::invalid(
                    "matmul",
                    "an operand row is larger than one storage binding",
                ));
            }
        }
        for z in 0..d.batch {
            let (ab, bb, cb) = (z * d.a_bstride, z * d.b_bstride, z * d.c_bstride);
            for m0 in (0..d.m).step_by(mc) {
                let m1 = (m0 + mc).min(d.m);
                for n0 in (0..d.n).step_by(nc) {
                    let n1 = (n0 + nc).min(d.n);
                    for k0 in (0..d.k).step_by(kc) {
                        let k1 = (k0 + kc).min(d.k);
                        let (sa, la) = if d.ta {
                            (ab + k0 * lda + m0, span(k1 - k0, lda, m1 - m0))
                        } else {
                            (ab + m0 * lda + k0, span(m1 - m0, lda, k1 - k0))
                        };
                        let (sb, lb) = if d.tb {
                            (bb + n0 * ldb + k0, span(n1 - n0, ldb, k1 - k0))
                        } else {
                            (bb + k0 * ldb + n0, span(k1 - k0, ldb, n1 - n0))
                        };
                        let (sc, lc) = if d.tc {
                            (cb + n0 * ldc + m0, span(n1 - n0, ldc, m1 - m0))
                        } else {
                            (cb + m0 * ldc + n0, span(m1 - m0, ldc, n1 - n0))
                        };
                        let (av, bv, cv) = (
                            self.view(a, sa, la)?,
                            self.view(b, sb, lb)?,
                            self.view(c, sc, lc)?,
                        );
                        let acc = d.accumulate || k0 > 0 || (sum_batch && z > 0);
                        // Only the first K block adds the bias.
                        let with_bias = bias.is_some() && k0 == 0 && !(sum_batch && z > 0);
                        let fl = (flags(acc) & !4) | (with_bias as u32) << 2;
                        let params = [
                            u(m1 - m0),
                            u(n1 - n0),
                            u(k1 - k0),
                            fl,
                            av.elem_off,
                            bv.elem_off,
                            cv.elem_off,
                            u(n0),
                            0,
                            0,
                            0,
                            u(lda),
                            u(ldb),
                            u(ldc),
                            0,
                            0,
                        ];
                        let grid = [
                            (n1 - n0).div_ceil(tile) as u32,
                            (m1 - m0).div_ceil(tile) as u32,
                            1,
                        ];
                        op.dispatch(kernel, &params, &[av, bv, bias_view, cv], grid);
                    }
                }
            }
        }
        Ok(())
    }

    pub(crate) fn matmul_impl(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        bias: Option<&GpuTensor>,
        t: Transpose,
    ) -> Result<GpuTensor> {
        let g = self.geometry("matmul", a, b, t)?;
        if let Some(bias) = bias {
            need_f32("matmul bias", bias)?;
            if bias.dims() != [g.n] {
                return Err(Error::shape(
                    "matmul",
                    format!("bias {} for N = {}", bias.shape, g.n),
                ));
            }
        }
        let mut out_dims = g.batch_dims.clone();
        out_dims.extend([g.m, g.n]);
        let c = self.alloc_f32(out_dims)?;
        let mut op = self.op("matmul");
        self.matmul_raw(&mut op, a, b, bias, &c, g.forward())?;
        op.finish()?;
        Ok(c)
    }

    pub(crate) fn matmul_backward_impl(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
    ) -> Result<MatmulGrads<GpuTensor>> {
        let g = self.geometry("matmul_backward", a, b, t)?;
        need_f32("matmul_backward dout", dout)?;
        let mut out_dims = g.batch_dims.clone();
        out_dims.extend([g.m, g.n]);
        if dout.dims() != out_dims.as_slice() {
            return Err(Error::shape(
                "matmul_backward",
                format!("dout {} but the product is {:?}", dout.shape, out_dims),
            ));
        }
        let (m, n, k, nb) = (g.m, g.n, g.k, g.batch);
        let mut op = self.op("matmul_backward");
        let da = if needs.da {
            // op(a)' = dout @ op(b)ᵀ, [M, K]; stored transposed when a is.
            let da = self.alloc_f32(a.shape.clone())?;
            let flat = g.b_shared && !t.a;
            let d = Mm {
                m: if flat { nb * m } else { m },
                n: k,
                k: n,
                batch: if flat { 1 } else { nb },
                ta: false,
                tb: !t.b,
                tc: t.a,
                a_bstride: m * n,
                b_bstride: if g.b_shared { 0 } else { k * n },
                c_bstride: m * k,
                accumulate: false,
            };
            self.matmul_raw(&mut op, dout, b, None, &da, d)?;
            Some(da)
        } else {
            None
        };
        let db = if needs.db {
            let db = self.alloc(b.shape.clone(), DType::F32)?;
            // Shared b with a batched a sums over the batch: flattened into K
            // when a's rows are contiguous, else accumulated batch by batch.
            let flat = g.b_shared && !t.a;
            let (kk, batch) = if flat { (nb * m, 1) } else { (m, nb) };
            let c_bstride = if g.b_shared { 0 } else { k * n };
            let d = if !t.b {
                // db [K, N] = op(a)ᵀ @ dout
                Mm {
                    m: k,
                    n,
                    k: kk,
                    batch,
                    ta: !t.a,
                    tb: false,
                    tc: false,
                    a_bstride: m * k,
                    b_bstride: m * n,
                    c_bstride,
                    accumulate: false,
                }
            } else {
                // db [N, K] = doutᵀ @ op(a)
                Mm {
                    m: n,
                    n: k,
                    k: kk,
                    batch,
                    ta: true,
                    tb: t.a,
                    tc: false,
                    a_bstride: m * n,
                    b_bstride: m * k,
                    c_bstride,
                    accumulate: false,
                }
            };
            if !t.b {
                self.matmul_raw(&mut op, a, dout, None, &db, d)?;
            } else {
                self.matmul_raw(&mut op, dout, a, None, &db, d)?;
            }
            Some(db)
        } else {
            None
        };
        op.finish()?;
        let dbias = if needs.dbias {
            Some(self.sum_rows(dout, n)?)
        } else {
            None
        };
        Ok(MatmulGrads { da, db, dbias })
    }

    fn geometry(&self, op: &'static str, a: &GpuTensor, b: &GpuTensor, t: Transpose) -> Result<Geometry> {
        need_f32(op, a)?;
        if b.dtype == DType::F16 {
            return Err(Error::DType {
                op,
                expected: DType::F32,
                got: b.dtype,
            });
        }
        let (ad, bd) = (a.dims(), b.dims());
        if ad.len() < 2 || bd.len() < 2 {
            return Err(Error::shape(
                op,
                format!("a {} and b {} must be at least 2-D", a.shape, b.shape),
            ));
        }
        let batch_dims = ad[..ad.len() - 2].to_vec();
        let (r0, r1) = (ad[ad.len() - 2], ad[ad.len() - 1]);
        let (m, k) = if t.a { (r1, r0) } else { (r0, r1) };
        let (b0, b1) = (bd[bd.len() - 2], bd[bd.len() - 1]);
        let (kb, n) = if t.b { (b1, b0) } else { (b0, b1) };
        if kb != k {
            return Err(Error::shape(
                op,
                format!(
                    "a {} and b {} disagree on K ({k} vs {kb}) with {t:?}",
                    a.shape, b.shape
                ),
            ));
        }
        let b_shared = bd.len() == 2;
        if !b_shared && bd[..bd.len() - 2] != batch_dims[..] {
            return Err(Error::shape(
                op,
                format!("b {} is neither 2-D nor batched like a {}", b.shape, a.shape),
            ));
        }
        let batch = Shape::new(batch_dims.clone()).numel();
        Ok(Geometry {
            batch_dims,
            m,
            n,
            k,
            batch,
            b_shared,
            t,
        })
    }
}

struct Geometry {
    batch_dims: Vec<usize>,
    m: usize,
    n: usize,
    k: usize,
    batch: usize,
    b_shared: bool,
    t: Transpose,
}

impl Geometry {
    fn forward(&self) -> Mm {
        // A shared weight with row-major activations: one big [batch·M, K] product.
        let flat = self.b_shared && !self.t.a;
        Mm {
            m: if flat { self.batch * self.m } else { self.m },
            n: self.n,
            k: self.k,
            batch: if flat { 1 } else { self.batch },
            ta: self.t.a,
            tb: self.t.b,
            tc: false,
            a_bstride: self.m * self.k,
            b_bstride: if self.b_shared { 0 } else { self.k * self.n },
            c_bstride: self.m * self.n,
            accumulate: false,
        }
    }
}
