//! Everything the executor counts of the host's work, in one snapshot: what
//! `bench-throughput` reports per step and `tests/host_floor.rs` bounds.

use super::{GpuExecutor, SubmitStats};

/// Counters since the executor was made; the difference of two snapshots
/// is the work between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostWork {
    /// Ops, dispatches, passes, submissions and waits.
    pub submit: SubmitStats,
    pub bind_groups_made: u64,
    pub device_allocations: u64,
    /// Staging and readback buffers the transports made.
    pub host_buffers_made: u64,
    pub uploads: u64,
    pub downloads: u64,
}

impl std::ops::Sub for HostWork {
    type Output = HostWork;

    fn sub(self, b: HostWork) -> HostWork {
        HostWork {
            submit: self.submit - b.submit,
            bind_groups_made: self.bind_groups_made - b.bind_groups_made,
            device_allocations: self.device_allocations - b.device_allocations,
            host_buffers_made: self.host_buffers_made - b.host_buffers_made,
            uploads: self.uploads - b.uploads,
            downloads: self.downloads - b.downloads,
        }
    }
}

impl GpuExecutor {
    pub fn host_work(&self) -> HostWork {
        let t = self.transport_stats();
        HostWork {
            submit: self.submit_stats(),
            bind_groups_made: self.bind_group_stats().made,
            device_allocations: self.memory().allocations,
            host_buffers_made: t.buffers_created,
            uploads: t.uploads,
            downloads: t.downloads,
        }
    }
}
