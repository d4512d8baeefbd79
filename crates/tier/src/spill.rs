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
//! [`TierError::DiskFull`] from [`SpillWindow::finish`].

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::buf::{AlignedBuf, PAGE};
use crate::error::{IoContext, Result, TierError};

/// Opens a new spill file at `path` and reserves `bytes` for it. Returns
/// the file and whether it is open for direct I/O. On failure nothing is
/// left at `path`.
pub(crate) fn open_spill_file(path: &Path, bytes: u64) -> Result<(File, bool)> {
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
    if let Err(e) = preallocate(&file, bytes) {
        let _ = std::fs::remove_file(path);
        return Err(e).at(path);
    }
    Ok((file, direct))
}

/// Reserves the file's blocks so that ENOSPC comes now, not at write-back.
/// Falls back to a sparse `set_len` where the filesystem cannot allocate.
fn preallocate(file: &File, bytes: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor; the call only changes the file.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, bytes as libc::off_t) };
        match rc {
            0 => return Ok(()),
            libc::EOPNOTSUPP | libc::EINVAL => {}
            e => return Err(std::io::Error::from_raw_os_error(e)),
        }
    }
    file.set_len(bytes)
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

/// A spilled layer's p, m and v files.
#[derive(Debug, Clone)]
pub struct SpilledLayer {
    pub layer: usize,
    pub numel: usize,
    pub p: SpillRegion,
    pub m: SpillRegion,
    pub v: SpillRegion,
}

impl SpilledLayer {
    fn regions(&self) -> [&SpillRegion; 3] {
        [&self.p, &self.m, &self.v]
    }
}

/// Size of the window: `depth` chunk sets of p, m and v, each chunk at most
/// `chunk_elems` f32 elements, so at most `12 · chunk_elems · depth` bytes
/// of RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowConfig {
    pub chunk_elems: usize,
    pub depth: usize,
}

/// Chunks are cut on multiples of this many elements (the AdamW crate's
/// rayon chunk, and a whole number of pages).
pub const CHUNK_ALIGN: usize = 32 * 1024;

impl Default for WindowConfig {
    /// 8 Mi elements (32 MiB per block, 96 MiB per chunk set) × 4 chunk
    /// sets: 384 MiB of window.
    fn default() -> Self {
        WindowConfig {
            chunk_elems: 8 << 20,
            depth: 4,
        }
    }
}

impl WindowConfig {
    /// A window of about `bytes` of RAM in `depth` chunk sets.
    pub fn from_bytes(bytes: u64, depth: usize) -> Self {
        let depth = depth.max(2);
        let elems = (bytes / (12 * depth as u64)) as usize;
        WindowConfig {
            chunk_elems: elems,
            depth,
        }
        .normalized()
    }

    fn normalized(self) -> Self {
        WindowConfig {
            chunk_elems: (self.chunk_elems / CHUNK_ALIGN).max(1) * CHUNK_ALIGN,
            depth: self.depth.max(1),
        }
    }

    /// RAM the window's buffers take.
    pub fn bytes(&self) -> u64 {
        let c = self.normalized();
        12 * c.chunk_elems as u64 * c.depth as u64
    }
}

/// One chunk of a spilled layer in RAM: elements `range` of its p, m, v.
#[derive(Debug)]
pub struct Chunk {
    layer: usize,
    range: Range<usize>,
    bufs: ChunkBufs,
}

#[derive(Debug)]
struct ChunkBufs {
    p: AlignedBuf<f32>,
    m: AlignedBuf<f32>,
    v: AlignedBuf<f32>,
}

impl Chunk {
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// Elements of the layer this chunk holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// `(p, m, v)` of the chunk's elements.
    pub fn parts_mut(&mut self) -> (&mut [f32], &mut [f32], &mut [f32]) {
        let n = self.range.len();
        (
            &mut self.bufs.p[..n],
            &mut self.bufs.m[..n],
            &mut self.bufs.v[..n],
        )
    }
}

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
    /// last writes at [`SpillWindow::finish`].
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
struct DiskClock {
    in_flight: u32,
    since: Instant,
    busy: Duration,
    bytes_read: u64,
    bytes_written: u64,
    read: Duration,
    write: Duration,
}

impl DiskClock {
    fn new() -> Self {
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

type Clock = Arc<Mutex<DiskClock>>;

/// Runs `f` as disk time, counting `bytes` as read (`write == false`) or
/// written.
fn timed<T>(clock: &Clock, write: bool, bytes: u64, f: impl FnOnce() -> Result<T>) -> Result<T> {
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

/// Bytes the I/O of `n` elements covers: whole pages (the file is padded).
fn io_bytes(n: usize) -> usize {
    (n * 4).div_ceil(PAGE) * PAGE
}

fn as_bytes_mut(b: &mut AlignedBuf<f32>, n: usize) -> &mut [u8] {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(b.as_mut_slice());
    let len = io_bytes(n).min(bytes.len());
    &mut bytes[..len]
}

/// The consumer's side, behind a lock so that `&SpillWindow` can be shared
/// with the optimizer thread.
struct Consumer {
    ready: Receiver<Result<Chunk>>,
    done: Option<Sender<Chunk>>,
    wait: Duration,
    failed: bool,
}

/// Read-ahead and write-behind for the spilled layers of one step (see the
/// module docs). Dropping it without [`SpillWindow::finish`] stops its
/// threads (writes queued so far are still carried out).
pub struct SpillWindow {
    consumer: Mutex<Consumer>,
    reader: Option<JoinHandle<()>>,
    writer: Option<JoinHandle<Result<()>>>,
    clock: Clock,
    config: WindowConfig,
}

impl std::fmt::Debug for SpillWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpillWindow")
            .field("config", &self.config)
            .finish()
    }
}

impl SpillWindow {
    /// Starts reading `layers` in the given order (the order the consumer
    /// will ask for them). Buffers are allocated here, once per window.
    pub fn start(layers: Vec<SpilledLayer>, config: WindowConfig) -> Result<Self> {
        let config = config.normalized();
        let max = layers.iter().map(|l| l.numel).max().unwrap_or(0);
        let chunk = config
            .chunk_elems
            .min(max.div_ceil(CHUNK_ALIGN).max(1) * CHUNK_ALIGN);
        let sets = layers
            .iter()
            .map(|l| l.numel.div_ceil(chunk))
            .sum::<usize>()
            .min(config.depth);
        let (free_tx, free_rx) = channel::<ChunkBufs>();
        for _ in 0..sets {
            free_tx
                .send(ChunkBufs {
                    p: AlignedBuf::zeroed(chunk)?,
                    m: AlignedBuf::zeroed(chunk)?,
                    v: AlignedBuf::zeroed(chunk)?,
                })
                .expect("receiver alive");
        }
        let (ready_tx, ready_rx) = channel::<Result<Chunk>>();
        let (done_tx, done_rx) = channel::<Chunk>();
        let clock: Clock = Arc::new(Mutex::new(DiskClock::new()));
        let regions: Vec<SpilledLayer> = layers.clone();

        let rclock = clock.clone();
        let reader = std::thread::Builder::new()
            .name("spill-read".into())
            .spawn(move || {
                let run = || -> Result<()> {
                    for l in &layers {
                        for r in l.regions() {
                            r.check_len()?;
                        }
                        let mut start = 0;
                        while start < l.numel {
                            let end = (start + chunk).min(l.numel);
                            let Ok(mut bufs) = free_rx.recv() else {
                                return Ok(()); // the window is shutting down
                            };
                            let n = end - start;
                            let off = io_bytes(start) as u64;
                            for (r, b) in l
                                .regions()
                                .into_iter()
                                .zip([&mut bufs.p, &mut bufs.m, &mut bufs.v])
                            {
                                let dst = as_bytes_mut(b, n);
                                timed(&rclock, false, dst.len() as u64, || r.read_at(dst, off))?;
                            }
                            let c = Chunk {
                                layer: l.layer,
                                range: start..end,
                                bufs,
                            };
                            if ready_tx.send(Ok(c)).is_err() {
                                return Ok(());
                            }
                            start = end;
                        }
                    }
                    Ok(())
                };
                if let Err(e) = run() {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| TierError::Spill(format!("cannot start the reader thread: {e}")))?;

        let wclock = clock.clone();
        let writer = std::thread::Builder::new()
            .name("spill-write".into())
            .spawn(move || -> Result<()> {
                let mut first_err = None;
                for mut c in done_rx {
                    if first_err.is_none() {
                        let l = regions
                            .iter()
                            .find(|l| l.layer == c.layer)
                            .expect("chunks come from these layers");
                        let n = c.range.len();
                        let off = io_bytes(c.range.start) as u64;
                        let bufs = &mut c.bufs;
                        for (r, b) in l
                            .regions()
                            .into_iter()
                            .zip([&mut bufs.p, &mut bufs.m, &mut bufs.v])
                        {
                            let src = as_bytes_mut(b, n);
                            let res = timed(&wclock, true, src.len() as u64, || r.write_at(src, off));
                            if let Err(e) = res {
                                first_err = Some(e);
                                break;
                            }
                        }
                    }
                    // After an error the reader gets its buffers back all
                    // the same, so it never waits for ever.
                    let _ = free_tx.send(c.bufs);
                }
                match first_err {
                    Some(e) => Err(e),
                    None => Ok(()),
                }
            })
            .map_err(|e| TierError::Spill(format!("cannot start the writer thread: {e}")))?;

        Ok(SpillWindow {
            consumer: Mutex::new(Consumer {
                ready: ready_rx,
                done: Some(done_tx),
                wait: Duration::ZERO,
                failed: false,
            }),
            reader: Some(reader),
            writer: Some(writer),
            clock,
            config,
        })
    }

    pub fn config(&self) -> WindowConfig {
        self.config
    }

    /// The next chunk, which must belong to `layer`; blocks until it is read.
    pub fn next(&self, layer: usize) -> Result<Chunk> {
        let mut c = self.consumer.lock().expect("spill window poisoned");
        let t = Instant::now();
        let got = c.ready.recv();
        c.wait += t.elapsed();
        let chunk = match got {
            Ok(Ok(chunk)) => chunk,
            Ok(Err(e)) => {
                c.failed = true;
                return Err(e);
            }
            Err(_) => {
                c.failed = true;
                return Err(TierError::Spill(format!(
                    "asked for layer {layer} but the reader has no more chunks"
                )));
            }
        };
        if chunk.layer != layer {
            c.failed = true;
            return Err(TierError::Spill(format!(
                "asked for layer {layer} but the read-ahead order has layer {} next",
                chunk.layer
            )));
        }
        Ok(chunk)
    }

    /// Hands an updated chunk to the writer.
    pub fn give_back(&self, chunk: Chunk) -> Result<()> {
        let c = self.consumer.lock().expect("spill window poisoned");
        c.done
            .as_ref()
            .and_then(|d| d.send(chunk).ok())
            .ok_or_else(|| TierError::Spill("the writer thread stopped".into()))
    }

    fn shutdown(&mut self) -> (Result<()>, Duration) {
        let t = Instant::now();
        let (wait, failed) = {
            let mut c = self.consumer.lock().expect("spill window poisoned");
            c.done.take();
            (c.wait, c.failed)
        };
        let written = match self.writer.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(TierError::Spill("the writer thread panicked".into())),
            None => Ok(()),
        };
        // The reader is either done, or waits for buffers that no one will
        // return now that the writer has gone: it stops.
        let read = match self.reader.take().map(JoinHandle::join) {
            Some(Err(_)) => Err(TierError::Spill("the reader thread panicked".into())),
            _ => Ok(()),
        };
        // A read error not yet seen by the consumer.
        let pending = if failed {
            Ok(())
        } else {
            let c = self.consumer.lock().expect("spill window poisoned");
            match c.ready.try_recv() {
                Ok(Err(e)) => Err(e),
                Ok(Ok(chunk)) => Err(TierError::Spill(format!(
                    "layer {} was read ahead but never updated",
                    chunk.layer
                ))),
                Err(_) => Ok(()),
            }
        };
        (written.and(read).and(pending), wait + t.elapsed())
    }

    /// Waits for the last writes and reports what moved. The first I/O
    /// error of either thread is returned (a full disk as
    /// [`TierError::DiskFull`]).
    pub fn finish(mut self) -> Result<SpillStats> {
        let (res, wait) = self.shutdown();
        res?;
        let c = self.clock.lock().expect("disk clock poisoned");
        Ok(SpillStats {
            bytes_read: c.bytes_read,
            bytes_written: c.bytes_written,
            disk_busy_ms: c.busy.as_secs_f64() * 1e3,
            read_ms: c.read.as_secs_f64() * 1e3,
            write_ms: c.write.as_secs_f64() * 1e3,
            wait_ms: wait.as_secs_f64() * 1e3,
        })
    }
}

impl Drop for SpillWindow {
    fn drop(&mut self) {
        if self.writer.is_some() || self.reader.is_some() {
            let _ = self.shutdown();
        }
    }
}

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
    let (file, direct) = open_spill_file(&path, bytes)?;
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
        region.file.sync_all().at(&path)?;
        let write_s = t.elapsed().as_secs_f64();
        #[cfg(target_os = "linux")]
        if !direct {
            use std::os::fd::AsRawFd;
            // SAFETY: a valid descriptor; advice only.
            unsafe { libc::posix_fadvise(region.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A spilled "layer" of `n` elements with p = i, m = 2i, v = 3i.
    fn layer(dir: &Path, index: usize, n: usize) -> (SpilledLayer, [AlignedBuf<f32>; 3]) {
        let mut bufs =
            [0, 1, 2].map(|k| AlignedBuf::<f32>::zeroed_on_disk(n, dir, &format!("t{index}-{k}")).unwrap());
        for (k, b) in bufs.iter_mut().enumerate() {
            for (i, x) in b.iter_mut().enumerate() {
                *x = ((k + 1) * i) as f32 + index as f32 * 1e6;
            }
            b.flush().unwrap();
        }
        let r = |k: usize| bufs[k].spill_region().unwrap().clone();
        let l = SpilledLayer {
            layer: index,
            numel: n,
            p: r(0),
            m: r(1),
            v: r(2),
        };
        (l, bufs)
    }

    #[test]
    fn chunks_come_in_order_and_updates_reach_the_files() {
        let dir = tempfile::tempdir().unwrap();
        // Uneven sizes: several chunks, a short last chunk, a 1-element layer.
        let sizes = [(5, 3 * CHUNK_ALIGN + 17), (3, 1), (1, CHUNK_ALIGN)];
        let mut held = Vec::new();
        let mut layers = Vec::new();
        for &(i, n) in &sizes {
            let (l, b) = layer(dir.path(), i, n);
            layers.push(l);
            held.push(b);
        }
        let config = WindowConfig {
            chunk_elems: CHUNK_ALIGN,
            depth: 3,
        };
        assert_eq!(config.bytes(), 12 * CHUNK_ALIGN as u64 * 3);
        let w = SpillWindow::start(layers, config).unwrap();
        let mut expect_bytes = 0;
        for &(i, n) in &sizes {
            let mut done = 0;
            while done < n {
                let mut c = w.next(i).unwrap();
                assert_eq!(c.layer(), i);
                assert_eq!(c.range().start, done);
                let r = c.range();
                let (p, m, v) = c.parts_mut();
                for (j, e) in r.clone().enumerate() {
                    let base = i as f32 * 1e6;
                    assert_eq!(p[j], e as f32 + base);
                    assert_eq!(m[j], (2 * e) as f32 + base);
                    assert_eq!(v[j], (3 * e) as f32 + base);
                    p[j] = -p[j];
                    m[j] += 1.0;
                    v[j] = 0.5;
                }
                expect_bytes += 3 * io_bytes(r.len()) as u64;
                done = r.end;
                w.give_back(c).unwrap();
            }
        }
        let s = w.finish().unwrap();
        assert_eq!((s.bytes_read, s.bytes_written), (expect_bytes, expect_bytes));
        assert!(s.disk_busy_ms > 0.0 && s.gb_per_s() > 0.0);
        assert!(s.disk_busy_ms <= s.read_ms + s.write_ms + 1e-6);
        // The maps see what was written through the files.
        for (&(i, _), b) in sizes.iter().zip(&held) {
            let base = i as f32 * 1e6;
            for (e, ((p, m), v)) in b[0].iter().zip(b[1].iter()).zip(b[2].iter()).enumerate() {
                assert_eq!(*p, -(e as f32 + base));
                assert_eq!(*m, (2 * e) as f32 + base + 1.0);
                assert_eq!(*v, 0.5);
            }
        }
    }

    #[test]
    fn a_consumer_out_of_order_is_an_error_and_drop_stops_the_threads() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _ha) = layer(dir.path(), 2, 100);
        let (b, _hb) = layer(dir.path(), 1, 100);
        let w = SpillWindow::start(vec![a.clone(), b.clone()], WindowConfig::default()).unwrap();
        let err = w.next(1).unwrap_err().to_string();
        assert!(
            err.contains("asked for layer 1") && err.contains("layer 2 next"),
            "{err}"
        );
        drop(w);
        // A chunk read ahead but never updated is reported by finish.
        let w = SpillWindow::start(vec![a, b], WindowConfig::default()).unwrap();
        let c = w.next(2).unwrap();
        w.give_back(c).unwrap();
        let err = w.finish().unwrap_err().to_string();
        assert!(err.contains("layer 1 was read ahead but never updated"), "{err}");
    }

    #[test]
    fn a_truncated_file_and_a_failing_write_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let (l, _h) = layer(dir.path(), 0, 5000);
        l.m.file.set_len(4096).unwrap();
        let w = SpillWindow::start(vec![l.clone()], WindowConfig::default()).unwrap();
        let err = w.next(0).unwrap_err();
        assert!(matches!(err, TierError::SpillLength { got: 4096, .. }), "{err}");
        l.m.file.set_len(l.m.bytes).unwrap();

        // Writes to a descriptor opened read-only fail; the error comes out
        // of finish (the writer never panics or blocks the reader).
        let ro_path = dir.path().join("ro.bin");
        std::fs::write(&ro_path, vec![0u8; l.v.bytes as usize]).unwrap();
        let ro = File::open(&ro_path).unwrap();
        let bad = SpilledLayer {
            v: SpillRegion::new(Arc::new(ro), ro_path.clone(), l.v.bytes, false),
            ..l
        };
        let w = SpillWindow::start(vec![bad], WindowConfig::default()).unwrap();
        let c = w.next(0).unwrap();
        w.give_back(c).unwrap();
        let err = w.finish().unwrap_err().to_string();
        assert!(err.contains("ro.bin"), "{err}");
    }

    #[test]
    fn full_disk_errors_are_named_as_such() {
        for code in [libc::ENOSPC, libc::EFBIG, libc::EDQUOT] {
            let e = TierError::io("/x/spill", std::io::Error::from_raw_os_error(code));
            assert!(e.is_disk_full(), "{code}");
            assert!(e.to_string().contains("the disk is full"), "{e}");
            assert!(e.to_string().starts_with("/x/spill: "), "{e}");
        }
        let e = TierError::io("/x", std::io::Error::from_raw_os_error(libc::EACCES));
        assert!(!e.is_disk_full());
    }

    #[test]
    fn disk_probe_measures_both_directions_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let bw = measure_disk_bandwidth(dir.path(), 1).unwrap();
        assert_eq!(bw.bytes, 32 << 20);
        assert!(bw.read_gb_s > 0.0 && bw.write_gb_s > 0.0);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn window_sizes_round_to_the_chunk_alignment() {
        let c = WindowConfig::from_bytes(1 << 30, 4);
        assert_eq!(c.chunk_elems % CHUNK_ALIGN, 0);
        assert!(c.bytes() <= 1 << 30 && c.bytes() > (1 << 30) - 12 * 4 * CHUNK_ALIGN as u64);
        assert_eq!(WindowConfig::from_bytes(1, 1).chunk_elems, CHUNK_ALIGN);
    }
}
