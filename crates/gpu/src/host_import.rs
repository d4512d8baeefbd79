//! Host memory the device reads by itself: Vulkan's
//! `VK_EXT_external_memory_host`, which turns pages the process already
//! owns (the tier's transport copies) into device-visible memory, as CUDA's
//! `cudaHostRegister` does. An upload from such memory is one buffer copy
//! on the queue, done by the copy engine at the bus's speed; the CPU moves
//! no byte of it. Without it every upload is copied by the CPU into mapped
//! staging memory first: 2 bytes read and 2 written per parameter and
//! crossing, on the host memory bus the optimizer also runs on.
//!
//! wgpu 30 does not enable the extension, so the device is opened through
//! wgpu-hal with it added (`open_device`), and an imported range is handed
//! to wgpu as a buffer whose memory wgpu-hal frees when wgpu destroys it.

use std::sync::{Arc, Mutex};

use crate::{GpuContext, GpuError};

/// `MEGATRAIN_UPLOADS=copy`: open the device as wgpu does (no host memory
/// import) and copy every upload through mapped memory; `direct`: the
/// device copies from registered host memory wherever it can; `auto` (the
/// default): `direct` except on CPU adapters. Changes no value: for timing
/// the copy that `direct` saves, and as a way around a driver that
/// mishandles imported memory.
pub const UPLOADS_ENV: &str = "MEGATRAIN_UPLOADS";

/// How uploads of a layer reach the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Uploads {
    /// `Direct`, except on a CPU adapter (lavapipe), whose "device copy"
    /// is one host thread's memcpy: there the copy threads writing the
    /// slot through a mapping are faster.
    #[default]
    Auto,
    /// Copied by the device from registered host memory where possible.
    Direct,
    /// Always copied by the CPU into mapped memory first.
    Copy,
}

impl std::fmt::Display for Uploads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Uploads::Auto => "auto",
            Uploads::Direct => "direct",
            Uploads::Copy => "copy",
        })
    }
}

/// What the device offers for importing host memory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostImport {
    /// `minImportedHostPointerAlignment`: an imported range starts and ends
    /// on a multiple of it.
    pub align: u64,
}

/// One imported range and the buffer over it.
pub(crate) struct Region {
    pub start: usize,
    pub end: usize,
    pub buffer: wgpu::Buffer,
}

/// The imported ranges of one context, shared by its executors' lookups
/// and by the registrations that remove them.
#[derive(Default)]
pub(crate) struct Registry {
    regions: Mutex<Vec<Arc<Region>>>,
}

impl Registry {
    /// The imported range holding all of the addresses `a..b`, if any.
    pub fn find(&self, a: usize, b: usize) -> Option<Arc<Region>> {
        let regions = self.regions.lock().expect("host registry poisoned");
        regions.iter().find(|r| r.start <= a && b <= r.end).cloned()
    }

    fn overlaps(&self, start: usize, end: usize) -> bool {
        let regions = self.regions.lock().expect("host registry poisoned");
        regions.iter().any(|r| r.start < end && start < r.end)
    }

    fn add(&self, r: Arc<Region>) {
        self.regions.lock().expect("host registry poisoned").push(r);
    }

    fn remove(&self, start: usize) -> Option<Arc<Region>> {
        let mut regions = self.regions.lock().expect("host registry poisoned");
        let i = regions.iter().position(|r| r.start == start)?;
        Some(regions.swap_remove(i))
    }

    pub fn len(&self) -> usize {
        self.regions.lock().expect("host registry poisoned").len()
    }
}

/// Ends a registration when dropped: the range leaves the registry, its
/// buffer is destroyed, and the device is waited on, so that no copy
/// still queued reads the memory after its owner frees it.
pub(crate) struct Registration {
    ctx: Arc<GpuContext>,
    start: usize,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(r) = self.ctx.host_registry.remove(self.start) {
            // The copy queue's copies are not wgpu's: wait for them first.
            if let Some(q) = &self.ctx.copy_queue {
                let _ = q.wait_idle();
            }
            r.buffer.destroy();
            drop(r);
            // Destruction is deferred to the end of the last submission
            // that used the buffer; waiting runs it. A lost device has
            // stopped reading anyway, so its error changes nothing here.
            let _ = self.ctx.device.poll(wgpu::PollType::wait_indefinitely());
        }
    }
}

/// Imports the largest `align`-aligned part of `bytes` and registers it.
/// `Ok(None)` where the device cannot: no import support, a range smaller
/// than the alignment, a driver refusal (uploads are then copied).
///
/// # Safety
/// `bytes` must stay allocated, at the same address, until the returned
/// registration is dropped.
pub(crate) unsafe fn register(ctx: &Arc<GpuContext>, bytes: &[u8]) -> Result<Option<Registration>, GpuError> {
    let Some(caps) = ctx.host_import else {
        return Ok(None);
    };
    let a = caps.align as usize;
    let start = (bytes.as_ptr() as usize).next_multiple_of(a);
    let end = (bytes.as_ptr() as usize + bytes.len()) / a * a;
    if end <= start {
        return Ok(None);
    }
    if ctx.host_registry.overlaps(start, end) {
        return Err(GpuError::Unsupported {
            op: "register_host",
            detail: format!("host memory at {start:#x} is already registered"),
        });
    }
    // SAFETY: forwarded from the caller.
    let Some((buffer, covered)) = (unsafe { vk::import(ctx, start, end - start, false) }) else {
        return Ok(None);
    };
    ctx.host_registry.add(Arc::new(Region {
        start,
        end: start + covered,
        buffer,
    }));
    Ok(Some(Registration {
        ctx: ctx.clone(),
        start,
    }))
}

/// Host memory of its own that the device copies into (and the copy
/// queue's check as the device opens, out of): where a download
/// on the copy queue lands, read by the CPU where it is. Page-aligned (to
/// the import alignment) and imported whole.
pub(crate) struct HostBuffer {
    ptr: *mut u8,
    layout: std::alloc::Layout,
    pub buffer: wgpu::Buffer,
    ctx: Arc<GpuContext>,
}

// SAFETY: the memory is owned by the value; the device writes it only
// between a copy's submission and the wait that precedes every read.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// `bytes` (at least 4) of zeroed host memory the device can copy
    /// into; `None` where it cannot import them whole.
    pub fn new(ctx: &Arc<GpuContext>, bytes: u64) -> Option<HostBuffer> {
        let size = Self::size_for(ctx, bytes)? as usize;
        let align = Self::align(ctx)? as usize;
        let layout = std::alloc::Layout::from_size_align(size, align).ok()?;
        // SAFETY: a non-zero size and a power-of-two alignment.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return None;
        }
        // SAFETY: the memory stays allocated until `drop`, which destroys
        // the buffer and waits for the device first.
        match unsafe { vk::import(ctx, ptr as usize, size, true) } {
            Some((buffer, covered)) if covered as u64 >= bytes => Some(HostBuffer {
                ptr,
                layout,
                buffer,
                ctx: ctx.clone(),
            }),
            other => {
                if let Some((buffer, _)) = other {
                    buffer.destroy();
                    let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
                }
                // SAFETY: allocated above with this layout; no buffer over it.
                unsafe { std::alloc::dealloc(ptr, layout) };
                None
            }
        }
    }

    fn align(ctx: &GpuContext) -> Option<u64> {
        Some(ctx.host_import?.align.max(4096))
    }

    /// Bytes a buffer for `bytes` holds (whole import units).
    pub fn size_for(ctx: &GpuContext, bytes: u64) -> Option<u64> {
        Some(bytes.max(4).next_multiple_of(Self::align(ctx)?))
    }

    /// Bytes the buffer holds.
    pub fn size(&self) -> u64 {
        self.layout.size() as u64
    }

    /// The memory, as the device last left it: read only after waiting
    /// for the copy that wrote it.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `layout.size()` bytes allocated in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }

    /// The memory, to fill before a copy reads it (no copy may be
    /// reading or writing it meanwhile).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `layout.size()` bytes allocated in `new`, borrowed
        // mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // No copy may still write the memory when it is freed.
        if let Some(q) = &self.ctx.copy_queue {
            let _ = q.wait_idle();
        }
        self.buffer.destroy();
        let _ = self.ctx.device.poll(wgpu::PollType::wait_indefinitely());
        // SAFETY: allocated in `new` with this layout; the buffer over it
        // is destroyed and the device waited for.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

pub(crate) use vk::open_device;

#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
mod vk {
    use std::ffi::c_void;

    use ash::vk;
    use wgpu::hal::api::Vulkan;

    use super::HostImport;
    use crate::GpuContext;
    use crate::copy_queue::{CopyQueue, CopyQueueChoice};

    const HANDLE: vk::ExternalMemoryHandleTypeFlags = vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT;

    /// Opens `desc` on a Vulkan `adapter` with `VK_EXT_external_memory_host`
    /// enabled, where the adapter has it. `None`: not Vulkan, no such
    /// extension, or the driver refused (the caller opens as wgpu does).
    pub(crate) fn open_device(
        adapter: &wgpu::Adapter,
        desc: &wgpu::DeviceDescriptor<'_>,
        copy: CopyQueueChoice,
    ) -> Option<(wgpu::Device, wgpu::Queue, HostImport, Option<CopyQueue>)> {
        // SAFETY: the hal adapter is only read, and the device it opens is
        // handed straight to wgpu with the features and limits it was
        // opened with; the callback only adds an extension the physical
        // device lists (wgpu-hal's rule for it) and a queue of a family it
        // lists (`copy_queue::add_queue`).
        unsafe {
            let pick;
            let open = {
                let hal = adapter.as_hal::<Vulkan>()?;
                let instance = hal.shared_instance().raw_instance();
                let phd = hal.raw_physical_device();
                let listed = instance.enumerate_device_extension_properties(phd).ok()?;
                let name = ash::ext::external_memory_host::NAME;
                if !listed
                    .iter()
                    .any(|e| e.extension_name_as_c_str().is_ok_and(|n| n == name))
                {
                    return None;
                }
                let props = instance.get_physical_device_properties(phd);
                if props.api_version < vk::API_VERSION_1_1 {
                    return None;
                }
                pick = crate::copy_queue::pick(instance, phd, copy);
                let add: Box<wgpu::hal::vulkan::CreateDeviceCallback<'_>> = Box::new(move |args| {
                    if !args.extensions.contains(&name) {
                        args.extensions.push(name);
                    }
                    if let Some(p) = pick {
                        crate::copy_queue::add_queue(p, args.queue_create_infos);
                    }
                });
                hal.open_with_callback(
                    desc.required_features,
                    &desc.required_limits,
                    &desc.memory_hints,
                    Some(add),
                )
                .ok()?
            };
            let align = {
                let hal = adapter.as_hal::<Vulkan>()?;
                let instance = hal.shared_instance().raw_instance();
                let mut host = vk::PhysicalDeviceExternalMemoryHostPropertiesEXT::default();
                let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut host);
                instance.get_physical_device_properties2(hal.raw_physical_device(), &mut props);
                host.min_imported_host_pointer_alignment
            };
            let (device, queue) = adapter.create_device_from_hal(open, desc).ok()?;
            let copy_queue = pick.and_then(|p| CopyQueue::new(&device, p));
            Some((device, queue, HostImport { align: align.max(1) }, copy_queue))
        }
    }

    /// A `COPY_SRC` buffer (`COPY_DST` too with `dst`) over the host bytes
    /// `start..start + size` (aligned to the device's import alignment)
    /// and the bytes it covers from `start` (all of them unless the driver
    /// pads buffers), or `None` where the driver refuses them.
    ///
    /// # Safety
    /// The bytes stay allocated until the buffer is destroyed and the
    /// device has been waited on.
    pub(super) unsafe fn import(
        ctx: &GpuContext,
        start: usize,
        size: usize,
        dst: bool,
    ) -> Option<(wgpu::Buffer, usize)> {
        let size = size as u64;
        let (vk_usage, usage) = match dst {
            false => (vk::BufferUsageFlags::TRANSFER_SRC, wgpu::BufferUsages::COPY_SRC),
            // Both ways: the copy queue's check also copies out of one.
            true => (
                vk::BufferUsageFlags::TRANSFER_DST | vk::BufferUsageFlags::TRANSFER_SRC,
                wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            ),
        };
        // SAFETY: Vulkan objects made here are destroyed here on failure,
        // or handed to wgpu-hal (`from_raw_managed`), which destroys the
        // buffer and frees the memory when wgpu destroys the buffer.
        unsafe {
            let hal_buffer = {
                let hal = ctx.device.as_hal::<Vulkan>()?;
                let dev = hal.raw_device();
                let instance = hal.shared_instance().raw_instance();
                let ext = ash::ext::external_memory_host::Device::new(instance, dev);
                let ptr = start as *mut c_void;
                let mut host = vk::MemoryHostPointerPropertiesEXT::default();
                (ext.fp().get_memory_host_pointer_properties_ext)(dev.handle(), HANDLE, ptr, &mut host)
                    .result()
                    .ok()?;
                // A copy queue of another family reads it too.
                let (mode, families) = match &ctx.copy_queue {
                    Some(q) => q.sharing(),
                    None => (vk::SharingMode::EXCLUSIVE, &[][..]),
                };
                let make = |bytes: u64| {
                    let mut external = vk::ExternalMemoryBufferCreateInfo::default().handle_types(HANDLE);
                    let info = vk::BufferCreateInfo::default()
                        .size(bytes)
                        .usage(vk_usage)
                        .sharing_mode(mode)
                        .queue_family_indices(families)
                        .push_next(&mut external);
                    let buffer = dev.create_buffer(&info, None).ok()?;
                    Some((buffer, dev.get_buffer_memory_requirements(buffer), bytes))
                };
                let (mut buffer, mut req, mut bytes) = make(size)?;
                if req.size > size {
                    // A driver that pads buffers past the import's
                    // granule: a buffer over the whole padded units only
                    // (tensors past its end are copied by the host).
                    dev.destroy_buffer(buffer, None);
                    let unit = req.alignment.max(1);
                    (buffer, req, bytes) = make(Some(size / unit * unit).filter(|&b| b > 0)?)?;
                }
                let types = instance.get_physical_device_memory_properties(hal.raw_physical_device());
                // Host-coherent only: the CPU writes through its own
                // pointer, never through a Vulkan mapping it could flush.
                let coherent = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
                let ty = (0..types.memory_type_count).find(|&i| {
                    (req.memory_type_bits & host.memory_type_bits) >> i & 1 == 1
                        && types.memory_types[i as usize].property_flags.contains(coherent)
                });
                let (Some(ty), true) = (ty, req.size <= size) else {
                    dev.destroy_buffer(buffer, None);
                    return None;
                };
                let mut import = vk::ImportMemoryHostPointerInfoEXT::default()
                    .handle_type(HANDLE)
                    .host_pointer(ptr);
                let alloc = vk::MemoryAllocateInfo::default()
                    .allocation_size(size)
                    .memory_type_index(ty)
                    .push_next(&mut import);
                let memory = crate::copy_queue::allocate_bound(dev, buffer, &alloc).ok()?;
                (
                    wgpu::hal::vulkan::Buffer::from_raw_managed(buffer, memory, 0, bytes),
                    bytes,
                )
            };
            let (hal_buffer, bytes) = hal_buffer;
            let buffer = ctx.device.create_buffer_from_hal::<Vulkan>(
                hal_buffer,
                &wgpu::BufferDescriptor {
                    label: Some("registered host memory"),
                    size: bytes,
                    usage,
                    mapped_at_creation: false,
                },
            );
            Some((buffer, bytes as usize))
        }
    }
}

#[cfg(any(target_vendor = "apple", target_arch = "wasm32"))]
mod vk {
    //! No Vulkan here: uploads are copied (unified memory on Apple GPUs
    //! would rather bind host memory directly, which wgpu 30 cannot either).
    use super::HostImport;
    use crate::GpuContext;
    use crate::copy_queue::{CopyQueue, CopyQueueChoice};

    pub(crate) fn open_device(
        _adapter: &wgpu::Adapter,
        _desc: &wgpu::DeviceDescriptor<'_>,
        _copy: CopyQueueChoice,
    ) -> Option<(wgpu::Device, wgpu::Queue, HostImport, Option<CopyQueue>)> {
        None
    }

    pub(super) unsafe fn import(
        _ctx: &GpuContext,
        _start: usize,
        _size: usize,
        _dst: bool,
    ) -> Option<(wgpu::Buffer, usize)> {
        None
    }
}
