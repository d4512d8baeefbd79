//! Downloads on the copy queue (`crate::copy_queue`), so that a layer's
//! gradients cross the bus while the next layer's backward runs.
//!
//! The gradients lie in wgpu's buffers, which only wgpu's queue family may
//! read without an ownership transfer. So wgpu's queue first copies them
//! into a staging buffer both families share (device to device, at the
//! memory's speed, inside the step's own submission order), and the copy
//! queue then moves the staging buffer into host memory of the pool's own
//! (imported, `host_import::HostBuffer`), where the optimizer reads it once
//! the copy's value is reached. A download takes a staging buffer the copy
//! queue is done reading, or a new one (up to a few per size class); past
//! that, reusing one waits on the device for the copy queue's read of it,
//! which the copy queue's bookkeeping does by itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use megatrain_tensor::{Landed, LandedF32, Result, TransportStats};

use super::{Link, nanos};
use crate::arena::{Arena, PooledBuffer};
use crate::copy_queue::CopyQueue;
use crate::host_import::HostBuffer;
use crate::{GpuContext, GpuError};

/// Fewest staging buffers per size class: downloads in flight at once
/// before one waits for the copy queue to finish reading an earlier one.
const RING: usize = 4;

/// Staging buffers of a size class where `count` downloads of it are
/// reserved: as many (the trainer reserves one layer's chunks in flight
/// and the few the optimizer holds, `gradient_chunks_held`). Fewer than a
/// layer's chunks in flight would have wgpu's queue, and the next layer's
/// backward queued behind the copies, wait for the copy queue.
fn ring_len(count: usize) -> usize {
    count.max(1)
}

/// Device bytes of the staging ring that downloads of up to `bytes` each,
/// `count` reserved (`Executor::reserve_downloads`), take on a device with
/// a copy queue: what `megatrain plan` counts beside the executor's tensors.
pub fn staging_bytes(bytes: u64, count: usize) -> u64 {
    ring_len(count) as u64 * crate::arena::size_class(bytes.max(4))
}

pub(crate) struct SideReadback {
    ctx: Arc<GpuContext>,
    queue: Arc<CopyQueue>,
    /// Counts the staging ring as the executor's device memory.
    arena: Arc<Arena>,
    /// Host buffers not in use, by size (their class rounded up to whole
    /// import units, `HostBuffer::size_for`).
    free: HashMap<u64, Vec<HostBuffer>>,
    lent: Arc<Mutex<Lent>>,
    staging: HashMap<u64, Ring>,
    /// Whole layers' gradients, by size class (`DownloadStaging::Layer`).
    layers: HashMap<u64, Ring>,
}

struct Ring {
    bufs: Vec<Arc<PooledBuffer>>,
    next: usize,
    /// Most buffers ([`ring_len`] of the last reservation).
    len: usize,
}

impl Default for Ring {
    fn default() -> Self {
        Ring {
            bufs: Vec::new(),
            next: 0,
            len: RING,
        }
    }
}

#[derive(Default)]
struct Lent {
    bytes: u64,
    back: Vec<HostBuffer>,
}

/// A download on its way into host memory: done once the copy queue
/// reaches `value`.
pub(crate) struct Landing {
    host: HostBuffer,
    value: u64,
}

impl Landing {
    /// The bytes, once [`SideReadback::wait`] returned.
    pub fn bytes(&self) -> &[u8] {
        self.host.bytes()
    }
}

/// A download's f32 values read where they landed; the host buffer goes
/// back to the pool when dropped.
struct InHost {
    host: Option<HostBuffer>,
    len: usize,
    home: Arc<Mutex<Lent>>,
}

impl LandedF32 for InHost {
    fn as_f32(&self) -> &[f32] {
        let host = self.host.as_ref().expect("held until dropped");
        bytemuck::cast_slice(&host.bytes()[..4 * self.len])
    }
}

impl Drop for InHost {
    fn drop(&mut self) {
        let host = self.host.take().expect("held until dropped");
        // A poisoned pool (a panic elsewhere) just frees the buffer.
        if let Ok(mut lent) = self.home.lock() {
            lent.bytes -= host.size();
            lent.back.push(host);
        }
    }
}

impl SideReadback {
    /// The pool of a device with a copy queue, if the device imports host
    /// memory to copy into (tried once here: where it does not, downloads
    /// stay on wgpu's queue).
    pub fn new(ctx: &Arc<GpuContext>, arena: &Arc<Arena>) -> Option<Self> {
        ctx.copy_queue.as_ref()?;
        let probe = HostBuffer::new(ctx, 4096)?;
        let mut free = HashMap::new();
        free.insert(probe.size(), vec![probe]);
        Some(SideReadback {
            queue: ctx.copy_queue.clone()?,
            ctx: ctx.clone(),
            arena: arena.clone(),
            free,
            lent: Default::default(),
            staging: HashMap::new(),
            layers: HashMap::new(),
        })
    }

    /// Host bytes the pool owns: free, lent out, or given back.
    pub fn host_bytes(&self) -> u64 {
        let lent = self.lent.lock().expect("download pool poisoned");
        let parked: u64 = self
            .free
            .values()
            .flatten()
            .chain(&lent.back)
            .map(HostBuffer::size)
            .sum();
        parked + lent.bytes
    }

    /// Makes `count` host buffers of `class` bytes and the staging ring.
    pub fn reserve(&mut self, class: u64, count: usize, stats: &mut TransportStats) -> Result<()> {
        self.take_back();
        let key = self.key(class);
        let have = self.free.get(&key).map_or(0, Vec::len);
        for _ in have..count {
            let h = self.make_host(class, stats)?;
            self.free.entry(key).or_default().push(h);
        }
        // The whole ring: downloads begun back to back each take one.
        let ring = self.staging.entry(class).or_default();
        ring.len = ring.len.max(ring_len(count));
        for _ in ring.bufs.len()..ring_len(count) {
            stats.buffers_created += 1;
            let b = self.make_staging(class)?;
            self.staging.entry(class).or_default().bufs.push(b);
        }
        Ok(())
    }

    fn take_back(&mut self) {
        let back = std::mem::take(&mut self.lent.lock().expect("download pool poisoned").back);
        for h in back {
            self.free.entry(h.size()).or_default().push(h);
        }
    }

    fn make_host(&self, class: u64, stats: &mut TransportStats) -> Result<HostBuffer> {
        stats.buffers_created += 1;
        Ok(
            HostBuffer::new(&self.ctx, class).ok_or_else(|| GpuError::Unsupported {
                op: "download",
                detail: format!("the device cannot import {class} bytes of host memory for a download"),
            })?,
        )
    }

    fn key(&self, class: u64) -> u64 {
        HostBuffer::size_for(&self.ctx, class).unwrap_or(class)
    }

    fn take_host(&mut self, class: u64, stats: &mut TransportStats) -> Result<HostBuffer> {
        self.take_back();
        let key = self.key(class);
        match self.free.get_mut(&key).and_then(Vec::pop) {
            Some(h) => Ok(h),
            None => self.make_host(class, stats),
        }
    }

    /// A staging buffer of `class` bytes: one the copy queue is done
    /// reading, else a new one while there are fewer than the ring's
    /// length ([`ring_len`]), else
    /// the next in turn (whose reuse then waits on the device).
    fn next_staging(&mut self, class: u64, stats: &mut TransportStats) -> Result<Arc<PooledBuffer>> {
        let ring = self.staging.entry(class).or_default();
        if let Some(b) = ring.bufs.iter().find(|b| self.queue.idle(b.buffer())) {
            return Ok(b.clone());
        }
        if ring.bufs.len() < ring.len {
            stats.buffers_created += 1;
            let b = self.make_staging(class)?;
            self.staging.entry(class).or_default().bufs.push(b.clone());
            return Ok(b);
        }
        let b = ring.bufs[ring.next % ring.bufs.len()].clone();
        ring.next += 1;
        Ok(b)
    }

    fn make_staging(&self, class: u64) -> Result<Arc<PooledBuffer>> {
        let b = self
            .queue
            .create_buffer(&self.ctx.device, class, "download staging (copy queue)")
            .map_err(|e| GpuError::Unsupported {
                op: "download",
                detail: format!("no device memory for a {class}-byte download staging buffer ({e})"),
            })?;
        Ok(Arc::new(self.arena.adopt(b)))
    }

    /// Copies `pieces` (buffer, byte offset, bytes: 4-byte multiples) one
    /// after another into a staging buffer of `class` bytes on wgpu's
    /// queue, then on to host memory on the copy queue.
    pub fn begin(
        &mut self,
        link: &Link<'_>,
        pieces: &[(&wgpu::Buffer, u64, u64)],
        class: u64,
        stats: &mut TransportStats,
    ) -> Result<Landing> {
        let bytes: u64 = pieces.iter().map(|p| p.2).sum();
        let staging = self.next_staging(class, stats)?;
        gather(link, pieces, staging.buffer());
        self.begin_from(&staging, 0, bytes, class, stats)
    }

    /// Copies `pieces` (buffer, byte offset, bytes: 4-byte multiples) one
    /// after another into a device buffer of the copy queue's on wgpu's
    /// queue, as one submission right after the work queued so far: the
    /// chunks [`SideReadback::begin_from`] then takes from it are the copy
    /// queue's alone, and wait for nothing wgpu's queue takes up later
    /// (the next layer's backward). A buffer is taken again only once
    /// nothing holds it but this pool: neither the caller (whose layer's
    /// chunks are not all begun) nor a copy the copy queue has not
    /// finished. So a size class holds two or three: the one the copy
    /// queue reads, the next layer's, and one whose last copies finished
    /// but are not yet reclaimed.
    pub fn snapshot(
        &mut self,
        link: &Link<'_>,
        pieces: &[(&wgpu::Buffer, u64, u64)],
    ) -> Result<Arc<PooledBuffer>> {
        let bytes: u64 = pieces.iter().map(|p| p.2).sum();
        let class = crate::arena::size_class(bytes.max(4));
        let ring = self.layers.entry(class).or_default();
        let buf = match ring.bufs.iter().find(|b| Arc::strong_count(b) == 1) {
            Some(b) => b.clone(),
            None => {
                let b = Arc::new(
                    self.arena.adopt(
                        self.queue
                            .create_buffer(&self.ctx.device, class, "layer gradients (copy queue)")
                            .map_err(|e| GpuError::Unsupported {
                                op: "download",
                                detail: format!(
                                    "no device memory for a {class}-byte copy of a layer's gradients ({e})"
                                ),
                            })?,
                    ),
                );
                ring.bufs.push(b.clone());
                b
            }
        };
        gather(link, pieces, buf.buffer());
        Ok(buf)
    }

    /// Bytes `offset..offset + bytes` of `src` (a staging buffer, or a
    /// [`SideReadback::snapshot`]) into host memory of `class` bytes, on
    /// the copy queue alone.
    pub fn begin_from(
        &mut self,
        src: &Arc<PooledBuffer>,
        offset: u64,
        bytes: u64,
        class: u64,
        stats: &mut TransportStats,
    ) -> Result<Landing> {
        let host = self.take_host(class, stats)?;
        let regions = [(offset, 0, bytes)];
        let regions = if bytes > 0 { &regions[..] } else { &[] };
        let value = self
            .queue
            .copy(src.buffer(), &host.buffer, regions, true, vec![src.clone()])?;
        Ok(Landing { host, value })
    }

    /// Blocks until `l` is in host memory.
    pub fn wait(&self, l: &Landing, stats: &mut TransportStats) -> Result<()> {
        let t = Instant::now();
        self.queue.wait_for(l.value)?;
        stats.down_wait_copy_ns += nanos(t.elapsed());
        Ok(())
    }

    /// `l`'s first `len` f32 values, lent until dropped (after `wait`).
    pub fn lend(&self, l: Landing, len: usize) -> Landed {
        self.lent.lock().expect("download pool poisoned").bytes += l.host.size();
        Landed::new(InHost {
            host: Some(l.host),
            len,
            home: self.lent.clone(),
        })
    }

    /// Takes `l`'s host buffer back (after it was read).
    pub fn recycle(&mut self, l: Landing) {
        self.free.entry(l.host.size()).or_default().push(l.host);
    }
}

/// Copies `pieces` (buffer, byte offset, bytes) one after another into
/// `dst` on wgpu's queue, as one submission after the work queued so far.
fn gather(link: &Link<'_>, pieces: &[(&wgpu::Buffer, u64, u64)], dst: &wgpu::Buffer) {
    let mut enc = link.device.create_command_encoder(&Default::default());
    let mut at = 0;
    for &(src, from, len) in pieces {
        enc.copy_buffer_to_buffer(src, from, dst, at, len);
        at += len;
    }
    let mut uses: Vec<&wgpu::Buffer> = pieces.iter().map(|p| p.0).collect();
    uses.push(dst);
    link.submit(enc, &uses);
}

impl Drop for SideReadback {
    fn drop(&mut self) {
        for ring in self.staging.values().chain(self.layers.values()) {
            for b in &ring.bufs {
                self.queue.forget(b.buffer());
            }
        }
    }
}
