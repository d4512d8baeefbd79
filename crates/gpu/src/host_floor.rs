//! A device on wgpu's noop backend, for measuring the host's share of a
//! step (feature `host-floor`; never chosen by default).
//!
//! On the noop backend dispatches do nothing, buffer copies, clears and
//! mappings are done at once in host memory and waits return at once, so a
//! streamed step costs exactly what the host does for it: our recording,
//! wgpu-core's validation and tracking, bind groups, submits, maps, the
//! transport's host copies, the CPU AdamW and the trainer's bookkeeping.
//! Results are garbage (no kernel runs; device buffers read as zeros or as
//! whatever was last copied into them).
//!
//! The adapter reports what an NVIDIA H100 reports through Vulkan in wgpu 30
//! (48 KiB of workgroup memory, storage bindings of 2 GiB − 1, subgroups of
//! 32, 64-byte uniform and 16-byte storage offset alignment) and the
//! optional features we ask for, except cooperative matrices: the kernels
//! and code paths chosen are those of an NVIDIA GPU without tensor cores
//! (f16 products on the SIMT kernel). wgpu 30's noop adapter reports
//! `DeviceType::Cpu` whatever its options say; the executor's one branch
//! on the device type (the head's logits chunk) asks `is_host_floor`.

use std::sync::Arc;

use crate::{GpuContext, GpuError};

/// The name the noop adapter reports (wgpu's own).
pub const HOST_FLOOR_ADAPTER: &str = "noop wgpu backend";

/// What an H100's Vulkan driver reports through wgpu 30, where it matters
/// to which kernels and binding splits we choose.
pub fn h100_limits() -> wgpu::Limits {
    wgpu::Limits {
        max_compute_workgroup_storage_size: 48 << 10,
        max_compute_invocations_per_workgroup: 1024,
        max_compute_workgroup_size_x: 1024,
        max_compute_workgroup_size_y: 1024,
        max_compute_workgroup_size_z: 64,
        max_compute_workgroups_per_dimension: 65535,
        // wgpu caps every binding at i32::MAX bytes.
        max_storage_buffer_binding_size: (1 << 31) - 1,
        max_uniform_buffer_binding_size: 64 << 10,
        max_buffer_size: 1 << 40,
        max_storage_buffers_per_shader_stage: 1 << 20,
        max_uniform_buffers_per_shader_stage: 1 << 20,
        max_bindings_per_bind_group: 1000,
        min_uniform_buffer_offset_alignment: 64,
        min_storage_buffer_offset_alignment: 16,
        max_immediate_size: 256,
        ..wgpu::Limits::default()
    }
}

impl GpuContext {
    /// Opens a device on wgpu's noop backend with H100-like limits (see the
    /// module docs). Only for measuring the host's cost of a step: no
    /// kernel runs on it.
    pub fn host_floor() -> Result<Arc<Self>, GpuError> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::NOOP;
        desc.backend_options.noop = wgpu::NoopBackendOptions {
            enable: true,
            limits: Some(h100_limits()),
            features: Some(
                wgpu::Features::TIMESTAMP_QUERY
                    | wgpu::Features::SHADER_F16
                    | wgpu::Features::SUBGROUP
                    | wgpu::Features::MAPPABLE_PRIMARY_BUFFERS,
            ),
            device_type: Some(wgpu::DeviceType::DiscreteGpu),
            subgroup_min_size: Some(32),
            subgroup_max_size: Some(32),
        };
        let instance = wgpu::Instance::new(desc);
        let adapter = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::NOOP))
            .into_iter()
            .find(|a| a.get_info().backend == wgpu::Backend::Noop)
            .ok_or_else(|| GpuError::AdapterNotFound {
                wanted: HOST_FLOOR_ADAPTER.into(),
                available: "none: wgpu was built without its noop backend".into(),
            })?;
        Self::open(adapter, crate::copy_queue::CopyQueueChoice::Off)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_with_h100_limits_and_without_tensor_cores() {
        let ctx = GpuContext::host_floor().unwrap();
        assert!(ctx.is_host_floor());
        assert_eq!(ctx.info.name, HOST_FLOOR_ADAPTER);
        assert_eq!(ctx.limits.max_compute_workgroup_storage_size, 48 << 10);
        assert_eq!(ctx.max_binding_bytes(), (1 << 31) - 1);
        assert!(
            ctx.features
                .contains(wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP)
        );
        assert!(!ctx.has_cooperative_matrix());
        let ex = crate::GpuExecutor::new(ctx);
        assert_eq!(
            megatrain_tensor::Executor::logits_chunk_bytes(&ex),
            megatrain_tensor::DEVICE_LOGITS_CHUNK_BYTES
        );
    }
}
