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
    /// Under F16: operand max scans and the bytes they read, outputs whose
    /// maxima their producers stored instead, f16 operand copies.
    pub operand_max_scans: u64,
    pub operand_max_scan_bytes: u64,
    pub output_maxima_stored: u64,
    pub operand_f16_copies: u64,
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
            operand_max_scans: self.operand_max_scans - b.operand_max_scans,
            operand_max_scan_bytes: self.operand_max_scan_bytes - b.operand_max_scan_bytes,
            output_maxima_stored: self.output_maxima_stored - b.output_maxima_stored,
            operand_f16_copies: self.operand_f16_copies - b.operand_f16_copies,
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
            operand_max_scans: self.operand_max_scans(),
            operand_max_scan_bytes: self.operand_max_scan_bytes(),
            output_maxima_stored: self.output_maxima_stored(),
            operand_f16_copies: self.operand_f16_copies(),
        }
    }
}
