//! The spill files: created with their blocks reserved, opened for direct
//! I/O where the filesystem allows, read and written at page-aligned
//! offsets.

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::buf::PAGE;
use crate::error::{IoContext, Result, TierError};

/// Opens a new spill file of `bytes` at `path` and reserves the blocks of
/// its bytes `reserve` (page-aligned; the rest stays a hole that nothing
/// may write through a map: a rank of a sharded optimizer reserves only
/// its range). Returns the file and whether it is open for direct I/O. On
/// failure nothing is left at `path`.
pub(crate) fn open_spill_file(path: &Path, bytes: u64, reserve: Range<u64>) -> Result<(File, bool)> {
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create_new(true);
        #[cfg(target_os = "linux")]
        if direct {
            use std::os::unix::fs::OpenOptionsExt;
            o.custom_flags(libc::O_DIRECT);
        }
        let _ = direct;
        o.open(path)
    };
    let (file, direct) = match open(cfg!(target_os = "linux")) {
        Ok(f) => (f, cfg!(target_os = "linux")),
        // tmpfs and some FUSE filesystems refuse O_DIRECT.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (open(false).at(path)?, false),
        Err(e) => return Err(e).at(path),
    };
    if let Err(e) = preallocate(&file, bytes, reserve) {
        let _ = std::fs::remove_file(path);
        return Err(e).at(path);
    }
    Ok((file, direct))
}

/// Reserves the blocks of bytes `reserve` of a file of `bytes`, so that
/// ENOSPC comes now, not at write-back (or as SIGBUS, through a map).
/// Falls back to a sparse file where the filesystem cannot allocate.
fn preallocate(file: &File, bytes: u64, reserve: Range<u64>) -> std::io::Result<()> {
    file.set_len(bytes)?;
    reserve_blocks(file, reserve.start.min(bytes)..reserve.end.min(bytes))
}

/// Reserves the blocks of bytes `reserve` of `file` (within its length).
pub(crate) fn reserve_blocks(file: &File, reserve: Range<u64>) -> std::io::Result<()> {
    #[cfg(unix)]
    if !reserve.is_empty() {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor; the call only changes the file.
        let rc = unsafe {
            libc::posix_fallocate(
                file.as_raw_fd(),
                reserve.start as libc::off_t,
                (reserve.end - reserve.start) as libc::off_t,
            )
        };
        match rc {
            0 | libc::EOPNOTSUPP | libc::EINVAL => {}
            e => return Err(std::io::Error::from_raw_os_error(e)),
        }
    }
    let _ = reserve;
    Ok(())
}

/// One spill file, for positioned I/O: every offset and length a multiple
/// of [`PAGE`], every buffer page-aligned (what `O_DIRECT` asks).
#[derive(Debug, Clone)]
pub struct SpillRegion {
    file: Arc<File>,
    path: PathBuf,
    bytes: u64,
    direct: bool,
}

impl SpillRegion {
    pub(crate) fn new(file: Arc<File>, path: PathBuf, bytes: u64, direct: bool) -> Self {
        SpillRegion {
            file,
            path,
            bytes,
            direct,
        }
    }

    /// The name the file had (it is unlinked right after creation).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reserved bytes (whole pages).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Reserves blocks for the whole file (see [`reserve_blocks`]).
    pub(crate) fn reserve_all(&self) -> Result<()> {
        reserve_blocks(&self.file, 0..self.bytes).at(&self.path)
    }

    /// Bytes of disk the file holds (its allocated blocks).
    pub fn allocated_bytes(&self) -> Result<u64> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            Ok(self.file.metadata().at(&self.path)?.blocks() * 512)
        }
        #[cfg(not(unix))]
        Ok(self.bytes)
    }

    /// The file still has the length it was created with.
    pub fn check_len(&self) -> Result<()> {
        let got = self.file.metadata().at(&self.path)?.len();
        if got != self.bytes {
            return Err(TierError::SpillLength {
                path: self.path.clone(),
                expected: self.bytes,
                got,
            });
        }
        Ok(())
    }

    /// The open file (for syncing and advice).
    pub(super) fn file(&self) -> &File {
        &self.file
    }

    fn check_io(&self, ptr: *const u8, len: usize, offset: u64) -> Result<()> {
        let ok = (ptr as usize).is_multiple_of(PAGE)
            && len.is_multiple_of(PAGE)
            && offset.is_multiple_of(PAGE as u64)
            && offset + len as u64 <= self.bytes;
        if ok {
            Ok(())
        } else {
            Err(TierError::Spill(format!(
                "{}: unaligned or out-of-range I/O ({len} bytes at {offset} of {})",
                self.path.display(),
                self.bytes
            )))
        }
    }

    /// Fills `buf` from `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check_io(buf.as_ptr(), buf.len(), offset)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            self.file.read_exact_at(buf, offset).at(&self.path)
        }
        #[cfg(not(unix))]
        {
            use std::os::windows::fs::FileExt;
            let mut done = 0;
            while done < buf.len() {
                let n = self
                    .file
                    .seek_read(&mut buf[done..], offset + done as u64)
                    .at(&self.path)?;
                if n == 0 {
                    return Err(TierError::Spill(format!("{}: short read", self.path.display())));
                }
                done += n;
            }
            Ok(())
        }
    }

    /// Writes `buf` at `offset`.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.check_io(buf.as_ptr(), buf.len(), offset)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            self.file.write_all_at(buf, offset).at(&self.path)
        }
        #[cfg(not(unix))]
        {
            use std::os::windows::fs::FileExt;
            let mut done = 0;
            while done < buf.len() {
                done += self
                    .file
                    .seek_write(&buf[done..], offset + done as u64)
                    .at(&self.path)?;
            }
            Ok(())
        }
    }
}

/// A spilled layer's p, m and v files, and the elements of them a
/// [`crate::SpillWindow`] moves.
#[derive(Debug, Clone)]
pub struct SpilledLayer {
    pub layer: usize,
    pub numel: usize,
    pub p: SpillRegion,
    pub m: SpillRegion,
    pub v: SpillRegion,
    /// The whole layer, or the part of it one rank of a sharded optimizer
    /// owns (starting on a page, see [`SpilledLayer::only`]).
    pub range: Range<usize>,
}

impl SpilledLayer {
    /// The same files, moving only elements `range`; it must start on a
    /// page ([`PAGE`] / 4 elements), since the window's I/O is direct.
    pub fn only(self, range: Range<usize>) -> Result<Self> {
        let l = SpilledLayer { range, ..self };
        l.check_range()?;
        Ok(l)
    }

    pub(super) fn check_range(&self) -> Result<()> {
        let r = &self.range;
        if r.start > r.end || r.end > self.numel || (!r.is_empty() && !r.start.is_multiple_of(PAGE / 4)) {
            return Err(TierError::Spill(format!(
                "layer {}: elements {r:?} of {} do not start on a page of its spill files",
                self.layer, self.numel
            )));
        }
        Ok(())
    }

    pub(super) fn regions(&self) -> [&SpillRegion; 3] {
        [&self.p, &self.m, &self.v]
    }
}
