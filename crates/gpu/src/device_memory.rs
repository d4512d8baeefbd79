//! How much memory of its own a device has: the largest device-local heap
//! Vulkan reports. wgpu has no query for it (`megatrain plan` asks the user
//! for `--device-mem`); `--keep-activations auto` sizes itself by it.

use crate::GpuContext;

impl GpuContext {
    /// Bytes of the device's largest device-local memory heap, where it
    /// runs on Vulkan; `None` elsewhere (other backends, the noop one).
    pub fn device_memory_bytes(&self) -> Option<u64> {
        heap::largest_device_local(self)
    }
}

#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
mod heap {
    use ash::vk;
    use wgpu::hal::api::Vulkan;

    use crate::GpuContext;

    pub(super) fn largest_device_local(ctx: &GpuContext) -> Option<u64> {
        // SAFETY: the hal adapter is only read; the query takes the
        // physical device wgpu opened and changes nothing.
        unsafe {
            let hal = ctx.adapter.as_hal::<Vulkan>()?;
            let instance = hal.shared_instance().raw_instance();
            let props = instance.get_physical_device_memory_properties(hal.raw_physical_device());
            props.memory_heaps[..props.memory_heap_count as usize]
                .iter()
                .filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
                .map(|h| h.size)
                .max()
        }
    }
}

#[cfg(any(target_vendor = "apple", target_arch = "wasm32"))]
mod heap {
    pub(super) fn largest_device_local(_: &crate::GpuContext) -> Option<u64> {
        None
    }
}
