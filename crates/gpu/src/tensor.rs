//! Device tensors: a shape, a storage dtype and a shared pooled buffer.

use std::sync::{Arc, Mutex};

use megatrain_tensor::{DType, Shape, TensorHandle};

use crate::arena::PooledBuffer;

/// A tensor on the device. f32 tensors hold one f32 per element; bf16 and f16
/// tensors hold two elements per u32 word (element 2j in the low half). Clones and
/// reshapes share the buffer; in-place ops copy first when it is shared.
/// `offset` (bytes, a multiple of the storage offset alignment) is non-zero
/// for the tensors of a weight slot, which share one buffer per layer.
/// `derived` remembers what the f16 matmuls derive from the contents (max|x|
/// and the f16 copy); clones and reshapes share it along with the contents.
#[derive(Clone)]
pub struct GpuTensor {
    pub(crate) buf: Arc<PooledBuffer>,
    pub(crate) offset: u64,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    pub(crate) derived: Arc<Derived>,
}

/// What the f16 matmuls derive from a tensor's contents, each remembered
/// with the buffer generation it was derived at: max|x| (on the device: a
/// word the absmax kernel found, or the partial maxima of the op that
/// stored the tensor, [`Max`]), and the f16 copy made under the scale that
/// max gives (`exec/f16_copy.rs`).
///
/// A tensor is scanned and copied once per value instead of once per
/// product that reads it. A stale max would scale an operand by the wrong
/// power of two, and a stale copy would be the wrong operand, without any
/// error, so validity is not left to the writers' care: every write into an
/// existing buffer notes it on the buffer ([`PooledBuffer::note_write`]:
/// `GpuExecutor::make_unique`, the one gate of the in-place ops, and the
/// weight reloads), and nothing derived at an older generation is ever
/// handed out. A write into a weight slot's buffer invalidates every tensor
/// over it, not only the one written — conservative, and correct.
#[derive(Default)]
pub(crate) struct Derived {
    max: Mutex<Option<(u64, Max)>>,
    half: Mutex<Option<(u64, GpuTensor)>>,
}

/// A remembered max|x|: one word (an absmax scan's, or a fold's), or the
/// partial maxima the op that stored the tensor left (max_bits words, in
/// ranges `(tensor, start, count)`), which the first f16 product that
/// reads the tensor folds: an output no product reads costs no fold.
#[derive(Clone)]
pub(crate) enum Max {
    Word(GpuTensor),
    Partials(Vec<(GpuTensor, usize, usize)>),
}

impl Derived {
    /// The remembered max of `t`'s contents, if it is current.
    pub(crate) fn max(t: &GpuTensor) -> Option<Max> {
        let g = t.buf.generation();
        match &*t.derived.max.lock().expect("derived cell poisoned") {
            Some((at, m)) if *at == g => Some(m.clone()),
            _ => None,
        }
    }

    /// Remembers `m` as `t`'s max, of its contents at `generation` (read
    /// before the scan or the producer was recorded).
    pub(crate) fn set_max(t: &GpuTensor, generation: u64, m: Max) {
        *t.derived.max.lock().expect("derived cell poisoned") = Some((generation, m));
    }

    /// The remembered f16 copy of `t`'s contents, if it is current. A stale
    /// one is dropped here, so that its memory goes back to the pool before
    /// a new copy is made.
    pub(crate) fn half(t: &GpuTensor) -> Option<GpuTensor> {
        let g = t.buf.generation();
        let mut cell = t.derived.half.lock().expect("derived cell poisoned");
        match &*cell {
            Some((at, copy)) if *at == g => Some(copy.clone()),
            _ => {
                *cell = None;
                None
            }
        }
    }

    /// Remembers `copy` as `t`'s f16 copy, made from its contents at
    /// `generation` (read before the copy was recorded).
    pub(crate) fn set_half(t: &GpuTensor, generation: u64, copy: GpuTensor) {
        *t.derived.half.lock().expect("derived cell poisoned") = Some((generation, copy));
    }
}

impl std::fmt::Debug for GpuTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuTensor({}, {})", self.shape, self.dtype)
    }
}

impl TensorHandle for GpuTensor {
    fn shape(&self) -> &Shape {
        &self.shape
    }

    fn dtype(&self) -> DType {
        self.dtype
    }
}

impl GpuTensor {
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    pub fn buffer(&self) -> &wgpu::Buffer {
        self.buf.buffer()
    }

    /// Where the tensor's first element lies in [`GpuTensor::buffer`].
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes the elements occupy (rounded up to whole u32 words).
    pub fn byte_len(&self) -> u64 {
        storage_bytes(self.dtype, self.shape.numel())
    }
}

pub fn storage_bytes(dtype: DType, numel: usize) -> u64 {
    ((numel * dtype.size_in_bytes()) as u64).div_ceil(4) * 4
}

/// Widens a tensor's stored bytes (little-endian f32, bf16 or f16) into
/// `out`, one element per slot of `out`.
pub(crate) fn widen_bytes(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    match dtype {
        DType::F32 => {
            let src = &bytes[..4 * n];
            match bytemuck::try_cast_slice::<u8, f32>(src) {
                Ok(v) => out.copy_from_slice(v),
                Err(_) => {
                    for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                }
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes[..2 * n].chunks_exact(2)) {
                *o = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes[..2 * n].chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
}
