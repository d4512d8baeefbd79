//! A queue of the device's own for the uploads it copies from registered
//! host memory, so that a layer's upload runs while the layer before it
//! computes.
//!
//! On wgpu's one queue that cannot happen. wgpu-hal chains its submissions
//! (each waits for the one before to finish), and a kernel reading what a
//! copy wrote is fenced by a pipeline barrier whose scope is every earlier
//! copy in the queue: however idle the copy engines, layer i + 1's upload
//! and layer i's kernels run one after the other. Vulkan drivers expose the
//! copy engines as queues of a transfer-only family (NVIDIA's family 1);
//! the device is opened with one of them added (`open_device` in
//! `host_import`), and this module submits the uploads there.
//!
//! Two timeline semaphores order the queues on the device, so the host
//! never waits: `copies` counts this queue's copies, and the first wgpu
//! submission that uses a buffer after a copy into it waits for the copy's
//! value; `compute` counts wgpu's submissions (each signals the next
//! value), and a copy into a buffer waits for the value of the last
//! submission that used it. Buffers shared by the two queues are made
//! `CONCURRENT` where the families differ, so no ownership transfer is
//! needed, and through wgpu-hal, so that wgpu never zero-fills a range it
//! did not see written.

use std::str::FromStr;

use crate::GpuError;

/// `MEGATRAIN_COPY_QUEUE`: `auto` (the default) copies uploads from
/// registered host memory on a queue of their own where the device offers
/// a second queue (a transfer-only family first), `off` on wgpu's queue;
/// `shared` runs the same machinery on wgpu's own queue, for testing it on
/// a device with one queue (lavapipe). Changes no value.
pub const COPY_QUEUE_ENV: &str = "MEGATRAIN_COPY_QUEUE";

/// Where the device's copies from registered host memory run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyQueueChoice {
    /// A queue of their own where the device offers one, else wgpu's.
    #[default]
    Auto,
    /// wgpu's queue, as part of its submissions.
    Off,
    /// This module's submissions on wgpu's own queue (for tests: the
    /// synchronization runs, nothing overlaps).
    Shared,
}

impl std::fmt::Display for CopyQueueChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyQueueChoice::Auto => "auto",
            CopyQueueChoice::Off => "off",
            CopyQueueChoice::Shared => "shared",
        })
    }
}

impl FromStr for CopyQueueChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        use CopyQueueChoice::*;
        crate::exec::named(s, [Auto, Off, Shared].into_iter())
    }
}

impl CopyQueueChoice {
    /// The choice [`COPY_QUEUE_ENV`] names (`Auto` when unset).
    pub fn from_env() -> Result<Self, GpuError> {
        match std::env::var(COPY_QUEUE_ENV) {
            Err(_) => Ok(CopyQueueChoice::Auto),
            Ok(v) => v.parse().map_err(|expected| GpuError::Env {
                var: COPY_QUEUE_ENV,
                value: v,
                expected,
            }),
        }
    }
}

/// What a copy queue did since the device was opened: the edges between
/// it and wgpu's queue, which no test on a one-queue device can observe
/// otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CopyQueueStats {
    /// Copies submitted.
    pub copies: u64,
    /// Of those, copies that waited for a wgpu submission that used their
    /// destination (write after read).
    pub copies_after_use: u64,
    /// wgpu submissions that waited for a copy into a buffer they use.
    pub submissions_waiting: u64,
}

pub(crate) use vk::CopyQueue;
#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
pub(crate) use vk::{add_queue, pick};

#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
mod vk {
    use std::any::Any;
    use std::collections::{HashMap, VecDeque};
    use std::sync::{Arc, Mutex};

    use ash::vk;
    use wgpu::hal::api::Vulkan;

    use super::CopyQueueChoice;

    /// The queue a device is opened with for copies, chosen before it is.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) struct QueuePick {
        pub family: u32,
        pub index: u32,
        /// What it is, for reports.
        pub what: &'static str,
    }

    /// The queue for `choice` on the physical device: a transfer-only
    /// family (copy engines) before any other family, a second queue of
    /// wgpu's family (0) last. `None` without timeline semaphores
    /// (Vulkan 1.2), which the synchronization needs.
    pub(crate) fn pick(
        instance: &ash::Instance,
        phd: vk::PhysicalDevice,
        choice: CopyQueueChoice,
    ) -> Option<QueuePick> {
        // SAFETY: queries of a physical device the adapter holds.
        unsafe {
            if instance.get_physical_device_properties(phd).api_version < vk::API_VERSION_1_2 {
                return None;
            }
            let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
            let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut v12);
            instance.get_physical_device_features2(phd, &mut f2);
            if v12.timeline_semaphore == vk::FALSE {
                return None;
            }
            let families = instance.get_physical_device_queue_family_properties(phd);
            match choice {
                CopyQueueChoice::Off => None,
                CopyQueueChoice::Shared => Some(QueuePick {
                    family: 0,
                    index: 0,
                    what: "wgpu's own queue (shared)",
                }),
                CopyQueueChoice::Auto => {
                    let rank = |f: &vk::QueueFamilyProperties| {
                        let busy = vk::QueueFlags::GRAPHICS | vk::QueueFlags::COMPUTE;
                        (f.queue_flags & busy).as_raw().count_ones()
                    };
                    let other = families
                        .iter()
                        .enumerate()
                        .skip(1)
                        .filter(|(_, f)| {
                            f.queue_flags.contains(vk::QueueFlags::TRANSFER) && f.queue_count > 0
                        })
                        .min_by_key(|(_, f)| rank(f));
                    match other {
                        Some((i, f)) => Some(QueuePick {
                            family: i as u32,
                            index: 0,
                            what: if rank(f) == 0 {
                                "a transfer-only queue family"
                            } else {
                                "a second queue family"
                            },
                        }),
                        None if families.first().is_some_and(|f| f.queue_count >= 2) => Some(QueuePick {
                            family: 0,
                            index: 1,
                            what: "a second queue of wgpu's family",
                        }),
                        None => None,
                    }
                }
            }
        }
    }

    /// Queue priorities that outlive the device's creation.
    static ONE: [f32; 1] = [1.0];
    static TWO: [f32; 2] = [1.0, 1.0];

    /// Adds `pick`'s queue to the device wgpu-hal is about to create
    /// (wgpu's own is family 0, index 0).
    pub(crate) fn add_queue(pick: QueuePick, infos: &mut Vec<vk::DeviceQueueCreateInfo<'_>>) {
        match (pick.family, pick.index) {
            (0, 0) => {}
            (0, _) => {
                if let Some(info) = infos.iter_mut().find(|i| i.queue_family_index == 0) {
                    *info = info.queue_priorities(&TWO);
                }
            }
            (f, _) => infos.push(
                vk::DeviceQueueCreateInfo::default()
                    .queue_family_index(f)
                    .queue_priorities(&ONE),
            ),
        }
    }

    /// Where a buffer stands between the two queues.
    #[derive(Default)]
    struct Target {
        /// `compute` value of the last wgpu submission that used it.
        last_use: u64,
        /// `copies` value of the last copy that read or wrote it.
        copy_use: u64,
    }

    /// A copy submitted and what it must keep alive until done.
    struct InFlight {
        value: u64,
        cmd: vk::CommandBuffer,
        _keep: Vec<Arc<dyn Any + Send + Sync>>,
    }

    struct State {
        pool: vk::CommandPool,
        free: Vec<vk::CommandBuffer>,
        in_flight: VecDeque<InFlight>,
        /// Last value signalled (or to be) on each semaphore.
        copies: u64,
        compute: u64,
        /// Highest `copies` value a wgpu submission waited for: wgpu's
        /// submissions run in order, so later ones need not wait again.
        waited: u64,
        targets: HashMap<wgpu::Buffer, Target>,
        stats: super::CopyQueueStats,
    }

    /// The copy queue of one device and its bookkeeping.
    pub(crate) struct CopyQueue {
        raw: ash::Device,
        queue: vk::Queue,
        pick: QueuePick,
        /// Families sharing its buffers, where they differ.
        sharing: Vec<u32>,
        copies: vk::Semaphore,
        compute: vk::Semaphore,
        state: Mutex<State>,
        /// Keeps the device alive until the semaphores and pool are gone.
        _device: wgpu::Device,
    }

    // SAFETY: the Vulkan handles are used under `state`'s lock (the pool,
    // the command buffers, the queue) or are thread-safe to use (semaphore
    // waits and queries); `ash::Device` is a table of function pointers.
    unsafe impl Send for CopyQueue {}
    unsafe impl Sync for CopyQueue {}

    fn timeline(raw: &ash::Device) -> Option<vk::Semaphore> {
        let mut ty = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let info = vk::SemaphoreCreateInfo::default().push_next(&mut ty);
        // SAFETY: a plain object creation on a live device.
        unsafe { raw.create_semaphore(&info, None).ok() }
    }

    impl CopyQueue {
        /// The queue `pick` names on `device`, opened with it (`add_queue`).
        pub(crate) fn new(device: &wgpu::Device, pick: QueuePick) -> Option<CopyQueue> {
            // SAFETY: the hal device outlives what is made here (held by
            // `_device`); every object is destroyed in `Drop`, or here on
            // failure.
            unsafe {
                let hal = device.as_hal::<Vulkan>()?;
                let raw = hal.raw_device().clone();
                let own = hal.queue_family_index();
                let queue = match (pick.family, pick.index) {
                    (f, 0) if f == own => hal.raw_queue(),
                    (f, i) => raw.get_device_queue(f, i),
                };
                let copies = timeline(&raw)?;
                let Some(compute) = timeline(&raw) else {
                    raw.destroy_semaphore(copies, None);
                    return None;
                };
                let info = vk::CommandPoolCreateInfo::default()
                    .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER)
                    .queue_family_index(pick.family);
                let Ok(pool) = raw.create_command_pool(&info, None) else {
                    raw.destroy_semaphore(copies, None);
                    raw.destroy_semaphore(compute, None);
                    return None;
                };
                let sharing = if pick.family == own {
                    Vec::new()
                } else {
                    vec![own, pick.family]
                };
                Some(CopyQueue {
                    raw,
                    queue,
                    pick,
                    sharing,
                    copies,
                    compute,
                    state: Mutex::new(State {
                        pool,
                        free: Vec::new(),
                        in_flight: VecDeque::new(),
                        copies: 0,
                        compute: 0,
                        waited: 0,
                        targets: HashMap::new(),
                        stats: Default::default(),
                    }),
                    _device: device.clone(),
                })
            }
        }

        /// What the queue is, for reports.
        pub(crate) fn describe(&self) -> String {
            format!(
                "{} (family {}, queue {})",
                self.pick.what, self.pick.family, self.pick.index
            )
        }

        /// Whether copies here can run beside wgpu's work.
        pub(crate) fn overlaps(&self) -> bool {
            self.pick.family != 0 || self.pick.index != 0
        }

        /// Sharing mode and families for a buffer both queues use.
        pub(crate) fn sharing(&self) -> (vk::SharingMode, &[u32]) {
            match self.sharing.is_empty() {
                true => (vk::SharingMode::EXCLUSIVE, &[]),
                false => (vk::SharingMode::CONCURRENT, &self.sharing),
            }
        }

        fn lock(&self) -> std::sync::MutexGuard<'_, State> {
            self.state.lock().expect("copy queue poisoned")
        }

        /// Runs `submit` (one wgpu `queue.submit`) so that it waits for
        /// every copy into a buffer `uses` says it uses, and signals the
        /// next `compute` value, which later copies into those buffers
        /// wait for. Under the lock: no other submission may take the
        /// semaphores staged for this one, and on a shared queue no copy
        /// is submitted meanwhile.
        pub(crate) fn submit_wgpu<R>(
            &self,
            queue: &wgpu::Queue,
            uses: impl Fn(&wgpu::Buffer) -> bool,
            submit: impl FnOnce() -> R,
        ) -> R {
            let mut s = self.lock();
            let value = s.compute + 1;
            let mut wait = 0;
            for (buf, t) in s.targets.iter_mut() {
                if uses(buf) {
                    t.last_use = value;
                    wait = wait.max(t.copy_use);
                }
            }
            // SAFETY: semaphores of this device, staged for the submission
            // made next, under the lock; the values only grow.
            unsafe {
                let hal = queue
                    .as_hal::<Vulkan>()
                    .expect("a copy queue exists on Vulkan devices only");
                if wait > s.waited {
                    hal.add_wait_semaphore(self.copies, Some(wait), vk::PipelineStageFlags::ALL_COMMANDS);
                    s.waited = wait;
                    s.stats.submissions_waiting += 1;
                }
                hal.add_signal_semaphore(self.compute, Some(value));
            }
            s.compute = value;
            submit()
        }

        /// Makes a device-local buffer of `bytes` for both queues
        /// (`STORAGE | COPY_DST | COPY_SRC`) and starts tracking it: a
        /// weight slot the queue writes, or the staging a download is
        /// copied through (the queue reads it).
        pub(crate) fn create_buffer(
            &self,
            device: &wgpu::Device,
            bytes: u64,
            label: &str,
        ) -> Option<wgpu::Buffer> {
            let usage = vk::BufferUsageFlags::STORAGE_BUFFER
                | vk::BufferUsageFlags::TRANSFER_DST
                | vk::BufferUsageFlags::TRANSFER_SRC;
            let (mode, families) = self.sharing();
            // SAFETY: objects made here go to wgpu-hal (`from_raw_managed`,
            // which frees them when wgpu destroys the buffer) or are
            // destroyed here on failure.
            let buffer = unsafe {
                let hal = device.as_hal::<Vulkan>()?;
                let dev = hal.raw_device();
                let info = vk::BufferCreateInfo::default()
                    .size(bytes)
                    .usage(usage)
                    .sharing_mode(mode)
                    .queue_family_indices(families);
                let buffer = dev.create_buffer(&info, None).ok()?;
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
                    .or_else(|| {
                        (0..types.memory_type_count).find(|&i| ok(i, vk::MemoryPropertyFlags::empty()))
                    });
                let Some(ty) = ty else {
                    dev.destroy_buffer(buffer, None);
                    return None;
                };
                let alloc = vk::MemoryAllocateInfo::default()
                    .allocation_size(req.size)
                    .memory_type_index(ty);
                let Ok(memory) = dev.allocate_memory(&alloc, None) else {
                    dev.destroy_buffer(buffer, None);
                    return None;
                };
                if dev.bind_buffer_memory(buffer, memory, 0).is_err() {
                    dev.destroy_buffer(buffer, None);
                    dev.free_memory(memory, None);
                    return None;
                }
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
            Some(buffer)
        }

        /// Whether every copy that used `buf` is done.
        pub(crate) fn idle(&self, buf: &wgpu::Buffer) -> bool {
            let used = self.lock().targets.get(buf).map_or(0, |t| t.copy_use);
            // SAFETY: a query of this device's semaphore.
            used == 0 || unsafe { self.raw.get_semaphore_counter_value(self.copies) }.is_ok_and(|v| v >= used)
        }

        /// Stops tracking `buf` (its owner let it go). Copies still in
        /// flight keep it alive themselves.
        pub(crate) fn forget(&self, buf: &wgpu::Buffer) {
            self.lock().targets.remove(buf);
        }

        /// Copies `regions` (source offset, destination offset, bytes)
        /// from `src` into `dst` after the last wgpu submission that used
        /// either, where it is one of [`CopyQueue::create_buffer`]'s (the
        /// other side is registered host memory). `to_host`: `dst` is host
        /// memory the CPU reads after [`CopyQueue::wait_for`] the value.
        /// `keep` stays alive until the copy is done. Returns the copy's
        /// `copies` value.
        pub(crate) fn copy(
            &self,
            src: &wgpu::Buffer,
            dst: &wgpu::Buffer,
            regions: &[(u64, u64, u64)],
            to_host: bool,
            keep: Vec<Arc<dyn Any + Send + Sync>>,
        ) -> Result<u64, crate::GpuError> {
            let fail = |what: &str, e: vk::Result| crate::GpuError::Unsupported {
                op: "copy queue",
                detail: format!("{what} failed: {e}"),
            };
            let mut s = self.lock();
            self.reclaim(&mut s);
            let after = [src, dst]
                .iter()
                .filter_map(|b| s.targets.get(*b))
                .map(|t| t.last_use)
                .max();
            let Some(after) = after else {
                return Err(crate::GpuError::Unsupported {
                    op: "copy queue",
                    detail: "neither side of the copy was made by the copy queue".into(),
                });
            };
            let value = s.copies + 1;
            let copies: Vec<vk::BufferCopy> = regions
                .iter()
                .map(|&(src_offset, dst_offset, size)| vk::BufferCopy {
                    src_offset,
                    dst_offset,
                    size,
                })
                .collect();
            // SAFETY: the command buffer is this queue's, recorded and
            // submitted under the lock; `src` and `dst` stay alive in
            // `keep` and `in_flight` until `value` is reached.
            unsafe {
                // One at a time: each guard holds wgpu's snatch lock.
                let raw = |b: &wgpu::Buffer| {
                    b.as_hal::<Vulkan>()
                        .map(|h| h.raw_handle())
                        .ok_or_else(|| crate::GpuError::Unsupported {
                            op: "copy queue",
                            detail: "a buffer of another backend".into(),
                        })
                };
                let (src_raw, dst_raw) = (raw(src)?, raw(dst)?);
                let cmd = match s.free.pop() {
                    Some(c) => c,
                    None => {
                        let info = vk::CommandBufferAllocateInfo::default()
                            .command_pool(s.pool)
                            .level(vk::CommandBufferLevel::PRIMARY)
                            .command_buffer_count(1);
                        self.raw
                            .allocate_command_buffers(&info)
                            .map_err(|e| fail("allocating a command buffer", e))?[0]
                    }
                };
                let begin =
                    vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
                let recorded = self.raw.begin_command_buffer(cmd, &begin).and_then(|()| {
                    if !copies.is_empty() {
                        self.raw.cmd_copy_buffer(cmd, src_raw, dst_raw, &copies);
                    }
                    if to_host {
                        // The device's writes made visible to the host's
                        // reads after its wait on the semaphore.
                        let barrier = vk::MemoryBarrier::default()
                            .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                            .dst_access_mask(vk::AccessFlags::HOST_READ);
                        self.raw.cmd_pipeline_barrier(
                            cmd,
                            vk::PipelineStageFlags::TRANSFER,
                            vk::PipelineStageFlags::HOST,
                            vk::DependencyFlags::empty(),
                            &[barrier],
                            &[],
                            &[],
                        );
                    }
                    self.raw.end_command_buffer(cmd)
                });
                if let Err(e) = recorded {
                    s.free.push(cmd);
                    return Err(fail("recording a copy", e));
                }
                let (wait_sems, wait_values, stages) = match after {
                    0 => (vec![], vec![], vec![]),
                    v => (
                        vec![self.compute],
                        vec![v],
                        vec![vk::PipelineStageFlags::TRANSFER],
                    ),
                };
                let signal_values = [value];
                let mut timeline = vk::TimelineSemaphoreSubmitInfo::default()
                    .wait_semaphore_values(&wait_values)
                    .signal_semaphore_values(&signal_values);
                let cmds = [cmd];
                let signal = [self.copies];
                let submit = vk::SubmitInfo::default()
                    .wait_semaphores(&wait_sems)
                    .wait_dst_stage_mask(&stages)
                    .command_buffers(&cmds)
                    .signal_semaphores(&signal)
                    .push_next(&mut timeline);
                if let Err(e) = self.raw.queue_submit(self.queue, &[submit], vk::Fence::null()) {
                    s.free.push(cmd);
                    return Err(fail("submitting a copy", e));
                }
                s.in_flight.push_back(InFlight {
                    value,
                    cmd,
                    _keep: keep,
                });
            }
            s.copies = value;
            s.stats.copies += 1;
            s.stats.copies_after_use += u64::from(after > 0);
            for b in [src, dst] {
                if let Some(t) = s.targets.get_mut(b) {
                    t.copy_use = value;
                }
            }
            Ok(value)
        }

        /// Blocks until copy `value` is done.
        pub(crate) fn wait_for(&self, value: u64) -> Result<(), crate::GpuError> {
            let (sems, values) = ([self.copies], [value]);
            let info = vk::SemaphoreWaitInfo::default().semaphores(&sems).values(&values);
            // SAFETY: a wait on this device's semaphore for a value a
            // submitted copy signals.
            unsafe { self.raw.wait_semaphores(&info, u64::MAX) }
                .map_err(|e| crate::GpuError::Poll(format!("waiting for the copy queue: {e}")))
        }

        /// Recycles the command buffers of finished copies and lets go of
        /// what they kept alive.
        fn reclaim(&self, s: &mut State) {
            // SAFETY: a query of this device's semaphore.
            let done = unsafe { self.raw.get_semaphore_counter_value(self.copies) }.unwrap_or(0);
            while s.in_flight.front().is_some_and(|f| f.value <= done) {
                let f = s.in_flight.pop_front().expect("checked");
                // SAFETY: the copy is done, so the buffer is not in use.
                unsafe {
                    let _ = self
                        .raw
                        .reset_command_buffer(f.cmd, vk::CommandBufferResetFlags::empty());
                }
                s.free.push(f.cmd);
            }
        }

        pub(crate) fn stats(&self) -> super::CopyQueueStats {
            self.lock().stats
        }

        /// Blocks until every copy submitted so far is done.
        pub(crate) fn wait_idle(&self) -> Result<(), crate::GpuError> {
            let last = self.lock().copies;
            self.wait_for(last)?;
            let mut s = self.lock();
            self.reclaim(&mut s);
            Ok(())
        }
    }

    impl Drop for CopyQueue {
        fn drop(&mut self) {
            let s = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
            // Neither semaphore may be destroyed while a submission that
            // signals it is pending: wait for both (bounded, so that a
            // lost device cannot hang the drop).
            let (sems, values) = ([self.copies, self.compute], [s.copies, s.compute]);
            let info = vk::SemaphoreWaitInfo::default().semaphores(&sems).values(&values);
            // SAFETY: the waits are for values submitted on this device;
            // afterwards nothing made here is in use.
            unsafe {
                let _ = self.raw.wait_semaphores(&info, 60_000_000_000);
                s.in_flight.clear();
                self.raw.destroy_command_pool(s.pool, None);
                self.raw.destroy_semaphore(self.copies, None);
                self.raw.destroy_semaphore(self.compute, None);
            }
        }
    }
}

#[cfg(any(target_vendor = "apple", target_arch = "wasm32"))]
mod vk {
    //! No Vulkan here, so no queue of its own: uploads are copied by the
    //! host (`host_import` imports nothing either).
    use std::any::Any;
    use std::sync::Arc;

    /// Never made: no value of this type exists.
    pub(crate) enum CopyQueue {}

    impl CopyQueue {
        pub(crate) fn describe(&self) -> String {
            match *self {}
        }
        pub(crate) fn overlaps(&self) -> bool {
            match *self {}
        }
        pub(crate) fn submit_wgpu<R>(
            &self,
            _: &wgpu::Queue,
            _: impl Fn(&wgpu::Buffer) -> bool,
            _: impl FnOnce() -> R,
        ) -> R {
            match *self {}
        }
        pub(crate) fn create_buffer(&self, _: &wgpu::Device, _: u64, _: &str) -> Option<wgpu::Buffer> {
            match *self {}
        }
        pub(crate) fn forget(&self, _: &wgpu::Buffer) {
            match *self {}
        }
        pub(crate) fn idle(&self, _: &wgpu::Buffer) -> bool {
            match *self {}
        }
        pub(crate) fn copy(
            &self,
            _: &wgpu::Buffer,
            _: &wgpu::Buffer,
            _: &[(u64, u64, u64)],
            _: bool,
            _: Vec<Arc<dyn Any + Send + Sync>>,
        ) -> Result<u64, crate::GpuError> {
            match *self {}
        }
        pub(crate) fn wait_for(&self, _: u64) -> Result<(), crate::GpuError> {
            match *self {}
        }
        pub(crate) fn wait_idle(&self) -> Result<(), crate::GpuError> {
            match *self {}
        }
        pub(crate) fn stats(&self) -> super::CopyQueueStats {
            match *self {}
        }
    }
}
