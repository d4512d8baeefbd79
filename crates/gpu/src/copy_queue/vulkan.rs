//! The copy queue on Vulkan: its submissions, the two timeline
//! semaphores, and the buffers both queues use.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use ash::vk;
use wgpu::hal::api::Vulkan;

use super::{CopyQueueStats, QueuePick};

/// Where a buffer stands between the two queues.
#[derive(Default)]
pub(super) struct Target {
    /// `compute` value of the last wgpu submission that used it.
    last_use: u64,
    /// `copies` value of the last copy that read or wrote it.
    copy_use: u64,
}

/// How long a host wait for one copy may take before it is an error.
const STALL: std::time::Duration = std::time::Duration::from_secs(120);

/// Why a bounded wait for a copy ended without it.
#[derive(Debug)]
pub(crate) enum Waited {
    /// The bound passed: the copy may still run (or never will).
    Stalled,
    /// The wait itself failed (a lost device).
    Failed(vk::Result),
}

/// A copy submitted and what it must keep alive until done.
struct InFlight {
    value: u64,
    cmd: vk::CommandBuffer,
    _keep: Vec<Arc<dyn Any + Send + Sync>>,
}

pub(super) struct State {
    pool: vk::CommandPool,
    free: Vec<vk::CommandBuffer>,
    in_flight: VecDeque<InFlight>,
    /// Last value signalled (or to be) on each semaphore.
    copies: u64,
    compute: u64,
    /// Highest `copies` value a wgpu submission waited for: wgpu's
    /// submissions run in order, so later ones need not wait again.
    waited: u64,
    pub(super) targets: HashMap<wgpu::Buffer, Target>,
    stats: CopyQueueStats,
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

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
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
            .max()
            .ok_or_else(|| crate::GpuError::Unsupported {
                op: "copy queue",
                detail: "neither side of the copy was made by the copy queue".into(),
            })?;
        let value = s.copies + 1;
        let copies: Vec<vk::BufferCopy> = regions
            .iter()
            .map(|&(src_offset, dst_offset, size)| vk::BufferCopy {
                src_offset,
                dst_offset,
                size,
            })
            .collect();
        let (src_raw, dst_raw) = (super::buffers::raw_buffer(src)?, super::buffers::raw_buffer(dst)?);
        let cmd = match s.free.pop() {
            Some(c) => c,
            None => {
                let info = vk::CommandBufferAllocateInfo::default()
                    .command_pool(s.pool)
                    .level(vk::CommandBufferLevel::PRIMARY)
                    .command_buffer_count(1);
                // SAFETY: the pool is this queue's, used under the lock.
                unsafe { self.raw.allocate_command_buffers(&info) }
                    .map_err(|e| fail("allocating a command buffer", e))?[0]
            }
        };
        // SAFETY: the command buffer is this queue's, recorded and
        // submitted under the lock; `src` and `dst` stay alive (`keep`,
        // and the callers' own) until `value` is reached.
        let done = unsafe { self.record(cmd, src_raw, dst_raw, &copies, to_host) }
            .map_err(|e| fail("recording a copy", e))
            .and_then(|()| {
                unsafe { self.submit(cmd, after, value) }.map_err(|e| fail("submitting a copy", e))
            });
        if let Err(e) = done {
            s.free.push(cmd);
            return Err(e);
        }
        s.in_flight.push_back(InFlight {
            value,
            cmd,
            _keep: keep,
        });
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

    /// Records `copies` from `src` to `dst` into `cmd`.
    ///
    /// # Safety
    /// `cmd` is a free command buffer of this queue's pool, under the lock.
    unsafe fn record(
        &self,
        cmd: vk::CommandBuffer,
        src: vk::Buffer,
        dst: vk::Buffer,
        copies: &[vk::BufferCopy],
        to_host: bool,
    ) -> ash::prelude::VkResult<()> {
        let begin = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: forwarded from the caller.
        unsafe {
            self.raw.begin_command_buffer(cmd, &begin)?;
            if !copies.is_empty() {
                self.raw.cmd_copy_buffer(cmd, src, dst, copies);
            }
            if to_host {
                // The device's writes made visible to the host's reads
                // after its wait on the semaphore.
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
        }
    }

    /// Submits `cmd` to wait for wgpu's submission `after` (none if 0)
    /// and signal `value` on `copies`.
    ///
    /// # Safety
    /// `cmd` is recorded, under the lock.
    unsafe fn submit(&self, cmd: vk::CommandBuffer, after: u64, value: u64) -> ash::prelude::VkResult<()> {
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
        // SAFETY: forwarded from the caller; the queue is used under the
        // lock (and, shared with wgpu, only between its submissions,
        // which `submit_wgpu` makes under the same lock).
        unsafe { self.raw.queue_submit(self.queue, &[submit], vk::Fence::null()) }
    }

    /// Blocks until copy `value` is done.
    /// Bounded by [`STALL`]: a copy is one layer, so a wait that long is
    /// a stalled queue, reported instead of hanging the run.
    pub(crate) fn wait_for(&self, value: u64) -> Result<(), crate::GpuError> {
        self.wait_within(value, STALL).map_err(|e| match e {
            Waited::Stalled => crate::GpuError::Poll(format!(
                "the copy queue ({}) did not finish copy {value} in {} s; \
                 {}=off keeps the device's copies on wgpu's queue",
                self.describe(),
                STALL.as_secs(),
                super::COPY_QUEUE_ENV
            )),
            Waited::Failed(e) => crate::GpuError::Poll(format!("waiting for the copy queue: {e}")),
        })
    }

    /// Blocks until copy `value` is done or `bound` has passed.
    pub(crate) fn wait_within(&self, value: u64, bound: std::time::Duration) -> Result<(), Waited> {
        let (sems, values) = ([self.copies], [value]);
        let info = vk::SemaphoreWaitInfo::default().semaphores(&sems).values(&values);
        // SAFETY: a wait on this device's semaphore for a value a
        // submitted copy signals.
        match unsafe { self.raw.wait_semaphores(&info, bound.as_nanos() as u64) } {
            Ok(()) => Ok(()),
            Err(vk::Result::TIMEOUT) => Err(Waited::Stalled),
            Err(e) => Err(Waited::Failed(e)),
        }
    }

    /// The value of the last copy submitted.
    pub(crate) fn last_copy(&self) -> u64 {
        self.lock().copies
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

    pub(crate) fn stats(&self) -> CopyQueueStats {
        self.lock().stats
    }

    /// Blocks until every copy submitted so far is done.
    pub(crate) fn wait_idle(&self) -> Result<(), crate::GpuError> {
        self.wait_for(self.last_copy())?;
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
            let _ = self.raw.wait_semaphores(&info, STALL.as_nanos() as u64);
            s.in_flight.clear();
            self.raw.destroy_command_pool(s.pool, None);
            self.raw.destroy_semaphore(self.copies, None);
            self.raw.destroy_semaphore(self.compute, None);
        }
    }
}
