//! Every kernel of `Kernel::ALL` compiles into a pipeline on this adapter.

mod common;

#[test]
fn every_pipeline_compiles() {
    let Some(gpu) = common::gpu() else { return };
    gpu.warm_up();
}

/// The device reports its own memory where it runs on Vulkan (a
/// device-local heap: lavapipe has one, sized by the host's memory), and
/// an adapter on the CPU keeps its tensors in host memory, which
/// `--keep-activations auto` sizes itself by instead.
#[test]
fn the_device_reports_its_memory_and_where_tensors_live() {
    use megatrain_tensor::{Executor, TensorMemory};
    let Some(gpu) = common::gpu() else { return };
    let ctx = gpu.context();
    let on_vulkan = ctx.adapter.get_info().backend == wgpu::Backend::Vulkan;
    let bytes = ctx.device_memory_bytes();
    eprintln!("device-local heap: {bytes:?}");
    assert_eq!(bytes.is_some(), on_vulkan, "{bytes:?}");
    assert!(bytes.is_none_or(|b| b >= 1 << 28), "{bytes:?}");
    let cpu = ctx.adapter.get_info().device_type == wgpu::DeviceType::Cpu;
    match gpu.tensor_memory() {
        TensorMemory::Host => assert!(cpu),
        TensorMemory::Device(b) => assert!(!cpu && b == bytes),
    }
}
