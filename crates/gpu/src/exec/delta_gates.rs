//! The gated delta rule's gates (activation.wgsl's `delta_gates`,
//! `delta_gates_bwd`): elementwise over rows of the decays' H heads or
//! H·Dk key channels and the rates' H heads, the `[H·Dk]` parameters bound
//! whole beside each chunk of rows; their gradients summed over rows as
//! column sums (`sum_rows`: a fixed order, no atomics).

use megatrain_tensor::{Result, delta_gates_dims};

use super::{GpuExecutor, View, grid_for, need_f32, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

impl GpuExecutor {
    /// Runs `kernel` over `rows` rows, a thread per element of the widest:
    /// `rowwise` (tensors, each with its elements per row) in chunks of
    /// whole rows, so that an element's place in its row is its index mod
    /// the row's width, and `params` (the `[H·Dk]` parameters) whole; the
    /// kernel's bindings take them in `order` (indices into `rowwise` then
    /// `params`); `words(rows, row_offsets, param_offsets)` builds
    /// activation.wgsl's parameter block for a chunk of `rows` rows.
    #[allow(clippy::too_many_arguments)]
    fn run_heads(
        &self,
        name: &'static str,
        kernel: Kernel,
        rows: usize,
        rowwise: &[(&GpuTensor, usize)],
        params: &[&GpuTensor],
        order: &[usize],
        words: impl Fn(usize, &[u32], &[u32]) -> Vec<u32>,
    ) -> Result<()> {
        let whole: Vec<View<'_>> = params.iter().map(|t| self.full(t)).collect::<Result<_>>()?;
        let poffs: Vec<u32> = whole.iter().map(|v| v.elem_off).collect();
        let widths: Vec<usize> = rowwise.iter().map(|&(_, w)| w).collect();
        let widest = widths.iter().copied().max().unwrap_or(0);
        let mut op = self.op(name);
        for (r0, nr) in self.row_chunks(rows, &widths)? {
            let views: Vec<View<'_>> = rowwise
                .iter()
                .map(|&(t, w)| self.view(t, r0 * w, nr * w))
                .collect::<Result<_>>()?;
            let offs: Vec<u32> = views.iter().map(|v| v.elem_off).collect();
            let all: Vec<View<'_>> = views.into_iter().chain(whole.iter().copied()).collect();
            let bound: Vec<View<'_>> = order.iter().map(|&i| all[i]).collect();
            op.dispatch(
                kernel,
                &words(nr, &offs, &poffs),
                &bound,
                grid_for((nr * widest).div_ceil(256)),
            );
        }
        op.finish()
    }

    pub(crate) fn delta_gates_impl(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        a_log: &GpuTensor,
        dt_bias: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        const OP: &str = "delta_gates";
        for t in [a, b, a_log, dt_bias] {
            need_f32(OP, t)?;
        }
        let [rows, h, dk] = delta_gates_dims(OP, &a.shape, &b.shape, &a_log.shape, &dt_bias.shape, None)?;
        let c = h * dk;
        let g = self.alloc_f32(a.shape.clone())?;
        let beta = self.alloc_f32(b.shape.clone())?;
        if g.numel() > 0 {
            self.run_heads(
                OP,
                Kernel::DeltaGates,
                rows,
                &[(a, c), (b, h), (&g, c), (&beta, h)],
                &[a_log, dt_bias],
                // a, b, a_log, dt_bias, g, beta.
                &[0, 1, 4, 5, 2, 3],
                |nr, o, q| {
                    vec![
                        u(nr * c),
                        o[0],
                        o[1],
                        q[0],
                        o[2],
                        o[3],
                        0,
                        0,
                        q[1],
                        0,
                        0,
                        0,
                        u(c),
                        u(nr * h),
                    ]
                },
            )?;
        }
        Ok((g, beta))
    }

    /// `(da, db, da_log, ddt_bias)`: da, db and each element's dg · g in
    /// one pass, then the column sums of da (ddt_bias) and of dg · g
    /// (da_log, as ∂g/∂A_log = g).
    pub(crate) fn delta_gates_backward_impl(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        a_log: &GpuTensor,
        dt_bias: &GpuTensor,
        dg: &GpuTensor,
        dbeta: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor, GpuTensor, GpuTensor)> {
        const OP: &str = "delta_gates_backward";
        for t in [a, b, a_log, dt_bias, dg, dbeta] {
            need_f32(OP, t)?;
        }
        let grads = Some((&dg.shape, &dbeta.shape));
        let [rows, h, dk] = delta_gates_dims(OP, &a.shape, &b.shape, &a_log.shape, &dt_bias.shape, grads)?;
        let c = h * dk;
        let da = self.alloc_f32(a.shape.clone())?;
        let db = self.alloc_f32(b.shape.clone())?;
        if da.numel() == 0 {
            return Ok((da, db, self.zeros_f32([c])?, self.zeros_f32([c])?));
        }
        let terms = self.alloc_f32([rows, c])?;
        self.run_heads(
            OP,
            Kernel::DeltaGatesBwd,
            rows,
            &[
                (a, c),
                (b, h),
                (dg, c),
                (dbeta, h),
                (&da, c),
                (&db, h),
                (&terms, c),
            ],
            &[a_log, dt_bias],
            // a, b, a_log, dt_bias, dg, dbeta, da, db, terms.
            &[0, 1, 7, 8, 2, 3, 4, 5, 6],
            |nr, o, q| {
                vec![
                    u(nr * c),
                    o[0],
                    o[1],
                    q[0],
                    o[4],
                    o[5],
                    0,
                    0,
                    q[1],
                    o[2],
                    o[3],
                    o[6],
                    u(c),
                    u(nr * h),
                ]
            },
        )?;
        let da_log = self.sum_rows(&terms, c)?;
        let ddt = self.sum_rows(&da, c)?;
        Ok((da, db, da_log, ddt))
    }
}
