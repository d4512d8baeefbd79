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

/// How long the copy queue's check as the device opens may take: it moves
/// two pages.
pub(crate) const CHECK_BOUND: std::time::Duration = std::time::Duration::from_secs(10);

/// Why the copy queue's check failed.
#[derive(Debug)]
pub(crate) enum Failed {
    /// The queue finished (wrong bytes, or a copy it could not queue): it
    /// is idle and may be dropped.
    Idle(String),
    /// It did not finish within the bound: what it was given must never
    /// be freed, the queue included.
    Stalled(String),
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::Idle(w) | Failed::Stalled(w) => f.write_str(w),
        }
    }
}

#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
mod buffers;
#[cfg(any(target_vendor = "apple", target_arch = "wasm32"))]
mod none;
#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
mod pick;
#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
mod probe;
#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
mod vulkan;

#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
pub(crate) use buffers::allocate_bound;
#[cfg(any(target_vendor = "apple", target_arch = "wasm32"))]
pub(crate) use none::{CopyQueue, round_trip};
#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
pub(crate) use pick::{QueuePick, add_queue, pick};
#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
pub(crate) use probe::round_trip;
#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
pub(crate) use vulkan::CopyQueue;
