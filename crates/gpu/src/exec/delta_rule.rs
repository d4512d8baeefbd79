//! The gated delta rule (Qwen3-Next's linear attention) on the GPU: its
//! kernels are not written yet, so both directions check their shapes,
//! then refuse.

use megatrain_tensor::{DeltaRuleGrads, DeltaRuleOut, Result, delta_rule_dims};

use super::{GpuExecutor, need_f32};
use crate::GpuError;
use crate::tensor::GpuTensor;

fn not_yet(op: &'static str) -> megatrain_tensor::Error {
    GpuError::Unsupported {
        op,
        detail: "the GPU kernels of the gated delta rule are not written yet".into(),
    }
    .into()
}

impl GpuExecutor {
    pub(crate) fn gated_delta_rule_impl(&self, x: [&GpuTensor; 5]) -> Result<DeltaRuleOut<GpuTensor>> {
        const OP: &str = "gated_delta_rule";
        x.iter().try_for_each(|t| need_f32(OP, t))?;
        delta_rule_dims(OP, x.map(|t| &t.shape), None)?;
        Err(not_yet(OP))
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
        let bwd = [&fwd.out.shape, &fwd.saved.shape, &dout.shape];
        delta_rule_dims(OP, x.map(|t| &t.shape), Some(bwd))?;
        Err(not_yet(OP))
    }
}
