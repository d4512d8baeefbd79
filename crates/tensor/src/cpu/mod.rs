//! The reference executor: every [`Executor`](crate::Executor) op in plain
//! Rust, generic over the compute type. [`CpuExecutor`] (f32) is the oracle
//! every other backend is tested against; [`F64Executor`] runs the same code
//! in f64 for finite-difference checks and high-precision references.

mod add_norm;
mod exec;
mod f16_operands;
mod packed;
mod real;
pub mod reference;
mod tensor;

pub use exec::{CpuExecutor, F64Executor, RefExecutor};
pub use real::Real;
pub use tensor::CpuTensor;
