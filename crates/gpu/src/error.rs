//! Errors of the GPU backend. They reach callers of [`megatrain_tensor::Executor`]
//! wrapped in `Error::Backend`.

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// `diagnosis` says what was checked (loader, driver manifests and
    /// libraries, container capabilities) and what to install or set.
    #[error("no GPU adapter found (wgpu enumerated none on any backend)\n{diagnosis}")]
    NoAdapter { diagnosis: String },
    #[error("MEGATRAIN_ADAPTER={wanted:?} matches none of the adapters: {available}")]
    AdapterNotFound { wanted: String, available: String },
    #[error("requesting a device on adapter '{adapter}' failed: {cause}")]
    RequestDevice {
        adapter: String,
        cause: wgpu::RequestDeviceError,
    },
    #[error("adapter '{adapter}' is too small for the kernels: {detail}")]
    Limits { adapter: String, detail: String },
    #[error("mapping a readback buffer failed: {0}")]
    Map(String),
    #[error("device poll failed: {0}")]
    Poll(String),
    #[error("{op}: {detail}")]
    Unsupported { op: &'static str, detail: String },
    /// The device refused a new buffer (a tensor's: after the free pool
    /// was given back to it).
    #[error(
        "out of device memory on '{adapter}': a {bytes}-byte {what} refused with {live} bytes held by tensors{of}{after}; a training run holds less keeping fewer blocks' activations (--keep-activations), with a smaller --batch or --seq-len, or fewer LM-head rows at once (--chunk-rows)"
    )]
    OutOfMemory {
        adapter: String,
        /// What the buffer was for ("buffer" for a tensor's).
        what: &'static str,
        bytes: u64,
        live: u64,
        /// ", of N on the device", where the device reports its memory.
        of: String,
        /// What was given back before the last try, if anything.
        after: String,
    },
    /// The device refused a buffer of the layer transport (memory the host
    /// maps: upload staging, gradient readback).
    #[error(
        "out of memory for the layer transport: a {bytes}-byte {what} refused; fewer gradient chunks at once (--chunks-in-flight, --optimizer-queue) or smaller ones (--transfer-chunk) hold less"
    )]
    TransportOutOfMemory { what: &'static str, bytes: u64 },
    #[error("MEGATRAIN_LAVAPIPE_COOP=1, but adapter '{adapter}' is not one it applies to: {detail}")]
    LavapipeCoop { adapter: String, detail: String },
    #[error("{var}={value:?} names none of its settings: expected {expected}")]
    Env {
        var: &'static str,
        value: String,
        expected: String,
    },
}

impl From<GpuError> for megatrain_tensor::Error {
    fn from(e: GpuError) -> Self {
        megatrain_tensor::Error::Backend(Box::new(e))
    }
}
