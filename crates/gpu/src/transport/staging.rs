//! Transport 1: a ring of staging buffers the CPU writes through a mapping,
//! then a buffer copy into the weight slot. The copy is queue-ordered after
//! every op that read the slot's previous weights, so the CPU never waits
//! for the slot itself — only for a ring entry whose copy is still running.

use megatrain_tensor::Result;

use super::{Link, MapState, SlotBuffer, Transport};
use crate::GpuError;

/// Entries in the ring: one being written while two copies may be queued.
const RING: usize = 3;

struct Entry {
    buf: wgpu::Buffer,
    map: MapState,
    /// The submission that copies out of it (its remap waits for that).
    copy: Option<wgpu::SubmissionIndex>,
}

#[derive(Default)]
pub(crate) struct StagingTransport {
    ring: Vec<Option<Entry>>,
    next: usize,
}

impl StagingTransport {
    /// Host-visible bytes held by the ring.
    pub fn ring_bytes(&self) -> u64 {
        self.ring.iter().flatten().map(|e| e.buf.size()).sum()
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
        bytes: u64,
        fill: &mut dyn FnMut(wgpu::WriteOnly<'_, [u8]>),
    ) -> Result<()> {
        if self.ring.is_empty() {
            self.ring.resize_with(RING, || None);
        }
        let i = self.next;
        self.next = (i + 1) % RING;
        let entry = &mut self.ring[i];
        if entry.as_ref().is_none_or(|e| e.buf.size() < bytes) {
            *entry = Some(Entry {
                buf: link.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("upload staging"),
                    size: crate::arena::size_class(bytes),
                    usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: true,
                }),
                map: MapState::mapped(),
                copy: None,
            });
        }
        let e = entry.as_mut().expect("entry just ensured");
        if e.map.get() == MapState::PENDING
            && let Some(idx) = &e.copy
        {
            link.wait_for(idx)?;
        }
        link.wait_map(&e.map)?;
        {
            let mut view = e
                .buf
                .get_mapped_range_mut(0..bytes)
                .map_err(|err| GpuError::Map(err.to_string()))?;
            fill(view.slice(..));
        }
        e.buf.unmap();
        let mut enc = link.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&e.buf, 0, slot.buf.buffer(), 0, bytes);
        e.copy = Some(link.submit(enc));
        let size = e.buf.size();
        e.map.map(&e.buf, wgpu::MapMode::Write, size);
        Ok(())
    }

    fn readback_usage(&self) -> wgpu::BufferUsages {
        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST
    }
}
