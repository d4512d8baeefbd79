//! The tensor handle of the reference executors.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::cpu::Real;
use crate::{DType, Error, HostData, HostTensor, MemoryStats, Result, Shape, TensorHandle, convert};

/// A shape, the dtype the tensor is stored in, and its values widened to the
/// compute type `F`. Values of a bf16/f16 tensor are exactly representable
/// in that dtype, so `download` gives back what was uploaded.
#[derive(Debug, PartialEq)]
pub struct CpuTensor<F> {
    shape: Shape,
    dtype: DType,
    data: Vec<F>,
}

/// Bytes of every live reference-executor tensor in the process, and their
/// peak since the last reset: the executor's share of host memory, which
/// on the CPU executor is the same RAM as the tier's (the trainer reports
/// it as the "device" peak).
static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

fn data_bytes<F>(v: &Vec<F>) -> u64 {
    (v.capacity() * std::mem::size_of::<F>()) as u64
}

fn track<F>(v: &Vec<F>) {
    let b = data_bytes(v);
    let live = LIVE.fetch_add(b, Ordering::Relaxed) + b;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

fn untrack<F>(v: &Vec<F>) {
    LIVE.fetch_sub(data_bytes(v), Ordering::Relaxed);
}

/// Live and peak bytes of reference-executor tensors (process-wide).
pub(crate) fn memory_stats() -> MemoryStats {
    MemoryStats {
        live_bytes: LIVE.load(Ordering::Relaxed),
        peak_bytes: PEAK.load(Ordering::Relaxed),
    }
}

pub(crate) fn reset_peak_memory() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

impl<F> Drop for CpuTensor<F> {
    fn drop(&mut self) {
        untrack(&self.data);
    }
}

impl<F: Clone> Clone for CpuTensor<F> {
    fn clone(&self) -> Self {
        let data = self.data.clone();
        track(&data);
        CpuTensor {
            shape: self.shape.clone(),
            dtype: self.dtype,
            data,
        }
    }
}

impl<F: Real> CpuTensor<F> {
    /// An f32-stored tensor from compute values (e.g. f64 inputs of a
    /// finite-difference test).
    pub fn from_vec(shape: impl Into<Shape>, data: Vec<F>) -> Result<Self> {
        let shape = shape.into();
        if shape.numel() != data.len() {
            return Err(Error::shape(
                "CpuTensor::from_vec",
                format!(
                    "shape {shape} holds {} elements, data has {}",
                    shape.numel(),
                    data.len()
                ),
            ));
        }
        track(&data);
        Ok(CpuTensor {
            shape,
            dtype: DType::F32,
            data,
        })
    }

    pub(crate) fn new_unchecked(shape: Shape, data: Vec<F>) -> Self {
        debug_assert_eq!(shape.numel(), data.len());
        track(&data);
        CpuTensor {
            shape,
            dtype: DType::F32,
            data,
        }
    }

    pub(crate) fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    pub fn from_host(t: &HostTensor) -> Self {
        let data = match t.data() {
            HostData::F32(v) => v.iter().map(|&x| F::from_f32(x)).collect(),
            HostData::BF16(v) => v.iter().map(|&x| F::from_f32(x.to_f32())).collect(),
            HostData::F16(v) => v.iter().map(|&x| F::from_f32(x.to_f32())).collect(),
        };
        track(&data);
        CpuTensor {
            shape: t.shape().clone(),
            dtype: t.dtype(),
            data,
        }
    }

    /// Back to a host tensor in the stored dtype.
    pub fn to_host(&self) -> HostTensor {
        let f: Vec<f32> = self.data.iter().map(|&x| x.narrow_f32()).collect();
        let data = match self.dtype {
            DType::F32 => HostData::F32(f),
            DType::BF16 => HostData::BF16(convert::f32_to_bf16(&f)),
            DType::F16 => HostData::F16(convert::f32_to_f16(&f)),
        };
        HostTensor::new(self.shape.clone(), data).expect("CpuTensor keeps shape and data in step")
    }

    /// The values in the compute type.
    pub fn data(&self) -> &[F] {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut [F] {
        &mut self.data
    }

    pub fn into_vec(mut self) -> Vec<F> {
        untrack(&self.data);
        std::mem::take(&mut self.data)
    }
}

impl<F> TensorHandle for CpuTensor<F> {
    fn shape(&self) -> &Shape {
        &self.shape
    }

    fn dtype(&self) -> DType {
        self.dtype
    }
}
