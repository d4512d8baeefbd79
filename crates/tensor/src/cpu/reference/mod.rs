//! Reference kernels, generic over the scalar type ([`Real`](crate::cpu::Real):
//! f32 or f64), on plain row-major slices. Sizes come in as arguments and
//! are asserted: callers that take sizes from user input validate them first
//! (the [`RefExecutor`](crate::cpu::RefExecutor) does, returning
//! [`Error::Shape`](crate::Error::Shape)). Data-dependent failures (token
//! ids, targets) are returned as errors.

mod activation;
mod attention;
mod attention_sinks;
mod conv1d;
mod delta_gates;
mod delta_rule;
mod embedding;
mod layout;
mod loss;
mod matmul;
mod norm;
mod rope;

pub use activation::{
    geglu, geglu_backward, gelu, gelu_backward, gelu_erf, gelu_erf_backward, sigmoid_mul,
    sigmoid_mul_backward, softcap, softcap_backward, swiglu, swiglu_backward, swiglu_clamped,
    swiglu_clamped_backward,
};
pub use attention::{AttnDims, attention, attention_backward, attention_cached};
pub use attention_sinks::{attention_sinks, attention_sinks_backward};
pub use conv1d::{causal_conv1d_silu, causal_conv1d_silu_backward};
pub use delta_gates::{delta_gates, delta_gates_backward};
pub use delta_rule::{DeltaRuleIn, gated_delta_rule, gated_delta_rule_backward, gated_delta_rule_cached};
pub(crate) use embedding::check_ids;
pub use embedding::{embedding, embedding_backward};
pub use layout::{concat_last, slice_rows, split_last, write_rows};
pub use loss::{CeRows, cross_entropy};
pub use matmul::{MatmulDims, add_bias, bias_grad, matmul, matmul_backward};
pub(crate) use matmul::{Strides, a_strides, gemm, matmul_da, matmul_db, matmul_db_acc};
pub use norm::{
    add_layernorm, add_layernorm_backward, add_rmsnorm, add_rmsnorm_backward, layernorm, layernorm_backward,
    rmsnorm, rmsnorm_backward,
};
pub use rope::{rope, rope_tables, rope_tables_for};
