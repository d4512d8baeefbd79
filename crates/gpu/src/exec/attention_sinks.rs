//! GPT-OSS's attention sinks (attention_sinks.wgsl): the plain attention's
//! rows scaled by σ(lse − sink), and the backward's dout scaled the same,
//! with the sinks' gradient summed from per-row terms by the column sums
//! (`sum_rows`: a fixed order, no atomics).

use megatrain_tensor::{AttentionOut, Result, attention_sinks_dims};

use super::{GpuExecutor, grid_for, need_f32, u};
use crate::GpuError;
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// Batches `b0..b0 + nb` of an attention output, rows `t0..t0 + nt` of
/// each.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    b0: usize,
    nb: usize,
    t0: usize,
    nt: usize,
}

impl Chunk {
    /// The chunk's first row and row count in O's order (b, t, h).
    fn rows(self, t: usize, hq: usize) -> (usize, usize) {
        ((self.b0 * t + self.t0) * hq, self.nb * self.nt * hq)
    }
}

impl GpuExecutor {
    /// Chunks of O `[B, T, Hq, D]` that fit a binding: as many whole
    /// batches as fit, or where one batch does not (B = 1 at long T),
    /// rows of one batch at a time. Each binds its batches' whole lse
    /// slabs (`[Hq, T]`, far smaller than their rows of O), so a row finds
    /// its lse from its place in the chunk.
    fn sink_chunks(&self, [b, t, hq, d]: [usize; 4]) -> Result<Vec<Chunk>> {
        let (batch, slab) = (t * hq * d, hq * t);
        let room = self.max_binding_bytes().saturating_sub(self.align) / 4;
        if batch.max(slab) as u64 <= room {
            let chunks = self.row_chunks(b, &[batch, slab])?;
            return Ok(chunks
                .into_iter()
                .map(|(b0, nb)| Chunk { b0, nb, t0: 0, nt: t })
                .collect());
        }
        let mut out = Vec::new();
        for b0 in 0..b {
            for (t0, nt) in self.row_chunks(t, &[hq * d])? {
                out.push(Chunk { b0, nb: 1, t0, nt });
            }
        }
        Ok(out)
    }

    /// `x · σ(lse − sink)` row by row, `x` of O's shape.
    fn sink_scale(
        &self,
        op_name: &'static str,
        x: &GpuTensor,
        lse: &GpuTensor,
        sinks: &GpuTensor,
        dims: [usize; 4],
    ) -> Result<GpuTensor> {
        let y = self.alloc_f32(x.shape.clone())?;
        if y.numel() == 0 {
            return Ok(y);
        }
        let [_, t, hq, d] = dims;
        let sv = self.full(sinks)?;
        let mut op = self.op(op_name);
        for c in self.sink_chunks(dims)? {
            let (r0, rows) = c.rows(t, hq);
            let n = rows * d;
            let xv = self.view(x, r0 * d, n)?;
            let lv = self.view(lse, c.b0 * hq * t, c.nb * hq * t)?;
            let yv = self.view(&y, r0 * d, n)?;
            let params = [
                u(n),
                u(t),
                u(hq),
                u(d),
                u(c.t0),
                u(c.nt),
                xv.elem_off,
                lv.elem_off,
                sv.elem_off,
                0,
                yv.elem_off,
                0,
            ];
            op.dispatch(
                Kernel::AttnSinkScale,
                &params,
                &[xv, lv, sv, yv],
                grid_for(n.div_ceil(256)),
            );
        }
        op.finish()?;
        Ok(y)
    }

    pub(crate) fn attention_sinks_impl(
        &self,
        fwd: &AttentionOut<GpuTensor>,
        sinks: &GpuTensor,
    ) -> Result<GpuTensor> {
        const OP: &str = "attention_sinks";
        for x in [&fwd.out, &fwd.lse, sinks] {
            need_f32(OP, x)?;
        }
        let dims = attention_sinks_dims(OP, &fwd.out.shape, &fwd.lse.shape, &sinks.shape, None)?;
        self.sink_scale(OP, &fwd.out, &fwd.lse, sinks, dims)
    }

    /// `(σ · dout, dsinks)`: the scale as the forward's, then one term per
    /// row, `−(dout · out)(1 − σ)` into `[B·T, Hq]`, whose column sums are
    /// the sinks' gradient.
    pub(crate) fn attention_sinks_backward_impl(
        &self,
        out: &GpuTensor,
        lse: &GpuTensor,
        sinks: &GpuTensor,
        dout: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        const OP: &str = "attention_sinks_backward";
        for x in [out, lse, sinks, dout] {
            need_f32(OP, x)?;
        }
        let dims = attention_sinks_dims(OP, &out.shape, &lse.shape, &sinks.shape, Some(&dout.shape))?;
        let [b, t, hq, d] = dims;
        // sink_rows walks a row in one loop, which llvmpipe would end
        // early past its budget (a head dimension is far below it).
        if d > self.loop_budget.saturating_sub(64) {
            return Err(GpuError::Unsupported {
                op: OP,
                detail: format!("rows of {d} elements exceed the device's loop budget"),
            }
            .into());
        }
        let dx = self.sink_scale(OP, dout, lse, sinks, dims)?;
        if out.numel() == 0 {
            return Ok((dx, self.zeros_f32([hq])?));
        }
        let terms = self.alloc_f32([b * t, hq])?;
        let sv = self.full(sinks)?;
        let mut op = self.op(OP);
        for c in self.sink_chunks(dims)? {
            let (r0, rows) = c.rows(t, hq);
            let ov = self.view(out, r0 * d, rows * d)?;
            let lv = self.view(lse, c.b0 * hq * t, c.nb * hq * t)?;
            let gv = self.view(dout, r0 * d, rows * d)?;
            let yv = self.view(&terms, r0, rows)?;
            let params = [
                u(rows),
                u(t),
                u(hq),
                u(d),
                u(c.t0),
                u(c.nt),
                ov.elem_off,
                lv.elem_off,
                sv.elem_off,
                gv.elem_off,
                yv.elem_off,
                0,
            ];
            op.dispatch(
                Kernel::AttnSinkRows,
                &params,
                &[ov, lv, sv, gv, yv],
                grid_for(rows.div_ceil(256)),
            );
        }
        op.finish()?;
        let dsinks = self.sum_rows(&terms, hq)?;
        Ok((dx, dsinks))
    }
}
