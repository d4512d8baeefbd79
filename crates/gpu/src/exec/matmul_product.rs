//! How one product C = op(A) @ op(B) is recorded: the kernel family it
//! runs on (SIMT, or the tensor-core tiles under F16), one dispatch per
//! batch entry where every operand fits one binding and K the loop budget,
//! else a grid of sub-blocks each bound as its own range (K split over
//! dispatches, partial sums added into C), and each dispatch as an
//! interior pipeline over whole tiles plus checked edge strips.

use megatrain_tensor::{DType, Error, Result};

use super::matmul::{F16Matmul, Mm, Scales};
use super::matmul_epilogue::{EPI_SHIFT, Epilogue};
use super::{F16Operands, GpuExecutor, Op, View, u};
use crate::coop::{CoopMatmul, CoopTile};
use crate::kernels::{Kernel, MatmulB, SimtMatmul};
use crate::simt::SimtInterior;
use crate::tensor::GpuTensor;

/// `STORE_MAX` of `shaders/matmul_params.wgsl`: the product stores its
/// workgroups' output maxima through binding 9.
const STORE_MAX: u32 = 256;

/// The partial maxima a product's dispatches stored: one buffer each,
/// max|C| of each workgroup in the first `count` words, max|aux_out| in the
/// next `count`.
type Partials = Vec<(GpuTensor, usize)>;

/// The kernel family one product runs on.
#[derive(Clone, Copy)]
enum Path {
    Simt(SimtMatmul),
    Coop {
        tile: CoopTile,
        a_f16: bool,
        b_f16: bool,
        emulated: bool,
        epi: bool,
    },
}

/// Multiple that chunk sizes are rounded to (the larger tile).
const TILE: usize = 128;

fn halve(x: usize) -> usize {
    let h = x / 2;
    if h >= 2 * TILE {
        h.div_ceil(TILE) * TILE
    } else {
        h.max(1)
    }
}

impl GpuExecutor {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_raw(
        &self,
        op: &mut Op<'_>,
        a: &GpuTensor,
        b: &GpuTensor,
        bias: Option<&GpuTensor>,
        c: &GpuTensor,
        d: Mm,
        scales: Option<Scales<'_>>,
    ) -> Result<()> {
        self.matmul_epi(op, a, b, bias, c, d, scales, None).map(|_| ())
    }

    /// [`Self::matmul_raw`] storing C through `epi`. Returns false where the
    /// epilogue cannot see whole sums (K split over dispatches, ACCUMULATE,
    /// a batch summed into one C), having recorded nothing but perhaps the
    /// operands' f16 copies (which the product the caller then records
    /// finds remembered): the caller composes the product and the
    /// standalone activation.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_epi(
        &self,
        op: &mut Op<'_>,
        a: &GpuTensor,
        b: &GpuTensor,
        bias: Option<&GpuTensor>,
        c: &GpuTensor,
        d: Mm,
        scales: Option<Scales<'_>>,
        epi: Option<Epilogue<'_>>,
    ) -> Result<bool> {
        if d.m == 0 || d.n == 0 {
            return Ok(true);
        }
        if d.k == 0 {
            // An empty sum: C is the bias (or stays as it is when accumulating).
            return Err(Error::invalid("matmul", "inner dimension K is 0"));
        }
        let big = self.simt_tile(&d) == 128;
        let b_kind = match b.dtype {
            DType::F32 => MatmulB::F32,
            DType::BF16 => MatmulB::Bf16,
            DType::F16 => MatmulB::F16,
        };
        let simt = |f16| {
            Path::Simt(SimtMatmul {
                big,
                b: b_kind,
                f16,
                epi: epi.is_some(),
            })
        };
        let path = match scales {
            None => simt(false),
            // The tensor-core kernels take f32 or f16 B; bf16 B (never on the
            // f16 path's transport) stays on the SIMT kernel.
            Some(_) => match (self.f16_matmul_kernel(), b_kind) {
                (F16Matmul::Coop(tile), MatmulB::F32 | MatmulB::F16) => Path::Coop {
                    tile,
                    a_f16: false,
                    b_f16: b_kind == MatmulB::F16,
                    emulated: false,
                    epi: epi.is_some(),
                },
                (F16Matmul::CoopEmulated(tile), MatmulB::F32 | MatmulB::F16) => Path::Coop {
                    tile,
                    a_f16: false,
                    b_f16: b_kind == MatmulB::F16,
                    emulated: true,
                    epi: epi.is_some(),
                },
                _ => simt(true),
            },
        };
        let sum_batch = d.batch > 1 && d.c_bstride == 0;
        if epi.is_some() && (d.accumulate || sum_batch) {
            return Ok(false);
        }
        // Under F16Operands::Copy the tensor-core kernels read f16 copies
        // of f32 operands (rounded to nearest even, as staging rounds on the
        // adapters tested; half the bytes, no conversion per tile); both
        // copies go in before any of C is written. How the
        // product is split over bindings is decided on the operands
        // themselves, so that it, and with it the order of the sums (K
        // split over dispatches), is the same as without copies.
        let (a16, b16);
        let (ka, kb, path) = match (path, scales) {
            (
                Path::Coop {
                    tile,
                    b_f16,
                    emulated,
                    epi,
                    ..
                },
                Some(s),
            ) if self.f16_operands == F16Operands::Copy => {
                a16 = self.f16_copy(op, a, s.buf, s.a)?;
                b16 = match b_f16 {
                    true => None,
                    false => Some(self.f16_copy(op, b, s.buf, s.b)?),
                };
                let path = Path::Coop {
                    tile,
                    a_f16: true,
                    b_f16: true,
                    emulated,
                    epi,
                };
                (&a16, b16.as_ref().unwrap_or(b), path)
            }
            (path, _) => (a, b, path),
        };
        let scale_view = match scales {
            Some(s) => Some(self.full(s.buf)?),
            None => None,
        };
        let (slot_a, slot_b) = scales.map_or((0, 0), |s| (s.a, s.b));
        let (lda, ldb, ldc) = (
            if d.ta { d.m } else { d.k },
            if d.tb { d.k } else { d.n },
            if d.tc { d.m } else { d.n },
        );
        let epi_bits = epi.map_or(0, |e| e.kind() << EPI_SHIFT);
        let k_cap = self.k_cap();
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
                | epi_bits
        };
        if self.in_one_pass(a, b, c, &d, epi) {
            let fold = self.folds_output(c, &d, scales.is_some());
            let (av, bv, cv) = (self.full(ka)?, self.full(kb)?, self.full(c)?);
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
                slot_a,
                slot_b,
                0,
                0,
                0,
                0,
            ];
            let views = [av, bv, bias_view, cv];
            let epi_views = match epi {
                Some(e) => Some(self.epi_views(e, cv, 0, c.numel())?),
                None => None,
            };
            let partials =
                self.dispatch_mm(op, path, params, &views, scale_view, epi_views, fold, d.batch)?;
            self.remember_output_maxima(c, epi, partials.into_iter().collect());
            return Ok(true);
        }
        // Chunked path: shrink the block until every operand's range fits.
        let lim = (self.max_binding.saturating_sub(self.align) / 4) as usize;
        let span = |rows: usize, ld: usize, cols: usize| (rows - 1) * ld + cols;
        let (mut mc, mut nc, mut kc) = (d.m, d.n, d.k.min(k_cap / TILE * TILE));
        loop {
            // b's span is in elements of its dtype: bf16 and f16 count half.
            let bscale = if b.dtype == DType::F32 { 1 } else { 2 };
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
        if epi.is_some() && kc < d.k {
            return Ok(false);
        }
        // Blocks of C that are summed over several dispatches store partial
        // sums: no maxima there.
        let fold = kc == d.k && !sum_batch && self.folds_output(c, &d, scales.is_some());
        let mut partials = Partials::new();
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
                            self.view(ka, sa, la)?,
                            self.view(kb, sb, lb)?,
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
                            slot_a,
                            slot_b,
                            0,
                            0,
                            0,
                            0,
                        ];
                        let views = [av, bv, bias_view, cv];
                        let epi_views = match epi {
                            Some(e) => Some(self.epi_views(e, cv, sc, lc)?),
                            None => None,
                        };
                        let p = self.dispatch_mm(op, path, params, &views, scale_view, epi_views, fold, 1)?;
                        partials.extend(p);
                    }
                }
            }
        }
        self.remember_output_maxima(c, epi, partials);
        Ok(true)
    }

    /// Whether product `d` stores its output maxima (see [`Mm::max_out`]):
    /// under F16 (`scaled`) where producers fold them, and where it
    /// stores every element of `c`.
    fn folds_output(&self, c: &GpuTensor, d: &Mm, scaled: bool) -> bool {
        scaled && d.max_out && self.folds_maxima() && d.batch * d.m * d.n == c.numel()
    }

    /// Remembers what a product's dispatches stored of its outputs'
    /// maxima: C's, and the epilogue's output's where it has one.
    fn remember_output_maxima(&self, c: &GpuTensor, epi: Option<Epilogue<'_>>, partials: Partials) {
        if partials.is_empty() {
            return;
        }
        let ranges = |second: bool| {
            let part = |(t, n): &(GpuTensor, usize)| (t.clone(), if second { *n } else { 0 }, *n);
            partials.iter().map(part).collect()
        };
        if let Some(out) = epi.and_then(|e| e.operands()[2]) {
            self.remember_partial_maxima(out, ranges(true));
        }
        self.remember_partial_maxima(c, ranges(false));
    }

    /// Records one product: `params` as matmul_params.wgsl's `Params`, `views` the
    /// A, B, bias and C bindings, `epi_views` the epilogue's (with one in
    /// the params' flags), `batch` the grid's depth; with `fold` the
    /// workgroups store their output maxima (STORE_MAX), in a buffer it
    /// returns with their number. The 128-wide
    /// SIMT tile and the tensor-core kernels run whole tiles on an interior
    /// pipeline (vector loads, no bounds checks) when the operands allow it,
    /// and the M and N edge strips on the checked one.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_mm(
        &self,
        op: &mut Op<'_>,
        path: Path,
        mut params: [u32; 20],
        views: &[View<'_>; 4],
        scale_view: Option<View<'_>>,
        epi_views: Option<[View<'_>; 3]>,
        fold: bool,
        batch: usize,
    ) -> Result<Option<(GpuTensor, usize)>> {
        let (m, n, k) = (params[0] as usize, params[1] as usize, params[2] as usize);
        let mut all: Vec<View<'_>> = views.to_vec();
        let f16 = scale_view.is_some();
        all.extend(scale_view);
        all.extend(epi_views.into_iter().flatten());
        // Vector loads read four elements of the contiguous dimension at a
        // 16-byte (f32) or 8-byte (f16) boundary: every start the kernel
        // forms (offset, batch stride, leading dimension, tile origins) must
        // be a multiple of 4 elements.
        let aligned = [params[4], params[5], params[8], params[9], params[11], params[12]]
            .iter()
            .all(|x| x % 4 == 0);
        let flags = params[3];
        // (pipeline, first tile column, first tile row, tile columns, tile rows)
        let plan: Vec<(Kernel, usize, usize, usize, usize)> = match path {
            Path::Simt(v) if !v.big => vec![(Kernel::Matmul(v), 0, 0, n.div_ceil(64), m.div_ceil(64))],
            Path::Simt(v) => {
                // Whole tiles on the interior pipeline of the layout; the
                // right strip (all rows) and the bottom strip left of it on
                // the checked kernel.
                let t = SimtInterior::TILE;
                let (mt, nt) = (m.div_ceil(t), n.div_ceil(t));
                let (mf, nf) = if self.simt_interior && aligned && k.is_multiple_of(SimtInterior::BK) {
                    (m / t, n / t)
                } else {
                    (0, 0)
                };
                let interior = Kernel::MatmulInterior(SimtInterior {
                    ta: flags & 1 != 0,
                    tb: flags & 2 != 0,
                    b: v.b,
                    f16: v.f16,
                    epi: v.epi,
                });
                vec![
                    (interior, 0, 0, nf, mf),
                    (Kernel::Matmul(v), nf, 0, nt - nf, mt),
                    (Kernel::Matmul(v), 0, mf, nf, mt - mf),
                ]
            }
            Path::Coop {
                tile,
                a_f16,
                b_f16,
                emulated,
                epi,
            } => {
                let s = tile.shape();
                let (bm, bn, bk) = (s.bm as usize, s.bn as usize, s.bk as usize);
                let variant = |edge| {
                    Kernel::MatmulCoop(CoopMatmul {
                        tile,
                        ta: flags & 1 != 0,
                        tb: flags & 2 != 0,
                        tc: flags & 16 != 0,
                        edge,
                        b_f16,
                        a_f16,
                        emulated,
                        epi,
                        probe: self.coop_probe,
                    })
                };
                let (mt, nt) = (m.div_ceil(bm), n.div_ceil(bn));
                let (mf, nf) = if aligned && k.is_multiple_of(bk) {
                    (m / bm, n / bn)
                } else {
                    (0, 0)
                };
                // The interior; the right strip (all rows), then the bottom
                // strip left of it.
                vec![
                    (variant(false), 0, 0, nf, mf),
                    (variant(true), nf, 0, nt - nf, mt),
                    (variant(true), 0, mf, nf, mt - mf),
                ]
            }
        };
        let plan: Vec<_> = plan.into_iter().filter(|p| p.3 > 0 && p.4 > 0).collect();
        // One slot per workgroup of every dispatch, for C and for aux_out
        // (unused without one: a few words).
        let total: usize = plan.iter().map(|p| p.3 * p.4 * batch).sum();
        let partials = self.maxima_slots(fold, 2 * total)?;
        if f16 {
            all.push(self.maxima_view(&partials, (0, 2 * total), views[3])?);
        }
        if fold {
            params[3] |= STORE_MAX;
            params[19] = u(total);
        }
        let mut base = 0;
        for &(kernel, x0, y0, gx, gy) in &plan {
            params[16] = x0 as u32;
            params[17] = y0 as u32;
            params[18] = u(base);
            op.dispatch(kernel, &params, &all, [gx as u32, gy as u32, batch as u32]);
            base += gx * gy * batch;
        }
        Ok(partials.map(|t| (t, total)))
    }

    /// The SIMT kernels' tile width for product `d`: 128 once there are
    /// enough such tiles to fill a large GPU; below that, 64-wide tiles keep
    /// more workgroups in flight.
    pub(super) fn simt_tile(&self, d: &Mm) -> usize {
        self.matmul_tile
            .map_or(if d.m >= 512 && d.n >= 512 { 128 } else { 64 }, |t| t as usize)
    }

    /// Counting the inner loops in case the driver does not unroll them,
    /// an invocation runs up to ~9 loop iterations per unit of K; past the
    /// loop budget K is split over dispatches (accumulating into C).
    pub(super) fn k_cap(&self) -> usize {
        (self.loop_budget / 10).max(TILE)
    }

    /// Whether [`Self::matmul_epi`] runs product `d` as one dispatch per
    /// batch entry: every operand in one binding, K within the loop budget,
    /// no batch summed into one C. Otherwise it runs a grid of sub-blocks,
    /// possibly splitting K (partial sums added into C one by one).
    pub(super) fn in_one_pass(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        c: &GpuTensor,
        d: &Mm,
        epi: Option<Epilogue<'_>>,
    ) -> bool {
        let sum_batch = d.batch > 1 && d.c_bstride == 0;
        let fits = |t: &GpuTensor| t.byte_len() <= self.max_binding;
        fits(a)
            && fits(b)
            && fits(c)
            && epi.is_none_or(|e| e.operands().iter().flatten().all(|t| fits(t)))
            && !sum_batch
            && d.k <= self.k_cap()
    }
}
