//! The gated delta net's short convolution (conv1d.wgsl): a depthwise
//! causal conv1d then SiLU over rows of `x: [B, T, C]`, bound in chunks of
//! rows with the K − 1 rows the taps reach past each chunk's edge. The
//! backward stores the pre-activation's gradient once (dx and dw each read
//! it at K rows), and sums dw from partials per block of rows by the
//! column sums (`sum_rows`: a fixed order, no atomics). With documents
//! packed in the rows every kernel also binds their bounds, and a document
//! is a sequence of its own.

use megatrain_tensor::{Docs, Result, causal_conv1d_dims};

use super::docs::DocsBounds;
use super::{GpuExecutor, Op, View, grid_for, need_f32, u};
use crate::GpuError;
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// Blocks of rows dw's partials are summed in at most (each thread walks
/// one block): enough threads for a large GPU at C·K in the thousands,
/// partials a small fraction of x.
const DW_BLOCKS: usize = 256;

/// One chunk's place: rows `r0 .. r0 + nr` of the `rows` of `[B, T, C]`,
/// with `hl` rows of x before it bound for the taps.
#[derive(Clone, Copy)]
struct Chunk {
    r0: usize,
    nr: usize,
    hl: usize,
}

impl GpuExecutor {
    /// The most rows a kernel loop here may walk (llvmpipe's budget).
    fn conv_loop_cap(&self) -> usize {
        self.loop_budget.saturating_sub(64).max(1)
    }

    /// Chunks of `rows` rows of `c` floats whose x with the K − 1 rows
    /// before (and the pre-activation's gradient with the K − 1 after) fit
    /// one binding, each a whole number of `blk` rows, and whose blocks'
    /// dw partials (C·K floats a block) fit one too.
    fn conv_chunks(
        &self,
        op: &'static str,
        rows: usize,
        c: usize,
        k: usize,
        blk: usize,
    ) -> Result<Vec<Chunk>> {
        let room = (self.max_binding_bytes().saturating_sub(self.align) / 4) as usize;
        let by_rows = (room / c.max(1)).saturating_sub(k - 1);
        let by_partials = (room / (c * k).max(1)) * blk;
        let per = by_rows.min(by_partials) / blk * blk;
        if per == 0 {
            return Err(GpuError::Unsupported {
                op,
                detail: format!(
                    "{blk} rows of {c} channels and their {k} taps exceed the storage binding limit of {} bytes",
                    self.max_binding_bytes()
                ),
            }
            .into());
        }
        Ok((0..rows)
            .step_by(per)
            .map(|r0| Chunk {
                r0,
                nr: per.min(rows - r0),
                hl: r0.min(k - 1),
            })
            .collect())
    }

    /// The documents' starts of the chunk's rows and the K − 1 after them
    /// (those `conv_dx` looks ahead to), and conv1d.wgsl's `docs` and
    /// `docs_off`: no more words than the chunk's x has floats a channel.
    fn conv_docs<'a>(
        &'a self,
        docs: &'a DocsBounds,
        rows: usize,
        k: usize,
        ch: Chunk,
    ) -> Result<(View<'a>, [u32; 2])> {
        let n = (ch.r0 + ch.nr + k - 1).min(rows) - ch.r0;
        let v = docs.starts_view(self, ch.r0, n)?;
        Ok((v, [u(docs.some() as usize), v.elem_off]))
    }

    /// Refuses more taps than a kernel loop may walk on this device.
    fn conv_taps_fit(&self, op: &'static str, k: usize) -> Result<()> {
        if k > self.conv_loop_cap() {
            return Err(GpuError::Unsupported {
                op,
                detail: format!("{k} taps exceed the device's loop budget"),
            }
            .into());
        }
        Ok(())
    }

    /// `conv_silu` or `conv_dpre` (with `dy`) over one chunk into `y`,
    /// within `docs`.
    #[allow(clippy::too_many_arguments)]
    fn conv_pre_pass(
        &self,
        op: &mut Op<'_>,
        kernel: Kernel,
        [b, t, c, k]: [usize; 4],
        ch: Chunk,
        x: &GpuTensor,
        w: &GpuTensor,
        dy: Option<&GpuTensor>,
        y: &GpuTensor,
        docs: &DocsBounds,
    ) -> Result<()> {
        let (docs, [dflag, doff]) = self.conv_docs(docs, b * t, k, ch)?;
        let n = ch.nr * c;
        let xv = self.view(x, (ch.r0 - ch.hl) * c, (ch.nr + ch.hl) * c)?;
        let wv = self.full(w)?;
        let yv = self.view(y, ch.r0 * c, n)?;
        let dv = dy.map(|d| self.view(d, ch.r0 * c, n)).transpose()?;
        let params = [
            u(n),
            u(c),
            u(k),
            u(t),
            u(ch.r0),
            u(ch.hl),
            u(ch.nr),
            0,
            xv.elem_off,
            wv.elem_off,
            dv.map_or(0, |v| v.elem_off),
            yv.elem_off,
            dflag,
            doff,
            0,
            0,
        ];
        let views = match dv {
            Some(dv) => vec![xv, wv, dv, yv, docs],
            None => vec![xv, wv, yv, docs],
        };
        op.dispatch(kernel, &params, &views, grid_for(n.div_ceil(256)));
        Ok(())
    }

    pub(crate) fn causal_conv1d_silu_impl(
        &self,
        x: &GpuTensor,
        w: &GpuTensor,
        docs: Option<&Docs>,
    ) -> Result<GpuTensor> {
        const OP: &str = "causal_conv1d_silu";
        need_f32(OP, x)?;
        need_f32(OP, w)?;
        let dims = causal_conv1d_dims(OP, &x.shape, &w.shape, None, docs)?;
        let [b, t, c, k] = dims;
        self.conv_taps_fit(OP, k)?;
        let y = self.alloc_f32(x.shape.clone())?;
        if y.numel() == 0 {
            return Ok(y);
        }
        let docs = self.docs_bounds(docs)?;
        let mut op = self.op(OP);
        for ch in self.conv_chunks(OP, b * t, c, k, 1)? {
            self.conv_pre_pass(&mut op, Kernel::ConvSilu, dims, ch, x, w, None, &y, &docs)?;
        }
        op.finish()?;
        Ok(y)
    }

    /// `(dx, dw)`: the pre-activation's gradient `d = dy · silu'(pre)`
    /// into a tensor of x's shape, then per chunk dx from d (each row
    /// reading the K − 1 after it) and dw's partials of blocks of rows,
    /// whose column sums are dw.
    pub(crate) fn causal_conv1d_silu_backward_impl(
        &self,
        x: &GpuTensor,
        w: &GpuTensor,
        dy: &GpuTensor,
        docs: Option<&Docs>,
    ) -> Result<(GpuTensor, GpuTensor)> {
        const OP: &str = "causal_conv1d_silu_backward";
        for t in [x, w, dy] {
            need_f32(OP, t)?;
        }
        let dims = causal_conv1d_dims(OP, &x.shape, &w.shape, Some(&dy.shape), docs)?;
        let [b, t, c, k] = dims;
        self.conv_taps_fit(OP, k)?;
        let dx = self.alloc_f32(x.shape.clone())?;
        let rows = b * t;
        if dx.numel() == 0 {
            return Ok((dx, self.zeros_f32(w.shape.clone())?));
        }
        let blk = rows.div_ceil(DW_BLOCKS).min(self.conv_loop_cap());
        let chunks = self.conv_chunks(OP, rows, c, k, blk)?;
        let ck = c * k;
        let d = self.alloc_f32(x.shape.clone())?;
        let part = self.alloc_f32([rows.div_ceil(blk), ck])?;
        let docs = self.docs_bounds(docs)?;
        let mut op = self.op(OP);
        for &ch in &chunks {
            self.conv_pre_pass(&mut op, Kernel::ConvDpre, dims, ch, x, w, Some(dy), &d, &docs)?;
        }
        for &ch in &chunks {
            let (docs_view, [dflag, doff]) = self.conv_docs(&docs, rows, k, ch)?;
            let n = ch.nr * c;
            let after = (ch.r0 + ch.nr + k - 1).min(rows) - ch.r0;
            let xv = self.view(x, (ch.r0 - ch.hl) * c, (ch.nr + ch.hl) * c)?;
            let wv = self.full(w)?;
            let dv = self.view(&d, ch.r0 * c, after * c)?;
            let yv = self.view(&dx, ch.r0 * c, n)?;
            let params = [
                u(n),
                u(c),
                u(k),
                u(t),
                u(ch.r0),
                u(ch.hl),
                u(ch.nr),
                0,
                0,
                wv.elem_off,
                dv.elem_off,
                yv.elem_off,
                dflag,
                doff,
                0,
                0,
            ];
            op.dispatch(
                Kernel::ConvDx,
                &params,
                &[wv, dv, yv, docs_view],
                grid_for(n.div_ceil(256)),
            );
            let blocks = ch.nr.div_ceil(blk);
            let pv = self.view(&part, ch.r0 / blk * ck, blocks * ck)?;
            let params = [
                u(blocks * ck),
                u(c),
                u(k),
                u(t),
                u(ch.r0),
                u(ch.hl),
                u(ch.nr),
                u(blk),
                xv.elem_off,
                0,
                dv.elem_off,
                pv.elem_off,
                dflag,
                doff,
                0,
                0,
            ];
            op.dispatch(
                Kernel::ConvDwPart,
                &params,
                &[xv, dv, pv, docs_view],
                grid_for((blocks * ck).div_ceil(256)),
            );
        }
        op.keep(d);
        op.finish()?;
        let dw = self.sum_rows(&part, ck)?;
        let dw = self.reshape_impl(&dw, &w.shape)?;
        Ok((dx, dw))
    }
}
