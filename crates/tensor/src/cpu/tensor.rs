//! The tensor handle of the reference executors.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};

use crate::cpu::Real;
use crate::{DType, Error, HostData, HostSlice, HostTensor, MemoryStats, Result, Shape, TensorHandle};

/// A tensor's elements as the reference executors keep them: f32-stored
/// tensors widened to the compute type, bf16/f16 ones (the 16-bit transport
/// copies of weights) in their own 2 bytes, widened a panel or a row at a
/// time by the ops that read them, so that a layer's weights take in RAM
/// what they take on a GPU.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Store<F> {
    Wide(Vec<F>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

/// Applies a generic expression to whichever vector a [`Store`] holds and
/// wraps the result in the same variant (for data movement, which never
/// converts).
macro_rules! each_store {
    ($s:expr, $v:ident => $e:expr) => {
        match $s {
            Store::Wide($v) => Store::Wide($e),
            Store::BF16($v) => Store::BF16($e),
            Store::F16($v) => Store::F16($e),
        }
    };
}
pub(crate) use each_store;

impl<F> Store<F> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Store::Wide(v) => v.len(),
            Store::BF16(v) => v.len(),
            Store::F16(v) => v.len(),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            Store::Wide(_) => DType::F32,
            Store::BF16(_) => DType::BF16,
            Store::F16(_) => DType::F16,
        }
    }

    /// Bytes the elements occupy (capacity, as the allocator sees them).
    fn bytes(&self) -> u64 {
        let (cap, size) = match self {
            Store::Wide(v) => (v.capacity(), std::mem::size_of::<F>()),
            Store::BF16(v) => (v.capacity(), 2),
            Store::F16(v) => (v.capacity(), 2),
        };
        (cap * size) as u64
    }
}

/// A shape, the dtype the tensor is stored in, and its elements: f32-stored
/// ones widened to the compute type `F`, bf16/f16 ones as stored (read them
/// with [`CpuTensor::values`]). Widening is exact, so every op gives the
/// bits it would give on the widened tensor, and `download` gives back
/// what was uploaded.
#[derive(Debug, PartialEq)]
pub struct CpuTensor<F> {
    shape: Shape,
    store: Store<F>,
}

/// Bytes of every live reference-executor tensor in the process, and their
/// peak since the last reset: the executor's share of host memory, which
/// on the CPU executor is the same RAM as the tier's (the trainer reports
/// it as the "device" peak).
static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

fn track<F>(s: &Store<F>) {
    let b = s.bytes();
    let live = LIVE.fetch_add(b, Ordering::Relaxed) + b;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

fn untrack<F>(s: &Store<F>) {
    LIVE.fetch_sub(s.bytes(), Ordering::Relaxed);
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
        untrack(&self.store);
    }
}

impl<F: Clone> Clone for CpuTensor<F> {
    fn clone(&self) -> Self {
        CpuTensor::from_store(self.shape.clone(), self.store.clone())
    }
}

impl<F> CpuTensor<F> {
    /// A tensor over `store`, whose length the caller has matched to `shape`.
    pub(crate) fn from_store(shape: Shape, store: Store<F>) -> Self {
        debug_assert_eq!(shape.numel(), store.len());
        track(&store);
        CpuTensor { shape, store }
    }

    pub(crate) fn store(&self) -> &Store<F> {
        &self.store
    }

    pub(crate) fn store_mut(&mut self) -> &mut Store<F> {
        &mut self.store
    }

    /// Bytes the elements take in RAM: 4 (f32) or 8 (f64) per element of an
    /// f32-stored tensor, 2 per element of a bf16/f16 one.
    pub fn stored_bytes(&self) -> u64 {
        self.store.bytes()
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
        Ok(Self::from_store(shape, Store::Wide(data)))
    }

    pub(crate) fn new_unchecked(shape: Shape, data: Vec<F>) -> Self {
        Self::from_store(shape, Store::Wide(data))
    }

    pub fn from_host(t: &HostTensor) -> Self {
        let store = match t.data() {
            HostData::F32(v) => Store::Wide(v.iter().map(|&x| F::from_f32(x)).collect()),
            HostData::BF16(v) => Store::BF16(v.clone()),
            HostData::F16(v) => Store::F16(v.clone()),
        };
        Self::from_store(t.shape().clone(), store)
    }

    /// A tensor copied straight from borrowed host data, in its dtype.
    pub(crate) fn from_slice(op: &'static str, shape: &Shape, data: HostSlice<'_>) -> Result<Self> {
        if shape.numel() != data.len() {
            return Err(Error::shape(
                op,
                format!(
                    "shape {shape} holds {} elements, data has {}",
                    shape.numel(),
                    data.len()
                ),
            ));
        }
        let store = match data {
            HostSlice::F32(v) => Store::Wide(v.iter().map(|&x| F::from_f32(x)).collect()),
            HostSlice::BF16(v) => Store::BF16(v.to_vec()),
            HostSlice::F16(v) => Store::F16(v.to_vec()),
        };
        Ok(Self::from_store(shape.clone(), store))
    }

    /// Back to a host tensor in the stored dtype.
    pub fn to_host(&self) -> HostTensor {
        let data = match &self.store {
            Store::Wide(v) => HostData::F32(v.iter().map(|&x| x.narrow_f32()).collect()),
            Store::BF16(v) => HostData::BF16(v.clone()),
            Store::F16(v) => HostData::F16(v.clone()),
        };
        HostTensor::new(self.shape.clone(), data).expect("CpuTensor keeps shape and data in step")
    }

    /// The values of an f32-stored tensor, in the compute type.
    ///
    /// # Panics
    /// If the tensor is stored as bf16/f16: those have no widened copy to
    /// borrow; read them with [`CpuTensor::values`].
    pub fn data(&self) -> &[F] {
        match &self.store {
            Store::Wide(v) => v,
            s => panic!(
                "CpuTensor::data on a {} tensor {}: use values()",
                s.dtype(),
                self.shape
            ),
        }
    }

    /// Mutable [`CpuTensor::data`]; the same panic.
    pub fn data_mut(&mut self) -> &mut [F] {
        match &mut self.store {
            Store::Wide(v) => v,
            s => panic!("CpuTensor::data_mut on a {} tensor: use values()", s.dtype()),
        }
    }

    /// The values in the compute type, whatever the stored dtype (a widened
    /// copy for bf16/f16).
    pub fn values(&self) -> Cow<'_, [F]> {
        match &self.store {
            Store::Wide(v) => Cow::Borrowed(v),
            Store::BF16(v) => Cow::Owned(v.iter().map(|x| F::from_f32(x.to_f32())).collect()),
            Store::F16(v) => Cow::Owned(v.iter().map(|x| F::from_f32(x.to_f32())).collect()),
        }
    }

    pub fn into_vec(mut self) -> Vec<F> {
        untrack(&self.store);
        match std::mem::replace(&mut self.store, Store::Wide(Vec::new())) {
            Store::Wide(v) => v,
            packed => {
                // `self` now holds an empty, untracked store.
                let s = CpuTensor {
                    shape: self.shape.clone(),
                    store: packed,
                };
                track(&s.store);
                s.values().into_owned()
            }
        }
    }
}

impl<F> TensorHandle for CpuTensor<F> {
    fn shape(&self) -> &Shape {
        &self.shape
    }

    fn dtype(&self) -> DType {
        self.store.dtype()
    }
}
