//! The gated delta rule's per-head gates (activation.wgsl's `delta_gates`,
//! `delta_gates_bwd`): elementwise over rows of H heads, the `[H]`
//! parameters bound whole beside each chunk of rows; their gradients
//! summed over rows as column sums (`sum_rows`: a fixed order, no atomics).

use megatrain_tensor::{Result, delta_gates_dims};

use super::{GpuExecutor, View, grid_for, need_f32, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

impl GpuExecutor {
    /// Runs `kernel` over `rows` rows of `h` heads: `rowwise` (tensors of
    /// rows of `h`) in chunks of whole rows, so that an element's head is
    /// its index mod `h`, and `params` (the `[H]` parameters) whole; the
    /// kernel's bindings take them in `order` (indices into `rowwise` then
    /// `params`); `words(count, row_offsets, param_offsets)` builds
    /// activation.wgsl's parameter block.
    #[allow(clippy::too_many_arguments)]
    fn run_heads(
        &self,
        name: &'static str,
        kernel: Kernel,
        (rows, h): (usize, usize),
        rowwise: &[&GpuTensor],
        params: &[&GpuTensor],
        order: &[usize],
        words: impl Fn(usize, &[u32], &[u32]) -> Vec<u32>,
    ) -> Result<()> {
        let whole: Vec<View<'_>> = params.iter().map(|t| self.full(t)).collect::<Result<_>>()?;
        let poffs: Vec<u32> = whole.iter().map(|v| v.elem_off).collect();
        let mut op = self.op(name);
        for (r0, nr) in self.row_chunks(rows, &[h])? {
            let n = nr * h;
            let views: Vec<View<'_>> = rowwise
                .iter()
                .map(|t| self.view(t, r0 * h, n))
                .collect::<Result<_>>()?;
            let offs: Vec<u32> = views.iter().map(|v| v.elem_off).collect();
            let all: Vec<View<'_>> = views.into_iter().chain(whole.iter().copied()).collect();
            let bound: Vec<View<'_>> = order.iter().map(|&i| all[i]).collect();
            op.dispatch(
                kernel,
                &words(n, &offs, &poffs),
                &bound,
                grid_for(n.div_ceil(256)),
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
        let [rows, h] = delta_gates_dims(OP, &a.shape, &b.shape, &a_log.shape, &dt_bias.shape, None)?;
        let g = self.alloc_f32(a.shape.clone())?;
        let beta = self.alloc_f32(a.shape.clone())?;
        if g.numel() > 0 {
            self.run_heads(
                OP,
                Kernel::DeltaGates,
                (rows, h),
                &[a, b, &g, &beta],
                &[a_log, dt_bias],
                // a, b, a_log, dt_bias, g, beta.
                &[0, 1, 4, 5, 2, 3],
                |n, o, q| vec![u(n), o[0], o[1], q[0], o[2], o[3], 0, 0, q[1], 0, 0, 0, u(h)],
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
        let [rows, h] = delta_gates_dims(OP, &a.shape, &b.shape, &a_log.shape, &dt_bias.shape, grads)?;
        let da = self.alloc_f32(a.shape.clone())?;
        let db = self.alloc_f32(a.shape.clone())?;
        if da.numel() == 0 {
            return Ok((da, db, self.zeros_f32([h])?, self.zeros_f32([h])?));
        }
        let terms = self.alloc_f32([rows, h])?;
        self.run_heads(
            OP,
            Kernel::DeltaGatesBwd,
            (rows, h),
            &[a, b, dg, dbeta, &da, &db, &terms],
            &[a_log, dt_bias],
            // a, b, a_log, dt_bias, dg, dbeta, da, db, terms.
            &[0, 1, 7, 8, 2, 3, 4, 5, 6],
            |n, o, q| {
                vec![
                    u(n),
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
                    u(h),
                ]
            },
        )?;
        let da_log = self.sum_rows(&terms, h)?;
        let ddt = self.sum_rows(&da, h)?;
        Ok((da, db, da_log, ddt))
    }
}
