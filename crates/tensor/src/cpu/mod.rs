//! The reference executor: every [`Executor`](crate::Executor) op in plain
//! Rust, generic over the compute type. [`CpuExecutor`] (f32) is the oracle
//! every other backend is tested against; [`F64Executor`] runs the same code
//! in f64 for finite-difference checks and high-precision references.
//! bf16/f16 tensors (weights' transport copies) stay 2 bytes per element;
//! the ops that read them widen a panel or a row at a time (`packed`).

mod add_norm;
mod exec;
mod f16_operands;
mod matmul;
mod packed;
mod real;
pub mod reference;
mod tensor;

pub use exec::{CpuExecutor, F64Executor, RefExecutor};
pub use real::Real;
pub use tensor::CpuTensor;
