//! megatrain-tensor: dtypes, shapes, host tensors, the [`Executor`] op
//! vocabulary, and [`CpuExecutor`], the reference semantics of every op.

pub mod convert;
mod dtype;
mod error;
mod executor;
mod host;
mod params;
mod shape;

pub use dtype::DType;
pub use error::{Error, Result};
pub use executor::*;
pub use host::{HostData, HostTensor};
pub use params::{ParamSpec, ParamTable};
pub use shape::Shape;
pub use half::{bf16, f16};
