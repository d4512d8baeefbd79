//! [`SpillWindow`]: the reader and writer threads that move spilled layers
//! through a fixed set of RAM chunks for the optimizer (see the module docs
//! of `spill`).

use std::ops::Range;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::clock::{Clock, DiskClock, SpillStats, timed};
use super::file::SpilledLayer;
use crate::buf::{AlignedBuf, PAGE};
use crate::error::{Result, TierError};

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

/// The chunks of elements `range` in order: cut where `range` crosses a
/// multiple of `grid` (the window's configured chunk), so they start where
/// the range does (a rank's shard of a layer) and otherwise on the same
/// boundaries as the trainer's transfer chunks, which are multiples of the
/// grid; each is at most `grid` long.
fn pieces(range: Range<usize>, grid: usize) -> impl Iterator<Item = Range<usize>> {
    let mut start = range.start;
    std::iter::from_fn(move || {
        (start < range.end).then(|| {
            let end = ((start / grid + 1) * grid).min(range.end);
            let r = start..end;
            start = end;
            r
        })
    })
}

/// Bytes the I/O of `n` elements covers: whole pages (the file is padded).
pub(super) fn io_bytes(n: usize) -> usize {
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
        let grid = config.chunk_elems;
        let max = layers.iter().map(|l| l.range.len()).max().unwrap_or(0);
        // Buffers no longer than the longest range needs.
        let chunk = grid.min(max.div_ceil(CHUNK_ALIGN).max(1) * CHUNK_ALIGN);
        for l in &layers {
            l.check_range()?;
        }
        let sets = layers
            .iter()
            .map(|l| pieces(l.range.clone(), grid).count())
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
                        for Range { start, end } in pieces(l.range.clone(), grid) {
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
