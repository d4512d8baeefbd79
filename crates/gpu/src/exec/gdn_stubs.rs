//! The gated delta net's small ops, not yet on the GPU: each refuses
//! with an error naming itself, so a model reaching one fails clearly.

use megatrain_tensor::Result;

use super::GpuExecutor;
use crate::GpuError;
use crate::tensor::GpuTensor;

fn not_yet<T>(op: &'static str) -> Result<T> {
    Err(GpuError::Unsupported {
        op,
        detail: "not implemented on the GPU executor yet".into(),
    }
    .into())
}

impl GpuExecutor {
    pub(crate) fn causal_conv1d_silu_impl(&self, _x: &GpuTensor, _w: &GpuTensor) -> Result<GpuTensor> {
        not_yet("causal_conv1d_silu")
    }

    pub(crate) fn causal_conv1d_silu_backward_impl(
        &self,
        _x: &GpuTensor,
        _w: &GpuTensor,
        _dy: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        not_yet("causal_conv1d_silu_backward")
    }

    pub(crate) fn delta_gates_impl(
        &self,
        _a: &GpuTensor,
        _b: &GpuTensor,
        _a_log: &GpuTensor,
        _dt_bias: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        not_yet("delta_gates")
    }

    pub(crate) fn delta_gates_backward_impl(
        &self,
        _a: &GpuTensor,
        _b: &GpuTensor,
        _a_log: &GpuTensor,
        _dt_bias: &GpuTensor,
        _dg: &GpuTensor,
        _dbeta: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor, GpuTensor, GpuTensor)> {
        not_yet("delta_gates_backward")
    }

    pub(crate) fn sigmoid_mul_impl(&self, _gate: &GpuTensor, _x: &GpuTensor) -> Result<GpuTensor> {
        not_yet("sigmoid_mul")
    }

    pub(crate) fn sigmoid_mul_backward_impl(
        &self,
        _gate: &GpuTensor,
        _x: &GpuTensor,
        _dy: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        not_yet("sigmoid_mul_backward")
    }
}
