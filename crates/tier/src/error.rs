//! Typed errors of the tier. Every variant that concerns a file or a tensor
//! names it, so the trainer can report it without adding context.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "tier needs {needed} bytes of RAM but the budget is {budget} bytes ({detail}); \
         raise the budget or give a spill directory"
    )]
    BudgetExceeded {
        needed: u64,
        budget: u64,
        detail: String,
    },
    #[error("transport copies alone need {needed} bytes of RAM, over the budget of {budget} bytes")]
    TransportOverBudget { needed: u64, budget: u64 },
    #[error("parameter '{name}' appears in layer {first} and layer {second}; names must be unique")]
    DuplicateParam {
        name: String,
        first: usize,
        second: usize,
    },
    #[error("layer {layer} has no parameter named '{name}'")]
    UnknownParam { layer: usize, name: String },
    #[error("layer index {index} out of range (the tier has {len} layers)")]
    LayerOutOfRange { index: usize, len: usize },
    #[error("{}: tensor '{tensor}' is missing", file.display())]
    MissingTensor { file: PathBuf, tensor: String },
    #[error("{}: tensor '{tensor}' is not part of this model", file.display())]
    UnexpectedTensor { file: PathBuf, tensor: String },
    #[error("{}: tensor '{tensor}' has shape {got:?}, expected {expected:?}", file.display())]
    WrongShape {
        file: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("{}: tensor '{tensor}' has dtype {got}, expected {expected}", file.display())]
    WrongDType {
        file: PathBuf,
        tensor: String,
        expected: String,
        got: String,
    },
    #[error("{}: corrupt or truncated{}: {detail}", file.display(), tensor_suffix(tensor))]
    Corrupt {
        file: PathBuf,
        tensor: Option<String>,
        detail: String,
    },
    #[error("{}: cannot write safetensors: {detail}", file.display())]
    Serialize { file: PathBuf, detail: String },
    #[error("{}: invalid checkpoint metadata: {detail}", file.display())]
    Meta { file: PathBuf, detail: String },
}

fn tensor_suffix(t: &Option<String>) -> String {
    match t {
        Some(t) => format!(" (tensor '{t}')"),
        None => String::new(),
    }
}

pub type Result<T, E = TierError> = std::result::Result<T, E>;

/// Attaches a path to an I/O error.
pub(crate) trait IoContext<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|source| TierError::Io {
            path: path.into(),
            source,
        })
    }
}
