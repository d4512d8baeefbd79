//! The gated delta rule continuing from a given state, for generation
//! (delta_rule_cached.wgsl): a thread a column of each (batch, value
//! head)'s state, the steps split over dispatches under the loop budget.

use megatrain_tensor::{Result, delta_rule_cached_dims};

use super::{GpuExecutor, grid_for, need_f32, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

impl GpuExecutor {
    pub(crate) fn gated_delta_rule_cached_impl(
        &self,
        x: [&GpuTensor; 5],
        state: &mut GpuTensor,
    ) -> Result<GpuTensor> {
        const OP: &str = "gated_delta_rule_cached";
        for t in x.iter().copied().chain([&*state]) {
            need_f32(OP, t)?;
        }
        let d = delta_rule_cached_dims(OP, x.map(|t| &t.shape), &state.shape)?;
        let [q, k, v, g, beta] = x;
        let out = self.alloc_f32(v.shape.clone())?;
        if out.numel() == 0 {
            return Ok(out);
        }
        let views = [
            self.full(q)?,
            self.full(k)?,
            self.full(v)?,
            self.full(g)?,
            self.full(beta)?,
            self.full(&out)?,
            self.full(state)?,
        ];
        let [qo, ko, vo, go, bo, oo, so] = views.map(|v| v.elem_off);
        let n = d.b * d.hv * d.dv;
        // Two loops of Dk a step.
        let steps = (self.loop_budget / (2 * d.dk + 2)).max(1);
        let mut op = self.op(OP);
        for t0 in (0..d.t).step_by(steps) {
            let params = [
                u(d.t),
                u(d.hk),
                u(d.hv),
                u(d.dk),
                u(d.dv),
                u(d.group()),
                u(d.decays()),
                u(n),
                qo,
                ko,
                vo,
                go,
                bo,
                oo,
                so,
                u(t0),
                u((t0 + steps).min(d.t)),
                0,
                0,
                0,
            ];
            op.dispatch(Kernel::DeltaRuleCached, &params, &views, grid_for(n.div_ceil(64)));
        }
        op.finish()?;
        Ok(out)
    }
}
