//! Spill files and the optimizer's window onto them.
//!
//! A spilled layer keeps its p, m and v in three preallocated scratch files
//! (see [`crate::AlignedBuf`]). Once per step the optimizer reads each of
//! them, updates it and writes it back: 24 bytes per parameter through the
//! disk. [`SpillWindow`] does that I/O on two threads of its own so the
//! optimizer never touches the disk itself:
//!
//! - a reader runs ahead in the order the optimizer will meet the layers
//!   (the backward's: last layer first), filling RAM chunks of p, m and v
//!   with positioned reads (`pread`);
//! - the optimizer takes each chunk, runs AdamW on it and hands it back;
//! - a writer writes it behind (`pwrite`) and returns the buffers to the
//!   reader.
//!
//! The window is a fixed number of chunk sets ([`WindowConfig`]), so the
//! RAM it adds is bounded whatever the layer sizes: a 2 GB layer streams
//! through the same few buffers as a small one. Chunks are cut on multiples
//! of 32 Ki elements; AdamW is elementwise, so updating a layer chunk by
//! chunk gives the same bits as updating it whole.
//!
//! Files are opened with `O_DIRECT` where the filesystem supports it
//! (tmpfs does not; then the same calls go through the page cache). On the
//! development VM buffered writes of 2 GiB ran at 0.36–1.3 GB/s from one
//! run to the next against a steady 1.5 GB/s direct (dd, 2026-11-23), and
//! direct I/O skips the page-cache copy, which matters on 2 cores. The
//! transfers are tens of MiB each, which the block layer already splits
//! into a deep queue of requests, so one thread per direction keeps the
//! device busy without `io_uring` (no crate earns its keep here beyond
//! `libc` for `O_DIRECT`, `posix_fallocate` and `posix_fadvise`).
//!
//! Errors are values, never signals: a write that finds the disk full is a
//! [`crate::TierError::DiskFull`] from [`SpillWindow::finish`].

mod clock;
mod file;
mod probe;
#[cfg(test)]
mod tests;
mod window;

pub use clock::SpillStats;
pub use file::{SpillRegion, SpilledLayer};
pub(crate) use file::{open_spill_file, reserve_blocks};
pub use probe::{DiskBandwidth, measure_disk_bandwidth};
pub use window::{CHUNK_ALIGN, Chunk, SpillWindow, WindowConfig};
