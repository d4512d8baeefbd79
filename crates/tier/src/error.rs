//! Typed errors of the tier. Every variant that concerns a file or a tensor
//! names it, so the trainer can report it without adding context.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("{}: {cause}", path.display())]
    Io { path: PathBuf, cause: std::io::Error },
    /// The filesystem is full (ENOSPC), a quota is exhausted (EDQUOT) or a
    /// file-size limit was hit (EFBIG), writing or preallocating `path`.
    #[error(
        "{}: {cause}: the disk is full (or a file-size limit was hit); free space on it or put \
         --out on a larger disk (a larger --host-budget spills less)",
        path.display()
    )]
    DiskFull { path: PathBuf, cause: std::io::Error },
    /// The memory filesystem a machine's ranks share their transport
    /// copies in has no room for them.
    #[error(
        "{}: {cause}: no room for the {needed} bytes of transport copies this machine's ranks \
         share; enlarge that filesystem (a container's /dev/shm is often 64 MiB: `docker run \
         --shm-size`) or give another with --shm-dir",
        path.display()
    )]
    SharedFull {
        path: PathBuf,
        needed: u64,
        cause: std::io::Error,
    },
    #[error("{}: shared transport copies: {detail}", path.display())]
    Shared { path: PathBuf, detail: String },
    #[error("{}: spill file has {got} bytes, expected {expected}", path.display())]
    SpillLength { path: PathBuf, expected: u64, got: u64 },
    #[error("spill window: {0}")]
    Spill(String),
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
    #[error("{got} checkpoint file tables for a tier of {layers} layers")]
    FileTables { got: usize, layers: usize },
    #[error("layer {layer}: the checkpoint file's tensors cover {file} elements, the layer has {table}")]
    FileTable { layer: usize, file: usize, table: usize },
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
    /// Bringing a sharded layer whole to the rank that saves it failed.
    #[error("gathering layer {layer} for the checkpoint: {detail}")]
    Gather { layer: usize, detail: String },
    #[error("{}: invalid checkpoint metadata: {detail}", file.display())]
    Meta { file: PathBuf, detail: String },
    /// A checkpoint refused because a value it would hold is NaN or
    /// infinite: a run whose update went non-finite keeps its last good
    /// checkpoint current instead of saving (and then rotating to) this one.
    #[error(
        "{}: not saved: tensor '{tensor}' holds {value} at element {index} (a diverged update: try a lower learning rate or gradient clipping; or a model that held it from the start)",
        dir.display()
    )]
    NonFinite {
        dir: PathBuf,
        tensor: String,
        index: usize,
        value: f32,
    },
    /// The tier kept its transport copies alone (a forward-only tier).
    #[error("{what}: the tier keeps only its transport copies (for forwards), not its fp32 parameters")]
    TransportOnly { what: &'static str },
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

/// Whether an I/O error means "no room": ENOSPC, EDQUOT or EFBIG.
pub fn is_disk_full(e: &std::io::Error) -> bool {
    if matches!(
        e.kind(),
        std::io::ErrorKind::StorageFull
            | std::io::ErrorKind::QuotaExceeded
            | std::io::ErrorKind::FileTooLarge
    ) {
        return true;
    }
    #[cfg(unix)]
    if let Some(code) = e.raw_os_error() {
        return [libc::ENOSPC, libc::EDQUOT, libc::EFBIG].contains(&code);
    }
    false
}

impl TierError {
    /// An I/O error about `path`, as [`TierError::DiskFull`] when it is one.
    pub fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        let path = path.into();
        if is_disk_full(&cause) {
            TierError::DiskFull { path, cause }
        } else {
            TierError::Io { path, cause }
        }
    }

    pub fn is_disk_full(&self) -> bool {
        matches!(self, TierError::DiskFull { .. })
    }
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|cause| TierError::io(path, cause))
    }
}
