//! GPT-OSS's clamped SwiGLU (activation.wgsl's `swiglu_clamped`), its
//! constants rounded to f32 once and passed in the parameter block.

use megatrain_tensor::{ClampedGlu, Result};

use super::{GpuExecutor, f, need_f32, same_shape, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// activation.wgsl's `alpha` and `limit` words.
fn constants(c: ClampedGlu) -> [u32; 2] {
    [f(c.alpha as f32), f(c.limit as f32)]
}

impl GpuExecutor {
    pub(crate) fn swiglu_clamped_impl(
        &self,
        gate: &GpuTensor,
        up: &GpuTensor,
        c: ClampedGlu,
    ) -> Result<GpuTensor> {
        const OP: &str = "swiglu_clamped";
        c.check(OP)?;
        need_f32(OP, gate)?;
        need_f32(OP, up)?;
        same_shape(OP, gate, up)?;
        let y = self.alloc_f32(gate.shape.clone())?;
        let [alpha, limit] = constants(c);
        self.run_elementwise(OP, Kernel::SwigluClamped, &[gate, up, &y], y.numel(), |n, o| {
            vec![u(n), o[0], o[1], 0, o[2], 0, alpha, limit]
        })?;
        Ok(y)
    }

    /// (dgate, dup) of [`swiglu_clamped_impl`](Self::swiglu_clamped_impl).
    pub(crate) fn swiglu_clamped_backward_impl(
        &self,
        gate: &GpuTensor,
        up: &GpuTensor,
        dy: &GpuTensor,
        c: ClampedGlu,
    ) -> Result<(GpuTensor, GpuTensor)> {
        const OP: &str = "swiglu_clamped_backward";
        c.check(OP)?;
        for t in [gate, up, dy] {
            need_f32(OP, t)?;
        }
        same_shape(OP, gate, up)?;
        same_shape(OP, gate, dy)?;
        let dg = self.alloc_f32(gate.shape.clone())?;
        let du = self.alloc_f32(gate.shape.clone())?;
        let [alpha, limit] = constants(c);
        let operands = [gate, up, dy, &dg, &du];
        self.run_elementwise(OP, Kernel::SwigluClampedBwd, &operands, dg.numel(), |n, o| {
            vec![u(n), o[0], o[1], o[2], o[3], o[4], alpha, limit]
        })?;
        Ok((dg, du))
    }
}
