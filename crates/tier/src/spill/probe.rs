//! The disk's sequential bandwidth, measured the way the window does I/O.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::file::{SpillRegion, open_spill_file};
use crate::buf::AlignedBuf;
use crate::error::{IoContext, Result};

/// Sequential bandwidth of the disk under `dir`, in GB/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiskBandwidth {
    pub read_gb_s: f64,
    pub write_gb_s: f64,
    pub bytes: u64,
    /// Measured with `O_DIRECT` (as the spill I/O runs), else buffered
    /// with the written pages dropped from the cache before reading.
    pub direct: bool,
}

/// Writes a scratch file of `bytes` in `dir` in 32 MiB blocks (synced),
/// then reads it back, the way the spill window does; removes it.
pub fn measure_disk_bandwidth(dir: &Path, bytes: u64) -> Result<DiskBandwidth> {
    const BLOCK: usize = 32 << 20;
    std::fs::create_dir_all(dir).at(dir)?;
    let bytes = (bytes.max(BLOCK as u64) / BLOCK as u64) * BLOCK as u64;
    let path = dir.join(format!("megatrain-disk-probe-{}.bin", std::process::id()));
    let (file, direct) = open_spill_file(&path, bytes, 0..bytes)?;
    let region = SpillRegion::new(Arc::new(file), path.clone(), bytes, direct);
    let res = (|| {
        let mut buf = AlignedBuf::<u8>::zeroed(BLOCK)?;
        for (i, x) in buf.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        let t = Instant::now();
        for k in 0..bytes / BLOCK as u64 {
            region.write_at(&buf, k * BLOCK as u64)?;
        }
        region.file().sync_all().at(&path)?;
        let write_s = t.elapsed().as_secs_f64();
        #[cfg(target_os = "linux")]
        if !direct {
            use std::os::fd::AsRawFd;
            // SAFETY: a valid descriptor; advice only.
            unsafe { libc::posix_fadvise(region.file().as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
        let t = Instant::now();
        for k in 0..bytes / BLOCK as u64 {
            region.read_at(&mut buf, k * BLOCK as u64)?;
        }
        let read_s = t.elapsed().as_secs_f64();
        Ok(DiskBandwidth {
            read_gb_s: bytes as f64 / read_s / 1e9,
            write_gb_s: bytes as f64 / write_s / 1e9,
            bytes,
            direct,
        })
    })();
    drop(region);
    let _ = std::fs::remove_file(&path);
    res
}
