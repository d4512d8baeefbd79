//! What the window moved and how long the disk was busy: the union of the
//! intervals with a read or write in flight, kept by both I/O threads.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::Result;

/// What the window moved, and how long the disk and the optimizer took.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpillStats {
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Wall time with at least one read or write in flight.
    pub disk_busy_ms: f64,
    /// Time inside reads, and inside writes (they overlap each other).
    pub read_ms: f64,
    pub write_ms: f64,
    /// The optimizer waiting for a chunk to be read, plus the wait for the
    /// last writes at [`super::SpillWindow::finish`].
    pub wait_ms: f64,
}

impl SpillStats {
    /// Bytes moved per second of disk-busy time, in GB/s.
    pub fn gb_per_s(&self) -> f64 {
        if self.disk_busy_ms > 0.0 {
            (self.bytes_read + self.bytes_written) as f64 / (self.disk_busy_ms / 1e3) / 1e9
        } else {
            0.0
        }
    }
}

/// Union of the intervals with I/O in flight.
#[derive(Debug)]
pub(super) struct DiskClock {
    in_flight: u32,
    since: Instant,
    pub(super) busy: Duration,
    pub(super) bytes_read: u64,
    pub(super) bytes_written: u64,
    pub(super) read: Duration,
    pub(super) write: Duration,
}

impl DiskClock {
    pub(super) fn new() -> Self {
        DiskClock {
            in_flight: 0,
            since: Instant::now(),
            busy: Duration::ZERO,
            bytes_read: 0,
            bytes_written: 0,
            read: Duration::ZERO,
            write: Duration::ZERO,
        }
    }
}

pub(super) type Clock = Arc<Mutex<DiskClock>>;

/// Runs `f` as disk time, counting `bytes` as read (`write == false`) or
/// written.
pub(super) fn timed<T>(clock: &Clock, write: bool, bytes: u64, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let start = {
        let mut c = clock.lock().expect("disk clock poisoned");
        let now = Instant::now();
        if c.in_flight == 0 {
            c.since = now;
        }
        c.in_flight += 1;
        now
    };
    let out = f();
    let mut c = clock.lock().expect("disk clock poisoned");
    let now = Instant::now();
    c.in_flight -= 1;
    if c.in_flight == 0 {
        let since = c.since;
        c.busy += now - since;
    }
    if write {
        c.write += now - start;
        if out.is_ok() {
            c.bytes_written += bytes;
        }
    } else {
        c.read += now - start;
        if out.is_ok() {
            c.bytes_read += bytes;
        }
    }
    out
}
