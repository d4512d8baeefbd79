//! Host tensors: a shape and a typed, owned buffer.

use half::{bf16, f16};

use crate::{DType, Error, Result, Shape, convert};

#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

impl HostData {
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::BF16(_) => DType::BF16,
            HostData::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::BF16(v) => v.len(),
            HostData::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostData::F32(v) => bytemuck::cast_slice(v),
            HostData::BF16(v) => bytemuck::cast_slice(v),
            HostData::F16(v) => bytemuck::cast_slice(v),
        }
    }
}

/// Borrowed host data of one of the storage types.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HostSlice<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

impl HostSlice<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            HostSlice::F32(_) => DType::F32,
            HostSlice::BF16(_) => DType::BF16,
            HostSlice::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostSlice::F32(v) => v.len(),
            HostSlice::BF16(v) => v.len(),
            HostSlice::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostSlice::F32(v) => bytemuck::cast_slice(v),
            HostSlice::BF16(v) => bytemuck::cast_slice(v),
            HostSlice::F16(v) => bytemuck::cast_slice(v),
        }
    }

    /// An owned copy in the same dtype.
    pub fn to_host_data(&self) -> HostData {
        match self {
            HostSlice::F32(v) => HostData::F32(v.to_vec()),
            HostSlice::BF16(v) => HostData::BF16(v.to_vec()),
            HostSlice::F16(v) => HostData::F16(v.to_vec()),
        }
    }

    /// Writes the values widened to f32 into `out` (same length).
    pub fn widen_into(&self, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.len());
        match self {
            HostSlice::F32(v) => out.copy_from_slice(v),
            HostSlice::BF16(v) => out.iter_mut().zip(v.iter()).for_each(|(o, x)| *o = x.to_f32()),
            HostSlice::F16(v) => out.iter_mut().zip(v.iter()).for_each(|(o, x)| *o = x.to_f32()),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    shape: Shape,
    data: HostData,
}

impl HostTensor {
    pub fn new(shape: impl Into<Shape>, data: HostData) -> Result<Self> {
        let shape = shape.into();
        if shape.numel() != data.len() {
            return Err(Error::shape(
                "HostTensor::new",
                format!(
                    "shape {shape} holds {} elements, data has {}",
                    shape.numel(),
                    data.len()
                ),
            ));
        }
        Ok(HostTensor { shape, data })
    }

    pub fn from_f32(shape: impl Into<Shape>, data: Vec<f32>) -> Result<Self> {
        Self::new(shape, HostData::F32(data))
    }

    pub fn zeros(shape: impl Into<Shape>) -> Self {
        let shape = shape.into();
        let data = HostData::F32(vec![0.0; shape.numel()]);
        HostTensor { shape, data }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    pub fn data(&self) -> &HostData {
        &self.data
    }

    pub fn into_data(self) -> HostData {
        self.data
    }

    /// The f32 buffer, or an error naming the dtype it actually holds.
    pub fn as_f32(&self) -> Result<&[f32]> {
        match &self.data {
            HostData::F32(v) => Ok(v),
            other => Err(Error::DType {
                op: "HostTensor::as_f32",
                expected: DType::F32,
                got: other.dtype(),
            }),
        }
    }

    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        match &mut self.data {
            HostData::F32(v) => Ok(v),
            other => Err(Error::DType {
                op: "HostTensor::as_f32_mut",
                expected: DType::F32,
                got: other.dtype(),
            }),
        }
    }

    /// Values widened to f32 whatever the storage type.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            HostData::F32(v) => v.clone(),
            HostData::BF16(v) => convert::bf16_to_f32(v),
            HostData::F16(v) => convert::f16_to_f32(v),
        }
    }

    /// The same values stored as `dtype` (round to nearest even when narrowing).
    pub fn to_dtype(&self, dtype: DType) -> HostTensor {
        if dtype == self.dtype() {
            return self.clone();
        }
        let f = self.to_f32_vec();
        let data = match dtype {
            DType::F32 => HostData::F32(f),
            DType::BF16 => HostData::BF16(convert::f32_to_bf16(&f)),
            DType::F16 => HostData::F16(convert::f32_to_f16(&f)),
        };
        HostTensor {
            shape: self.shape.clone(),
            data,
        }
    }

    /// Same data, new shape of equal element count.
    pub fn reshape(self, shape: impl Into<Shape>) -> Result<Self> {
        Self::new(shape, self.data)
    }
}
