//! megatrain-tensor: dtypes, shapes, host tensors, the [`Executor`] op
//! vocabulary, and [`CpuExecutor`], the reference semantics of every op.

mod compose;
pub mod convert;
pub mod cpu;
mod docs;
mod dropout;
mod dtype;
mod error;
mod executor;
mod host;
mod mapped;
mod op_types;
mod params;
mod precision;
mod rope_scaling;
mod shape;
pub mod testing;
mod transport;

pub use compose::*;
pub use cpu::{CpuExecutor, CpuTensor, F64Executor};
pub use docs::Docs;
pub use dropout::{Dropout, MAX_DROPOUT, Noise, dropout_layout, mix64};
pub use dtype::DType;
pub use error::{Error, Result};
pub use executor::*;
pub use half::{bf16, f16};
pub use host::{HostData, HostSlice, HostTensor};
pub use mapped::release_mapped;
pub use op_types::*;
pub use params::{ParamSpec, ParamTable};
pub use precision::{
    ComputePrecision, F16_OPERAND_BOUND_LOG2, f16_scale_exponent, mul_pow2, pow2, round_f16_scaled,
};
pub use rope_scaling::RopeScaling;
pub use shape::Shape;
pub use transport::{
    Download, HostRegistration, Landed, LandedF32, TransportInfo, TransportStats, WeightSlot, WeightUpload,
};
