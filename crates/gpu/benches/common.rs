//! Shared bench setup: the executor (or a skip notice) and random inputs.
#![allow(dead_code)]

use megatrain_gpu::{GpuContext, GpuExecutor};
use megatrain_tensor::testing::random_f32;
use megatrain_tensor::{HostTensor, Shape};

pub fn executor() -> Option<GpuExecutor> {
    match GpuContext::new() {
        Ok(ctx) => {
            eprintln!("bench device: {}", ctx.info);
            let g = GpuExecutor::new(ctx);
            g.warm_up();
            Some(g)
        }
        Err(e) => {
            eprintln!("no GPU adapter, skipping GPU benches: {e}");
            None
        }
    }
}

/// A real GPU (not lavapipe / a CPU adapter): the big shapes are worth it.
pub fn is_real_gpu(g: &GpuExecutor) -> bool {
    g.context().info.device_type != "Cpu"
}

pub fn rand(seed: u64, dims: &[usize]) -> HostTensor {
    let s = Shape::new(dims.to_vec());
    HostTensor::from_f32(s.clone(), random_f32(seed, s.numel())).expect("sized")
}

/// `flops` a second as TFLOP/s, or GFLOP/s where under one TFLOP/s (a CPU
/// adapter's).
pub fn flops_rate(flops: f64) -> String {
    if flops >= 1e12 {
        format!("{:.1} TFLOP/s", flops / 1e12)
    } else {
        format!("{:.2} GFLOP/s", flops / 1e9)
    }
}

/// A device of its own for a bench's timing probes, whose other kernels
/// are not compiled first (unlike [`executor`]), where the adapter has
/// cooperative matrices; else a notice naming `what` and `None`.
pub fn probe_context(what: &str) -> Option<std::sync::Arc<GpuContext>> {
    let ctx = match GpuContext::new() {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("{what}: no GPU adapter: {e}");
            return None;
        }
    };
    eprintln!("bench device: {}", ctx.info);
    if !ctx.has_cooperative_matrix() {
        eprintln!("{what}: adapter has no cooperative matrices, no probes");
        return None;
    }
    Some(ctx)
}
