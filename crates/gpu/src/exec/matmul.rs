//! Matmul forward and backward on top of one tiled kernel (f32, packed-bf16
//! or packed-f16 B operand), and under the F16 compute precision on the
//! tensor-core kernels (`crate::coop`) where the adapter has cooperative
//! matrices, else on the same tiled kernel rounding its operands to f16:
//! the ops' shapes and gradients here, each product's recording (kernel,
//! binding grid, dispatches) in `matmul_product`.

use megatrain_tensor::{DType, Error, MatmulGrads, MatmulNeeds, Result, Shape, Transpose};

use super::matmul_epilogue::Epilogue;
use super::{GpuExecutor, Op, need_f32};
use crate::coop::CoopTile;
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
            F16Matmul::Coop(t) => f.write_str(&t.name()),
            F16Matmul::CoopEmulated(t) => write!(f, "{}_sw", t.name()),
        }
    }
}

/// The f16 operand scales of one op: a device buffer of max|x| words
/// (`shaders/absmax.wgsl`) and which word belongs to which operand.
#[derive(Clone, Copy)]
pub(crate) struct Scales<'a> {
    pub(super) buf: &'a GpuTensor,
    pub(super) a: u32,
    pub(super) b: u32,
}

/// Workgroups a product should have before its K is split to reach it (an
/// H100 has 132 SMs).
const SPLIT_GRID: usize = 128;
/// Fewest rows of K a part of a split product sums on the SIMT kernels.
const SPLIT_MIN_K: usize = 64;
/// The same on the tensor-core tiles, where a part's workgroup also
/// stores a whole tile of partial sums (128 KiB for the default tile):
/// 512 rows are 16 K steps of 32 and about seven times the time of that
/// store at a multiprocessor's share of the bandwidth.
const SPLIT_MIN_K_COOP: usize = 512;

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

impl GpuExecutor {
    /// The f16 matmul kernel family in use (Auto resolved for this adapter:
    /// the default tile where the adapter has cooperative matrices and the
    /// tile matched the SIMT kernel there, `matmul_check.rs`).
    /// Resolved once per executor: every product asks.
    pub fn f16_matmul_kernel(&self) -> F16Matmul {
        *self.f16_matmul_resolved.get_or_init(|| match self.f16_matmul {
            F16Matmul::Auto
                if self.ctx.has_cooperative_matrix() && self.coop_matmul_checked(CoopTile::DEFAULT) =>
            {
                F16Matmul::Coop(CoopTile::DEFAULT)
            }
            F16Matmul::Auto => F16Matmul::Simt,
            k => k,
        })
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

    /// How many parts to split the K of product `d` into (1: none). A
    /// weight gradient of a small layer is a few output tiles summed over
    /// every token of the step: one workgroup per tile walking all of K
    /// leaves a large GPU nearly idle (gpt2-nano's are 4 to 16 tiles over
    /// 768 rows; under F16 on the tensor cores TinyLlama's K and V
    /// projections' are 16 tiles of 128x256 over 8,192 tokens, Qwen2.5-7B's
    /// 56). Split where the grid is under [`SPLIT_GRID`] workgroups of the
    /// kernel the product runs on, into parts of at least [`SPLIT_MIN_K`]
    /// rows ([`SPLIT_MIN_K_COOP`] on the tensor-core tiles, the only f16
    /// kernels split) that divide K in whole K steps (so a part runs on
    /// the same interior pipeline as the whole would), for products whose
    /// K rows are contiguous in both operands (A stored [K, M], B [K, N]:
    /// the weight gradients).
    fn k_parts(&self, d: &Mm, scaled: bool) -> usize {
        if !d.ta || d.tb || d.tc || d.batch != 1 {
            return 1;
        }
        let (bm, bn, step, min_k) = self.split_tile(d, scaled);
        let grid = d.m.div_ceil(bm) * d.n.div_ceil(bn);
        let want = SPLIT_GRID.div_ceil(grid).min(d.k / min_k);
        let fits = |p: usize| (p * d.m * d.n * 4) as u64 <= self.max_binding && d.k / p <= self.k_cap();
        (2..=want)
            .rev()
            .find(|&p| d.k.is_multiple_of(p) && (d.k / p).is_multiple_of(step) && fits(p))
            .unwrap_or(1)
    }

    /// The output tile (rows, columns), the multiple of K a part must be
    /// and the fewest rows of K it sums, on the kernel product `d` runs on
    /// (`scaled`: under F16). Under F16 only the tensor-core tiles split:
    /// the SIMT f16 kernel is the path of adapters without them, where
    /// the step's shapes are small (left as it was).
    fn split_tile(&self, d: &Mm, scaled: bool) -> (usize, usize, usize, usize) {
        match (scaled, self.f16_matmul_kernel()) {
            (true, F16Matmul::Coop(t) | F16Matmul::CoopEmulated(t)) => {
                let s = t.shape();
                let bk = s.bk as usize;
                (s.bm as usize, s.bn as usize, bk.max(16), SPLIT_MIN_K_COOP.max(bk))
            }
            (true, _) => (1, 1, 16, usize::MAX),
            (false, _) => {
                let tile = self.simt_tile(d);
                (tile, tile, 16, SPLIT_MIN_K)
            }
        }
    }

    /// Product `d` as `parts` partial products over consecutive ranges of
    /// K, one batch entry each in one dispatch (under F16 with the whole
    /// operands' scales), then their sum (in order, plus C where `d`
    /// accumulates) by `sum_rows`' kernel.
    #[allow(clippy::too_many_arguments)]
    fn split_k(
        &self,
        op: &mut Op<'_>,
        a: &GpuTensor,
        b: &GpuTensor,
        c: &GpuTensor,
        d: Mm,
        parts: usize,
        scales: Option<Scales<'_>>,
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
        self.matmul_raw(op, a, b, None, &partial, split, scales)?;
        self.dispatch_sum_rows(op, self.full(&partial)?, parts, mn, self.full(c)?, d.accumulate);
        op.keep(partial);
        Ok(())
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
            DaOut::Epi(c, e) => Some((c, false, self.epilogues.backward().then_some(e))),
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
                parts => self.split_k(&mut op, x, y, db, d, parts, sc)?,
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
