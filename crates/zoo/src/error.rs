use std::path::PathBuf;

/// Errors of the zoo. Each variant names the file, field or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum ZooError {
    #[error("{path}: {cause}")]
    Io { path: PathBuf, cause: std::io::Error },
    #[error("{path}: invalid JSON: {cause}")]
    Json { path: PathBuf, cause: serde_json::Error },
    #[error("{path}: unknown architecture '{name}' (supported: {supported})")]
    UnknownArchitecture {
        path: PathBuf,
        name: String,
        supported: &'static str,
    },
    #[error("{path}: missing field '{field}'")]
    MissingField { path: PathBuf, field: &'static str },
    #[error("{path}: field '{field}': {detail}")]
    BadField {
        path: PathBuf,
        field: String,
        detail: String,
    },
    #[error("{path}: unsupported: {detail}")]
    Unsupported { path: PathBuf, detail: String },
    #[error("{file}: invalid safetensors file: {detail}")]
    Safetensors { file: PathBuf, detail: String },
    #[error("{file}: missing tensor '{tensor}'")]
    MissingTensor { file: PathBuf, tensor: String },
    #[error("{file}: tensor '{tensor}' has shape {got:?}, config.json implies {expected:?}")]
    TensorShape {
        file: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("{file}: tensor '{tensor}' is stored as {got}; expected F32, BF16 or F16")]
    TensorDType {
        file: PathBuf,
        tensor: String,
        got: String,
    },
    #[error("{path}: tokenizer: {detail}")]
    Tokenizer { path: PathBuf, detail: String },
    #[error("character {ch:?} at position {pos} is not in the char vocabulary")]
    UnknownChar { ch: char, pos: usize },
    #[error("token id {id} at position {pos} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error("unknown preset '{name}' (known: {known})")]
    UnknownPreset { name: String, known: String },
    #[error("{op}: {detail}")]
    Invalid { op: &'static str, detail: String },
    #[error(transparent)]
    Tensor(#[from] megatrain_tensor::Error),
}

pub type Result<T, E = ZooError> = std::result::Result<T, E>;

impl ZooError {
    pub(crate) fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        ZooError::Io {
            path: path.into(),
            cause,
        }
    }

    pub(crate) fn invalid(op: &'static str, detail: impl Into<String>) -> Self {
        ZooError::Invalid {
            op,
            detail: detail.into(),
        }
    }
}
