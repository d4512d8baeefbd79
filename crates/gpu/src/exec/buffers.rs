//! Device tensors: allocation from the arena, host uploads and downloads,
//! and private copies for in-place ops.

use std::sync::Arc;

use megatrain_tensor::{DType, Error, HostData, HostTensor, Result, Shape};

use super::GpuExecutor;
use crate::GpuError;
use crate::tensor::{GpuTensor, storage_bytes};

impl GpuExecutor {
    /// A queue write into `buf`, ordered after every op recorded before it.
    fn write_buffer(&self, buf: &wgpu::Buffer, offset: u64, data: &[u8]) {
        self.submitter.write_buffer(&self.ctx.queue, buf, offset, data);
    }

    /// An uninitialised tensor (NaN-filled when poisoning is on).
    pub(crate) fn alloc(&self, shape: Shape, dtype: DType) -> Result<GpuTensor> {
        let bytes = storage_bytes(dtype, shape.numel());
        let max = self.ctx.limits.max_buffer_size;
        if bytes > max {
            return Err(GpuError::Unsupported {
                op: "alloc",
                detail: format!("a {dtype} tensor of shape {shape} needs {bytes} bytes; the device's largest buffer is {max}"),
            }
            .into());
        }
        let buf = match self.arena.alloc(bytes) {
            Ok(b) => b,
            Err(_) => {
                // Free buffers of other size classes are device memory
                // the request may fit in once given back.
                let freed = self.memory().pooled_bytes;
                self.trim_pool();
                self.arena
                    .alloc(bytes)
                    .map_err(|class| self.out_of_memory("buffer", class, Some(freed)))?
            }
        };
        if self.poison && bytes > 0 {
            let nan = vec![f32::NAN; (bytes / 4) as usize];
            self.write_buffer(buf.buffer(), 0, bytemuck::cast_slice(&nan));
        }
        Ok(GpuTensor {
            buf: Arc::new(buf),
            offset: 0,
            shape,
            dtype,
            derived: Default::default(),
        })
    }

    /// The error of a `bytes`-byte buffer for `what` the device refused,
    /// after giving `freed` bytes of free buffers back where it did.
    pub(crate) fn out_of_memory(&self, what: &'static str, bytes: u64, freed: Option<u64>) -> GpuError {
        GpuError::OutOfMemory {
            adapter: self.ctx.adapter.get_info().name,
            what,
            bytes,
            live: self.memory().live_bytes,
            of: self
                .ctx
                .device_memory_bytes()
                .map_or(String::new(), |b| format!(", of {b} on the device")),
            after: freed.map_or(String::new(), |f| {
                format!(" (the {f} bytes of free buffers were given back first)")
            }),
        }
    }

    pub(crate) fn alloc_f32(&self, shape: impl Into<Shape>) -> Result<GpuTensor> {
        self.alloc(shape.into(), DType::F32)
    }

    pub(crate) fn zeros_f32(&self, shape: impl Into<Shape>) -> Result<GpuTensor> {
        let t = self.alloc(shape.into(), DType::F32)?;
        let mut op = self.op("zeros");
        op.clear(t.buffer(), t.byte_len());
        op.finish()?;
        Ok(t)
    }

    /// A device buffer for host-side index data (ids, targets, offsets).
    pub(crate) fn upload_words(&self, words: &[u32]) -> Result<GpuTensor> {
        let n = words.len().max(1);
        let t = self.alloc(Shape::new([n]), DType::F32)?;
        if !words.is_empty() {
            self.write_buffer(t.buffer(), 0, bytemuck::cast_slice(words));
        }
        Ok(t)
    }

    pub(crate) fn upload_host(&self, h: &HostTensor) -> Result<GpuTensor> {
        self.upload_bytes(h.shape(), h.dtype(), h.data().as_bytes())
    }

    /// Writes host bytes (in `dtype`'s layout) straight into a new tensor.
    pub(crate) fn upload_bytes(&self, shape: &Shape, dtype: DType, bytes: &[u8]) -> Result<GpuTensor> {
        if bytes.len() != shape.numel() * dtype.size_in_bytes() {
            return Err(Error::shape(
                "upload",
                format!(
                    "shape {shape} of {dtype} needs {} bytes, got {}",
                    shape.numel() * dtype.size_in_bytes(),
                    bytes.len()
                ),
            ));
        }
        let t = self.alloc(shape.clone(), dtype)?;
        if !bytes.is_empty() {
            if bytes.len().is_multiple_of(4) {
                self.write_buffer(t.buffer(), 0, bytes);
            } else {
                let mut padded = bytes.to_vec();
                padded.resize(bytes.len().div_ceil(4) * 4, 0);
                self.write_buffer(t.buffer(), 0, &padded);
            }
        }
        Ok(t)
    }

    /// Copies `bytes` bytes of `buf` from `offset` (MAP_READ or not) back to the host.
    pub(crate) fn read_buffer(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        if !buf.usage().contains(wgpu::BufferUsages::MAP_READ) {
            // Through the pooled readback buffers: the trainer downloads
            // every gradient of every step.
            return self.read_pooled(buf, offset, bytes);
        }
        // A mapping waits for submitted work only: the batch must be on the queue.
        self.flush();
        let (tx, rx) = std::sync::mpsc::channel();
        buf.map_async(wgpu::MapMode::Read, offset..offset + bytes, move |r| {
            let _ = tx.send(r);
        });
        self.submitter.note_wait();
        self.ctx.wait()?;
        rx.recv()
            .map_err(|e| GpuError::Map(e.to_string()))?
            .map_err(|e| GpuError::Map(e.to_string()))?;
        let out = buf
            .get_mapped_range(offset..offset + bytes)
            .map_err(|e| GpuError::Map(e.to_string()))?
            .to_vec();
        buf.unmap();
        Ok(out)
    }

    /// Downloads `t` widened to f32 into `out` without a host tensor between.
    pub(crate) fn download_into_f32(&self, t: &GpuTensor, out: &mut [f32]) -> Result<()> {
        if out.len() != t.numel() {
            return Err(Error::shape(
                "download_into",
                format!(
                    "tensor {} has {} elements, destination {}",
                    t.shape,
                    t.numel(),
                    out.len()
                ),
            ));
        }
        let bytes = self.read_buffer(t.buffer(), t.offset, t.byte_len())?;
        crate::tensor::widen_bytes(t.dtype, &bytes, out);
        Ok(())
    }

    pub(crate) fn download_host(&self, t: &GpuTensor) -> Result<HostTensor> {
        let bytes = self.read_buffer(t.buffer(), t.offset, t.byte_len())?;
        let n = t.numel();
        let data = match t.dtype {
            DType::F32 => HostData::F32(bytemuck::pod_collect_to_vec::<u8, f32>(&bytes)),
            DType::BF16 => {
                let all: Vec<half::bf16> = bytes
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect();
                HostData::BF16(all[..n].to_vec())
            }
            DType::F16 => {
                let all: Vec<half::f16> = bytes
                    .chunks_exact(2)
                    .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect();
                HostData::F16(all[..n].to_vec())
            }
        };
        HostTensor::new(t.shape.clone(), data)
    }

    /// A private copy of `t` when its buffer is shared, so that an in-place op
    /// does not show through other handles. The gate of every in-place op:
    /// it also notes the coming write on the buffer, so that a max
    /// remembered for the old contents is never used again.
    pub(crate) fn make_unique(&self, t: &mut GpuTensor) -> Result<()> {
        if Arc::strong_count(&t.buf) > 1 {
            let fresh = self.alloc(t.shape.clone(), t.dtype)?;
            let mut op = self.op("copy");
            op.copy(t.buffer(), t.offset, fresh.buffer(), 0, t.byte_len());
            op.finish()?;
            *t = fresh;
        }
        t.buf.note_write();
        Ok(())
    }
}
