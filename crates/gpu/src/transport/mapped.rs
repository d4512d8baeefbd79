//! Transport 2: weight slots that are themselves mappable storage buffers
//! (`MAPPABLE_PRIMARY_BUFFERS`). The CPU writes the layer straight into the
//! slot; no copy runs on the queue. Mapping a slot waits until the device has
//! finished every op that read its previous weights, so the trainer keeps
//! more slots than it needs at once (double buffering) and the wait falls on
//! work that finished long ago. On unified memory (integrated GPUs, CPU
//! adapters) this saves the staging copy; on a discrete GPU the slot may sit
//! in host-visible memory that kernels read across the bus — which is why
//! the choice is measured per adapter.

use std::time::Instant;

use megatrain_tensor::{Result, TransportStats};

use super::{Image, Link, SlotBuffer, Transport, nanos};
use crate::GpuError;

#[derive(Default)]
pub(crate) struct MappedTransport;

impl Transport for MappedTransport {
    fn slot_usage(&self) -> wgpu::BufferUsages {
        crate::arena::USAGE | wgpu::BufferUsages::MAP_WRITE
    }

    fn slot_mapped_at_creation(&self) -> bool {
        true
    }

    fn write(
        &mut self,
        link: &Link<'_>,
        slot: &mut SlotBuffer,
        image: &Image<'_>,
        pool: &rayon::ThreadPool,
        stats: &mut TransportStats,
    ) -> Result<()> {
        let buf = slot.buf.buffer();
        let bytes = image.bytes();
        let t = Instant::now();
        if !slot.mapped {
            // Waits for the ops that read the slot's previous weights: compute.
            slot.map.map(buf, wgpu::MapMode::Write, buf.size());
            link.wait_map(&slot.map)?;
        }
        let t2 = Instant::now();
        stats.up_wait_compute_ns += nanos(t2 - t);
        {
            let mut view = buf
                .get_mapped_range_mut(0..bytes)
                .map_err(|err| GpuError::Map(err.to_string()))?;
            image.write_par(pool, 0, view.slice(..));
        }
        let t3 = Instant::now();
        stats.up_fill_ns += nanos(t3 - t2);
        buf.unmap();
        slot.mapped = false;
        stats.up_submit_ns += nanos(t3.elapsed());
        stats.uploads += 1;
        stats.bytes_up += bytes;
        Ok(())
    }

    fn readback_usage(&self) -> wgpu::BufferUsages {
        // Gradient slots: mappable primary buffers, the same kind of memory
        // the weights are written through.
        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::STORAGE
    }
}
