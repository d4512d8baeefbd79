//! Matmul forward and backward on top of one tiled kernel (f32, packed-bf16
//! or packed-f16 B operand), and under the F16 compute precision on the
//! tensor-core kernels (`crate::coop`) where the adapter has cooperative
//! matrices, else on the same tiled kernel rounding its operands to f16.
//! Operands larger than one storage binding are processed as a grid of
//! sub-blocks, each bound as its own range.

use megatrain_tensor::{DType, Error, MatmulGrads, MatmulNeeds, Result, Shape, Transpose};

use super::matmul_epilogue::{EPI_SHIFT, Epilogue};
use super::{F16Operands, GpuExecutor, Op, View, need_f32, u};
use crate::coop::{CoopMatmul, CoopTile};
use crate::kernels::{Kernel, MatmulB, SimtMatmul};
use crate::simt::SimtInterior;
use crate::tensor::GpuTensor;

/// Which kernels run matmuls under the F16 compute precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum F16Matmul {
    /// The tuned tensor-core kernel where the adapter has cooperative
    /// matrices, else the SIMT kernel.
    #[default]
    Auto,
    /// The SIMT tiled kernel rounding operands to f16 (any adapter).
    Simt,
    /// A tensor-core tile (the adapter must have cooperative matrices).
    Coop(CoopTile),
    /// A tensor-core tile's kernel with the cooperative-matrix operations
    /// emulated in plain WGSL: any adapter whose workgroup memory holds the
    /// tile in f32, slowly. For checking the kernels without tensor cores.
    CoopEmulated(CoopTile),
}

impl std::fmt::Display for F16Matmul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            F16Matmul::Auto => f.write_str("auto"),
            F16Matmul::Simt => f.write_str("simt"),
            F16Matmul::Coop(t) => f.write_str(t.name()),
            F16Matmul::CoopEmulated(t) => write!(f, "{}_sw", t.name()),
        }
    }
}

/// `STORE_MAX` of `shaders/matmul_params.wgsl`: the product stores its
/// workgroups' output maxima through binding 9.
const STORE_MAX: u32 = 256;

/// The partial maxima a product's dispatches stored: one buffer each,
/// max|C| of each workgroup in the first `count` words, max|aux_out| in the
/// next `count`.
type Partials = Vec<(GpuTensor, usize)>;

/// The f16 operand scales of one op: a device buffer of max|x| words
/// (`shaders/absmax.wgsl`) and which word belongs to which operand.
#[derive(Clone, Copy)]
pub(crate) struct Scales<'a> {
    pub(super) buf: &'a GpuTensor,
    pub(super) a: u32,
    pub(super) b: u32,
}

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

/// Workgroups a product should have before its K is split to reach it (an
/// H100 has 132 SMs).
const SPLIT_GRID: usize = 128;
/// Fewest rows of K a part of a split product sums.
const SPLIT_MIN_K: usize = 64;

/// Where a backward puts `a`'s gradient.
pub(super) enum DaOut<'a> {
    /// A fresh tensor, when `needs.da`.
    Fresh,
    /// Added into this accumulator (the ACCUMULATE store).
    Acc(&'a GpuTensor),
    /// Into this C through an activation's epilogue (where it applies).
    Epi(&'a GpuTensor, Epilogue<'a>),
}

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
    /// Under F16, fold max|C| (and the epilogue's output's) while storing
    /// and remember it with C, where C is stored whole and once: the
    /// activations and their gradients, which f16 products read next (not
    /// the weights' gradients, nor a split product's partial sums).
    pub max_out: bool,
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

    /// The f16 matmul kernel family in use (Auto resolved for this adapter).
    pub fn f16_matmul_kernel(&self) -> F16Matmul {
        match self.f16_matmul {
            F16Matmul::Auto if self.ctx.has_cooperative_matrix() => F16Matmul::Coop(CoopTile::Tile128),
            F16Matmul::Auto => F16Matmul::Simt,
            k => k,
        }
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
        let maxima = self.operand_maxima(&mut op, &[a, b])?;
        let scales = maxima.as_ref().map(|(buf, s)| Scales {
            buf,
            a: s[0],
            b: s[1],
        });
        self.matmul_raw(&mut op, a, b, bias, &c, g.forward(), scales)?;
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
        let (g, _) = self.backward("matmul_backward", a, b, dout, t, needs, DaOut::Fresh, None)?;
        Ok(g)
    }

    /// `b`'s gradient added into `db_acc` by the product itself (the
    /// kernels' ACCUMULATE store: unscale, then `+ C`), so no `b`-sized
    /// temporary. Bit-identical to the product then `add_assign` when K
    /// (the rows summed) fits one dispatch; past the loop budget K is split
    /// and the partial sums land in `db_acc` one by one.
    pub(crate) fn matmul_backward_into_impl(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
        db_acc: &mut GpuTensor,
    ) -> Result<MatmulGrads<GpuTensor>> {
        megatrain_tensor::check_db_acc(&db_acc.shape, db_acc.dtype, &b.shape)?;
        self.make_unique(db_acc)?;
        let needs = MatmulNeeds { db: false, ..needs };
        let (g, _) = self.backward(
            "matmul_backward",
            a,
            b,
            dout,
            t,
            needs,
            DaOut::Fresh,
            Some(db_acc),
        )?;
        Ok(g)
    }

    /// `a`'s gradient added into `da_acc` by the product's ACCUMULATE store
    /// (unscale, then `+ C`: the bits of the product then `add_assign`),
    /// so no activation-sized temporary. Where the product would run in
    /// more than one pass (K past the loop budget, operands bound as
    /// several ranges) partial sums would land in `da_acc` one by one and
    /// round differently: there `da` is computed on its own and added.
    pub(crate) fn matmul_backward_da_into_impl(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
        da_acc: &mut GpuTensor,
    ) -> Result<MatmulGrads<GpuTensor>> {
        megatrain_tensor::check_da_acc(&da_acc.shape, da_acc.dtype, &a.shape)?;
        let g = self.geometry("matmul_backward", a, b, t)?;
        if !self.in_one_pass(dout, b, da_acc, &g.da(), None) {
            let needs = MatmulNeeds { da: true, ..needs };
            let (mut r, _) = self.backward("matmul_backward", a, b, dout, t, needs, DaOut::Fresh, None)?;
            let da = r.da.take().expect("da was requested");
            self.add_assign_impl(da_acc, &da)?;
            return Ok(r);
        }
        self.make_unique(da_acc)?;
        let needs = MatmulNeeds { da: false, ..needs };
        let (g, _) = self.backward("matmul_backward", a, b, dout, t, needs, DaOut::Acc(da_acc), None)?;
        Ok(g)
    }

    /// The SIMT kernels' tile width for product `d`: 128 once there are
    /// enough such tiles to fill a large GPU; below that, 64-wide tiles keep
    /// more workgroups in flight.
    fn simt_tile(&self, d: &Mm) -> usize {
        self.matmul_tile
            .map_or(if d.m >= 512 && d.n >= 512 { 128 } else { 64 }, |t| t as usize)
    }

    /// How many parts to split the K of product `d` into (1: none). A
    /// weight gradient of a small layer is a few output tiles summed over
    /// every token of the step: one workgroup per tile walking all of K
    /// leaves a large GPU nearly idle (gpt2-nano's are 4 to 16 tiles over
    /// 768 rows). Split where the grid is under [`SPLIT_GRID`] workgroups,
    /// into parts of at least [`SPLIT_MIN_K`] rows that divide K in
    /// multiples of 16, for f32 products whose K rows are contiguous in
    /// both operands (A stored [K, M], B [K, N]: the weight gradients).
    fn k_parts(&self, d: &Mm, scaled: bool) -> usize {
        if scaled || !d.ta || d.tb || d.tc || d.batch != 1 {
            return 1;
        }
        let tile = self.simt_tile(d);
        let grid = d.m.div_ceil(tile) * d.n.div_ceil(tile);
        let want = SPLIT_GRID.div_ceil(grid).min(d.k / SPLIT_MIN_K);
        let fits = |p: usize| (p * d.m * d.n * 4) as u64 <= self.max_binding && d.k / p <= self.k_cap();
        (2..=want)
            .rev()
            .find(|&p| d.k.is_multiple_of(p) && (d.k / p).is_multiple_of(16) && fits(p))
            .unwrap_or(1)
    }

    /// Product `d` as `parts` partial products over consecutive ranges of
    /// K, one batch entry each in one dispatch, then their sum (in order,
    /// plus C where `d` accumulates) by `sum_rows`' kernel.
    fn split_k(
        &self,
        op: &mut Op<'_>,
        a: &GpuTensor,
        b: &GpuTensor,
        c: &GpuTensor,
        d: Mm,
        parts: usize,
    ) -> Result<()> {
        let (mn, ks) = (d.m * d.n, d.k / parts);
        let partial = self.alloc_f32([parts, mn])?;
        let split = Mm {
            k: ks,
            batch: parts,
            a_bstride: ks * d.m,
            b_bstride: ks * d.n,
            c_bstride: mn,
            accumulate: false,
            max_out: false,
            ..d
        };
        self.matmul_raw(op, a, b, None, &partial, split, None)?;
        self.dispatch_sum_rows(op, self.full(&partial)?, parts, mn, self.full(c)?, d.accumulate);
        op.keep(partial);
        Ok(())
    }

    /// Counting the inner loops in case the driver does not unroll them,
    /// an invocation runs up to ~9 loop iterations per unit of K; past the
    /// loop budget K is split over dispatches (accumulating into C).
    fn k_cap(&self) -> usize {
        (self.loop_budget / 10).max(TILE)
    }

    /// Whether [`Self::matmul_epi`] runs product `d` as one dispatch per
    /// batch entry: every operand in one binding, K within the loop budget,
    /// no batch summed into one C. Otherwise it runs a grid of sub-blocks,
    /// possibly splitting K (partial sums added into C one by one).
    fn in_one_pass(
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

    /// Every backward entry point, recorded as one op named `name`: `a`'s
    /// gradient as `da` says, `b`'s accumulated into `db_acc` when given
    /// (`needs.db` is then false). Returns the gradients and whether a
    /// [`DaOut::Epi`] epilogue was applied (where it was not, its C holds
    /// the plain product).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward(
        &self,
        name: &'static str,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
        da: DaOut<'_>,
        db_acc: Option<&GpuTensor>,
    ) -> Result<(MatmulGrads<GpuTensor>, bool)> {
        let g = self.geometry(name, a, b, t)?;
        need_f32(name, dout)?;
        let mut out_dims = g.batch_dims.clone();
        out_dims.extend([g.m, g.n]);
        if dout.dims() != out_dims.as_slice() {
            return Err(Error::shape(
                name,
                format!("dout {} but the product is {:?}", dout.shape, out_dims),
            ));
        }
        let (m, n, k, nb) = (g.m, g.n, g.k, g.batch);
        let mut op = self.op(name);
        // Each operand is scaled by its own max over the whole tensor.
        let maxima = self.operand_maxima(&mut op, &[a, b, dout])?;
        let scales = |x: usize, y: usize| {
            maxima.as_ref().map(|(buf, s)| Scales {
                buf,
                a: s[x],
                b: s[y],
            })
        };
        let fresh_da = match (needs.da, &da) {
            (true, DaOut::Fresh) => Some(self.alloc_f32(a.shape.clone())?),
            _ => None,
        };
        // op(a)' = dout @ op(b)ᵀ, [M, K]; stored transposed when a is.
        let target = match da {
            DaOut::Fresh => fresh_da.as_ref().map(|c| (c, false, None)),
            DaOut::Acc(c) => Some((c, true, None)),
            DaOut::Epi(c, e) => Some((c, false, Some(e))),
        };
        let mut fused = false;
        if let Some((c, accumulate, epi)) = target {
            let d = Mm { accumulate, ..g.da() };
            fused = self.matmul_epi(&mut op, dout, b, None, c, d, scales(2, 1), epi)? && epi.is_some();
            if epi.is_some() && !fused {
                self.matmul_raw(&mut op, dout, b, None, c, d, scales(2, 1))?;
            }
        }
        let da = fresh_da;
        let fresh = match (needs.db, db_acc) {
            (true, None) => Some(self.alloc(b.shape.clone(), DType::F32)?),
            _ => None,
        };
        if let Some(db) = db_acc.or(fresh.as_ref()) {
            let accumulate = db_acc.is_some();
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
                    accumulate,
                    max_out: false,
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
                    accumulate,
                    max_out: false,
                }
            };
            let (x, y, sc) = if !t.b {
                (a, dout, scales(0, 2))
            } else {
                (dout, a, scales(2, 0))
            };
            match self.k_parts(&d, sc.is_some()) {
                1 => self.matmul_raw(&mut op, x, y, None, db, d, sc)?,
                parts => self.split_k(&mut op, x, y, db, d, parts)?,
            }
        }
        let db = fresh;
        op.finish()?;
        let dbias = if needs.dbias {
            Some(self.sum_rows(dout, n)?)
        } else {
            None
        };
        Ok((MatmulGrads { da, db, dbias }, fused))
    }

    pub(super) fn geometry(
        &self,
        op: &'static str,
        a: &GpuTensor,
        b: &GpuTensor,
        t: Transpose,
    ) -> Result<Geometry> {
        need_f32(op, a)?;
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

pub(super) struct Geometry {
    pub(super) batch_dims: Vec<usize>,
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) batch: usize,
    pub(super) b_shared: bool,
    t: Transpose,
}

impl Geometry {
    /// op(a)' = dout @ op(b)ᵀ, [M, K], stored transposed when a is.
    pub(super) fn da(&self) -> Mm {
        let (m, n, k, nb) = (self.m, self.n, self.k, self.batch);
        let flat = self.b_shared && !self.t.a;
        Mm {
            m: if flat { nb * m } else { m },
            n: k,
            k: n,
            batch: if flat { 1 } else { nb },
            ta: false,
            tb: !self.t.b,
            tc: self.t.a,
            a_bstride: m * n,
            b_bstride: if self.b_shared { 0 } else { k * n },
            c_bstride: m * k,
            accumulate: false,
            max_out: true,
        }
    }

    pub(super) fn forward(&self) -> Mm {
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
            max_out: true,
        }
    }
}
