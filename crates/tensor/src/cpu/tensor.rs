//! The tensor handle of the reference executors.

use crate::cpu::Real;
use crate::{DType, Error, HostData, HostTensor, Result, Shape, TensorHandle, convert};

/// A shape, the dtype the tensor is stored in, and its values widened to the
/// compute type `F`. Values of a bf16/f16 tensor are exactly representable
/// in that dtype, so `download` gives back what was uploaded.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor<F> {
    shape: Shape,
    dtype: DType,
    data: Vec<F>,
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
        Ok(CpuTensor {
            shape,
            dtype: DType::F32,
            data,
        })
    }

    pub(crate) fn new_unchecked(shape: Shape, data: Vec<F>) -> Self {
        debug_assert_eq!(shape.numel(), data.len());
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

    pub fn into_vec(self) -> Vec<F> {
        self.data
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
