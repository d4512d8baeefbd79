//! No Vulkan here, so no queue of its own: uploads are copied by the host
//! (`host_import` imports nothing either).

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
    pub(crate) fn create_buffer(&self, _: &wgpu::Device, _: u64, _: &str) -> Result<wgpu::Buffer, String> {
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

/// Nothing to check: no context here has a copy queue.
pub(crate) fn round_trip(ctx: &Arc<crate::GpuContext>, _: std::time::Duration) -> Result<(), super::Failed> {
    match ctx.copy_queue.as_deref() {
        Some(q) => match *q {},
        None => Ok(()),
    }
}
