//! The gated delta rule (Qwen3-Next's linear attention, and Kimi Linear's
//! KDA where g decays each key channel on its own) on delta_rule.wgsl's
//! SIMT kernels, in f32 whatever the compute precision: the recurrence
//! carries every rounding through the whole sequence.
//!
//! A workgroup owns 32 state columns of one (batch, value head), so a
//! 128×128 state runs on 4 workgroups with its block in registers. Memory
//! (f32, C = [`DELTA_RULE_CHUNK`], NB = ⌈Dv/32⌉):
//! - `saved`: `4·B·Hv·⌈T/C⌉·Dk·Dv` bytes (the state at every chunk start;
//!   1 GiB at B·T = 8×4096, Hv = 32, Dk = Dv = 128, twice `out`; 32 KiB a
//!   token, the largest of a sequence's tensors, so at Qwen3.5-9B's heads
//!   NVIDIA's 2 GiB − 1 bindings take sequences of up to about 65,000
//!   tokens);
//! - the backward's scratch, `4·Hv·NB·32·(C·Dk + C + Dk)` bytes a batch of
//!   a piece (the replayed chunk's states, its Sᵀk and the dS handed
//!   between dispatches: 131 MiB at Hv = 32, Dk = Dv = 128), and its
//!   partials, `4·W·Hv·NB·(2·Dk + G + 1)` bytes a batch for a time window
//!   of W steps, G = 1 for a decay per head, Dk per key channel (dq and dk
//!   per value head and column block before their sums, dg per column
//!   block and decay, dβ per column block: 130 KiB a step at those heads,
//!   193 KiB per channel). The backward walks the sequence last window to
//!   first, summing each window's partials into its rows of dq, dk, dg and
//!   dβ before the next, so they no longer grow with T: W is the most
//!   whole chunks whose partials for a piece's batches fit one binding (at
//!   most T; about 2000 steps for 8 batches at those heads on NVIDIA, 1344
//!   per channel), and one chunk's take at most a sixteenth of the scratch
//!   (a tenth per channel), so they fit wherever it does.
//!
//! With documents packed in the rows both kernels bind their bounds, and
//! the state restarts from zero at each document's first step.
//!
//! Whole batches are bound at a time, as many as every binding holds; a
//! batch whose q/k, v, gates, saved states or scratch outgrow one binding
//! is refused, naming the longest sequence that would fit.

use megatrain_tensor::{
    DELTA_RULE_CHUNK, DeltaRuleDims, DeltaRuleGrads, DeltaRuleOut, Docs, Result, delta_rule_dims,
};

use super::{GpuExecutor, grid_for, need_f32, u};
use crate::GpuError;
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// State columns per workgroup (delta_rule.wgsl's COLS).
const COLS: usize = 32;
/// The largest Dk the kernels' register blocks hold (RG · NR).
const MAX_DK: usize = 128;
/// An upper bound on the loop iterations one step costs an invocation
/// (replay and reverse walk together), for splitting chunks over dispatches
/// under llvmpipe's loop budget.
const STEP_LOOPS: usize = 400;

/// Elements one batch takes in each kind of binding: q/k, v/out/dout,
/// g (beta its first `T·Hv` where g is per channel), saved, the backward's
/// scratch, and its partials of the shortest window (one chunk, or the
/// sequence where shorter): pieces hold at least that, and
/// [`GpuExecutor::delta_rule_window`] widens it.
fn per_batch(d: DeltaRuleDims) -> [usize; 6] {
    let nb = d.dv.div_ceil(COLS);
    [
        d.t * d.hk * d.dk,
        d.t * d.hv * d.dv,
        d.t * d.hv * d.decays(),
        d.hv * d.chunks() * d.dk * d.dv,
        d.hv * nb * COLS * (DELTA_RULE_CHUNK * d.dk + DELTA_RULE_CHUNK + d.dk),
        d.t.min(DELTA_RULE_CHUNK) * step_parts(d),
    ]
}

/// The backward's partials of one step of one batch: dq and dk
/// `[Hk, grp·NB, Dk]` each, dg `[Hv, NB, decays]`, dβ `[Hv, NB]`.
fn step_parts(d: DeltaRuleDims) -> usize {
    let nb = d.dv.div_ceil(COLS);
    2 * d.hk * d.group() * nb * d.dk + d.hv * nb * (d.decays() + 1)
}

impl GpuExecutor {
    fn delta_rule_check(&self, op: &'static str, d: DeltaRuleDims) -> Result<()> {
        if d.dk > MAX_DK {
            return Err(GpuError::Unsupported {
                op,
                detail: format!("key heads of {} (the kernels hold at most {MAX_DK})", d.dk),
            }
            .into());
        }
        Ok(())
    }

    /// Chunk ranges one dispatch each covering chunks `c0..c1`, first to
    /// last, each within the loop budget (all of them in one where there is
    /// none). The backward asks per time window, so no dispatch writes
    /// partials of two windows.
    fn delta_rule_ranges(&self, c0: usize, c1: usize) -> Vec<(usize, usize)> {
        let per = (self.loop_budget / (DELTA_RULE_CHUNK * STEP_LOOPS)).max(1);
        (c0..c1).step_by(per).map(|c| (c, (c + per).min(c1))).collect()
    }

    /// The backward's time window in steps for pieces of at most `nb`
    /// batches: the most whole chunks whose partials for `nb` batches fit
    /// one binding, at most the whole sequence (pieces are cut so that one
    /// chunk fits). Results do not depend on it, bit for bit: a window only
    /// moves where a step's partials sit, their sums keep their order, and
    /// dS crosses windows as it crosses dispatches, through the scratch.
    fn delta_rule_window(&self, d: DeltaRuleDims, nb: usize) -> usize {
        let room = (self.max_binding.saturating_sub(self.align) / 4) as usize;
        let chunk = (nb * DELTA_RULE_CHUNK * step_parts(d)).max(1);
        ((room / chunk).max(1) * DELTA_RULE_CHUNK).min(d.t)
    }

    /// A refusal naming what of one sequence outgrows a storage binding,
    /// and what would fit: binding the op's tensors by whole sequences, a
    /// sequence's q/k, v, gates and saved states grow with T (at
    /// Qwen3.5-9B's heads the saved states, 32 KiB a token, pass NVIDIA's
    /// 2 GiB − 1 near 65,000 tokens), the replay scratch with the heads
    /// alone. The backward's partials are not named: they take a time
    /// window ([`GpuExecutor::delta_rule_window`]), and one chunk's are at
    /// most a sixteenth of the scratch.
    fn delta_rule_fits(&self, op: &'static str, d: DeltaRuleDims) -> Result<()> {
        let room = self.max_binding.saturating_sub(self.align);
        let names = [
            "q or k",
            "v or output",
            "gates",
            "saved states",
            "backward replay scratch",
        ];
        for (i, (name, elems)) in names.iter().zip(per_batch(d)).enumerate() {
            let bytes = 4 * elems as u64;
            if bytes <= room {
                continue;
            }
            let fits = match i {
                4 => "fewer or narrower value heads would".to_string(),
                _ => {
                    let per_token = bytes.div_ceil(d.t.max(1) as u64).max(1);
                    let chunks = DELTA_RULE_CHUNK as u64;
                    let most = match i {
                        // Saved states grow a chunk at a time.
                        3 => room / (bytes / d.chunks().max(1) as u64).max(1) * chunks,
                        _ => room / per_token,
                    };
                    format!("sequences of at most {most} tokens would")
                }
            };
            return Err(GpuError::Unsupported {
                op,
                detail: format!(
                    "one sequence's {name} take {bytes} bytes (T = {}, Hv = {}, Dk = {}, Dv = {}), past this \
                     adapter's storage binding limit of {} bytes: {fits} fit",
                    d.t, d.hv, d.dk, d.dv, self.max_binding
                ),
            }
            .into());
        }
        Ok(())
    }

    /// Batch pieces `(b0, nb)` whose every binding fits, at most 65535
    /// batches (one grid dimension) each.
    fn delta_rule_pieces(&self, d: DeltaRuleDims) -> Result<Vec<(usize, usize)>> {
        let mut out = Vec::new();
        for (b0, n) in self.row_chunks(d.b, &per_batch(d))? {
            out.extend((b0..b0 + n).step_by(65535).map(|s| (s, (b0 + n - s).min(65535))));
        }
        Ok(out)
    }

    pub(crate) fn gated_delta_rule_impl(
        &self,
        x: [&GpuTensor; 5],
        docs: Option<&Docs>,
    ) -> Result<DeltaRuleOut<GpuTensor>> {
        const OP: &str = "gated_delta_rule";
        x.iter().try_for_each(|t| need_f32(OP, t))?;
        let d = delta_rule_dims(OP, x.map(|t| &t.shape), None)?;
        if let Some(docs) = docs {
            docs.check(OP, d.b, d.t)?;
        }
        let docs = docs.cloned();
        self.delta_rule_check(OP, d)?;
        self.delta_rule_fits(OP, d)?;
        let [q, k, v, g, beta] = x;
        let out = self.alloc_f32(v.shape.clone())?;
        let saved = self.alloc_f32(d.saved_shape())?;
        if out.numel() == 0 {
            return Ok(DeltaRuleOut { out, saved, docs });
        }
        let [nq, nv, ng, ns, _, _] = per_batch(d);
        let nbeta = d.t * d.hv;
        let bounds = self.docs_bounds(docs.as_ref())?;
        let mut op = self.op(OP);
        for (b0, nb) in self.delta_rule_pieces(d)? {
            let docs_view = bounds.starts_view(self, b0 * d.t, nb * d.t)?;
            let views = [
                self.view(q, b0 * nq, nb * nq)?,
                self.view(k, b0 * nq, nb * nq)?,
                self.view(v, b0 * nv, nb * nv)?,
                self.view(g, b0 * ng, nb * ng)?,
                self.view(beta, b0 * nbeta, nb * nbeta)?,
                self.view(&out, b0 * nv, nb * nv)?,
                self.view(&saved, b0 * ns, nb * ns)?,
                docs_view,
            ];
            let offs = views.map(|v| v.elem_off);
            let dp = [u(bounds.some() as usize), docs_view.elem_off];
            for (c0, c1) in self.delta_rule_ranges(0, d.chunks()) {
                let mut params = params(d, nb, &offs, [0, 0], (c0, c1), (0, 0), [0; 6]);
                params[30..].copy_from_slice(&dp);
                op.dispatch(
                    Kernel::DeltaRuleFwd,
                    &params,
                    &views,
                    [u(d.dv.div_ceil(COLS)), u(d.hv), u(nb)],
                );
            }
        }
        op.finish()?;
        Ok(DeltaRuleOut { out, saved, docs })
    }

    pub(crate) fn gated_delta_rule_backward_impl(
        &self,
        x: [&GpuTensor; 5],
        fwd: &DeltaRuleOut<GpuTensor>,
        dout: &GpuTensor,
    ) -> Result<DeltaRuleGrads<GpuTensor>> {
        const OP: &str = "gated_delta_rule_backward";
        x.iter()
            .chain([&&fwd.out, &&fwd.saved, &dout])
            .try_for_each(|t| need_f32(OP, t))?;
        let d = delta_rule_dims(
            OP,
            x.map(|t| &t.shape),
            Some([&fwd.out.shape, &fwd.saved.shape, &dout.shape]),
        )?;
        self.delta_rule_check(OP, d)?;
        self.delta_rule_fits(OP, d)?;
        if let Some(docs) = &fwd.docs {
            docs.check(OP, d.b, d.t)?;
        }
        let [q, k, v, g, beta] = x;
        let grads = DeltaRuleGrads {
            dq: self.alloc_f32(q.shape.clone())?,
            dk: self.alloc_f32(k.shape.clone())?,
            dv: self.alloc_f32(v.shape.clone())?,
            dg: self.alloc_f32(g.shape.clone())?,
            dbeta: self.alloc_f32(beta.shape.clone())?,
        };
        if grads.dv.numel() == 0 {
            return Ok(grads);
        }
        let [nq, nv, ng, ns, nscratch, _] = per_batch(d);
        let nbeta = d.t * d.hv;
        let pieces = self.delta_rule_pieces(d)?;
        let most = pieces.iter().map(|p| p.1).max().unwrap_or(0);
        let w = self.delta_rule_window(d, most);
        let scratch = self.alloc_f32([most * nscratch])?;
        let parts = self.alloc_f32([most * w * step_parts(d)])?;
        let cols = d.dv.div_ceil(COLS);
        let bounds = self.docs_bounds(fwd.docs.as_ref())?;
        let mut op = self.op(OP);
        for (b0, nb) in pieces {
            let docs_view = bounds.starts_view(self, b0 * d.t, nb * d.t)?;
            let views = [
                self.view(q, b0 * nq, nb * nq)?,
                self.view(k, b0 * nq, nb * nq)?,
                self.view(v, b0 * nv, nb * nv)?,
                self.view(g, b0 * ng, nb * ng)?,
                self.view(beta, b0 * nbeta, nb * nbeta)?,
                self.view(&grads.dv, b0 * nv, nb * nv)?,
                self.view(&fwd.saved, b0 * ns, nb * ns)?,
                self.view(dout, b0 * nv, nb * nv)?,
                self.view(&scratch, 0, nb * nscratch)?,
                self.view(&parts, 0, nb * w * step_parts(d))?,
                docs_view,
            ];
            let offs = views.map(|v| v.elem_off);
            let dp = [u(bounds.some() as usize), docs_view.elem_off];
            // Windows last to first, as the chunks go; `w` is whole chunks
            // unless it is the whole sequence.
            for t0 in (0..d.t).step_by(w).rev() {
                let t1 = (t0 + w).min(d.t);
                let win = (t0, w);
                let chunks = (t0 / DELTA_RULE_CHUNK, t1.div_ceil(DELTA_RULE_CHUNK));
                for (c0, c1) in self.delta_rule_ranges(chunks.0, chunks.1).into_iter().rev() {
                    let mut params = params(d, nb, &offs, [offs[8], offs[9]], (c0, c1), win, [0; 6]);
                    params[30..].copy_from_slice(&dp);
                    op.dispatch(Kernel::DeltaRuleBwd, &params, &views, [u(cols), u(d.hv), u(nb)]);
                }
                // The window's partials (delta_rule.wgsl's dr_bwd: [nb, w,
                // ..] in each region) summed into rows t0..t1 of each batch,
                // which lie T rows apart. Per kind: elements a step, the
                // width of a row and its partials.
                let key = (d.hk * d.dk, d.dk, d.group() * cols);
                let gate = (d.hv * d.decays(), d.decays(), cols);
                let beta = (d.hv, 1, cols);
                let region = nb * w * key.0 * key.2;
                let sums = [
                    (&grads.dq, b0 * nq, 0, key),
                    (&grads.dk, b0 * nq, region, key),
                    (&grads.dg, b0 * ng, 2 * region, gate),
                    (
                        &grads.dbeta,
                        b0 * nbeta,
                        2 * region + nb * w * gate.0 * gate.2,
                        beta,
                    ),
                ];
                for (y, y0, at, (step, width, np)) in sums {
                    // A batch's window, and its batch strides in y and in
                    // the partials.
                    let (n, ystride, pstride) = ((t1 - t0) * step, d.t * step, w * step * np);
                    let yv = self.view(y, y0 + t0 * step, (nb - 1) * ystride + n)?;
                    let gs = [u(n), u(width), u(np), yv.elem_off, u(ystride), u(pstride)];
                    let params = params(d, nb, &[0; 10], [0, offs[9] + u(at)], (0, 0), (0, 0), gs);
                    op.dispatch(
                        Kernel::DeltaRuleGroupSum,
                        &params,
                        &[views[9], yv],
                        grid_for((nb * n).div_ceil(256)),
                    );
                }
            }
        }
        op.keep(scratch);
        op.keep(parts);
        op.finish()?;
        Ok(grads)
    }
}

/// delta_rule.wgsl's `Params`: the sizes, the element offsets of the bound
/// q, k, v, g, beta, out (or dv), saved and dout, then those of the
/// scratch and partials, the chunk range, dr_group_sum's `(n, w, p, y_off,
/// y_stride, parts_stride)`, the backward's time window `(t0, w)` and the
/// decays a step and head (`gw`: 1, or Dk per key channel); the
/// documents' `docs` and `docs_off` are left 0 (none) for the caller.
fn params(
    d: DeltaRuleDims,
    nbatch: usize,
    offs: &[u32],
    [scratch, parts]: [u32; 2],
    (c0, c1): (usize, usize),
    (w0, w): (usize, usize),
    gs: [u32; 6],
) -> [u32; 32] {
    let off = |i: usize| offs.get(i).copied().unwrap_or(0);
    [
        u(d.t),
        u(d.hk),
        u(d.hv),
        u(d.dk),
        u(d.dv),
        u(d.group()),
        u(d.dv.div_ceil(COLS)),
        u(d.chunks()),
        off(0),
        off(1),
        off(2),
        off(3),
        off(4),
        off(5),
        off(6),
        off(7),
        scratch,
        parts,
        u(nbatch),
        u(c0),
        u(c1),
        gs[0],
        gs[1],
        gs[2],
        gs[3],
        gs[4],
        gs[5],
        u(w0),
        u(w),
        u(d.decays()),
        0,
        0,
    ]
}
