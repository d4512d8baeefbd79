//! Gradient downloads that overlap compute: the layer's gradient tensors are
//! copied into one readback buffer and its mapping is requested at once;
//! the host collects the bytes later, after the device has moved on to the
//! next layer.

use std::collections::HashMap;

use megatrain_tensor::{DType, Error, Result};

use super::{Link, MapState};
use crate::GpuError;
use crate::tensor::GpuTensor;

/// Readback buffers not in use, by (usage, size class).
#[derive(Default)]
pub(crate) struct ReadbackPool {
    free: HashMap<(u32, u64), Vec<wgpu::Buffer>>,
}

/// One download in flight.
pub(crate) struct PendingRead {
    buf: wgpu::Buffer,
    map: MapState,
    copy: wgpu::SubmissionIndex,
    /// (dtype, elements, byte offset) of each tensor, in order.
    layout: Vec<(DType, usize, u64)>,
    bytes: u64,
    pub numel: usize,
}

impl ReadbackPool {
    /// Host-visible bytes parked in the pool.
    pub fn pooled_bytes(&self) -> u64 {
        self.free.values().flatten().map(|b| b.size()).sum()
    }

    /// Copies `tensors` into a readback buffer of `usage` and starts mapping it.
    pub fn begin(
        &mut self,
        link: &Link<'_>,
        usage: wgpu::BufferUsages,
        tensors: &[GpuTensor],
    ) -> PendingRead {
        let mut layout = Vec::with_capacity(tensors.len());
        let mut bytes = 0u64;
        for t in tensors {
            layout.push((t.dtype, t.numel(), bytes));
            bytes += t.byte_len();
        }
        let class = crate::arena::size_class(bytes.max(4));
        let buf = self
            .free
            .get_mut(&(usage.bits(), class))
            .and_then(Vec::pop)
            .unwrap_or_else(|| {
                link.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("gradient readback"),
                    size: class,
                    usage,
                    mapped_at_creation: false,
                })
            });
        let mut enc = link.device.create_command_encoder(&Default::default());
        for (t, &(_, _, at)) in tensors.iter().zip(&layout) {
            if t.byte_len() > 0 {
                enc.copy_buffer_to_buffer(t.buffer(), t.offset, &buf, at, t.byte_len());
            }
        }
        let copy = link.submit(enc);
        let map = MapState::default();
        map.map(&buf, wgpu::MapMode::Read, bytes.max(4));
        PendingRead {
            buf,
            map,
            copy,
            numel: layout.iter().map(|l| l.1).sum(),
            layout,
            bytes,
        }
    }

    /// Waits for `p`, widens its tensors to f32 into `out` and recycles the
    /// buffer (also when `out` has the wrong length, which is an error).
    pub fn finish(&mut self, link: &Link<'_>, p: PendingRead, out: &mut [f32]) -> Result<()> {
        link.wait_for(&p.copy)?;
        link.wait_map(&p.map)?;
        let result = if out.len() != p.numel {
            Err(Error::shape(
                "finish_download",
                format!("{} elements into a destination of {}", p.numel, out.len()),
            ))
        } else {
            Self::decode(&p, out)
        };
        p.buf.unmap();
        let key = (p.buf.usage().bits(), p.buf.size());
        self.free.entry(key).or_default().push(p.buf);
        result
    }

    fn decode(p: &PendingRead, out: &mut [f32]) -> Result<()> {
        let view = p
            .buf
            .get_mapped_range(0..p.bytes.max(4))
            .map_err(|e| GpuError::Map(e.to_string()))?;
        let mut at = 0;
        for &(dtype, n, off) in &p.layout {
            let dst = &mut out[at..at + n];
            let src = &view[off as usize..];
            match dtype {
                DType::F32 => {
                    let src = &src[..4 * n];
                    match bytemuck::try_cast_slice::<u8, f32>(src) {
                        Ok(v) => dst.copy_from_slice(v),
                        Err(_) => {
                            for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                            }
                        }
                    }
                }
                _ => {
                    for (o, c) in dst.iter_mut().zip(src[..2 * n].chunks_exact(2)) {
                        *o = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                    }
                }
            }
            at += n;
        }
        Ok(())
    }
}
