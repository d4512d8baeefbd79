//! `F16Attention::Auto` takes the tensor-core attention at a head dimension
//! only once it has matched the SIMT kernels on the device. Its kernels
//! passed every check on Mesa's lavapipe (software and cooperative-matrix
//! builds) yet computed garbage on an NVIDIA H200 (driver 580.159.04,
//! 2026-11-27: forward relative error 1.4) while the tensor-core matmuls
//! were right there. The likely cause, cooperative loads from workgroup
//! memory the driver did not place on 16 bytes, is removed (`Shared` in
//! attention_coop.wgsl) but has not run on a GPU since; and whatever a
//! driver makes of these kernels, a run with a wrong attention trains, with
//! no error, to a wrong model, so it is not taken on trust. One small
//! causal case per head dimension (two query heads on one kv head, partial
//! tiles), forward and backward through both families on the same inputs,
//! costs a few pipelines once per device.

use megatrain_tensor::testing::{random_tensor, rel_norm_err};
use megatrain_tensor::{AttnMask, ComputePrecision, Executor, HostTensor};

use super::{GpuExecutor, GpuOptions};
use crate::F16Attention;

/// The two families round the same f16 operands and differ in the order
/// of their f32 sums: where right, each is within 3.5e-4 of the CPU F16
/// reference (tests/attention_f16.rs, on lavapipe and the H200); the wrong
/// kernel was off by order 1.
const TOLERANCE: f64 = 1e-2;

impl GpuExecutor {
    /// Whether the tensor-core attention at head dimension `d` matched the
    /// SIMT kernels on this device, checked on first asking.
    pub(crate) fn coop_attention_checked(&self, d: usize) -> bool {
        self.ctx
            .coop_attention_checks
            .passed(d, || self.compare_attention_families(d))
    }

    fn compare_attention_families(&self, d: usize) -> Result<(), String> {
        let (t, hq, hkv) = (37, 2, 1);
        let run = |kind: F16Attention| -> megatrain_tensor::Result<Vec<Vec<f32>>> {
            let mut g = GpuExecutor::with_options(
                self.ctx.clone(),
                GpuOptions {
                    f16_attention: kind,
                    f16_operands: self.f16_operands,
                    loop_budget: Some(self.loop_budget),
                    ..GpuOptions::default()
                },
            );
            g.set_compute_precision(ComputePrecision::F16)?;
            let up = |seed: u64, h: usize| g.upload(&random_tensor(seed, [1, t, h, d]));
            let (q, k, v, dout) = (up(1, hq)?, up(2, hkv)?, up(3, hkv)?, up(4, hq)?);
            let f = g.attention(&q, &k, &v, AttnMask::CAUSAL)?;
            let b = g.attention_backward(&q, &k, &v, &f, &dout)?;
            [&f.out, &f.lse, &b.dq, &b.dk, &b.dv]
                .into_iter()
                .map(|x| g.download(x).map(|h: HostTensor| h.to_f32_vec()))
                .collect()
        };
        let failed = |e: megatrain_tensor::Error| format!("the check did not run: {e}");
        let coop = run(F16Attention::Coop).map_err(failed)?;
        let simt = run(F16Attention::Simt).map_err(failed)?;
        let worst = ["out", "lse", "dq", "dk", "dv"]
            .into_iter()
            .zip(coop.iter().zip(&simt))
            .map(|(name, (c, s))| (name, rel_norm_err(c, s)))
            .fold(
                ("out", 0.0f64),
                |w, x| if x.1 > w.1 || x.1.is_nan() { x } else { w },
            );
        // NaN compares false: it fails here too.
        if worst.1 <= TOLERANCE {
            return Ok(());
        }
        Err(format!(
            "tensor-core attention at head dimension {d} is off the SIMT kernels on this device \
             ({} relative error {:.2e}): the SIMT kernels run instead",
            worst.0, worst.1
        ))
    }
}
