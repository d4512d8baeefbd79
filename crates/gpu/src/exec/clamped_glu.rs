//! GPT-OSS's clamped SwiGLU (activation.wgsl's `swiglu_clamped`) of its
//! interleaved gate/up product, its constants rounded to f32 once and
//! passed in the parameter block.

use megatrain_tensor::{ClampedGlu, Error, Result, clamped_glu_out};

use super::{GpuExecutor, f, need_f32, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// activation.wgsl's `alpha` and `limit` words.
fn constants(c: ClampedGlu) -> [u32; 2] {
    [f(c.alpha as f32), f(c.limit as f32)]
}

impl GpuExecutor {
    pub(crate) fn swiglu_clamped_impl(&self, gate_up: &GpuTensor, c: ClampedGlu) -> Result<GpuTensor> {
        const OP: &str = "swiglu_clamped";
        c.check(OP)?;
        need_f32(OP, gate_up)?;
        let y = self.alloc_f32(clamped_glu_out(OP, &gate_up.shape)?)?;
        let [alpha, limit] = constants(c);
        let operands = [(gate_up, 2), (&y, 1)];
        self.run_elementwise_wide(OP, Kernel::SwigluClamped, &operands, y.numel(), |n, o| {
            vec![u(n), o[0], 0, 0, o[1], 0, alpha, limit, 0, 0, 0, 0, 0]
        })?;
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
        let [alpha, limit] = constants(c);
        let operands = [(gate_up, 2), (dy, 1), (&dx, 2)];
        self.run_elementwise_wide(OP, Kernel::SwigluClampedBwd, &operands, dy.numel(), |n, o| {
            vec![u(n), o[0], o[1], 0, o[2], 0, alpha, limit, 0, 0, 0, 0, 0]
        })?;
        Ok(dx)
    }
}
