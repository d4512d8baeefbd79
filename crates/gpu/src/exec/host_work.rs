//! Everything the executor counts of the host's work, in one snapshot: what
//! `bench-throughput` reports per step and `tests/host_floor.rs` bounds.

use super::GpuExecutor;

/// Counters since the executor was made; the difference of two snapshots
/// is the work between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostWork {
    pub ops: u64,
    /// Compute dispatches, and the compute passes holding them.
    pub dispatches: u64,
    pub passes: u64,
    pub op_submissions: u64,
    pub transfer_submissions: u64,
    /// Times the host waited for the device (polls that wait, buffer maps).
    pub waits: u64,
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
            ops: self.ops - b.ops,
            dispatches: self.dispatches - b.dispatches,
            passes: self.passes - b.passes,
            op_submissions: self.op_submissions - b.op_submissions,
            transfer_submissions: self.transfer_submissions - b.transfer_submissions,
            waits: self.waits - b.waits,
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
        let s = self.submit_stats();
        let t = self.transport_stats();
        HostWork {
            ops: s.ops,
            dispatches: s.dispatches,
            passes: s.passes,
            op_submissions: s.op_submissions,
            transfer_submissions: s.transfer_submissions,
            waits: s.waits,
            bind_groups_made: self.bind_group_stats().made,
            device_allocations: self.memory().allocations,
            host_buffers_made: t.buffers_created,
            uploads: t.uploads,
            downloads: t.downloads,
        }
    }
}
