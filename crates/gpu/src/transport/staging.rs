//! Transport 1: a ring of staging buffers the CPU writes through a mapping,
//! then a buffer copy into the weight slot. The copy is queue-ordered after
//! every op that read the slot's previous weights, so the CPU never waits
//! for the slot itself — only for a ring entry whose copy is still running.
//!
//! A layer larger than one entry goes through the ring in entry-sized
//! pieces, each submitted as soon as it is written: the copy engine moves
//! piece i while the CPU writes piece i + 1, and the ring's host memory is
//! `depth × chunk` whatever the layer size. Entries keep their buffers;
//! the only mapping per use is the remap after its copy (wgpu cannot copy
//! out of a mapped buffer).

use megatrain_tensor::{Result, TransportStats};

use super::{Copying, Image, Link, MapState, SlotBuffer, Transport, nanos};
use crate::GpuError;

/// Entries in the ring unless configured: one being written while three
/// copies may be queued.
pub(crate) const DEFAULT_DEPTH: usize = 4;
/// Largest piece one entry carries unless configured.
pub(crate) const DEFAULT_CHUNK: u64 = 32 << 20;

struct Entry {
    buf: wgpu::Buffer,
    map: MapState,
    /// The submission that copies out of it (its remap waits for that).
    copy: Option<Copying>,
}

pub(crate) struct StagingTransport {
    ring: Vec<Option<Entry>>,
    next: usize,
    chunk: u64,
}

impl Default for StagingTransport {
    fn default() -> Self {
        Self::new(DEFAULT_DEPTH, DEFAULT_CHUNK)
    }
}

impl StagingTransport {
    /// A ring of `depth` entries of at most `chunk` bytes (rounded up to a
    /// multiple of 256 so pieces keep copy alignment and widened tensors
    /// are never cut inside an element).
    pub fn new(depth: usize, chunk: u64) -> Self {
        let mut ring = Vec::new();
        ring.resize_with(depth.max(1), || None);
        StagingTransport {
            ring,
            next: 0,
            chunk: chunk.max(256).div_ceil(256) * 256,
        }
    }

    /// Lets the ring's buffers go (remade on the next write): after the
    /// transport's calibration, where the step's uploads take another way
    /// (mapped, or the device's copies from the tier), they would hold
    /// host-visible memory for nothing. A copy still queued from one keeps
    /// it alive until done (wgpu defers the destruction).
    pub fn release(&mut self) {
        self.ring.iter_mut().for_each(|e| *e = None);
        self.next = 0;
    }

    /// Host-visible bytes held by the ring.
    pub fn ring_bytes(&self) -> u64 {
        self.ring.iter().flatten().map(|e| e.buf.size()).sum()
    }

    /// The next entry, holding at least `bytes`, mapped and free.
    fn entry(&mut self, link: &Link<'_>, bytes: u64, stats: &mut TransportStats) -> Result<&mut Entry> {
        let i = self.next;
        self.next = (i + 1) % self.ring.len();
        let entry = &mut self.ring[i];
        if entry.as_ref().is_none_or(|e| e.buf.size() < bytes) {
            stats.buffers_created += 1;
            let buf = link.create_buffer(
                "upload staging buffer",
                &wgpu::BufferDescriptor {
                    label: Some("upload staging"),
                    size: crate::arena::size_class(bytes),
                    usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: true,
                },
            )?;
            *entry = Some(Entry {
                buf,
                map: MapState::mapped(),
                copy: None,
            });
        }
        let e = entry.as_mut().expect("entry just ensured");
        match &e.copy {
            Some(c) => link.wait_copy(
                c,
                &e.map,
                &mut stats.up_wait_compute_ns,
                &mut stats.up_wait_copy_ns,
            )?,
            None => link.wait_map(&e.map)?,
        }
        Ok(e)
    }
}

impl Transport for StagingTransport {
    fn slot_usage(&self) -> wgpu::BufferUsages {
        crate::arena::USAGE
    }

    fn slot_mapped_at_creation(&self) -> bool {
        false
    }

    fn write(
        &mut self,
        link: &Link<'_>,
        slot: &mut SlotBuffer,
        image: &Image<'_>,
        pool: &rayon::ThreadPool,
        stats: &mut TransportStats,
    ) -> Result<()> {
        let bytes = image.bytes();
        let chunk = self.chunk;
        let mut at = 0;
        while at < bytes {
            let n = chunk.min(bytes - at);
            let e = self.entry(link, n, stats)?;
            let t = std::time::Instant::now();
            {
                let mut view = e
                    .buf
                    .get_mapped_range_mut(0..n)
                    .map_err(|err| GpuError::Map(err.to_string()))?;
                image.write_par(pool, at, view.slice(..));
            }
            let t2 = std::time::Instant::now();
            stats.up_fill_ns += nanos(t2 - t);
            e.buf.unmap();
            let mut enc = link.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&e.buf, 0, slot.buf.buffer(), at, n);
            e.copy = Some(link.submit_copy(enc, &[slot.buf.buffer()]));
            let size = e.buf.size();
            e.map.map(&e.buf, wgpu::MapMode::Write, size);
            stats.up_submit_ns += nanos(t2.elapsed());
            at += n;
        }
        stats.uploads += 1;
        stats.bytes_up += bytes;
        Ok(())
    }

    fn readback_usage(&self) -> wgpu::BufferUsages {
        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST
    }
}
