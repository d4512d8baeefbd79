use crate::DType;

/// Errors of the tensor layer. Backends wrap their own failures in `Backend`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op}: shape mismatch: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op}: expected dtype {expected}, got {got}")]
    DType {
        op: &'static str,
        expected: DType,
        got: DType,
    },
    #[error("unknown dtype '{0}' (expected f32, bf16 or f16)")]
    UnknownDType(String),
    #[error("{op}: token id {id} at position {pos} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        op: &'static str,
        id: u32,
        pos: usize,
        vocab: usize,
    },
    #[error("{op}: invalid argument: {detail}")]
    Invalid { op: &'static str, detail: String },
    #[error("backend: {0}")]
    Backend(Box<dyn std::error::Error + Send + Sync>),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Shape {
            op,
            detail: detail.into(),
        }
    }

    pub fn invalid(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Invalid {
            op,
            detail: detail.into(),
        }
    }
}
