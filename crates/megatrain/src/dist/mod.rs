//! Data parallel training across processes (ARCHITECTURE.md, "Past one
//! GPU"). Each rank trains on its own rows of every batch; gradients are
//! summed across ranks on the host chunk by chunk as they land (the
//! trainer's transfer chunks, so no buffer is sized by a layer), by the
//! trainer's optimizer worker while the device goes on with earlier layers.
//!
//! [`Collective`] is the engine-neutral interface the trainer uses; the MPI
//! implementation (`mpi::MpiComm`, feature `mpi`) is the only one that
//! spans processes; [`local::LocalComm`] runs ranks as threads of one
//! process (tests: no MPI, and sums in rank order whatever the message
//! sizes). Nothing here needs MPI to build.

mod check;
pub mod local;
pub mod machines;
#[cfg(feature = "mpi")]
pub mod mpi;
mod shard;

use std::sync::Arc;

pub use check::check_same;
pub use machines::{Machines, Shared, Sharing, share_transport};
pub use shard::{chunk_ranges, shard_range, shard_ranges, shard_ranges_aligned};

#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("{engine}: {call} failed with error code {code}")]
    Engine {
        engine: &'static str,
        call: &'static str,
        code: i32,
    },
    #[error("{what}: {count} elements exceed what one {engine} call can move ({max})")]
    TooLarge {
        engine: &'static str,
        what: String,
        count: usize,
        max: usize,
    },
    #[error("ranks disagree before the first step: {0}")]
    Mismatch(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = DistError> = std::result::Result<T, E>;

/// Whether this process was started by an MPI launcher (`mpirun`, `srun`
/// with PMI/PMIx): only then is MPI initialised, so a build with the
/// feature still runs alone without one.
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"]
        .iter()
        .any(|k| std::env::var_os(k).is_some())
}

/// This process's index among the ranks on its node (picks its GPU).
pub fn local_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// How many ranks run on this process's node, as the launcher says.
pub fn local_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// How many of a node's `local_size` ranks use the device of local rank
/// `local_rank`, where they take `devices` devices in turn (rank r the
/// (r mod devices)-th, as `GpuContext::with_adapter_choice` does): at
/// least 1.
pub fn ranks_per_device(local_rank: usize, local_size: usize, devices: usize) -> usize {
    let d = devices.max(1);
    let first = local_rank % d;
    local_size.saturating_sub(first).div_ceil(d).max(1)
}

/// Element type of a buffer moved by a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    /// bf16 or f16 transport copies: moved as raw 16-bit words.
    U16,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::U16 => 2,
        }
    }
}

/// A non-blocking collective in flight. Its buffers stay valid until
/// [`InFlight::wait`] returns: an implementation must not return from
/// dropping one before the operation has completed.
pub trait InFlight: Send {
    /// Blocks until the operation is complete.
    fn wait(self: Box<Self>) -> Result<()>;
}

/// The collectives data parallel training needs. Every rank must call the
/// same collectives in the same order (the trainer issues them in layer
/// order from one thread at a time).
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The engine's name, for messages (`MPI`).
    fn engine(&self) -> &'static str;

    /// Blocking element-wise sum of a small f64 vector across ranks.
    fn sum_f64(&self, x: &mut [f64]) -> Result<()>;
    /// Blocking: replaces `bytes` with rank 0's.
    fn broadcast_bytes(&self, bytes: &mut Vec<u8>) -> Result<()>;
    /// Blocks until every rank has called it; what a rank wrote to memory
    /// other ranks map before it is visible to them after it.
    fn barrier(&self) -> Result<()>;
    /// A communicator of the ranks that passed the same `color`, in rank
    /// order: a collective.
    fn split(&self, color: usize) -> Result<Arc<dyn Collective>>;
    /// A communicator of the ranks on this rank's machine (those that can
    /// map one file together), in rank order: a collective.
    fn split_machine(&self) -> Result<Arc<dyn Collective>>;
    /// Blocking gather of f32 shards into `buf` on rank 0: rank k's
    /// `buf[ranges[k]]` lands at the same place of rank 0's `buf`. Other
    /// ranks' `buf` outside their range is left alone.
    fn gather_f32_to_root(&self, buf: &mut [f32], ranges: &[std::ops::Range<usize>]) -> Result<()>;

    /// Starts summing `send` across ranks into `recv` (both `len` elements).
    ///
    /// # Safety
    /// Both buffers must stay valid until the returned operation has been
    /// waited on; `send` must not be written and `recv` neither read nor
    /// written meanwhile.
    unsafe fn start_sum(&self, send: *const f32, recv: *mut f32, len: usize) -> Result<Box<dyn InFlight>>;
    /// Starts a reduce-scatter: `send` (`ranges` covering it in rank order,
    /// some possibly empty: a chunk of a layer cut by the ranks' shards, see
    /// [`chunk_ranges`]) is summed across ranks and this rank's range of
    /// the sum lands in `recv` (`ranges[rank].len()` elements).
    ///
    /// # Safety
    /// Both buffers must stay valid until the returned operation has been
    /// waited on; `send` must not be written and `recv` neither read nor
    /// written meanwhile.
    unsafe fn start_reduce_scatter(
        &self,
        send: *const f32,
        recv: *mut f32,
        ranges: &[std::ops::Range<usize>],
    ) -> Result<Box<dyn InFlight>>;
    /// Starts an in-place all-gather: rank k's `buf[ranges[k]]` (elements
    /// of `elem`; `ranges` disjoint, in rank order, some possibly empty) is
    /// copied into every rank's `buf`.
    ///
    /// # Safety
    /// `buf` must stay valid, and untouched, until the returned operation
    /// has been waited on.
    unsafe fn start_all_gather(
        &self,
        buf: *mut u8,
        elem: Elem,
        ranges: &[std::ops::Range<usize>],
    ) -> Result<Box<dyn InFlight>>;

    /// Ends every rank's process after a failure on this one (so no rank
    /// waits forever in a collective the failed rank will never join).
    fn abort(&self, code: i32) -> !;
}

/// How a trainer takes part in data parallel training.
#[derive(Clone)]
pub struct DistConfig {
    pub comm: Arc<dyn Collective>,
    /// ZeRO-1/2: each rank updates only its 1/N of every layer (p, m, v),
    /// from reduce-scattered gradients, and the transport copies are
    /// all-gathered; otherwise gradients are all-reduced and every rank
    /// updates every layer.
    pub shard_optimizer: bool,
    /// The machines whose ranks share their transport copies, for a tier
    /// built with [`megatrain_tier::TierConfig::shared_transport`] (see
    /// [`machines`]). `None`: each rank holds a copy.
    pub shared: Option<Machines>,
}

impl std::fmt::Debug for DistConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistConfig")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("engine", &self.comm.engine())
            .field("shard_optimizer", &self.shard_optimizer)
            .field("shared", &self.shared)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::ranks_per_device;

    /// Ranks take the devices in turn: each device's count is how many
    /// local ranks land on it, and the counts add up to the ranks.
    #[test]
    fn ranks_share_devices_in_turn() {
        assert_eq!(ranks_per_device(0, 1, 1), 1);
        // 8 ranks on 8 GPUs: one each; on 4: two each; on one: all.
        assert!((0..8).all(|r| ranks_per_device(r, 8, 8) == 1));
        assert!((0..8).all(|r| ranks_per_device(r, 8, 4) == 2));
        assert!((0..8).all(|r| ranks_per_device(r, 8, 1) == 8));
        // 6 ranks on 4 GPUs: devices 0 and 1 get two, 2 and 3 one.
        let counts: Vec<usize> = (0..6).map(|r| ranks_per_device(r, 6, 4)).collect();
        assert_eq!(counts, [2, 2, 1, 1, 2, 2]);
        // Fewer ranks than devices; no count of devices is one device.
        assert_eq!(ranks_per_device(1, 2, 8), 1);
        assert_eq!(ranks_per_device(2, 3, 0), 3);
    }
}
