//! GPT-OSS's clamped SwiGLU (activation.wgsl's `swiglu_clamped`) of its
//! interleaved gate/up product, its constants rounded to f32 once and
//! passed in the parameter block.

use megatrain_tensor::{ClampedGlu, Error, Result, clamped_glu_out};

use super::{GpuExecutor, View, f, grid_for, need_f32, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// activation.wgsl's `alpha` and `limit` words.
fn constants(c: ClampedGlu) -> [u32; 2] {
    [f(c.alpha as f32), f(c.limit as f32)]
}

impl GpuExecutor {
    /// Runs `kernel` over the `n` outputs of a clamped SwiGLU: `pairs`
    /// (gate_up, and in the backward its gradient) hold two elements an
    /// output, `singles` (the output, or dy) one, in binding order
    /// `pairs[0], singles.., pairs[1..]`.
    fn run_clamped(
        &self,
        op_name: &'static str,
        kernel: Kernel,
        operands: &[(&GpuTensor, usize)],
        n: usize,
        c: ClampedGlu,
    ) -> Result<()> {
        let [alpha, limit] = constants(c);
        let widths: Vec<usize> = operands.iter().map(|&(_, w)| w).collect();
        let mut op = self.op(op_name);
        for (start, count) in self.row_chunks(n, &widths)? {
            let views: Vec<View<'_>> = operands
                .iter()
                .map(|&(t, w)| self.view(t, start * w, count * w))
                .collect::<Result<_>>()?;
            let o: Vec<u32> = views.iter().map(|v| v.elem_off).collect();
            let params = match o.as_slice() {
                [x, y] => vec![u(count), *x, 0, 0, *y, 0, alpha, limit],
                [x, dy, dx] => vec![u(count), *x, *dy, 0, *dx, 0, alpha, limit],
                _ => unreachable!("two or three operands"),
            };
            op.dispatch(kernel, &params, &views, grid_for(count.div_ceil(256)));
        }
        op.finish()
    }

    pub(crate) fn swiglu_clamped_impl(&self, gate_up: &GpuTensor, c: ClampedGlu) -> Result<GpuTensor> {
        const OP: &str = "swiglu_clamped";
        c.check(OP)?;
        need_f32(OP, gate_up)?;
        let y = self.alloc_f32(clamped_glu_out(OP, &gate_up.shape)?)?;
        let n = y.numel();
        self.run_clamped(OP, Kernel::SwigluClamped, &[(gate_up, 2), (&y, 1)], n, c)?;
        Ok(y)
    }

    /// d(gate_up) of [`swiglu_clamped_impl`](Self::swiglu_clamped_impl),
    /// interleaved as `gate_up`.
    pub(crate) fn swiglu_clamped_backward_impl(
        &self,
        gate_up: &GpuTensor,
        dy: &GpuTensor,
        c: ClampedGlu,
    ) -> Result<GpuTensor> {
        const OP: &str = "swiglu_clamped_backward";
        c.check(OP)?;
        need_f32(OP, gate_up)?;
        need_f32(OP, dy)?;
        let out = clamped_glu_out(OP, &gate_up.shape)?;
        if dy.shape != out {
            return Err(Error::shape(
                OP,
                format!(
                    "dy {} must be {out}, the output of gate_up {}",
                    dy.shape, gate_up.shape
                ),
            ));
        }
        let dx = self.alloc_f32(gate_up.shape.clone())?;
        let n = dy.numel();
        self.run_clamped(
            OP,
            Kernel::SwigluClampedBwd,
            &[(gate_up, 2), (dy, 1), (&dx, 2)],
            n,
            c,
        )?;
        Ok(dx)
    }
}
