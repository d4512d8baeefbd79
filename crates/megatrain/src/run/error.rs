use std::path::PathBuf;

use megatrain_tier::TierError;
use megatrain_zoo::ZooError;

use crate::data::DataError;
use crate::trainer::TrainError;

/// Everything a command can refuse or fail with; each names its input.
///
/// Every message in the workspace's errors is whole: a variant that quotes
/// the error it wraps does not also return it as `source()`, so the
/// binary's `{:#}`, which prints the chain, says it once.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Zoo(#[from] ZooError),
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error(transparent)]
    Tensor(#[from] megatrain_tensor::Error),
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
    #[error("{path}: {cause}")]
    Io { path: PathBuf, cause: std::io::Error },
    #[error("{path}: {detail}")]
    File { path: PathBuf, detail: String },
    /// A bad option: its name, the value given and why it is refused.
    #[error("--{name} {value}: {detail}")]
    Option {
        name: String,
        value: String,
        detail: String,
    },
    #[error("{0}")]
    Config(String),
}

impl RunError {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> RunError {
        let path = path.into();
        move |cause| RunError::Io { path, cause }
    }

    pub fn file(path: impl Into<PathBuf>, detail: impl Into<String>) -> RunError {
        RunError::File {
            path: path.into(),
            detail: detail.into(),
        }
    }

    pub fn option(name: &str, value: impl std::fmt::Display, detail: impl Into<String>) -> RunError {
        RunError::Option {
            name: name.to_string(),
            value: value.to_string(),
            detail: detail.into(),
        }
    }
}

pub type Result<T, E = RunError> = std::result::Result<T, E>;
