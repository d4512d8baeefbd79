//! The ops' arguments and results beside the [`Executor`](crate::Executor)
//! trait: which operands a matmul reads transposed, which gradients a
//! backward must produce, and what each forward and backward returns.

use crate::{DType, Error, Result, RopeScaling, Shape};

/// Which matmul operands are read transposed. `a` is `[.., M, K]`, or
/// `[.., K, M]` when `a` is set; `b` is `[K, N]`, or `[N, K]` when `b` is set
/// (the `nn.Linear` weight layout `[out, in]` is `b` transposed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Transpose {
    pub a: bool,
    pub b: bool,
}

impl Transpose {
    pub const NN: Transpose = Transpose { a: false, b: false };
    pub const NT: Transpose = Transpose { a: false, b: true };
    pub const TN: Transpose = Transpose { a: true, b: false };
    pub const TT: Transpose = Transpose { a: true, b: true };
}

/// Which gradients a matmul backward must produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulNeeds {
    pub da: bool,
    pub db: bool,
    pub dbias: bool,
}

impl MatmulNeeds {
    pub const ALL: MatmulNeeds = MatmulNeeds {
        da: true,
        db: true,
        dbias: true,
    };
}

/// What [`Executor::matmul_backward_into`](crate::Executor::matmul_backward_into) needs of its accumulator: f32,
/// of `b`'s shape (every executor checks it with this).
pub fn check_db_acc(acc_shape: &Shape, acc_dtype: DType, b_shape: &Shape) -> Result<()> {
    const OP: &str = "matmul_backward_into";
    if acc_dtype != DType::F32 {
        return Err(Error::DType {
            op: OP,
            expected: DType::F32,
            got: acc_dtype,
        });
    }
    if acc_shape != b_shape {
        return Err(Error::shape(
            OP,
            format!("db_acc {acc_shape} must have b's shape {b_shape}"),
        ));
    }
    Ok(())
}

/// What [`Executor::matmul_backward_da_into`](crate::Executor::matmul_backward_da_into) needs of its accumulator:
/// f32, of `a`'s shape (every executor checks it with this).
pub fn check_da_acc(acc_shape: &Shape, acc_dtype: DType, a_shape: &Shape) -> Result<()> {
    const OP: &str = "matmul_backward_da_into";
    if acc_dtype != DType::F32 {
        return Err(Error::DType {
            op: OP,
            expected: DType::F32,
            got: acc_dtype,
        });
    }
    if acc_shape != a_shape {
        return Err(Error::shape(
            OP,
            format!("da_acc {acc_shape} must have a's shape {a_shape}"),
        ));
    }
    Ok(())
}

#[derive(Debug)]
pub struct MatmulGrads<T> {
    pub da: Option<T>,
    /// Same shape as `b`; summed over the batch when `b` was broadcast.
    pub db: Option<T>,
    /// `[N]`, summed over every row of the output.
    pub dbias: Option<T>,
}

/// Output of a norm forward: the normalised tensor and the per-row statistics
/// the backward needs (`mean` is `None` for RMSNorm).
#[derive(Debug)]
pub struct NormOut<T> {
    pub y: T,
    /// `[rows]`; `None` for RMSNorm.
    pub mean: Option<T>,
    /// `[rows]`: 1 / sqrt(var + eps) (or mean square + eps for RMSNorm).
    pub rstd: T,
}

/// Output of a residual add fused with the norm that follows it
/// ([`Executor::add_rmsnorm`](crate::Executor::add_rmsnorm), [`Executor::add_layernorm`](crate::Executor::add_layernorm)).
#[derive(Debug)]
pub struct AddNormOut<T> {
    /// The residual stream `x + r`, which flows on past the norm.
    pub h: T,
    /// The norm of `h`, with the statistics its backward needs.
    pub norm: NormOut<T>,
}

#[derive(Debug)]
pub struct NormGrads<T> {
    pub dx: T,
    pub dw: T,
    /// `None` for RMSNorm.
    pub db: Option<T>,
}

#[derive(Debug)]
pub struct AttentionOut<T> {
    /// `[B, T, Hq, D]`.
    pub out: T,
    /// `[B, Hq, T]`: log-sum-exp of each query row's scaled scores.
    pub lse: T,
}

#[derive(Debug)]
pub struct AttentionGrads<T> {
    pub dq: T,
    pub dk: T,
    pub dv: T,
}

#[derive(Debug)]
pub struct CrossEntropyOut<T> {
    /// `[N]`: −log p(target) per row, 0 where the target is ignored.
    pub losses: T,
    /// `[N, V]`: grad_scale · (softmax − onehot), zero rows where ignored.
    pub dlogits: T,
}

/// Rotary embedding parameters: half-split `rotate_half` layout over the full
/// head dimension, as Hugging Face Llama/Mistral/Qwen use it.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    /// Position of the first token of the sequence.
    pub offset: usize,
    pub scaling: RopeScaling,
}

impl Rope {
    /// Unscaled frequencies with base `theta`, from position `offset`.
    pub fn plain(theta: f64, offset: usize) -> Rope {
        Rope {
            theta,
            offset,
            scaling: RopeScaling::None,
        }
    }
}
