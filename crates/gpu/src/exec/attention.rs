//! Fused causal attention (online-softmax forward, recomputing backward),
//! in a sliding window where the mask has one, within the documents packed
//! in the rows where it has them (every family: attention_mask.wgsl), its
//! scores soft-capped where the mask has a cap (both f32 families:
//! attention.wgsl and attention_lanes.wgsl; not the tensor-core kernels).
//! Under the F16 compute precision the operands are first rounded
//! (`attention_coop.rs`), then run on the tensor-core family or on these
//! f32 kernels.

use megatrain_tensor::{AttentionGrads, AttentionOut, AttnMask, ComputePrecision, Error, Result};

use super::{GpuExecutor, Op, View, f, need_f32, u};
use crate::kernels::{ATTN_MAX_HEAD_DIM, AttnHeadDim, Kernel};
use crate::tensor::GpuTensor;

/// Largest head dimension of the f32 kernels (attention.wgsl's DM of the
/// wide variant); the lanes and tensor-core families take fewer.
const MAX_HEAD_DIM: usize = ATTN_MAX_HEAD_DIM;
/// Rows per workgroup (attention.wgsl and attention_lanes.wgsl RB).
const RB: usize = 64;
/// Rows per tile of the lanes kernels (attention_lanes.wgsl KB); the
/// one-row kernels' tiles are their variant's ([`AttnHeadDim::kb`],
/// [`AttnHeadDim::qb`]).
const LANES_KB: usize = 16;

/// Consecutive ranges of `0..t`, each a multiple of `unit` long, such that
/// a thread looping `per_item` iterations per item stays within `budget`.
fn ranges(t: usize, unit: usize, per_item: usize, fixed: usize, budget: usize) -> Vec<(usize, usize)> {
    let n = (budget.saturating_sub(fixed) / per_item.max(1)) / unit * unit;
    let n = n.max(unit).min(t.max(1));
    (0..t.max(1)).step_by(n).map(|s| (s, (s + n).min(t))).collect()
}

/// attention.wgsl's STORE_MAX flag: the LAST dispatch's workgroups store
/// their output's maxima (out, or dv).
const STORE_MAX: u32 = 4;

/// FIRST / LAST flags of range `i` of `n`.
fn flags(i: usize, n: usize) -> u32 {
    (i == 0) as u32 | ((i + 1 == n) as u32) << 1
}

/// Which kernels run attention under the F16 compute precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum F16Attention {
    /// The tensor-core family where the adapter has cooperative matrices
    /// (and the head dimension is one of the family's, and the mask has no
    /// soft cap), else the SIMT kernels on the rounded operands.
    #[default]
    Auto,
    /// The f32 SIMT kernels on the rounded operands (any adapter).
    Simt,
    /// The tensor-core family (the adapter must have cooperative matrices;
    /// a head dimension it has no kernels for is refused, and so is a
    /// soft-capped mask).
    Coop,
    /// The tensor-core family with the cooperative-matrix operations
    /// emulated in plain WGSL (any adapter, slowly; for tests; refused at
    /// a head dimension the family has no kernels for or a soft cap).
    CoopEmulated,
}

pub(crate) struct Dims {
    pub b: usize,
    pub t: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    /// The mask and its window as the kernels take it
    /// ([`AttnMask::kernel_window`]).
    pub mask: AttnMask,
    pub window: u32,
}

impl Dims {
    /// attention_params.wgsl's `softcap`: the cap's bits, 0 for none.
    fn softcap(&self) -> u32 {
        self.mask.softcap.map_or(0, |c| f(c.get()))
    }

    /// The last 8 words of every attention kernel's `Params`: the dropout
    /// of the probabilities (threshold, 0 for none; key; scale; the batch
    /// row of the chunk that starts at `b0`: attention_mask.wgsl's
    /// `drop_factor`), then padding.
    pub(super) fn dropout_params(&self, b0: usize) -> [u32; 8] {
        match &self.mask.dropout {
            None => [0; 8],
            Some(dr) => {
                let [k0, k1] = dr.key();
                let batch0 = dr.batch0().wrapping_add(b0 as u32);
                [dr.threshold(), k0, k1, f(dr.scale() as f32), batch0, 0, 0, 0]
            }
        }
    }
}

impl GpuExecutor {
    pub(crate) fn attn_dims(op: &'static str, [q, k, v]: [&GpuTensor; 3], mask: AttnMask) -> Result<Dims> {
        for x in [q, k, v] {
            need_f32(op, x)?;
        }
        let (qd, kd) = (q.dims(), k.dims());
        if qd.len() != 4 || kd.len() != 4 || k.shape != v.shape {
            return Err(Error::shape(
                op,
                format!("q {}, k {}, v {} must be [B, T, H, D]", q.shape, k.shape, v.shape),
            ));
        }
        if qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3] || kd[2] == 0 || qd[2] % kd[2] != 0 {
            return Err(Error::shape(
                op,
                format!(
                    "q {} and k {}: B, T, D must match and Hq be a multiple of Hkv",
                    q.shape, k.shape
                ),
            ));
        }
        if qd[3] > MAX_HEAD_DIM {
            return Err(Error::invalid(
                op,
                format!(
                    "head dim {} exceeds the attention kernels' largest, {MAX_HEAD_DIM}",
                    qd[3]
                ),
            ));
        }
        mask.check(op, qd[0], qd[1])?;
        Ok(Dims {
            b: qd[0],
            t: qd[1],
            hq: qd[2],
            hkv: kd[2],
            d: qd[3],
            window: mask.kernel_window(qd[1]),
            mask,
        })
    }

    pub(crate) fn attention_impl(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        mask: AttnMask,
    ) -> Result<AttentionOut<GpuTensor>> {
        let d = Self::attn_dims("attention", [q, k, v], mask)?;
        if self.precision == ComputePrecision::F16 {
            let coop = self.coop_attention_kernel("attention", &d)?;
            let xs = [q, k, v];
            let copy = coop.is_none() || self.copy_attention_operands;
            let (r, maxima) = self.round_operands("attention", &xs, &[copy; 3])?;
            let [q, k, v] = [0, 1, 2].map(|i| r[i].as_ref().unwrap_or(xs[i]));
            return match coop {
                Some(emulated) => self.attention_coop(&d, [q, k, v], &maxima, emulated),
                None => self.attention_simt(&d, q, k, v),
            };
        }
        self.attention_simt(&d, q, k, v)
    }

    fn attention_simt(
        &self,
        d: &Dims,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
    ) -> Result<AttentionOut<GpuTensor>> {
        let out = self.alloc_f32(q.shape.clone())?;
        let lse = self.alloc_f32([d.b, d.hq, d.t])?;
        // Running softmax sums between key ranges.
        let lsum = self.alloc_f32([d.b, d.hq, d.t])?;
        let lanes = self.lanes(d);
        let keys = self.key_ranges(d, lanes);
        let (qe, ke, le) = (d.t * d.hq * d.d, d.t * d.hkv * d.d, d.hq * d.t);
        let scale = 1.0 / (d.d as f32).sqrt();
        let rows = d.t.div_ceil(RB);
        let fold = self.folds_maxima();
        let slots = self.maxima_slots(fold, rows * d.hq * d.b)?;
        let docs = self.docs_bounds(d.mask.docs.as_ref())?;
        let docs_view = docs.view(self)?;
        let mut op = self.op("attention");
        for (b0, nb) in self.row_chunks(d.b, &[qe, ke, le])? {
            let [dflag, doff, dends] = docs.params(&docs_view, b0);
            let qv = self.view(q, b0 * qe, nb * qe)?;
            let kv = self.view(k, b0 * ke, nb * ke)?;
            let vv = self.view(v, b0 * ke, nb * ke)?;
            let ov = self.view(&out, b0 * qe, nb * qe)?;
            let lv = self.view(&lse, b0 * le, nb * le)?;
            let sv = self.view(&lsum, b0 * le, nb * le)?;
            let mv = self.maxima_view(&slots, (b0 * rows * d.hq, nb * rows * d.hq), ov)?;
            for (ri, &(r0, r1)) in keys.iter().enumerate() {
                let mut params = [0u32; 32];
                params[24..].copy_from_slice(&d.dropout_params(b0));
                params[..24].copy_from_slice(&[
                    u(d.t),
                    u(d.hq),
                    u(d.hkv),
                    u(d.d),
                    f(scale),
                    qv.elem_off,
                    kv.elem_off,
                    vv.elem_off,
                    ov.elem_off,
                    lv.elem_off,
                    0,
                    0,
                    0,
                    0,
                    sv.elem_off,
                    flags(ri, keys.len()) | if fold { STORE_MAX } else { 0 },
                    u(r0),
                    u(r1),
                    mv.elem_off,
                    d.window,
                    d.softcap(),
                    dflag,
                    doff,
                    dends,
                ]);
                let grid = [rows as u32, d.hq as u32, nb as u32];
                let kernel = match lanes {
                    true => Kernel::AttnFwdLanes { d: u(d.d) },
                    false => Kernel::AttnFwd {
                        d: AttnHeadDim::of(d.d),
                    },
                };
                op.dispatch(kernel, &params, &[qv, kv, vv, ov, lv, sv, mv, docs_view], grid);
            }
        }
        op.finish()?;
        self.remember_maxima_slots(&out, slots);
        Ok(AttentionOut {
            out,
            lse,
            mask: d.mask.clone(),
        })
    }

    pub(crate) fn attention_backward_impl(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        fwd: &AttentionOut<GpuTensor>,
        dout: &GpuTensor,
    ) -> Result<AttentionGrads<GpuTensor>> {
        let name = "attention_backward";
        let d = Self::attn_dims(name, [q, k, v], fwd.mask.clone())?;
        need_f32(name, dout)?;
        if dout.shape != q.shape || fwd.out.shape != q.shape || fwd.lse.numel() != d.b * d.hq * d.t {
            return Err(Error::shape(
                name,
                format!(
                    "dout {}, out {}, lse {} for q {}",
                    dout.shape, fwd.out.shape, fwd.lse.shape, q.shape
                ),
            ));
        }
        if self.precision == ComputePrecision::F16 {
            // dO is read unstaged too (delta = rowsum(dO∘O)): always copied.
            let coop = self.coop_attention_kernel(name, &d)?;
            let xs = [q, k, v, dout];
            let copy = coop.is_none() || self.copy_attention_operands;
            let (r, maxima) = self.round_operands(name, &xs, &[copy, copy, copy, true])?;
            let ops = [0, 1, 2, 3].map(|i| r[i].as_ref().unwrap_or(xs[i]));
            return match coop {
                Some(emulated) => self.attention_backward_coop(&d, ops, fwd, &maxima, emulated),
                None => self.attention_backward_simt(&d, ops[0], ops[1], ops[2], fwd, ops[3]),
            };
        }
        self.attention_backward_simt(&d, q, k, v, fwd, dout)
    }

    fn attention_backward_simt(
        &self,
        d: &Dims,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        fwd: &AttentionOut<GpuTensor>,
        dout: &GpuTensor,
    ) -> Result<AttentionGrads<GpuTensor>> {
        let lanes = self.lanes(d);
        let keys = self.key_ranges(d, lanes);
        let group = d.hq / d.hkv;
        let hd = AttnHeadDim::of(d.d);
        let queries = match lanes {
            // Per query of every head of the group, one loop iteration and
            // a share of the tile's loads.
            true => ranges(d.t, LANES_KB, 2 * group, 2 * d.d, self.loop_budget),
            // Per query of every head of the group, two D-loops and two more.
            false => ranges(d.t, hd.qb(), group * (4 * d.d + 4), 6 * d.d, self.loop_budget),
        };
        let rows = d.t.div_ceil(RB);
        let (dq_kernel, dkv_kernel) = match lanes {
            true => (
                Kernel::AttnDqLanes { d: u(d.d) },
                Kernel::AttnDkvLanes { d: u(d.d) },
            ),
            false => (Kernel::AttnDq { d: hd }, Kernel::AttnDkv { d: hd }),
        };
        let fold = self.folds_maxima();
        let slots = self.maxima_slots(fold, rows * d.hkv * d.b)?;
        let delta = match lanes {
            true => Kernel::AttnDeltaLanes { d: u(d.d) },
            false => Kernel::AttnDelta,
        };
        let grads =
            self.attention_backward_chunks(d, [q, k, v, dout], dout, fwd, delta, false, |op, b0, nb, c| {
                let mv = self.maxima_view(&slots, (b0 * rows * d.hkv, nb * rows * d.hkv), c.dv)?;
                let with = |fl: u32, r0: usize, r1: usize| {
                    let mut p = c.params(d).to_vec();
                    p[15..19].copy_from_slice(&[fl, u(r0), u(r1), mv.elem_off]);
                    p
                };
                for (ri, &(r0, r1)) in keys.iter().enumerate() {
                    let params = with(flags(ri, keys.len()), r0, r1);
                    let views = [c.q, c.k, c.v, c.lse, c.dout, c.dq, c.delta, c.docs];
                    op.dispatch(dq_kernel, &params, &views, [rows as u32, d.hq as u32, nb as u32]);
                }
                for (ri, &(r0, r1)) in queries.iter().enumerate() {
                    let fl = flags(ri, queries.len()) | if fold { STORE_MAX } else { 0 };
                    let params = with(fl, r0, r1);
                    let views = [c.q, c.k, c.v, c.lse, c.dout, c.dk, c.dv, c.delta, mv, c.docs];
                    op.dispatch(
                        dkv_kernel,
                        &params,
                        &views,
                        [rows as u32, d.hkv as u32, nb as u32],
                    );
                }
                Ok(())
            })?;
        self.remember_maxima_slots(&grads.dv, slots);
        Ok(grads)
    }

    /// Whether the f32 attention of `d` runs on the lanes kernels
    /// (attention_lanes.wgsl: a row's D over four subgroup lanes, soft cap
    /// and all).
    fn lanes(&self, d: &Dims) -> bool {
        self.attention_lanes && self.ctx.attention_lanes(d.d)
    }

    /// The key ranges of the forward and dq dispatches (one, except under a
    /// loop budget).
    fn key_ranges(&self, d: &Dims, lanes: bool) -> Vec<(usize, usize)> {
        match lanes {
            // Per key one loop iteration and a share of the tile's loads.
            true => ranges(d.t, LANES_KB, 2, 2 * d.d, self.loop_budget),
            // Per key two D-loops, the key loop's and the tile loop's
            // iterations, and the tile-load share (D / RB a key: 4 at
            // D = 256, taken as at least 2).
            false => ranges(
                d.t,
                AttnHeadDim::of(d.d).kb(),
                2 * d.d + 2 + d.d.div_ceil(RB).max(2),
                4 * d.d,
                self.loop_budget,
            ),
        }
    }

    /// What every attention backward does around its own kernels: allocates
    /// dq, dk, dv and delta, and for each chunk of the batch that fits the
    /// bindings computes delta = rowsum(dO ∘ O) (`delta_kernel`, on
    /// `dout`), then calls `each` with the chunk's first batch, count and views
    /// (dO as the kernels read it from `dout_in`: `dout` itself, or its f16
    /// copy for the tensor-core kernels). With `zero_dq`, dq starts at 0 (for
    /// kernels that add into it).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward_chunks(
        &self,
        d: &Dims,
        [q, k, v, dout]: [&GpuTensor; 4],
        dout_in: &GpuTensor,
        fwd: &AttentionOut<GpuTensor>,
        delta_kernel: Kernel,
        zero_dq: bool,
        mut each: impl FnMut(&mut Op<'_>, usize, usize, &BwdViews<'_>) -> Result<()>,
    ) -> Result<AttentionGrads<GpuTensor>> {
        let dq = self.alloc_f32(q.shape.clone())?;
        let dk = self.alloc_f32(k.shape.clone())?;
        let dv = self.alloc_f32(v.shape.clone())?;
        let delta = self.alloc_f32([d.b, d.hq, d.t])?;
        let (qe, ke, le) = (d.t * d.hq * d.d, d.t * d.hkv * d.d, d.hq * d.t);
        let docs = self.docs_bounds(d.mask.docs.as_ref())?;
        let docs_view = docs.view(self)?;
        let mut op = self.op("attention_backward");
        if zero_dq {
            op.clear(dq.buffer(), dq.byte_len());
        }
        for (b0, nb) in self.row_chunks(d.b, &[qe, ke, le])? {
            let c = BwdViews {
                q: self.view(q, b0 * qe, nb * qe)?,
                k: self.view(k, b0 * ke, nb * ke)?,
                v: self.view(v, b0 * ke, nb * ke)?,
                o: self.view(&fwd.out, b0 * qe, nb * qe)?,
                lse: self.view(&fwd.lse, b0 * le, nb * le)?,
                dout: self.view(dout, b0 * qe, nb * qe)?,
                dout_in: self.view(dout_in, b0 * qe, nb * qe)?,
                dq: self.view(&dq, b0 * qe, nb * qe)?,
                dk: self.view(&dk, b0 * ke, nb * ke)?,
                dv: self.view(&dv, b0 * ke, nb * ke)?,
                delta: self.view(&delta, b0 * le, nb * le)?,
                docs: docs_view,
                docs_params: docs.params(&docs_view, b0),
                b0,
            };
            let mut params = c.params(d);
            params[15..18].copy_from_slice(&[3, 0, u(d.t)]);
            op.dispatch(
                delta_kernel,
                &params,
                &[c.o, c.dout, c.delta],
                [d.t.div_ceil(RB) as u32, d.hq as u32, nb as u32],
            );
            each(&mut op, b0, nb, &c)?;
        }
        op.finish()?;
        Ok(AttentionGrads { dq, dk, dv })
    }
}

/// The views of one batch chunk that an attention backward binds.
pub(super) struct BwdViews<'a> {
    pub q: View<'a>,
    pub k: View<'a>,
    pub v: View<'a>,
    pub o: View<'a>,
    pub lse: View<'a>,
    pub dout: View<'a>,
    pub dout_in: View<'a>,
    pub dq: View<'a>,
    pub dk: View<'a>,
    pub dv: View<'a>,
    pub delta: View<'a>,
    /// The documents' bounds, and attention_mask.wgsl's parameters for
    /// them from this chunk's first row.
    pub docs: View<'a>,
    pub docs_params: [u32; 3],
    /// The chunk's first batch row.
    pub b0: usize,
}

impl BwdViews<'_> {
    /// attention.wgsl's `Params` for these views, key or query range,
    /// flags and maxima slot (15..19) left zero.
    fn params(&self, d: &Dims) -> [u32; 32] {
        let mut p = [0u32; 32];
        p[..5].copy_from_slice(&[u(d.t), u(d.hq), u(d.hkv), u(d.d), f(1.0 / (d.d as f32).sqrt())]);
        p[19] = d.window;
        p[20] = d.softcap();
        p[21..24].copy_from_slice(&self.docs_params);
        p[24..].copy_from_slice(&d.dropout_params(self.b0));
        let offs = [
            self.q, self.k, self.v, self.o, self.lse, self.dout, self.dq, self.dk, self.dv, self.delta,
        ];
        for (i, v) in offs.iter().enumerate() {
            p[5 + i] = v.elem_off;
        }
        p
    }
}
