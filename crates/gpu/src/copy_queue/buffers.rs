//! Buffers both queues use: made through wgpu-hal so that they can be
//! shared across queue families, and handed to wgpu as its own.

use ash::vk;
use wgpu::hal::api::Vulkan;

use super::vulkan::{CopyQueue, Target};

/// The Vulkan handle of a wgpu buffer.
pub(super) fn raw_buffer(b: &wgpu::Buffer) -> Result<vk::Buffer, crate::GpuError> {
    // SAFETY: the handle is only recorded into copies, while `b` is kept
    // alive; the guard (wgpu's snatch lock) is dropped at once, so two are
    // never held together.
    unsafe { b.as_hal::<Vulkan>().map(|h| h.raw_handle()) }.ok_or_else(|| crate::GpuError::Unsupported {
        op: "copy queue",
        detail: "a buffer of another backend".into(),
    })
}

/// Allocates `alloc` and binds it to `buffer`; on failure destroys the
/// buffer and whatever was allocated, and says which call failed and how.
///
/// # Safety
/// `buffer` is a buffer of `dev` with no memory bound, and `alloc` is
/// valid for it.
pub(crate) unsafe fn allocate_bound(
    dev: &ash::Device,
    buffer: vk::Buffer,
    alloc: &vk::MemoryAllocateInfo<'_>,
) -> Result<vk::DeviceMemory, String> {
    // SAFETY: forwarded from the caller.
    unsafe {
        let memory = match dev.allocate_memory(alloc, None) {
            Ok(m) => m,
            Err(e) => {
                dev.destroy_buffer(buffer, None);
                return Err(format!(
                    "vkAllocateMemory of {} bytes (memory type {}): {e}",
                    alloc.allocation_size, alloc.memory_type_index
                ));
            }
        };
        if let Err(e) = dev.bind_buffer_memory(buffer, memory, 0) {
            dev.destroy_buffer(buffer, None);
            dev.free_memory(memory, None);
            return Err(format!("vkBindBufferMemory: {e}"));
        }
        Ok(memory)
    }
}

impl CopyQueue {
    /// Makes a device-local buffer of `bytes` for both queues
    /// (`STORAGE | COPY_DST | COPY_SRC`) and starts tracking it: a
    /// weight slot the queue writes, or the staging a download is
    /// copied through (the queue reads it).
    pub(crate) fn create_buffer(
        &self,
        device: &wgpu::Device,
        bytes: u64,
        label: &str,
    ) -> Result<wgpu::Buffer, String> {
        let usage = vk::BufferUsageFlags::STORAGE_BUFFER
            | vk::BufferUsageFlags::TRANSFER_DST
            | vk::BufferUsageFlags::TRANSFER_SRC;
        let (mode, families) = self.sharing();
        // SAFETY: objects made here go to wgpu-hal (`from_raw_managed`,
        // which frees them when wgpu destroys the buffer) or are
        // destroyed here on failure.
        let buffer = unsafe {
            let hal = device
                .as_hal::<Vulkan>()
                .ok_or_else(|| "not a Vulkan device".to_string())?;
            let dev = hal.raw_device();
            let info = vk::BufferCreateInfo::default()
                .size(bytes)
                .usage(usage)
                .sharing_mode(mode)
                .queue_family_indices(families);
            let buffer = dev
                .create_buffer(&info, None)
                .map_err(|e| format!("vkCreateBuffer of {bytes} bytes: {e}"))?;
            let req = dev.get_buffer_memory_requirements(buffer);
            let instance = hal.shared_instance().raw_instance();
            let types = instance.get_physical_device_memory_properties(hal.raw_physical_device());
            let ok = |i: u32, not: vk::MemoryPropertyFlags| {
                let flags = types.memory_types[i as usize].property_flags;
                req.memory_type_bits >> i & 1 == 1
                    && flags.contains(vk::MemoryPropertyFlags::DEVICE_LOCAL)
                    && !flags.intersects(not)
            };
            // Device memory the host cannot map first (where a driver
            // offers both, the mappable kind is the scarcer BAR).
            let ty = (0..types.memory_type_count)
                .find(|&i| ok(i, vk::MemoryPropertyFlags::HOST_VISIBLE))
                .or_else(|| (0..types.memory_type_count).find(|&i| ok(i, vk::MemoryPropertyFlags::empty())));
            let Some(ty) = ty else {
                dev.destroy_buffer(buffer, None);
                return Err(format!(
                    "no device-local memory type among the buffer's (bits {:#x})",
                    req.memory_type_bits
                ));
            };
            let alloc = vk::MemoryAllocateInfo::default()
                .allocation_size(req.size)
                .memory_type_index(ty);
            let memory = allocate_bound(dev, buffer, &alloc).map_err(|e| {
                // What an out-of-memory on a large device needs to be read:
                // the heap, and how many buffers this queue holds.
                let heap = types.memory_types[ty as usize].heap_index as usize;
                format!(
                    "{e}; heap {heap} of {} MiB; {} copy-queue buffers live",
                    types.memory_heaps[heap].size >> 20,
                    self.lock().targets.len()
                )
            })?;
            let hal_buffer = wgpu::hal::vulkan::Buffer::from_raw_managed(buffer, memory, 0, req.size);
            device.create_buffer_from_hal::<Vulkan>(
                hal_buffer,
                &wgpu::BufferDescriptor {
                    label: Some(label),
                    size: bytes,
                    usage: crate::arena::USAGE,
                    mapped_at_creation: false,
                },
            )
        };
        self.lock().targets.insert(buffer.clone(), Target::default());
        Ok(buffer)
    }
}
